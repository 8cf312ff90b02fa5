"""``python -m tilescale_core.doctor``: what this machine offers TileScale, and whether the heap works.

Prints package versions, the CUDA driver and toolkit, the visible GPUs, and for each memory
path (CUDA IPC, VMM fabric, VMM file descriptor, multicast) whether its probe passes and,
if not, why.  On a GPU machine it also builds a 2-rank heap on each usable path (two
processes over gloo; they share GPUs when there are fewer than two) and round-trips a
tensor through it.  Other installed TileScale wheels add sections through the entry-point
group :data:`SECTIONS_GROUP` (tilescale-host: topology and a process-group check): each entry
point names a callable returning ``[(title, lines)]``, run in its declared ``order`` (see
``tilescale_core._bootstrap.load_ordered``).  Exit status: 0, or 1 when a heap round-trip
failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable

from . import probes

__all__ = ["SECTIONS_GROUP", "main", "memory_path_lines", "roundtrip_rank", "sections"]

#: Entry-point group of the callables ``sections() -> [(title, lines)]`` that other wheels add.
SECTIONS_GROUP = "tilescale.doctor_sections"

Section = tuple[str, list[str]]

_THIRD_PARTY = ("tilelang", "torch", "cuda-python", "cuda-bindings", "apache-tvm-ffi", "nvidia-ml-py")
#: What an absent optional package would be for (said instead of a bare ``not installed``).
_OPTIONAL = {
    "cuda-python": "optional: TileScale calls CUDA through cuda-bindings",
    "nvidia-ml-py": "needed only by tilescale-host, for its NVLink topology queries",
}


def package_lines() -> list[str]:
    """One ``name version`` line per installed tilescale-* distribution and key dependency."""
    names = sorted(
        {d.metadata["Name"] for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower().startswith("tilescale")}
    )
    lines = []
    for name in [*names, *_THIRD_PARTY]:
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            why = _OPTIONAL.get(name)
            lines.append(f"{name}: not installed" + (f" ({why})" if why else ""))
    lines.append(f"python {sys.version.split()[0]} ({sys.executable})")
    return lines


def _nvcc_version() -> str:
    candidates = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    for nvcc in filter(None, candidates):
        if not os.path.exists(nvcc):
            continue
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{nvcc}: failed to run ({exc})"
        release = [line for line in out.splitlines() if "release" in line]
        return f"{nvcc}: {release[-1].strip() if release else out.strip()[:80]}"
    return "not found (no nvcc on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)"


def cuda_lines() -> list[str]:
    """Driver probe, toolkit (nvcc) and torch's CUDA build."""
    import torch

    driver = probes.probe_driver()
    return [
        f"driver: {driver.reason}",
        f"toolkit: {_nvcc_version()}",
        f"torch CUDA build: {torch.version.cuda}, torch.cuda.is_available(): {torch.cuda.is_available()}",
    ]


