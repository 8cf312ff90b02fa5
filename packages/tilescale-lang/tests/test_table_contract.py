"""The device header's table capacity is tilescale_core.table's (CPU; parses common.cuh)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tilescale_core import table

import tilescale_lang
from tilescale_lang import metadata, validation

HEADER = Path(tilescale_lang.__file__).parent / "include" / "tilescale" / "common.cuh"


def test_header_capacity_matches_core():
    text = HEADER.read_text(encoding="utf-8")
    found = re.findall(r"^\s*#define\s+TILESCALE_MAX_TABLE\s+(\d+)\s*$", text, flags=re.M)
    assert found == [str(table.MAX_TABLE_ENTRIES)], f"{HEADER}: TILESCALE_MAX_TABLE {found} != tilescale_core.table"
    assert "meta_data[TILESCALE_MAX_TABLE]" in text


def test_lang_uses_core_table():
    assert metadata.MAX_TABLE_ENTRIES == validation.TABLE_ENTRIES == table.MAX_TABLE_ENTRIES
    assert metadata.table_from_allocator is table.table_from_allocator
    assert validation.MAX_PE == table.MAX_RANKS - 1


def test_lang_cuda_calls_raise_the_core_error():
    import tilescale_core

    class _Status(int):
        name = "CUDA_ERROR_NOT_FOUND"

    with pytest.raises(tilescale_core.CudaError) as info:
        metadata._check((_Status(500), None, None), "cuModuleGetGlobal(meta_data)")
    assert (info.value.call, info.value.code) == ("cuModuleGetGlobal(meta_data)", 500)


def test_lang_imports_no_private_core_module():
    private = re.compile(r"tilescale_core\._|from tilescale_core import _")
    for path in Path(tilescale_lang.__file__).parent.rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not private.search(line.split("#", 1)[0]), f"{path}:{n}: {line.strip()}"
