"""TileScale's benchmarks; each prints a table with ratios to a baseline measured in the same
run. ``python -m tilescale_examples.benchmarks`` runs them all (see :mod:`.__main__`)."""

#: Every benchmark module (the modules without a leading underscore; the others are the harness), in the order ``python -m tilescale_examples.benchmarks`` runs them.
BENCHMARKS = ("heap", "signals", "putget", "allgather", "reducescatter", "alltoall", "allreduce", "ag_gemm", "gemm_rs", "gemm",
              "overlap_emulated", "emulated", "reduce_ceiling", "moe", "moe_phases", "remote_tma", "gpu_barrier",
              "decode", "decode_ranks", "gemm_allreduce", "gemm_allreduce_ranks", "ulysses", "launch", "cold_start",
              "attention", "sp_attention", "concurrent")
