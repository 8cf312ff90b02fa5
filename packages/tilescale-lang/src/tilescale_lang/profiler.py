"""Intra-kernel event profiler: ``T.profile_event`` records timestamps inside a kernel, and
:class:`EventProfiler` owns the buffer and turns it into spans and a Chrome/Perfetto trace.

Typical use (one row per block, up to ``capacity`` events per block)::

    prof = EventProfiler(blocks=132, capacity=64, device="cuda")

    @T.prim_func
    def k(..., Prof: T.Tensor(prof.shape, "uint64")):
        with T.Kernel(132, threads=256) as bx:
            if T.get_thread_binding() == 0:
                T.profile_event(Prof, task=0, is_start=True)     # e.g. "wait"
            ...
            if T.get_thread_binding() == 0:
                T.profile_event(Prof, task=0, is_start=False)

    prof.reset(); kernel(..., prof.buffer); torch.cuda.synchronize()
    prof.save("trace-rank0.json", task_names=["wait", "put"], rank=rank)
    # several ranks: merge_chrome_traces([...], "trace.json"), open in ui.perfetto.dev

Device side (``include/tilescale/profiler.cuh``): the calling thread takes a slot in its
block's row with a 64-bit atomic add and stores the task id, start/end, its warp and SM and
``%globaltimer`` (nanoseconds, one clock for every SM of the GPU; its update granularity is
hardware dependent, commonly 32 ns to 1 µs). Each call costs one atomic and two stores;
``enabled=False`` emits nothing, so a profiled kernel can be built with profiling compiled out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tilescale_core.interface import check_positive_int

from ._tvm import tirx

from . import validation as V

#: Bit layout of an event's tag word (see profiler.cuh).
_TASK_MASK = (1 << 32) - 1
_START_BIT = 32
_WARP_SHIFT, _SM_SHIFT, _FIELD_MASK = 33, 43, 0x3FF
_WRITTEN_BIT = 63
#: A trace's thread id of (block, warp) is ``block * TID_BLOCK_STRIDE + warp``.
TID_BLOCK_STRIDE = 1024


# ------------------------------------------------------------------------------ device side
def profile_event(buf, task, is_start=True, enabled=True, slot=None):
    """Record an event in this block's row of ``buf`` (call from one thread per event).

    Args:
        buf: the profiler buffer, a global ``uint64`` tensor of shape ``(rows, 1 + 2 * capacity)``
            (``EventProfiler.shape``); the block with linear index ``b`` writes row ``b``, so
            ``rows`` must be at least the grid size.
        task: task id, an integer expression in ``[0, 2**32)`` (names are given on the host).
        is_start: compile-time bool, True for the start of the task, False for its end.
        enabled: compile-time bool; False emits nothing (profiling compiled out).
        slot: None (default): the event takes the row's next slot with a 64-bit atomic add,
            so any threads of a block may record concurrently, but the recording thread waits
            for the atomic's result (a memory round trip per event). An integer (expression)
            in ``[0, capacity)``: the event goes into that slot with two plain stores and no
            wait, for timelines of short phases; the caller gives every event of a block its
            own slot (a slot past the capacity records nothing) and does not mix the two ways
            in one buffer.

    Raises:
        TypeError / ValueError naming ``buf``, ``task``, ``is_start``, ``enabled`` or ``slot``.
    """
    if not V.const_bool(enabled, "enabled"):
        return tirx.const(0, "int32")
    start = V.const_bool(is_start, "is_start")
    op = V.operand(buf, "buf")
    if op.dtype != "uint64":
        raise TypeError(f"buf must be a uint64 buffer (EventProfiler.buffer), got {op.dtype}")
    V.require_global(op, "buf", "(the host reads it after the kernel)")
    capacity = _capacity(buf)
    if isinstance(task, bool) or not isinstance(task, (int, tirx.PrimExpr)) or (
            isinstance(task, tirx.PrimExpr) and not V.is_int_dtype(task.dtype)):
        raise TypeError(f"task must be an integer (expression), got {task!r}")
    if isinstance(task, int) and not 0 <= task <= _TASK_MASK:
        raise ValueError(f"task must be in [0, 2**32), got {task}")
    flag = tirx.const(1 if start else 0, "bool")
    if slot is None:
        return V.extern("handle", f"tilescale::profile_event<{capacity}>", op.ptr, V.cast_to(task, "uint32", "task"), flag)
    if isinstance(slot, bool) or not isinstance(slot, (int, tirx.PrimExpr)) or (
            isinstance(slot, tirx.PrimExpr) and not V.is_int_dtype(slot.dtype)):
        raise TypeError(f"slot must be None or an integer (expression), got {slot!r}")
    if isinstance(slot, int) and not 0 <= slot < capacity:
        raise ValueError(f"slot must be in [0, {capacity}) (the buffer's capacity), got {slot}")
    return V.extern("handle", f"tilescale::profile_event_at<{capacity}>", op.ptr, V.cast_to(slot, "uint32", "slot"),
                    V.cast_to(task, "uint32", "task"), flag)


def _capacity(buf: Any) -> int:
    """Events per row of a ``(rows, 1 + 2 * capacity)`` profiler buffer (static shape)."""
    if not isinstance(buf, tirx.Buffer):
        raise TypeError("buf must be the profiler buffer itself (a T.Tensor parameter), not an element, region or pointer")
    buffer = buf
    shape = [int(e.value) if isinstance(e, tirx.IntImm) else None for e in buffer.shape]
    if len(shape) != 2 or shape[1] is None or shape[1] < 3 or shape[1] % 2 == 0:
        raise ValueError(f"buf must have shape (rows, 1 + 2 * capacity) with a static odd second extent >= 3, got {list(buffer.shape)}")
    return (shape[1] - 1) // 2


# ------------------------------------------------------------------------------ host side
@dataclass(frozen=True)
class Event:
    """One recorded event. ``time_ns``: ``%globaltimer`` of the GPU (nanoseconds)."""

    block: int
    warp: int
    sm: int
    task: int
    is_start: bool
    time_ns: int


@dataclass(frozen=True)
class Span:
    """A start/end pair of one task on one (block, warp); times in nanoseconds."""

    block: int
    warp: int
    sm: int
    task: int
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        """``end_ns - start_ns``."""
        return self.end_ns - self.start_ns


def decode(rows: Sequence[Sequence[int]]) -> tuple[list[Event], int]:
    """Events of a profiler buffer given as rows of unsigned 64-bit ints, in time order per
    block, and the number of events dropped because a row was full. Every slot whose tag has
    the written bit counts (slots taken by the atomic counter or chosen with ``slot=``); a
    slot counted but not yet written (read while the kernel ran) is skipped."""
    events, dropped = [], 0
    for block, row in enumerate(rows):
        capacity = (len(row) - 1) // 2
        count = int(row[0]) & ((1 << 64) - 1)
        dropped += max(0, count - capacity)
        for k in range(capacity):
            tag, t = int(row[1 + 2 * k]) & ((1 << 64) - 1), int(row[2 + 2 * k]) & ((1 << 64) - 1)
            if not tag >> _WRITTEN_BIT & 1:
                continue
            events.append(Event(block, tag >> _WARP_SHIFT & _FIELD_MASK, tag >> _SM_SHIFT & _FIELD_MASK,
                                tag & _TASK_MASK, bool(tag >> _START_BIT & 1), t))
    events.sort(key=lambda e: (e.block, e.time_ns))
    return events, dropped


def pair_spans(events: Iterable[Event]) -> tuple[list[Span], list[Event]]:
    """Match every end with the latest open start of the same (block, warp, task); returns
    the spans (sorted by start) and the events left unmatched."""
    open_starts: dict[tuple[int, int, int], list[Event]] = {}
    spans, unmatched = [], []
    for e in sorted(events, key=lambda e: (e.time_ns, not e.is_start)):
        key = (e.block, e.warp, e.task)
        if e.is_start:
            open_starts.setdefault(key, []).append(e)
        elif open_starts.get(key):
            s = open_starts[key].pop()
            spans.append(Span(e.block, e.warp, s.sm, e.task, s.time_ns, e.time_ns))
        else:
            unmatched.append(e)
    for starts in open_starts.values():
        unmatched.extend(starts)
    spans.sort(key=lambda s: (s.start_ns, s.block, s.warp))
    return spans, sorted(unmatched, key=lambda e: e.time_ns)


def chrome_trace(spans: Sequence[Span], task_names: Sequence[str] | None = None, rank: int = 0,
                 origin_ns: int | None = None) -> dict:
    """A Chrome/Perfetto trace (``{"traceEvents": [...]}``): one complete event ("ph": "X")
    per span, ``pid`` = rank, ``tid`` = block * :data:`TID_BLOCK_STRIDE` + warp (named "block B warp W"),
    microseconds from ``origin_ns`` (default: the earliest start)."""
    names = list(task_names or [])
    origin = min((s.start_ns for s in spans), default=0) if origin_ns is None else origin_ns
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    threads = sorted({(s.block, s.warp) for s in spans})
    for block, warp in threads:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": block * TID_BLOCK_STRIDE + warp,
                       "args": {"name": f"block {block} warp {warp}"}})
    for s in spans:
        events.append({
            "name": names[s.task] if s.task < len(names) else f"task {s.task}",
            "ph": "X", "pid": rank, "tid": s.block * TID_BLOCK_STRIDE + s.warp,
            "ts": (s.start_ns - origin) / 1000.0, "dur": s.duration_ns / 1000.0,
            "args": {"sm": s.sm, "task": s.task},
        })
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def merge_chrome_traces(traces: Iterable[dict | str], path: str | None = None) -> dict:
    """Concatenate the events of several traces (dicts or JSON file paths), e.g. one per
    rank; writes the result to ``path`` when given. Times are kept as they are: use one
    ``origin_ns`` for every rank (``%globaltimer`` is one clock per GPU, not across GPUs)."""
    merged: list[dict] = []
    for t in traces:
        if isinstance(t, str):
            with open(t) as f:
                t = json.load(f)
        merged.extend(t["traceEvents"])
    out = {"traceEvents": merged, "displayTimeUnit": "ns"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f)
    return out


def render_timeline(trace: dict, width: int = 64) -> str:
    """A text picture of a Chrome trace (:func:`chrome_trace` / :func:`merge_chrome_traces`):
    one line per (rank, block, warp) track, time running left to right over ``width``
    columns from the earliest start to the latest end; a column shows the first letter of
    the task that covers most of it (``.``: idle), and a legend names the letters.

    Args:
        trace: ``{"traceEvents": [...]}`` with complete events (``"ph": "X"``; ``ts`` and
            ``dur`` in microseconds).
        width: columns of the time axis (>= 8).

    Raises:
        ValueError: ``width`` below 8, or a trace without complete events.
    """
    if not isinstance(width, int) or isinstance(width, bool) or width < 8:
        raise ValueError(f"width must be an int >= 8, got {width!r}")
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not spans:
        raise ValueError("trace has no complete events (\"ph\": \"X\") to draw")
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    scale = width / max(t1 - t0, 1e-9)
    letters: dict[str, str] = {}
    for name in sorted({e["name"] for e in spans}):
        letter = next((c for c in name.lower() if c.isalnum() and c not in letters.values()), "?")
        letters[name] = letter
    cover: dict[tuple[int, int], list[dict[str, float]]] = {}
    for e in spans:
        key = (e["pid"], e["tid"])
        cols = cover.setdefault(key, [dict() for _ in range(width)])
        start, end = (e["ts"] - t0) * scale, (e["ts"] + e["dur"] - t0) * scale
        for c in range(int(start), min(width, int(end) + 1)):
            overlap = min(end, c + 1) - max(start, c)
            if overlap > 0 or (start == end and c == int(start)):
                cols[c][e["name"]] = cols[c].get(e["name"], 0.0) + max(overlap, 1e-9)
    lines = [f"{'track':<24}|{'':-<{width}}| {t1 - t0:.1f} us"]
    for pid, tid in sorted(cover):
        row = "".join(letters[max(col, key=col.get)] if col else "." for col in cover[(pid, tid)])
        block, warp = divmod(tid, TID_BLOCK_STRIDE)
        lines.append(f"{f'rank {pid} block {block} warp {warp}':<24}|{row}|")
    lines.append("legend: " + ", ".join(f"{letter} = {name}" for name, letter in letters.items()) + ", . = idle")
    return "\n".join(lines)


class EventProfiler:
    """Owns a zeroed profiler buffer and decodes it.

    Args:
        blocks: rows, one per block of the profiled grid (at least the grid size).
        capacity: events each block can record per launch (later ones are counted as dropped).
        device: where the buffer lives (the kernel's device).

    Attributes: ``buffer`` (``torch.uint64``, ``shape``), ``shape`` (``(blocks, 1 + 2 *
    capacity)``, for the kernel's ``T.Tensor`` annotation), ``blocks``, ``capacity``.
    """

    def __init__(self, blocks: int, capacity: int = 256, device: Any = "cuda"):
        import torch

        blocks = check_positive_int("blocks", blocks)
        capacity = check_positive_int("capacity", capacity)
        self.blocks, self.capacity = blocks, capacity
        self.shape = (blocks, 1 + 2 * capacity)
        self.buffer = torch.zeros(self.shape, dtype=torch.uint64, device=device)

    def reset(self) -> None:
        """Zero the buffer (before each profiled launch, on the launch's stream)."""
        self.buffer.zero_()

    def rows(self) -> list[list[int]]:
        """The buffer as rows of unsigned ints (copies to the host; synchronise first)."""
        import torch

        return [[v & ((1 << 64) - 1) for v in row] for row in self.buffer.view(torch.int64).cpu().tolist()]

    def events(self) -> tuple[list[Event], int]:
        """``decode(self.rows())``: the events and the number dropped."""
        return decode(self.rows())

    def spans(self) -> tuple[list[Span], list[Event]]:
        """``pair_spans`` of the recorded events: spans and unmatched events."""
        return pair_spans(self.events()[0])

    def chrome_trace(self, task_names: Sequence[str] | None = None, rank: int = 0,
                     origin_ns: int | None = None) -> dict:
        """:func:`chrome_trace` of the recorded spans."""
        return chrome_trace(self.spans()[0], task_names, rank, origin_ns)

    def save(self, path: str, task_names: Sequence[str] | None = None, rank: int = 0,
             origin_ns: int | None = None) -> dict:
        """Write :meth:`chrome_trace` as JSON to ``path`` (open it in ui.perfetto.dev or
        chrome://tracing) and return it."""
        trace = self.chrome_trace(task_names, rank, origin_ns)
        with open(path, "w") as f:
            json.dump(trace, f)
        return trace
