"""``dump_c``: a C header and source that embed a bundle's cubins and launch its kernels
through the CUDA driver API, for a C or C++ program without Python.

The generated API (``P`` is the prefix, default the bundle's name)::

    CUresult P_load(void);        /* load every kernel's cubin for the current context's GPU */
    CUresult P_unload(void);
    CUresult P_set_table(const uint64_t *table, size_t entries, CUstream stream);
    CUresult P_<id>(CUstream stream, <typed arguments>);   /* one per bundle entry */

``P_set_table`` copies the heap table (``[local_rank, num_ranks, base_0, ...]``, 2..1024
uint64 entries; the host array must stay valid until ``stream`` reaches the copy) into every
module that declares it; a kernel that reads the table returns
``CUDA_ERROR_NOT_INITIALIZED`` before it. A kernel's arguments are its PrimFunc's parameters in
order (a buffer as a pointer to its element type: 16-bit floats as ``uint16_t``, 8-bit floats as
``uint8_t``, ``bool`` as ``uint8_t``), then its symbolic shape variables.
"""

from __future__ import annotations

import ast
import keyword
import os
import re
from pathlib import Path
from typing import Any

from .manifest import read_manifest

__all__ = ["C_TYPES", "c_expr", "dump_c"]

#: C type of each TileLang dtype (a buffer is a pointer to it).
C_TYPES = {
    "bool": "uint8_t", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float32": "float", "float64": "double", "float16": "uint16_t", "bfloat16": "uint16_t",
    "float8_e4m3": "uint8_t", "float8_e5m2": "uint8_t", "float8_e4m3fn": "uint8_t",
}
_C_RESERVED = set(keyword.kwlist) | {
    "auto", "char", "const", "default", "do", "double", "enum", "extern", "float", "goto", "int", "long",
    "register", "short", "signed", "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned",
    "void", "volatile", "stream", "restrict", "inline",
}
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/", ast.Mod: "%"}
_SMEM_LIMIT = 48 * 1024


def _ident(name: str) -> str:
    """A C identifier for a parameter or variable name (``tsaot_``-prefixed names are ours)."""
    out = re.sub(r"\W", "_", name)
    if not out or out[0].isdigit() or out in _C_RESERVED or out.startswith("tsaot_"):
        out = "arg_" + out
    return out


def _ctype(dtype: str, where: str) -> str:
    if dtype not in C_TYPES:
        raise ValueError(f"{where}: dtype {dtype!r} has no C type (known: {sorted(C_TYPES)})")
    return C_TYPES[dtype]


def c_expr(expr: int | str) -> str:
    """A launch expression (an int, or Python text over variable names) in C: an int or a bare
    variable as itself, arithmetic over ``int64_t`` (``//`` as ``/``: the operands are sizes)."""
    if isinstance(expr, int):
        return str(expr)
    tree = ast.parse(expr, mode="eval").body
    if isinstance(tree, ast.Name):
        return _ident(tree.id)

    def emit(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return f"(int64_t){node.value}"
        if isinstance(node, ast.Name):
            return f"(int64_t){_ident(node.id)}"
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return f"({emit(node.left)} {_BINOPS[type(node.op)]} {emit(node.right)})"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return f"(-{emit(node.operand)})"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max")
                and len(node.args) == 2):
            return f"TSAOT_{node.func.id.upper()}({emit(node.args[0])}, {emit(node.args[1])})"
        raise ValueError(f"launch expression {expr!r}: {ast.dump(node)} has no C form")

    return emit(tree)


def _signature(entry: dict[str, Any]) -> list[tuple[str, str]]:
    """``(C type, C name)`` of each argument of an entry's launch function, after the stream."""
    out = []
    for p in entry["params"]:
        ctype = _ctype(p["dtype"], f"{entry['id']}.{p['name']}")
        out.append((f"{ctype} *" if p["kind"] == "buffer" else f"{ctype} ", _ident(p["name"])))
    out += [(f"{_ctype(d['dtype'], entry['id'])} ", _ident(d["name"])) for d in entry["dynamic_vars"]]
    return out


