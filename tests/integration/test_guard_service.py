"""The guard service as a real subprocess: claims, leases fenced by pidfd, restarts, bad input.

Claimants are this test process (through ``KVCRClient``) and child processes
(``claimant_proc.py``) that the tests release, SIGKILL, fork or exec.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcr import KVCRClient, KVCRPoolHold
from kvcr.config import G3Options
from kvcr.errors import KVCRGuardProtocolError, KVCRSocketError
from kvcr.guard import protocol as wire
from procs import GuardProcess, wait_until

pytestmark = pytest.mark.integration

CLAIMANT = Path(__file__).resolve().parent.parent / "claimant_proc.py"
LAYOUT = [("", 4096)]
LOCAL = ("127.0.0.1", 0)


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[GuardProcess]:
    service = GuardProcess(tmp_path)
    yield service
    assert service.stop() == 0, service.log()


class Claimant:
    """Another process holding (or trying to hold) a group."""

    def __init__(self, guard: GuardProcess, index: int = 0, digest: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(CLAIMANT),
                guard.socket_path,
                str(index),
                *[digest or guard.digest, "4096"],
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.first = self.read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"claimant {self.proc.pid} exited ({self.proc.poll()})"
        return json.loads(line)

    def command(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def claim(guard: GuardProcess, index: int = 0, **kwargs) -> KVCRPoolHold:
    return guard.client.claim(index, kwargs.pop("layouts", LAYOUT), guard.digest, LOCAL, **kwargs)


# --- claim, release, leases -------------------------------------------------------------------


def test_a_group_is_claimed_released_and_claimed_again(guard) -> None:
    hold = claim(guard)
    assert guard.states() == [("held", os.getpid()), ("idle", None)]
    (name, address, size) = hold.local_dram.pools[0]
    assert name == "" and size == 1048576 and address != 0
    first_port = hold.control_address[1]

    hold.release()
    assert guard.states() == [("idle", None), ("idle", None)]
    again = claim(guard)
    # The control endpoint is bound at the first claim and kept for the group's life.
    assert again.lease != hold.lease and again.control_address[1] == first_port
    again.release()


def test_the_pools_are_shared_memory_that_outlives_the_holder(guard) -> None:
    hold = claim(guard)
    path = hold.group_path
    _, address, _ = hold.local_dram.pools[0]
    import ctypes

    ctypes.memmove(address, b"kept across holders", 19)
    hold.release()
    with open(path, "rb") as group:  # pool 0 sits right after the 100 MiB journal
        group.seek(100 * 1024 * 1024)
        assert group.read(19) == b"kept across holders"


def test_a_second_claimant_is_refused_while_the_group_is_held(guard) -> None:
    holder = Claimant(guard)
    try:
        assert "claimed" in holder.first
        with pytest.raises(KVCRGuardProtocolError, match=rf"\(held\).*held by pid {holder.pid}"):
            claim(guard)
        other = Claimant(guard)
        assert "(held)" in other.first["refused"]
        other.close()
        assert guard.states()[0] == ("held", holder.pid)
    finally:
        holder.close()


def test_a_sigkilled_holder_frees_its_lease(guard) -> None:
    holder = Claimant(guard)
    assert guard.states()[0] == ("held", holder.pid)

    holder.kill()

    guard.wait_free(0)  # then the guard serves the group until somebody claims it
    claim(guard).release()


def test_closing_the_socket_or_exec_does_not_release_a_live_claimant(guard) -> None:
    holder = Claimant(guard)
    try:
        # Every request is its own connection: the claim's socket is already closed.
        assert guard.states()[0] == ("held", holder.pid)
        holder.command("exec")
        wait_until(
            lambda: b"-c" in Path(f"/proc/{holder.pid}/cmdline").read_bytes(), what="the exec"
        )
        assert guard.states()[0] == ("held", holder.pid)
    finally:
        holder.close()  # the exec'd program exits when its stdin closes
    guard.wait_free(0)


def test_release_by_the_holder_waits_for_the_acknowledgement(guard) -> None:
    holder = Claimant(guard)
    try:
        holder.command("release")
        assert holder.read() == {"released": True}
        assert guard.states()[0] == ("idle", None)  # acknowledged, so already idle
    finally:
        holder.close()


def test_only_the_holder_can_release_its_lease(guard) -> None:
    holder = Claimant(guard)
    try:
        with pytest.raises(KVCRGuardProtocolError, match=f"held by pid {holder.pid}"):
            guard.client.release(0, holder.first["claimed"])
        with pytest.raises(KVCRGuardProtocolError, match="not the group's current lease"):
            guard.client.release(0, holder.first["claimed"] + 1000)
        assert guard.states()[0] == ("held", holder.pid)
    finally:
        holder.close()


def test_a_forked_child_inherits_neither_the_mapping_nor_the_lease(guard) -> None:
    holder = Claimant(guard)
    try:
        holder.command("fork")
        seen = holder.read()
        assert seen["mapped"] is False
        assert "belongs to process" in seen["release"]
        assert guard.states()[0] == ("held", holder.pid)
    finally:
        holder.close()


# --- claim rules ------------------------------------------------------------------------------


def test_a_wrong_digest_is_refused_with_the_message(guard) -> None:
    with pytest.raises(KVCRGuardProtocolError) as err:
        guard.client.claim(0, LAYOUT, "other-digest", LOCAL)
    assert "(digest_mismatch)" in str(err.value)
    assert "'other-digest' does not match the service's 'digest-1'" in str(err.value)
    assert guard.states()[0] == ("idle", None)


def test_an_index_out_of_range_is_refused(guard) -> None:
    with pytest.raises(KVCRGuardProtocolError, match=r"\(index_out_of_range\).*2 group\(s\)"):
        claim(guard, 2)


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"layouts": [("", 8192)]}, "layout_mismatch"),
        ({"layouts": [("other", 4096)]}, "layout_mismatch"),
        ({"remote_fw_dram_backend": "LIBFABRIC"}, "backend_mismatch"),
        ({"g3": "g3"}, "g3_mismatch"),
    ],
    ids=["block-size", "pool-name", "backend", "g3"],
)
def test_terms_must_match_the_groups_first_claim(guard, tmp_path, change, code) -> None:
    claim(guard).release()
    if change.get("g3") == "g3":
        change["g3"] = G3Options(
            paths=(tmp_path / "g3",), capacity_bytes_per_file=1 << 20, backend="POSIX"
        )
    with pytest.raises(KVCRGuardProtocolError, match=rf"\({code}\)"):
        claim(guard, **change)
    claim(guard).release()  # the refusal changed nothing


def test_the_control_address_must_be_the_groups_endpoint(guard) -> None:
    hold = claim(guard)
    port = hold.control_address[1]
    hold.release()
    # The bound port (or 0 again, as first asked) matches; another address does not.
    guard.client.claim(0, LAYOUT, guard.digest, ("127.0.0.1", port)).release()
    with pytest.raises(KVCRGuardProtocolError, match=rf"\(control_mismatch\).*127.0.0.1:{port}"):
        guard.client.claim(0, LAYOUT, guard.digest, ("127.0.0.2", port))


def test_layouts_that_do_not_fit_the_pools_are_refused(guard) -> None:
    with pytest.raises(KVCRGuardProtocolError, match=r"1 pool\(s\) of \[1048576\] bytes"):
        claim(guard, layouts=[("a", 4096), ("b", 4096)])
    with pytest.raises(KVCRGuardProtocolError, match="exceeds its pool of 1048576 bytes"):
        claim(guard, layouts=[("", 2 << 20)])


def test_status_shows_groups_holders_and_layouts_as_a_table_and_json(guard) -> None:
    hold = claim(guard)
    status = [sys.executable, "-m", "kvcr.kvcr_service", "status", "--socket-path"]
    table = subprocess.run([*status, guard.socket_path], capture_output=True, text=True, check=True)
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        *("group", "state", "holder", "last", "beat", "fenced", "control", "port", "journal"),
        *("served", "layouts"),
    ]
    port = str(hold.control_address[1])
    # A bare claim writes no journal: "-" (workers' journals are shown, see the workers' tests);
    # this service asks for no heartbeats: no last beat.
    assert lines[1].split() == [
        *("0", "held", str(os.getpid()), "-", "0", port, "-", "0", "(G3", "0)", "<default>:4096")
    ]
    assert lines[2].split() == ["1", "idle", "-", "-", "0", "-", "-", "0", "(G3", "0)", "-"]

    doc = subprocess.run(
        [*status, guard.socket_path, "--json"], capture_output=True, text=True, check=True
    )
    groups = json.loads(doc.stdout)["groups"]
    assert groups[0] == {
        "group": 0,
        "state": "held",
        "holder_pid": os.getpid(),
        "control_port": hold.control_address[1],
        "journal_blocks": None,
        "journal_fill_percent": None,
        "recovery_disabled": False,
        "fenced": 0,
        "last_beat_ms": None,
        "served_blocks": 0,
        "served_g3_blocks": 0,
        "layouts": [["", 4096]],
    }
    hold.release()


def test_status_of_a_missing_service_is_a_clear_error(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvcr.kvcr_service", "status", "--socket-path", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "cannot connect" in out.stderr and str(tmp_path / "x") in out.stderr


# --- service lifecycle ------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_shuts_down_cleanly_removing_pool_files_and_socket(tmp_path, sig) -> None:
    service = GuardProcess(tmp_path)
    assert len(list(service.pool_dir.iterdir())) == 2
    assert oct(os.stat(service.socket_path).st_mode & 0o777) == "0o600"
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in service.pool_dir.iterdir())

    assert service.stop(sig) == 0
    assert list(service.pool_dir.iterdir()) == []
    assert not os.path.exists(service.socket_path)
    assert "service_stopped" in service.log()


def test_a_sigkilled_services_files_are_reclaimed_at_the_next_start(tmp_path) -> None:
    first = GuardProcess(tmp_path)
    first.stop(signal.SIGKILL)
    assert len(list(first.pool_dir.iterdir())) == 2 and os.path.exists(first.socket_path)

    second = GuardProcess(tmp_path)
    try:
        log = second.log()
        assert log.count("orphan_reclaimed") == 2 and "stale_socket_replaced" in log
        claim(second).release()
    finally:
        assert second.stop() == 0


def test_a_file_still_held_by_a_worker_of_a_dead_service_is_adopted_detached(tmp_path) -> None:
    first = GuardProcess(tmp_path)
    holder = Claimant(first)
    path = first.pool_dir / "kvcr-group-0.pool"
    before = os.stat(path)
    try:
        first.stop(signal.SIGKILL)
        second = GuardProcess(tmp_path)
        assert "group_detached" in second.log()
        assert second.states() == [("detached", None), ("idle", None)]
        after = os.stat(path)  # the worker's file is the same file, untouched
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        # Nobody but its worker (re-attaching) may have it; the other group is lent as ever.
        with pytest.raises(KVCRGuardProtocolError, match="re-attaches on its own"):
            claim(second)
        claim(second, index=1).release()
        # The worker exits without re-attaching: the group is free (its journal as it left it).
        holder.close()
        wait_until(lambda: second.states()[0] == ("idle", None), what="orphaned group idle")
        assert "detached_orphaned" in second.log()
        claim(second).release()
    finally:
        holder.close()
    assert second.stop() == 0
    assert list(second.pool_dir.iterdir()) == []


def test_a_restart_with_other_pool_sizes_keeps_lending_the_groups_it_can(tmp_path) -> None:
    first = GuardProcess(tmp_path)
    holder = Claimant(first)
    try:
        first.stop(signal.SIGKILL)
        second = GuardProcess(tmp_path, pool_sizes_gb="0.001953125")  # 2 MiB, not 1
        assert second.states() == [("unusable", None), ("idle", None)]
        with pytest.raises(KVCRGuardProtocolError) as refused:
            claim(second)
        text = str(refused.value)
        assert "kvcr-group-0.pool is 105906176 bytes" in text
        assert "restart the service with the flags of the one that created it" in text
        claim(second, index=1).release()
        assert (first.pool_dir / "kvcr-group-0.pool").exists()  # the worker's data survives
    finally:
        holder.close()
    assert second.stop() == 0


def test_a_live_services_socket_is_never_taken_over(guard) -> None:
    rival = GuardProcess(guard.directory, wait=False)
    assert rival.proc.wait(30) == 1
    assert "another kvcr-guard is running on this socket" in rival.log()
    assert guard.states() == [("idle", None), ("idle", None)]


def test_a_stale_socket_left_by_another_program_is_replaced(tmp_path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "guard.sock"))
    stale.close()  # the file stays, nobody listens
    service = GuardProcess(tmp_path)
    try:
        assert "stale_socket_replaced" in service.log()
    finally:
        assert service.stop() == 0


def test_a_path_that_is_not_a_socket_is_not_replaced(tmp_path) -> None:
    (tmp_path / "guard.sock").write_text("precious")
    service = GuardProcess(tmp_path, wait=False)
    assert service.proc.wait(30) == 1
    assert "exists and is not a socket" in service.log()
    assert (tmp_path / "guard.sock").read_text() == "precious"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--guard-count", "0"], "--guard-count must be in 1..4096"),
        (["--pool-sizes-gb", "0"], "must be positive"),
        (["--pool-sizes-gb", "-1"], "must be positive"),
        (["--pool-sizes-gb", "nan"], "not a finite number"),
        (["--pool-sizes-gb", "inf"], "not a finite number"),
        (["--pool-sizes-gb", "1e-9"], "below one page"),
        (["--pool-sizes-gb", "1,,2"], "item 1 ('') is not a number"),
        (["--pool-dir", "/nonexistent/kvcr"], "not an existing directory"),
        (["--compatibility-digest", ""], "--compatibility-digest must be 1..256 characters"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(tmp_path, flags, message) -> None:
    args = {
        "--socket-path": str(tmp_path / "s.sock"),
        "--pool-dir": str(tmp_path),
        "--guard-count": "1",
        "--pool-sizes-gb": "0.001",
        "--compatibility-digest": "d",
    }
    args.update(dict(zip(flags[::2], flags[1::2])))
    cmd = [sys.executable, "-m", "kvcr.kvcr_service", *[x for kv in args.items() for x in kv]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert message in out.stderr
    assert not os.path.exists(tmp_path / "s.sock")


def test_no_room_for_the_pools_is_an_error_at_startup(tmp_path) -> None:
    service = GuardProcess(tmp_path, pool_sizes_gb="1000000", wait=False)
    assert service.proc.wait(60) == 1
    assert "cannot reserve" in service.log()
    assert list(service.pool_dir.iterdir()) == []
    assert not os.path.exists(service.socket_path)


# --- bad input on the live socket ----------------------------------------------------------------


def exchange(guard: GuardProcess, data: bytes, fds: tuple[int, ...] = ()) -> bytes:
    """Send raw bytes (and descriptors), half-close, and read until the service closes."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(guard.socket_path)
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def refusal(reply: bytes) -> wire.ClaimRefused:
    (message,) = wire.FrameReader().feed(reply)
    assert isinstance(message, wire.ClaimRefused)
    return message


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\x00\x00\x00\x05garba", "not msgpack"),
        (frame(b"\x81\xa1v\x02"), "wrong protocol version 2"),
        (frame(b"\x82\xa1v\x01\xa1t\xa4nope"), "unknown type 'nope'"),
        (b"\x7f\xff\xff\xff", "oversized"),
        (b"\x00\x00\x00\x00", "zero length"),
        (b"\x00\x00\x00\x10abc", "connection closed mid-frame"),
        (frame(b"\x82\xa1v\x01\xa1t\xa5claim"), "bad field"),
    ],
    ids=["garbage", "version", "type", "oversized", "zero", "truncated", "missing-fields"],
)
def test_bad_frames_get_a_clear_error_and_leave_leases_alone(guard, data, text) -> None:
    holder = Claimant(guard)
    try:
        reply = refusal(exchange(guard, data))
        assert reply.code == "bad_request" and text in reply.message
        assert guard.states()[0] == ("held", holder.pid)
    finally:
        holder.close()


