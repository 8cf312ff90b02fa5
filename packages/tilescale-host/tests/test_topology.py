"""The nvidia-smi topo -m parser on stored layouts, the NUMA reader, the no-GPU answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilescale_host import _cuda, topology
from tilescale_host.topology import is_fullmesh, nvlink_adjacency, numa_node_of_bus_id, parse_topo_matrix


FIXTURES = Path(__file__).parent / "fixtures"


def layout(name: str) -> list[list[str]]:
    return parse_topo_matrix((FIXTURES / "topo" / name).read_text(encoding="utf-8"))


def test_hgx_8gpu_nv18_full_mesh_ignores_nic_rows_and_legend():
    m = layout("hgx_h100_8gpu_nv18.txt")
    assert len(m) == 8 and all(len(row) == 8 for row in m)
    assert m[0][:3] == ["X", "NV18", "NV18"]
    assert is_fullmesh(nvlink_adjacency(m))


def test_pcie_4gpu_is_not_a_mesh():
    m = layout("pcie_4gpu.txt")
    assert m[0] == ["X", "PIX", "PHB", "SYS"]
    adj = nvlink_adjacency(m)
    assert not any(any(row) for row in adj)
    assert not is_fullmesh(adj)


def test_dgx1_partial_mesh_full_on_a_subset_only():
    adj = nvlink_adjacency(layout("dgx1v_8gpu_partial_mesh.txt"))
    assert not is_fullmesh(adj)
    assert is_fullmesh(adj, [0, 1, 2, 3])  # the quad is all-to-all NVLink
    assert not is_fullmesh(adj, [0, 5])


def test_single_gpu_and_trivial_meshes():
    m = layout("single_gpu.txt")
    assert m == [["X"]]
    assert is_fullmesh(nvlink_adjacency(m))
    assert is_fullmesh([], [])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("Legend:\n  X = Self\n", "no GPU column header"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "lacks rows for"),
        ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", "GPU0 row has 1 cells for 2"),
    ],
)
def test_parser_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_topo_matrix(text)


def test_numa_node_from_sysfs(tmp_path):
    dev = tmp_path / "0000:18:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert numa_node_of_bus_id("00000000:18:00.0", tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert numa_node_of_bus_id("0000:18:00.0", tmp_path) == -1
    with pytest.raises(RuntimeError, match="cannot read the NUMA node of PCI device 0000:19:00.0"):
        numa_node_of_bus_id("0000:19:00.0", tmp_path)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [("00000000:18:00.0", "0000:18:00.0"), ("0000:1B:00.0", "0000:1b:00.0"), ("18:00.0", "0000:18:00.0")],
)
def test_bus_id_normalisation(raw, norm):
    assert _cuda.normalize_bus_id(raw) == norm


def test_fullmesh_from_nvidia_smi_maps_visible_devices(monkeypatch):
    """CUDA ordinals are matched to nvidia-smi rows by bus id (CUDA_VISIBLE_DEVICES=4,5 here)."""
    text = (FIXTURES / "topo" / "dgx1v_8gpu_partial_mesh.txt").read_text(encoding="utf-8")
    smi_bus = [f"0000:{0x10 + i:02x}:00.0" for i in range(8)]
    monkeypatch.setattr(topology.NvidiaSmiUtil, "topo_matrix_text", staticmethod(lambda: text))
    monkeypatch.setattr(topology.NvidiaSmiUtil, "bus_ids", staticmethod(lambda: smi_bus))
    monkeypatch.setattr(topology, "_visible_bus_ids", lambda: [smi_bus[4], smi_bus[5]])
    assert topology._fullmesh_from_nvidia_smi() is True
    monkeypatch.setattr(topology, "_visible_bus_ids", lambda: [smi_bus[0], smi_bus[5], smi_bus[1]])
    with pytest.warns(RuntimeWarning, match="not a full mesh"):
        assert topology._fullmesh_from_nvidia_smi() is False


def test_without_gpu(monkeypatch):
    monkeypatch.setattr(_cuda, "device_count", lambda: 1)
    topology.has_fullmesh_nvlink.cache_clear()
    topology.has_fullmesh_nvlink_pynvml.cache_clear()
    topology.supports_p2p_native_atomic.cache_clear()
    try:
        assert topology.has_fullmesh_nvlink() is True
        assert topology.has_fullmesh_nvlink_pynvml() is True
        with pytest.raises(RuntimeError, match="at least two visible CUDA devices, found 1"):
            topology.supports_p2p_native_atomic()
    finally:
        topology.has_fullmesh_nvlink.cache_clear()
        topology.has_fullmesh_nvlink_pynvml.cache_clear()
        topology.supports_p2p_native_atomic.cache_clear()


def test_pci_bus_id_stops_at_the_c_string_terminator(monkeypatch):
    """cuDeviceGetPCIBusId fills a fixed-size buffer: text after the first NUL is junk."""

    class FakeDriver:
        @staticmethod
        def cuDeviceGetPCIBusId(length, dev):
            return (0, b"0000:00:06.0\x00\x07junk" + b"\x00" * 40)

    monkeypatch.setattr(_cuda, "driver", lambda: FakeDriver)
    monkeypatch.setattr(_cuda, "device", lambda ordinal: ordinal)
    monkeypatch.setattr(_cuda, "check", lambda result, what: result[1])
    assert _cuda.pci_bus_id(0) == "0000:00:06.0"
