"""Latency of host-enqueued stream signals against one-thread kernel flag writes, in µs.

``python -m tilescale_examples.benchmarks.signals [--rounds 200] [--samples 20] [--out DIR]``

Two measurements, each timed on the GPU with CUDA events around a batch of ``rounds``
operations on stream A (a spin kernel of :data:`HOLD_MS` placed first on the timed stream
hides the host's enqueue time, so the numbers are device-side latencies;
``tilescale_host.bench.perf_rounds`` with ``hold``, which doubles the hold and times again
when it ran out before the batch was enqueued):

* flag write: back-to-back writes of one int32 flag on one stream, ``set_signal``
  (cuStreamWriteValue32) against ``flag.fill_(i)`` (a one-thread-block torch kernel);
* ping-pong round trip between streams A and B: with memops, A sets ``ab`` and waits for
  ``ba`` while B waits for ``ab`` and sets ``ba`` (``set_signal`` / ``stream_wait_eq``); with kernels,
  each side writes its flag with ``fill_`` and the other side waits on a CUDA event recorded
  after it (``Stream.wait_event``), the usual way to order torch work across streams.

After one untimed batch of each, the memop and the kernel batch take turns in ``samples``
rounds; the table reports each one's median batch, per operation or round, and the ratio
memop / kernel (below 1: the host-enqueued signal is faster).
"""

from __future__ import annotations

from collections.abc import Callable

from tilescale_host.bench import perf_rounds

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import print_table, ratio

__all__ = ["main", "measure", "HOLD_MS", "WAIT_S"]

#: Milliseconds of GPU spinning placed before each timed batch to cover the enqueue time.
HOLD_MS = 20.0
#: Seconds a wait for a batch may take: a lost signal fails the run instead of hanging it.
WAIT_S = 60.0


class _Bench:
    """Flags, streams and a round counter shared by the four measurements."""

    def __init__(self, rounds: int):
        import torch

        self.rounds = rounds
        self.a, self.b = torch.cuda.Stream(), torch.cuda.Stream()
        self.ab = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.ba = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.ev_a, self.ev_b = torch.cuda.Event(), torch.cuda.Event()
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

    def medians_us(self, memop: Callable[[], None], kernel: Callable[[], None], samples: int) -> tuple:
        """``(memop µs, kernel µs)`` per round: one untimed batch of each, then ``samples``
        rounds that time a batch of each in turn on stream A behind a :data:`HOLD_MS` hold;
        each one's median batch."""
        ms = perf_rounds({"memop": memop, "kernel": kernel}, samples, warmup=1, rep=1, hold=HOLD_MS,
                         stream=self.a, timeout=WAIT_S, group="local")
        return ms["memop"] * 1000.0 / self.rounds, ms["kernel"] * 1000.0 / self.rounds


def measure(rounds: int = 200, samples: int = 20) -> list[tuple[str, float, float, float]]:
    """Rows ``(operation, memop µs, kernel µs, memop/kernel)`` for the two measurements."""
    bench = _Bench(rounds)
    rows = []
    for name, memop, kernel in (
        ("flag write, one stream", bench.memop_writes, bench.kernel_writes),
        ("ping-pong round trip, two streams", bench.memop_ping_pong, bench.kernel_ping_pong),
    ):
        m, k = bench.medians_us(memop, kernel, samples)
        rows.append((name, m, k, ratio(m, k)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints the table."""
    parser = _harness.parser("signals", __doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="operations or round trips per timed batch")
    parser.add_argument("--samples", type=int, default=20, help="timed batches; the median is reported")
    args = _harness.parse_args(parser, argv)
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
