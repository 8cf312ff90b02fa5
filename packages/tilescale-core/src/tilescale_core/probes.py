"""Runtime capability probes for the memory paths: CUDA IPC, VMM fabric, VMM fd, multicast.

Each probe returns a :class:`Probe` ``(ok, reason)``: ``ok`` says whether the path can be
used in this process, ``reason`` says why not (or, when ``ok``, what was found).  Probes
inspect every CUDA-visible device, never create a CUDA context, never allocate, and never
raise: on a machine without a GPU or driver they answer ``False`` with the reason.  Set
``CUDA_VISIBLE_DEVICES`` to the participating GPUs before probing.
"""

from __future__ import annotations

import glob
import os
import socket
import sys
from typing import Callable, NamedTuple

from . import _driver

__all__ = [
    "IMEX_CHANNEL_GLOB",
    "MIN_FABRIC_DRIVER_VERSION",
    "MULTICAST_DISABLE_ENV",
    "Probe",
    "multicast_disabled_by_env",
    "probe_cuda_ipc",
    "probe_driver",
    "probe_multicast",
    "probe_vmm_fabric",
    "probe_vmm_fd",
]

#: Driver API version (``cuDriverGetVersion``) needed for fabric handles: CUDA 12.4.
MIN_FABRIC_DRIVER_VERSION = 12040
#: Device nodes of the NVIDIA IMEX channels that fabric handles need.
IMEX_CHANNEL_GLOB = "/dev/nvidia-caps-imex-channels/channel*"
#: The IMEX channel setup script shipped as tilelang/distributed/scripts/conf_vmm.sh.
CONF_VMM_SCRIPT = os.path.join(os.path.dirname(__file__), "_facade", "distributed", "scripts", "conf_vmm.sh")
#: Environment settings under which multicast objects must never be created.
MULTICAST_DISABLE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class Probe(NamedTuple):
    """Result of a capability probe: ``ok`` and a human-readable ``reason``."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:  # a failed probe is falsy even though the tuple is not empty
        return self.ok


def _guarded(fn: Callable[[], Probe]) -> Callable[[], Probe]:
    def wrapper() -> Probe:
        try:
            return fn()
        except Exception as exc:  # probes never raise
            return Probe(False, f"{type(exc).__name__}: {exc}")

    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@_guarded
def probe_driver() -> Probe:
    """Whether the CUDA driver loads and shows at least one device."""
    try:
        _driver.init()
    except _driver.CudaUnavailableError:
        return Probe(False, "no CUDA driver: libcuda could not be loaded (no NVIDIA driver here?)")
    except _driver.CudaError as exc:
        return Probe(False, f"CUDA driver present but unusable: {exc}")
    n = _driver.device_count()
    if n == 0:
        return Probe(False, "the CUDA driver sees no GPU (check CUDA_VISIBLE_DEVICES)")
    v = _driver.driver_version()
    return Probe(True, f"CUDA driver API {v // 1000}.{(v % 1000) // 10}, {n} visible GPU(s)")


def _lacking(attribute: str, what: str) -> Probe | None:
    """A failed probe naming the visible GPUs whose device ``attribute`` is off (they do not
    support ``what``), or None when every GPU has it."""
    n = _driver.device_count()
    lacking = [d for d in range(n) if not _driver.device_attribute(attribute, d)]
    return Probe(False, f"GPU(s) {lacking} do not support {what}") if lacking else None


def _after_driver(*checks: Callable[[], Probe | None]) -> Probe:
    """The driver probe, then each check (a failed probe, or None when it passes) in turn: the
    first failure, else success with the driver's reason."""
    base = probe_driver()
    if not base:
        return base
    for check in checks:
        failed = check()
        if failed is not None:
            return failed
    return Probe(True, base.reason)


def _peer_access() -> Probe | None:
    n = _driver.device_count()
    missing = [(a, b) for a in range(n) for b in range(n) if a != b and not _driver.can_access_peer(a, b)]
    if missing:
        pairs = ", ".join(f"{a}->{b}" for a, b in missing)
        return Probe(False, f"no CUDA peer access between visible GPUs {pairs}")
    return None