def test_descriptors_on_a_request_that_takes_none_are_refused(guard) -> None:
    r, w = os.pipe()
    try:
        reply = refusal(exchange(guard, wire.encode_frame(wire.StatusRequest()), (r, w)))
    finally:
        os.close(r)
        os.close(w)
    assert "carries descriptors" in reply.message
    assert guard.states() == [("idle", None), ("idle", None)]


def claim_request(guard: GuardProcess, pid: int) -> wire.ClaimRequest:
    return wire.ClaimRequest(
        guard_index=0,
        pool_layouts=LAYOUT,
        compatibility_digest=guard.digest,
        control_host="127.0.0.1",
        control_port=0,
        g3=None,
        remote_fw_dram_backend="UCX",
        pid=pid,
    )


def test_a_claim_for_another_pid_is_refused(guard) -> None:
    pidfd = os.pidfd_open(os.getpid())
    try:
        reply = refusal(
            exchange(guard, wire.encode_frame(claim_request(guard, os.getpid() + 1)), (pidfd,))
        )
    finally:
        os.close(pidfd)
    assert "the connection is pid" in reply.message
    assert guard.states()[0] == ("idle", None)


@pytest.fixture
def no_peer_pidfd(tmp_path: Path) -> Iterator[GuardProcess]:
    """A service acting as on kernels without SO_PEERPIDFD: the claimant's pidfd comes
    attached to its request, and is checked."""
    service = GuardProcess(tmp_path, env={"KVCR_GUARD_PEERPIDFD": "0"})
    yield service
    assert service.stop() == 0, service.log()


