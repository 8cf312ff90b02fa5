"""The benchmarks' timing harness: every timing of :mod:`tilescale_examples.benchmarks` goes
through :mod:`tilescale_host.bench` (``perf_fn``, ``do_bench``, ``perf_rounds``), named here
by what it measures. Every time is in milliseconds per call.

* :func:`time_ms`: a collective on every rank: 2 warm-up calls, the ranks together
  (barrier), ``iters`` back-to-back calls between one CUDA event pair on the device's
  current stream; the slowest rank's time (every rank gets the same number). A wait for the
  GPU fails after :data:`WAIT_S` seconds instead of hanging on a lost signal.
* :func:`interleaved_ms`: several such columns in rounds that time each in turn (each
  timing as :func:`time_ms`), the median round per column: a drift of the clocks during
  the run reaches every column alike.
* :func:`local_ms`: this rank alone: the median of ``iters`` calls, each timed with its own
  event pair from an idle GPU (one warm-up call).
* :func:`local_rounds`: columns in rounds (each timing :func:`local_ms` after a barrier of
  the ranks, when a process group is initialised), this rank's median round per column.
* :func:`held_ms_per_launch`: GPU time per launch of back-to-back launches behind a stream
  hold (a spin kernel holds the stream while the host enqueues the start event, the launches
  and the end event), so the host's launch cost is not counted.
* :func:`host_us_rounds`: host microseconds per call of several functions, their best of
  alternating rounds (back-to-back calls, or each call's enqueue cost alone).
* :func:`capture_calls` / :func:`graph_ms_per_call` / :func:`poison_`: a call captured
  into a CUDA graph and its replays timed.

Repeated launches on the same buffers find them in L2 when they fit (H200: 50 MB): a baseline
timed the same way on buffers of the same size sees the same effect.

These replace the benchmarks' own CUDA-event loops and measure what they measured; what
``tilescale_host.bench`` adds: every phase starts from an idle GPU (a wait before the
barriers, which cost no timed interval), the ranks' times are gathered with ``all_gather``
(the same maximum the former ``all_reduce(MAX)`` gave), a stream hold is at most 1 s when
first sized (then doubled while it runs out, at most four attempts, the last one warning).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tilescale_host.bench import do_bench, perf_fn, perf_rounds

__all__ = ["WAIT_S", "time_ms", "interleaved_ms", "local_ms", "local_rounds", "held_ms_per_launch",
           "host_us_rounds", "poison_", "capture_calls", "graph_ms_per_call"]

#: Seconds a wait for the GPU may take in a collective's timing before it fails.
WAIT_S = 300.0
#: Warm-up calls before a collective's timed calls.
WARMUP = 2


def _stream(device):
    import torch

    return torch.cuda.current_stream(device)


def time_ms(fn: Callable[[], object], iters: int, group, device) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls of ``fn`` after :data:`WARMUP`
    warm-up calls, timed with CUDA events on ``device``'s current stream after a barrier of
    ``group``; the slowest rank's time (``perf_fn``)."""
    return perf_fn(fn, WARMUP, iters, group=group, stream=_stream(device), timeout=WAIT_S)[1]


def interleaved_ms(calls: Mapping[str, Callable[[], object]], iters: int, rounds: int, group, device) -> dict:
    """``{name: ms per call}`` of every function of ``calls``: ``rounds`` rounds that time each
    in turn (as :func:`time_ms`: warm-up, barrier, ``iters`` back-to-back calls), the median
    over the rounds of the slowest rank's time (``perf_rounds``)."""
    def timer(fn):
        return perf_fn(fn, WARMUP, iters, group=group, aggregate="none", stream=_stream(device), timeout=WAIT_S)[1]

    return perf_rounds(dict(calls), rounds, warmup=0, timer=timer, group=group, timeout=WAIT_S)


