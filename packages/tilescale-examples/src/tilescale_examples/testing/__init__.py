"""Infrastructure for tests and benchmarks: :mod:`.emulated` (N peers' heap regions in one
process, to measure multi-rank kernels on one GPU) and :mod:`.precompile` (compile every kernel
a suite will need, in parallel, before it runs)."""
