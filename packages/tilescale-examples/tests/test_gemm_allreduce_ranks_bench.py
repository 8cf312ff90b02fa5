"""``benchmarks.gemm_allreduce_ranks`` (GemmAllReduce across real ranks) on the CPU: the
two-shot size it derives from a table, its argument errors before any rank starts, and its
precompile jobs against the kernels its ranks' ops build (a dry run of the constructors)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tilescale_examples.benchmarks import gemm_allreduce_ranks as bench


@pytest.mark.parametrize("rows, want", [
    ([(16, 1.0, 2.0), (1024, 2.0, 1.5), (4096, 3.0, 2.0)], 1024),  # two-shot from 1024 bytes on
    ([(16, 1.0, 0.5), (1024, 2.0, 2.5), (4096, 3.0, 2.0)], 4096),  # faster at 16 bytes, not at 1024: from 4096
    ([(16, 1.0, 2.0), (4096, 3.0, 3.0)], None),  # never faster (a tie is not faster)
    ([], None),
])
def test_two_shot_from_bytes_is_the_start_of_the_largest_sizes_it_wins(rows, want):
    assert bench.two_shot_from_bytes(rows) == want
    assert bench.two_shot_from_bytes(list(reversed(rows))) == want  # the order of the rows does not count


@pytest.mark.parametrize("argv, match", [
    (["--ranks", "1"], "--ranks must be at least 2"),
    (["--k", "100"], "--k and --n must be positive multiples of 64"),
    (["--m", "0"], "--m, --iters and --rounds must be positive"),
    (["--dtype", "float32"], "invalid choice"),
])
def test_bad_arguments_are_refused_before_any_rank(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("world", [2, 4])
def test_jobs_are_the_kernels_the_ranks_build(world):
    from tilescale_examples._contract import RecordingAllocator
    from tilescale_examples.collectives.allreduce import AllReduce
    from tilescale_examples.decode.gemm_allreduce import GemmAllReduce
    from tilescale_examples.testing.precompile import build_job

    args = SimpleNamespace(m=[1, 64, 512], k=1024, n=2048, dtype="bfloat16")
    jobs = {build_job(builder, job_args).script() for builder, job_args, _ in bench.jobs(args, world, 132)}
    built = []
    for m in args.m:
        for reduction in ("one_shot", "two_shot"):
            alloc = RecordingAllocator(world, sm_count=132)
            GemmAllReduce(alloc, m, args.k, args.n, torch.bfloat16, world_size=world, reduction=reduction, split_k=1)
            built += [build() for build, _, _ in alloc.builds]
        alloc = RecordingAllocator(world, sm_count=132)
        AllReduce(alloc, (m, args.n), torch.bfloat16, world_size=world)
        built += [build() for build, _, _ in alloc.builds]
    assert len(built) >= 3 * len(args.m)
    missing = [func.attrs["global_symbol"] for func in built if func.script() not in jobs]
    assert not missing, f"kernels the ranks build that jobs() does not compile: {missing}"
