"""Automation for the TileScale monorepo.

`nox -l` lists the sessions; docs/testing.md ("Nox sessions") says what each one does.
A bare `nox` runs the CPU suite of every wheel (`nox -s tests`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
#: Each package and the tilescale packages it needs, installed from this checkout.
LOCAL_DEPENDENCIES = {
    "core": [],
    "host": ["core"],
    "lang": ["core"],
    "examples": ["core", "host", "lang"],
}
CONSTRAINTS = ROOT / "ci" / "constraints.txt"
DIST = ROOT / "dist"
#: Wheels built by ``nox -s build``: directory -> distribution name.
WHEELS = {"tilescale-core": "tilescale-core", "tilescale-host": "tilescale-host",
          "tilescale-lang": "tilescale-lang", "tilescale-examples": "tilescale-examples", "tilescale": "tilescale"}

#: The CUDA toolkit compatibility matrix, in one place: per toolkit, the registry wheels that
#: make it (``toolkit``), how kernels are compiled with it, and the torch, cuda-bindings and
#: tilelang it is tested with. The CUDA 12.1/12.2 nvcc wheels hold ptxas but no nvcc driver:
#: kernels compile with that toolkit's NVRTC and ptxas; CCCL comes from 12.9 because stock
#: tilelang's CUTLASS 4.1 needs libcu++'s <cuda/std/cassert> under NVRTC, which 12.1/12.2's
#: CCCL lacks. ``local`` is the machine's toolkit ($CUDA_HOME or /usr/local/cuda).
MATRIX = {
    "12.1": {
        "toolkit": ["nvidia-cuda-nvcc-cu12==12.1.105", "nvidia-cuda-nvrtc-cu12==12.1.105",
                    "nvidia-cuda-runtime-cu12==12.1.105", "nvidia-cuda-cccl-cu12==12.9.27"],
        "layout": "cu12", "compiler": "NVRTC 12.1 + ptxas 12.1",
        "torch": "2.13.0", "cuda-bindings": "12.9.4", "tilelang": "0.1.15",
    },
    "12.2": {
        "toolkit": ["nvidia-cuda-nvcc-cu12==12.2.140", "nvidia-cuda-nvrtc-cu12==12.2.140",
                    "nvidia-cuda-runtime-cu12==12.2.140", "nvidia-cuda-cccl-cu12==12.9.27"],
        "layout": "cu12", "compiler": "NVRTC 12.2 + ptxas 12.2",
        "torch": "2.13.0", "cuda-bindings": "12.9.4", "tilelang": "0.1.15",
    },
    "13.1": {
        "toolkit": ["nvidia-cuda-nvcc==13.1.115", "nvidia-cuda-crt==13.1.115", "nvidia-nvvm==13.1.115",
                    "nvidia-cuda-runtime==13.1.80", "nvidia-cuda-cccl==13.1.115"],
        "layout": "cu13", "compiler": "nvcc 13.1",
        "torch": "2.13.0", "cuda-bindings": "13.1.1", "tilelang": "0.1.15",
    },
    "local": {
        "toolkit": [], "layout": "local", "compiler": "nvcc of $CUDA_HOME (or /usr/local/cuda)",
        "torch": "2.13.0", "cuda-bindings": "any >= 12.8 (newest)", "tilelang": "0.1.15",
    },
}

#: ``allow_parallel=`` (sessions side by side under ``nox -j N``) came with nox 2026.8.10.
nox.needs_version = ">=2026.8.10"
nox.options.sessions = ["tests"]
#: Sessions that allow it (the CPU suites, the matrix, ...) run side by side, one per CPU; each
#: buffers its output and prints it when it ends (``-j 1``: one at a time, output live).
nox.options.parallel = "auto"


class _SequentialNotice(logging.Filter):
    """Drops nox's notice that the selected sessions run one at a time despite
    :data:`nox.options.parallel` (``nox -s demo``, ``nox -s gpu``): that is how those sessions
    are meant to run, and a newcomer would read the notice as a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No selected session allows parallel execution")


logging.getLogger("nox").addFilter(_SequentialNotice())
nox.options.default_venv_backend = "venv"


def _pkg(name: str) -> str:
    return str(PACKAGES / f"tilescale-{name}")


