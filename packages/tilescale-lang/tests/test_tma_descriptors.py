"""Kernels whose host code encodes TMA descriptors (TileLang's GEMMs on sm_90a) in the lean
launcher: the descriptors described as TileLang's host code encodes them (checked against
the lowered host function's own call), encoded once at preparation with those arguments (a
recording encoder on the CPU), byte for byte in the packed and frozen parameters, and refused
(TileLang's launcher) where a changing argument reaches a descriptor; AOT bundles still refuse
them; AOT bundles record them (``tensormap`` launch arguments) and their loader and C export
encode them at each call. GPU tests (``gpu``): a frozen launch of such a kernel, and the
kernel run from a bundle, give TileLang's bits."""

import ctypes
import json
import re
import shutil
import subprocess

import pytest
import torch
from lang_helpers import TARGET, needs_nvcc

from tilescale_lang import aot, lean
from tilescale_lang.aot import launch_info, packing
from test_aot import CC, CUDA_HOME

from test_lean import _full_packing, _go_lean, driver_path, fake  # noqa: F401  (driver_path: a fixture)


def build_tma_gemm(m=128, n=128, k=128, dtype="float16"):
    """``C = A @ B`` in 64 x 64 tiles, pipelined: its tile copies from global memory lower to
    TMA loads on sm_90a, whose descriptors the host code encodes (``m``: an int or a
    ``T.dynamic`` size)."""
    import tilelang.language as T

    @T.prim_func
    def tma_gemm(A: T.Tensor((m, k), dtype), B: T.Tensor((k, n), dtype), C: T.Tensor((m, n), dtype)):
        with T.Kernel(n // 64, T.ceildiv(m, 64), threads=128) as (bx, by):
            A_s = T.alloc_shared((64, 32), dtype)
            B_s = T.alloc_shared((32, 64), dtype)
            C_l = T.alloc_fragment((64, 64), "float32")
            T.clear(C_l)
            for ko in T.Pipelined(k // 32, num_stages=2):
                T.copy(A[by * 64, ko * 32], A_s)
                T.copy(B[ko * 32, bx * 64], B_s)
                T.gemm(A_s, B_s, C_l)
            T.copy(C_l, C[by * 64, bx * 64])

    return tma_gemm


def _host_calls(artifact):
    """Descriptor name -> the arguments of the host function's encoding call, as printed."""
    calls = {}
    for line in artifact.host_mod.script().splitlines():
        found = re.search(r'call_packed\("__tvm_tensormap_create_tiled", (\w+), (.*)\)\s*$', line.strip())
        if found:
            calls[found.group(1)] = [a.strip() for a in found.group(2).split(",")]
    return calls


@pytest.mark.parametrize("dynamic", [False, True])
def test_descriptors_are_described_as_the_host_code_encodes_them(dynamic):
    """describe(tensormaps=True): each descriptor argument carries the buffer and every field
    of the host function's ``__tvm_tensormap_create_tiled`` call (a symbolic size as its
    name); describe() without it, as AOT bundles are built, still refuses the kernel."""
    import tilelang.language as T

    func = build_tma_gemm(T.dynamic("m") if dynamic else 128)
    artifact = launch_info.lower(func, TARGET["arch"])
    (launch,) = launch_info.describe(func, artifact, tensormaps=True)["launches"]
    kinds = [a["kind"] for a in launch["args"]]
    assert kinds[:3] == ["tensormap", "tensormap", "pointer"]
    calls = _host_calls(artifact)
    assert len(calls) == 2
    for arg, (name, host) in zip(launch["args"][:2], sorted(calls.items())):
        assert name == f"{arg['param']}_desc" and host[2] == arg["param"]
        rank = arg["rank"]
        fields = [arg["data_type"], rank, *arg["dims"], *arg["strides"], *arg["box"], *arg["element_strides"],
                  arg["interleave"], arg["swizzle"], arg["l2_promotion"], arg["oob_fill"]]
        assert [str(f) for f in fields] == host[:2] + host[3:], (name, host)
    assert launch["args"][0]["dims"] == [128, "m" if dynamic else 128]
    assert launch["args"][0]["strides"][0] == 2  # the element size, which the driver does not take
    with pytest.raises(launch_info.UnsupportedKernelError, match=r"A_desc\) is a handle built on the host"):
        launch_info.describe(func, artifact)


def test_tensormap_fields_evaluate_sizes_and_drop_the_element_stride():
    arg = {"kind": "tensormap", "param": "A", "data_type": 6, "rank": 2, "dims": [128, "m"], "strides": [2, 256],
           "box": [32, 64], "element_strides": [1, 1], "interleave": 0, "swizzle": 2, "l2_promotion": 2, "oob_fill": 0}
    assert packing.tensormap_fields(arg, 4096, {"m": 320}) == (6, 2, 4096, [128, 320], [256], [32, 64], [1, 1],
                                                              0, 2, 2, 0)
    data = bytes(range(128))
    value = packing.tensormap_value(arg, 4096, {"m": 320}, encode=lambda *a: data)
    assert ctypes.sizeof(value) == 128 and ctypes.addressof(value) % 64 == 0 and bytes(value) == data
    with pytest.raises(ValueError, match="128 bytes, the encoder gave 64"):
        packing.tensormap_value(arg, 4096, {"m": 320}, encode=lambda *a: data[:64])


def test_value_copy_keeps_bytes_and_the_descriptors_alignment():
    desc = packing.tensormap_value({"dims": [1], "strides": [4], "box": [1], "element_strides": [1], "data_type": 7,
                                    "rank": 1, "interleave": 0, "swizzle": 0, "l2_promotion": 0, "oob_fill": 0},
                                   64, {}, encode=lambda *a: bytes(reversed(range(128))))
    copy = packing.value_copy(desc)
    assert bytes(copy) == bytes(desc) and ctypes.addressof(copy) != ctypes.addressof(desc)
    assert ctypes.addressof(copy) % 64 == 0
    scalar = packing.value_copy(ctypes.c_int32(-7))
    assert isinstance(scalar, ctypes.c_int32) and scalar.value == -7


def test_encode_tensormap_gives_the_driver_its_types(monkeypatch):
    """encode_tensormap: the driver's enums and cuuint64/cuuint32 lists (cuda-bindings takes
    no bare ints there), the 128 bytes of the map it returns."""
    from tilescale_core import driver

    drv = driver.driver_module()
    seen, data = [], (ctypes.c_uint8 * 128)(*range(128))

    class Map:
        def getPtr(self):
            return ctypes.addressof(data)

    monkeypatch.setattr(driver, "call", lambda name, *args: seen.append((name, args)) or Map())
    out = packing.encode_tensormap(9, 2, 0x7000, [1024, 128], [2048], [64, 128], [1, 1], 0, 3, 2, 0)
    assert out == bytes(range(128))
    ((name, args),) = seen
    assert name == "cuTensorMapEncodeTiled"
    assert args[0] == drv.CUtensorMapDataType(9) and args[1:3] == (2, 0x7000)
    assert [int(v) for v in args[3]] == [1024, 128] and all(isinstance(v, drv.cuuint64_t) for v in args[3] + args[4])
    assert [int(v) for v in args[4]] == [2048] and [int(v) for v in args[5]] == [64, 128]
    assert all(isinstance(v, drv.cuuint32_t) for v in args[5] + args[6])
    assert args[7:] == (drv.CUtensorMapInterleave(0), drv.CUtensorMapSwizzle(3), drv.CUtensorMapL2promotion(2),
                        drv.CUtensorMapFloatOOBfill(0))


@pytest.fixture(scope="module")
def gemm_kernel():
    import tilelang

    return tilelang.compile(build_tma_gemm(), target=TARGET)


class Encoder:
    """Stands for the driver's encoding: records each call, gives 128 bytes derived from it."""

    def __init__(self):
        self.calls = []

    def __call__(self, *fields):
        self.calls.append(fields)
        return bytes((len(self.calls) * 31 + i) % 256 for i in range(128))


@needs_nvcc
def test_descriptors_of_fixed_buffers_are_encoded_once_and_frozen(gemm_kernel, monkeypatch, driver_path):
    """A launcher with nothing changing encodes each descriptor once, at preparation, with
    the host code's arguments and the buffers' addresses; every call and its frozen launch
    pass those bytes (the full packing of the same arguments gives them too), no encoding
    per call."""
    encoder = Encoder()
    monkeypatch.setattr(packing, "encode_tensormap", encoder)
    a, b, c = fake(128, 128, dtype=torch.float16), fake(128, 128, dtype=torch.float16), fake(128, 128, dtype=torch.float16)
    launch = lean.prepare(gemm_kernel, (a, b, c))
    assert [f[2] for f in encoder.calls] == [a.data_ptr(), b.data_ptr()]
    assert encoder.calls[0][:2] == (6, 2) and encoder.calls[0][3:5] == ([128, 128], [256])
    assert launch.why_not != "" and "TMA" not in (launch.why_not or "")  # only: not loaded yet
    rec = _go_lean(launch, monkeypatch, driver_path)
    launch()
    launch()
    raw = rec.launches[-1]["raw"]
    assert [len(r) for r in raw] == [128, 128, 8]
    encoded = [bytes((n * 31 + i) % 256 for i in range(128)) for n in (1, 2)]
    assert raw[:2] == encoded and int.from_bytes(raw[2], "little") == c.data_ptr()
    assert len(encoder.calls) == 2  # nothing encoded per call
    encoder.calls.clear()
    (full,) = _full_packing(gemm_kernel, (a, b, c))
    assert full.raw()[2] == raw[2] and len(encoder.calls) == 2
    if driver_path == "records":
        frozen = launch.frozen()
        assert frozen() is True and rec.launches[-1]["raw"] == raw


@needs_nvcc
def test_a_descriptor_over_a_changing_argument_takes_tilelangs_launcher(gemm_kernel, monkeypatch):
    """A changing buffer that a descriptor describes would need it encoded at each call:
    the launcher says so and calls go through ``kernel(*args)``; no encoding is made for it."""
    encoder = Encoder()
    monkeypatch.setattr(packing, "encode_tensormap", encoder)
    a, b, c = fake(128, 128, dtype=torch.float16), fake(128, 128, dtype=torch.float16), fake(128, 128, dtype=torch.float16)
    launch = lean.prepare(gemm_kernel, (a, b, c), changing=("B",))
    assert "TMA descriptor over changing argument 'B'" in launch.why_not and not launch.lean
    assert [f[2] for f in encoder.calls] == [a.data_ptr()]
    assert launch.frozen() is None
    seen = []
    monkeypatch.setattr(launch, "_through_kernel", lambda values, stream: seen.append(values))
    b2 = fake(128, 128, dtype=torch.float16)
    launch(b2)
    assert seen == [(b2,)]


@pytest.mark.gpu
def test_gpu_a_frozen_launch_of_a_tma_kernel_gives_tilelangs_bits():
    """The GEMM through TileLang's launcher, then frozen (its descriptors encoded here once):
    200 frozen launches with the inputs refilled in place give TileLang's bits; prepared
    with a changing input, calls take TileLang's launcher and still give its bits."""
    import tilelang

    kernel = tilelang.compile(build_tma_gemm(256, 128, 256), target=TARGET)
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    c, ref = torch.full((256, 128), float("nan"), device="cuda", dtype=torch.float16), torch.empty(
        256, 128, device="cuda", dtype=torch.float16)
    kernel(a, b, ref)  # loads the module
    frozen = lean.freeze(kernel, (a, b, c))
    assert frozen is not None, "no frozen launch of a TMA kernel"
    for i in range(200):
        a.normal_()
        b.normal_()
        c.fill_(float("nan"))
        assert frozen() is True
        kernel(a, b, ref)
        if i % 50 in (0, 1):
            torch.cuda.synchronize()
            assert torch.equal(c, ref), i
            torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-1)
    moving = lean.prepare(kernel, (a, b, c), changing=("A",))
    assert not moving.lean and "TMA" in moving.why_not
    a2 = torch.randn_like(a)
    c.fill_(float("nan"))
    moving(a2)
    kernel(a2, b, ref)
    torch.cuda.synchronize()
    assert torch.equal(c, ref)


TMA_SPEC = {"name": "tma", "kernels": [{"name": "tma_gemm", "entry": "test_tma_descriptors:build_tma_gemm",
                                        "args": [{"m": 128}]}]}


@pytest.fixture(scope="module")
def tma_bundle(tmp_path_factory):
    from lang_helpers import have_nvcc

    if not have_nvcc():
        pytest.skip("needs nvcc (set CUDA_HOME)")
    out = tmp_path_factory.mktemp("tma_bundle")
    aot.build(TMA_SPEC, out)
    return out


@needs_nvcc
def test_a_bundle_records_descriptors_and_its_loader_encodes_them_per_call(tma_bundle, monkeypatch):
    """The manifest's launch takes two ``tensormap`` arguments (bundle format 2); the loader
    encodes both at each call, for that call's buffers, with the recorded fields."""
    manifest = json.loads((tma_bundle / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["format_version"] == aot.FORMAT_VERSION == 2
    (entry,) = manifest["kernels"]
    (launch,) = entry["archs"]["sm_90a"]["launches"]
    assert [a["kind"] for a in launch["args"]] == ["tensormap", "tensormap", "pointer"]
    encoder = Encoder()
    monkeypatch.setattr(packing, "encode_tensormap", encoder)
    kernel = aot.load(tma_bundle, strict=True, arch="sm_90a").kernel("tma_gemm", m=128)
    for call in range(2):
        a, b, c = (torch.zeros(128, 128, dtype=torch.float16) for _ in range(3))
        (packed,) = kernel.pack(a, b, c)
        assert [f[2] for f in encoder.calls[2 * call:]] == [a.data_ptr(), b.data_ptr()]
        raw = packed.raw()
        assert raw[0] == bytes(((2 * call + 1) * 31 + i) % 256 for i in range(128))
        assert int.from_bytes(raw[2], "little") == c.data_ptr()
    assert encoder.calls[0] == (6, 2, encoder.calls[0][2], [128, 128], [256], [32, 64], [1, 1], 0, 2, 2, 0)


@needs_nvcc
@pytest.mark.skipif(CC is None, reason="needs a host C compiler (gcc or cc)")
def test_the_c_export_encodes_descriptors_with_the_driver(tma_bundle, tmp_path):
    """dump_c of a bundle with descriptors: each launch encodes them with
    ``cuTensorMapEncodeTiled`` (the recorded fields, strides without the element size) and
    passes the maps by value; the source compiles with the host compiler, warnings as errors."""
    _, source = aot.dump_c(tma_bundle, tmp_path, prefix="tma")
    text = source.read_text(encoding="utf-8")
    assert text.count("cuTensorMapEncodeTiled(") == 2
    assert "tsaot_a0_strides[1] = {(cuuint64_t)(256)}" in text
    assert "(CUtensorMapDataType)6, 2u, (void *)A, tsaot_a0_dims" in text and "&tsaot_a0, &tsaot_a1, &tsaot_a2" in text
    obj = tmp_path / "tma.o"
    res = subprocess.run([CC, "-std=c11", "-Wall", "-Wextra", "-Werror", f"-I{CUDA_HOME}/include", f"-I{tmp_path}", "-c",
                          str(source), "-o", str(obj)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    nm = shutil.which("nm")
    if nm:
        assert "cuTensorMapEncodeTiled" in subprocess.run([nm, "-u", str(obj)], capture_output=True, text=True).stdout


@pytest.mark.gpu
def test_gpu_the_bundles_gemm_gives_tilelangs_bits(tma_bundle):
    """The GEMM loaded from the bundle (its descriptors encoded by the loader at each call)
    against the same kernel compiled by TileLang, on two sets of buffers."""
    import tilelang

    kernel = aot.load(tma_bundle, strict=True).kernel("tma_gemm", m=128)
    jit = tilelang.compile(build_tma_gemm(128), target=TARGET)
    for _ in range(2):
        a, b = (torch.randn(128, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        c, ref = torch.full((128, 128), float("nan"), device="cuda", dtype=torch.float16), torch.empty(
            128, 128, device="cuda", dtype=torch.float16)
        kernel(a, b, c)
        jit(a, b, ref)
        torch.cuda.synchronize()
        assert torch.equal(c, ref)
