"""The guard service's status at ``--guard-socket``, as ``kvcr-guard status`` shows it,
with a clear word when the path is not a live guard service."""

from __future__ import annotations

import errno
import os
import stat
from collections import Counter

from kvcr.diagnose.result import CheckResult, Status
from kvcr.errors import KVCRServiceError, KVCRSocketError
from kvcr.guard.client import KVCRClient

NAME = "guard"
STATUS_TIMEOUT_S = 3.0
FIX = (
    "pass the --socket-path the guard service was started with (`kvcr-guard --socket-path "
    "S ...`) as --guard-socket"
)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a socket"


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError under a client error, if one caused it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    return None


def _not_a_guard(path: str, exc: KVCRServiceError) -> CheckResult:
    """Why ``path`` did not answer as a guard service does."""
    details = {"socket_path": path, "error": str(exc)}
    cause = _os_error(exc)
    if isinstance(exc, KVCRSocketError) and cause is not None:
        if cause.errno == errno.ECONNREFUSED:
            why = "nothing listens on this socket (left behind by a guard service that exited?)"
            fix = f"start the guard service, or {FIX}"
            return CheckResult.fail(NAME, f"--guard-socket {path}: {why}", fix, details)
        if cause.errno in (errno.EACCES, errno.EPERM):
            return CheckResult.fail(
                NAME,
                f"--guard-socket {path}: permission denied",
                "run as the guard service's user, or start it with --allow-gid naming a "
                "group of this user",
                details,
            )
        if isinstance(cause, TimeoutError):
            return CheckResult.fail(
                NAME,
                f"--guard-socket {path}: no answer within {STATUS_TIMEOUT_S:.0f} s: not a kvcr "
                "guard service, or a hung one",
                FIX,
                details,
            )
    return CheckResult.fail(
        NAME,
        f"--guard-socket {path}: not a kvcr guard service ({exc})",
        FIX,
        details,
    )


def check(path: str | None) -> CheckResult:
    if path is None:
        return CheckResult.skipped(NAME, "no --guard-socket given")
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return CheckResult.fail(
            NAME,
            f"--guard-socket {path}: {exc.strerror}",
            f"start the guard service, or {FIX}",
            {"socket_path": path},
        )
    if not stat.S_ISSOCK(mode):
        return CheckResult.fail(
            NAME,
            f"--guard-socket {path}: {_kind(mode)}, not a Unix socket",
            FIX,
            {"socket_path": path},
        )
    client = KVCRClient(path)
    client.timeout_s = STATUS_TIMEOUT_S
    try:
        groups = client.status()
    except KVCRServiceError as exc:
        return _not_a_guard(path, exc)
    states = Counter(g.state for g in groups)
    held = sum(g.holder_pid is not None for g in groups)
    summary = (
        f"{path}: {len(groups)} groups, {held} held ("
        + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        + ")"
    )
    # Rendered as `kvcr-guard status` renders it; imported here because it brings the
    # whole service module along, which only this check needs.
    from kvcr.guard.cli import group_record, status_table

    return CheckResult(
        NAME,
        Status.OK,
        summary,
        {"socket_path": path, "groups": [group_record(g) for g in groups]},
        extra=tuple(status_table(groups).splitlines()),
    )
