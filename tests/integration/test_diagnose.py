"""``kvcr diagnose`` through its public entry points: the console script and
``python -m kvcr``, as subprocesses, judged by exit code and the --json document."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from procs import GuardProcess, free_port

pytestmark = pytest.mark.integration

SCRIPT = Path(sys.executable).parent / "kvcr"
SOURCES = Path(__file__).resolve().parents[2] / "src" / "kvcr"
CHECKS = [
    "python",
    "kvcr",
    "dependencies",
    "engine",
    "environment",
    "nixl_backends",
    "ucx",
    "ucx_lo",
    "ucx_host",
    "self_test",
    "control_port",
    "guard",
]
PASSING = {"ok", "warn", "skipped"}


def diagnose(
    *args: str, module: bool = False, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvcr"] if module else [str(SCRIPT)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON document; stdout holds nothing else."""
    try:
        return json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"stdout is not one JSON document:\n{proc.stdout}\nstderr:\n{proc.stderr}")


def failing(doc: dict[str, Any]) -> list[str]:
    return [name for name, check in doc["checks"].items() if check["status"] == "fail"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_console_script_runs_every_check_and_the_self_test_moves_verified_bytes() -> None:
    proc = diagnose("diagnose", "--json")
    doc = report(proc)
    assert proc.returncode == 0, (failing(doc), proc.stderr)
    assert (doc["format"], doc["exit_code"]) == ("kvcr-diagnose/1", 0)
    assert list(doc["checks"]) == CHECKS
    assert {c["status"] for c in doc["checks"].values()} <= PASSING
    test = doc["checks"]["self_test"]
    assert test["details"]["bytes_verified"] is True
    assert test["details"]["mib"] == 64
    assert test["details"]["steady_gb_per_s"] > 0
    assert test["details"]["first_touch_gb_per_s"] > 0
    kvcr = doc["checks"]["kvcr"]
    assert kvcr["status"] == "ok"
    assert kvcr["details"]["import_path"] == str(SOURCES)
    backends = doc["checks"]["nixl_backends"]["details"]["backends"]
    assert backends["UCX"]["ok"] is True
    ucx = doc["checks"]["ucx"]["details"]
    assert "tcp/lo" in ucx["in_use"]
    assert ucx["version"].count(".") == 2
    assert doc["checks"]["dependencies"]["details"]["packages"]["nixl-cu13"]["version"]


def test_module_entry_prints_the_table() -> None:
    proc = diagnose("diagnose", "--skip-self-test", "--host", "127.0.0.1", module=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(
        i for i, line in enumerate(lines) if line.split() == ["check", "status", "summary"]
    )
    table = lines[header + 1 : lines.index("", header)]
    rows = {line.split()[0]: line.split()[1] for line in table}
    assert list(rows) == CHECKS
    assert rows["self_test"] == "skipped"
    assert rows["ucx_host"] in {"ok", "warn"}
    assert "127.0.0.1 is on lo" in proc.stdout
    assert lines[-1].startswith("result: ") and lines[-1].endswith("exit code 0")


def test_a_free_control_port_passes_a_message() -> None:
    port = free_port()
    proc = diagnose("diagnose", "--json", "--skip-self-test", "--control-port", str(port))
    doc = report(proc)
    assert proc.returncode == 0, failing(doc)
    check = doc["checks"]["control_port"]
    assert check["status"] in {"ok", "warn"}
    assert check["details"]["endpoint"] == f"tcp://127.0.0.1:{port}"


def test_a_busy_control_port_fails_naming_the_flag(busy_port: int) -> None:
    proc = diagnose("diagnose", "--json", "--skip-self-test", "--control-port", str(busy_port))
    doc = report(proc)
    assert proc.returncode == 1
    assert failing(doc) == ["control_port"]
    check = doc["checks"]["control_port"]
    assert f"--control-port {busy_port}" in check["summary"]
    assert "in use" in check["summary"]
    assert "--control-port" in check["fix"]
    assert doc["exit_code"] == 1


def test_guard_socket_shows_a_live_guards_groups(tmp_path: Path) -> None:
    guard = GuardProcess(tmp_path)
    try:
        proc = diagnose(
            "diagnose", "--json", "--skip-self-test", "--guard-socket", guard.socket_path
        )
        doc = report(proc)
        text = diagnose("diagnose", "--skip-self-test", "--guard-socket", guard.socket_path)
    finally:
        assert guard.stop() == 0, guard.log()
    assert proc.returncode == 0, failing(doc)
    check = doc["checks"]["guard"]
    assert check["status"] == "ok"
    groups = check["details"]["groups"]
    assert [g["group"] for g in groups] == [0, 1]
    assert all(g["holder_pid"] is None for g in groups)
    assert text.returncode == 0
    # The group table as `kvcr-guard status` prints it, under the checks.
    after = text.stdout.split("\nguard:\n", 1)[1].splitlines()
    assert after[0].split()[:3] == ["group", "state", "holder"]
    assert [line.split()[0] for line in after[1:3]] == ["0", "1"]


@pytest.fixture
def impostor(tmp_path: Path) -> Iterator[str]:
    """A Unix socket whose server answers like a web server, not like a guard service."""
    path = str(tmp_path / "impostor.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield path
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)


@pytest.fixture
def stale_socket(tmp_path: Path) -> str:
    """A socket file nothing listens on any more."""
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(path)
    return path


@pytest.mark.parametrize("kind", ["plain_file", "impostor", "stale_socket", "missing"])
def test_a_guard_socket_that_is_no_guard_fails_naming_the_flag(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "plain_file":
        path = tmp_path / "not-a-socket"
        path.write_text("hello")
        target = str(path)
    elif kind == "missing":
        target = str(tmp_path / "nothing-here.sock")
    else:
        target = request.getfixturevalue(kind)
    proc = diagnose("diagnose", "--skip-self-test", "--guard-socket", target)
    assert proc.returncode == 1, proc.stdout
    guard_row = next(line for line in proc.stdout.splitlines() if line.startswith("guard "))
    assert guard_row.split()[1] == "fail"
    assert f"--guard-socket {target}" in guard_row
    assert "  guard (fail): " in proc.stdout  # and the fix under the table


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["diagnose", "--control-port", "70000"], "--control-port"),
        (["diagnose", "--self-test-mib", "0"], "--self-test-mib"),
        (["diagnose", "--no-such-flag"], "--no-such-flag"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_bad_flags_exit_2_naming_them(args: list[str], named: str) -> None:
    proc = diagnose(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert proc.stdout == ""


def test_a_kvcr_other_than_the_installed_one_is_flagged(tmp_path: Path) -> None:
    # `python -m` puts the working directory first on sys.path: a kvcr there shadows the
    # installed one, as a stray copy in a job's directory would.
    shutil.copytree(SOURCES, tmp_path / "kvcr", ignore=shutil.ignore_patterns("__pycache__"))
    proc = diagnose("diagnose", "--json", "--skip-self-test", module=True, cwd=tmp_path)
    doc = report(proc)
    assert proc.returncode == 1
    assert failing(doc) == ["kvcr"]
    check = doc["checks"]["kvcr"]
    assert check["details"]["import_path"] == str((tmp_path / "kvcr").resolve())
    assert str(SOURCES) in check["summary"]
    assert "shadows" in check["fix"]
