"""set_signal / wait_eq: argument checks on CPU; round trips on a GPU."""

from __future__ import annotations

import pytest
import torch

from tilescale_host import signals
from tilescale_host.signals import (
    check_signal_tensor,
    check_signal_value,
    set_signal,
    synchronize_streams,
    wait_eq,
)


@pytest.fixture
def driver_spy(monkeypatch):
    """Fail the test if any check lets a call through to the driver."""
    calls = []
    monkeypatch.setattr(signals._cuda, "driver", lambda: calls.append("driver") or pytest.fail("driver reached"))
    return calls


@pytest.mark.parametrize(
    ("value", "bits", "exc", "needle"),
    [
        (-1, 32, ValueError, "does not fit in an unsigned 32-bit"),
        (2**32, 32, ValueError, "does not fit in an unsigned 32-bit"),
        (2**64, 64, ValueError, "unsigned 64-bit"),
        (1.0, 32, TypeError, "must be an integer, got float"),
        (True, 32, TypeError, "got bool"),
    ],
)
def test_value_range(value, bits, exc, needle):
    with pytest.raises(exc, match=needle):
        check_signal_value(value, bits)


def test_value_limits_accepted():
    assert check_signal_value(2**32 - 1, 32) == 2**32 - 1
    assert check_signal_value(2**64 - 1, 64) == 2**64 - 1
    assert check_signal_value(torch.tensor(7).item(), 32) == 7


@pytest.mark.parametrize(
    ("tensor", "bits", "exc", "needle"),
    [
        ([0], 32, TypeError, "must be a torch.Tensor, got list"),
        (torch.zeros(1, dtype=torch.float32), 32, TypeError, r"torch.int32 or torch.uint32, got torch.float32"),
        (torch.zeros(1, dtype=torch.int64), 32, TypeError, "require_i64=True"),
        (torch.zeros(1, dtype=torch.int32), 64, TypeError, r"torch.int64 or torch.uint64, got torch.int32"),
        (torch.zeros(0, dtype=torch.int32), 32, ValueError, "must be nonempty"),
        (torch.zeros(4, 4, dtype=torch.int32).t(), 32, ValueError, "must be contiguous"),
    ],
)
def test_tensor_checks(tensor, bits, exc, needle):
    with pytest.raises(exc, match=needle):
        check_signal_tensor(tensor, bits)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32])
def test_cpu_tensor_is_rejected_before_the_driver(driver_spy, dtype):
    t = torch.zeros(1, dtype=dtype)
    with pytest.raises(ValueError, match="must be a CUDA tensor, got device cpu"):
        set_signal(t, 1)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        wait_eq(t, 1)
    assert driver_spy == []


def test_i64_wait_checks_before_the_driver(driver_spy):
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        wait_eq(torch.zeros(1, dtype=torch.uint64), 2**40, require_i64=True)
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        wait_eq(torch.zeros(1, dtype=torch.int32), 2**40)
    with pytest.raises(TypeError, match="torch.int32 or torch.uint32, got torch.int64"):
        set_signal(torch.zeros(1, dtype=torch.int64), 1)  # set_signal is 32-bit only
    assert driver_spy == []


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_round_trip_one_stream():
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # after the zero fill
    for i in range(1, 50):
        set_signal(flag, i, stream)
        wait_eq(flag, i, stream)
    synchronize_streams([stream], timeout=30.0)
    assert flag.tolist() == [49, 0, 0, 0]
    set_signal(flag, 2**32 - 1)  # the default stream; an unsigned value stored bit-for-bit
    wait_eq(flag, 2**32 - 1)
    torch.cuda.synchronize()
    assert flag[0].item() == -1


@pytest.mark.gpu
def test_wait_on_b_released_by_set_on_a_orders_data():
    """B waits; A writes data, then sets; a torch op on B after the wait sees A's data.

    A's work is enqueued before B's wait: two streams can share one hardware queue, and a
    wait enqueued ahead of its producer in a shared queue would block the producer forever.
    """
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    data = torch.zeros(1 << 20, device="cuda")
    out = torch.full_like(data, -1.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(50_000_000)  # ~25 ms of spinning: B would copy zeros if it did not wait
        data.fill_(3.0)
    set_signal(flag, 1, a)
    wait_eq(flag, 1, b)
    with torch.cuda.stream(b):
        out.copy_(data)  # must not run before A's set
    synchronize_streams([a, b], timeout=30.0)
    assert torch.all(out == 3.0)


@pytest.mark.gpu
def test_synchronize_streams_times_out_on_a_signal_that_never_comes():
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stuck = torch.cuda.Stream()
    torch.cuda.synchronize()
    wait_eq(flag, 7, stuck)
    with pytest.raises(TimeoutError, match="still busy after 0.5 s"):
        synchronize_streams([stuck], timeout=0.5)
    releaser = torch.cuda.Stream()  # the next pool stream: a different hardware queue
    set_signal(flag, 7, releaser)  # release it, so the process can exit
    synchronize_streams([stuck, releaser], timeout=30.0)


def test_synchronize_streams_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        synchronize_streams([], timeout=0)


@pytest.mark.gpu
def test_i64_wait_with_require_i64():
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    flag.fill_(2**40 + 5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    wait_eq(flag, 2**40 + 5, stream, require_i64=True)
    synchronize_streams([stream], timeout=30.0)


@pytest.mark.gpu
def test_stream_on_another_device_is_rejected(driver_spy):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with pytest.raises(ValueError, match="stream is on cuda:1 but the signal tensor is on cuda:0"):
        set_signal(torch.zeros(1, dtype=torch.int32, device="cuda:0"), 1, torch.cuda.Stream(device=1))


@pytest.mark.gpu
def test_signals_benchmark_prints_its_table(capsys):
    bench = pytest.importorskip("tilescale_examples.benchmarks.signals")
    assert bench.main(["--rounds", "50", "--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "ping-pong round trip, two streams" in out and "ratio" in out


def test_stream_wait_eq_is_the_host_stream_wait():
    """``stream_wait_eq`` says what it is; ``wait_eq`` (the API reference's name) is the same."""
    import tilescale_host
    from tilescale_host import signals
    from tilescale_host._facade.distributed import host as facade  # noqa: F401 - import check only

    assert signals.wait_eq is signals.stream_wait_eq
    assert tilescale_host.stream_wait_eq is tilescale_host.wait_eq is signals.stream_wait_eq
    assert {"stream_wait_eq", "wait_eq"} <= set(tilescale_host.__all__)
