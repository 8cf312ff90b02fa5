"""``tilelang.distributed.shared_memory``: the shared-memory FFI bindings and probes.

Re-exports :mod:`tilescale_core.shared_memory`; see that module for the documentation.
"""

from tilescale_core.shared_memory import *  # noqa: F401,F403
from tilescale_core.shared_memory import __all__  # noqa: F401
