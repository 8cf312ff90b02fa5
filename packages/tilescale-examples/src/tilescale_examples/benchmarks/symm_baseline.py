"""torch symmetric memory as a second baseline of the reduction benchmarks.

torch ships reduction kernels over its own symmetric memory
(``torch.distributed._symmetric_memory``): a buffer from ``symm_mem.empty`` becomes peer
visible after ``symm_mem.rendezvous(buf, group_name)``, and ``torch.ops.symm_mem`` runs on it:

* all-reduce: ``one_shot_all_reduce_out`` (or ``one_shot_all_reduce``) and
  ``two_shot_all_reduce_out`` (or the in-place ``two_shot_all_reduce_``);
* reduce-scatter: ``reduce_scatter_out``.

:class:`SymmBaseline` probes which of these the installed torch has (they are named in the
benchmark's title), and per size fills a symmetric buffer with the input, checks each op's
result against the TileScale output, times every op that passed and reports the fastest. It
needs one GPU per rank and an NCCL group; otherwise :attr:`SymmBaseline.reason` says why it
is "n/a".
"""

from __future__ import annotations

from typing import Callable

__all__ = ["SymmBaseline", "CANDIDATES"]

#: benchmark op -> (family, [op names in order of preference]); one op per family is timed.
CANDIDATES = {
    "allreduce": (("one-shot", ("one_shot_all_reduce_out", "one_shot_all_reduce")),
                  ("two-shot", ("two_shot_all_reduce_out", "two_shot_all_reduce_"))),
    "reducescatter": (("reduce-scatter", ("reduce_scatter_out",)),),
}


def _call(name: str, buf, out, group_name: str) -> Callable[[], object]:
    """A zero-argument call of ``torch.ops.symm_mem.<name>`` on ``buf`` (result in ``out``,
    or in ``buf`` for the in-place op, or returned for ``one_shot_all_reduce``)."""
    import torch

    fn = getattr(torch.ops.symm_mem, name)
    if name == "reduce_scatter_out":
        return lambda: fn(buf, group_name, False, out)
    if name.endswith("_out"):
        return lambda: fn(buf, "sum", group_name, out)
    return lambda: fn(buf, "sum", group_name)


class SymmBaseline:
    """The torch symmetric-memory ops of ``op`` ("allreduce" or "reducescatter") on ``group``.

    Attributes: ``reason`` (None when usable, else why not), ``ops`` (the chosen op name per
    family, in order).
    """

    def __init__(self, op: str, group, device, backend: str, ranks_share_gpu: bool):
        self.op, self.group, self.device = op, group, device
        self.ops: list[str] = []
        self.reason = None
        if op not in CANDIDATES:
            self.reason = "n/a (torch symmetric memory has no such op)"
            return
        if ranks_share_gpu or backend != "nccl":
            self.reason = "n/a (ranks share a GPU: torch symmetric memory needs one GPU per rank and NCCL)"
            return
        try:
            import torch
            import torch.distributed._symmetric_memory as symm_mem

            self.symm_mem = symm_mem
            self.group_name = group.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(self.group_name)
            for _, names in CANDIDATES[op]:
                have = [n for n in names if hasattr(torch.ops.symm_mem, n)]
                if have:
                    self.ops.append(have[0])
        except Exception as e:  # an old torch, or no CUDA symmetric memory backend
            self.reason = f"n/a (torch symmetric memory unavailable: {type(e).__name__}: {e})"[:160]
            return
        if not self.ops:
            self.reason = "n/a (this torch has none of the ops)"

    def title(self) -> str:
        """What the title says about this baseline."""
        if self.reason is not None:
            return f"torch symmetric memory: {self.reason}"
        return "torch symmetric memory: torch.ops.symm_mem." + " / ".join(self.ops) + " on symm_mem.empty buffers (fastest per size)"

    def measure(self, x, expect, match: Callable, time_ms: Callable, iters: int):
        """``(op name, milliseconds)`` of the fastest op whose result ``match(result,
        expect)`` on a symmetric copy of ``x`` (this rank's flat input), or ``(None,
        reason)``. Every rank must call it with the same sizes (rendezvous is collective)."""
        import torch

        if self.reason is not None:
            return None, self.reason
        buf = self.symm_mem.empty(x.numel(), dtype=x.dtype, device=self.device)
        self.symm_mem.rendezvous(buf, self.group_name)
        out = torch.empty(expect.numel(), dtype=x.dtype, device=self.device)
        best = (None, "n/a (every op failed)")
        for name in self.ops:
            buf.copy_(x.reshape(-1))  # the in-place two-shot leaves its result here
            call = _call(name, buf, out, self.group_name)
            why = "wrong result"
            try:
                result = call()
                torch.cuda.synchronize(self.device)
                got = buf if name.endswith("_") else (result if name == "one_shot_all_reduce" else out)
                ok = bool(match(got.reshape(-1), expect))
            except (RuntimeError, ValueError, TypeError) as e:
                ok, why = False, type(e).__name__
            if not _all_ranks(ok, self.group, self.device):
                if best[0] is None:
                    best = (None, f"n/a ({name}: {why})")
                continue
            ms = time_ms(call, iters, self.group, self.device)
            if best[0] is None or ms < best[1]:
                best = (name, ms)
        del buf, out
        return best


def _all_ranks(ok: bool, group, device) -> bool:
    """Whether ``ok`` holds on every rank (a MIN all-reduce; every rank must call it)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
