"""AOT bundles (tilescale_lang.aot): build for sm_90a with nvcc, check the manifest, refuse a
mismatch, select and pack a kernel's arguments (CPU, no driver call), export to C and compile
it with the host compiler. GPU tests (``gpu``) launch from the bundle and from the C export.

The kernels: ``build_scale`` (a ``@tilelang.jit`` factory: a symbolic row count, a scalar)
and ``build_put_signal`` (a TileScale kernel: ``T.put_signal_block`` to the next rank, then
``T.signal_wait_until`` on its own signal; it reads the heap table)."""

# No ``from __future__ import annotations``: T.prim_func evaluates its parameter annotations.

import ast
import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tilelang
import tilelang.language as T
from lang_helpers import FakeAllocator, have_nvcc

import tilescale_lang
from tilescale_lang import aot
from tilescale_lang.aot import manifest as manifest_mod
from tilescale_lang.aot import spec as spec_mod
from tilescale_lang.aot.packing import ArgPacker, evaluate

needs_nvcc = pytest.mark.skipif(not have_nvcc(), reason="needs nvcc (set CUDA_HOME)")
CC = shutil.which("gcc") or shutil.which("cc")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


@tilelang.jit
def build_scale(n: int = 256, block: int = 128, dtype: str = "float32"):
    """``b[i, j] = a[i, j] * scale`` over ``m`` rows (symbolic) of ``n``, 4 rows per block."""
    m = T.dynamic("m")

    @T.prim_func
    def scale_rows(a: T.Tensor((m, n), dtype), b: T.Tensor((m, n), dtype), scale: T.float32):
        with T.Kernel(T.ceildiv(m, 4), threads=block) as bx:
            for i, j in T.Parallel(4, n):
                b[bx * 4 + i, j] = a[bx * 4 + i, j] * scale

    return scale_rows


def build_put_signal(n: int = 1024, dtype: str = "float32"):
    """Put ``src`` into ``dst`` on rank ``rank + 1`` and set its ``sig`` to ``epoch``; then wait
    until this rank's ``sig`` holds ``epoch``."""

    @T.prim_func
    def put_signal(src: T.Tensor((n,), dtype), dst: T.Tensor((n,), dtype), sig: T.Tensor((1,), "uint64"),
                   epoch: T.uint64):
        with T.Kernel(1, threads=128):
            peer = (T.get_rank() + 1) % T.get_num_ranks()
            T.put_signal_block(src[0], dst[0], n, sig[0], epoch, "set", peer)
            T.signal_wait_until(sig[0], "eq", epoch)

    return put_signal


SPEC = {
    "name": "demo",
    "kernels": [
        {"name": "scale", "entry": "test_aot:build_scale", "args": [{"n": 256}]},
        {"name": "put_signal", "entry": "test_aot:build_put_signal", "product": {"n": [1024], "dtype": ["float32"]}},
    ],
}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    if not have_nvcc():
        pytest.skip("needs nvcc (set CUDA_HOME)")
    out = tmp_path_factory.mktemp("bundle")
    aot.build(SPEC, out)  # two nvcc compiles
    return out


@pytest.fixture(scope="module")
def manifest(bundle_dir):
    return json.loads((bundle_dir / "manifest.json").read_text(encoding="utf-8"))


def _entry(manifest, name):
    return next(e for e in manifest["kernels"] if e["name"] == name)


# ------------------------------------------------------------------------------ spec
def test_spec_expands_args_and_product_and_names_bad_keys():
    spec = spec_mod.load_spec({"kernels": [{"entry": "m:f", "args": [{"n": 1}],
                                            "product": {"n": [1, 2], "dtype": ["a", "b"]}}]})
    (k,) = spec.kernels
    assert k.name == "f" and k.archs == ("sm_90a",)
    assert k.variants == [{"n": 1}, {"n": 1, "dtype": "a"}, {"n": 1, "dtype": "b"}, {"n": 2, "dtype": "a"},
                          {"n": 2, "dtype": "b"}]
    assert spec_mod.variant_id("f", {"n": [1, 2]}) == spec_mod.variant_id("f", {"n": (1, 2)})
    bad = [({"kernels": [{"entry": "nocolon"}]}, "kernels[0].entry"),
           ({"kernels": [{"entry": "m:f", "archs": ["hopper"]}]}, "kernels[0].archs"),
           ({"kernels": [{"entry": "m:f", "product": {"n": 3}}]}, "kernels[0].product"),
           ({"kernels": [{"entry": "m:f", "bogus": 1}]}, "bogus"),
           ({"kernels": [{"entry": "m:f"}, {"entry": "n:f"}]}, "unique"),
           ({"kernels": []}, "kernels")]
    for raw, word in bad:
        with pytest.raises((ValueError, TypeError), match=word.replace("[", r"\[").replace("]", r"\]")):
            spec_mod.load_spec(raw)
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        spec_mod.resolve_entry("no_such_module_xyz:f")