def _install(session: nox.Session, *names: str, extras: str = "", editable: bool = False) -> None:
    """Install the named local packages (and their local tilescale dependencies)."""
    if session.venv_backend == "none":
        session.log("no virtual environment: using the packages already installed")
        return
    wanted: list[str] = []
    for name in names:
        for dep in [*LOCAL_DEPENDENCIES[name], name]:
            if dep not in wanted:
                wanted.append(dep)
    args = ["-c", str(CONSTRAINTS)] if CONSTRAINTS.exists() else []
    targets = []
    for dep in wanted:
        target = _pkg(dep) + (f"[{extras}]" if extras and dep in names else "")
        targets += ["-e", target] if editable else [target]
    session.install(*args, *targets)


def _cuda_env() -> dict[str, str]:
    env = {}
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDA_HOME"] = "/usr/local/cuda"
    return env


def _suite_env(session: nox.Session) -> dict[str, str]:
    """:func:`_cuda_env` plus a TileLang kernel cache of this session's own (inside its virtual
    environment, so new each run): TileLang's cache key does not name the toolkit, and a kernel
    another session or an earlier run compiled must not stand in for this session's compile."""
    env = _cuda_env()
    if session.venv_backend != "none":
        env["TILELANG_CACHE_DIR"] = str(Path(session.virtualenv.location) / "tilelang-cache")
    return env


#: The CPU suites, longest first (side by side, the longest starts at once).
SUITES = ["examples", "lang", "core", "host"]
assert sorted(SUITES) == sorted(LOCAL_DEPENDENCIES), "every package has a CPU suite"


@nox.session(allow_parallel=True)
@nox.parametrize("package", SUITES)
def tests(session: nox.Session, package: str) -> None:
    """CPU suite of one wheel, installed alone (with its tilescale dependencies).

    tilescale-examples' environment holds every wheel, so its session also runs the one-run
    collection check of ``collect``."""
    _install(session, package, extras="test")
    session.run(
        "python", "-m", "pytest", str(PACKAGES / f"tilescale-{package}" / "tests"),
        "-m", "not gpu", "-p", "no:cacheprovider", "--durations=5", *session.posargs,  # a line per module
        env=_suite_env(session),
    )
    if package == "examples" and not session.posargs:
        _collect_all(session)


@nox.session
def doctor(session: nox.Session) -> None:
    """Report versions, CUDA, GPUs, memory paths and topology; exits 0 without a GPU."""
    _install(session, "core", "host", "lang")
    session.run("python", "-m", "tilescale_core.doctor", *session.posargs, env=_cuda_env())


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with Sphinx (warnings are errors)."""
    _install(session, "core", "host", "lang", "examples")
    if session.venv_backend != "none":
        # pytest: autodoc imports tilescale_host.pytest_plugin
        session.install("-c", str(CONSTRAINTS), "sphinx>=7", "myst-parser>=2", "pytest>=8")
    html = ROOT / "docs" / "_build" / "html"
    session.run("python", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(html))
    session.log(f"HTML written to {html}; open {html / 'index.html'}")


def _listed_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (at most as many as CUDA_VISIBLE_DEVICES names): asked
    before anything is installed, with no import of torch or tilescale; 0 without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60) if smi else None
    except (OSError, subprocess.SubprocessError):
        out = None
    count = sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out and out.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def _need_gpus(session: nox.Session, need: int, instead: str = "") -> None:
    """Stop the session, in one line and before it installs anything, unless ``need`` GPUs are listed."""
    have = _listed_gpus()
    what = "a CUDA GPU" if need == 1 else f"{need} or more CUDA GPUs"
    if have == 0:
        session.error(f"{session.name} needs {what} and `nvidia-smi -L` lists none: run it on a GPU machine "
                      "(`nox -s tests` is the CPU suite; `nox -s collect` collects the GPU tests)")
    if have < need:
        session.error(f"{session.name} needs {what} and `nvidia-smi -L` lists {have}{instead}")


def _visible_gpus(session: nox.Session) -> int:
    out = session.run("python", "-c", "import torch; print(torch.cuda.device_count())", silent=True)
    return int(str(out).strip().splitlines()[-1]) if out else 0


def _gpu_suite(session: nox.Session, share_gpus: bool) -> None:
    """Every package's GPU tests in ONE pytest run (the helpers' module names are unique)."""
    _install(session, "examples", extras="test", editable=True)
    env = {**_cuda_env(), "TILESCALE_SHARE_GPUS": "1" if share_gpus else "0"}
    tests = [str(PACKAGES / f"tilescale-{p}" / "tests") for p in LOCAL_DEPENDENCIES]
    session.run("python", "-m", "pytest", *tests, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                *session.posargs, env=env)


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU suite with ranks sharing the visible GPUs (how a one-GPU machine is tested)."""
    _need_gpus(session, 1)
    _gpu_suite(session, share_gpus=True)


