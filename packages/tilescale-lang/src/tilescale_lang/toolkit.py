"""The CUDA toolkit that compiles TileScale kernels: where it is, its version, how to compile
with it, and which TileScale features it lacks.

The toolkit is the one TileLang compiles with: ``$CUDA_HOME`` (else TileLang's own detection,
``tilelang.env.CUDA_HOME``). Two layouts work:

* a full toolkit with ``bin/nvcc`` (``/usr/local/cuda``, or the ``nvidia-cuda-nvcc`` 13.x
  wheels' ``nvidia/cu13`` tree): :meth:`Toolkit.compile` runs nvcc the way TileLang does;
* a compiler-driver-less toolkit, as the registry's CUDA 12.1/12.2 wheels give it (their
  ``nvidia-cuda-nvcc-cu12`` has ``ptxas`` but no ``nvcc``): ``lib/libnvrtc.so*`` and
  ``bin/ptxas``; :meth:`Toolkit.compile` runs NVRTC (through ``cuda.bindings.nvrtc``, whose
  major version must match) and then ptxas.

A feature that needs a newer toolkit than the one found is rejected when a kernel that uses it
is compiled (``tilelang.compile``), before nvcc runs, with a :class:`ToolkitFeatureError`
naming the feature, the version it needs and the toolkit found (:func:`check_features`).
"""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = ["FEATURES", "Toolkit", "ToolkitFeatureError", "check_features", "find_toolkit"]

#: TileScale device helpers that need a minimum toolkit: ``helper -> ((major, minor), what)``.
FEATURES = {
    "tilescale::multimem_tma_store": ((13, 1), "T.multimem_tma_store (PTX multimem.cp.async.bulk, the multimem bulk store)"),
    "tilescale::multimem_ld_reduce_x2<tilescale::MMOp::ADD": (
        (12, 2), "T.multimem_ld_reduce ADD of float16/bfloat16 pairs (PTX multimem.ld_reduce .acc::f32)"),
}


class ToolkitFeatureError(RuntimeError):
    """A kernel uses a feature that the CUDA toolkit found cannot compile."""


