"""The sustained runs with SM clock and power samples (``benchmarks._clocks``) and the GEMM
benchmark's ``--sustain`` option: the steady-sample medians, argument errors (CPU). The runs
themselves need a GPU (``ci/device-check.sh bench-gemm-sustain``)."""

import math

import pytest
from examples_helpers import exits_naming

from tilescale_examples.benchmarks._clocks import steady_median, sustained


def test_the_first_quarter_of_the_samples_is_dropped_and_the_rest_medianed():
    samples = [(1000.0, 100.0)] * 4 + [(1755.0, 690.0), (1740.0, 700.0), (1980.0, 500.0)] * 4
    assert steady_median(samples) == (1755.0, 690.0)
    assert steady_median([(1500.0, 300.0)]) == (1500.0, 300.0)  # too few to drop any
    assert all(math.isnan(v) for v in steady_median([]))


@pytest.mark.parametrize("kwargs", [dict(seconds=0), dict(seconds=-1), dict(period=0)])
def test_bad_durations_are_refused_before_anything_runs(kwargs):
    ran = []
    with pytest.raises(ValueError, match="seconds and period must be > 0"):
        sustained(lambda: ran.append(1), sample=lambda: (0.0, 0.0), **kwargs)
    assert ran == []


def test_the_gemm_benchmark_refuses_a_negative_sustain(capsys):
    from tilescale_examples.benchmarks import gemm as bench

    exits_naming(bench.main, ["--sustain", "-1"], "--sustain must be >= 0 seconds", capsys)
    exits_naming(bench.main, ["--sustain", "nan"], "--sustain must be >= 0 seconds", capsys)
    assert bench.SUSTAINED_HEADERS == ["m", "n", "kernel", "TFLOP/s", "SM MHz", "W", "TFLOP/s per GHz"]
