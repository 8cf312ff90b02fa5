"""torch symmetric memory as a second baseline of the reduction benchmarks.

torch ships reduction kernels over its own symmetric memory
(``torch.distributed._symmetric_memory``): a buffer from ``symm_mem.empty`` becomes peer
visible after ``symm_mem.rendezvous(buf, group_name)``, and ``torch.ops.symm_mem`` runs on it:

* all-reduce: ``one_shot_all_reduce_out`` (or ``one_shot_all_reduce``) and
  ``two_shot_all_reduce_out`` (or the in-place ``two_shot_all_reduce_``);
* reduce-scatter: ``reduce_scatter_out``.

:class:`SymmBaseline` probes which of these the installed torch has (they are named in the
benchmark's title), and per size fills a symmetric buffer with the input, checks each op's
result against the TileScale output, times every op that passed (back-to-back calls, and,
when asked, replayed from a CUDA graph: :class:`SymmTimes`) and reports the fastest. It needs
one GPU per rank and an NCCL group (one rank works: a group of size 1); otherwise
:attr:`SymmBaseline.reason` says why it is "n/a".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["SymmBaseline", "SymmTimes", "CANDIDATES"]

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


def _result(name: str, returned, buf, out):
    """Where op ``name`` left its result: ``buf`` for the in-place op, what it returned for
    ``one_shot_all_reduce``, else ``out``."""
    return buf if name.endswith("_") else (returned if name == "one_shot_all_reduce" else out)


@dataclass
class SymmTimes:
    """What :meth:`SymmBaseline.measure` found for one size: milliseconds per call of every op
    that passed the check, called back to back (``eager``) and replayed from a CUDA graph
    (``graph``, when asked for), by op name; ``reason`` / ``graph_reason``: why the dict is
    empty ("n/a (...)")."""

    eager: dict = field(default_factory=dict)
    graph: dict = field(default_factory=dict)
    reason: str = "n/a (every op failed)"
    graph_reason: str = "n/a (not measured)"

    def fastest(self, graph: bool = False) -> tuple:
        """``(op name, milliseconds per call)`` of the fastest op eagerly (``graph``: replayed
        from a CUDA graph), or ``(None, reason)``."""
        times = self.graph if graph else self.eager
        if not times:
            return None, self.graph_reason if graph else self.reason
        name = min(times, key=times.get)
        return name, times[name]


class SymmBaseline:
    """The torch symmetric-memory ops of ``op`` ("allreduce" or "reducescatter") on ``group``.

    Attributes: ``reason`` (None when usable, else why not), ``ops`` (the chosen op name per
    family, in order), ``families`` (family -> chosen op name, e.g. ``"one-shot"``).
    """

    def __init__(self, op: str, group, device, backend: str, ranks_share_gpu: bool):
        self.op, self.group, self.device = op, group, device
        self.ops: list[str] = []
        self.families: dict[str, str] = {}
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
            for family, names in CANDIDATES[op]:
                have = [n for n in names if hasattr(torch.ops.symm_mem, n)]
                if have:
                    self.ops.append(have[0])
                    self.families[family] = have[0]
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

    def measure(self, x, expect, match: Callable, time_ms: Callable, iters: int,
                graph_time: Callable | None = None) -> SymmTimes:
        """:class:`SymmTimes` of every op whose result ``match(result, expect)`` on a symmetric
        copy of ``x`` (this rank's flat input): ``time_ms(call, iters, group, device)``
        milliseconds per back-to-back call (``_timing.time_ms``), and with ``graph_time``
        (``graph_time(call) -> (milliseconds per call, graph, last captured result)``, e.g.
        ``_timing.graph_ms_per_call``) per call replayed from a CUDA graph, the result checked again
        after the replays (not for the in-place op, whose replays sum their own output).
        Every rank must call it with the same sizes (rendezvous is collective)."""
        import torch

        times = SymmTimes()
        if self.reason is not None:
            times.reason = times.graph_reason = self.reason
            return times
        buf = self.symm_mem.empty(x.numel(), dtype=x.dtype, device=self.device)
        self.symm_mem.rendezvous(buf, self.group_name)
        out = torch.empty(expect.numel(), dtype=x.dtype, device=self.device)
        for name in self.ops:
            buf.copy_(x.reshape(-1))  # the in-place two-shot leaves its result here
            call = _call(name, buf, out, self.group_name)
            ok, why = self._check(name, call, buf, out, expect, match)
            if not _all_ranks(ok, self.group, self.device):
                if not times.eager:
                    times.reason = f"n/a ({name}: {why})"
                continue
            times.eager[name] = time_ms(call, iters, self.group, self.device)
            if graph_time is None:
                continue
            buf.copy_(x.reshape(-1))
            ms, why = None, "wrong result after replays"
            try:
                ms, _, returned = graph_time(call)
                torch.cuda.synchronize(self.device)
                ok = name.endswith("_") or bool(match(_result(name, returned, buf, out).reshape(-1), expect))
            except RuntimeError as e:  # an op this torch cannot capture
                ok, why = False, f"capture: {type(e).__name__}"
            if _all_ranks(ok, self.group, self.device):
                times.graph[name] = ms
            elif not times.graph:
                times.graph_reason = f"n/a ({name} graph: {why})"
        if not times.eager:
            times.graph_reason = times.reason
        del buf, out
        return times

    def _check(self, name: str, call, buf, out, expect, match) -> tuple:
        """``(ok, why not)`` of one eager call of op ``name`` against ``expect``."""
        import torch

        try:
            returned = call()
            torch.cuda.synchronize(self.device)
            return bool(match(_result(name, returned, buf, out).reshape(-1), expect)), "wrong result"
        except (RuntimeError, ValueError, TypeError) as e:
            return False, type(e).__name__


def _all_ranks(ok: bool, group, device) -> bool:
    """Whether ``ok`` holds on every rank (a MIN all-reduce; every rank must call it)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