def _describe(entry: dict[str, Any]) -> str:
    parts = []
    for p in entry["params"]:
        shape = "[" + ", ".join(str(d) for d in p["shape"]) + "]" if p["kind"] == "buffer" else ""
        parts.append(f"{p['name']}: {p['dtype']}{shape}")
    table = "; reads the heap table (call _set_table first)" if entry["table"]["needed"] else ""
    return f"{entry['name']} {entry['args']}: " + ", ".join(parts) + table


def _bytes_array(name: str, data: bytes) -> str:
    rows = [", ".join(f"0x{b:02x}" for b in data[i : i + 16]) for i in range(0, len(data), 16)]
    return f"static const unsigned char {name}[{len(data)}] = {{\n  " + ",\n  ".join(rows) + "\n};\n"


def _tensormap_lines(name: str, arg: dict[str, Any]) -> list[str]:
    """The C statements that encode a ``tensormap`` launch argument into ``CUtensorMap name``
    (``cuTensorMapEncodeTiled`` with the arguments TileLang's host code passes; the strides
    without the first, the element size)."""
    rank = int(arg["rank"])

    def values(key: str, ctype: str, skip: int = 0) -> str:
        items = ", ".join(f"({ctype})({c_expr(e)})" for e in arg[key][skip:]) or "0"
        return f"{ctype} {name}_{key}[{max(rank - skip, 1)}] = {{{items}}};"

    return [f"    CUtensorMap {name};",
            "    { " + values("dims", "cuuint64_t"), "      " + values("strides", "cuuint64_t", skip=1),
            "      " + values("box", "cuuint32_t"), "      " + values("element_strides", "cuuint32_t"),
            f"      TSAOT_CHECK(cuTensorMapEncodeTiled(&{name}, (CUtensorMapDataType){int(arg['data_type'])}, {rank}u, "
            f"(void *){_ident(arg['param'])}, {name}_dims, {name}_strides, {name}_box, {name}_element_strides, "
            f"(CUtensorMapInterleave){int(arg['interleave'])}, (CUtensorMapSwizzle){int(arg['swizzle'])}, "
            f"(CUtensorMapL2promotion){int(arg['l2_promotion'])}, "
            f"(CUtensorMapFloatOOBfill){int(arg['oob_fill'])})); }}"]


def _launch_block(k: int, li: int, launch: dict[str, Any]) -> str:
    """The C statements of one launch of kernel slot ``k``."""
    lines = [f"  {{ /* {launch['symbol']} */"]
    for i, arg in enumerate(launch["args"]):
        if arg["kind"] == "pointer":
            lines.append(f"    void *tsaot_a{i} = (void *){_ident(arg['param'])};")
        elif arg["kind"] == "tensormap":
            lines += _tensormap_lines(f"tsaot_a{i}", arg)
        else:
            ctype = _ctype(arg["dtype"], launch["symbol"])
            lines.append(f"    {ctype} tsaot_a{i} = ({ctype})({c_expr(arg['value'])});")
    n = len(launch["args"])
    refs = ", ".join(f"&tsaot_a{i}" for i in range(n)) or "NULL"
    lines.append(f"    void *tsaot_params[{max(n, 1)}] = {{{refs}}};")
    dims = [f"{e}u" if isinstance(e, int) else f"(unsigned int)({c_expr(e)})" for e in (*launch["grid"], *launch["block"])]
    lines.append(f"    unsigned int tsaot_dims[6] = {{{', '.join(dims)}}};")
    fn = f"tsaot_kernels[{k}].functions[{li}]"
    smem = int(launch["dynamic_smem"])
    if launch.get("cluster") or launch.get("cooperative"):
        cluster = launch.get("cluster")
        lines.append(f"    TSAOT_CHECK(tsaot_launch_ex({fn}, tsaot_dims, {smem}u, stream, tsaot_params, "
                     f"{int(bool(launch.get('cooperative')))}, "
                     + (", ".join(f"{int(c)}u" for c in cluster) if cluster else "0u, 0u, 0u") + "));")
    else:
        lines.append(f"    TSAOT_CHECK(cuLaunchKernel({fn}, tsaot_dims[0], tsaot_dims[1], tsaot_dims[2], tsaot_dims[3], "
                     f"tsaot_dims[4], tsaot_dims[5], {smem}u, stream, tsaot_params, NULL));")
    lines.append("  }")
    return "\n".join(lines)


