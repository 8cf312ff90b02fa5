"""The lean launcher (tilescale_lang.lean): launch metadata of a compiled kernel (fresh or from
the disk cache), the checks made once at ``prepare`` and cheaply per call, and the packed
parameters of each call -- byte for byte what the full packing of the same arguments gives --
through a recording driver (CPU). GPU tests (``gpu``): the same bits as TileLang's launcher
over 1000 calls, on a side stream and captured in a CUDA graph.

The kernels are test_aot's: ``build_scale`` (a symbolic row count, a grid over it, a float
scalar) and ``build_put_signal`` (a TileScale kernel reading the heap table, a uint64 epoch)."""

import ctypes
import json
from types import SimpleNamespace

import pytest
import torch
from lang_helpers import TARGET, FakeAllocator, needs_nvcc

from tilescale_lang import lean, lean_describe, lean_driver
from tilescale_lang.aot import launch_info
from tilescale_lang.aot.packing import ArgPacker

import test_aot  # noqa: E402  (its kernel factories)
from test_aot import bundle_dir  # noqa: E402,F401  (a fixture: the bundle of test_aot's kernels)


class Named:
    def __init__(self, name_hint):
        self.name_hint = name_hint


class FakeCudaTensor:
    """A CPU tensor that says it lives on cuda:``index`` (what the launcher reads of a tensor)."""

    is_cuda = True

    def __init__(self, tensor, index=0):
        self.t, self.index = tensor, index
        self.dtype, self.shape = tensor.dtype, tensor.shape
        self.device = f"cuda:{index}"

    def data_ptr(self):
        return self.t.data_ptr()

    def stride(self):
        return self.t.stride()

    def is_contiguous(self):
        return self.t.is_contiguous()

    def get_device(self):
        return self.index


def fake(*shape, dtype=torch.float32, index=0):
    return FakeCudaTensor(torch.zeros(*shape, dtype=dtype), index)


class RecordingDriver:
    """Stands for the driver's launch entry points: records every launch's grid, block, shared
    memory, stream and the bytes of each parameter (read through the ``void*`` array, as the
    driver does)."""

    def __init__(self, sizes):
        self.sizes, self.launches = sizes, []

    def launch(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params):
        n = len(self.sizes[fn])
        ptrs = (ctypes.c_void_p * n).from_address(params)
        raw = [ctypes.string_at(ptrs[i], size) for i, size in enumerate(self.sizes[fn])]
        self.launches.append({"fn": fn, "dims": (gx, gy, gz, bx, by, bz), "smem": smem, "stream": stream, "raw": raw})
        return 0


@pytest.fixture(scope="module")
def scale_kernel():
    import tilelang

    return tilelang.compile(test_aot.build_scale.get_tir(n=256), target=TARGET)


@pytest.fixture(scope="module")
def put_kernel():
    import tilelang

    return tilelang.compile(test_aot.build_put_signal(), target=TARGET)


def _go_lean(launch, monkeypatch, path="ctypes"):
    """Make ``launch`` take its lean path on this machine with a recording driver: functions
    0x1000, 0x1001, ...; ``path`` "ctypes" (each launch a ctypes call of the driver) or
    "records" (the launch records' C helper, compiled here, calling the recording driver
    through C function pointers)."""
    launch._functions = [0x1000 + i for i in range(len(launch._launches))]
    launch.why_not = None
    rec = RecordingDriver({0x1000 + i: [ctypes.sizeof(v) for v in entry[4]] for i, entry in enumerate(launch._launches)})
    monkeypatch.setattr(lean, "_driver_calls", lambda: (rec.launch, rec.launch))
    monkeypatch.setattr(lean, "_current_stream_getter", lambda: lambda index: 1234)
    rec.capturing = False  # what the capture query answers
    rec.query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(
        lambda stream, status: status.__setitem__(0, int(rec.capturing)) or 0)
    monkeypatch.setattr(lean, "_capture_query_address", lambda: ctypes.cast(rec.query, ctypes.c_void_p).value)
    if path == "records":
        entry = (lean_driver._LAUNCH(lambda fn, *rest: rec.launch(fn, *rest[:-1])),
                 lean_driver._COOPERATIVE_LAUNCH(rec.launch))
        rec.keep = entry  # the C function pointers live as long as the recorder
        monkeypatch.setattr(lean, "_driver_addresses", lambda: tuple(ctypes.cast(f, ctypes.c_void_p).value for f in entry))
        launch._records = launch._make_records()
        assert launch._records is not None, "the launch records' C helper could not be made"
    return rec