#: GPUs ``gpu-4`` needs: its 4-rank tests run one rank per GPU over NCCL.
GPU4_GPUS = 4


@nox.session(name="gpu-4")
def gpu_4(session: nox.Session) -> None:
    """GPU suite with one rank per GPU and NCCL host groups; needs 4 or more visible GPUs."""
    _need_gpus(session, GPU4_GPUS, " (one rank per GPU): `nox -s gpu` runs the suite with ranks sharing them")
    _install(session, "examples", extras="test", editable=True)
    gpus = _visible_gpus(session)
    if gpus < GPU4_GPUS:
        session.error(
            f"gpu-4 needs {GPU4_GPUS} or more visible CUDA GPUs (one rank per GPU, NCCL host groups); "
            f"this machine has {gpus}. Run `nox -s gpu` instead: ranks share the visible GPUs over gloo."
        )
    _gpu_suite(session, share_gpus=False)


@nox.session(allow_parallel=True)
def collect(session: nox.Session) -> None:
    """Collect every package's GPU tests in ONE pytest run (-m gpu --collect-only).

    A test helper module that two packages both name (``conftest`` imports, ``helpers.py``)
    fails here. ``tests(package='examples')`` runs the same check."""
    _install(session, "examples", extras="test")
    _collect_all(session)


def _collect_all(session: nox.Session) -> None:
    """The one-run collection check, in an environment that has every wheel installed."""
    tests = [str(PACKAGES / f"tilescale-{p}" / "tests") for p in LOCAL_DEPENDENCIES]
    # --rootdir: node ids then start with packages/tilescale-<name>/tests/ for every package
    out = session.run("python", "-m", "pytest", *tests, "-m", "gpu", "--collect-only", "-q",
                      "--rootdir", str(ROOT), "-p", "no:cacheprovider", env=_cuda_env(), silent=True)
    lines = str(out).splitlines()
    print("\n".join(lines[-3:]))
    for p in LOCAL_DEPENDENCIES:  # each package contributes GPU tests to the one run
        if not any(f"tilescale-{p}/tests/" in line for line in lines):
            session.error(f"the one-run collection has no GPU test of tilescale-{p}:\n" + "\n".join(lines[-20:]))


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: the doctor's summary, then the kernels users come for.

    On the GPUs each kernel runs against torch; without one, it is compiled for sm_90a with nvcc."""
    _install(session, "examples")
    session.run("python", "-m", "tilescale_examples.demo", *session.posargs, env=_cuda_env())


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark of tilescale-examples (GPU machine; without a GPU each says so)."""
    _install(session, "examples")
    session.run("python", "-m", "tilescale_examples.benchmarks", *session.posargs, env=_cuda_env())


# ------------------------------------------------------------------------------ toolkit matrix
def _site_packages(session: nox.Session) -> Path:
    out = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    return Path(str(out).strip().splitlines()[-1])


def _link_tree(dst: Path, sources: list[Path]) -> None:
    """``dst`` as the union of ``sources``: symlinks to their entries, merging directories."""
    dst.mkdir(parents=True, exist_ok=True)
    for src in sources:
        if not src.is_dir():
            continue
        for entry in src.iterdir():
            if entry.name in ("__init__.py", "__pycache__"):
                continue
            target = dst / entry.name
            if target.is_symlink() and target.resolve().is_dir() and entry.is_dir():
                first = target.resolve()
                target.unlink()
                _link_tree(target, [first, entry])
            elif target.is_dir() and not target.is_symlink() and entry.is_dir():
                _link_tree(target, [entry])
            elif not target.exists() and not target.is_symlink():
                target.symlink_to(entry)


def _cuda_home(session: nox.Session, layout: str) -> Path:
    """The CUDA_HOME the installed toolkit wheels make."""
    site = _site_packages(session)
    if layout == "cu13":
        return site / "nvidia" / "cu13"  # the 13.x wheels share one toolkit tree
    nv = site / "nvidia"
    home = Path(session.virtualenv.location) / "cuda-home"
    if home.exists():
        shutil.rmtree(home)
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "ptxas").symlink_to(nv / "cuda_nvcc" / "bin" / "ptxas")
    _link_tree(home / "include", [nv / "cuda_runtime" / "include", nv / "cuda_nvcc" / "include",
                                  nv / "cuda_cccl" / "include"])
    _link_tree(home / "lib", [nv / "cuda_nvrtc" / "lib", nv / "cuda_runtime" / "lib"])
    _link_tree(home / "nvvm", [nv / "cuda_nvcc" / "nvvm"])
    return home


