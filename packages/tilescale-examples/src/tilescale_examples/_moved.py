"""Old module paths of 0.1.0 (``tilescale_examples.allreduce``, ...) that forward to their new
home in a subpackage, warning once per process with :class:`MovedModuleWarning`.

The forwarding module is the new module itself (``sys.modules`` maps the old name to it), so
private names, ``isinstance`` checks and monkeypatching behave exactly as with the new path.
The old paths are kept through the 0.1.x releases.
"""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["MovedModuleWarning", "forward"]


class MovedModuleWarning(FutureWarning):
    """An old ``tilescale_examples`` module path was imported; the message names the new one."""


def forward(old: str, new: str) -> None:
    """Make the module being imported as ``old`` the module ``new``, and warn once."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old path works through 0.1.x)",
                  MovedModuleWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
