"""The intra-kernel profiler: T.profile_event codegen, PTX and rejections; the host decoder,
span pairing and Chrome trace on synthetic buffers (CPU). The GPU run is in test_gpu.py."""

# (no `from __future__ import annotations`: TileLang evaluates the kernels' annotations)

import json

import pytest
import tilelang.language as T
import torch
from lang_helpers import kernel_body, lower_source, needs_toolkit, nvcc_ptx

from tilescale_lang import profiler as P


def _kernel(body, shape=(4, 17), dtype="uint64"):
    @T.prim_func
    def k(A: T.Tensor((128,), "float32"), Prof: T.Tensor(shape, dtype)):
        with T.Kernel(4, threads=128) as bx:
            tx = T.get_thread_binding()
            if tx % 32 == 0:
                body(Prof, bx, tx)
            A[tx] = A[tx] * 2.0

    return k


# ------------------------------------------------------------------------------ device side
def test_codegen_capacity_task_and_start_flag():
    @T.prim_func
    def k(A: T.Tensor((128,), "float32"), Prof: T.Tensor((4, 17), "uint64")):
        with T.Kernel(4, threads=128) as bx:
            tx = T.get_thread_binding()
            if tx % 32 == 0:
                T.profile_event(Prof, 3, is_start=True)
            A[tx] = A[tx] * 2.0
            if tx % 32 == 0:
                T.profile_event(Prof, bx + 1, is_start=False)
                T.profile_event(Prof, 9, enabled=False)

    body_src = kernel_body(lower_source(k))
    assert "tilescale::profile_event<8>((&(Prof[0])), (uint)3, (bool)1);" in body_src  # (17 - 1) / 2
    assert "tilescale::profile_event<8>((&(Prof[0])), ((uint)(((int)blockIdx.x) + 1)), (bool)0);" in body_src
    assert body_src.count("profile_event") == 2  # enabled=False emits nothing


@needs_toolkit
def test_ptx_reads_globaltimer_and_smid_and_takes_slot_atomically(tmp_path):
    @T.prim_func
    def k(Prof: T.Tensor((2, 9), "uint64")):
        with T.Kernel(2, threads=32) as _:
            T.profile_event(Prof, 1)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    for instr in ("%globaltimer", "%smid", "atom.global.add.u64"):
        assert instr in ptx, instr


def test_codegen_of_a_caller_chosen_slot_takes_no_counter():
    @T.prim_func
    def k(A: T.Tensor((128,), "float32"), Prof: T.Tensor((4, 17), "uint64")):
        with T.Kernel(4, threads=128) as bx:
            tx = T.get_thread_binding()
            if tx == 0:
                T.profile_event(Prof, 3, slot=0)
            A[tx] = A[tx] * 2.0
            if tx % 32 == 0:
                T.profile_event(Prof, 3, is_start=False, slot=1 + tx // 32)

    body_src = kernel_body(lower_source(k))
    assert "tilescale::profile_event_at<8>((&(Prof[0])), (uint)0, (uint)3, (bool)1);" in body_src
    assert "tilescale::profile_event_at<8>((&(Prof[0])), ((uint)((((int)threadIdx.x) >> 5) + 1)), (uint)3, (bool)0);" in body_src
    assert "tilescale::profile_event<" not in body_src


@needs_toolkit
def test_ptx_of_a_caller_chosen_slot_has_no_atomic(tmp_path):
    @T.prim_func
    def k(Prof: T.Tensor((2, 9), "uint64")):
        with T.Kernel(2, threads=32) as _:
            T.profile_event(Prof, 1, slot=2)

    ptx = nvcc_ptx(lower_source(k), tmp_path)
    assert "%globaltimer" in ptx and "%smid" in ptx
    assert "atom." not in ptx and "red." not in ptx


@pytest.mark.parametrize("body,shape,dtype,exc,match", [
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, slot=8), (4, 17), "uint64", ValueError, r"slot must be in \[0, 8\) \(the buffer's capacity\), got 8"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, slot=-1), (4, 17), "uint64", ValueError, r"slot must be in \[0, 8\)"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, slot=1.0), (4, 17), "uint64", TypeError, "slot must be None or an integer"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, slot=True), (4, 17), "uint64", TypeError, "slot must be None or an integer"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1), (4, 17), "uint32", TypeError, "buf must be a uint64 buffer"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1), (68,), "uint64", ValueError, r"shape \(rows, 1 \+ 2 \* capacity\)"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1), (4, 16), "uint64", ValueError, "static odd second extent"),
    (lambda Prof, bx, tx: T.profile_event(Prof[0, 0], 1), (4, 17), "uint64", TypeError, "profiler buffer itself"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1.5), (4, 17), "uint64", TypeError, "task must be an integer"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 2**32), (4, 17), "uint64", ValueError, r"task must be in \[0, 2\*\*32\)"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, is_start=tx == 0), (4, 17), "uint64", TypeError, "is_start must be a compile-time boolean"),
    (lambda Prof, bx, tx: T.profile_event(Prof, 1, enabled="yes"), (4, 17), "uint64", TypeError, "enabled must be a compile-time boolean"),
])
def test_rejections_name_the_argument(body, shape, dtype, exc, match):
    with pytest.raises(exc, match=match):
        _kernel(body, shape, dtype)


