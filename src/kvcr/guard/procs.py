"""Who is on the other end of a Unix socket, and a handle that says when it exits.

A claim is fenced by the claimant's *pidfd*: a descriptor that refers to one process (never
to a later process that reuses its pid) and becomes readable when that process exits. The
service takes it from the connection itself with ``SO_PEERPIDFD`` (Linux 6.5+), else from
the pidfd the claimant attached to its request, which it checks against the connection's
``SO_PEERCRED`` pid. A re-attaching worker also hands over its group file and its control
listener, which are checked to be what the service expects (:func:`handed_over_refusal`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import trio

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+; Python 3.11 lacks the name


@attrs.frozen
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket | trio.socket.SocketType) -> PeerCred:
    """The credentials of the process that connected ``sock`` (at connect time)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def supplementary_groups(pid: int) -> frozenset[int]:
    """The process's supplementary group ids (empty if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def access_refusal(cred: PeerCred, owner_uid: int, allowed_gid: int | None) -> str | None:
    """Why ``cred`` may not use the service, or None: the service's own uid and root may;
    with ``allowed_gid``, so may members of that group (primary or supplementary)."""
    if cred.uid in (owner_uid, 0):
        return None
    if allowed_gid is not None and (
        cred.gid == allowed_gid or allowed_gid in supplementary_groups(cred.pid)
    ):
        return None
    allowed = f"uid {owner_uid}" + (f" or gid {allowed_gid}" if allowed_gid is not None else "")
    return f"process {cred.pid} (uid {cred.uid}, gid {cred.gid}) is not {allowed}"


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd for the connecting process from the kernel, or None where it has none
    (or where ``KVCR_GUARD_PEERPIDFD=0`` says to act as on kernels without it)."""
    if os.environ.get("KVCR_GUARD_PEERPIDFD") == "0":
        return None
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None


def pidfd_pid(fd: int) -> int | None:
    """The pid a pidfd refers to; None if ``fd`` is not a pidfd or its process is gone."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        return None
    return None


def has_exited(pidfd: int) -> bool:
    """True once the process behind ``pidfd`` has exited (the pidfd is readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def close_quietly(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def claimant_pidfd(sock: socket.socket, attached: list[int]) -> tuple[int, PeerCred]:
    """The pidfd that fences a claim from ``sock``, and the peer's credentials.

    ``attached`` are the descriptors that came with the request (at most the claimant's
    pidfd); this function owns them and closes the ones it does not return. Raises
    ValueError naming the problem if no trustworthy, live pidfd can be had.
    """
    cred = peer_cred(sock)
    try:
        kernel = peer_pidfd(sock)
        if kernel is not None:
            close_quietly(*attached)
            attached = []
            fd = kernel
        elif len(attached) == 1:
            fd = attached.pop()
            if pidfd_pid(fd) != cred.pid:
                close_quietly(fd)
                raise ValueError(
                    f"the attached descriptor is not a pidfd of the connecting process {cred.pid}"
                )
        else:
            raise ValueError(
                "the claim carries no pidfd and the kernel offers no SO_PEERPIDFD; "
                "attach os.pidfd_open(os.getpid())"
            )
        if has_exited(fd):
            close_quietly(fd)
            raise ValueError(f"the claimant process {cred.pid} has already exited")
        return fd, cred
    finally:
        close_quietly(*attached)


def handed_over_refusal(
    file_fd: int, file_path: str, group_fd: int, listener_fd: int, port: int
) -> str | None:
    """Why what a re-attaching worker handed over is not the group file open as
    ``file_fd`` and a listening stream socket bound to ``port``; None if it is."""
    mine, theirs = os.fstat(file_fd), os.fstat(group_fd)
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        return f"the attached file is not this service's {file_path}"
    try:
        probe = socket.socket(fileno=os.dup(listener_fd))
    except OSError as exc:
        return f"the attached listener is not a socket: {exc}"
    with probe:
        try:
            listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            bound = probe.getsockname()
        except OSError as exc:
            return f"the attached listener cannot be read: {exc}"
        kind = probe.type
    if kind != socket.SOCK_STREAM or not listening:
        return "the attached listener is not a listening stream socket"
    if not isinstance(bound, tuple) or bound[1] != port:
        return f"the attached listener is bound to {bound!r}, not to port {port}"
    return None