# ------------------------------------------------------------------------------ manifest
@needs_nvcc
def test_manifest_records_key_kernels_and_launch_metadata(bundle_dir, manifest):
    from tilescale_core import table

    from tilescale_lang import headers
    from tilescale_lang.toolkit import find_toolkit

    tk = find_toolkit()
    assert manifest["format"] == manifest_mod.FORMAT and manifest["format_version"] == aot.FORMAT_VERSION
    assert manifest["key"] == {
        "format_version": aot.FORMAT_VERSION, "archs": ["sm_90a"], "toolkit": f"{tk.version[0]}.{tk.version[1]}",
        "tilescale_lang": tilescale_lang.__version__, "tilelang": tilelang.__version__,
        "table_version": table.TABLE_VERSION, "header_abi": headers.abi_hash()}
    for entry in manifest["kernels"]:
        per_arch = entry["archs"]["sm_90a"]
        data = (bundle_dir / per_arch["cubin"]).read_bytes()
        assert data[:4] == b"\x7fELF" and hashlib.sha256(data).hexdigest() == per_arch["sha256"]
        assert (bundle_dir / per_arch["source"]).read_text(encoding="utf-8").count("__global__") >= 1
    scale, ring = _entry(manifest, "scale"), _entry(manifest, "put_signal")
    assert scale["bound"] == {"n": 256, "block": 128, "dtype": "float32"}
    assert scale["params"] == [
        {"name": "a", "kind": "buffer", "dtype": "float32", "shape": ["m", 256], "strides": [256, 1]},
        {"name": "b", "kind": "buffer", "dtype": "float32", "shape": ["m", 256], "strides": [256, 1]},
        {"name": "scale", "kind": "scalar", "dtype": "float32"}]
    assert scale["dynamic_vars"] == [{"name": "m", "dtype": "int32", "param": "a", "axis": 0, "of": "shape"}]
    (launch,) = scale["archs"]["sm_90a"]["launches"]
    assert launch["symbol"] == "scale_rows_kernel" and launch["block"] == [128, 1, 1]
    assert evaluate(launch["grid"][0], {"m": 9}) == 3 and launch["dynamic_smem"] == 0
    assert [a.get("param", a.get("value")) for a in launch["args"]] == ["a", "b", "m", "scale"]
    assert scale["table"]["needed"] is False and scale["helpers"] == []
    # the TileScale kernel: the heap table must be bound; the device order is (dst, sig, src, epoch)
    assert ring["table"]["needed"] is True and ring["table"]["symbol"] == "meta_data"
    assert ring["table"]["entries"] == table.MAX_TABLE_ENTRIES and "get_rank" in ring["table"]["readers"]
    assert b"meta_data" in (bundle_dir / ring["archs"]["sm_90a"]["cubin"]).read_bytes()
    assert "#include <tilescale/tilescale.cuh>" in (bundle_dir / ring["archs"]["sm_90a"]["source"]).read_text(encoding="utf-8")
    (launch,) = ring["archs"]["sm_90a"]["launches"]
    assert [a.get("param", a.get("value")) for a in launch["args"]] == ["dst", "sig", "src", "epoch"]
    assert [p["name"] for p in ring["params"]] == ["src", "dst", "sig", "epoch"]


def _copy_with_key(bundle_dir, tmp_path, **changes):
    out = tmp_path / "copy"
    shutil.copytree(bundle_dir, out)
    data = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    for field, value in changes.items():
        (data if field in ("format", "format_version") else data["key"])[field] = value
    (out / "manifest.json").write_text(json.dumps(data))
    return out


@needs_nvcc
@pytest.mark.parametrize("field,value", [("format_version", 99), ("tilescale_lang", "0.0.1"), ("table_version", 7),
                                         ("format", "something-else")])
