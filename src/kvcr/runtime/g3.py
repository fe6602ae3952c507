"""The G3 tier: blocks kept in local files, stored from and read back into host memory.

One slot index (a :class:`BlockIndex` with a single pool of file slots) in the runtime
thread; the data moves through the file transport, one transfer per batch. A slot's data is
trusted only while its on-disk record names the key and the generation this tier wrote
(:mod:`kvcr.g3.files`), checked after every read (before it, only that the file is still
whole): a file deleted, truncated, replaced or zeroed under a running instance turns its
keys into misses, never into wrong bytes. A slot's new record is written only once its
data is on disk, and the journal (guard groups) has published the removal of the slot's
previous key before the slot is rewritten: a crash mid-store leaves no record that could
vouch for half a block, for no key a successor could look for there.

Stores and reads are batches of hundreds of blocks, each a few microseconds of I/O: the
bookkeeping is done a batch at a time (one eviction pass, one record write per run of
slots, one commit) so that it stays a small share of the transfer.

As with every transfer, the completion work (commit, unclaim, verify) runs when the
transfer is terminal, whatever happened to whoever waits for it: an operation that times
out stops waiting at its deadline, a spill stops waiting at ``abandon_timeout_ms`` and
reports; the slots and host memory stay held until the transport says the copy is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from kvcr.config import G3Options
from kvcr.g3.files import G3Files
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.transfers import Transfers, Xfer
from kvcr.store.index import BlockIndex, Published
from kvcr.store.records import Block, BlockState
from kvcr.store.slots import SlotPool
from kvcr.telemetry import SCOPE_G3_FILL, SCOPE_G3_STORE, result_label
from kvcr.transport.base import TransportError
from kvcr.types import BlockKey, CacheTier, QueryStatus

FETCHABLE_G3 = (QueryStatus.FETCHABLE, CacheTier.G3)
# What runs once a G3 transfer is terminal: the transfer (None if nothing was posted), and
# the keys it moved (stored, or read and still vouched for).
Then = Callable[[Xfer | None, set[BlockKey]], None]


def open_g3(
    opts: G3Options, templates: Sequence[Path], memory: MemoryMap, agent: str, ephemeral: bool
) -> tuple[G3Files, Any]:
    """Open the G3 files and their NIXL agent, registered against ``memory``'s pools
    (blocking: file set-up and registration). ``ephemeral``: the files are this process's
    alone (no guard journal names them), removed at close."""
    from kvcr.transport.nixl_files import NixlFileTransport  # nixl only where G3 is used

    files = G3Files(
        opts.paths,
        opts.capacity_bytes_per_file,
        memory.block_sizes[0],
        templates=templates,
        ephemeral=ephemeral,
    )
    try:
        transport = NixlFileTransport(agent, opts.backend, dict(opts.backend_options))
        transport.open(memory.segments, [(f.fd, f.size) for f in files.files], files.slot_rows())
    except BaseException:
        files.close()
        raise
    return files, transport


class G3Tier:
    def __init__(
        self,
        *,
        files: G3Files,
        transport: Any,
        transfers: Transfers[Any],
        score: Callable[[Block], float],
        on_removed: Callable[[list[BlockKey]], None],
        log: Any,
        telemetry: Any = None,
        journal: Any = None,
        view: Published | None = None,
    ) -> None:
        self.files = files
        self.transport = transport
        self.transfers = transfers
        # ``query`` answers for committed blocks only.
        self.index = BlockIndex([SlotPool("g3", files.block, files.capacity)], FETCHABLE_G3, None)
        if view is not None:
            view.index = self.index
        self._score = score
        self._on_removed = on_removed
        self._telemetry = telemetry
        self.journal = journal  # the recovery journal's mirror (guard groups), or None
        self.log = log
        # Generations only grow, across restarts too: a record written by an earlier
        # process can never match what this one expects.
        self._next_generation = time.time_ns()

    def gauges(self) -> dict[str, float]:
        pool = self.index.pools[0]
        return {
            "g3_capacity_bytes": pool.capacity * pool.block_size,
            "g3_used_bytes": pool.used * pool.block_size,
            "g3_blocks": self.index.ready_count,
        }

    def close(self, leaked: bool) -> None:
        """Close the files and their agent, unless a transfer might still touch them."""
        if leaked or self.transfers.in_flight:
            self.log.error("g3_kept", reason="G3 transfers in flight at close")
            return
        self.transport.close()
        self.files.close()

    def __contains__(self, key: BlockKey) -> bool:
        block = self.index.get(key)
        return block is not None and block.state is BlockState.READY

    # -- store -------------------------------------------------------------------------------

    def store(self, items: Sequence[tuple[BlockKey, int]], what: str, then: Then) -> Xfer | None:
        """Start copying host descriptors into G3 slots (``items``: key, descriptor index),
        evicting G3 blocks by score for room. ``then(xfer, stored)`` runs once the copy is
        terminal, with the keys now committed in G3: until then the host descriptors are
        read and the slots written. Returns the transfer still in flight, or None when
        ``then`` has run already."""
        started = trio.current_time()
        wanted = len(items)
        items = [(k, d) for k, d in items if self.index.get(k) is None]
        items = items[: self._make_room(len(items))]
        blocks = self.index.add_filling_batch([k for k, _ in items], started)
        if self.journal is not None and blocks:
            self.journal.flush()  # the evicted keys' removals, before their slots are rewritten

        def finish(xfer: Xfer | None, ok: bool) -> None:
            stored = self._commit_store(blocks, ok, what)
            self._record(SCOPE_G3_STORE, started, len(stored), wanted)
            then(xfer, stored)

        return self._post("WRITE", [d for _, d in items], blocks, what, finish)

    def _record(self, scope: str, started: float, done: int, wanted: int) -> None:
        if self._telemetry is not None and wanted:
            self._telemetry.record(
                scope,
                trio.current_time() - started,
                result_label(done, wanted),
                done,
                done * self.files.block,
            )

    def _commit_store(self, blocks: list[Block], ok: bool, what: str) -> set[BlockKey]:
        """The write into ``blocks``' slots is over: vouch for and commit those it wrote,
        forget the others."""
        done = [b for b in blocks if self.index.holds(b)] if ok else []
        generation = self._next_generation
        try:
            self.files.vouch([b.slots[0] for b in done], [b.key for b in done], generation)
        except OSError as exc:
            self.log.warning("g3_record_failed", what=what, error=str(exc))
            done = []
        self._next_generation += len(done)
        if len(done) < len(blocks):
            kept = set(done)
            for block in blocks:
                if block not in kept and self.index.holds(block):
                    self.index.remove(block)
        self.index.commit_many(done, [self._score(b) for b in done])
        if self.journal is not None and done:
            self.journal.g3_committed_many(
                [b.key for b in done],
                [(b.slots[0], generation + i) for i, b in enumerate(done)],
            )
        return {b.key for b in done}

    def _make_room(self, wanted: int) -> int:
        pool = self.index.pools[0]
        if pool.free < wanted:
            self._dropped(self.index.evict(wanted - pool.free))
        return min(wanted, pool.free)

    def _dropped(self, keys: list[BlockKey]) -> None:
        """``keys`` left G3: journal them (guard groups) and report them removed."""
        if keys:
            if self.journal is not None:
                self.journal.g3_removed_many(keys)
            self._on_removed(keys)

    def restore(self, records: dict[BlockKey, Any]) -> list[BlockKey]:
        """Take back the G3 blocks an earlier holder journaled (``records``: key ->
        residency with values (slot, generation)), keeping only those whose slot is in range,
        not named twice, and still vouched for by its file and record. Returns them."""
        capacity = self.index.pools[0].capacity
        candidates: dict[int, tuple[BlockKey, int]] = {}
        for key, residency in records.items():
            values = residency.values
            if len(values) == 2 and 0 <= values[0] < capacity and values[0] not in candidates:
                candidates[values[0]] = (key, values[1])
        sound = self.files.check_many(candidates) if candidates else set()
        slots = sorted(sound)
        self.index.put_recovered([candidates[s][0] for s in slots], slots)
        self.index.queue_recovered(self._score)
        for slot in sound:
            self._next_generation = max(self._next_generation, candidates[slot][1] + 1)
        kept = {candidates[s][0] for s in sound}
        dropped = [k for k in records if k not in kept]
        if self.journal is not None:
            self.journal.g3_removed_many(dropped)
        self.log.info("g3_recovered", blocks=len(kept), dropped=len(dropped))
        return sorted(kept)

    # -- read --------------------------------------------------------------------------------

    def read(
        self,
        items: Sequence[tuple[BlockKey, int]],
        what: str,
        then: Then,
        scope: str = SCOPE_G3_FILL,
    ) -> Xfer | None:
        """Start copying G3 blocks into host descriptors (``items``: key, descriptor index).
        ``then(xfer, got)`` runs once the copy is terminal, with the keys whose bytes arrived
        and were still vouched for after the copy: until then the descriptors are written
        and the blocks' slots stay claimed. Returns the transfer still in flight, or None
        when ``then`` has run already. ``scope`` labels its telemetry (``g3_fill`` into
        G2, ``g3_deliver`` into engine memory)."""
        started = trio.current_time()
        # Before the read, only what is cheap: READY blocks in files that can be read whole
        # (a truncated file would fail the whole transfer). The records are checked once,
        # after the read: that check is the one that vouches for the bytes.
        get, ready, n = self.index.get, BlockState.READY, len(self.files.files)
        found = [(b, d) for k, d in items if (b := get(k)) is not None and b.state is ready]
        readable = self.files.readable(b.slots[0] for b, _ in found)
        wanted = [(b, d) for b, d in found if b.slots[0] % n in readable]
        if len(wanted) < len(found):
            self._lose([b for b, _ in found if b.slots[0] % n not in readable])
        blocks = [b for b, _ in wanted]
        for block in blocks:
            self.index.claim(block)

        def finish(xfer: Xfer | None, ok: bool) -> None:
            now = trio.current_time()
            for block in blocks:
                self.index.unclaim_scored(block, self._score, now)
            got = {b.key for b in self._verified(blocks)} if ok else set()
            self._record(scope, started, len(got), len(items))
            then(xfer, got)

        return self._post("READ", [d for _, d in wanted], blocks, what, finish)

    def _verified(self, blocks: list[Block]) -> list[Block]:
        """Those of ``blocks`` (just read) still held that their files and records still
        vouch for (one file check per file, one record read and comparison per run of
        slots: the records must be byte for byte those this tier wrote or verified for
        them); the others are forgotten and reported removed."""
        held = [b for b in blocks if self.index.holds(b)]
        sound = self.files.check_written([b.slots[0] for b in held])
        self._lose([b for b in held if b.slots[0] not in sound])
        return [b for b in held if b.slots[0] in sound]

    def _lose(self, lost: list[Block]) -> None:
        """Forget blocks whose file or record no longer vouches for them (those still
        claimed are forgotten by the next check after their last claim ends)."""
        if not lost:
            return
        self.log.warning("g3_record_invalid", blocks=len(lost), reason="file or record changed")
        unclaimed = [b for b in lost if b.claims == 0]
        for block in unclaimed:
            self.index.remove(block)
        self._dropped([b.key for b in unclaimed])

    def _post(
        self,
        op: str,
        descriptors: list[int],
        blocks: list[Block],
        what: str,
        finish: Callable[[Xfer | None, bool], None],
    ) -> Xfer | None:
        """Post one transfer between ``descriptors`` and ``blocks``' slots; ``finish`` runs
        once it is terminal (at once, not ok, when there is nothing to move or it could not
        be posted). The tier's poller drives it (the file backends progress only while
        polled): whoever waits for it may give up, the completion work still runs."""
        if not blocks:
            finish(None, False)
            return None
        slots = self.files.positions([b.slots[0] for b in blocks])
        try:
            handle = self.transport.post(op, descriptors, slots, what)
        except TransportError as exc:
            self.log.warning("g3_transfer_failed", op=op, what=what, error=str(exc))
            finish(None, False)
            return None
        nbytes = len(blocks) * self.files.block
        xfer = self.transfers.track(handle, what, nbytes, lambda x: finish(x, x.ok))
        return None if xfer.done.is_set() else xfer
