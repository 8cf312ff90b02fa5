"""The repository's own front doors (CPU, no tilescale import): the README's and quick start's
snippets only use what the install line before them installs, ``nox -l`` starts with a short
docstring, docs/testing.md lists every nox session, and the GPU sessions stop at once without
GPUs (issue 46).  ``.ci/run`` runs this module; the nox tests need nox (skipped without it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))
import check_nox_doc  # noqa: E402
import snippets as doc_snippets  # noqa: E402

needs_nox = pytest.mark.skipif(importlib.util.find_spec("nox") is None, reason="nox is not installed")

#: Its requirements: quoted, or editable checkout paths.
REQUIREMENT = re.compile(r'"([^"]+)"|-e (packages/[\w-]+)')
#: What a snippet uses: ``import x`` / ``from x import`` in Python, ``-m x`` on a command line.
USES = re.compile(r"^\s*(?:from|import)\s+([\w.]+)|(?:-m|python -m)\s+(tilescale_\w+)", re.M)


def _requires(dist: str) -> list[str]:
    """The tilescale distributions ``dist`` (``tilescale[examples]``) depends on, itself included."""
    name, _, extra = dist.partition("[")
    folder = ROOT / "packages" / name
    text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M).group(1)
    if extra:
        deps += re.search(rf"^{extra.rstrip(']')} = \[(.*?)\]", text, re.M).group(1)
    out = [name]
    for dep in re.findall(r'"(tilescale[\w-]*)', deps):
        out += [d for d in _requires(dep) if d not in out]
    return out


def _installed(command: str) -> set[str]:
    out = set()
    for m in REQUIREMENT.finditer(command):
        out.update(_requires(re.match(r"(?:packages/)?([\w-]+(?:\[\w+\])?)", m.group(1) or m.group(2)).group(1)))
    return out


def _provider(module: str) -> str | None:
    """The tilescale distribution ``module`` comes from (None: stock or third-party)."""
    if module.startswith("tilelang.distributed"):
        return "tilescale-host"
    top = module.split(".")[0]
    return top.replace("_", "-") if top.startswith("tilescale_") else None


def snippet_problems(text: str) -> list[str]:
    """Each use of a tilescale module in a code block or ``-m`` command of ``text`` that the
    latest install line before it does not install."""
    problems, installed, install_line = [], set(), None
    events = [(m.start(), "install", m.group(0)) for m in doc_snippets.INSTALL.finditer(text)]
    events += [(m.start(), "use", m.group(1) or m.group(2)) for m in USES.finditer(text)]
    for _, kind, what in sorted(events):
        if kind == "install":
            installed, install_line = _installed(what), what
            continue
        need = _provider(what)
        if need and need not in installed:
            problems.append(f"{what} needs {need}, which {install_line or 'no install line before it'} "
                            f"does not install")
    return problems


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_snippets_use_only_what_the_install_line_before_them_installs(doc):
    assert snippet_problems((ROOT / doc).read_text(encoding="utf-8")) == []


def test_the_snippet_check_sees_a_missing_extra():
    text = ('pip install --find-links dist "tilescale[distributed]>=0.1"\n'
            "```python\nfrom tilescale_examples.tutorials.ring_put import x\n```")
    assert snippet_problems(text) == [
        "tilescale_examples.tutorials.ring_put needs tilescale-examples, which "
        'pip install --find-links dist "tilescale[distributed]>=0.1" does not install']
    assert snippet_problems(text.replace("[distributed]", "[examples]")) == []


def test_meta_package_readme_keeps_the_version_floor():
    text = (ROOT / "packages" / "tilescale" / "README.md").read_text(encoding="utf-8")
    specs = re.findall(r'pip install "([^"]+)"', text)
    assert specs and all(">=0.1" in spec for spec in specs), specs


def test_noxfile_docstring_is_a_few_plain_lines():
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8")))
    assert len(doc.splitlines()) <= 6, doc
    assert "``" not in doc and ":data:" not in doc, doc


def test_check_nox_doc_names_what_the_list_lacks():
    doc = check_nox_doc.section("intro `x`\n## Nox sessions\n\n- `a`, `b(p='1')`: ...\n\n## Next\n`c`\n")
    assert check_nox_doc.problems(["a", "b(p='1')"], doc) == []
    assert check_nox_doc.problems(["a", "b(p='1')", "c"], doc) == ["the list does not name the session ``c``"]
    assert check_nox_doc.problems(["b(p='1')", "a"], doc) == ["the list has ``a`` where nox -l has ``b(p='1')``"]


def _nox(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


@needs_nox
def test_testing_md_lists_every_nox_session():
    out = _nox("-l", "--json", "-k", "tests or not tests")
    sessions = [entry["session"] for entry in json.loads(out.stdout)]
    doc = check_nox_doc.section((ROOT / "docs" / "testing.md").read_text(encoding="utf-8"))
    assert check_nox_doc.problems(sessions, doc) == []


@needs_nox
@pytest.mark.parametrize("session", ["gpu", "gpu-4"])
def test_gpu_sessions_stop_in_one_line_before_installing(session, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this machine has
    start = time.monotonic()
    out = _nox("--envdir", str(tmp_path), "-s", session, env=env)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert elapsed < 40, f"{session} took {elapsed:.0f} s to say it has no GPU"
    text = out.stdout + out.stderr
    assert f"{session} needs" in text and "lists none" in text, text
    assert "pip install" not in text and "python -m pip" not in text, text



@pytest.mark.parametrize("doc", doc_snippets.DOCS)
def test_every_python_block_says_where_it_runs(doc):
    assert doc_snippets.problems((ROOT / doc).read_text(encoding="utf-8"), doc) == []


def test_snippet_markers_and_install_lines_are_read():
    text = ('pip install --find-links dist "tilescale[examples]>=0.1"\n\n<!-- snippet: cpu -->\n```python\nprint(1)\n```\n'
            "```python\nx\n```\n")
    found = doc_snippets.snippets(text)
    assert [(s.kind, s.install, s.code) for s in found] == [
        ("cpu", 'pip install --find-links dist "tilescale[examples]>=0.1"', "print(1)\n"), (None, 'pip install --find-links dist "tilescale[examples]>=0.1"', "x\n")]
    assert doc_snippets.problems(text) == ["document:7: python block without a <!-- snippet: cpu|gpu|fragment --> marker"]
    assert doc_snippets.requirement(found[0].install) == ["tilescale[examples]>=0.1"]


def test_quick_start_shows_the_ring_put_program_as_it_is():
    """The quick start's program is the tutorial's source (from ``import os``), inline so that it
    reads on a code host as well as in the built docs."""
    source = (ROOT / "packages/tilescale-examples/src/tilescale_examples/tutorials/ring_put.py").read_text(encoding="utf-8")
    program = source[source.index("import os"):]
    blocks = [s.code for s in doc_snippets.snippets((ROOT / "docs/quickstart.md").read_text(encoding="utf-8"))]
    assert program in blocks


def test_docs_read_on_a_code_host_without_sphinx_directives():
    """Pages a newcomer opens first carry no Sphinx directive (they show raw on a code host)."""
    for page in ("README.md", "docs/index.md", "docs/quickstart.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert "```{" not in text, page