def test_without_so_peerpidfd_the_attached_pidfd_fences_the_claim(no_peer_pidfd) -> None:
    guard = no_peer_pidfd
    holder = Claimant(guard)
    assert guard.states()[0] == ("held", holder.pid)
    holder.kill()
    guard.wait_free(0)


@pytest.mark.parametrize("attach", ["nothing", "a pipe", "two pidfds"])
def test_without_so_peerpidfd_a_missing_or_wrong_descriptor_is_refused(
    no_peer_pidfd, attach
) -> None:
    guard = no_peer_pidfd
    frame = wire.encode_frame(claim_request(guard, os.getpid()))
    r, w = os.pipe()
    pidfds = [os.pidfd_open(os.getpid()) for _ in range(2)]
    try:
        fds = {"nothing": (), "a pipe": (r,), "two pidfds": tuple(pidfds)}[attach]
        reply = refusal(exchange(guard, frame, fds))
    finally:
        for fd in (r, w, *pidfds):
            os.close(fd)
    expected = {
        "nothing": "carries no pidfd",
        "a pipe": "not a pidfd of the connecting process",
        "two pidfds": "2 descriptors, at most 1",
    }[attach]
    assert expected in reply.message
    assert guard.states()[0] == ("idle", None)


def test_a_host_that_cannot_be_resolved_is_refused_naming_it(guard) -> None:
    host = "a" * 70 + ".example"
    with pytest.raises(KVCRGuardProtocolError, match=rf"\(control_unavailable\).*{host}"):
        guard.client.claim(0, LAYOUT, guard.digest, (host, 0))
    assert guard.states()[0] == ("idle", None)


