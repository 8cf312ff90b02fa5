"""The doctor lists other wheels' sections through an entry-point group, in declared order (CPU)."""

from __future__ import annotations

from pathlib import Path

import tilescale_core
from tilescale_core import doctor


class _FakeEntryPoint:
    def __init__(self, name, obj=None, error=None):
        self.name, self.value, self._obj, self._error = name, f"fake.{name}:sections", obj, error

    def load(self):
        if self._error is not None:
            raise self._error
        return self._obj


def _sections(title, order=None, boom=False):
    def sections():
        if boom:
            raise RuntimeError("probe exploded")
        return [(title, [f"{title} line"])]

    if order is not None:
        sections.order = order
    return sections


def test_sections_in_declared_order_and_failures_are_lines():
    eps = [
        _FakeEntryPoint("a_late", _sections("Late", order=50)),
        _FakeEntryPoint("b_broken", error=ImportError("no module named fake")),
        _FakeEntryPoint("c_raises", _sections("Never", order=5, boom=True)),
        _FakeEntryPoint("z_early", _sections("Early", order=1)),
    ]
    out = doctor.extension_sections(eps)
    assert [title for title, _ in out] == ["b_broken", "Early", "c_raises", "Late"]
    assert out[0][1] == ["fake.b_broken:sections could not be loaded: ImportError: no module named fake"]
    assert out[2][1] == ["fake.c_raises:sections failed: RuntimeError: probe exploded"]


def test_core_names_no_other_tilescale_wheel():
    """Core imports nothing of host or lang: they register with core, not the other way."""
    root = Path(tilescale_core.__file__).parent
    for path in [*root.rglob("*.py"), root.parent / "_tilescale_hook.py"]:
        text = path.read_text(encoding="utf-8")
        for other in ("tilescale_host", "tilescale_lang", "tilescale_examples"):
            assert other not in text, f"{path} names {other}"


def test_without_a_driver_its_reason_is_said_once(monkeypatch):
    """No driver: the driver line says why; GPUs and memory paths refer to it (issue 46: the
    reason was printed six times across the doctor and the demo)."""
    from tilescale_core import probes

    reason = "no CUDA driver: libcuda could not be loaded (no NVIDIA driver here?)"
    monkeypatch.setattr(probes, "probe_driver", lambda: probes.Probe(False, reason))
    lines = doctor.cuda_lines() + doctor.gpu_lines() + doctor.memory_path_lines()
    assert sum("no CUDA driver" in line for line in lines) == 1, lines
    assert lines[0] == f"driver: {reason}"
    paths = doctor.memory_path_lines()
    assert len(paths) == 1 and all(label in paths[0] for label in ("CUDA IPC", "VMM fabric", "multicast"))
    assert "see driver above" in paths[0]


def test_an_absent_optional_package_says_what_it_is_for(monkeypatch):
    real = doctor.importlib.metadata.version

    def version(name):
        if name == "cuda-python":
            raise doctor.importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(doctor.importlib.metadata, "version", version)
    line = next(line for line in doctor.package_lines() if line.startswith("cuda-python"))
    assert line == "cuda-python: not installed (optional: TileScale calls CUDA through cuda-bindings)"
