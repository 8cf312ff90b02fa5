"""The A/B of the reduction kernels' call numbers, for :mod:`~tilescale_examples.benchmarks.emulated`.

The library's flag kernels keep their call number on the device (each block reads its count
of earlier calls from ``State`` and writes it back: graph-safe). Before that, the host passed
it as a kernel argument, which a CUDA graph freezes. This module times the two on the same
emulated collective, the same arguments and the same procedure: the kernel of
:func:`~tilescale_examples.collectives.reduce_kernel.build_reduce_kernel` as the op built it,
and the same kernel built with ``call_number="argument"`` (the host's number, ``State``
untouched), each launched ``iters`` times back to back behind a stream hold (the host's
launch cost not counted), every emulated rank in turn, flags preset so that waits pass.
"""

from __future__ import annotations

import itertools
import statistics

from tilescale_examples.benchmarks import _timing

__all__ = ["HEADERS", "GOAL", "host_number_kernel", "time_call_numbers", "row"]

HEADERS = ["ranks", "size", "op", "device number us", "host number us", "device / host"]
#: The goal: the graph-safe kernel's GPU time at most this many times the host-numbered one's.
GOAL = 1.03


def host_number_kernel(coll):
    """The compiled kernel of ``coll`` (a flag-based :class:`ReductionCollective`: one-shot,
    two-shot, reduce-scatter) built with ``call_number="argument"``: its parameters are the
    op's kernel's, then the call number (int64)."""
    from tilescale_examples.base import compile_once
    from tilescale_examples.collectives.reduce_engine import REDUCE_DTYPES
    from tilescale_examples.collectives.reduce_kernel import PASS_CONFIGS, build_reduce_kernel

    func = build_reduce_kernel(coll.mode, REDUCE_DTYPES[coll.dtype], coll.world_size, coll.threads, coll.plan.unroll,
                               call_number="argument")
    return compile_once(func, None, None, PASS_CONFIGS)


def time_call_numbers(colls, iters: int, host_kernel, preset_flags) -> tuple:
    """``(device_ms, host_ms)``: GPU milliseconds per launch of one rank's kernel, the op's own
    (call number on the device) and ``host_kernel`` (:func:`host_number_kernel`), mean over the
    emulated ranks ``colls``; both on the same arguments (the input already staged, the op's
    output rows), the host's numbers one more per launch as the device's are (the launches
    alternate between the staging buffers alike), each after ``preset_flags(colls)`` and with
    the rank's table bound to the kernel timed."""
    device_ms, host_ms = [], []
    for c in colls:
        args = c._kernel_args(c.stages[0], c.result, 0)
        preset_flags(colls)
        c.bind_table()
        device_ms.append(_timing.held_ms_per_launch(lambda: c.kernel(*args), iters, c.device))
        # numbered by the host as the device numbers them: one more per launch, so the launches
        # alternate between the staging buffers alike (every preset flag is above the numbers)
        numbers = itertools.count(int(c.state[0]) + 1)
        preset_flags(colls)
        c.bind_table(kernel=host_kernel)
        host_ms.append(_timing.held_ms_per_launch(lambda: host_kernel(*args, next(numbers)), iters, c.device))
    return statistics.fmean(device_ms), statistics.fmean(host_ms)


def row(ranks: int, size: str, op: str, device_ms: float, host_ms: float) -> list:
    """One row of :data:`HEADERS` (microseconds, ratio rounded to 3 places)."""
    return [ranks, size, op, device_ms * 1e3, host_ms * 1e3, round(device_ms / host_ms, 3)]