def test_an_unnamed_pool_beside_others_is_refused(tmp_path) -> None:
    service = GuardProcess(tmp_path, pool_sizes_gb="0.0009765625,0.0009765625")
    try:
        with pytest.raises(KVCRGuardProtocolError, match=r"unnamed pool \(''\) must be the only"):
            service.client.claim(0, [("", 4096), ("b", 4096)], service.digest, LOCAL)
    finally:
        assert service.stop() == 0


def test_a_silent_claimant_is_dropped_and_does_not_block_others(guard) -> None:
    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(guard.socket_path)
        silent.sendall(b"\x00\x00\x01")  # part of a header, then nothing
        hold = claim(guard)  # served meanwhile
        silent.settimeout(10)
        assert silent.recv(100) == b""  # closed by the service after its idle timeout
    assert "connection_silent" in guard.log()
    hold.release()


def test_an_unreachable_service_is_a_socket_error(tmp_path) -> None:
    with pytest.raises(KVCRSocketError, match="cannot connect"):
        KVCRClient(str(tmp_path / "none.sock")).claim(0, LAYOUT, "d", LOCAL)


FOREIGN = """
import os, sys
from kvcr import KVCRClient
from kvcr.errors import KVCRServiceError
uid, gid = (int(x) for x in sys.argv[3].split(":"))
os.setgroups([])  # after the imports: the interpreter's files need not be readable by them
os.setgid(gid)
os.setuid(uid)
try:
    KVCRClient(sys.argv[1]).claim(0, [("", 4096)], sys.argv[2], ("127.0.0.1", 0)).release()
    print("granted")
except KVCRServiceError as exc:
    print(exc)
"""
NOBODY = 65534
ALLOWED_GID = 4242