@_guarded
def probe_cuda_ipc() -> Probe:
    """Whether CUDA IPC can work: a driver, and peer access between every pair of visible GPUs."""
    return _after_driver(_peer_access)


def _vmm_with(attribute: str, label: str) -> Probe:
    return _after_driver(lambda: _lacking("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "CUDA virtual memory management"),
                         lambda: _lacking(attribute, f"{label} handles"))


@_guarded
def probe_vmm_fd() -> Probe:
    """Whether VMM memory can be shared as POSIX file descriptors over Unix sockets."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return Probe(False, "POSIX fd passing needs Linux and Python's socket.send_fds")
    return _vmm_with("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "POSIX file descriptor")


def _imex_channel() -> Probe:
    channels = sorted(glob.glob(IMEX_CHANNEL_GLOB))
    if not channels:
        return Probe(
            False,
            f"no IMEX channel ({IMEX_CHANNEL_GLOB} absent); an administrator can create one "
            f"with {CONF_VMM_SCRIPT} [channel_id] (tilelang/distributed/scripts/conf_vmm.sh)",
        )
    usable = [c for c in channels if os.access(c, os.R_OK | os.W_OK)]
    if not usable:
        return Probe(False, f"IMEX channel(s) {channels} exist but are not readable and writable")
    return Probe(True, f"IMEX channel {usable[0]}")


@_guarded
def probe_vmm_fabric() -> Probe:
    """Whether fabric handles work: driver >= 12.4, fabric support on every GPU, an IMEX channel."""
    base = probe_driver()
    if not base:
        return base
    version = _driver.driver_version()
    if version < MIN_FABRIC_DRIVER_VERSION:
        return Probe(False, f"CUDA driver API {version} is older than 12.4 (fabric handles need 12.4)")
    vmm = _vmm_with("HANDLE_TYPE_FABRIC_SUPPORTED", "fabric")
    if not vmm:
        return vmm
    channel = _imex_channel()
    if not channel:
        return channel
    return Probe(True, f"{base.reason}; {channel.reason}")


def multicast_disabled_by_env() -> str | None:
    """Return the first set environment variable that forbids multicast, as ``"NAME=value"``.

    The values are read as booleans (:func:`tilescale_core.env.parse_flag`): any spelling of
    the value in :data:`MULTICAST_DISABLE_ENV` forbids multicast (``NCCL_NVLS_ENABLE=false``,
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=yes``, ...).  These variables belong to NCCL, torch and
    NVSHMEM, so a value TileScale cannot read forbids multicast too (the safe side), and the
    answer says why, instead of raising.
    """
    from .env import parse_flag

    for name, disabling in MULTICAST_DISABLE_ENV.items():
        value = os.environ.get(name)
        if value is None:
            continue
        off = parse_flag(name, disabling)
        try:
            if parse_flag(name, value, default=not off) == off:
                return f"{name}={value}"
        except ValueError as exc:
            return f"{name}={value} ({exc}; read as disabling multicast, to be safe)"
    return None


@_guarded
def probe_multicast() -> Probe:
    """Whether NVLink multicast is allowed and available; never creates a multicast object.

    Answers False, before any driver call, while ``NCCL_NVLS_ENABLE=0``,
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` or ``NVSHMEM_DISABLE_NVLS=1`` is set (any boolean
    spelling of these values, or a value that is no boolean: see
    :func:`multicast_disabled_by_env`).
    """
    disabled = multicast_disabled_by_env()
    if disabled:
        return Probe(False, f"multicast disabled by {disabled} in the environment")
    fabric = probe_vmm_fabric()
    if not fabric:
        return Probe(False, f"multicast needs VMM fabric handles: {fabric.reason}")
    lacking = _lacking("MULTICAST_SUPPORTED", "multicast objects")
    return Probe(True, fabric.reason) if lacking is None else lacking
