"""Latency of host-enqueued stream signals against one-thread kernel flag writes, in µs.

``python -m tilescale_examples.benchmarks.signals [--rounds 200] [--samples 20]``

Two measurements, each timed on the GPU with CUDA events around a batch of ``rounds``
operations (a spin kernel placed first on the timed stream hides the host's enqueue time, so
the numbers are device-side latencies):

* flag write: back-to-back writes of one int32 flag on one stream, ``set_signal``
  (cuStreamWriteValue32) against ``flag.fill_(i)`` (a one-thread-block torch kernel);
* ping-pong round trip between streams A and B: with memops, A sets ``ab`` and waits for
  ``ba`` while B waits for ``ab`` and sets ``ba`` (``set_signal`` / ``stream_wait_eq``); with kernels,
  each side writes its flag with ``fill_`` and the other side waits on a CUDA event recorded
  after it (``Stream.wait_event``), the usual way to order torch work across streams.

The table reports the median over ``samples`` batches, per operation or round, and the ratio
memop / kernel (below 1: the host-enqueued signal is faster).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["main", "measure"]

#: Milliseconds of GPU spinning placed before each timed batch to cover the enqueue time.
LEAD_MS = 20


def _timed(stream, enqueue: Callable[[], None], rounds: int, lead_cycles: int) -> float:
    """Device time of ``enqueue()``'s batch on ``stream``, in µs per round."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(lead_cycles)
        start.record(stream)
        enqueue()
        end.record(stream)
    from tilescale_host import synchronize_streams

    synchronize_streams([stream], timeout=60.0)  # a lost signal fails the run instead of hanging it
    return start.elapsed_time(end) * 1000.0 / rounds


class _Bench:
    """Flags, streams and a round counter shared by the four measurements."""

    def __init__(self, rounds: int):
        import torch

        from tilescale_host.utils import get_max_gpu_clock_rate_in_khz

        self.rounds = rounds
        self.a, self.b = torch.cuda.Stream(), torch.cuda.Stream()
        self.ab = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.ba = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.ev_a, self.ev_b = torch.cuda.Event(), torch.cuda.Event()
        self.lead = LEAD_MS * get_max_gpu_clock_rate_in_khz(torch.cuda.current_device())
        self.value = 0
        torch.cuda.synchronize()  # the zero fills run on the default stream, before A and B use the flags

    def _next(self) -> int:
        self.value += 1
        return self.value

    def memop_writes(self) -> None:
        from tilescale_host import set_signal

        for _ in range(self.rounds):
            set_signal(self.ab, self._next(), self.a)

    def kernel_writes(self) -> None:
        for _ in range(self.rounds):
            self.ab.fill_(self._next())

    def memop_ping_pong(self) -> None:
        from tilescale_host import set_signal, stream_wait_eq

        for _ in range(self.rounds):
            v = self._next()
            set_signal(self.ab, v, self.a)
            stream_wait_eq(self.ab, v, self.b)
            set_signal(self.ba, v, self.b)
            stream_wait_eq(self.ba, v, self.a)

    def kernel_ping_pong(self) -> None:
        import torch

        for _ in range(self.rounds):
            v = self._next()
            self.ab.fill_(v)  # on A (the caller's current stream)
            self.ev_a.record(self.a)
            self.b.wait_event(self.ev_a)
            with torch.cuda.stream(self.b):
                self.ba.fill_(v)
            self.ev_b.record(self.b)
            self.a.wait_event(self.ev_b)

    def median_us(self, enqueue: Callable[[], None], samples: int) -> float:
        """Median over ``samples`` batches (after one warm-up batch) in µs per round."""
        _timed(self.a, enqueue, self.rounds, self.lead)
        return statistics.median(_timed(self.a, enqueue, self.rounds, self.lead) for _ in range(samples))


def measure(rounds: int = 200, samples: int = 20) -> list[tuple[str, float, float, float]]:
    """Rows ``(operation, memop µs, kernel µs, memop/kernel)`` for the two measurements."""
    bench = _Bench(rounds)
    rows = []
    for name, memop, kernel in (
        ("flag write, one stream", bench.memop_writes, bench.kernel_writes),
        ("ping-pong round trip, two streams", bench.memop_ping_pong, bench.kernel_ping_pong),
    ):
        m, k = bench.median_us(memop, samples), bench.median_us(kernel, samples)
        rows.append((name, m, k, ratio(m, k)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="operations or round trips per timed batch")
    parser.add_argument("--samples", type=int, default=20, help="timed batches; the median is reported")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("signals benchmark: no CUDA device visible; nothing to measure")
        return 1
    rows = measure(args.rounds, args.samples)
    print_table(
        f"Signal latency on {torch.cuda.get_device_name()} (median of {args.samples} x {args.rounds})",
        ["operation", "set_signal/wait_eq us", "kernel fill_ us", "ratio"],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