def _launch_function(prefix: str, k: int, entry: dict[str, Any]) -> tuple[str, str]:
    """The declaration and the definition of kernel slot ``k``'s launch function."""
    args = ", ".join(["CUstream stream"] + [f"{t}{n}" for t, n in _signature(entry)])
    decl = f"/* {_describe(entry)} */\nCUresult {prefix}_{entry['id']}({args});\n"
    body = [f"CUresult {prefix}_{entry['id']}({args}) {{",
            f"  if (tsaot_kernels[{k}].module == NULL) return CUDA_ERROR_NOT_INITIALIZED;"]
    if entry["table"]["needed"]:
        body.append("  if (!tsaot_table_set) return CUDA_ERROR_NOT_INITIALIZED;")
    used = {_ident(p["name"]) for p in entry["params"]} | {_ident(d["name"]) for d in entry["dynamic_vars"]}
    body.append("  " + " ".join(f"(void){name};" for name in sorted(used)))  # arguments no launch reads
    for ai, arch in enumerate(entry["archs"]):
        body.append(f"  if (tsaot_kernels[{k}].image_index == {ai}) {{ /* {arch} */")
        body += [_launch_block(k, li, launch) for li, launch in enumerate(entry["archs"][arch]["launches"])]
        body.append("  }")
    body += ["  return CUDA_SUCCESS;", "}\n"]
    return decl, "\n".join(body)


_RUNTIME = r"""
#define TSAOT_CHECK(call) do { CUresult tsaot_r = (call); if (tsaot_r != CUDA_SUCCESS) return tsaot_r; } while (0)
#define TSAOT_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TSAOT_MAX(a, b) ((a) > (b) ? (a) : (b))

typedef struct { int cc; const unsigned char *image; } tsaot_image;
typedef struct {
  const tsaot_image *images; int n_images;
  const char *const *symbols; const unsigned int *smem; int n_functions;
  int has_table; int image_index; CUmodule module; CUfunction *functions;
} tsaot_kernel;

static int tsaot_table_set = 0;

static inline CUresult tsaot_launch_ex(CUfunction f, const unsigned int *d, unsigned int smem, CUstream stream,
                                void **params, int cooperative, unsigned int cx, unsigned int cy, unsigned int cz) {
  CUlaunchAttribute attrs[2];
  CUlaunchConfig config;
  unsigned int n = 0;
  memset(attrs, 0, sizeof(attrs));
  memset(&config, 0, sizeof(config));
  if (cx) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[n].value.clusterDim.x = cx; attrs[n].value.clusterDim.y = cy; attrs[n].value.clusterDim.z = cz;
    n++;
  }
  if (cooperative) { attrs[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE; attrs[n].value.cooperative = 1; n++; }
  config.gridDimX = d[0]; config.gridDimY = d[1]; config.gridDimZ = d[2];
  config.blockDimX = d[3]; config.blockDimY = d[4]; config.blockDimZ = d[5];
  config.sharedMemBytes = smem; config.hStream = stream; config.attrs = attrs; config.numAttrs = n;
  return cuLaunchKernelEx(&config, f, params, NULL);
}

static CUresult tsaot_current_cc(int *cc) {
  CUdevice dev; int major = 0, minor = 0;
  TSAOT_CHECK(cuCtxGetDevice(&dev));
  TSAOT_CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  TSAOT_CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  *cc = major * 10 + minor;
  return CUDA_SUCCESS;
}

static CUresult tsaot_load_one(tsaot_kernel *k, int cc) {
  int i;
  k->image_index = -1;
  for (i = 0; i < k->n_images; ++i) if (k->images[i].cc == cc) { k->image_index = i; break; }
  if (k->image_index < 0) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  TSAOT_CHECK(cuModuleLoadData(&k->module, k->images[k->image_index].image));
  for (i = 0; i < k->n_functions; ++i) {
    TSAOT_CHECK(cuModuleGetFunction(&k->functions[i], k->module, k->symbols[i]));
    if (k->smem[i] > SMEM_LIMIT)
      TSAOT_CHECK(cuFuncSetAttribute(k->functions[i], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)k->smem[i]));
  }
  return CUDA_SUCCESS;
}
"""

