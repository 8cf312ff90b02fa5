"""GPU topology probes: NVLink full mesh, NUMA placement, P2P native atomics, stream priority.

``has_fullmesh_nvlink()`` asks NVML first and falls back to parsing ``nvidia-smi topo -m``
(:func:`parse_topo_matrix`, a pure function tested on stored outputs).  Devices are the CUDA
devices visible to this process: they are matched to NVML / nvidia-smi entries by PCI bus id,
so CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER are honoured.

The full-mesh helpers return True for zero or one visible GPU.  They describe topology and
are not, alone, proof that a multi-GPU test ran (docs/host.md, "Validation record").
"""

from __future__ import annotations

import functools
import re
import subprocess
import threading
import warnings
from pathlib import Path

from . import _cuda

__all__ = [
    "NvidiaSmiUtil",
    "cuda_stream_max_priority",
    "has_fullmesh_nvlink",
    "has_fullmesh_nvlink_pynvml",
    "is_fullmesh",
    "nvlink_adjacency",
    "parse_topo_matrix",
    "supports_p2p_native_atomic",
]

_GPU_NAME = re.compile(r"^GPU(\d+)$")
_NVLINK_CELL = re.compile(r"^NV\d+$")
_LINK_CELL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_nvml_lock = threading.Lock()
_nvml_ready = False
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")


# --------------------------------------------------------------------------- parsing


def parse_topo_matrix(text: str) -> list[list[str]]:
    """Parse ``nvidia-smi topo -m`` output into the GPU-to-GPU link matrix.

    Returns an ``n x n`` list of link labels (``"X"`` on the diagonal, ``"NV18"``, ``"PIX"``,
    ``"PHB"``, ``"SYS"``, ...) for the ``n`` GPU rows, in nvidia-smi index order.  NIC rows
    and columns, the affinity columns and the legend are ignored.

    Raises:
        ValueError: no header with GPU columns, or a GPU row with too few cells.
    """
    rows: dict[str, list[str]] = {}
    columns: list[str] | None = None
    for tokens in (line.split() for line in text.splitlines() if line.strip()):
        if _is_gpu_row(tokens):
            rows[tokens[0]] = tokens[1:]
        elif columns is None and any(_GPU_NAME.match(tok) for tok in tokens):
            columns = [tok for tok in tokens if _GPU_NAME.match(tok)]
    if columns is None:
        raise ValueError("no GPU column header found in nvidia-smi topo -m output")
    for name, cells in rows.items():
        if len(cells) < len(columns):
            raise ValueError(f"{name} row has {len(cells)} cells for {len(columns)} GPU columns")
    missing = [c for c in columns if c not in rows]
    if missing:
        raise ValueError(f"nvidia-smi topo -m output lacks rows for {missing}")
    return [rows[c][: len(columns)] for c in columns]


def _is_gpu_row(tokens: list[str]) -> bool:
    """A matrix row: ``GPU<i>`` followed by a link label (the header has GPU names instead)."""
    return len(tokens) > 1 and bool(_GPU_NAME.match(tokens[0])) and bool(_LINK_CELL.match(tokens[1]))


def nvlink_adjacency(matrix: list[list[str]]) -> list[list[bool]]:
    """``adj[i][j]`` is True when GPUs ``i`` and ``j`` are joined by NVLink (``NV#``)."""
    return [[bool(_NVLINK_CELL.match(cell)) for cell in row] for row in matrix]


def is_fullmesh(adjacency: list[list[bool]], devices: list[int] | None = None) -> bool:
    """True when every pair of distinct ``devices`` (default: all) is NVLink-connected.

    Zero or one device counts as a full mesh.
    """
    devices = list(range(len(adjacency))) if devices is None else devices
    return all(adjacency[i][j] for i in devices for j in devices if i != j)


# --------------------------------------------------------------------------- NVML


def _nvml():
    """Import pynvml and initialise NVML once per process."""
    global _nvml_ready
    import pynvml

    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True
    return pynvml


def _visible_bus_ids() -> list[str]:
    """PCI bus ids of the CUDA-visible devices, in CUDA ordinal order."""
    return [_cuda.pci_bus_id(i) for i in range(_cuda.device_count())]


def nvml_handle(ordinal: int):
    """NVML handle of CUDA device ``ordinal`` (matched by PCI bus id)."""
    pynvml = _nvml()
    return pynvml.nvmlDeviceGetHandleByPciBusId(_cuda.pci_bus_id(ordinal).encode())


