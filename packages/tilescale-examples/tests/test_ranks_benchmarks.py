"""The benchmarks that run real ranks, one per GPU (``benchmarks.gemm_allreduce_ranks``,
``benchmarks.decode_ranks``), on the CPU: their argument errors before any rank starts, their
precompile jobs against the kernels their ranks' ops build (dry runs of the constructors), the
two-shot size the GEMM + all-reduce benchmark derives from its table, and the fused norm's
inputs (the residual and the weight replicated, as in a tensor-parallel model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tilescale_examples.benchmarks import decode_ranks, gemm_allreduce_ranks


@pytest.mark.parametrize("bench, argv, match", [
    (gemm_allreduce_ranks, ["--ranks", "1"], "--ranks must be at least 2"),
    (gemm_allreduce_ranks, ["--k", "100"], "--k and --n must be positive multiples of 64"),
    (gemm_allreduce_ranks, ["--m", "0"], "--m, --iters and --rounds must be positive"),
    (gemm_allreduce_ranks, ["--dtype", "float32"], "invalid choice"),
    (decode_ranks, ["--ranks", "1"], "--ranks must be at least 2"),
    (decode_ranks, ["--hidden", "100"], "--hidden must be a positive multiple of 8"),
    (decode_ranks, ["--tokens", "0"], "--tokens, --iters and --rounds must be positive"),
    (decode_ranks, ["--rounds", "0"], "--tokens, --iters and --rounds must be positive"),
])
def test_bad_arguments_are_refused_before_any_rank(bench, argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def _missing(jobs, builds) -> list:
    """The kernels ``builds`` (constructor calls on a RecordingAllocator, each returning it)
    make that ``jobs`` (precompile jobs) do not compile; also that they made some."""
    from tilescale_examples.testing.precompile import build_job

    scripts = {build_job(builder, args).script() for builder, args, _ in jobs}
    built = [build() for make in builds for build, _, _ in make().builds]
    assert len(built) >= len(builds)
    return [func.attrs["global_symbol"] for func in built if func.script() not in scripts]


def _dry_run(world: int, cls, *op_args, **kwargs):
    """A constructor call ``cls(RecordingAllocator(world), *op_args, world_size=world,
    **kwargs)`` to make later; it returns the allocator, which recorded the kernels built."""
    from tilescale_examples._contract import RecordingAllocator

    def make():
        alloc = RecordingAllocator(world, sm_count=132)
        cls(alloc, *op_args, world_size=world, **kwargs)
        return alloc

    return make


@pytest.mark.parametrize("world", [2, 4])
def test_the_gemm_allreduce_jobs_are_the_kernels_the_ranks_build(world):
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce

    args = SimpleNamespace(m=[1, 64, 512], k=1024, n=2048, dtype="bfloat16")

    builds = [_dry_run(world, GemmAllReduce, m, args.k, args.n, torch.bfloat16, reduction=r, split_k=1)
              for m in args.m for r in ("one_shot", "two_shot")]
    builds += [_dry_run(world, AllReduce, (m, args.n), torch.bfloat16) for m in args.m]
    assert not _missing(gemm_allreduce_ranks.jobs(args, world, 132), builds)


@pytest.mark.parametrize("world", [2, 4])
def test_the_decode_jobs_are_the_kernels_the_ranks_build(world):
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.allreduce_norm import AllReduceResidualRMSNorm

    builds = [_dry_run(world, AllReduceResidualRMSNorm, (t, 4096), torch.bfloat16, algorithm=a)
              for t in (1, 64, 256) for a in ("one_shot", "lamport")]
    builds += [_dry_run(world, AllReduce, (t, 4096), torch.bfloat16) for t in (1, 64, 256)]
    assert not _missing(decode_ranks.jobs(SimpleNamespace(hidden=4096, dtype="bfloat16"), world), builds)


@pytest.mark.parametrize("rows, want", [
    ([(16, 1.0, 2.0), (1024, 2.0, 1.5), (4096, 3.0, 2.0)], 1024),  # two-shot from 1024 bytes on
    ([(16, 1.0, 0.5), (1024, 2.0, 2.5), (4096, 3.0, 2.0)], 4096),  # faster at 16 bytes, not at 1024: from 4096
    ([(16, 1.0, 2.0), (4096, 3.0, 3.0)], None),  # never faster (a tie is not faster)
    ([], None),
])
def test_two_shot_from_bytes_is_the_start_of_the_largest_sizes_it_wins(rows, want):
    assert gemm_allreduce_ranks.two_shot_from_bytes(rows) == want
    assert gemm_allreduce_ranks.two_shot_from_bytes(list(reversed(rows))) == want  # the rows' order does not count


def test_the_decode_inputs_replicate_the_residual_and_the_weight():
    ranks = [decode_ranks._inputs(p, 3, 64, torch.bfloat16, "cpu") for p in range(2)]
    assert not torch.equal(ranks[0][0], ranks[1][0])  # each rank's own partial sum
    assert torch.equal(ranks[0][1], ranks[1][1]) and torch.equal(ranks[0][2], ranks[1][2])
    assert [t.shape for t in ranks[0]] == [(3, 64), (3, 64), (64,)]
