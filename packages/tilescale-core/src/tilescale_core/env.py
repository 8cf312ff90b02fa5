"""Reading TileScale's boolean environment variables, one way everywhere.

Every on/off switch (``TILESCALE_DISABLE_HOOK``, ``TILESCALE_CHECK_ALLOC``,
``TILESCALE_SHARE_GPUS``, ``TILESCALE_CHECK_PE``, ...) and the multicast opt-outs that
TileScale honours (``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST``,
``NVSHMEM_DISABLE_NVLS``) are read by :func:`flag`: ``1``, ``true``, ``yes``, ``on`` (and
``y``, ``t``) mean on; ``0``, ``false``, ``no``, ``off`` (and ``n``, ``f``) mean off (any case,
surrounding blanks ignored), as tilescale-host's ``utils.get_bool_env`` reads them; an unset
or empty variable takes the default; anything else raises ``ValueError`` naming the variable
and its value, so a typo never silently reads as the default. Standard library only.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["TRUE", "FALSE", "flag", "parse_flag"]

#: Spellings of on and of off (compared after ``strip().lower()``).
TRUE = ("1", "true", "yes", "on", "y", "t")
FALSE = ("0", "false", "no", "off", "n", "f")


def parse_flag(name: str, value: Optional[str], default: bool = False) -> bool:
    """``value`` (the text of environment variable ``name``, None when unset) as a bool:
    :data:`TRUE` or :data:`FALSE` spellings; unset or blank: ``default``.

    Raises:
        ValueError: any other text, naming ``name``, the value and the accepted spellings.
    """
    if value is None or not value.strip():
        return bool(default)
    text = value.strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of {'/'.join(TRUE)} (on) or "
                     f"{'/'.join(FALSE)} (off), or leave it unset")


def flag(name: str, default: bool = False, env: Optional[Mapping[str, str]] = None) -> bool:
    """Environment variable ``name`` of ``env`` (default ``os.environ``) as a bool (see
    :func:`parse_flag`)."""
    return parse_flag(name, (os.environ if env is None else env).get(name), default)
