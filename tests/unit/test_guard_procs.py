"""Who is on the other end of a guard connection, and the pidfd that fences its claim."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvcr.guard import procs
from kvcr.guard.procs import (
    PeerCred,
    access_refusal,
    claimant_pidfd,
    has_exited,
    peer_cred,
    pidfd_pid,
    supplementary_groups,
)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_peer_credentials_name_the_connecting_process(pair) -> None:
    cred = peer_cred(pair[0])
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_a_pidfd_names_its_process_and_becomes_readable_at_exit() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    fd = os.pidfd_open(child.pid)
    try:
        assert pidfd_pid(fd) == child.pid and not has_exited(fd)
        child.stdin.close()
        child.wait(10)
        assert has_exited(fd)
        assert pidfd_pid(fd) is None  # the kernel reports -1 once the process is gone
    finally:
        os.close(fd)


def test_a_descriptor_that_is_not_a_pidfd_has_no_pid() -> None:
    r, w = os.pipe()
    try:
        assert pidfd_pid(r) is None
    finally:
        os.close(r)
        os.close(w)


def test_the_kernels_peer_pidfd_is_preferred_and_the_attached_one_closed(pair) -> None:
    kernel = procs.peer_pidfd(pair[0])
    if kernel is None:
        pytest.skip("this kernel has no SO_PEERPIDFD")
    os.close(kernel)
    attached = os.pidfd_open(os.getpid())
    fd, cred = claimant_pidfd(pair[0], [attached])
    attached_closed = not is_open(attached) or fd == attached
    try:
        assert pidfd_pid(fd) == os.getpid() == cred.pid
        assert attached_closed
    finally:
        os.close(fd)


def test_without_so_peerpidfd_the_attached_pidfd_is_checked_against_the_peer(
    pair, monkeypatch
) -> None:
    monkeypatch.setattr(procs, "peer_pidfd", lambda sock: None)
    attached = os.pidfd_open(os.getpid())
    fd, _ = claimant_pidfd(pair[0], [attached])
    assert fd == attached
    os.close(fd)

    r, w = os.pipe()
    with pytest.raises(ValueError, match="not a pidfd of the connecting process"):
        claimant_pidfd(pair[0], [r])
    assert not is_open(r)
    os.close(w)

    with pytest.raises(ValueError, match="carries no pidfd"):
        claimant_pidfd(pair[0], [])


def test_a_pidfd_of_another_process_is_refused(pair, monkeypatch) -> None:
    monkeypatch.setattr(procs, "peer_pidfd", lambda sock: None)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    other = os.pidfd_open(child.pid)
    try:
        with pytest.raises(ValueError, match=f"connecting process {os.getpid()}"):
            claimant_pidfd(pair[0], [other])
        assert not is_open(other)
    finally:
        child.stdin.close()
        child.wait(10)


def test_the_services_uid_and_root_may_use_it_and_an_allowed_group_too() -> None:
    me = os.getpid()
    assert access_refusal(PeerCred(me, 1000, 1000), owner_uid=1000, allowed_gid=None) is None
    assert access_refusal(PeerCred(me, 0, 0), owner_uid=1000, allowed_gid=None) is None
    assert access_refusal(PeerCred(me, 1001, 42), owner_uid=1000, allowed_gid=42) is None
    refusal = access_refusal(PeerCred(me, 1001, 43), owner_uid=1000, allowed_gid=42)
    assert refusal == f"process {me} (uid 1001, gid 43) is not uid 1000 or gid 42"
    assert "is not uid 1000" in access_refusal(PeerCred(me, 1001, 42), 1000, None)


def test_an_allowed_group_counts_among_supplementary_groups() -> None:
    groups = supplementary_groups(os.getpid())
    assert groups == frozenset(os.getgroups())
    for gid in groups:
        assert access_refusal(PeerCred(os.getpid(), 4321, 4321), 1000, gid) is None
    assert supplementary_groups(2**22 + 12345) == frozenset()  # no such process
