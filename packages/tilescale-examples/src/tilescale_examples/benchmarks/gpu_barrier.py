"""GPU barrier latency: the one-word layout (upstream's ``T.Tensor([1], T.uint32)``) against
the two-word layout, in the same run.

``python -m tilescale_examples.benchmarks.gpu_barrier [--blocks N] [--iters K] [--reps R] [--out DIR]``

One kernel per layout runs ``K`` ``T.sync_barrier_gpu`` generations over ``N`` co-resident
blocks (default: one per SM); the table gives microseconds per barrier (kernel time / K, the
median of ``R`` launches after one untimed launch, each launch on an idle GPU with its stamps
zeroed; ``tilescale_host.bench.do_bench``) and the ratio one-word / two-word (below 1: the
one-word form is faster).  Each run is checked: every block stamps its generation before the
barrier and checks every other block's stamp after it.
"""

# (no `from __future__ import annotations`: TileLang reads the kernels' annotations)

from tilescale_host.bench import do_bench

from tilescale_examples.benchmarks import _harness
from tilescale_examples.benchmarks._report import print_table, ratio

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def build_barrier_loop(words: int, blocks: int):
    """``(Bar, Slots, Err, iters)``: ``iters`` stamped generations of the ``words``-word barrier."""
    import tilelang.language as T

    @T.prim_func
    def barrier_loop(Bar: T.Tensor((words,), "uint32"), Slots: T.Tensor((blocks,), "int32"),
                     Err: T.Tensor((1,), "int32"), iters: T.int32):
        with T.Kernel(blocks, threads=128) as bx:
            tx = T.get_thread_binding()
            v = T.alloc_var("int32")
            T.init_barrier_gpu(Bar, blocks)
            for i in T.serial(iters):
                if tx == 0:
                    T.st(Slots[bx], i + 1, scope="gpu", sem="relaxed")
                T.sync_barrier_gpu(Bar)
                if tx < blocks:
                    T.ld(Slots[tx], v, scope="gpu", sem="relaxed")
                    if v < i + 1:
                        Err[0] = 1

    return barrier_loop


def main(argv=None) -> int:
    import tilelang
    import torch

    p = _harness.parser("gpu_barrier", __doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=0, help="blocks (default: the SM count; must be co-resident)")
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--reps", type=int, default=10)
    args = _harness.parse_args(p, argv)
    blocks = args.blocks or torch.cuda.get_device_properties(0).multi_processor_count
    rows, ok = [], True
    times = {}
    for words in (1, 2):
        k = tilelang.compile(build_barrier_loop(words, blocks), target=TARGET)
        bar = torch.zeros(words, dtype=torch.uint32, device="cuda")
        slots = torch.zeros(blocks, dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        ms = do_bench(lambda: k(bar, slots, err, args.iters), 1, args.reps, flush_l2=False, group="local",
                      before=lambda: (slots.zero_(), torch.cuda.synchronize()))
        ok &= int(err.item()) == 0
        times[words] = ms * 1000 / args.iters
    rows.append([blocks, args.iters, times[1], times[2], ratio(times[1], times[2])])
    print_table("GPU barrier: microseconds per generation (median of runs)",
                ["blocks", "generations", "one word us", "two words us", "one/two"], rows)
    print(f"\ncorrectness (every block saw every stamp after every barrier): {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
