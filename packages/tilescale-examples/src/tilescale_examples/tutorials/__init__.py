"""Small programs that teach one idea each: :mod:`.ring_put` (a put around a ring of ranks) and
:mod:`.tma_allreduce` (an all-reduce whose loads are TMA copies from peers)."""
