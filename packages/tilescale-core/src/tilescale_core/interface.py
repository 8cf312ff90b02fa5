"""What the other TileScale wheels use from tilescale-core: a small, versioned interface.

tilescale-host and tilescale-lang import only these names (never core's private modules), so
any tilescale-core 0.1.x serves them. :data:`TABLE_VERSION` numbers the layout of the
allocator's metadata table that compiled kernels receive; tilescale-lang checks it when it
is imported and refuses, with a clear error, a core that speaks another layout.
:func:`check_positive_int`, :func:`check_non_negative_int`, :func:`check_seconds` and
:func:`check_choice` (:mod:`tilescale_core.validate`) check arguments with one wording in
every wheel. :func:`set_default_allocator` / :func:`default_allocator`
(:mod:`tilescale_core.default_heap`) hold the heap that kernels launched without
``kernel.initialize`` bind to (set by tilescale-host's ``pynvshmem``).
"""

from __future__ import annotations

from ._extension import add_facade_dir, after_import
from ._lazy import lazy_exports, lazy_getattr
from ._parent_death import PARENT_PID_ENV, die_with_parent, parent_pid_from_env
from .default_heap import default_allocator, set_default_allocator
from .table import TABLE_LAYOUT, TABLE_VERSION
from .validate import check_choice, check_non_negative_int, check_positive_int, check_seconds

__all__ = [
    "PARENT_PID_ENV",
    "TABLE_VERSION",
    "TABLE_LAYOUT",
    "add_facade_dir",
    "after_import",
    "check_choice",
    "check_non_negative_int",
    "check_positive_int",
    "check_seconds",
    "default_allocator",
    "die_with_parent",
    "lazy_exports",
    "lazy_getattr",
    "parent_pid_from_env",
    "set_default_allocator",
]
# TABLE_VERSION and TABLE_LAYOUT are tilescale_core.table's (the table's one owner).
