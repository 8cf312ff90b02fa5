"""Automation for the TileScale monorepo.

Sessions (``nox -l`` lists them):

- ``tests``: the CPU suite. Each wheel is installed, with only the tilescale wheels it
  depends on, into its own virtual environment and its tests run there (``-m "not gpu"``).
  ``nox -s "tests(package='core')"`` runs one package.
- ``doctor``: the main job until the examples exist: versions, CUDA, GPUs, memory paths,
  topology, and on a GPU machine a 2-rank heap round trip.
- ``docs``: builds ``docs/`` with Sphinx, warnings as errors, API pages from docstrings.
- ``gpu``: the GPU suite of every package with ranks sharing the visible GPUs
  (``TILESCALE_SHARE_GPUS=1``); ``gpu-4`` runs it with one rank per GPU on 4 GPUs.
- ``bench``: every benchmark in tilescale-examples, each printing ratios to its baseline.

On a machine without a package registry (the GPU machines), run a session against the
already-installed packages with ``nox --no-venv -s gpu`` (or use ``ci/device-check.sh``).
"""

from __future__ import annotations

import os
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

nox.options.sessions = ["tests"]
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


@nox.session
@nox.parametrize("package", list(LOCAL_DEPENDENCIES))
def tests(session: nox.Session, package: str) -> None:
    """CPU suite of one wheel, installed alone (with its tilescale dependencies)."""
    _install(session, package, extras="test")
    session.run(
        "python", "-m", "pytest", str(PACKAGES / f"tilescale-{package}" / "tests"),
        "-m", "not gpu", "-q", "-p", "no:cacheprovider", *session.posargs,
        env=_cuda_env(),
    )


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
    session.run(
        "python", "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
        str(ROOT / "docs"), str(ROOT / "docs" / "_build" / "html"),
    )


def _gpu_suite(session: nox.Session, share_gpus: bool) -> None:
    _install(session, "examples", extras="test", editable=True)
    env = {**_cuda_env(), "TILESCALE_SHARE_GPUS": "1" if share_gpus else "0"}
    tests = [str(PACKAGES / f"tilescale-{p}" / "tests") for p in LOCAL_DEPENDENCIES]
    session.run("python", "-m", "pytest", *tests, "-m", "gpu", "-q", "-rs", *session.posargs, env=env)


@nox.session
def gpu(session: nox.Session) -> None:
    """GPU suite with ranks sharing the visible GPUs (how a one-GPU machine is tested)."""
    _gpu_suite(session, share_gpus=True)


@nox.session(name="gpu-4")
def gpu_4(session: nox.Session) -> None:
    """GPU suite with one rank per GPU on a 4-GPU machine (NCCL host groups)."""
    _gpu_suite(session, share_gpus=False)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark of tilescale-examples (GPU machine)."""
    _install(session, "examples")
    for name in ("heap", "signals", "putget", "allgather", "reducescatter", "alltoall", "allreduce", "ag_gemm", "moe"):
        session.run("python", "-m", f"tilescale_examples.benchmarks.{name}", env=_cuda_env())