@pytest.fixture(params=["ctypes", "records"])
def driver_path(request, tmp_path, monkeypatch):
    """Both ways the lean launcher reaches the driver (the records' helper compiled afresh
    into a temporary cache, or none: ctypes)."""
    from tilescale_lang import launch_records

    if request.param == "ctypes":
        monkeypatch.setattr(launch_records, "_helper", False)  # decided: no helper
    else:
        import shutil

        if shutil.which("cc") is None:
            pytest.skip("the launch records' helper needs a C compiler (cc)")
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(launch_records, "_helper", None)
        monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    return request.param


def _full_packing(kernel, args):
    info = lean.describe_kernel(kernel)
    packer = ArgPacker({"id": info["id"], "params": info["params"], "dynamic_vars": info["dynamic_vars"],
                        "archs": {"x": {"launches": info["launches"]}}}, "x")
    return packer.pack(*args)


@needs_nvcc
def test_describe_fresh_and_cached_kernels_alike(scale_kernel):
    fresh = lean.describe_kernel(scale_kernel)
    cached = SimpleNamespace(prim_func=scale_kernel.prim_func, target=scale_kernel.target, artifact=None,
                             pass_configs=scale_kernel.pass_configs)  # what a disk-cache load keeps
    assert lean.describe_kernel(cached) == fresh
    assert fresh["unsupported"] is None
    assert [p["name"] for p in fresh["params"]] == ["a", "b", "scale"]
    (launch,) = fresh["launches"]
    assert launch["block"] == [128, 1, 1] and isinstance(launch["grid"][0], str)  # ceildiv(m, 4)
    with pytest.raises(ValueError, match="names no CUDA arch"):
        lean.describe_kernel(SimpleNamespace(prim_func=scale_kernel.prim_func, target={"kind": "cuda"}, artifact=None))


@needs_nvcc
def test_launch_metadata_is_kept_per_kernel_and_per_machine(scale_kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))

    def cached():  # a kernel as a disk-cache load gives it: a new object, the same PrimFunc
        return SimpleNamespace(prim_func=scale_kernel.prim_func, target=scale_kernel.target,
                               pass_configs=scale_kernel.pass_configs)

    first = cached()
    info = lean.describe_kernel(first)
    (kept,) = (tmp_path / "tilescale-launch").glob("*.json")
    lowered = []
    monkeypatch.setattr(launch_info, "lower", lambda *a: lowered.append(a))
    assert lean.describe_kernel(first) is info  # kept on the kernel
    assert lean.describe_kernel(cached()) == info and lowered == []  # read back from the machine's cache
    kept.write_text("{not json", encoding="utf-8")
    monkeypatch.undo()
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    assert lean.describe_kernel(cached()) == info  # a damaged file: lowered again, and rewritten
    assert json.loads(kept.read_text(encoding="utf-8")) == info


@needs_nvcc
def test_unknown_launch_attributes_take_tilelangs_path():
    art = launch_info.lower(test_aot.build_put_signal(), TARGET["arch"])
    assert lean_describe._unsupported(art.device_mod) is None
    fn = next(iter(art.device_mod.functions.values()))
    odd = SimpleNamespace(functions={Named("k"): fn.with_attr("tl.use_pdl", True)})
    assert "tl.use_pdl" in lean_describe._unsupported(odd)


@needs_nvcc
def test_each_call_packs_what_the_full_packing_gives(scale_kernel, monkeypatch, driver_path):
    a, b = fake(10, 256), fake(10, 256)
    launch = lean.prepare(scale_kernel, (a, b, 1.5), changing=("a", "b", "scale"))
    assert not launch.lean and launch.changing == ("a", "b", "scale")
    rec = _go_lean(launch, monkeypatch, driver_path)
    for scale in (1.5, -3.25, 0.0):
        a2, b2 = fake(10, 256), fake(10, 256)
        launch(a2, b2, scale)
        (want,) = _full_packing(scale_kernel, (a2, b2, scale))
        got = rec.launches[-1]
        assert got["raw"] == want.raw()
        assert got["dims"] == want.grid + want.block and got["dims"][0] == 3  # ceildiv(10, 4)
        assert got["stream"] == 1234
    launch(a2, b2, 2.0, stream=77)
    assert rec.launches[-1]["stream"] == 77