@contextlib.contextmanager
def reachable_guard(*extra: str) -> Iterator[tuple[GuardProcess, Callable[[int, int], str]]]:
    """A guard whose socket path other users can reach, and a claim as (uid, gid)."""
    directory = Path(tempfile.mkdtemp(prefix="kvcr-uid-"))
    directory.chmod(0o711)  # others may reach the socket's path, not list the directory
    service = GuardProcess(directory, extra=("--idle-timeout-s", "0.5", *extra))

    def claim_as(uid: int, gid: int) -> str:
        identity = f"{uid}:{gid}"
        out = subprocess.run(
            [sys.executable, "-c", FOREIGN, service.socket_path, service.digest, identity],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        return out.stdout + out.stderr

    try:
        yield service, claim_as
        assert service.states()[0][0] == "idle"
    finally:
        assert service.stop() == 0, service.log()
        shutil.rmtree(directory, ignore_errors=True)


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a claimant as another user"
)


@needs_root
def test_a_claimant_with_another_uid_is_refused() -> None:
    with reachable_guard() as (service, claim_as):
        assert stat.S_IMODE(os.stat(service.socket_path).st_mode) == 0o600
        # The socket is owner-only: another uid cannot even connect.
        assert "Permission denied" in claim_as(NOBODY, NOBODY)
        # And were the socket opened up, the service itself refuses other uids.
        os.chmod(service.socket_path, 0o666)
        refused = claim_as(NOBODY, NOBODY)
        assert "refused (permission_denied)" in refused
        assert f"(uid {NOBODY}, gid {NOBODY}) is not uid 0" in refused


@needs_root
def test_members_of_an_allowed_group_may_claim_and_no_one_else() -> None:
    with reachable_guard("--allow-gid", str(ALLOWED_GID)) as (service, claim_as):
        st = os.stat(service.socket_path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, ALLOWED_GID)
        assert claim_as(NOBODY, ALLOWED_GID) == "granted\n"
        assert "Permission denied" in claim_as(NOBODY, NOBODY)
        os.chmod(service.socket_path, 0o666)
        assert f"is not uid 0 or gid {ALLOWED_GID}" in claim_as(NOBODY, NOBODY)


def test_an_unknown_allowed_group_is_a_flag_error(tmp_path) -> None:
    service = GuardProcess(tmp_path, extra=("--allow-gid", "no-such-group-kvcr"), wait=False)
    assert service.proc.wait(30) != 0
    assert "--allow-gid no-such-group-kvcr: no such group" in service.log()
