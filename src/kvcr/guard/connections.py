"""The guard service's connections: each one a task that reads requests one at a time and
answers them (claims, releases, status), with the descriptors a request carries.

A connection is closed when it is idle for ``idle_timeout_s``, after a malformed frame, or
when too many are open; a started frame must be complete within the timeout of its first
byte. Every request is checked against the allowed users first. A claim of a group the
service serves hands the group back first (:meth:`Guard.hand_back`), under the group's lock:
one claim of a group at a time. The service that owns the groups: ``service.py``.

A granted claim's connection becomes the lease's *link*: it stays open, idle or not, for as
long as the lease lasts (so a worker sees the service die as the end of its link), does not
count against ``MAX_CONNECTIONS``, and carries the holder's heartbeats. A beat on any other
connection, or naming another lease, is refused and ends the connection; a duplicate or a
flooding beat is ignored and counted (``heartbeat.py``). A re-attach is a claim that hands
over, after the pidfd, the group file and the listener the worker of a dead service holds.
"""

from __future__ import annotations

import array
import contextlib
import errno
import gc
import math
import os
import socket
from typing import Any

import attrs
import trio

from kvcr.errors import KVCRMsgFramingError
from kvcr.guard import protocol as wire
from kvcr.guard.guard import Guard
from kvcr.guard.heartbeat import BEAT_MS, Verdict
from kvcr.guard.metrics import Tally
from kvcr.guard.pools import GroupLayout
from kvcr.guard.procs import (
    PeerCred,
    access_refusal,
    claimant_pidfd,
    close_quietly,
    peer_cred,
)
from kvcr.guard.rules import GroupEvent, Groups, GroupState, Lease, Refusal

MAX_CONNECTIONS = 256
MAX_FDS = 3  # a re-attach: the claimant's pidfd, its group file, its control listener
_ITEMSIZE = array.array("i").itemsize


@attrs.define
class _Link:
    """What a connection holds: the lease it was granted, if any (then it is that lease's
    link), and the kinds of ignored beats it has logged."""

    index: int | None = None
    lease: int | None = None
    ignored: set[Verdict] = attrs.field(factory=set)


