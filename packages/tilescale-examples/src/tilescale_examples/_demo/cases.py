"""What the demo runs: :data:`CASES` (the ring put, then two sizes of each collective), each
built by :func:`build_case` through the examples' public constructors together with its
torch.distributed baseline, the symmetric heap they need (:func:`heap_bytes`: what their
constructors allocate), and :class:`Row`, one result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tilescale_examples.benchmarks._report import format_bytes

__all__ = ["Case", "CASES", "Row", "GEMM_N", "GEMM_K", "build_case", "heap_bytes", "poison_then_stage"]

#: Heap bytes per rank beyond what the cases allocate.
HEAP_SLACK = 64 << 20

@dataclass(frozen=True)
class Case:
    """One row of the demo: ``op`` at ``size`` (elements per rank, or ``m_local`` rows for
    AllGatherGEMM), with its dtype."""

    op: str
    size: int
    dtype: str

    def label(self, world: int) -> str:
        """The size column: total bytes moved per rank, or the GEMM's shape."""
        if self.op == "AllGatherGEMM":
            return f"{world * self.size}x{GEMM_N}x{GEMM_K}"
        itemsize = _ITEMSIZE[self.dtype]
        total = self.size * itemsize * (world if self.op == "all-gather" else 1)
        return format_bytes(total)


#: Columns and reduction dimension of the AllGatherGEMM cases.
GEMM_N, GEMM_K = 4096, 4096
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
#: Every row, in order: the ring put, then two sizes of each collective.
CASES = (
    Case("ring put", 1 << 16, "float32"),
    Case("ring put", 1 << 22, "float32"),
    Case("all-gather", 1 << 18, "float16"),     # per-rank shard elements
    Case("all-gather", 1 << 24, "float16"),
    Case("all-reduce", 1 << 19, "float16"),     # tensor elements
    Case("all-reduce", 1 << 25, "float16"),
    Case("AllGatherGEMM", 512, "bfloat16"),     # m_local rows
    Case("AllGatherGEMM", 2048, "bfloat16"),
)


@dataclass
class Row:
    """One result: ``kernels``, the distinct compiled kernels the op's object holds
    (:func:`kernels_of`: compiled now or found in TileLang's cache); compile mode also fills
    ``compile_s`` and ``files`` (what the build added to the cache); GPU mode the times
    (microseconds), ``ratio`` (baseline / TileScale: above 1, TileScale is faster),
    ``baseline`` (what ran) and ``check``."""

    op: str
    size: str
    kernels: int = 0
    compile_s: float = 0.0
    files: list = field(default_factory=list)
    tilescale_us: float = float("nan")
    baseline_us: float = float("nan")
    ratio: float = float("nan")
    baseline: str = ""
    check: str = ""



# ------------------------------------------------------------------------------ adapter
# The only place the demo touches the examples' classes and kernel builders: each maker
# builds one case through the public constructor and returns (object, call, inputs,
# baseline, tolerance). ``call(inputs)`` runs TileScale and returns the output;
# ``baseline(inputs, out)`` writes the torch.distributed result into ``out``.
class _Built:
    def __init__(self, obj, call, inputs, baseline_name, baseline, tol, output):
        self.obj, self.call, self.inputs = obj, call, inputs
        self.baseline_name, self.baseline, self.tol, self.output = baseline_name, baseline, tol, output

    def close(self) -> None:
        close = getattr(self.obj, "close", None)
        if close is not None:
            close()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _random(shape, dtype, seed: int):
    from tilescale_examples.benchmarks._collectives import random_input
    import torch

    return random_input(shape, _torch_dtype(dtype), torch.Generator().manual_seed(seed))