#: Test modules of tilescale-lang and tilescale-examples that neither lower nor compile device
#: code (host-side logic, benchmark tables, torch references): their results do not depend on
#: the toolkit, ``tests`` runs them, and the matrix sessions leave them out.
TOOLKIT_INDEPENDENT_TESTS = [
    "tilescale-lang/tests/test_core_check.py",
    "tilescale-examples/tests/test_benchmarks.py",
    "tilescale-examples/tests/test_emulated.py",
    "tilescale-examples/tests/test_report.py",
    "tilescale-examples/tests/test_stream_ops.py",
]


@nox.session(allow_parallel=True)
@nox.parametrize("cuda", list(MATRIX))
def matrix(session: nox.Session, cuda: str) -> None:
    """The lang and examples CPU suites against one CUDA toolkit of the matrix (docs/compatibility.md).

    Every header, intrinsic and example kernel compiles for sm_90a with that toolkit and the
    PTX checks pass; the modules of :data:`TOOLKIT_INDEPENDENT_TESTS` are left out."""
    entry = MATRIX[cuda]
    _install(session, "examples", extras="test")
    if entry["layout"] == "local":
        env = _cuda_env()
    else:
        session.install("-c", str(CONSTRAINTS), f"cuda-bindings=={entry['cuda-bindings']}", *entry["toolkit"])
        home = _cuda_home(session, entry["layout"])
        env = {"CUDA_HOME": str(home), "LD_LIBRARY_PATH": str(home / "lib"),
               "PATH": f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    session.run("python", "-c", "from tilescale_lang.toolkit import find_toolkit; t = find_toolkit(); "
                "print('toolkit:', t); assert t is not None", env=env)
    if cuda != "local":
        session.run("python", "-c", f"from tilescale_lang.toolkit import find_toolkit; "
                    f"assert find_toolkit().version == {tuple(int(x) for x in cuda.split('.'))}", env=env)
    if session.venv_backend != "none":
        env["TILELANG_CACHE_DIR"] = str(Path(session.virtualenv.location) / "tilelang-cache")
    ignore = [f"--ignore={PACKAGES / m}" for m in TOOLKIT_INDEPENDENT_TESTS]
    session.run("python", "-m", "pytest", str(PACKAGES / "tilescale-lang" / "tests"),
                str(PACKAGES / "tilescale-examples" / "tests"), *ignore, "-m", "not gpu", "-q", "-rs",
                "-p", "no:cacheprovider", *session.posargs, env=env)


def matrix_table() -> str:
    """:data:`MATRIX` as a Markdown table (``docs/compatibility.md`` carries it)."""
    rows = ["| CUDA toolkit | compiled with | torch | cuda-bindings | tilelang | toolkit wheels |",
            "|---|---|---|---|---|---|"]
    for cuda, e in MATRIX.items():
        wheels = ", ".join(f"`{w}`" for w in e["toolkit"]) or "the machine's"
        rows.append(f"| {cuda} | {e['compiler']} | {e['torch']} | {e['cuda-bindings']} | {e['tilelang']} | {wheels} |")
    return "\n".join(rows)


@nox.session(name="matrix_table", venv_backend="none")
def matrix_table_session(session: nox.Session) -> None:
    """Print the compatibility matrix; `-- --check FILE` fails unless FILE carries it."""
    table = matrix_table()
    print(table)
    if session.posargs[:1] == ["--check"]:
        text = Path(session.posargs[1]).read_text(encoding="utf-8")
        if table not in text:
            session.error(f"{session.posargs[1]} does not carry the current matrix table (nox -s matrix_table)")


# ------------------------------------------------------------------------------ lower bounds
def lower_bounds(package: str) -> list[str]:
    """``name==lowest`` for every third-party dependency of ``package`` (its ``>=`` floors)."""
    import re
    import tomllib

    data = tomllib.loads((Path(_pkg(package)) / "pyproject.toml").read_text(encoding="utf-8"))
    pins = []
    for dep in data["project"]["dependencies"]:
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][^,;\s]*)", dep)
        if m and not m.group(1).startswith("tilescale"):
            pins.append(f"{m.group(1)}=={m.group(2)}")
    return pins