@functools.cache
def has_fullmesh_nvlink_pynvml() -> bool:
    """NVML pairwise check: every pair of visible GPUs reports NVLink P2P status OK.

    True for zero or one visible GPU.  Raises when NVML is unavailable (no driver, no
    pynvml); returns False when NVML answers "not supported".
    """
    count = _cuda.device_count()
    if count <= 1:
        return True
    pynvml = _nvml()
    handles = [nvml_handle(i) for i in range(count)]
    try:
        for a in handles:
            for b in handles:
                if a is b:
                    continue
                status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status != pynvml.NVML_P2P_STATUS_OK:
                    return False
    except pynvml.NVMLError_NotSupported:
        return False
    return True


# --------------------------------------------------------------------------- nvidia-smi


class NvidiaSmiUtil:
    """Topology queries through the ``nvidia-smi`` command and Linux sysfs."""

    @staticmethod
    def topo_matrix_text() -> str:
        """Raw ``nvidia-smi topo -m`` output."""
        return subprocess.check_output(["nvidia-smi", "topo", "-m"], text=True, timeout=30)

    @staticmethod
    def bus_ids() -> list[str]:
        """PCI bus ids in nvidia-smi index order (normalised, see ``_cuda.normalize_bus_id``)."""
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], text=True, timeout=30
        )
        return [_cuda.normalize_bus_id(line) for line in out.splitlines() if line.strip()]

    @staticmethod
    def get_nvlink_adjacency_matrix() -> list[list[bool]]:
        """NVLink adjacency of all GPUs in nvidia-smi index order."""
        return nvlink_adjacency(parse_topo_matrix(NvidiaSmiUtil.topo_matrix_text()))

    @staticmethod
    def get_gpu_numa_node(index: int = 0) -> int:
        """NUMA node of CUDA device ``index``, read from ``/sys/bus/pci/devices/<bus id>/numa_node``.

        Returns -1 when the kernel reports no NUMA affinity (single-socket machines).
        Raises :class:`RuntimeError` when the device or its sysfs entry cannot be found.
        """
        return numa_node_of_bus_id(_cuda.pci_bus_id(index))


def numa_node_of_bus_id(bus_id: str, sysfs: Path = SYSFS_PCI_DEVICES) -> int:
    """NUMA node of the PCI device ``bus_id`` (-1: no affinity reported)."""
    path = Path(sysfs) / _cuda.normalize_bus_id(bus_id) / "numa_node"
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot read the NUMA node of PCI device {bus_id} from {path}: {exc}") from exc


def _fullmesh_from_nvidia_smi() -> bool:
    adjacency = NvidiaSmiUtil.get_nvlink_adjacency_matrix()
    smi_index = {bus: i for i, bus in enumerate(NvidiaSmiUtil.bus_ids())}
    devices = [smi_index[bus] for bus in _visible_bus_ids()]
    full = is_fullmesh(adjacency, devices)
    if not full and any(adjacency[i][j] for i in devices for j in devices if i != j):
        warnings.warn(
            "found NVLink between some visible GPUs but not a full mesh; kernels that assume "
            "all-to-all NVLink may be slow or wrong on this topology",
            RuntimeWarning,
            stacklevel=3,
        )
    return full


@functools.cache
def has_fullmesh_nvlink() -> bool:
    """True when every pair of visible GPUs is NVLink-connected (True for 0 or 1 GPU).

    Uses NVML when available and otherwise parses ``nvidia-smi topo -m``.  Raises
    :class:`RuntimeError` when neither source can be queried.
    """
    if _cuda.device_count() <= 1:
        return True
    try:
        return has_fullmesh_nvlink_pynvml()
    except Exception as nvml_exc:
        try:
            return _fullmesh_from_nvidia_smi()
        except Exception as smi_exc:
            raise RuntimeError(
                f"cannot determine the NVLink topology: NVML failed ({nvml_exc}); "
                f"nvidia-smi failed ({smi_exc})"
            ) from smi_exc


# --------------------------------------------------------------------------- CUDA


@functools.cache
def supports_p2p_native_atomic() -> bool:
    """Whether CUDA devices 0 and 1 support native atomics over P2P.

    Only the pair (0, 1) is checked.  Raises :class:`RuntimeError` with fewer than two
    visible GPUs.
    """
    count = _cuda.device_count()
    if count < 2:
        raise RuntimeError(f"supports_p2p_native_atomic needs at least two visible CUDA devices, found {count}")
    drv = _cuda.driver()
    attr = drv.CUdevice_P2PAttribute.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
    value = _cuda.check(
        drv.cuDeviceGetP2PAttribute(attr, _cuda.device(0), _cuda.device(1)), "cuDeviceGetP2PAttribute"
    )
    return int(value) == 1


def cuda_stream_max_priority() -> int:
    """The CUDA runtime's highest (numerically lowest) stream priority on the current device."""
    _least, greatest = _cuda.check(
        _cuda.runtime().cudaDeviceGetStreamPriorityRange(), "cudaDeviceGetStreamPriorityRange"
    )
    return int(greatest)