@needs_nvcc
def test_symbolic_sizes_of_changing_tensors_are_bound_at_each_call(scale_kernel, monkeypatch, driver_path):
    a, b = fake(10, 256), fake(10, 256)
    launch = lean.prepare(scale_kernel, (a, b, 1.5), changing=("a", "b"))
    assert launch.sized_positions == ()
    rec = _go_lean(launch, monkeypatch, driver_path)
    for rows in (1, 7, 10, 33):
        a2, b2 = fake(rows, 256), fake(rows, 256)
        launch(a2, b2)
        (want,) = _full_packing(scale_kernel, (a2, b2, 1.5))
        assert rec.launches[-1]["raw"] == want.raw() and rec.launches[-1]["dims"] == want.grid + want.block
        assert rec.launches[-1]["dims"][0] == (rows + 3) // 4
    with pytest.raises(ValueError, match=r"'b' shape\[0\] is 8 but m is 9 from an earlier argument"):
        launch(fake(9, 256), fake(8, 256))
    with pytest.raises(ValueError, match=r"'a' must have shape \['m', 256\], got \[9, 128\]"):
        launch(fake(9, 128), fake(9, 128))
    with pytest.raises(ValueError, match="would launch an empty grid"):
        launch(fake(0, 256), fake(0, 256))
    fixed_rows = lean.prepare(scale_kernel, (a, b, 1.5), changing=("b",))  # a binds m: b must keep it
    assert fixed_rows.sized_positions == (0,)
    _go_lean(fixed_rows, monkeypatch)
    with pytest.raises(ValueError, match=r"'b' must have shape \[10, 256\] \(as prepared\), got \[7, 256\]"):
        fixed_rows(fake(7, 256))


@needs_nvcc
def test_changing_scalars_are_recomputed_and_fixed_buffers_stay(put_kernel, monkeypatch, driver_path):
    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    launch = lean.prepare(put_kernel, (src, dst, sig, 1), changing=("src", "epoch"))
    rec = _go_lean(launch, monkeypatch, driver_path)
    for epoch in (2, 3, 2**64 - 1):
        src2 = fake(1024)
        launch(src2, epoch)
        (want,) = _full_packing(put_kernel, (src2, dst, sig, epoch))
        assert rec.launches[-1]["raw"] == want.raw()


@needs_nvcc
def test_a_call_with_nothing_to_recompute_is_one_helper_call(put_kernel, monkeypatch, driver_path):
    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    launch = lean.prepare(put_kernel, (src, dst, sig, 5), changing=("src",))
    rec = _go_lean(launch, monkeypatch, driver_path)
    assert driver_path == "ctypes" or launch._records_static
    for _ in range(3):
        src2 = fake(1024)
        launch(src2)
        (want,) = _full_packing(put_kernel, (src2, dst, sig, 5))
        assert rec.launches[-1]["raw"] == want.raw() and rec.launches[-1]["stream"] == 1234
    assert len(rec.launches) == 3
    rec.launch = lambda *args: 700  # the driver refuses (CUDA_ERROR_ILLEGAL_ADDRESS): the error names the launch
    from tilescale_core import driver

    with pytest.raises(driver.CudaError, match=r"cuLaunchKernel\(put_signal"):
        launch(fake(1024))


@needs_nvcc
def test_a_frozen_launch_is_the_last_calls_launch_alone(put_kernel, monkeypatch, driver_path):
    """frozen(): the launch with the last call's values, one helper call, holding no tensor;
    None where the launcher has no records or is not lean yet."""
    import gc
    import weakref

    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    launch = lean.prepare(put_kernel, (src, dst, sig, 9), changing=("src",))
    assert launch.frozen() is None  # not lean yet
    rec = _go_lean(launch, monkeypatch, driver_path)
    if driver_path == "ctypes":
        assert launch.frozen() is None
        return
    src2 = fake(1024)
    launch(src2)
    frozen = launch.frozen()
    launch(fake(1024))  # later calls of the launcher leave the frozen launch as it was
    watch = weakref.ref(src2.t)
    (want,) = _full_packing(put_kernel, (src2, dst, sig, 9))
    del launch, src2
    gc.collect()
    assert watch() is None  # the frozen launch keeps addresses, not tensors
    before = len(rec.launches)
    assert frozen() is True and frozen(stream=77) is True
    assert len(rec.launches) == before + 2
    assert rec.launches[-2]["raw"] == want.raw() and rec.launches[-2]["stream"] == 1234
    assert rec.launches[-1]["stream"] == 77
    rec.capturing = True  # the stream captures a CUDA graph: nothing launched, and it says so
    assert frozen() is False and len(rec.launches) == before + 2
    rec.capturing = False
    rec.launch = lambda *args: 700
    from tilescale_core import driver

    with pytest.raises(driver.CudaError, match=r"cuLaunchKernel\(put_signal"):
        frozen()