def test_shared_buffer_rejected():
    with pytest.raises(ValueError, match="buf must be in global memory"):

        @T.prim_func
        def k(A: T.Tensor((8,), "float32")):
            with T.Kernel(1, threads=32) as _:
                s = T.alloc_shared((2, 5), "uint64")
                T.profile_event(s, 0)


# ------------------------------------------------------------------------------ host side
def tag(task, start, warp=0, sm=0, written=True):
    """The tag word profiler.cuh writes."""
    return task | (int(start) << 32) | (warp << 33) | (sm << 43) | (int(written) << 63)


def rows_of(events_per_block, capacity=4):
    """Rows of a buffer holding the given (tag, time) pairs; the counter is their number."""
    rows = []
    for evs in events_per_block:
        row = [len(evs)] + [0] * (2 * capacity)
        for k, (t, ns) in enumerate(evs[:capacity]):
            row[1 + 2 * k], row[2 + 2 * k] = t, ns
        rows.append(row)
    return rows


def test_decode_fields_order_and_dropped_events():
    rows = rows_of([
        [(tag(7, True, warp=1, sm=131), 2000), (tag(7, False, warp=1, sm=131), 5000)],
        [(tag(2, False, warp=3, sm=5), 900), (tag(2, True, warp=3, sm=5), 100)]
        + [(tag(4, True), 1000 + i) for i in range(4)],  # 6 counted, capacity 4: 2 dropped
        [],
    ])
    events, dropped = P.decode(rows)
    assert dropped == 2
    assert events[0] == P.Event(block=0, warp=1, sm=131, task=7, is_start=True, time_ns=2000)
    assert [(e.block, e.time_ns) for e in events] == [(0, 2000), (0, 5000), (1, 100), (1, 900), (1, 1000), (1, 1001)]
    assert events[2].task == 2 and events[2].is_start and events[2].sm == 5 and events[2].warp == 3


def test_decode_skips_slots_counted_but_not_written():
    rows = rows_of([[(tag(1, True), 10), (tag(1, False, written=False), 0)]])
    events, dropped = P.decode(rows)
    assert len(events) == 1 and dropped == 0


def test_decode_reads_caller_chosen_slots_without_a_count():
    row = [0] * (1 + 2 * 4)  # profile_event_at leaves the counter at 0
    row[1 + 2 * 2], row[2 + 2 * 2] = tag(5, False), 700
    row[1 + 2 * 0], row[2 + 2 * 0] = tag(5, True), 300
    events, dropped = P.decode([row])
    assert dropped == 0 and [(e.task, e.is_start, e.time_ns) for e in events] == [(5, True, 300), (5, False, 700)]
    spans, unmatched = P.pair_spans(events)
    assert [s.duration_ns for s in spans] == [400] and not unmatched


def test_pair_spans_nested_and_unmatched():
    evs = [
        P.Event(0, 0, 3, 1, True, 100), P.Event(0, 0, 3, 1, True, 200),  # nested starts
        P.Event(0, 0, 3, 1, False, 250), P.Event(0, 0, 3, 1, False, 400),
        P.Event(1, 2, 4, 1, False, 50),  # an end without a start
        P.Event(1, 2, 4, 9, True, 60),  # a start without an end
        P.Event(0, 1, 3, 1, True, 150), P.Event(0, 1, 3, 1, False, 175),  # another warp
    ]
    spans, unmatched = P.pair_spans(evs)
    assert [(s.warp, s.start_ns, s.end_ns) for s in spans] == [(0, 100, 400), (1, 150, 175), (0, 200, 250)]
    assert spans[0].duration_ns == 300 and spans[0].sm == 3
    assert [(e.block, e.task, e.is_start) for e in unmatched] == [(1, 1, False), (1, 9, True)]