_API = r"""
CUresult PREFIX_load(void) {
  int cc = 0, i;
  TSAOT_CHECK(tsaot_current_cc(&cc));
  for (i = 0; i < N_KERNELS; ++i) if (tsaot_kernels[i].module == NULL) TSAOT_CHECK(tsaot_load_one(&tsaot_kernels[i], cc));
  return CUDA_SUCCESS;
}

CUresult PREFIX_unload(void) {
  int i;
  for (i = 0; i < N_KERNELS; ++i) {
    if (tsaot_kernels[i].module != NULL) TSAOT_CHECK(cuModuleUnload(tsaot_kernels[i].module));
    tsaot_kernels[i].module = NULL;
  }
  tsaot_table_set = 0;
  return CUDA_SUCCESS;
}

CUresult PREFIX_set_table(const uint64_t *table, size_t entries, CUstream stream) {
  int i;
  if (table == NULL || entries < 2 || entries > MAX_TABLE || entries != (size_t)table[1] + 2) return CUDA_ERROR_INVALID_VALUE;
  for (i = 0; i < N_KERNELS; ++i) {
    CUdeviceptr ptr; size_t size;
    if (!tsaot_kernels[i].has_table) continue;
    if (tsaot_kernels[i].module == NULL) return CUDA_ERROR_NOT_INITIALIZED;
    TSAOT_CHECK(cuModuleGetGlobal(&ptr, &size, tsaot_kernels[i].module, "SYMBOL"));
    if (entries * sizeof(uint64_t) > size) return CUDA_ERROR_INVALID_VALUE;
    TSAOT_CHECK(cuMemcpyHtoDAsync(ptr, table, entries * sizeof(uint64_t), stream));
  }
  tsaot_table_set = 1;
  return CUDA_SUCCESS;
}
"""


def _kernel_tables(bundle_dir: Path, k: int, entry: dict[str, Any]) -> str:
    """The embedded cubins and the ``tsaot_kernel`` fields of kernel slot ``k``."""
    out = []
    images = []
    for arch, per_arch in entry["archs"].items():
        name = f"tsaot_k{k}_{arch}"
        out.append(_bytes_array(name, (bundle_dir / per_arch["cubin"]).read_bytes()))
        images.append(f"{{{re.sub(r'[^0-9]', '', arch)}, {name}}}")
    launches = next(iter(entry["archs"].values()))["launches"]
    symbols = ", ".join(f'"{launch["symbol"]}"' for launch in launches)
    smem = ", ".join(f"{int(launch['dynamic_smem'])}u" for launch in launches)
    out.append(f"static const tsaot_image tsaot_k{k}_images[] = {{{', '.join(images)}}};\n"
               f"static const char *const tsaot_k{k}_symbols[] = {{{symbols}}};\n"
               f"static const unsigned int tsaot_k{k}_smem[] = {{{smem}}};\n"
               f"static CUfunction tsaot_k{k}_functions[{len(launches)}];\n")
    return "".join(out)


