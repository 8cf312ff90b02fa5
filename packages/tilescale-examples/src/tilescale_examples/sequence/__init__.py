"""Sequence parallelism: :class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll`, the
all-to-all of Ulysses attention between sequence-sharded and head-sharded layouts."""
