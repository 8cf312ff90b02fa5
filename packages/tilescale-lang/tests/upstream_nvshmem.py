"""Upstream TileScale's NVSHMEM example programs, kept verbatim under
``data/upstream_nvshmem/<name>.py.txt`` (a four-line ``#`` header names the upstream file and
commit), and their kernel factories for the CPU tests.

:func:`program` gives a program's text without the header (byte for byte upstream's file);
:func:`factories` executes only the program's kernel-factory functions (top-level functions
that define a ``@T.prim_func``), their source registered with :mod:`linecache` so that
TileLang's parser can read it, in a namespace with upstream's ``T``, ``tilelang`` and
``dtype_map``.
"""

from __future__ import annotations

import ast
import linecache
from pathlib import Path

DATA = Path(__file__).parent / "data" / "upstream_nvshmem"
HEADER_LINES = 4
#: The upstream commit the programs were copied from (tile-ai/tilescale).
COMMIT = "4704282a16fd0e7ff2c2c13f87772b42e4dc6163"
#: Every program of issue 45's table of NVSHMEM-path examples.
PROGRAMS = (
    "example_allgather", "example_all_to_all", "example_allgather_gemm", "example_cannon", "example_summa",
    "example_pre_attn_all2all", "example_pre_attn_all2all_transpose", "example_post_attn_all2all_transpose",
    "example_simple_shift", "example_overlapping_allgather",
)


def header(name: str) -> list[str]:
    """The header lines of program ``name``'s data file."""
    return (DATA / f"{name}.py.txt").read_text(encoding="utf-8").splitlines()[:HEADER_LINES]


def program(name: str) -> str:
    """Upstream's ``examples/distributed/<name>.py``, unmodified."""
    text = (DATA / f"{name}.py.txt").read_text(encoding="utf-8")
    return "".join(text.splitlines(keepends=True)[HEADER_LINES:])


class _TorchDtypes(dict):
    """Upstream's ``dtype_map`` where tilescale-host (which provides it) is not installed: a
    dtype name to its torch dtype (``"s8"`` / ``"s32"``: int8 / int32), looked up in torch."""

    def __missing__(self, name: str):
        import torch

        return {"s8": torch.int8, "s32": torch.int32}.get(name) or getattr(torch, name)


def _defines_prim_func(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(inner, ast.FunctionDef) and any(ast.unparse(d) == "T.prim_func" for d in inner.decorator_list)
        for inner in node.body
    )


def factories(name: str) -> dict:
    """Program ``name``'s kernel factories, by function name, defined from upstream's source."""
    import tilelang
    import tilelang.language as T

    try:
        from tilelang.distributed import dtype_map
    except ImportError:  # tilescale-lang installed alone: tilescale-host's dtype_map is absent
        dtype_map = _TorchDtypes()
    source = program(name)
    filename = str(DATA / f"{name}.py")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    keep = [node for node in ast.parse(source).body if _defines_prim_func(node)]
    namespace = {"T": T, "tilelang": tilelang, "dtype_map": dtype_map}
    # dont_inherit: upstream's files have no ``from __future__ import annotations`` (this one
    # has), and TileLang evaluates the kernels' annotations.
    code = compile(ast.Module(body=keep, type_ignores=[]), filename, "exec", dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - test data
    return {node.name: namespace[node.name] for node in keep}
