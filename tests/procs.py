"""Child processes for integration tests: kvcr workers (``worker_proc.py``) and the guard
service (``python -m kvcr.kvcr_service``), each started for real and stopped or SIGKILLed."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvcr import KVCRClient
from kvcr.errors import KVCRSocketError

WORKER = Path(__file__).resolve().parent / "worker_proc.py"


_children: list[subprocess.Popen] = []


@atexit.register
def _kill_children() -> None:
    # A test that failed before its teardown must not leave a child running.
    for child in _children:
        if child.poll() is None:
            child.kill()


def native_threads(prefix: str) -> list[str]:
    """This process's threads whose name starts with ``prefix``, native ones included
    (``/proc/self/task/*/comm``: the copy pool's threads are pthreads Python never sees)."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append(comm.read_text().strip())
    return sorted(name for name in names if name.startswith(prefix))


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A port nobody listens on now, for a control endpoint a process binds *later*.

    Never one from the kernel's ephemeral range: a port picked there (by binding port 0)
    may be handed to any socket that binds port 0 before ours binds it (UCX's listeners,
    an engine's ZMQ sockets), which once failed vLLM's start with "Address already in use".
    Below that range the kernel hands out nothing; each port is given out once per process.
    """
    low, _ = _ephemeral_range()
    first = max(1024, low - 12000)
    while True:
        port = random.randrange(first, low)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # a service of the host's, or another test's
        _handed_out.add(port)
        return port


def wait_until(condition: Callable[[], Any], timeout: float = 20, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy; an event in another process
    has no other way to reach us. The timeout only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


def spawn(
    program: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    stderr: Any = None,
    prefix: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start ``python PROGRAM FD ARGS...`` with FD its end of a socketpair; returns the process
    and our end, over which it takes pickled ``(command, *args)`` tuples. ``prefix`` runs it
    through another command that execs it (``ip netns exec NS``: the pid stays the child's)."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [*prefix, sys.executable, str(program), str(theirs.fileno()), *args],
        pass_fds=[theirs.fileno()],
        env={**os.environ, **(env or {})},
        stderr=stderr,
    )
    _children.append(proc)
    theirs.close()
    conn = Connection(os.dup(ours.fileno()))
    ours.close()
    return proc, conn


def ask(conn: Connection, command: tuple[object, ...], timeout: float) -> Any:
    """Send one command to a child; its ``("ok", value)`` answer's value, or raise."""
    conn.send(command)
    if not conn.poll(timeout):
        raise TimeoutError(f"the child did not answer {command[0]!r} in {timeout} s")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(value)
    return value


class SourceWorker:
    """A kvcr worker in a child process, driven over a socketpair (see worker_proc.py).

    ``sizes`` are (block bytes, pool blocks, engine region blocks); ``guard`` is
    (socket path, group index, digest) to run over a guard service's pool group.
    """

    def __init__(
        self,
        name: str,
        sizes: tuple[int, int, int],
        port: int | None = None,
        guard: tuple[str, int, str] | None = None,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """``log``: a file for the child's stderr (appended to), else it inherits ours;
        ``prefix``: see :func:`spawn`."""
        self.port = port or free_port()
        extra = [str(x) for x in guard] if guard else []
        with open(log, "ab") if log else contextlib.nullcontext() as stderr:
            self.proc, self.conn = spawn(
                WORKER,
                [name, str(self.port), *(str(x) for x in sizes), *extra],
                env,
                stderr,
                prefix,
            )
        self.endpoint = self("endpoint", timeout=60)

    def __call__(self, *command: object, timeout: float = 20) -> Any:
        return ask(self.conn, command, timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Close the worker's KVCR and end it. Fails if any engine callback of its life
        came off the engine's thread or outside a call it made into KVCR."""
        off_thread: list[str] = []
        if self.proc.poll() is None:
            try:
                off_thread = self("stop", timeout=20)
            except (EOFError, OSError, TimeoutError):
                self.proc.kill()
        self.proc.wait(20)
        self.conn.close()
        assert not off_thread, f"engine callbacks broke the thread rule: {off_thread}"


class GuardProcess:
    """``python -m kvcr.kvcr_service`` in a child process, with its stderr in a file."""

    def __init__(
        self,
        directory: Path,
        *,
        guard_count: int = 2,
        pool_sizes_gb: str = "0.0009765625",  # 1 MiB
        digest: str = "digest-1",
        extra: tuple[str, ...] = ("--idle-timeout-s", "0.5"),
        wait: bool = True,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        """``prefix``: see :func:`spawn`."""
        self.directory = Path(directory)
        self.socket_path = str(self.directory / "guard.sock")
        self.pool_dir = self.directory / "pools"
        self.pool_dir.mkdir(exist_ok=True)
        self.digest = digest
        self.log_path = self.directory / f"guard-{time.monotonic_ns()}.log"
        self.args = [
            "--socket-path",
            self.socket_path,
            "--pool-dir",
            str(self.pool_dir),
            "--guard-count",
            str(guard_count),
            "--pool-sizes-gb",
            pool_sizes_gb,
            "--compatibility-digest",
            digest,
            "--log-level",
            "DEBUG",
            *extra,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvcr.kvcr_service", *self.args],
                stderr=log,
                env={**os.environ, **(env or {})},
            )
        _children.append(self.proc)
        self.client = KVCRClient(self.socket_path)
        self.client.timeout_s = 5.0
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"guard service exited {self.proc.returncode}: {self.log()}")
            try:
                self.client.status()
            except KVCRSocketError:
                return False
            return True

        wait_until(answers, 30, "guard service start")

    def log(self) -> str:
        return self.log_path.read_text()

    def states(self) -> list[tuple[str, int | None]]:
        return [(g.state, g.holder_pid) for g in self.client.status()]

    def wait_free(self, index: int) -> None:
        """Until nobody holds group ``index`` (it is then idle, or served by the guard)."""
        wait_until(lambda: self.states()[index][1] is None, what=f"group {index} freed")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(20)
