"""The package's public surface: the product classes from the top, the subpackages, the old
module paths of 0.1.0 forwarding to the new ones, and a benchmark list that names every module."""

import importlib
import pkgutil

import pytest

import tilescale_examples
from tilescale_examples import benchmarks
from tilescale_examples._moved import MovedModuleWarning

#: 0.1.0 module path -> where it lives now.
MOVED = {
    "collective": "base", "allgather": "collectives.allgather", "alltoall": "collectives.alltoall",
    "reducescatter": "collectives.reducescatter", "allreduce": "collectives.allreduce",
    "put_exchange": "collectives.put_exchange", "reduce_engine": "collectives.reduce_engine",
    "ag_gemm": "overlap.ag_gemm", "gemm_rs": "overlap.gemm_rs", "gemm": "overlap.gemm",
    "stream_ops": "overlap.stream_ops", "moe_kernels": "moe.kernels", "ring_put": "tutorials.ring_put",
    "tma_allreduce": "tutorials.tma_allreduce", "emulated": "testing.emulated",
    "precompile": "testing.precompile", "report": "benchmarks._report",
}


@pytest.mark.parametrize("name", tilescale_examples.__all__)
def test_product_classes_import_from_the_top(name):
    cls = getattr(tilescale_examples, name)
    assert isinstance(cls, type) and cls.__name__ == name
    assert cls.__module__.startswith("tilescale_examples.") and cls.__doc__


@pytest.mark.parametrize("sub", ["collectives", "overlap", "moe", "decode"])
def test_subpackages_export_their_classes(sub):
    pkg = importlib.import_module(f"tilescale_examples.{sub}")
    for name in pkg.__all__:
        assert getattr(pkg, name) is not None


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_module_paths_forward_and_warn(old, new):
    import sys

    sys.modules.pop(f"tilescale_examples.{old}", None)
    with pytest.warns(MovedModuleWarning, match=rf"tilescale_examples\.{old} moved to tilescale_examples\.{new}"):
        forwarded = importlib.import_module(f"tilescale_examples.{old}")
    assert forwarded is importlib.import_module(f"tilescale_examples.{new}")


def test_old_moe_path_still_has_its_public_names():
    from tilescale_examples import moe
    from tilescale_examples.moe import dispatcher

    for name in dispatcher.__all__:
        assert getattr(moe, name) is getattr(dispatcher, name)


def test_benchmark_list_names_every_benchmark_module():
    present = {m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.name.startswith("_")}
    assert set(benchmarks.BENCHMARKS) == present, (set(benchmarks.BENCHMARKS) ^ present)
    assert len(set(benchmarks.BENCHMARKS)) == len(benchmarks.BENCHMARKS)
