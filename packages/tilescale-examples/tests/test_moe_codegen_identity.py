"""The MoE kernels' generated CUDA is byte-identical to a recorded baseline.

``tests/data/moe_cuda_sha256.json`` holds the sha256 of the CUDA source that TileLang generates
(``tilelang.lower``, on the CPU, no nvcc) for each kernel configuration in :data:`CONFIGS`:
both dispatch paths (the small and the large batch are run-time branches of one kernel, so
every dispatch configuration holds both), with and without profiling, the combine, both
dtypes and index dtypes, 256/512/1024 threads, and expert counts, top-k values and hidden sizes
that change what the builders unroll (``E`` of 8 to 256: one to eight experts per lane in the
plan's scans; rows of one to 29 parts of 32 16-byte vectors, one not a multiple of 32 vectors).
The hashes hold for the TileLang version recorded with them; under another the test skips.

A refactor of :mod:`tilescale_examples.moe` that must not change the kernels runs this test
before and after. A change that is meant to change the generated code (or a TileLang upgrade)
regenerates the file::

    cd packages/tilescale-examples/tests && python test_moe_codegen_identity.py

(``--dump DIR`` also writes each source to ``DIR/<name>.cu`` for a diff.)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

import examples_helpers  # (sets CUDA_HOME before TileLang is imported)
import tilelang

DATA = Path(__file__).parent / "data" / "moe_cuda_sha256.json"
#: The target the hashes are recorded for (the examples' default target).
TARGET = {"kind": "cuda", "arch": "sm_90a"}

#: name -> (builder, keyword arguments). The first dispatch and the first combine row are the
#: dispatcher's defaults (what ``MoEDispatcher(num_experts=64, hidden=7168, topk=8,
#: max_tokens=4096)`` builds on a 132-SM GPU); the others are what the tests, the profiled
#: dispatch and the benchmarks build, plus the edges of what the builders unroll.
CONFIGS = {
    "dispatch-e64-k8-h7168-t4096-bf16-i64-b132": (
        "dispatch", dict(num_experts=64, topk=8, hidden=7168, max_tokens=4096, blocks=132)),
    "dispatch-e64-k8-h7168-t4096-bf16-i64-b132-profiled": (
        "dispatch", dict(num_experts=64, topk=8, hidden=7168, max_tokens=4096, blocks=132, profile=True)),
    "dispatch-e64-k8-h7168-t4096-bf16-i64-b132-th512": (
        "dispatch", dict(num_experts=64, topk=8, hidden=7168, max_tokens=4096, blocks=132, threads=512)),
    "dispatch-e64-k8-h7176-t128-bf16-i64-b2": (
        "dispatch", dict(num_experts=64, topk=8, hidden=7176, max_tokens=128, blocks=2)),
    "dispatch-e8-k2-h64-t16-f16-i32-b128": (
        "dispatch", dict(num_experts=8, topk=2, hidden=64, max_tokens=16, dtype="float16", index_dtype="int32",
                         blocks=128)),
    "dispatch-e8-k2-h64-t16-f16-i32-b128-profiled": (
        "dispatch", dict(num_experts=8, topk=2, hidden=64, max_tokens=16, dtype="float16", index_dtype="int32",
                         blocks=128, profile=True)),
    "dispatch-e256-k8-h7168-t4096-bf16-i32-b132": (
        "dispatch", dict(num_experts=256, topk=8, hidden=7168, max_tokens=4096, index_dtype="int32", blocks=132)),
    "dispatch-e48-k1-h2048-t512-f16-i64-b78-th256": (
        "dispatch", dict(num_experts=48, topk=1, hidden=2048, max_tokens=512, dtype="float16", blocks=78,
                         threads=256)),
    "combine-e64-k8-h7168-t4096-bf16-b132": (
        "combine", dict(num_experts=64, topk=8, hidden=7168, max_tokens=4096, blocks=132)),
    "combine-e64-k8-h7168-t4096-bf16-b132-th512": (
        "combine", dict(num_experts=64, topk=8, hidden=7168, max_tokens=4096, blocks=132, threads=512)),
    "combine-e64-k8-h7176-t128-bf16-b2": (
        "combine", dict(num_experts=64, topk=8, hidden=7176, max_tokens=128, blocks=2)),
    "combine-e8-k2-h64-t16-f16-b128": (
        "combine", dict(num_experts=8, topk=2, hidden=64, max_tokens=16, dtype="float16", blocks=128)),
    "combine-e256-k8-h7168-t4096-f16-b132": (
        "combine", dict(num_experts=256, topk=8, hidden=7168, max_tokens=4096, dtype="float16", blocks=132)),
    "combine-e48-k1-h2048-t512-bf16-b78-th256": (
        "combine", dict(num_experts=48, topk=1, hidden=2048, max_tokens=512, blocks=78, threads=256)),
}


def generate(name: str) -> str:
    """The CUDA source of configuration ``name``, lowered with the kernel's own pass configs."""
    from tilescale_examples.moe import kernels

    builder, kwargs = CONFIGS[name]
    func = (kernels.build_dispatch_kernel if builder == "dispatch" else kernels.build_combine_kernel)(**kwargs)
    return examples_helpers.lower_with(func, dict(func.attrs["tilelang_pass_configs"]))


def sha256(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _recorded() -> dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


def test_the_recorded_configurations_are_the_ones_checked():
    data = _recorded()
    assert sorted(data["sha256"]) == sorted(CONFIGS), "regenerate tests/data/moe_cuda_sha256.json (module docstring)"
    assert data["target"] == TARGET


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generated_cuda_is_byte_identical_to_the_recorded_baseline(name, tmp_path):
    data = _recorded()
    if data["tilelang"] != tilelang.__version__:
        pytest.skip(f"hashes recorded with tilelang {data['tilelang']}, this is {tilelang.__version__}")
    source = generate(name)
    if sha256(source) != data["sha256"][name]:
        dump = tmp_path / f"{name}.cu"
        dump.write_text(source)
        pytest.fail(f"the generated CUDA of {name} changed (now in {dump}); if that is intended, regenerate "
                    "tests/data/moe_cuda_sha256.json (see this module's docstring)")


def main(argv) -> None:
    dump = Path(argv[argv.index("--dump") + 1]) if "--dump" in argv else None
    hashes = {}
    for name in CONFIGS:
        source = generate(name)
        hashes[name] = sha256(source)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{name}.cu").write_text(source)
        print(name, hashes[name], flush=True)
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps({"tilelang": tilelang.__version__, "target": TARGET, "sha256": hashes},
                               indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
