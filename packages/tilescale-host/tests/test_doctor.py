"""The host sections of the doctor report."""

from __future__ import annotations

from tilescale_host import doctor


def test_sections_shape_and_content(clean_env):
    sections = doctor.sections()
    assert [title for title, _ in sections] == ["Topology", "Process group"]
    for _, lines in sections:
        assert lines and all(isinstance(line, str) for line in lines)
    topo = "\n".join(sections[0][1])
    assert "NVLink full mesh:" in topo and "P2P native atomics" in topo
    assert sections[1][1][0].startswith("2-rank gloo process group") and ": ok in" in sections[1][1][0]


def test_a_failing_probe_becomes_a_line():
    line = doctor._probe("thing", lambda: 1 / 0)
    assert line == "thing: unavailable (ZeroDivisionError: division by zero)"
    assert doctor._probe("flag", lambda: True) == "flag: yes"


def test_share_mode_reads_the_switch_as_init_dist_does(clean_env):
    clean_env.setenv("TILESCALE_SHARE_GPUS", "true")
    assert doctor._share_mode() == "on ('true')"
    clean_env.setenv("TILESCALE_SHARE_GPUS", "maybe")
    line = doctor._probe("TILESCALE_SHARE_GPUS", doctor._share_mode)
    assert "TILESCALE_SHARE_GPUS='maybe' is not a boolean" in line
    clean_env.delenv("TILESCALE_SHARE_GPUS")
    assert doctor._share_mode() == "off (unset)"


def test_nvlink_mesh_without_a_gpu_is_not_applicable(monkeypatch, clean_env):
    """0 GPUs: "n/a: no GPU", not "yes (trivially: fewer than 2 GPUs)" (issue 46)."""
    from tilescale_host import _cuda

    monkeypatch.setattr(_cuda, "device_count", lambda: 0)
    lines = doctor.topology_lines()
    assert "NVLink full mesh: n/a: no GPU" in lines, lines
    assert not any("trivially" in line for line in lines)