def test_load_refuses_a_mismatched_field(bundle_dir, tmp_path, field, value):
    copy = _copy_with_key(bundle_dir, tmp_path, **{field: value})
    with pytest.raises(aot.BundleMismatchError, match=field) as info:
        aot.load(copy, arch="sm_90a")
    assert isinstance(info.value, ValueError) and info.value.field == field
    assert info.value.bundle_value == value and repr(value) in str(info.value)
    assert repr(info.value.expected) in str(info.value)


@needs_nvcc
def test_load_refuses_another_arch_or_toolkit(bundle_dir, manifest):
    with pytest.raises(aot.BundleMismatchError, match=r"'arch'.*\['sm_90a'\].*'sm_80'"):
        aot.load(bundle_dir, arch="sm_80")
    with pytest.raises(aot.BundleMismatchError, match=r"'toolkit'.*'12\.4'"):
        aot.load(bundle_dir, arch="sm_90a", toolkit="12.4")
    with pytest.raises(aot.BundleMismatchError, match=r"'toolkit'.*driver is older"):
        manifest_mod.check_key(manifest, arch="sm_90", driver_version=12040)
    bundle = aot.load(bundle_dir, arch="sm_90", toolkit=manifest["key"]["toolkit"])  # sm_90a cubins run on 9.0
    assert bundle.arch == "sm_90"
    (bundle_dir / "not-a-bundle").mkdir(exist_ok=True)
    with pytest.raises(aot.BundleFormatError, match="manifest.json"):
        aot.load(bundle_dir / "not-a-bundle", arch="sm_90a")


# ------------------------------------------------------------------------------ selection
@needs_nvcc
def test_kernel_selection_strict_and_jit_fallback(bundle_dir, caplog):
    bundle = aot.load(bundle_dir, strict=True, arch="sm_90a")
    ring = bundle.kernel("put_signal", n=1024)
    assert isinstance(ring, aot.AotKernel) and ring.arch == "sm_90a"
    assert bundle.kernel("put_signal", dtype="float32") is ring  # defaults filled in, one kernel per entry
    assert bundle.kernel("scale", n=256, block=128).name == bundle.find("scale", n=256)["id"]
    with pytest.raises(aot.KernelNotInBundleError, match=r"'scale' with \{\"n\":64\}"):
        bundle.kernel("scale", n=64)
    with pytest.raises(aot.KernelNotInBundleError, match="kernels: \\['put_signal', 'scale'\\]"):
        bundle.kernel("nope")
    lenient = aot.load(bundle_dir, arch="sm_90a")
    with caplog.at_level(logging.WARNING, logger="tilescale_lang.aot"):
        jit = lenient.kernel("scale", n=64)  # one TileLang compile
    assert len([r for r in caplog.records if "not in bundle" in r.getMessage()]) == 1
    assert not isinstance(jit, aot.AotKernel) and "scale_rows_kernel" in jit.get_kernel_source()


