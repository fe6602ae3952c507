"""The worker's side of crash recovery: start warm from the group's journal, then mirror
every committed change into it.

At start, the journal left by the group's previous holder (a worker that died, or the Guard
that served in between) is replayed: every G2 record that names one in-range slot per pool,
no slot twice, becomes a READY block in the slots it had, with no claims and no recency,
queued for eviction by the policy's score; the LOCAL_G2 inventory is republished for them.
G3 records are kept aside in the journal for the file tier. Anything else is skipped (and
counted in the log): a record from outside is never trusted to point at memory.

Then :class:`Mirror` is the index's journal sink. If the journal cannot hold even a snapshot
of the live state, recovery is disabled for the group (logged as ``KVCR pool recovery
disabled``) and the worker goes on; it is enabled again once a snapshot fits.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from kvcr.guard import journal
from kvcr.runtime.index import Block, BlockIndex, BlockState
from kvcr.types import BlockKey


class Mirror(journal.Writer):
    """The journal writer of a worker's index: snapshots come from the index (plus the G3
    records kept aside); flushes log when recovery gets disabled or enabled again, and the
    first key the journal cannot describe."""

    def __init__(
        self,
        buf: memoryview,
        index: BlockIndex,
        kept: dict[BlockKey, journal.Residency],
        group: int | None,
        log: Any,
    ) -> None:
        self._source = buf
        self._index = index
        self._kept = kept  # the G3 residencies: as recovered, then as the file tier changes them
        self.group = group
        self.log = log
        self._warned = 0
        # Changes since the last flush, as one run of commits or one run of removals (the
        # order between runs is kept): published as batch entries.
        self._put_keys: list[BlockKey] = []
        self._put_slots: list[tuple[int, ...]] = []
        self._removed: list[BlockKey] = []
        super().__init__(buf, self._live)
        if self.disabled:
            self._disabled()

    @property
    def g3_records(self) -> dict[BlockKey, journal.Residency]:
        return self._kept

    def g3_committed_many(self, keys: list[BlockKey], values: list[tuple[int, ...]]) -> None:
        """Blocks committed in G3 (``values``: slot, generation each)."""
        for key, vals in zip(keys, values):
            self._kept[key] = journal.Residency(journal.PUT_G3, vals)
        self.put_batch(keys, values, journal.PUT_G3)

    def g3_removed_many(self, keys: list[BlockKey]) -> None:
        """Blocks that left G3 (those it never held are ignored)."""
        gone = [k for k in keys if self._kept.pop(k, None) is not None]
        if gone:
            self.remove_batch(gone, journal.REMOVE_G3)

    def _live(self) -> Iterator[journal.Entry]:
        ready = BlockState.READY
        for key, block in self._index.blocks.items():
            if block.state is ready:
                yield (journal.PUT_G2, key, block.slots)
        for key, residency in self._kept.items():
            yield (residency.tier, key, residency.values)

    @property
    def fill_percent(self) -> float:
        return 100.0 * self.fill

    def committed(self, key: BlockKey, slots: tuple[int, ...]) -> None:
        if self._removed:
            self._drain()
        self._put_keys.append(key)
        self._put_slots.append(slots)

    def removed(self, key: BlockKey) -> None:
        if self._put_keys:
            self._drain()
        self._removed.append(key)

    def _drain(self) -> None:
        if self._put_keys:
            self.put_batch(self._put_keys, self._put_slots)
            self._put_keys, self._put_slots = [], []
        if self._removed:
            self.remove_batch(self._removed)
            self._removed = []

    def flush(self) -> bool:
        self._drain()
        was = self.disabled
        ok = super().flush()
        if not ok and not was:
            self._disabled()
        elif ok and was:
            self.log.warning("KVCR pool recovery enabled again", group=self.group)
        if self.refused and not self._warned:
            # Those blocks are simply not recoverable; say so once, not once per block.
            self._warned = self.refused
            self.log.warning("recovery_mirror_skipped", error=str(self.last_refusal))
        return ok

    def _disabled(self) -> None:
        self.log.error(
            "KVCR pool recovery disabled",
            group=self.group,
            blocks=len(self._index.blocks),
            reason="the journal cannot hold a snapshot of the live state",
        )

    def close(self) -> None:
        """Publish what is buffered and let go of the journal's memory."""
        self.flush()
        self._buf.release()
        self._source.release()


def recover(
    index: BlockIndex, buf: memoryview, log: Any
) -> tuple[list[Block], dict[BlockKey, journal.Residency]]:
    """Replay ``buf`` into ``index``: the blocks restored, and the G3 records kept aside."""
    replay = journal.read(buf)
    capacities = [pool.capacity for pool in index.pools]
    taken: list[set[int]] = [set() for _ in capacities]
    records: list[tuple[BlockKey, tuple[int, ...]]] = []
    # The one place replayed journal keys (raw bytes) become block keys: the keys that were
    # put, byte for byte.
    state = cast("dict[BlockKey, journal.Residency]", replay.state)
    kept = dict(cast("dict[BlockKey, journal.Residency]", replay.g3))  # checked by the G3 tier
    skipped = 0
    for key, residency in state.items():
        slots = residency.values
        if (
            residency.tier != journal.PUT_G2
            or len(slots) != len(capacities)
            or any(not 0 <= s < cap or s in seen for s, cap, seen in zip(slots, capacities, taken))
        ):
            skipped += 1
            continue
        for slot, seen in zip(slots, taken):
            seen.add(slot)
        records.append((key, slots))
    blocks = index.restore(records)
    log.info(
        "recovered",
        blocks=len(blocks),
        g3_records=len(kept),
        skipped=skipped,
        epoch=replay.epoch,
        frames=replay.frames,
        disabled=replay.disabled,
    )
    return blocks, kept
