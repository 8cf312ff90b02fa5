"""``ci/device-check.sh`` read as text (CPU, no GPU, no tilescale import): every step that the
``unverified`` list names has a case of its own (or is ``bench-NAME`` of a benchmark module
that exists), the header comment names it, and every test file or benchmark module a step
runs exists. A typo there would cost a GPU session a step, found only on the device."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "ci" / "device-check.sh").read_text(encoding="utf-8")
BENCHMARKS = ROOT / "packages" / "tilescale-examples" / "src" / "tilescale_examples" / "benchmarks"


def case_labels() -> set[str]:
    """The labels of the step ``case`` (``    name) ...``), globs left out."""
    return {m.group(1) for m in re.finditer(r"^ {4}([\w-]+)\)", SCRIPT, re.M)}


def unverified() -> list[str]:
    return re.search(r"^unverified=\(([^)]*)\)", SCRIPT, re.M).group(1).split()


def header() -> str:
    """The leading comment block (the steps' documentation)."""
    return "\n".join(line for line in SCRIPT.splitlines()[:60] if line.startswith("#"))


def test_every_unverified_step_has_a_case_and_is_documented():
    labels, doc = case_labels(), header()
    for step in unverified():
        module = step[len("bench-"):] if step.startswith("bench-") else None
        assert step in labels or (module and (BENCHMARKS / f"{module}.py").is_file()), step
        assert step in doc or (module and step not in labels), f"{step} is not described in the header"


def test_every_test_file_and_benchmark_module_a_step_runs_exists():
    for spec in re.findall(r"(packages/[\w-]+/tests/[\w{},]+\.py)", SCRIPT):
        head, _, tail = spec.partition("{")
        names = [head + name + tail.split("}", 1)[1] for name in tail.split("}", 1)[0].split(",")] if tail else [spec]
        for name in names:
            assert (ROOT / name).is_file(), name
    for module in re.findall(r"-m\s+tilescale_examples\.benchmarks\.(\w+)", SCRIPT):
        assert (BENCHMARKS / f"{module}.py").is_file(), module


def test_the_checks_find_what_they_look_for():
    """The parsing finds the cases and files it checks (so the tests above cannot pass empty)."""
    assert {"tests-gemm-ar", "tests-exchange", "bench-gemm_allreduce-2shot", "doctor"} <= case_labels()
    assert len(unverified()) >= 1 and "tests-graphs" in case_labels()
    assert len(re.findall(r"packages/[\w-]+/tests/[\w{},]+\.py", SCRIPT)) > 10