@needs_nvcc
def test_a_frozen_launch_moves_its_changing_buffers_only(put_kernel, monkeypatch, driver_path):
    """frozen(*addresses): the changing buffers' new addresses written, everything else as
    frozen; no address: the last launch's; a changing scalar cannot be frozen."""
    if driver_path == "ctypes":
        pytest.skip("frozen launches need the launch records' helper")
    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    launch = lean.prepare(put_kernel, (src, dst, sig, 5), changing=("src", "dst"))
    rec = _go_lean(launch, monkeypatch, driver_path)
    frozen = launch.frozen()
    for _ in range(2):
        src2, dst2 = fake(1024), fake(1024)
        frozen(src2.data_ptr(), dst2.data_ptr())
        (want,) = _full_packing(put_kernel, (src2, dst2, sig, 5))
        assert rec.launches[-1]["raw"] == want.raw()
    frozen()
    assert rec.launches[-1]["raw"] == want.raw()  # as last launched
    scalar = lean.prepare(put_kernel, (src, dst, sig, 5), changing=("src", "epoch"))
    _go_lean(scalar, monkeypatch, driver_path)
    with pytest.raises(ValueError, match=r"addresses only, not the scalars \['epoch'\]"):
        scalar.frozen()


@needs_nvcc
def test_freeze_needs_a_tvm_ffi_kernel_with_a_loaded_module(put_kernel, monkeypatch):
    assert lean.freeze(SimpleNamespace(execution_backend="cython"), ()) is None
    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    assert lean.freeze(put_kernel, (src, dst, sig, 5)) is None  # never launched: no module here
    with pytest.raises(TypeError, match="src"):
        lean.freeze(put_kernel, (fake(1024, dtype=torch.float16), dst, sig, 5))


@needs_nvcc
@pytest.mark.parametrize("call, error, match", [
    (lambda x: x(fake(1024, dtype=torch.float16), 1), TypeError, "'src' must have dtype torch.float32"),
    (lambda x: x(fake(512), 1), ValueError, r"'src' must have shape \[1024\] \(as prepared\)"),
    (lambda x: x(FakeCudaTensor(torch.zeros(2048)[::2]), 1), ValueError, "'src' must be contiguous"),
    (lambda x: x(fake(1024, index=1), 1), ValueError, "'src' must be on cuda:0"),
    (lambda x: x(fake(1024), -1), ValueError, "'epoch'=-1 is out of the range of uint64"),
    (lambda x: x(fake(1024), 1.5), TypeError, "'epoch' must be an int"),
    (lambda x: x(fake(1024)), TypeError, r"takes the changing arguments \['src', 'epoch'\]"),
])
def test_bad_calls_are_refused_before_any_launch(put_kernel, monkeypatch, call, error, match):
    launch = lean.prepare(put_kernel, (fake(1024), fake(1024), fake(1, dtype=torch.uint64), 1), changing=("src", "epoch"))
    rec = _go_lean(launch, monkeypatch)
    with pytest.raises(error, match=match):
        call(launch)
    assert rec.launches == []


@needs_nvcc
def test_trusted_calls_check_shapes_and_ranges_only(put_kernel, monkeypatch):
    launch = lean.prepare(put_kernel, (fake(1024), fake(1024), fake(1, dtype=torch.uint64), 1), changing=("src", "epoch"))
    rec = _go_lean(launch, monkeypatch)
    src = fake(1024, index=1)  # the caller vouches for the device (and dtype, contiguity)
    launch.trusted(src, 5)
    assert rec.launches[-1]["raw"][2] == src.data_ptr().to_bytes(8, "little")  # src is the kernel's third
    with pytest.raises(ValueError, match=r"'src' must have shape \[1024\]"):
        launch.trusted(fake(512), 5)
    with pytest.raises(ValueError, match="'epoch'=-1 is out of the range"):
        launch.trusted(fake(1024), -1)
    assert len(rec.launches) == 1


