"""Sequence parallelism: :class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll`, the
all-to-all of Ulysses attention between sequence-sharded and head-sharded layouts, and
:func:`~tilescale_examples.sequence.flash_attention.flash_attention`, the attention forward
between them."""
