"""Which memory path a symmetric heap takes (docs/core.md, "Memory paths and how one is
chosen"): :func:`select_path` in the spec's order (``TILESCALE_USE_VMM``, then ``use_vmm``,
then the fabric probe), :func:`parse_use_vmm_env` and :func:`check_multicast`. Pure
functions of their arguments: the probes are passed in and called lazily."""

from __future__ import annotations

from collections.abc import Callable

from .probes import Probe

__all__ = ["PATHS", "USE_VMM_ENV", "VmmUnavailableError", "check_multicast", "parse_use_vmm_env", "select_path"]

#: Environment override of the VMM choice: present and ``1`` -> VMM, present otherwise -> IPC.
USE_VMM_ENV = "TILESCALE_USE_VMM"
#: Memory path names, as found in :attr:`~tilescale_core.allocator.BaseAllocator.path`.
PATHS = ("ipc", "vmm-fabric", "vmm-fd", "local")


class VmmUnavailableError(RuntimeError):
    """VMM was requested but neither fabric nor POSIX-fd handles work here (no IPC fallback)."""


def parse_use_vmm_env(value: str) -> bool:
    """``TILESCALE_USE_VMM``'s value: ``"1"`` selects VMM, ``"0"`` or empty CUDA IPC.

    Raises:
        ValueError: any other spelling (``"true"``, ``"1 "``, ``"yes"`` ...), naming the
            variable, instead of silently selecting IPC.
    """
    if value == "1":
        return True
    if value in ("0", ""):
        return False
    raise ValueError(
        f"{USE_VMM_ENV}={value!r} is not a recognised value: use 1 (VMM) or 0 (CUDA IPC), "
        f"or unset it to let the allocator choose"
    )


def select_path(
    *,
    is_distributed: bool,
    use_vmm: bool | None,
    env_value: str | None,
    fabric_probe: Callable[[], Probe],
    fd_probe: Callable[[], Probe],
) -> str:
    """Choose the memory path; a pure function of its arguments (probes are called lazily).

    Order (docs/core.md, "Memory paths and how one is chosen"): ``env_value`` (``TILESCALE_USE_VMM``) present -> ``"1"`` selects VMM,
    ``"0"``/empty IPC, any other spelling is a ValueError; else an explicit ``use_vmm``
    (a bool); else VMM only for a distributed
    allocator whose fabric probe passes.  VMM uses fabric handles when the fabric probe
    passes, else POSIX fds when their probe passes.  IPC is ``"local"`` for a
    non-distributed allocator.

    Returns:
        one of :data:`PATHS`.

    Raises:
        VmmUnavailableError: VMM selected but neither handle kind works (no IPC fallback).
        ValueError: ``env_value`` is not a recognised spelling.
        TypeError: ``use_vmm`` is not a bool or None.
    """
    if env_value is not None:
        want_vmm, why = parse_use_vmm_env(env_value), f"{USE_VMM_ENV}={env_value!r}"
    elif use_vmm is not None:
        if not isinstance(use_vmm, bool):
            raise TypeError(f"use_vmm must be True, False or None, got {type(use_vmm).__name__} {use_vmm!r}")
        want_vmm, why = use_vmm, f"use_vmm={use_vmm!r}"
    else:
        want_vmm, why = bool(is_distributed and fabric_probe()), "the fabric probe"
    if not want_vmm:
        return "ipc" if is_distributed else "local"
    fabric = fabric_probe()
    if fabric:
        return "vmm-fabric"
    fd = fd_probe()
    if fd:
        return "vmm-fd"
    raise VmmUnavailableError(
        f"VMM was selected by {why} but cannot be used here, and there is no fallback to CUDA IPC: "
        f"fabric handles: {fabric.reason}; POSIX fd handles: {fd.reason}. "
        f"Unset {USE_VMM_ENV} / use_vmm to use CUDA IPC."
    )


def check_multicast(mcast_size: int | None, path: str, is_distributed: bool, probe: Callable[[], Probe]) -> None:
    """Raise ValueError unless ``mcast_size`` is None or multicast can be set up on ``path``.

    Multicast needs a distributed allocator on the ``"vmm-fabric"`` path and a passing
    multicast probe; the probe is consulted only when the rest holds.
    """
    if mcast_size is None:
        return
    if isinstance(mcast_size, bool) or not isinstance(mcast_size, int) or mcast_size <= 0:
        raise ValueError(f"mcast_size must be a positive number of bytes, got {mcast_size!r}")
    if not is_distributed:
        raise ValueError("mcast_size needs a distributed allocator (is_distributed=True)")
    if path != "vmm-fabric":
        raise ValueError(
            f"mcast_size needs a VMM allocator with fabric handles, but this allocator uses {path!r} "
            f"(set use_vmm=True or {USE_VMM_ENV}=1 on a fabric-capable host)"
        )
    result = probe()
    if not result:
        raise ValueError(f"mcast_size was given but multicast is unavailable: {result.reason}")
