"""TileScale examples."""

__version__ = "0.1.0"

try:  # registers torch.ops.tilescale.* (a no-op where torch has no torch.library.custom_op)
    from tilescale_examples import torch_ops  # noqa: E402,F401
except ImportError:  # pragma: no cover - torch missing: the collectives need it anyway
    torch_ops = None