class _RingPut:
    """The quick-start kernel (``ring_put.build_ring_put``) on two symmetric tensors."""

    def __init__(self, alloc, n: int, dtype: str):
        import tilelang

        from tilescale_examples.base import TARGET
        from tilescale_examples.tutorials.ring_put import build_ring_put

        self.kernel = tilelang.compile(build_ring_put(n, dtype), target=TARGET, compile_once=True)
        self.kernel.initialize(allocator=alloc)
        self.src = tilelang.tensor((n,), _torch_dtype(dtype), allocator=alloc)
        self.dst = tilelang.tensor((n,), _torch_dtype(dtype), allocator=alloc)

    @staticmethod
    def heap_bytes(n: int, dtype) -> int:
        """Symmetric heap bytes of its two tensors of ``n`` elements (256-byte aligned each)."""
        import torch

        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return 2 * (-(-nbytes // 256) * 256)

    def __call__(self, src):
        self.kernel(src, self.dst)
        return self.dst

    def close(self) -> None:
        self.kernel = self.src = self.dst = None


def _ring_baselines():
    def p2p(dist, group, rank, world, x, out):
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world, group),
                                       dist.P2POp(dist.irecv, out, (rank - 1) % world, group)])
        for req in reqs:
            req.wait()

    def gather_select(dist, group, rank, world, x, out):
        import torch

        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        out.copy_(parts[(rank - 1) % world])

    def gather_select_host(dist, group, rank, world, x, out):
        import torch

        staged = x.cpu()  # a backend without CUDA tensors (gloo, ranks sharing a GPU)
        parts = [torch.empty_like(staged) for _ in range(world)]
        dist.all_gather(parts, staged, group=group)
        out.copy_(parts[(rank - 1) % world])

    return (("batch_isend_irecv ring", p2p), ("all_gather + select", gather_select),
            ("all_gather through host memory + select", gather_select_host))


def _gemm_baselines():
    def into_tensor(dist, group, gathered, a):
        dist.all_gather_into_tensor(gathered, a, group=group)

    def views(dist, group, gathered, a):
        dist.all_gather(list(gathered.chunk(dist.get_world_size(group))), a, group=group)

    def through_host(dist, group, gathered, a):
        import torch

        staged = a.cpu()  # a backend without CUDA tensors (gloo, ranks sharing a GPU)
        parts = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, staged, group=group)
        gathered.copy_(torch.cat(parts))

    return (("all_gather_into_tensor + matmul", into_tensor), ("all_gather + matmul", views),
            ("all_gather through host memory + matmul", through_host))


def _first_working(candidates, probe) -> tuple[str, Callable]:
    """The first ``(name, fn)`` of ``candidates`` for which ``probe(fn)`` is true (a backend
    may lack an operation, e.g. gloo's P2P on CUDA tensors); every rank probes alike."""
    for name, fn in candidates:
        try:
            if probe(fn):
                return name, fn
        except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError):
            pass
    raise RuntimeError(f"no torch.distributed baseline works on this group (tried {[n for n, _ in candidates]})")


