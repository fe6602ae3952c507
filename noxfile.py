"""Developer sessions: ``uv run nox`` (lint, unit, integration) or ``uv run nox -s NAME``.

Each session gets its own virtualenv under ``.nox/`` (created by uv) and installs the project
with its ``dev`` dependency group from ``uv.lock``, exactly as ``uv sync`` does for ``.venv``.
The test and benchmark sessions run with the NIXL/UCX environment of a CPU-only machine
(see docs/dev-guide.md); values already set in your shell win.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "unit", "integration"]  # not bench, not soak

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
    """ruff check and ruff format --check over the whole repo."""
    install(session)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


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