@needs_nvcc
def test_prepare_checks_every_argument_once(put_kernel):
    good = (fake(1024), fake(1024), fake(1, dtype=torch.uint64), 1)
    with pytest.raises(ValueError, match=r"changing must name distinct parameters of \['src', 'dst', 'sig', 'epoch'\]"):
        lean.prepare(put_kernel, good, changing=("source",))
    with pytest.raises(TypeError, match="argument 'sig' must have dtype uint64"):
        lean.prepare(put_kernel, (good[0], good[1], fake(1), 1))
    with pytest.raises(ValueError, match="argument 'dst' must be a CUDA tensor"):
        lean.prepare(put_kernel, (good[0], torch.zeros(1024), good[2], 1))
    with pytest.raises(TypeError, match="'src' must be prepared with a tensor"):
        lean.prepare(put_kernel, (good[0].data_ptr(),) + good[1:], changing=("src",))


@needs_nvcc
def test_until_the_module_is_known_calls_go_through_the_kernel(put_kernel, monkeypatch):
    seen = []
    monkeypatch.setitem(put_kernel.__dict__, "torch_function", lambda *args: seen.append(args))
    src, dst, sig = fake(1024), fake(1024), fake(1, dtype=torch.uint64)
    launch = lean.prepare(put_kernel, (src, dst, sig, 1), changing=("src", "epoch"))
    assert not launch.lean and "not loaded yet" in launch.why_not
    src2 = fake(1024)
    launch(src2, 9)
    assert len(seen) == 1 and seen[0][0] is src2 and seen[0][1:] == (dst, sig, 9)
    # a launch that reported no module (here: none made; for real, a module loaded before the
    # kernel was tracked): said once, and calls keep going through the kernel
    assert not launch.lean and "could not see it" in launch.why_not
    launch(src, 10)
    assert len(seen) == 2 and seen[1][0] is src and seen[1][1:] == (dst, sig, 10)


@needs_nvcc
def test_an_aot_kernel_is_prepared_like_a_jit_kernel(bundle_dir, monkeypatch):
    from tilescale_lang import aot

    kernel = aot.load(bundle_dir, arch="sm_90a").kernel("scale", n=256)
    a, b = fake(10, 256), fake(10, 256)
    launch = lean.prepare(kernel, (a, b, 1.5), changing=("a", "b", "scale"))
    assert not launch.lean and launch.why_not == lean._NOT_LOADED  # the module loads at the first call
    rec = _go_lean(launch, monkeypatch)
    a2, b2 = fake(6, 256), fake(6, 256)
    launch(a2, b2, -2.0)
    (want,) = kernel.pack(a2, b2, -2.0)
    assert rec.launches[-1]["raw"] == want.raw() and rec.launches[-1]["dims"] == want.grid + want.block


# ------------------------------------------------------------------------------ GPU
def build_put_signal_i32(n: int = 1024):
    """test_aot's put_signal with an int32 epoch."""
    import tilelang.language as T

    @T.prim_func
    def put_signal_i32(src: T.Tensor((n,), "float32"), dst: T.Tensor((n,), "float32"), sig: T.Tensor((1,), "uint64"),
                       epoch: T.int32):
        with T.Kernel(1, threads=128):
            peer = (T.get_rank() + 1) % T.get_num_ranks()
            T.put_signal_block(src[0], dst[0], n, sig[0], T.cast(epoch, "uint64"), "set", peer)
            T.signal_wait_until(sig[0], "eq", T.cast(epoch, "uint64"))

    return put_signal_i32