class Connections:
    def __init__(
        self,
        groups: Groups,
        guards: list[Guard],
        layout: GroupLayout,
        tally: Tally,
        idle_timeout_s: float,
        allowed_gid: int | None,
        log: Any,
        heartbeat: bool = False,
    ) -> None:
        """``guards``: the service's list, filled once the groups are created;
        ``heartbeat``: grants ask holders to beat (``--heartbeat-timeout-ms``)."""
        self.groups = groups
        self.guards = guards
        self.layout = layout
        self.tally = tally
        self.idle_timeout_s = idle_timeout_s  # a connection that sends nothing this long ends
        self.allowed_gid = allowed_gid  # besides the service's uid: members of this group
        self.log = log
        self.heartbeat = heartbeat
        self._connections = 0
        self._links = 0  # connections that are leases' links

    async def accept(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        """Accept connections on ``listener`` for good, each served in a task of ``nursery``."""
        while True:
            try:
                conn, _ = await listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.log.warning("accept_failed", error=str(exc))
                    await trio.sleep(0.1)
                    continue
                raise
            if self._connections >= MAX_CONNECTIONS:
                self.log.warning("connection_refused", reason="too many connections")
                conn.close()
                continue
            self._connections += 1
            nursery.start_soon(self._connection, conn)

    async def _connection(self, conn: trio.socket.SocketType) -> None:
        try:
            with conn:
                cred = peer_cred(conn)
                log = self.log.bind(pid=cred.pid)
                try:
                    await self._requests(conn, cred, log)
                except KVCRMsgFramingError as exc:
                    log.warning("bad_frame", error=str(exc))
                    with contextlib.suppress(Exception):
                        await self._send(conn, wire.ClaimRefused("bad_request", str(exc)[:1000]))
                except OSError as exc:
                    log.info("connection_lost", error=str(exc))
        except Exception as exc:  # one connection's bug must not stop the service
            self.log.exception("connection_failed", error=repr(exc))
        finally:
            self._connections -= 1

    async def _requests(self, conn: trio.socket.SocketType, cred: PeerCred, log: Any) -> None:
        reader = wire.FrameReader()
        pending: list[int] = []  # descriptors received, not yet matched to a request
        link = _Link()
        try:
            frame_deadline = math.inf
            while True:
                # Idle between requests for at most the timeout, and a started frame must be
                # complete within the timeout of its first byte: a trickle cannot hold a slot.
                deadline = min(trio.current_time() + self.idle_timeout_s, frame_deadline)
                with trio.move_on_at(deadline) as idle:
                    data, fds = await self._recv(conn)
                if idle.cancelled_caught:
                    if reader.pending:
                        log.warning("connection_silent", pending_bytes=reader.pending)
                        return
                    if self._lease_lives(link):
                        continue  # a link stays open, beats or not, while its lease lasts
                    return
                pending += fds
                if not data:
                    reader.eof()
                    if self._lease_lives(link):
                        log.info("lease_link_closed", group=link.index, lease=link.lease)
                    return
                for message in reader.feed(data):
                    attached, pending = pending, []
                    await self._handle(conn, cred, log, message, attached, link)
                frame_deadline = (
                    min(frame_deadline, trio.current_time() + self.idle_timeout_s)
                    if reader.pending
                    else math.inf
                )
        finally:
            close_quietly(*pending)
            if link.index is not None:
                self._links -= 1
                self._connections += 1  # given back: the finally of _connection takes it

    def _lease_lives(self, link: _Link) -> bool:
        if link.index is None:
            return False
        current = self.groups[link.index].lease
        return current is not None and current.number == link.lease

    async def _recv(self, conn: trio.socket.SocketType) -> tuple[bytes, list[int]]:
        flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        data, ancdata, msg_flags, _ = await conn.recvmsg(
            1 << 16, socket.CMSG_SPACE(MAX_FDS * _ITEMSIZE), flags
        )
        fds = array.array("i")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % _ITEMSIZE])
        if msg_flags & socket.MSG_CTRUNC:
            close_quietly(*fds)
            raise KVCRMsgFramingError("guard frame: too many descriptors attached")
        return data, list(fds)

    async def _send(
        self, conn: trio.socket.SocketType, message: wire.Message, fds: tuple[int, ...] = ()
    ) -> None:
        data = wire.encode_frame(message)
        with trio.move_on_after(self.idle_timeout_s) as late:
            if fds:
                cmsg = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = await conn.sendmsg([data], cmsg)
            else:
                sent = await conn.send(data)
            while sent < len(data):
                data = data[sent:]
                sent = await conn.send(data)
        if late.cancelled_caught:  # a peer that does not read must not hold its slot
            raise OSError(errno.ETIMEDOUT, f"guard reply {message.TYPE!r} not taken in time")

    async def _handle(
        self,
        conn: trio.socket.SocketType,
        cred: PeerCred,
        log: Any,
        message: wire.Message,
        fds: list[int],
        link: _Link,
    ) -> None:
        denied = access_refusal(cred, os.geteuid(), self.allowed_gid)
        if denied is not None:
            refusal = Refusal("permission_denied", f"{message.TYPE} request: {denied}")
            if isinstance(message, wire.ClaimRequest):
                self.tally.refusals[refusal.code] += 1
            await self._refuse(conn, log, refusal, fds)
            return
        if isinstance(message, wire.ClaimRequest):
            most = MAX_FDS if message.reattach else 1
            if len(fds) > most:
                close_quietly(*fds)
                raise KVCRMsgFramingError(
                    f"guard frame 'claim': {len(fds)} descriptors, at most {most}"
                )
            if link.index is not None:
                close_quietly(*fds)
                refusal = Refusal(
                    "bad_request",
                    f"claim of group {message.guard_index}: this connection is the link of "
                    f"group {link.index} lease {link.lease}; claim on a connection of its own",
                )
                await self._refuse_claim(conn, log, refusal)
                return
            granted = await self._claim(conn, cred, log, message, fds)
            if granted is not None:
                link.index, link.lease = message.guard_index, granted
                self._connections -= 1  # a link does not take a connection slot
                self._links += 1
            return
        if fds:
            close_quietly(*fds)
            raise KVCRMsgFramingError(f"guard frame {message.TYPE!r}: carries descriptors")
        if isinstance(message, wire.Heartbeat):
            self._beat(log, message, link)
        elif isinstance(message, wire.Release):
            await self._release(conn, cred, log, message)
        elif isinstance(message, wire.StatusRequest):
            await self._send(conn, wire.StatusReply(groups=self.status()))
        else:
            raise KVCRMsgFramingError(f"guard frame {message.TYPE!r}: not a request")

    async def _refuse_claim(self, conn: Any, log: Any, refusal: Refusal) -> None:
        """Refuse a claim: counted by its code for the metrics, then said."""
        self.tally.refusals[refusal.code] += 1
        await self._refuse(conn, log, refusal, [])

    async def _refuse(self, conn: Any, log: Any, refusal: Refusal, fds: list[int]) -> None:
        close_quietly(*fds)
        log.warning("refused", code=refusal.code, reason=refusal.message)
        await self._send(conn, wire.ClaimRefused(refusal.code, refusal.message[: wire.MAX_REFUSAL]))

    def _beat(self, log: Any, beat: wire.Heartbeat, link: _Link) -> None:
        if link.index is None or (beat.guard_index, beat.lease) != (link.index, link.lease):
            reason = "no_claim" if link.index is None else "wrong_lease"
            self.tally.heartbeats_refused[reason] += 1
            held = "holds no lease" if link.index is None else f"is lease {link.lease}'s link"
            raise KVCRMsgFramingError(
                f"guard frame 'beat' of group {beat.guard_index} lease {beat.lease}: this "
                f"connection {held}"
            )
        verdict = self.guards[link.index].beat(beat.lease, beat.seq)
        if verdict is None or verdict is Verdict.ACCEPTED:
            return  # accepted, or nobody watches beats (no timeout, or the lease ended)
        self.tally.heartbeats_refused[verdict.value] += 1
        if verdict not in link.ignored:  # once per kind and link: a flood logs one line
            link.ignored.add(verdict)
            log.warning("heartbeat_ignored", group=link.index, lease=link.lease, kind=verdict.value)

    async def _claim(
        self, conn: Any, cred: PeerCred, log: Any, request: wire.ClaimRequest, fds: list[int]
    ) -> int | None:
        """Check and grant ``request``: the lease granted, or None (refused, and said so)."""
        what = f"claim of group {request.guard_index}"
        handed = fds[1:] if request.reattach else []  # the group file and the listener
        if request.reattach and len(fds) != MAX_FDS:
            close_quietly(*fds)
            bad = Refusal(
                "bad_request",
                f"{what}: a re-attach carries the pidfd, the group file and the control "
                f"listener, got {len(fds)} descriptor(s)",
            )
            await self._refuse_claim(conn, log, bad)
            return None
        try:
            try:
                pidfd, cred = claimant_pidfd(conn, fds[:1])
            except ValueError as exc:
                bad = Refusal("bad_request", f"{what}: {exc}")
                await self._refuse_claim(conn, log, bad)
                return None
            lease = None
            try:
                if 0 <= request.guard_index < len(self.guards):
                    guard = self.guards[request.guard_index]
                    refusal, lease = await self._claim_group(
                        conn, log, guard, request, cred, pidfd, handed
                    )
                    if refusal is None:
                        pidfd = -1  # the Guard owns it now
                else:
                    refusal = self.groups.check_claim(request, cred.pid)  # names the indices
                if refusal is not None:
                    await self._refuse_claim(conn, log, refusal)
            finally:
                if pidfd >= 0:
                    close_quietly(pidfd)
            return lease
        finally:
            close_quietly(*handed)

    async def _claim_group(
        self,
        conn: Any,
        log: Any,
        guard: Guard,
        request: wire.ClaimRequest,
        cred: PeerCred,
        pidfd: int,
        handed: list[int],
    ) -> tuple[Refusal | None, int | None]:
        """Check and lend ``guard``'s group, handing it back first if the Guard serves it.
        One claim of a group at a time: binding its listener and handing back await."""
        async with guard.lock:
            refusal = self.groups.check_claim(request, cred.pid)
            if refusal is not None:
                return refusal, None
            if request.reattach:
                return await self._reattach(conn, log, guard, request, pidfd, handed)
            handed_back = self.groups[guard.index].state is GroupState.SERVING
            try:
                if handed_back:
                    await guard.hand_back()
                    if self.groups[guard.index].state is GroupState.UNUSABLE:
                        return self.groups.check_claim(request, cred.pid), None  # says why
                return await self._lend(conn, log, guard, request, pidfd)
            finally:
                if self.groups[guard.index].state is GroupState.HANDING_BACK:
                    self.groups.move(guard.index, GroupEvent.STOP)
                if handed_back:
                    # The stopped server's objects (its NIXL agent and the connections it
                    # holds) form reference cycles: free them now, after the grant.
                    gc.collect()

    async def _lend(
        self, conn: Any, log: Any, guard: Guard, request: wire.ClaimRequest, pidfd: int
    ) -> tuple[Refusal | None, int | None]:
        """Bind the group's listener if needed, grant, send the grant with the group file and
        the listener, and fence the lease by ``pidfd``. A refusal if the listener cannot be
        bound; if the grant cannot be sent, the lease ends at once."""
        try:
            listener = await guard.control_listener(request.control_host, request.control_port)
        except OSError as exc:
            address = f"{request.control_host}:{request.control_port}"
            return Refusal(
                "control_unavailable",
                f"claim of group {guard.index}: cannot bind control endpoint {address}: {exc}",
            ), None
        assert guard.file is not None, "a lendable group has its file"
        port = listener.getsockname()[1]
        lease = self.groups.grant(request, port)
        try:
            granted = self._granted(request, lease, port)
            await self._send(conn, granted, (guard.file.fd, listener.fileno()))
        except BaseException:
            self.groups.end_lease(guard.index, lease.number, GroupEvent.RELEASE)
            raise
        guard.watch(lease, pidfd)
        guard.tally.claims_granted += 1
        log.info("lease_granted", group=guard.index, lease=lease.number, control_port=port)
        return None, lease.number

    async def _reattach(
        self,
        conn: Any,
        log: Any,
        guard: Guard,
        request: wire.ClaimRequest,
        pidfd: int,
        handed: list[int],
    ) -> tuple[Refusal | None, int | None]:
        """Grant a detached group back to the worker that still maps it: ``handed`` must be
        the group's very file and a listener bound to the claimed port. The terms are the
        request's (the service that fixed them is gone); nothing is sent back but the grant."""
        what = f"claim of group {guard.index} (re-attach)"
        wrong = guard.reattach_refusal(handed[0], handed[1], request.control_port)
        if wrong is not None:
            return Refusal("bad_request", f"{what}: {wrong}"), None
        lease = self.groups.grant(request, request.control_port)
        try:
            guard.reattached(handed[1])
            await self._send(conn, self._granted(request, lease, request.control_port))
        except BaseException:
            self.groups.end_lease(guard.index, lease.number, GroupEvent.RELEASE)
            raise
        guard.watch(lease, pidfd)
        guard.tally.claims_granted += 1
        log.warning(
            "reattached",
            group=guard.index,
            lease=lease.number,
            control_port=request.control_port,
            reason="the worker of a service that died re-attached its group",
        )
        return None, lease.number

    def status(self) -> list[wire.GroupStatus]:
        """Every group as a status request (and the metrics) show it."""
        return [
            attrs.evolve(
                guard.journal_status(status),
                fenced=guard.tally.fenced,
                last_beat_ms=guard.last_beat_ms(),
            )
            for status, guard in zip(self.groups.status(), self.guards)
        ]

    def _granted(self, request: wire.ClaimRequest, lease: Lease, port: int) -> wire.ClaimGranted:
        pools = [
            (name, offset, size)
            for (name, _), (offset, size) in zip(request.pool_layouts, self.layout.pools)
        ]
        file = self.guards[request.guard_index].file
        assert file is not None, "a lendable group has its file"
        return wire.ClaimGranted(
            guard_index=request.guard_index,
            lease=lease.number,
            pools=pools,
            journal_offset=self.layout.journal[0],
            journal_size=self.layout.journal[1],
            group_path=str(file.path),
            control_host=request.control_host,
            control_port=port,
            heartbeat_ms=BEAT_MS if self.heartbeat else 0,
        )

    async def _release(self, conn: Any, cred: PeerCred, log: Any, release: wire.Release) -> None:
        refusal = self.groups.check_release(release.guard_index, release.lease, cred.pid)
        if refusal is not None:
            await self._refuse(conn, log, refusal, [])
            return
        self.guards[release.guard_index].released(release.lease, release.activated)
        await self._send(
            conn, wire.ReleaseAck(guard_index=release.guard_index, lease=release.lease)
        )