def build_case(case: Case, alloc, group, rank: int, world: int, device, with_baseline: bool) -> _Built:
    """Build ``case`` through the examples' public API (collective: every rank, same order).
    ``with_baseline`` False (compile mode) skips inputs and baselines."""
    import torch

    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM
    from tilescale_examples.collectives.allgather import AllGather
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.benchmarks import _collectives as C

    dtype = _torch_dtype(case.dtype)
    seed = rank * 7919 + case.size % 1000003
    if case.op == "ring put":
        obj = _RingPut(alloc, case.size, case.dtype)
        if not with_baseline:
            return _Built(obj, None, None, "", None, None, None)
        import torch.distributed as dist

        x = obj.src
        x.copy_(_random(x.shape, case.dtype, seed))
        prev = (rank - 1) % world
        expected = _random(x.shape, case.dtype, prev * 7919 + case.size % 1000003)  # what rank - 1 sends

        plain = x.clone()  # the baseline's input: ordinary torch memory, as a torch user has

        def probe(fn):
            out = torch.zeros_like(plain)
            fn(dist, group, rank, world, plain, out)
            torch.cuda.synchronize(device)
            return bool(torch.equal(out.cpu(), expected))

        candidates = _ring_baselines()
        if dist.get_backend(group) != "nccl":  # gloo: collectives first, P2P on CUDA tensors last
            candidates = candidates[1:] + candidates[:1]
        name, fn = _first_working(candidates, probe)
        return _Built(obj, obj, (x,), name, lambda xs, out: fn(dist, group, rank, world, plain, out), None, obj.dst)
    if case.op == "all-gather":
        obj = AllGather(alloc, (case.size,), dtype, group=group)
        op = C.OPS["allgather"]
    elif case.op == "all-reduce":
        obj = AllReduce(alloc, (case.size,), dtype, group=group)
        op = C.OPS["allreduce"]
    elif case.op == "AllGatherGEMM":
        obj = AllGatherGEMM(alloc, case.size, GEMM_K, GEMM_N, dtype, group=group)
        if not with_baseline:
            return _Built(obj, None, None, "", None, None, None)
        import torch.distributed as dist

        a = _random((case.size, GEMM_K), case.dtype, seed).to(device)
        b = (_random((GEMM_K, GEMM_N), case.dtype, seed + 1).float() / GEMM_K ** 0.5).to(dtype).to(device)
        gathered = torch.empty((world * case.size, GEMM_K), dtype=dtype, device=device)

        def probe(fn):
            fn(dist, group, gathered, a)
            torch.cuda.synchronize(device)
            return bool(torch.equal(gathered[rank * case.size:(rank + 1) * case.size], a))

        name, fn = _first_working(_gemm_baselines(), probe)

        def baseline(xs, out):
            fn(dist, group, gathered, xs[0])
            torch.matmul(gathered, xs[1], out=out)

        return _Built(obj, lambda a_, b_: obj(a_, b_), (a, b), name, baseline, (2e-2, 2e-2), obj.output)
    else:
        raise ValueError(f"unknown op {case.op!r}")
    if not with_baseline:
        return _Built(obj, None, None, "", None, None, None)
    x = obj.input
    x.copy_(_random(x.shape, case.dtype, seed))
    plain = x.clone()  # the baseline's input: ordinary torch memory (a gloo group takes no heap tensors)
    name, fn = C.pick_baseline(op, group, device, dtype)
    tol = C.tolerance(op, case.dtype, world)
    return _Built(obj, obj, (x,), name, lambda xs, out: fn(out.view(-1), plain.reshape(-1)), tol, obj.output)



def heap_bytes(world: int, device=None) -> int:
    """Symmetric heap per rank for every case, built in turn on one allocator (the heap returns
    bytes only at close): what each case's constructor allocates (the classes' ``heap_bytes``,
    a dry run of the constructor on ``device``'s SM count), plus :data:`HEAP_SLACK`."""
    from tilescale_examples.collectives.allgather import AllGather
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.overlap.ag_gemm import AllGatherGEMM

    total = HEAP_SLACK
    for case in CASES:
        dtype = _torch_dtype(case.dtype)
        if case.op == "ring put":
            total += _RingPut.heap_bytes(case.size, dtype)
        elif case.op == "all-gather":
            total += AllGather.heap_bytes((case.size,), dtype, world_size=world, device=device)
        elif case.op == "all-reduce":
            total += AllReduce.heap_bytes((case.size,), dtype, world_size=world, device=device)
        else:
            total += AllGatherGEMM.heap_bytes(case.size, GEMM_K, GEMM_N, dtype, world_size=world, device=device)
    return total


def poison_then_stage(built: _Built) -> None:
    """Poison ``built.output`` with NaN (a missed element cannot pass the check), then write
    the inputs again: an output may share memory with an input (the two-shot all-reduce
    returns its staging buffer, which is also ``input``), and a user writes the input after
    whatever the output held."""
    fresh = [x.clone() for x in built.inputs]
    built.output.fill_(float("nan"))
    for x, value in zip(built.inputs, fresh):
        x.copy_(value)