@nox.session(name="lower-bounds", allow_parallel=True)
@nox.parametrize("package", list(LOCAL_DEPENDENCIES))
def lower_bounds_session(session: nox.Session, package: str) -> None:
    """CPU suite of one wheel with every dependency at its declared lowest version.

    torch, cuda-bindings, tilelang, ... at their ``>=`` floors; the sibling tilescale wheels
    from this checkout (0.1.0, the lowest each range allows). torch's lowest release comes
    from the registry as a CUDA build (several GB)."""
    pins = []
    for dep in [*LOCAL_DEPENDENCIES[package], package]:
        pins += lower_bounds(dep)
    pins = sorted(set(pins))
    session.log("lower bounds: " + " ".join(pins))
    targets = [_pkg(d) for d in LOCAL_DEPENDENCIES[package]] + [_pkg(package) + "[test]"]
    session.install(*pins, *targets)
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    session.run("python", "-m", "pytest", str(PACKAGES / f"tilescale-{package}" / "tests"), "-m", "not gpu",
                "-q", "-p", "no:cacheprovider", *session.posargs, env=_suite_env(session))


# ------------------------------------------------------------------------------ build and install
@nox.session
def build(session: nox.Session) -> None:
    """Each package's wheel and sdist into dist/ (each with its own version)."""
    session.install("build>=1")
    if DIST.exists():
        shutil.rmtree(DIST)
    for directory in WHEELS:
        session.run("python", "-m", "build", "--outdir", str(DIST), str(PACKAGES / directory))
    for f in sorted(DIST.iterdir()):
        session.log(f.name)


@nox.session
def snippets(session: nox.Session) -> None:
    """Run README.md's and docs/quickstart.md's CPU snippets in this fresh environment, each after
    its install line, from dist/ (``nox -s build`` first); see ci/snippets.py."""
    import sys

    sys.path.insert(0, str(ROOT / "ci"))
    import snippets as doc_snippets

    if not any(DIST.glob("*.whl")):
        session.error("dist/ has no wheels: run `nox -s build` first")
    env = {**_cuda_env(), "TILELANG_CACHE_DIR": str(Path(session.virtualenv.location) / "tilelang-cache")}
    ran = 0
    for doc in doc_snippets.DOCS:
        for snip in doc_snippets.snippets((ROOT / doc).read_text(encoding="utf-8")):
            if snip.kind != "cpu":
                continue
            session.log(f"{doc}:{snip.line}: {snip.install}")
            session.install("-c", str(CONSTRAINTS), "--find-links", str(DIST), *doc_snippets.requirement(snip.install))
            session.run("python", "-c", snip.code, env=env)
            ran += 1
    if not ran:
        session.error("no <!-- snippet: cpu --> block found in " + ", ".join(doc_snippets.DOCS))


#: install-parts cases: what to ask pip for, and the tilescale distributions it must bring.
PARTS = {
    "lang": ("tilescale-lang=={lang}", {"tilescale-core", "tilescale-lang"}),
    "host": ("tilescale-host=={host}", {"tilescale-core", "tilescale-host"}),
    "meta": ("tilescale[distributed]>={meta}", {"tilescale", "tilescale-core", "tilescale-lang", "tilescale-host"}),
    "examples": ("tilescale-examples=={examples}", {"tilescale-core", "tilescale-host", "tilescale-lang", "tilescale-examples"}),
}


def _dist_versions() -> dict[str, str]:
    """``{short name: version}`` of the wheels in ``dist/``."""
    versions = {}
    for whl in DIST.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        versions[{"tilescale": "meta"}.get(name, name.removeprefix("tilescale_"))] = version
    return versions


@nox.session(name="install-parts")
@nox.parametrize("part", list(PARTS))
def install_parts(session: nox.Session, part: str) -> None:
    """Install one part from dist/ into a fresh environment and smoke-test it.

    ``nox -s build`` first. Checks which tilescale distributions came with the part,
    smoke-imports it and lowers a kernel on the CPU."""
    versions = _dist_versions()
    if not versions:
        session.error("dist/ has no wheels: run `nox -s build` first")
    spec, expected = PARTS[part]
    spec = spec.format(**versions)
    session.install("-c", str(CONSTRAINTS), "--find-links", str(DIST), spec)
    out = session.run("python", "-m", "pip", "list", "--format=freeze", silent=True)
    have = {line.split("==")[0].lower() for line in str(out).splitlines() if line.lower().startswith("tilescale")}
    if have != expected:
        session.error(f"{spec} installed the tilescale distributions {sorted(have)}, expected {sorted(expected)}")
    if "tilelang==" not in str(out):
        session.error(f"{spec} did not install tilelang")
    session.log(f"{spec}: {sorted(have)} + tilelang")
    session.run("python", str(ROOT / "ci" / "smoke.py"), part, env=_cuda_env())