def test_chrome_trace_and_merge(tmp_path):
    spans = [P.Span(0, 0, 7, 0, 1_000, 3_500), P.Span(2, 1, 9, 5, 2_000, 2_100)]
    trace = P.chrome_trace(spans, ["wait", "put"], rank=3)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "rank 3"}} in meta
    assert {e["args"]["name"] for e in meta if e["name"] == "thread_name"} == {"block 0 warp 0", "block 2 warp 1"}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs[0] == {"name": "wait", "ph": "X", "pid": 3, "tid": 0, "ts": 0.0, "dur": 2.5, "args": {"sm": 7, "task": 0}}
    assert xs[1]["name"] == "task 5" and xs[1]["tid"] == 2 * 1024 + 1 and xs[1]["ts"] == 1.0
    assert P.chrome_trace(spans, origin_ns=0)["traceEvents"][-1]["ts"] == 2.0
    path = tmp_path / "a.json"
    path.write_text(json.dumps(trace))
    merged = P.merge_chrome_traces([str(path), P.chrome_trace(spans, rank=4)], str(tmp_path / "m.json"))
    assert len(merged["traceEvents"]) == 2 * len(trace["traceEvents"])
    assert json.loads((tmp_path / "m.json").read_text(encoding="utf-8")) == merged


def test_event_profiler_buffer_round_trip(tmp_path):
    prof = P.EventProfiler(blocks=2, capacity=3, device="cpu")
    assert prof.shape == (2, 7) and prof.buffer.dtype == torch.uint64 and not prof.buffer.view(torch.int64).any()
    raw = prof.buffer.view(torch.int64)  # what the kernel writes: the counter, tag, time
    raw[1, 0], raw[1, 1], raw[1, 2], raw[1, 3], raw[1, 4] = 2, tag(0, True, sm=2) - (1 << 64), 10_000, tag(0, False, sm=2) - (1 << 64), 14_000
    events, dropped = prof.events()
    assert dropped == 0 and [(e.block, e.sm, e.is_start, e.time_ns) for e in events] == [(1, 2, True, 10_000), (1, 2, False, 14_000)]
    spans, unmatched = prof.spans()
    assert unmatched == [] and spans[0].duration_ns == 4_000
    trace = prof.save(str(tmp_path / "t.json"), ["copy"], rank=1)
    assert json.loads((tmp_path / "t.json").read_text(encoding="utf-8")) == trace
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["copy"]
    prof.reset()
    assert prof.events() == ([], 0)


@pytest.mark.parametrize("kwargs,match", [(dict(blocks=0), "blocks must be a positive int"),
                                          (dict(blocks=2, capacity=True), "capacity must be a positive int")])
def test_event_profiler_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        P.EventProfiler(device="cpu", **kwargs)


def test_render_timeline_draws_each_track_and_names_the_letters():
    spans = [P.Span(0, 0, 5, 0, 1_000, 5_000), P.Span(0, 0, 5, 1, 5_000, 9_000), P.Span(1, 0, 7, 0, 1_000, 3_000)]
    one = P.chrome_trace(spans, ["put", "wait"], rank=0, origin_ns=0)
    two = P.chrome_trace([P.Span(0, 0, 9, 1, 2_000, 9_000)], ["put", "wait"], rank=1, origin_ns=0)
    text = P.render_timeline(P.merge_chrome_traces([one, two]), width=16)
    lines = text.splitlines()
    assert lines[0].endswith("| 8.0 us")
    row = dict((line[:24].strip(), line[25:41]) for line in lines[1:-1])
    assert row["rank 0 block 0 warp 0"] == "ppppppppwwwwwwww"
    assert row["rank 0 block 1 warp 0"] == "pppp............"
    assert row["rank 1 block 0 warp 0"] == "..wwwwwwwwwwwwww"
    assert lines[-1] == "legend: p = put, w = wait, . = idle"
    with pytest.raises(ValueError, match="width"):
        P.render_timeline(one, width=4)
    with pytest.raises(ValueError, match="no complete events"):
        P.render_timeline({"traceEvents": []})