def local_ms(fn: Callable[[], object], iters: int) -> float:
    """This rank's median milliseconds of ``iters`` calls of ``fn``, each between its own
    event pair and started on an idle GPU (after one warm-up call; ``do_bench``, no L2 flush)."""
    import torch

    return do_bench(fn, 1, iters, flush_l2=False, group="local", before=torch.cuda.synchronize)


def local_rounds(columns: Sequence[tuple[str, Callable[[], object] | None]], rounds: int, iters: int,
                 group=None) -> dict:
    """``{name: ms}`` of every ``(name, fn)`` column: ``rounds`` rounds that time each in turn
    (:func:`local_ms` after a barrier of ``group``, default the WORLD group when a process
    group is initialised), this rank's median round per column. A column whose ``fn`` is None
    is not run on this rank (NaN) but its barriers are joined."""
    return perf_rounds(dict(columns), rounds, warmup=0, timer=lambda fn: local_ms(fn, iters), group=group,
                       aggregate="none")


def held_ms_per_launch(launch: Callable[[], object], launches: int, device) -> float:
    """Milliseconds of GPU time per call of ``launch`` (which enqueues work on ``device``'s
    current stream): ``launches`` back-to-back calls behind a stream hold sized from one
    untimed call, doubled and repeated when it ran out (``perf_fn(hold=True)``)."""
    return perf_fn(launch, 0, launches, group="local", stream=_stream(device), hold=True)[1]


def host_us_rounds(fns: Sequence[Callable[[], object]], calls: int, rounds: int = 5, warmup: int = 100,
                   clock: str = "host") -> list:
    """Host microseconds per call of each of ``fns``: ``warmup`` calls of each, then ``rounds``
    rounds that time ``calls`` calls of each in turn, the first one alternating; each
    function's best round (``perf_rounds``). ``clock="host"``: back-to-back calls, from an idle
    GPU to the end of their GPU work (paced by the GPU where its work per call takes longer);
    ``"enqueue"``: each call alone from an idle GPU, its GPU work not waited for (the host's
    cost of making it)."""
    times = perf_rounds(dict(enumerate(fns)), rounds, warmup=warmup, rep=calls, clock=clock, alternate=True,
                        return_mode="min", group="local")
    return [ms * 1e3 for ms in times.values()]


# ------------------------------------------------------------------------------ CUDA graphs
def poison_(t) -> None:
    """Fill tensor ``t`` with values no check accepts: NaN for floating point, the dtype's
    largest value for integers."""
    import torch

    t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)


def capture_calls(fn: Callable[[], object], calls: int) -> tuple:
    """``(graph, result)``: one eager call of ``fn`` (warm-up: compile, first-call setup), then
    ``calls`` calls captured into one ``torch.cuda.CUDAGraph`` on the current device; ``result``
    is what the last captured call returned. Its tensors (a tensor, or a list or tuple of them)
    are poisoned (:func:`poison_`) after the capture, so only replays write them: a check of
    ``result`` after the replays sees what the graph computed. Collective ``fn``: every rank
    captures the same calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    result = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            result = fn()
    for t in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(t, torch.Tensor):
            poison_(t)
    return graph, result


def graph_ms_per_call(fn: Callable[[], object], calls: int, replays: int, timer, capture=None) -> tuple:
    """``(milliseconds per call, graph, result)`` of ``fn`` replayed from a CUDA graph:
    ``capture(fn, calls)`` (default :func:`capture_calls`: one eager call, then ``calls`` calls
    captured into one graph), ``timer(graph.replay, replays)`` milliseconds per replay (e.g.
    ``lambda f, n: time_ms(f, n, group, device)``, or :func:`held_ms_per_launch` with a
    device), divided by ``calls``. ``result`` is the last captured call's return value
    (written by every replay)."""
    if calls < 1 or replays < 1:
        raise ValueError(f"calls and replays must be >= 1, got {calls} and {replays}")
    graph, result = (capture or capture_calls)(fn, calls)
    return timer(graph.replay, replays) / calls, graph, result
