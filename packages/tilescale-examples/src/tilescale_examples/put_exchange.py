"""Moved to :mod:`tilescale_examples.collectives.put_exchange` (this path forwards there through 0.1.x)."""

from tilescale_examples._moved import forward

forward(__name__, "tilescale_examples.collectives.put_exchange")
