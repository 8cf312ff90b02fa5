"""Running pieces of the device headers on the host (the ``*_host`` tests): the host C++
compiler, a header definition taken as it ships, and one compile-and-run of a harness.

A module of its own, with a name no other package's tests use, so that one pytest run can
collect every package's tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import tilescale_lang

#: The TileScale device headers.
INCLUDE = Path(tilescale_lang.__file__).parent / "include" / "tilescale"
#: The host C++ compiler, or None.
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
#: Tests that compile a harness with the host compiler.
needs_host_compiler = pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler on PATH")


def header_definition(header: str, start: str) -> str:
    """The definition in ``INCLUDE / header`` that begins with the text ``start`` (its template
    line and signature up to the opening parenthesis, as the header spells them), through its
    closing brace at the start of a line."""
    text = (INCLUDE / header).read_text(encoding="utf-8")
    first = text.index(start)
    return text[first:text.index("\n}\n", first) + 3]


def build_and_run(tmp_path, name: str, source: str) -> str:
    """Compile ``source`` (C++17) with the host compiler and run it; its standard output. The
    build and the run must both succeed."""
    cpp = tmp_path / f"{name}.cpp"
    cpp.write_text(source, encoding="utf-8")
    exe = tmp_path / name
    build = subprocess.run([COMPILER, "-std=c++17", "-O1", "-Wno-unknown-pragmas", str(cpp), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
