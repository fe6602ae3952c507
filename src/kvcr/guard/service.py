"""The guard service: a trio server that owns the pool groups and lends them (contract 10).

Startup, in this order, so that no worker ever sees a half-built service:

1. take the socket's lock file (``<socket>.lock``): one service per socket path;
2. replace a stale socket (nobody listening), refuse a live one;
3. reclaim group files that a dead service left in ``--pool-dir`` (nobody holds their lock);
4. create every group file, fully allocated (a full disk fails here, never as a SIGBUS later);
5. bind and listen on the Unix socket (mode 0600).

Then one supervisor nursery runs a :class:`Guard` task per group, which watches the
holder's pidfd, and the accept loop, which serves each connection in a task of its own. A
connection carries requests one at a time; it is closed when it is idle for
``idle_timeout_s``, after a malformed frame, or when too many are open. A Guard that fails
takes the whole service down (non-zero exit): a service that cannot fence its leases must
not keep lending. On the way out (also on SIGINT / SIGTERM) the socket and the group files
are removed.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import gc
import math
import os
import socket
import stat
from pathlib import Path
from typing import Any

import attrs
import trio

from kvcr.errors import KVCRMsgFramingError
from kvcr.guard import protocol as wire
from kvcr.guard.guard import Guard
from kvcr.guard.metrics import (
    GroupReading,
    MetricsEndpoint,
    ServiceCollector,
    Tally,
    registry_of,
)
from kvcr.guard.pools import create_group_file, plan_group, reclaim_orphans
from kvcr.guard.procs import (
    PeerCred,
    access_refusal,
    claimant_pidfd,
    close_quietly,
    peer_cred,
)
from kvcr.guard.rules import GroupEvent, Groups, GroupState, Lease, Refusal

MAX_CONNECTIONS = 256
CONTROL_BACKLOG = 128
FOLLOW_INTERVAL_S = 0.5
_ITEMSIZE = array.array("i").itemsize


class ServiceStartError(RuntimeError):
    """The service cannot start; the message names the flag, path or resource."""


@attrs.frozen
class ServiceConfig:
    socket_path: Path
    pool_dir: Path
    guard_count: int
    pool_sizes: list[int]  # bytes, page-rounded, one per ordered pool of every group
    compatibility_digest: str
    idle_timeout_s: float = 5.0  # a connection that sends nothing for this long is closed
    allowed_gid: int | None = None  # besides the service's uid: members of this group
    huge_page_size: int | None = None  # --huge-pages: the pools' page size (hugetlbfs)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # --metrics-port: serve Prometheus metrics (0: any port)


class GuardService:
    def __init__(self, config: ServiceConfig, log: Any) -> None:
        self.config = config
        self.log = log
        self.groups = Groups(config.guard_count, config.pool_sizes, config.compatibility_digest)
        self.layout = plan_group(config.pool_sizes)
        self.guards: list[Guard] = []
        self.tally = Tally.of(config.guard_count)
        self._lock_fd: int | None = None
        self._listener: trio.socket.SocketType | None = None
        self._socket_id: tuple[int, int] | None = None
        self._connections = 0

    # -- lifecycle ---------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start (see module docstring), serve until cancelled, and clean up."""
        try:
            self._start()
            assert self._listener is not None
            async with trio.open_nursery() as supervisor:
                for guard in self.guards:
                    guard.nursery = supervisor
                    supervisor.start_soon(self._supervise, guard)
                    supervisor.start_soon(guard.follow)
                supervisor.start_soon(self._accept, supervisor)
                if self.config.metrics_port is not None:
                    await self._start_metrics(supervisor)
                self.log.info(
                    "service_ready",
                    socket=str(self.config.socket_path),
                    groups=self.config.guard_count,
                    pools=len(self.config.pool_sizes),
                    group_bytes=self.layout.total_size,
                )
                task_status.started(self)
        finally:
            self._stop()

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        """Serve the metrics endpoint beside the service; if it cannot bind, or fails later,
        the service logs why and goes on lending pools without it."""
        cfg = self.config
        assert cfg.metrics_port is not None
        collector = ServiceCollector(self.tally, self._readings)
        endpoint = MetricsEndpoint(registry_of(collector), self.log)
        where = f"--metrics-host {cfg.metrics_host} --metrics-port {cfg.metrics_port}"
        try:
            listener = await endpoint.bind(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            self.log.error("metrics_failed", reason=f"{where}: cannot listen: {exc}")
            return
        host, port = listener.socket.getsockname()[:2]
        self.log.info("metrics_serving", url=f"http://{host}:{port}/metrics")

        async def serve() -> None:
            try:
                await endpoint.serve(listener)
            except Exception as exc:
                self.log.error("metrics_failed", reason=f"{where}: {exc!r}")

        nursery.start_soon(serve)

    def _readings(self) -> list[GroupReading]:
        return [
            GroupReading(status, guard.serving_blocks())
            for status, guard in zip(self._status(), self.guards)
        ]

    async def _supervise(self, guard: Guard) -> None:
        try:
            await guard.run()
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                self.log.error("guard_failed", group=guard.index, error=repr(exc))
            raise
        raise RuntimeError(f"guard of group {guard.index} stopped")

    def _start(self) -> None:
        cfg = self.config
        self._lock_socket(cfg.socket_path)
        self._clear_stale_socket(cfg.socket_path)
        reclaimed, kept = reclaim_orphans(cfg.pool_dir)
        for path in reclaimed:
            self.log.info("orphan_reclaimed", path=str(path))
        for path in kept:
            self.log.warning("group_file_in_use", path=str(path))
        for index in range(cfg.guard_count):
            try:
                group_file = create_group_file(cfg.pool_dir, index, self.layout, cfg.allowed_gid)
            except FileExistsError:
                raise ServiceStartError(
                    f"--pool-dir {cfg.pool_dir}: group file for group {index} exists and a live "
                    "process holds it (another service, or a worker of a dead one)"
                ) from None
            except OSError as exc:
                raise ServiceStartError(f"--pool-dir {cfg.pool_dir}: {exc}") from None
            try:
                self.guards.append(
                    Guard(index, group_file, self.groups, self.log, self.tally.groups[index])
                )
            except BaseException:
                group_file.close(unlink=True)
                raise
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # The socket is created 0600 (0660 with an allowed group), never briefly wider.
            old_umask = os.umask(0o177 if cfg.allowed_gid is None else 0o117)
            try:
                listener.bind(str(cfg.socket_path))
                if cfg.allowed_gid is not None:
                    os.chown(cfg.socket_path, -1, cfg.allowed_gid)
            finally:
                os.umask(old_umask)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise ServiceStartError(
                f"--socket-path {cfg.socket_path}: cannot bind: {exc}"
            ) from None
        st = os.stat(cfg.socket_path)
        self._socket_id = (st.st_dev, st.st_ino)
        self._listener = trio.socket.from_stdlib_socket(listener)
        self.log.info(
            "pools_created",
            groups=cfg.guard_count,
            group_bytes=self.layout.total_size,
            page_bytes=cfg.huge_page_size or os.sysconf("SC_PAGE_SIZE"),
            huge_pages=cfg.huge_page_size is not None,
        )

    def _lock_socket(self, path: Path) -> None:
        lock_path = f"{path}.lock"
        try:
            fd = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ServiceStartError(
                f"--socket-path {path}: cannot open {lock_path}: {exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServiceStartError(
                f"--socket-path {path}: another kvcr-guard is running on this socket"
            ) from None
        self._lock_fd = fd

    def _clear_stale_socket(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ServiceStartError(f"--socket-path {path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
            self.log.info("stale_socket_replaced", socket=str(path))
            return
        except OSError as exc:
            raise ServiceStartError(f"--socket-path {path}: cannot probe: {exc}") from None
        finally:
            probe.close()
        raise ServiceStartError(f"--socket-path {path}: a live service listens on it")

    def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                st = os.stat(self.config.socket_path)
                if (st.st_dev, st.st_ino) == self._socket_id:
                    os.unlink(self.config.socket_path)
        for guard in self.guards:
            try:
                guard.close()
            except Exception as exc:  # the other groups are still cleaned up
                self.log.warning("group_cleanup_failed", group=guard.index, error=repr(exc))
        self.guards.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock file stays: unlinking it would race a new service
            self._lock_fd = None
        self.log.info("service_stopped")

    # -- connections -------------------------------------------------------------------------

    async def _accept(self, nursery: trio.Nursery) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = await self._listener.accept()
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
                deadline = min(trio.current_time() + self.config.idle_timeout_s, frame_deadline)
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
                    min(frame_deadline, trio.current_time() + self.config.idle_timeout_s)
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
        with trio.move_on_after(self.config.idle_timeout_s) as late:
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
        denied = access_refusal(cred, os.geteuid(), self.config.allowed_gid)
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
            await self._send(conn, wire.StatusReply(groups=self._status()))
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

    def _status(self) -> list[wire.GroupStatus]:
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