@needs_nvcc
def test_argument_packing_without_a_gpu(bundle_dir):
    import torch

    bundle = aot.load(bundle_dir, strict=True, arch="sm_90a")
    kernel = bundle.kernel("scale", n=256)
    a, b = torch.zeros(9, 256), torch.zeros(9, 256)
    (launch,) = kernel.pack(a, b, 2.5)
    assert launch.symbol == "scale_rows_kernel" and launch.grid == (3, 1, 1) and launch.block == (128, 1, 1)
    assert launch.raw() == [a.data_ptr().to_bytes(8, "little"), b.data_ptr().to_bytes(8, "little"),
                            (9).to_bytes(4, "little"), bytes(ctypes.c_float(2.5))]
    params = (ctypes.c_void_p * 4).from_address(launch.address)
    assert [p for p in params] == [ctypes.addressof(v) for v in launch.values]
    bad = [((a, b), TypeError, "takes 3 arguments"), ((a.double(), b, 1.0), TypeError, "'a' must have dtype float32"),
           ((a, torch.zeros(9, 128), 1.0), ValueError, "'b' must have shape"),
           ((a, torch.zeros(8, 256), 1.0), ValueError, "m is 9"), ((a, b, "x"), TypeError, "'scale' must be a number"),
           ((torch.zeros(9, 512)[:, ::2], b, 1.0), ValueError, "'a' must have strides"),
           ((1234, b, 1.0), TypeError, "sizes a symbolic dimension")]
    for args, exc, words in bad:
        with pytest.raises(exc, match=words):
            kernel.pack(*args)
    one_row = torch.zeros(1, 256).as_strided((1, 256), (7, 1))  # a single row: its outer stride is free
    assert kernel.pack(one_row, torch.zeros(1, 256), 1.0)[0].grid == (1, 1, 1)
    with pytest.raises(ValueError, match="'a' must be a CUDA tensor"):
        kernel.packer.check_device((a, b, 1.0))  # what a launch checks first
    ring = bundle.kernel("put_signal")
    src, dst, sig = torch.zeros(1024), torch.zeros(1024), torch.zeros(1, dtype=torch.uint64)
    word = [t.data_ptr().to_bytes(8, "little") for t in (dst, sig, src)]
    assert ring.pack(src, dst, sig, 2**64 - 1)[0].raw() == [*word, b"\xff" * 8]
    assert ring.pack(0x1000, 0x2000, 0x3000, 7)[0].raw() == [(a).to_bytes(8, "little") for a in (0x2000, 0x3000, 0x1000, 7)]
    with pytest.raises(ValueError, match="'epoch'=-1 is out of the range of uint64"):
        ring.pack(src, dst, sig, -1)
    from tilescale_lang.metadata import KernelNotInitializedError

    with pytest.raises(KernelNotInitializedError, match="initialize"):
        ring(src, dst, sig, 1, stream=0)  # refused before any CUDA call
    assert ArgPacker(ring.entry, "sm_90a").pack(src, dst, sig, 1)[0].grid == (1, 1, 1)