@pytest.mark.gpu
def test_gpu_lean_calls_match_tilelangs_launcher(scale_kernel, driver_path):
    """1000 calls with fresh inputs: the lean path gives TileLang's bits; a side stream and a
    CUDA graph capture of the lean call work; through ctypes and through the launch records."""
    a = torch.randn(10, 256, device="cuda")
    b = torch.full_like(a, float("nan"))
    launch = lean.prepare(scale_kernel, (a, b, 1.0), changing=("a", "b", "scale"))
    launch(a, b, 1.0)  # through TileLang: loads the module, which the launcher then uses
    torch.cuda.synchronize()
    assert launch.lean, launch.why_not
    assert (launch._records is not None) == (driver_path == "records"), driver_path
    ref = torch.empty_like(b)
    for i in range(1000):
        a.normal_()
        b.fill_(float("nan"))
        launch(a, b, 0.5 + i)
        scale_kernel(a, ref, 0.5 + i)
        if i % 100 == 0:
            torch.cuda.synchronize()
            assert torch.equal(b, ref) and torch.equal(b, a * (0.5 + i))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b.fill_(float("nan"))
        launch(a, b, 2.0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(b, a * 2.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(a, b, 3.0)
    for _ in range(3):
        a.normal_()
        b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(b, a * 3.0)

    import tilelang

    put = tilelang.compile(build_put_signal_i32(), target="auto")  # TileLang's launcher takes no uint64 scalar
    src, dst = torch.rand(1024, device="cuda"), torch.full((1024,), float("nan"), device="cuda")
    sig = torch.zeros(1, dtype=torch.uint64, device="cuda")
    put.initialize(allocator=FakeAllocator(torch.tensor([0, 1, 0x7F0000000000], dtype=torch.uint64)))
    ring = lean.prepare(put, (src, dst, sig, 1), changing=("src", "epoch"))
    for epoch in range(1, 50):
        src2 = torch.rand(1024, device="cuda")
        ring(src2, epoch)  # world 1: the next rank is this one
        torch.cuda.synchronize()
        assert torch.equal(dst, src2) and int(sig.cpu().view(torch.int64)[0]) == epoch
    assert ring.lean, ring.why_not
    assert (ring._records is not None) == (driver_path == "records"), driver_path


@needs_nvcc
@pytest.mark.gpu
def test_gpu_a_frozen_launch_gives_tilelangs_bits():
    """freeze(): None before the kernel's first launch (which it arranges to see), a frozen
    launch after it; 1000 launches of it, the input refilled each time and every other
    launch moved to a second input, give what TileLang's launcher gives, on a side stream
    too; on a stream capturing a CUDA graph it launches nothing (False), and the graph holds
    no launch of it."""
    import tilelang

    scale_kernel = tilelang.compile(test_aot.build_scale.get_tir(n=128), target=TARGET)  # a kernel of its own
    a = torch.randn(10, 128, device="cuda")
    b = torch.full_like(a, float("nan"))
    assert lean.freeze(scale_kernel, (a, b, 1.5)) is None  # its module is not loaded yet
    scale_kernel(a, b, 1.5)  # loads the module, which freeze() now sees
    frozen = lean.freeze(scale_kernel, (a, b, 1.5), changing=("a",))
    assert frozen is not None, "no frozen launch (is there a C compiler for the launch records' helper?)"
    ref, inputs = torch.empty_like(b), (a, torch.empty_like(a))
    for i in range(1000):
        x = inputs[i % 2]
        x.normal_()
        b.fill_(float("nan"))
        assert frozen(x.data_ptr()) is True
        scale_kernel(x, ref, 1.5)
        if i % 100 in (0, 1):
            torch.cuda.synchronize()
            assert torch.equal(b, ref) and torch.equal(b, x * 1.5), i
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b.fill_(float("nan"))
        frozen(a.data_ptr())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(b, a * 1.5)
    graph = torch.cuda.CUDAGraph()
    b.fill_(float("nan"))
    with torch.cuda.graph(graph):
        captured = frozen(a.data_ptr())
        ref.fill_(2.0)  # the graph's one node
    assert captured is False
    ref.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert b.isnan().all() and ref.eq(2.0).all()  # nothing of the frozen launch was captured
    assert frozen(a.data_ptr()) is True  # eagerly again
    torch.cuda.synchronize()
    assert torch.equal(b, a * 1.5)


@pytest.mark.gpu
def test_gpu_lean_calls_of_an_aot_kernel(bundle_dir):
    from tilescale_lang import aot

    kernel = aot.load(bundle_dir, strict=True).kernel("scale", n=256)
    a = torch.randn(10, 256, device="cuda")
    b = torch.full_like(a, float("nan"))
    launch = lean.prepare(kernel, (a, b, 1.0), changing=("a", "b", "scale"))
    for i in range(100):
        rows = 1 + i % 13
        a2, b2 = torch.randn(rows, 256, device="cuda"), torch.full((rows, 256), float("nan"), device="cuda")
        launch(a2, b2, 0.25 * i)
        torch.cuda.synchronize()
        assert torch.equal(b2, a2 * (0.25 * i))
    assert launch.lean, launch.why_not


def test_the_driver_entry_points_have_the_c_signatures():
    """cuLaunchKernel: the function, 7 unsigned ints, the stream, the parameter array and
    ``extra``; cuLaunchCooperativeKernel: the same without ``extra``. Without a driver the
    entry points are cuda-bindings' calls, with the same arguments."""
    assert len(lean_driver._LAUNCH._argtypes_) == 11 and len(lean_driver._COOPERATIVE_LAUNCH._argtypes_) == 10
    launch, cooperative = lean_driver._driver_calls()
    assert callable(launch) and callable(cooperative)
