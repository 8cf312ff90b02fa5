"""Moved to :mod:`tilescale_examples.overlap.stream_ops` (this path forwards there through 0.1.x)."""

from tilescale_examples._moved import forward

forward(__name__, "tilescale_examples.overlap.stream_ops")