# ------------------------------------------------------------------------------ C export
@needs_nvcc
@pytest.mark.skipif(CC is None, reason="needs a host C compiler (gcc or cc)")
def test_c_export_compiles_with_the_host_compiler(bundle_dir, manifest, tmp_path):
    header, source = aot.dump_c(bundle_dir, tmp_path, prefix="demo")
    text = header.read_text(encoding="utf-8")
    scale, ring = _entry(manifest, "scale"), _entry(manifest, "put_signal")
    assert f"CUresult demo_{scale['id']}(CUstream stream, float *a, float *b, float scale, int32_t m);" in text
    assert f"CUresult demo_{ring['id']}(CUstream stream, float *src, float *dst, uint64_t *sig, uint64_t epoch);" in text
    assert "demo_set_table(const uint64_t *table, size_t entries, CUstream stream)" in text
    obj = tmp_path / "demo.o"
    flags = ["-Wall", "-Wextra", "-Werror", f"-I{CUDA_HOME}/include", f"-I{tmp_path}"]
    res = subprocess.run([CC, "-std=c11", *flags, "-c", str(source), "-o", str(obj)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    nm = shutil.which("nm")
    if nm:
        undefined = subprocess.run([nm, "-u", str(obj)], capture_output=True, text=True).stdout.split()
        assert {u for u in undefined if u != "U"} <= {"cuCtxGetDevice", "cuDeviceGetAttribute", "cuFuncSetAttribute",
                                                      "cuLaunchKernel", "cuLaunchKernelEx", "cuMemcpyHtoDAsync_v2",
                                                      "cuModuleGetFunction", "cuModuleGetGlobal_v2", "cuModuleLoadData",
                                                      "cuModuleUnload", "memset"}
    stubs = Path(CUDA_HOME) / "lib64" / "stubs"
    if (stubs / "libcuda.so").exists():  # link against the driver stub as a program would
        main = tmp_path / "main.c"
        main.write_text('#include "demo.h"\nint main(void) { return demo_load() == CUDA_SUCCESS ? 0 : 1; }\n')
        res = subprocess.run([CC, *flags, str(main), str(obj), f"-L{stubs}", "-lcuda", "-o", str(tmp_path / "demo")],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]


# ------------------------------------------------------------------------------ command line
@needs_nvcc
def test_command_line_builds_and_shows_a_bundle(tmp_path):
    (tmp_path / "aot_cli_kernels.py").write_text(
        "import tilelang.language as T\n\n\ndef build_copy(n=128):\n    @T.prim_func\n"
        "    def copy(a: T.Tensor((n,), 'float32'), b: T.Tensor((n,), 'float32')):\n"
        "        with T.Kernel(1, threads=n) as _:\n            for i in T.Parallel(n):\n                b[i] = a[i]\n"
        "    return copy\n")
    spec = tmp_path / "small.json"
    spec.write_text(json.dumps({"kernels": [{"entry": "aot_cli_kernels:build_copy", "args": [{"n": 64}]}]}))
    env = dict(os.environ, CUDA_HOME=CUDA_HOME)
    cmd = [sys.executable, "-m", "tilescale_lang.aot"]
    res = subprocess.run([*cmd, "build", str(spec), "-o", str(tmp_path / "b")], capture_output=True, text=True, env=env,
                         cwd=tmp_path.parent)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "aot build: build_copy_" in res.stdout and (tmp_path / "b" / "manifest.json").is_file()
    assert aot.read_manifest(tmp_path / "b")["name"] == "small"
    res = subprocess.run([*cmd, "show", str(tmp_path / "b")], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "aot_cli_kernels:build_copy" in res.stdout and f"format_version={aot.FORMAT_VERSION}" in res.stdout


def test_aot_modules_stay_small_and_documented():
    root = Path(aot.__file__).parent
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), path.name
        assert path.read_text(encoding="utf-8").count("\n") + 1 <= 500, path.name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 120, f"{path.name}:{node.name}"
        for node in tree.body:  # public module-level names and their public methods
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                assert ast.get_docstring(node), f"{path.name}:{node.name}"
                for item in (node.body if isinstance(node, ast.ClassDef) else []):
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                        assert ast.get_docstring(item), f"{path.name}:{node.name}.{item.name}"


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_bundle_kernels_run_like_torch(bundle_dir):
    import torch

    bundle = aot.load(bundle_dir, strict=True)  # this GPU's arch, this driver
    a = torch.randn(10, 256, device="cuda")
    b = torch.full_like(a, float("nan"))
    bundle.kernel("scale", n=256)(a, b, 1.5)
    torch.cuda.synchronize()
    assert torch.equal(b, a * 1.5)
    ring = bundle.kernel("put_signal")
    src, dst = torch.rand(1024, device="cuda"), torch.full((1024,), float("nan"), device="cuda")
    sig = torch.zeros(1, dtype=torch.uint64, device="cuda")
    ring.initialize(allocator=FakeAllocator(torch.tensor([0, 1, 0x7F0000000000], dtype=torch.uint64)))
    ring(src, dst, sig, 5)  # world 1: the next rank is this one, so it waits for its own signal
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and int(sig.cpu().view(torch.int64)[0]) == 5


@pytest.mark.gpu
@pytest.mark.skipif(CC is None, reason="needs a host C compiler (gcc or cc)")
def test_gpu_c_export_runs(bundle_dir, manifest, tmp_path):
    scale = _entry(manifest, "scale")
    aot.dump_c(bundle_dir, tmp_path, prefix="demo")
    (tmp_path / "main.c").write_text(f"""#include <stdio.h>
#include "demo.h"
#define CK(x) do {{ CUresult r_ = (x); if (r_ != CUDA_SUCCESS) {{ printf("%s: %d\\n", #x, (int)r_); return 1; }} }} while (0)
int main(void) {{
  CUdevice dev; CUcontext ctx; CUdeviceptr a, b; float h[8 * 256], out[8 * 256]; int i;
  for (i = 0; i < 8 * 256; ++i) h[i] = (float)i;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CK(demo_load());
  CK(cuMemAlloc(&a, sizeof(h))); CK(cuMemAlloc(&b, sizeof(h))); CK(cuMemcpyHtoD(a, h, sizeof(h)));
  CK(demo_{scale['id']}(NULL, (float *)a, (float *)b, 2.0f, 8));
  CK(cuCtxSynchronize()); CK(cuMemcpyDtoH(out, b, sizeof(out)));
  for (i = 0; i < 8 * 256; ++i) if (out[i] != 2.0f * h[i]) {{ printf("mismatch at %d\\n", i); return 1; }}
  printf("ok\\n"); return 0;
}}
""")
    exe = tmp_path / "demo"
    res = subprocess.run([CC, f"-I{CUDA_HOME}/include", f"-I{tmp_path}", str(tmp_path / "main.c"), str(tmp_path / "demo.c"),
                          "-lcuda", "-o", str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr
