"""The ``tl.shared_memory.*`` FFI: every spec name registered, argument types enforced, bindings route through it."""

from __future__ import annotations

import importlib

import pytest
import torch
import tvm_ffi

from tilescale_core import shared_memory as sm

# The spec's tables, transcribed independently of the implementation.
SPEC = {
    "create_ipc_handle": (("int64",), "Bytes"),
    "open_ipc_handle": (("Bytes",), "int64"),
    "close_ipc_handle": (("int64",), "void"),
    "sync_ipc_handles": (("int64", "int64", "int64", "Bytes"), "void"),
    "vmm_malloc": (("int64",), "int64"),
    "vmm_free": (("int64",), "void"),
    "create_vmm_handle": (("int64",), "Bytes"),
    "open_vmm_handle": (("Bytes",), "int64"),
    "close_vmm_handle": (("int64",), "void"),
    "sync_vmm_handles": (("int64", "int64", "int64", "Bytes"), "void"),
    "supports_vmm_fabric": ((), "bool"),
    "supports_multicast": ((), "bool"),
    "mc_create": (("int64", "int64"), "int64"),
    "mc_export_handle": (("int64",), "Bytes"),
    "mc_import_handle": (("Bytes",), "int64"),
    "mc_add_device": (("int64", "int64"), "void"),
    "mc_bind_mem": (("int64", "int64", "int64"), "void"),
    "mc_map": (("int64", "int64", "int64"), "int64"),
    "mc_release_handle": (("int64",), "void"),
    "mc_unmap": (("int64", "int64", "int64"), "void"),
    "mc_get_aligned_size": (("int64", "int64"), "int64"),
}

BINDINGS = [
    "_create_ipc_handle", "_open_ipc_handle", "_close_ipc_handle", "_sync_ipc_handles",
    "_vmm_malloc", "_vmm_free", "_create_vmm_handle", "_open_vmm_handle", "_close_vmm_handle",
    "_sync_vmm_handles", "_supports_vmm_fabric", "_supports_multicast", "_mc_create",
    "_mc_export_handle", "_mc_import_handle", "_mc_add_device", "_mc_bind_mem", "_mc_map",
    "_mc_release_handle", "_mc_unmap", "_mc_get_aligned_size",
]


def sample(kind):
    return {"int64": 7, "Bytes": b"\x01" * 64, "bool": True, "void": None}[kind]


def wrong(kind):
    return {"int64": b"\x07", "Bytes": 7}[kind]


@pytest.mark.parametrize("name", sorted(SPEC))
def test_registered_with_spec_signature(name):
    assert tvm_ffi.get_global_func("tl.shared_memory." + name, allow_missing=True) is not None
    params, ret = sm.SIGNATURES[name]
    assert (tuple(kind for _, kind in params), ret) == SPEC[name]


def test_no_extra_names():
    assert set(sm.SIGNATURES) == set(SPEC)


@pytest.mark.parametrize("name", BINDINGS)
def test_binding_exported(name):
    import tilelang.distributed.shared_memory as facade

    assert callable(getattr(facade, name)) and getattr(facade, name) is getattr(sm, name)


def test_registration_is_idempotent():
    before = tvm_ffi.get_global_func("tl.shared_memory.vmm_malloc")
    sm.register()
    importlib.reload(sm)  # re-registers over the earlier entries without error
    sm.register()
    assert tvm_ffi.get_global_func("tl.shared_memory.vmm_malloc") is not None
    assert before is not None


@pytest.mark.parametrize("name", [n for n, (p, _) in SPEC.items() if p])
def test_argument_types_are_enforced(name):
    fn = tvm_ffi.get_global_func("tl.shared_memory." + name)
    params, _ = SPEC[name]
    for i, kind in enumerate(params):
        args = [sample(k) for k in params]
        args[i] = wrong(kind)
        with pytest.raises(TypeError, match=f"tl.shared_memory.{name}"):
            fn(*args)
    with pytest.raises(TypeError, match="takes"):
        fn(*[sample(k) for k in params], 1)


