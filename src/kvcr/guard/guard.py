"""One Guard per pool group: the group's file and mapping, its control listener (bound on the
first claim, kept for the group's life), the watch on the current holder (its pidfd, and its
heartbeats with ``--heartbeat-timeout-ms``), and, after a holder died, the server of its
committed blocks (``serving.py``).

A Guard's moves are the group's moves in ``rules.py``; this module does the I/O around them.
Its tasks run in the service's supervisor nursery: the holder watch (``run``), the journal
follower (``follow``), a detached group's wait for its worker (``wait_detached``), and a
served group's runtime with its watcher. A Guard that fails stops the service; a served
group whose runtime fails only makes its group unusable.

A silent holder is fenced by ``fencing.py``; the lease ends only once its pidfd says the
process has exited, so no takeover ever reads pools a live holder could still write.
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
from typing import Any

import attrs
import trio

from kvcr.guard import protocol as wire
from kvcr.guard.fencing import fence_when_silent
from kvcr.guard.heartbeat import Beats, Verdict
from kvcr.guard.metrics import GroupTally
from kvcr.guard.pools import GroupFile, map_group, unheld
from kvcr.guard.procs import close_quietly, handed_over_refusal
from kvcr.guard.rules import GroupEvent, Groups, GroupState, Lease, Terms
from kvcr.guard.serving import CannotServe, GroupServer, Standby, group_memory
from kvcr.policy import LRUPolicy
from kvcr.runtime.mirror import Followed, Replayed
from kvcr.runtime.residency import index_options
from kvcr.store.index import BlockIndex
from kvcr.store.journal.replay import DictState, Follower, Replay, State
from kvcr.store.slots import slot_pools

CONTROL_BACKLOG = 128
FOLLOW_INTERVAL_S = 0.5
DETACHED_POLL_S = 1.0  # how often a detached group checks whether its worker still maps it


class Guard:
    def __init__(
        self,
        index: int,
        file: GroupFile | None,
        groups: Groups,
        log: Any,
        tally: GroupTally | None = None,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        """``file``: the group's file (None: a live worker maps a file of other flags under
        the group's name, and the group is never lent: ``Groups.detach``);
        ``heartbeat_timeout_s``: fence a holder that beats no sooner (None: holders are
        fenced by their exit alone)."""
        self.index = index
        self.tally = tally if tally is not None else GroupTally()  # for the metrics
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.beats: Beats | None = None  # the current lease's, with a heartbeat timeout
        self.file = file
        self.mapping = map_group(file.fd, file.layout) if file is not None else None
        self.server: GroupServer | None = None
        self.groups = groups
        self.log = log.bind(group=index)
        # The service's supervisor nursery, once it runs: served groups run in it.
        self.nursery: trio.Nursery | None = None
        self.lock = trio.Lock()  # one claim of this group at a time, across awaits
        self.listener: socket.socket | None = None
        # Unbounded, yet short: a lease is queued per grant and taken at the Guard's next turn.
        self._send, self._leases = trio.open_memory_channel[tuple[Lease, int, Beats | None]](
            math.inf
        )
        self._watch: tuple[int, trio.CancelScope] | None = None
        # Servers started and not known to have stopped in order: one that did not keeps
        # the group mapped at service stop (a transfer of it may still read the pools).
        self._servers: list[GroupServer] = []
        self.follower: Follower | None = None
        if self.mapping is not None:
            journal_offset, journal_size = self.mapping.layout.journal
            self.follower = Follower(
                memoryview(self.mapping.mmap)[journal_offset : journal_offset + journal_size],
                self._replay_state,
            )
        self.journal: Replay | None = None  # what the follower saw last
        self._following = trio.Lock()  # one poll at a time: a takeover takes the state
        # A transport opened over the pools while the group is held, for the next takeover.
        self._standby: Standby | None = None
        self._opening_standby = False

    def _replay_state(self) -> State:
        """What the follower replays into: a block index over the group's pools, which a
        takeover hands to the server as it stands (a dict until the group has terms)."""
        terms = self.groups[self.index].terms
        if terms is None or self.mapping is None:
            return DictState()
        memory = group_memory(terms, self.mapping)
        pools = slot_pools(memory.pool_names, memory.block_sizes, memory.pool_slots)
        return Replayed(BlockIndex(pools, **index_options(LRUPolicy())))

    async def control_listener(self, host: str, port: int) -> socket.socket:
        """The group's listening TCP socket, bound to (host, port) on first use."""
        if self.listener is None:
            try:
                infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (UnicodeError, ValueError) as exc:  # e.g. an over-long label
                raise OSError(f"bad host {host!r}: {exc}") from None
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(CONTROL_BACKLOG)
            except BaseException:
                sock.close()
                raise
            self.listener = sock
            self.log.info("control_bound", address=f"{host}:{sock.getsockname()[1]}")
        return self.listener

    def watch(self, lease: Lease, pidfd: int) -> None:
        """Fence ``lease`` by ``pidfd`` (now owned by the Guard) until it ends: its exit, and
        its heartbeats if the service requires them (the grant counts as the first beat).
        The beats travel with the lease: ``run`` may still be ending the previous lease's
        watch when this one is granted (a release, then a claim, in one scheduling round)."""
        beats = None
        if self.heartbeat_timeout_s is not None:
            beats = Beats(self.heartbeat_timeout_s, trio.current_time())
        try:
            self._send.send_nowait((lease, pidfd, beats))
        except BaseException:
            close_quietly(pidfd)
            raise

    def released(self, lease: int, activated: bool = True) -> None:
        if self.groups.end_lease(self.index, lease, GroupEvent.RELEASE):
            self.log.info("lease_ended", lease=lease, reason="released", activated=activated)
        if self._watch is not None and self._watch[0] == lease:
            self._watch[1].cancel()

    async def run(self) -> None:
        async for lease, pidfd, beats in self._leases:
            exited = False
            try:
                with trio.CancelScope() as scope:
                    self._watch = (lease.number, scope)
                    current = self.groups[self.index].lease
                    if current is not None and current.number == lease.number:
                        self.beats = beats
                        if self.nursery is not None:
                            self.nursery.start_soon(self._open_standby)
                        async with trio.open_nursery() as watch:
                            if beats is not None:
                                watch.start_soon(
                                    fence_when_silent,
                                    beats,
                                    lease,
                                    pidfd,
                                    self._fence,
                                    self.log,
                                )
                            await trio.lowlevel.wait_readable(pidfd)
                            watch.cancel_scope.cancel()
                        exited = self.groups.end_lease(
                            self.index, lease.number, GroupEvent.HOLDER_EXIT
                        )
            finally:
                self._watch = None
                if self.beats is beats:
                    self.beats = None
                close_quietly(pidfd)
            if exited:
                self.log.info("lease_ended", lease=lease.number, pid=lease.pid, reason="exited")
                async with self.lock:
                    await self._take_over()

    def beat(self, lease: int, seq: int) -> Verdict | None:
        """A heartbeat of ``lease`` arrived; None if it is not the lease being watched."""
        current = self.groups[self.index].lease
        beats = self.beats
        if beats is None or current is None or current.number != lease:
            return None
        return beats.beat(seq, trio.current_time())

    def last_beat_ms(self) -> int | None:
        """How long ago the holder last beat (None: no holder, or no heartbeats)."""
        beats = self.beats
        if beats is None or self.groups[self.index].lease is None:
            return None
        return max(0, round(1000 * (trio.current_time() - beats.last)))

    def _fence(self, lease: Lease) -> bool:
        """The holder of ``lease`` missed its deadline: fence it (False: it ended already)."""
        if not self.groups.fence(self.index, lease.number):
            return False
        self.tally.fenced += 1
        return True

    async def wait_detached(self, interval_s: float = DETACHED_POLL_S) -> None:
        """While the group is detached, check every ``interval_s`` whether any process still
        maps its file; once none does, the worker exited without re-attaching: the group is
        idle (its journal is what that worker left: an heir starts warm from it if valid)."""
        file = self.file
        assert file is not None, "a detached group has its file"
        while self.groups[self.index].state is GroupState.DETACHED:
            if unheld(file.path, file.fd):
                async with self.lock:
                    if self.groups[self.index].state is GroupState.DETACHED:
                        self.groups.move(self.index, GroupEvent.ORPHANED)
                        self._hold_file()
                        self.log.info("detached_orphaned", reason="its worker exited")
                return
            await trio.sleep(interval_s)

    def _hold_file(self) -> None:
        """Take the service's shared lock on an adopted file (it holds none while detached,
        so that a worker's exit shows as a lock nobody holds)."""
        assert self.file is not None
        fcntl.flock(self.file.fd, fcntl.LOCK_SH)

    def reattach_refusal(self, group_fd: int, listener_fd: int, port: int) -> str | None:
        """Why the descriptors of a re-attach are not this group's file and its listener
        bound to ``port``; None if they are."""
        assert self.file is not None, "a detached group has its file"
        return handed_over_refusal(self.file.fd, str(self.file.path), group_fd, listener_fd, port)

    def reattached(self, listener_fd: int) -> None:
        """The detached group's worker re-attached (granted): keep its listener (for a
        takeover after it dies), hold the file again, and follow its journal from scratch
        (it writes a new snapshot once attached)."""
        self.listener = socket.socket(fileno=os.dup(listener_fd))
        self._hold_file()
        assert self.follower is not None
        self.follower.restart()
        self.journal = None
        self.tally.reattached += 1

    async def _open_standby(self) -> None:
        """Open a transport over the held group's pools, so that a takeover does not wait
        for NIXL set-up. A failure is logged: the takeover then opens its own."""
        terms, mapping = self.groups[self.index].terms, self.mapping
        if self._standby is not None or self._opening_standby or terms is None or not mapping:
            return
        self._opening_standby = True
        try:
            standby = await trio.to_thread.run_sync(Standby.open, self.index, terms, mapping)
        except Exception as exc:
            self.log.warning("standby_failed", error=repr(exc), reason="a takeover opens its own")
            return
        finally:
            self._opening_standby = False
        self._standby = standby
        self.log.info("standby_opened", agent=standby.name)

    async def follow(self, interval_s: float = FOLLOW_INTERVAL_S) -> None:
        """Keep up with the group's journal while a holder writes it, for ``status`` and so
        that a takeover only applies the tail (while this Guard serves the group, its
        server's index is the state). A failure here is logged, not fatal."""
        while True:
            if self.groups[self.index].state is GroupState.HELD:
                await self._poll()
            await trio.sleep(interval_s)

    async def _poll(self) -> Replay | None:
        if self.follower is None:
            return None
        async with self._following:
            try:
                self.journal = await trio.to_thread.run_sync(self.follower.poll)
            except Exception as exc:
                self.log.warning("journal_follow_failed", error=repr(exc))
                return None
            return self.journal

    async def _followed(self) -> Followed | None:
        """The group's journal replayed to its end (the tail since the last poll applied),
        for a server to take over; the follower starts afresh. None if it is no index."""
        replay = await self._poll()
        if self.follower is None:
            return None
        async with self._following:
            state = self.follower.state
            self.follower.restart()
        if replay is None or not isinstance(state, Replayed):
            return None
        return state.followed(replay.position)

    def journal_status(self, status: wire.GroupStatus) -> wire.GroupStatus:
        """``status`` with what the group's journal holds (the server's own mirror while
        this Guard serves the group, else what the follower saw last) and the blocks
        served to peers so far."""
        status = attrs.evolve(
            status,
            served_blocks=self.tally.served_blocks + self.serving_blocks(),
            served_g3_blocks=self.tally.served_g3_blocks + self.serving_g3_blocks(),
        )
        server = self.server
        mirror = server.runtime.mirror if server is not None else None
        if mirror is None:
            return with_journal(status, self.journal)
        return attrs.evolve(
            status,
            journal_fill_percent=min(100, round(mirror.fill_percent)),
            journal_blocks=len(server.runtime.index) if server is not None else 0,
            recovery_disabled=mirror.disabled,
        )

    async def _take_over(self) -> None:
        """Serve the dead holder's committed blocks on the group's endpoint. If that is not
        possible (no address peers could use, or the server fails to start), the group just
        stays idle and claimable: serving is a bonus, fencing leases is what must not fail.
        A server that cannot open the group's G3 files serves its G2 blocks alone."""
        group = self.groups[self.index]
        if group.state is not GroupState.IDLE or group.terms is None or self.listener is None:
            return
        started = trio.current_time()
        assert self.nursery is not None, "the supervisor runs the Guard"
        followed = await self._followed()
        standby, self._standby = self._standby, None
        terms = group.terms
        try:
            try:
                server = await self._start_server(terms, followed, standby)
            except CannotServe:
                raise
            except Exception as exc:
                if terms.g3 is None:
                    raise
                # The files may be gone, locked or resized: the journal keeps their records
                # for the next holder, which checks them again. The index the first try was
                # handed may have been changed: this one replays the journal.
                self.log.warning("g3_not_served", error=repr(exc), reason="serving G2 alone")
                self._forget_if_clean()
                server = await self._start_server(attrs.evolve(terms, g3=None), None, None)
        except CannotServe as exc:
            self.log.warning("not_serving", reason=str(exc))
            return
        except Exception as exc:
            self.log.error("takeover_failed", error=repr(exc))
            self._forget_if_clean()
            return
        self.server = server
        self.groups.move(self.index, GroupEvent.TAKEOVER)
        self.tally.takeovers += 1
        self.nursery.start_soon(self._watch_server, server)
        self.log.info("took_over", seconds=round(trio.current_time() - started, 6))

    async def _start_server(
        self, terms: Terms, followed: Followed | None, standby: Standby | None
    ) -> GroupServer:
        """Build the group's server and start it in the supervisor nursery."""
        assert self.nursery is not None and self.listener is not None
        assert self.mapping is not None, "a group that had a holder has its file"
        try:
            server = GroupServer.prepare(
                self.index, terms, self.mapping, self.listener, self.log, followed, standby
            )
        except BaseException:
            if standby is not None:  # no runtime took it over
                await trio.to_thread.run_sync(standby.close)
            raise
        self._servers.append(server)
        await server.start(self.nursery)
        return server

    def serving_blocks(self) -> int:
        """Blocks the current server (if any) has written to peers so far."""
        server = self.server
        return server.served_blocks() if server is not None else 0

    def serving_g3_blocks(self) -> int:
        """... of which the current server read from the group's G3 files."""
        server = self.server
        return server.served_g3_blocks() if server is not None else 0

    def _count_served(self, server: GroupServer) -> None:
        """A server stopped: what it wrote goes into the group's tally."""
        self.tally.served_blocks += server.served_blocks()
        self.tally.served_g3_blocks += server.served_g3_blocks()

    async def _watch_server(self, server: GroupServer) -> None:
        """A server that stops on its own (its runtime failed) leaves the group unusable:
        nobody can tell whether a transfer of it still reads the pools."""
        await server.ended.wait()
        if self.server is not server:
            return  # handed back or closed: whoever stopped it decided
        self.server = None
        self._count_served(server)
        self._unusable(server, server.failure or "its server stopped")

    def _unusable(self, server: GroupServer, reason: str) -> None:
        self.groups.mark_unusable(self.index, reason)
        self.log.error("group_unusable", reason=reason)

    async def hand_back(self) -> None:
        """A claim arrived for the group this Guard serves: stop serving first (the journal
        then holds what the server held, for the claimant to recover). If the server could
        not stop cleanly, the group becomes unusable instead."""
        self.groups.move(self.index, GroupEvent.CLAIM)
        started = trio.current_time()
        server, self.server = self.server, None
        with trio.CancelScope(shield=True):  # bounded by the runtime's own deadlines
            stopped_clean = server is None or await server.stop()
        if server is not None:
            self._count_served(server)
        if server is not None and not stopped_clean:
            reason = server.failure or "a transfer of its server may still read its pools"
            self._unusable(server, reason)
            return
        self._forget_if_clean()
        self._follow_on(server)
        self.tally.handbacks += 1
        self.log.info("handed_back", seconds=round(trio.current_time() - started, 6))

    def _follow_on(self, server: GroupServer | None) -> None:
        """The server stopped in order: its index is what the journal holds, so following
        goes on from there (the next holder resumes the journal) rather than replaying it
        all again."""
        mirror = server.runtime.mirror if server is not None else None
        position = mirror.position() if mirror is not None else None
        if server is None or position is None:
            return
        index = server.runtime.index
        if self.follower is None:
            return
        index.journal = None  # the follower replays into it from now on
        replayed = Replayed(index)
        replayed.g3.update(mirror.g3_records if mirror is not None else {})
        self.follower.adopt(replayed, position)

    def _forget_if_clean(self) -> None:
        """Drop the servers that stopped in order: their runtime (NIXL agent, sockets) is
        garbage from now on."""
        self._servers = [s for s in self._servers if not s.clean]

    def close(self) -> None:
        """At service stop, once the supervisor nursery (and every server in it) is done:
        close the listener, unmap, remove the group file unless a worker still maps it (a
        restarted service lets that worker re-attach). A group whose server did not stop in
        order stays mapped until the process exits."""
        kept = any(not s.clean for s in self._servers)
        try:
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            if self.follower is not None:
                self.follower.release()
            if self._standby is not None:  # never used: deregistered before the unmap
                self._standby.close()
                self._standby = None
            if kept:
                self.log.error("group_kept_mapped", reason="a server's transfer may still run")
                return
            try:
                if self.mapping is not None:
                    self.mapping.close()
            finally:
                self._close_file()
        finally:
            self.server = None

    def _close_file(self) -> None:
        """Close the group file; remove it unless a worker still maps it (a service
        started with the same flags lets that worker re-attach)."""
        file = self.file
        if file is None or file.closed:
            return
        fcntl.flock(file.fd, fcntl.LOCK_UN)  # our own shared lock would hide a worker's
        in_use = not unheld(file.path, file.fd)
        if in_use:
            self.log.warning(
                "group_file_kept",
                path=str(file.path),
                reason="a worker still maps it; a service started with the same flags lets "
                "it re-attach",
            )
        file.close(unlink=not in_use)


def with_journal(status: wire.GroupStatus, replay: Replay | None) -> wire.GroupStatus:
    """``status`` with what the group's journal held when the service last read it."""
    if replay is None or (replay.epoch == 0 and not replay.disabled):
        return status  # never read, or nobody ever wrote it
    fill = 100 if replay.disabled else min(100, round(100 * replay.used / replay.half_size))
    return attrs.evolve(
        status,
        journal_fill_percent=fill,
        journal_blocks=len(replay.state),
        recovery_disabled=replay.disabled,
    )
