"""The guard service's connections: each one a task that reads requests one at a time and
answers them (claims, releases, status), with the descriptors a request carries.

A connection is closed when it is idle for ``idle_timeout_s``, after a malformed frame, or
when too many are open; a started frame must be complete within the timeout of its first
byte. Every request is checked against the allowed users first. A claim of a group the
service serves hands the group back first (:meth:`Guard.hand_back`), under the group's lock:
one claim of a group at a time. The service that owns the groups: ``service.py``.
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

import trio

from kvcr.errors import KVCRMsgFramingError
from kvcr.guard import protocol as wire
from kvcr.guard.guard import Guard
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
_ITEMSIZE = array.array("i").itemsize


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
    ) -> None:
        """``guards``: the service's list, filled once the groups are created."""
        self.groups = groups
        self.guards = guards
        self.layout = layout
        self.tally = tally
        self.idle_timeout_s = idle_timeout_s  # a connection that sends nothing this long ends
        self.allowed_gid = allowed_gid  # besides the service's uid: members of this group
        self.log = log
        self._connections = 0

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
                pending += fds
                if not data:
                    reader.eof()
                    return
                for message in reader.feed(data):
                    attached, pending = pending, []
                    await self._handle(conn, cred, log, message, attached)
                frame_deadline = (
                    min(frame_deadline, trio.current_time() + self.idle_timeout_s)
                    if reader.pending
                    else math.inf
                )
        finally:
            close_quietly(*pending)

    async def _recv(self, conn: trio.socket.SocketType) -> tuple[bytes, list[int]]:
        flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
        data, ancdata, msg_flags, _ = await conn.recvmsg(
            1 << 16, socket.CMSG_SPACE(2 * _ITEMSIZE), flags
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
    ) -> None:
        denied = access_refusal(cred, os.geteuid(), self.allowed_gid)
        if denied is not None:
            refusal = Refusal("permission_denied", f"{message.TYPE} request: {denied}")
            if isinstance(message, wire.ClaimRequest):
                self.tally.refusals[refusal.code] += 1
            await self._refuse(conn, log, refusal, fds)
            return
        if isinstance(message, wire.ClaimRequest):
            if len(fds) > 1:
                close_quietly(*fds)
                raise KVCRMsgFramingError(f"guard frame 'claim': {len(fds)} descriptors, at most 1")
            await self._claim(conn, cred, log, message, fds)
            return
        if fds:
            close_quietly(*fds)
            raise KVCRMsgFramingError(f"guard frame {message.TYPE!r}: carries descriptors")
        if isinstance(message, wire.Release):
            await self._release(conn, cred, log, message)
        elif isinstance(message, wire.StatusRequest):
            await self._send(conn, wire.StatusReply(groups=self.status()))
        else:
            raise KVCRMsgFramingError(f"guard frame {message.TYPE!r}: not a request")

    async def _refuse(self, conn: Any, log: Any, refusal: Refusal, fds: list[int]) -> None:
        close_quietly(*fds)
        log.warning("refused", code=refusal.code, reason=refusal.message)
        await self._send(conn, wire.ClaimRefused(refusal.code, refusal.message[: wire.MAX_REFUSAL]))

    async def _claim(
        self, conn: Any, cred: PeerCred, log: Any, request: wire.ClaimRequest, fds: list[int]
    ) -> None:
        what = f"claim of group {request.guard_index}"
        try:
            pidfd, cred = claimant_pidfd(conn, fds)
        except ValueError as exc:
            bad = Refusal("bad_request", f"{what}: {exc}")
            self.tally.refusals[bad.code] += 1
            await self._refuse(conn, log, bad, [])
            return
        try:
            if 0 <= request.guard_index < len(self.guards):
                guard = self.guards[request.guard_index]
                refusal = await self._claim_group(conn, log, guard, request, cred, pidfd)
                if refusal is None:
                    pidfd = -1  # the Guard owns it now
            else:
                refusal = self.groups.check_claim(request, cred.pid)  # names the indices
            if refusal is not None:
                self.tally.refusals[refusal.code] += 1
                await self._refuse(conn, log, refusal, [])
        finally:
            if pidfd >= 0:
                close_quietly(pidfd)

    async def _claim_group(
        self,
        conn: Any,
        log: Any,
        guard: Guard,
        request: wire.ClaimRequest,
        cred: PeerCred,
        pidfd: int,
    ) -> Refusal | None:
        """Check and lend ``guard``'s group, handing it back first if the Guard serves it.
        One claim of a group at a time: binding its listener and handing back await."""
        async with guard.lock:
            refusal = self.groups.check_claim(request, cred.pid)
            if refusal is not None:
                return refusal
            handed_back = self.groups[guard.index].state is GroupState.SERVING
            try:
                if handed_back:
                    await guard.hand_back()
                    if self.groups[guard.index].state is GroupState.UNUSABLE:
                        return self.groups.check_claim(request, cred.pid)  # says why
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
    ) -> Refusal | None:
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
            )
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
        return None

    def status(self) -> list[wire.GroupStatus]:
        """Every group as a status request (and the metrics) show it."""
        return [
            guard.journal_status(status) for status, guard in zip(self.groups.status(), self.guards)
        ]

    def _granted(self, request: wire.ClaimRequest, lease: Lease, port: int) -> wire.ClaimGranted:
        pools = [
            (name, offset, size)
            for (name, _), (offset, size) in zip(request.pool_layouts, self.layout.pools)
        ]
        return wire.ClaimGranted(
            guard_index=request.guard_index,
            lease=lease.number,
            pools=pools,
            journal_offset=self.layout.journal[0],
            journal_size=self.layout.journal[1],
            group_path=str(self.guards[request.guard_index].file.path),
            control_host=request.control_host,
            control_port=port,
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
