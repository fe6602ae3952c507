"""One Guard per pool group: the group's file and mapping, its control listener (bound on the
first claim, kept for the group's life), the watch on the current holder's pidfd, and,
after a holder died, the server of its committed blocks (``serving.py``).

A Guard's moves are the group's moves in ``rules.py``; this module does the I/O around them.
Its tasks run in the service's supervisor nursery: the holder watch (``run``), the journal
follower (``follow``), and a served group's runtime with its watcher. A Guard that fails
stops the service; a served group whose runtime fails only makes its group unusable.
"""

from __future__ import annotations

import math
import socket
from typing import Any

import attrs
import trio

from kvcr.guard import protocol as wire
from kvcr.guard.metrics import GroupTally
from kvcr.guard.pools import GroupFile, map_group
from kvcr.guard.procs import close_quietly
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


class Guard:
    def __init__(
        self, index: int, file: GroupFile, groups: Groups, log: Any, tally: GroupTally | None = None
    ) -> None:
        self.index = index
        self.tally = tally if tally is not None else GroupTally()  # for the metrics
        self.file = file
        self.mapping = map_group(file.fd, file.layout)
        self.server: GroupServer | None = None
        self.groups = groups
        self.log = log.bind(group=index)
        # The service's supervisor nursery, once it runs: served groups run in it.
        self.nursery: trio.Nursery | None = None
        self.lock = trio.Lock()  # one claim of this group at a time, across awaits
        self.listener: socket.socket | None = None
        # Unbounded, yet short: a lease is queued per grant and taken at the Guard's next turn.
        self._send, self._leases = trio.open_memory_channel[tuple[Lease, int]](math.inf)
        self._watch: tuple[int, trio.CancelScope] | None = None
        # Servers started and not known to have stopped in order: one that did not keeps
        # the group mapped at service stop (a transfer of it may still read the pools).
        self._servers: list[GroupServer] = []
        journal_offset, journal_size = file.layout.journal
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
        if terms is None:
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
        """Fence ``lease`` by ``pidfd`` (now owned by the Guard) until it ends."""
        try:
            self._send.send_nowait((lease, pidfd))
        except BaseException:
            close_quietly(pidfd)
            raise

    def released(self, lease: int, activated: bool = True) -> None:
        if self.groups.end_lease(self.index, lease, GroupEvent.RELEASE):
            self.log.info("lease_ended", lease=lease, reason="released", activated=activated)
        if self._watch is not None and self._watch[0] == lease:
            self._watch[1].cancel()

    async def run(self) -> None:
        async for lease, pidfd in self._leases:
            exited = False
            try:
                with trio.CancelScope() as scope:
                    self._watch = (lease.number, scope)
                    current = self.groups[self.index].lease
                    if current is not None and current.number == lease.number:
                        if self.nursery is not None:
                            self.nursery.start_soon(self._open_standby)
                        await trio.lowlevel.wait_readable(pidfd)
                        exited = self.groups.end_lease(
                            self.index, lease.number, GroupEvent.HOLDER_EXIT
                        )
            finally:
                self._watch = None
                close_quietly(pidfd)
            if exited:
                self.log.info("lease_ended", lease=lease.number, pid=lease.pid, reason="exited")
                async with self.lock:
                    await self._take_over()

    async def _open_standby(self) -> None:
        """Open a transport over the held group's pools, so that a takeover does not wait
        for NIXL set-up. A failure is logged: the takeover then opens its own."""
        terms = self.groups[self.index].terms
        if self._standby is not None or self._opening_standby or terms is None:
            return
        self._opening_standby = True
        try:
            standby = await trio.to_thread.run_sync(Standby.open, self.index, terms, self.mapping)
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
        close the listener, unmap, remove the group file. A group whose server did not stop
        in order stays mapped until the process exits."""
        kept = any(not s.clean for s in self._servers)
        try:
            if self.listener is not None:
                self.listener.close()
                self.listener = None
            self.follower.release()
            if self._standby is not None:  # never used: deregistered before the unmap
                self._standby.close()
                self._standby = None
            if kept:
                self.log.error("group_kept_mapped", reason="a server's transfer may still run")
                return
            try:
                self.mapping.close()
            finally:
                self.file.close(unlink=True)
        finally:
            self.server = None


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