def dump_c(bundle: Any, out_dir: str | os.PathLike, *, prefix: str | None = None) -> tuple[Path, Path]:
    """Write ``<prefix>.h`` and ``<prefix>.c`` for ``bundle`` (a loaded
    :class:`~tilescale_lang.aot.loader.Bundle` or a bundle directory) into ``out_dir``.

    The source embeds every cubin, includes ``<cuda.h>`` and links against ``libcuda``; the
    launch functions are described in the module doc.

    Returns:
        ``(header path, source path)``.

    Raises:
        ValueError: ``prefix`` is not a C identifier, or an entry's dtype has no C type.
    """
    bundle_dir = Path(getattr(bundle, "path", bundle))
    manifest = getattr(bundle, "manifest", None) or read_manifest(bundle_dir)
    prefix = prefix or manifest.get("name", "bundle")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
        raise ValueError(f"prefix must be a C identifier, got {prefix!r}")
    from tilescale_core import table

    entries = manifest["kernels"]
    key = manifest["key"]
    banner = (f"/* Generated by tilescale_lang.aot.dump_c from bundle {manifest.get('name')!r}: format "
              f"{manifest['format_version']}, archs {', '.join(key['archs'])}, CUDA {key['toolkit']}, tilescale-lang "
              f"{key['tilescale_lang']}, tilelang {key['tilelang']}. Do not edit. */\n")
    guard = prefix.upper() + "_AOT_H"
    decls, defs = zip(*[_launch_function(prefix, k, e) for k, e in enumerate(entries)]) if entries else ((), ())
    header = (banner + f"#ifndef {guard}\n#define {guard}\n#include <cuda.h>\n#include <stddef.h>\n#include <stdint.h>\n"
              "#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n"
              f"/* Load every kernel for the current context's GPU (CUDA_ERROR_NO_BINARY_FOR_GPU: no cubin for it). */\n"
              f"CUresult {prefix}_load(void);\nCUresult {prefix}_unload(void);\n"
              f"/* Copy the heap table [local_rank, num_ranks, base_0, ...] (2..{table.MAX_TABLE_ENTRIES} entries) "
              "into every loaded module that declares it. */\n"
              f"CUresult {prefix}_set_table(const uint64_t *table, size_t entries, CUstream stream);\n\n"
              + "\n".join(decls) + "\n#ifdef __cplusplus\n}\n#endif\n#endif\n")
    slots = ",\n".join(
        f"  {{tsaot_k{k}_images, {len(e['archs'])}, tsaot_k{k}_symbols, tsaot_k{k}_smem, "
        f"{len(next(iter(e['archs'].values()))['launches'])}, {int(e['table']['has_symbol'])}, -1, NULL, "
        f"tsaot_k{k}_functions}}" for k, e in enumerate(entries))
    runtime = _RUNTIME.replace("SMEM_LIMIT", f"{_SMEM_LIMIT}u")
    symbol = entries[0]["table"]["symbol"] if entries else "meta_data"
    api = (_API.replace("PREFIX", prefix).replace("N_KERNELS", str(len(entries)))
           .replace("MAX_TABLE", f"{table.MAX_TABLE_ENTRIES}u").replace("SYMBOL", symbol))
    source = (banner + f'#include <string.h>\n#include "{prefix}.h"\n' + runtime + "\n"
              + "".join(_kernel_tables(bundle_dir, k, e) for k, e in enumerate(entries))
              + f"\nstatic tsaot_kernel tsaot_kernels[{max(len(entries), 1)}] = {{\n{slots}\n}};\n" + api + "\n"
              + "\n".join(defs))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h_path, c_path = out / f"{prefix}.h", out / f"{prefix}.c"
    h_path.write_text(header, encoding="utf-8")
    c_path.write_text(source, encoding="utf-8")
    return h_path, c_path