def gpu_lines() -> list[str]:
    """One line per visible GPU, or a plain statement that there is none."""
    import torch

    if not torch.cuda.is_available():
        driver = probes.probe_driver()
        why = "" if driver.ok else " (see driver above)"
        return [f"no GPU on this machine{why}; GPU checks are skipped"]
    lines = [f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
    return lines


_PATH_PROBES = (
    ("CUDA IPC", probes.probe_cuda_ipc),
    ("VMM fabric", probes.probe_vmm_fabric),
    ("VMM file descriptor", probes.probe_vmm_fd),
    ("multicast", probes.probe_multicast),
)


def memory_path_lines() -> list[str]:
    """``<path>: available`` or ``<path>: unavailable: <reason>`` for each memory path; one
    line for them all when the driver probe fails (``driver:`` of :func:`cuda_lines` says why)."""
    if not probes.probe_driver():
        return [", ".join(label for label, _ in _PATH_PROBES) + ": unavailable (they need a CUDA driver "
                "that sees a GPU: see driver above)"]
    lines = []
    for label, probe in _PATH_PROBES:
        result = probe()
        lines.append(f"{label}: " + ("available" if result.ok else f"unavailable: {result.reason}"))
    return lines


def roundtrip_rank(rank: int, world_size: int, use_vmm: bool, numel: int = 1 << 20) -> str:
    """Rank body: build a heap, write ``rank + 1`` everywhere in this rank's tensor, read all peers.

    Ranks use GPU ``rank % device_count`` (they share GPUs when there are fewer GPUs than
    ranks).  Returns the allocator's path.
    """
    import torch
    import torch.distributed as dist

    import tilescale_core
    from tilescale_core.multiprocess import rank_device

    torch.cuda.set_device(rank_device(rank))
    allocator = tilescale_core.get_allocator(
        size=64 << 20, local_rank=rank, num_local_ranks=world_size, group=dist.group.WORLD, use_vmm=use_vmm
    )
    with allocator:
        views = tilescale_core.tensor((numel,), "float32", allocator=allocator, return_peers=True)
        views[rank].fill_(rank + 1)
        torch.cuda.synchronize()
        dist.barrier()
        for r, view in enumerate(views):
            if not bool(torch.all(view == r + 1)):
                raise AssertionError(f"rank {rank} read wrong data through rank {r}'s view")
        torch.cuda.synchronize()
        dist.barrier()
        return allocator.path


def heap_lines() -> tuple[list[str], bool]:
    """Run the 2-rank round-trip on each usable path; return the lines and whether all passed."""
    import torch

    if not torch.cuda.is_available():
        return ["skipped: no GPU on this machine"], True
    from .multiprocess import run_ranks

    plans = [("CUDA IPC", False, probes.probe_driver())]
    plans.append(("VMM", True, probes.probe_vmm_fabric() or probes.probe_vmm_fd()))
    lines, ok = [], True
    for label, use_vmm, probe in plans:
        if not probe:
            lines.append(f"{label}: skipped ({probe.reason})")
            continue
        start = time.perf_counter()
        try:
            paths = run_ranks(roundtrip_rank, 2, args=(use_vmm,), timeout=120)
        except Exception as exc:
            ok = False
            lines.append(f"{label}: FAILED: {type(exc).__name__}: {str(exc).strip()[-2000:]}")
            continue
        lines.append(f"{label}: 2-rank heap round-trip passed on path {paths[0]!r} ({time.perf_counter() - start:.1f} s)")
    return lines, ok


def extension_sections(eps=None) -> list[Section]:
    """The sections of every entry point in :data:`SECTIONS_GROUP` (or ``eps``), in their
    declared order; one that fails to load or raises becomes a section saying so."""
    from ._bootstrap import load_ordered

    if eps is None:
        eps = importlib.metadata.entry_points(group=SECTIONS_GROUP)
    out: list[Section] = []

    def failed(ep, exc, what="could not be loaded"):
        out.append((ep.name, [f"{ep.value} {what}: {type(exc).__name__}: {exc}"]))

    for ep, fn in load_ordered(eps, failed):
        try:
            out.extend(fn())
        except Exception as exc:
            failed(ep, exc, "failed")
    return out


def sections() -> tuple[list[Section], bool]:
    """Every report section as ``(title, lines)``, and whether all checks that ran passed."""
    heap, ok = heap_lines()
    out = [
        ("Packages", package_lines()),
        ("CUDA", cuda_lines()),
        ("GPUs", gpu_lines()),
        ("Memory paths", memory_path_lines()),
        ("Symmetric heap round-trip (2 ranks, gloo)", heap),
    ]
    return out + extension_sections(), ok


def render(report: Iterable[Section]) -> str:
    """Format sections as text."""
    chunks = []
    for title, lines in report:
        chunks.append(f"== {title} ==\n" + "\n".join(f"  {line}" for line in lines))
    return "\n\n".join(chunks)


def main() -> int:
    """Print the report; return the exit status."""
    report, ok = sections()
    print(render(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