def test_int64_range_is_enforced():
    with pytest.raises(TypeError, match="int64"):
        tvm_ffi.get_global_func("tl.shared_memory.vmm_free")(True)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_calls_route_through_ffi_with_checked_types(name, monkeypatch):
    """Replace each implementation: the binding must reach it through the FFI, results typed."""
    params, ret = SPEC[name]
    seen = []

    def fake(*args):
        seen.append(args)
        return sample(ret) if ret != "bool" else False

    monkeypatch.setitem(sm._IMPLS, name, fake)
    monkeypatch.setattr(sm, "_registered", False)
    sm.register()
    try:
        binding = getattr(sm, "_" + name)
        if name.startswith("sync_"):
            result = binding(1, [0, 1, 2], 4096, [b"a", b"bb", b"ccc"])
            assert seen == [(1, 3, 4096, sm.pack_handles([b"a", b"bb", b"ccc"]))]
        else:
            result = binding(*[sample(k) for k in params])
            assert seen == [tuple(sample(k) for k in params)]
        expected = {"int64": 7, "Bytes": b"\x01" * 64, "bool": False, "void": None}[ret]
        assert result == expected and type(result) is type(expected)
    finally:
        monkeypatch.undo()
        sm._registered = False
        sm.register()


def test_bad_return_type_is_caught(monkeypatch):
    monkeypatch.setitem(sm._IMPLS, "vmm_malloc", lambda size: "not an int")
    monkeypatch.setattr(sm, "_registered", False)
    sm.register()
    try:
        with pytest.raises(TypeError, match="return value"):
            sm._vmm_malloc(4096)
    finally:
        monkeypatch.undo()
        sm._registered = False
        sm.register()


def test_pack_unpack_handles():
    handles = [b"", b"x" * 64, b"yz"]
    packed = sm.pack_handles(handles)
    assert sm.unpack_handles(packed, 3) == handles
    with pytest.raises(ValueError, match="num_ranks=2"):
        sm.unpack_handles(packed, 2)
    with pytest.raises(ValueError, match="truncated"):
        sm.unpack_handles(packed[:-1], 3)
    with pytest.raises(TypeError):
        sm.pack_handles(["str"])


def test_sync_checks_rank_and_table_before_cuda():
    fn = tvm_ffi.get_global_func("tl.shared_memory.sync_ipc_handles")
    with pytest.raises(ValueError, match="outside"):
        fn(3, 2, 4096, sm.pack_handles([b"a", b"b"]))
    with pytest.raises(ValueError, match="null"):
        fn(0, 2, 0, sm.pack_handles([b"a", b"b"]))


def test_vmm_handle_encoding_round_trip_and_rejections():
    from tilescale_core import _vmm

    data = _vmm.encode_handle(_vmm.FABRIC, 2 << 20, b"\x05" * 64)
    assert _vmm.decode_handle(data) == (_vmm.FABRIC, 2 << 20, b"\x05" * 64)
    with pytest.raises(ValueError, match="too short"):
        _vmm.decode_handle(b"abc")
    with pytest.raises(ValueError, match="bad magic"):
        _vmm.decode_handle(b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="payload"):
        _vmm.decode_handle(data[:-1])
    import os, struct

    foreign = _vmm.encode_handle(_vmm.POSIX_FD, 4096, struct.pack("<qq", os.getpid() + 1, 5))
    with pytest.raises(ValueError, match="cannot travel as bytes"):
        _vmm.import_handle(foreign, 0)


def test_unknown_vmm_pointer_is_rejected():
    with pytest.raises(ValueError, match="not a VMM mapping"):
        sm._vmm_free(0x1234)
    with pytest.raises(ValueError, match="not a VMM mapping"):
        sm._create_vmm_handle(0x1234)


def test_ipc_handle_size_checked():
    with pytest.raises(ValueError, match="64 bytes"):
        sm._open_ipc_handle(b"short")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_calls_fail_clearly_without_gpu():
    with pytest.raises(RuntimeError, match="cudaMalloc|cudaGetDevice|driver"):
        sm._vmm_malloc(4096)
