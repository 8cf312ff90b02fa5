"""GPU: the plugin runs a 4-rank test on one GPU in shared mode (TILESCALE_SHARE_GPUS=1)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

FOUR_RANKS = '''
import pytest
import torch
import torch.distributed as dist

from tilescale_host import set_signal, wait_eq


@pytest.mark.ranks(4, timeout=120)
def test_four_ranks_share_one_gpu(rank, world_size):
    assert torch.cuda.current_device() == rank % torch.cuda.device_count()
    t = torch.full((1,), float(rank), device="cuda")
    dist.all_reduce(t)  # gloo accepts CUDA tensors
    assert t.item() == sum(range(world_size))
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    set_signal(flag, rank + 1)
    wait_eq(flag, rank + 1)
    torch.cuda.synchronize()
    assert flag.item() == rank + 1
'''


def test_plugin_runs_four_ranks_on_one_gpu(pytester, monkeypatch):
    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
    pytester.makepyfile(test_four=FOUR_RANKS)
    record = pytester.path / "rec"
    res = pytester.runpytest_subprocess("--tilescale-record", str(record), timeout=300)
    res.assert_outcomes(passed=1)
    import json

    (path,) = record.glob("*.jsonl")
    lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0]["gpu_count"] >= 1 and lines[0]["mode"] == "shared"
    expected = "shared" if lines[0]["gpu_count"] < 4 else "one-rank-per-GPU"
    assert lines[1]["outcome"] == "passed" and lines[1]["mode"] == expected
