"""Sequence parallelism: :class:`~tilescale_examples.sequence.ulysses.UlyssesAllToAll`, the
all-to-all of Ulysses attention between sequence-sharded and head-sharded layouts;
:func:`~tilescale_examples.sequence.flash_attention.flash_attention`, the attention forward;
:class:`~tilescale_examples.sequence.sp_attention.SPAllGatherAttention`, attention of
sequence-sharded queries over all-gathered K/V; :class:`~tilescale_examples.sequence.flash_decode.SPFlashDecode`,
decode attention over a KV cache split across ranks."""
