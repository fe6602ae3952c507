"""The worker's side of the guard service: ``KVCRClient`` and ``KVCRPoolHold`` (contract 10).

Every request is one short connection (connect, one frame each way, close), so the service
can drop connections that go quiet, except a granted claim's: it stays open as the lease's
*link* (``lease_link.py``), which carries the heartbeats and whose end tells the worker that
its service died. The lease itself lasts until ``release``, until the claimant's process
exits (the service learns it from the claimant's pidfd), or until the service fences a
holder that stopped beating. Every descriptor is close-on-exec.

A hold belongs to the process that claimed it. A forked child inherits neither the
mapping (``MADV_DONTFORK``) nor the lease: in the child the hold is dead, and ``release``
refuses to run there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from kvcr.config import G3Options, LocalDramOptions
from kvcr.errors import KVCRGuardProtocolError, KVCRServiceError, KVCRSocketError
from kvcr.guard import fdpass
from kvcr.guard import protocol as wire
from kvcr.guard.lease_link import Grant, Tie
from kvcr.guard.pools import GroupFile, GroupLayout, GroupMapping, map_group, share_group_file
from kvcr.logs import get_logger

__all__ = ["KVCRClient", "KVCRPoolHold"]

log = get_logger(__name__)

DEFAULT_TIMEOUT_S = 10.0
REATTACH_TIMEOUT_S = 2.0  # a re-attach runs on a runtime's thread pool: keep its stop short
_T = TypeVar("_T")


def _g3_description(g3: G3Options) -> wire.G3Description:
    return wire.G3Description(
        paths=[str(p) for p in g3.paths],
        capacity_bytes_per_file=g3.capacity_bytes_per_file,
        backend=g3.backend,
        backend_options=dict(g3.backend_options),
    )


class KVCRClient:
    """Talks to one guard service over its Unix socket. Every call blocks (bounded by
    ``timeout_s``); errors derive from :class:`~kvcr.errors.KVCRServiceError`."""

    #: Bound on each request (connect, send, reply); set per instance to change it.
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __init__(self, socket_path: str | os.PathLike[str]) -> None:
        self.socket_path = os.fspath(socket_path)
        if not self.socket_path:
            raise ValueError("KVCRClient: socket_path must be a non-empty path")

    def claim(
        self,
        guard_index: int,
        pool_layouts: Sequence[tuple[str, int]],
        compatibility_digest: str,
        control_bind: tuple[str, int],
        g3: G3Options | None = None,
        remote_fw_dram_backend: str = "UCX",
    ) -> KVCRPoolHold:
        """Claim pool group ``guard_index``, map it and take a shared hold on its file.

        ``control_bind`` is the (host, port) the group's control listener must have; the
        service binds it on the group's first claim (port 0: it picks one) and later claims
        must name the same address. Raises ValueError for arguments the protocol cannot
        carry, KVCRGuardProtocolError when the service refuses (its message says why),
        KVCRSocketError when it cannot be reached in time.
        """
        return self.claim_advertised(
            guard_index,
            pool_layouts,
            compatibility_digest,
            control_bind,
            g3=g3,
            remote_fw_dram_backend=remote_fw_dram_backend,
        )

    def claim_advertised(
        self,
        guard_index: int,
        pool_layouts: Sequence[tuple[str, int]],
        compatibility_digest: str,
        control_bind: tuple[str, int],
        *,
        g3: G3Options | None = None,
        remote_fw_dram_backend: str = "UCX",
        advertise: str | None = None,
    ) -> KVCRPoolHold:
        """:meth:`claim`, also telling the service the host peers reach the endpoint at."""
        try:
            host, port = control_bind
            request = wire.ClaimRequest(
                guard_index=guard_index,
                pool_layouts=[tuple(x) for x in pool_layouts],
                compatibility_digest=compatibility_digest,
                control_host=host,
                control_port=port,
                g3=None if g3 is None else _g3_description(g3),
                remote_fw_dram_backend=remote_fw_dram_backend,
                pid=os.getpid(),
                control_advertise=advertise,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"KVCRClient.claim: {exc}") from None
        pidfd = os.pidfd_open(os.getpid())
        try:
            reply, fds, link = self._request_link(request, [pidfd], 2, self.timeout_s)
        finally:
            os.close(pidfd)
        try:
            granted = self._expect(reply, wire.ClaimGranted, f"claim of group {guard_index}")
            if len(fds) != 2:
                raise KVCRGuardProtocolError(
                    f"guard service {self.socket_path}: claim of group {guard_index} was "
                    f"granted with {len(fds)} descriptor(s), expected 2"
                )
            hold = self._take(request, granted, fds[0], fds[1])
        except BaseException:
            link.close()
            raise
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        hold._tie = Tie(
            guard_index, _grant_of(granted, link), functools.partial(self._reattach, hold), log
        )
        return hold

    def status(self) -> list[wire.GroupStatus]:
        """Every group's state, holder and terms."""
        reply, _ = self._request(wire.StatusRequest(), [], max_fds=0)
        return self._expect(reply, wire.StatusReply, "status").groups

    def release(self, guard_index: int, lease: int, *, activated: bool = True) -> None:
        """Give a lease back and wait for the acknowledgement (the hold calls this)."""
        reply, _ = self._request(
            wire.Release(guard_index=guard_index, lease=lease, activated=activated), [], 0
        )
        ack = self._expect(reply, wire.ReleaseAck, f"release of group {guard_index}")
        if (ack.guard_index, ack.lease) != (guard_index, lease):
            raise KVCRGuardProtocolError(
                f"guard service {self.socket_path}: release of group {guard_index} lease "
                f"{lease} acknowledged as group {ack.guard_index} lease {ack.lease}"
            )

    # -- internals ---------------------------------------------------------------------------

    def _request(
        self, message: wire.Message, fds: list[int], max_fds: int
    ) -> tuple[wire.Message, list[int]]:
        reply, received, sock = self._request_link(message, fds, max_fds, self.timeout_s)
        sock.close()
        return reply, received

    def _request_link(
        self, message: wire.Message, fds: list[int], max_fds: int, timeout_s: float
    ) -> tuple[wire.Message, list[int], socket.socket]:
        """One request and its reply, and the connection, still open (a grant's link)."""
        where = f"guard service {self.socket_path}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            try:
                sock.connect(self.socket_path)
            except OSError as exc:
                raise KVCRSocketError(f"{where}: cannot connect: {exc}") from exc
            try:
                fdpass.send_frame_with_fds(sock, message, fds)
                reply, received = fdpass.recv_message_with_fds(sock, wire.FrameReader(), max_fds)
            except KVCRServiceError as exc:
                raise type(exc)(f"{where}: {message.TYPE}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return reply, received, sock

    def _reattach(self, hold: KVCRPoolHold) -> Grant:
        """Claim ``hold``'s group again from a service started after the one that granted
        it died, handing over the group file and the listener this process holds (blocking;
        run by the hold's tie). The hold's lease becomes the new one."""
        grant, group_fd, listener_fd = hold._grant, hold._group_fd(), hold._listener_fd
        request = hold._request
        if grant is None or request is None or group_fd is None or listener_fd is None:
            raise KVCRServiceError("KVCRPoolHold: nothing to re-attach (released)")
        what = f"claim of group {grant.guard_index}"
        again = attrs.evolve(
            request, reattach=True, control_port=grant.control_port, pid=os.getpid()
        )
        pidfd = os.pidfd_open(os.getpid())
        try:
            reply, _none, link = self._request_link(
                again, [pidfd, group_fd, listener_fd], 0, min(self.timeout_s, REATTACH_TIMEOUT_S)
            )
        finally:
            os.close(pidfd)
        try:
            granted = self._expect(reply, wire.ClaimGranted, what)
            if granted.guard_index != grant.guard_index or granted.pools != grant.pools:
                raise KVCRGuardProtocolError(
                    f"guard service {self.socket_path}: {what} (re-attach): the grant names "
                    f"group {granted.guard_index} pools {granted.pools}"
                )
        except BaseException:
            link.close()
            raise
        hold._grant = attrs.evolve(granted, group_path=grant.group_path)
        return _grant_of(granted, link)

    def _expect(self, reply: wire.Message, cls: type[_T], what: str) -> _T:
        if isinstance(reply, wire.ClaimRefused):
            raise KVCRGuardProtocolError(
                f"guard service {self.socket_path}: {what} refused ({reply.code}): {reply.message}"
            )
        if not isinstance(reply, cls):
            raise KVCRGuardProtocolError(
                f"guard service {self.socket_path}: {what}: unexpected reply {reply.TYPE!r}"
            )
        return reply

    def _take(
        self, request: wire.ClaimRequest, granted: wire.ClaimGranted, group_fd: int, listener: int
    ) -> KVCRPoolHold:
        what = f"claim of group {request.guard_index}"
        names = [name for name, _ in request.pool_layouts]
        try:
            if (
                granted.guard_index != request.guard_index
                or [name for name, _, _ in granted.pools] != names
            ):
                raise KVCRGuardProtocolError(
                    f"guard service {self.socket_path}: {what}: the grant names group "
                    f"{granted.guard_index} pools {[p[0] for p in granted.pools]}"
                )
            ends = [granted.journal_offset + granted.journal_size] + [
                o + s for _, o, s in granted.pools
            ]
            layout = GroupLayout(
                journal=(granted.journal_offset, granted.journal_size),
                pools=[(offset, size) for _, offset, size in granted.pools],
                total_size=max(ends),
            )
            lock = share_group_file(group_fd, layout)
        except BaseException:
            self._give_back(granted)
            raise
        try:
            mapping = map_group(group_fd, layout)
            listener_fd = os.dup(listener)
        except BaseException:
            lock.close()
            self._give_back(granted)
            raise
        pools = [
            (name, address, size)
            for (name, _, size), address in zip(granted.pools, mapping.pool_addresses)
        ]
        hold = KVCRPoolHold(LocalDramOptions(pools=pools))
        hold._attach(self, request, granted, mapping, lock, listener_fd)
        log.info(
            "guard_claimed",
            group=granted.guard_index,
            lease=granted.lease,
            control=f"{granted.control_host}:{granted.control_port}",
            path=granted.group_path,
        )
        return hold

    def _give_back(self, granted: wire.ClaimGranted) -> None:
        try:
            self.release(granted.guard_index, granted.lease, activated=False)
        except KVCRServiceError as exc:
            log.warning("guard_release_failed", group=granted.guard_index, error=str(exc))


def _grant_of(granted: wire.ClaimGranted, link: socket.socket) -> Grant:
    return Grant(granted.lease, link, granted.heartbeat_ms / 1000)


_live_holds: weakref.WeakSet[KVCRPoolHold] = weakref.WeakSet()


class KVCRPoolHold:
    """A claimed pool group, mapped in this process: its pools as ``local_dram``, the
    group's control listener, and the lease that ``release`` gives back.

    Built by :meth:`KVCRClient.claim`. ``KVCRPoolHold(local_dram)`` alone is a hold on
    memory that no service lends (nothing to release, no listener).
    """

    def __init__(self, local_dram: LocalDramOptions) -> None:
        self.local_dram = local_dram
        self._client: KVCRClient | None = None
        self._request: wire.ClaimRequest | None = None
        self._grant: wire.ClaimGranted | None = None
        self._tie: Tie | None = None  # the lease's link to the service
        self._mapping: GroupMapping | None = None
        self._lock: GroupFile | None = None
        self._listener_fd: int | None = None
        self._pid = os.getpid()
        self._released = False

    def _attach(
        self,
        client: KVCRClient,
        request: wire.ClaimRequest,
        grant: wire.ClaimGranted,
        mapping: GroupMapping,
        lock: GroupFile,
        listener_fd: int,
    ) -> None:
        self._client, self._request, self._grant, self._mapping = client, request, grant, mapping
        self._lock, self._listener_fd = lock, listener_fd
        _live_holds.add(self)

    @property
    def guard_index(self) -> int | None:
        return self._grant.guard_index if self._grant else None

    @property
    def group_path(self) -> str | None:
        """The group file this hold maps (the service's path)."""
        return self._grant.group_path if self._grant else None

    @property
    def lease(self) -> int | None:
        return self._grant.lease if self._grant else None

    @property
    def control_address(self) -> tuple[str, int] | None:
        """(host, port) of the group's control listener."""
        return (self._grant.control_host, self._grant.control_port) if self._grant else None

    @property
    def journal(self) -> tuple[int, int] | None:
        """(address, size) of the group's recovery journal in this process's mapping."""
        if self._mapping is None or self._grant is None:
            return None
        return (self._mapping.journal_address, self._grant.journal_size)

    def journal_buffer(self) -> memoryview | None:
        """A writable view of the group's recovery journal in this process's mapping. The
        caller must ``release()`` it before :meth:`release` (which cannot unmap under it)."""
        if self._mapping is None or self._grant is None:
            return None
        self._check_owner("journal_buffer")
        offset = self._grant.journal_offset
        return memoryview(self._mapping.mmap)[offset : offset + self._grant.journal_size]

    @property
    def released(self) -> bool:
        return self._released

    @property
    def tie(self) -> Tie | None:
        """The lease's link to the service (None: a hold no service lends); a KVCR runtime
        keeps it (:meth:`Tie.keep`)."""
        return self._tie

    def _group_fd(self) -> int | None:
        return None if self._lock is None or self._lock.closed else self._lock.fd

    def _check_owner(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise KVCRServiceError(
                f"KVCRPoolHold.{what}: the hold belongs to process {self._pid}; a forked "
                "child inherits neither the mapping nor the lease"
            )
        if self._released:
            raise KVCRServiceError(f"KVCRPoolHold.{what}: the hold was released")

    def hand_listener_to(self, adopt: Callable[[int], _T]) -> _T:
        """Call ``adopt(fd)`` with the group's control listener; ``adopt`` must duplicate the
        descriptor if it keeps it (the hold closes its own at release)."""
        self._check_owner("hand_listener_to")
        if self._listener_fd is None:
            raise KVCRServiceError("KVCRPoolHold.hand_listener_to: no control listener")
        return adopt(self._listener_fd)

    def release(self, *, activated: bool = True) -> None:
        """Unmap the pools, give the lease back and wait for the acknowledgement. Idempotent.

        Call it only when no transfer can touch the pools any more. If the mapping is
        still exported (a live memoryview), nothing is released and KVCRServiceError says so.
        """
        if self._released:
            return
        self._check_owner("release")
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError as exc:
                raise KVCRServiceError(
                    f"KVCRPoolHold.release: group {self.guard_index} is still in use in this "
                    f"process ({exc}); nothing was released"
                ) from None
        self._released = True
        _live_holds.discard(self)
        if self._listener_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._listener_fd)
            self._listener_fd = None
        if self._lock is not None:
            self._lock.close()
        tie, self._tie = self._tie, None
        if tie is not None:
            tie.stop_thread()
        try:
            if self._client is not None and self._grant is not None:
                grant = self._grant
                self._client.release(grant.guard_index, grant.lease, activated=activated)
                log.info("guard_released", group=grant.guard_index, lease=grant.lease)
        finally:
            if tie is not None:
                tie.close()

    def __repr__(self) -> str:
        if self._grant is None:
            return f"KVCRPoolHold(local_dram={self.local_dram!r})"
        state = "released" if self._released else "held"
        return (
            f"<KVCRPoolHold group={self._grant.guard_index} lease={self._grant.lease} "
            f"{state} path={self._grant.group_path}>"
        )


def _after_fork_in_child() -> None:
    # The child's copy of the listener fd would keep the group's endpoint open in a process
    # that is no worker; the mapping is already absent there (MADV_DONTFORK).
    for hold in list(_live_holds):
        if hold._listener_fd is not None:
            with contextlib.suppress(OSError):
                os.close(hold._listener_fd)
            hold._listener_fd = None
        if hold._tie is not None:
            hold._tie.forget_in_child()
            hold._tie = None
    _live_holds.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