def _version_from_nvcc(nvcc: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _version_from_header(home: Path) -> tuple[int, int] | None:
    header = home / "include" / "cuda.h"
    if not header.is_file():
        return None
    m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", header.read_text(errors="replace"))
    if not m:
        return None
    v = int(m.group(1))
    return v // 1000, v % 1000 // 10


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit: ``home`` (the CUDA_HOME directory), ``version`` ``(major, minor)``,
    ``nvcc`` (path, or None when the toolkit has none) and ``ptxas`` (path or None)."""

    home: str
    version: tuple[int, int]
    nvcc: str | None
    ptxas: str | None

    @property
    def compiler(self) -> str:
        """``"nvcc"`` or ``"nvrtc"`` (no nvcc: NVRTC + ptxas)."""
        return "nvcc" if self.nvcc else "nvrtc"

    def __str__(self) -> str:
        return f"CUDA {self.version[0]}.{self.version[1]} at {self.home} ({self.compiler})"

    def include_dirs(self) -> list[str]:
        """The toolkit's header directories (``include`` and, in the 13.x wheel layout,
        ``include/cccl``)."""
        dirs = [os.path.join(self.home, "include")]
        cccl = os.path.join(self.home, "include", "cccl")
        return dirs + ([cccl] if os.path.isdir(cccl) else [])

    def compile(self, source: str, workdir: str | os.PathLike, output: str = "ptx", arch: str = "sm_90a",
                options: Iterable[str] = (), ptxas_verbose: bool = False) -> tuple[Path, str, float]:
        """Compile generated CUDA ``source`` for ``arch`` the way TileLang compiles TileScale
        kernels (TileLang's options plus :func:`tilescale_lang.headers.compile_flags`).

        Args:
            source: CUDA C++ (e.g. :func:`tilescale_lang.codegen.cuda_source`).
            workdir: directory for the ``.cu`` and the output.
            output: ``"ptx"`` or ``"cubin"``.
            arch: ``sm_XY`` or ``sm_XYa``.
            options: extra compiler options (``-D...``).
            ptxas_verbose: pass ``-v`` to ptxas (register counts appear in the log).

        Returns:
            ``(output path, compiler log, seconds)``. Raises ``RuntimeError`` with the log when
            the compile fails.
        """
        from tilelang.contrib.nvcc import default_compile_options

        from . import headers

        if output not in ("ptx", "cubin"):
            raise ValueError(f"output must be 'ptx' or 'cubin', got {output!r}")
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        cu, out = work / "kernel.cu", work / f"kernel.{output}"
        cu.write_text(source)
        opts = default_compile_options(headers.compile_flags() + list(options))
        start = time.perf_counter()
        if self.nvcc:
            cmd = [self.nvcc, f"-{output}", f"-arch={arch}", *opts, "-w", "-o", str(out), str(cu)]
            if ptxas_verbose:
                cmd[1:1] = ["-Xptxas", "-v"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"nvcc failed ({self}):\n{res.stderr[-6000:]}")
            return out, res.stdout + res.stderr, time.perf_counter() - start
        ptx = self._nvrtc_ptx(source, arch, opts)
        ptx_path = work / "kernel.ptx"
        ptx_path.write_bytes(ptx)
        log = ""
        if output == "cubin":
            if not self.ptxas:
                raise RuntimeError(f"{self} has no bin/ptxas to assemble a cubin")
            cmd = [self.ptxas, f"-arch={arch}", *(["-v"] if ptxas_verbose else []), "-o", str(out), str(ptx_path)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"ptxas failed ({self}):\n{res.stderr[-6000:]}")
            log = res.stdout + res.stderr
        return out, log, time.perf_counter() - start

    def _nvrtc_ptx(self, source: str, arch: str, opts: list[str]) -> bytes:
        from tilelang.contrib import nvrtc

        m = re.fullmatch(r"sm_(\d+)a?", arch)
        if not m:
            raise ValueError(f"arch must look like sm_90a, got {arch!r}")
        found = nvrtc.get_nvrtc_version()
        if found[:2] != tuple(self.version):
            raise RuntimeError(f"cuda.bindings loads NVRTC {found[0]}.{found[1]}, but the toolkit is {self}; "
                               "put the toolkit's lib directory first on LD_LIBRARY_PATH")
        keep = [o for o in opts if o.startswith(("-I", "-D", "-std"))]
        keep += [f"-I{d}" for d in self.include_dirs()]
        # verbose: a failed compile raises with NVRTC's log in the message
        return bytes(nvrtc.compile_cuda(source, "ptx", int(m.group(1)), keep, verbose=True)).rstrip(b"\0")


def _home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home:
        try:
            from tilelang.env import CUDA_HOME as home
        except ImportError:
            home = None
    return home or None


@functools.lru_cache(maxsize=8)
def _toolkit_at(home: str) -> Toolkit | None:
    root = Path(home)
    nvcc = root / "bin" / "nvcc"
    ptxas = root / "bin" / "ptxas"
    version = _version_from_nvcc(str(nvcc)) if nvcc.exists() else None
    version = version or _version_from_header(root)
    if version is None:
        return None
    if not nvcc.exists() and not glob.glob(str(root / "lib" / "libnvrtc.so*")):
        return None
    return Toolkit(str(root), version, str(nvcc) if nvcc.exists() else None, str(ptxas) if ptxas.exists() else None)


def find_toolkit() -> Toolkit | None:
    """The toolkit at ``$CUDA_HOME`` (else TileLang's ``CUDA_HOME``), or None when there is
    none with a known version and a compiler."""
    home = _home()
    return _toolkit_at(home) if home and os.path.isdir(home) else None


def check_features(helpers: Iterable[str], toolkit: Toolkit | None = None) -> None:
    """Raise :class:`ToolkitFeatureError` when one of the ``tilescale::`` ``helpers`` a kernel
    calls needs a newer toolkit than ``toolkit`` (default :func:`find_toolkit`). Without a
    known toolkit nothing is rejected here (the headers' ``static_assert`` still is)."""
    needed = [(name, FEATURES[key]) for name in helpers for key in FEATURES if name.startswith(key)]
    if not needed:
        return
    toolkit = find_toolkit() if toolkit is None else toolkit
    if toolkit is None:
        return
    for name, (minimum, what) in needed:
        if tuple(toolkit.version) < minimum:
            raise ToolkitFeatureError(
                f"{what} needs CUDA Toolkit {minimum[0]}.{minimum[1]} or newer, but the toolkit that "
                f"compiles this kernel is CUDA {toolkit.version[0]}.{toolkit.version[1]} ({toolkit.home}); "
                f"set CUDA_HOME to a CUDA {minimum[0]}.{minimum[1]}+ toolkit or do not use it"
            )
