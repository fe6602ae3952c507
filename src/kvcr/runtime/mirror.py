"""The worker's side of crash recovery: start warm from the group's journal, then mirror
every committed change into it.

At start, the journal left by the group's previous holder (a worker that died, or the Guard
that served in between) is replayed: every G2 record that names one in-range slot per pool,
no slot twice, becomes a READY block in the slots it had, with no claims and no recency,
queued for eviction by the policy's score; the LOCAL_G2 inventory is republished for them.
G3 records are kept aside in the journal for the file tier. Anything else is skipped (and
counted in the log): a record from outside is never trusted to point at memory.

Then :class:`Mirror` is the index's journal sink. When the index holds exactly what was
replayed, it resumes the journal after its last whole frame (no snapshot, so a warm start
costs no write of the whole state, and the guard's follower simply goes on); otherwise it
starts a new epoch with a snapshot. If the journal cannot hold even a snapshot
of the live state, recovery is disabled for the group (logged as ``KVCR pool recovery
disabled``) and the worker goes on; it is enabled again once a snapshot fits.

When the guard service is lost (``guard_lost``), the mirror *detaches*: it marks the journal
as holding nothing (a reader that replayed it from now on would trust slots that no longer
hold what it says) and writes nothing more, though it keeps track of the G3 records for the
snapshot it writes when a restarted service lets the worker re-attach.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs
import numpy as np

from kvcr.store import journal
from kvcr.store.index import BlockIndex
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
        resume: journal.Position | None = None,
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
        self._put_slots: list[np.ndarray] = []  # keys x pools each
        self._removed: list[BlockKey] = []
        super().__init__(buf, None, resume)  # snapshots come from the index: snapshot()
        if self.disabled:
            self._disabled()

    @property
    def g3_records(self) -> dict[BlockKey, journal.Residency]:
        return self._kept

    def g3_committed_many(self, keys: list[BlockKey], values: list[tuple[int, ...]]) -> None:
        """Blocks committed in G3 (``values``: slot, generation each)."""
        for key, vals in zip(keys, values):
            self._kept[key] = journal.Residency(journal.PUT_G3, vals)
        if not self.stopped:
            self.put_batch(keys, values, journal.PUT_G3)

    def g3_removed_many(self, keys: list[BlockKey]) -> None:
        """Blocks that left G3 (those it never held are ignored)."""
        gone = [k for k in keys if self._kept.pop(k, None) is not None]
        if gone and not self.stopped:
            self.remove_batch(gone, journal.REMOVE_G3)

    @property
    def recording(self) -> bool:
        """Whether an heir could start warm from the journal as it stands."""
        return not (self.disabled or self.stopped)

    def detach(self) -> None:
        """The guard service is gone: stop journaling (see the module's docstring)."""
        self._put_keys, self._put_slots, self._removed = [], [], []
        self.stop()
        self.log.error(
            "KVCR pool recovery disabled",
            group=self.group,
            blocks=len(self._index),
            reason="the guard service is gone; recovery is on again once it is re-attached",
        )

    def attach(self) -> None:
        """Re-attached to a service: journal again, from a snapshot of the live state."""
        if self.resume():
            self.log.warning("KVCR pool recovery enabled again", group=self.group)
        else:
            self._disabled()

    def snapshot(self) -> bytes:
        """The live state from the index's arrays, no object per block."""
        keys, slots = self._index.ready_records()
        g2 = journal.encode_flat(journal.PUT_G2, keys, slots, len(self._index.pools))
        g3 = journal.encode_snapshot((r.tier, key, r.values) for key, r in self._kept.items())
        return g2 + g3

    @property
    def fill_percent(self) -> float:
        return 100.0 * self.fill

    def committed(self, key: BlockKey, slots: tuple[int, ...]) -> None:
        if self.stopped:
            return
        if self._removed:
            self._drain()
        self._put_keys.append(key)
        self._put_slots.append(np.array([slots], dtype=np.uint64))

    def committed_many(self, keys: list[BlockKey], slots: np.ndarray) -> None:
        if self.stopped:
            return
        if self._removed:
            self._drain()
        self._put_keys.extend(keys)
        # One dtype for all: numpy would join uint64 and int64 arrays as float64.
        self._put_slots.append(np.asarray(slots, dtype=np.uint64))

    def removed(self, key: BlockKey) -> None:
        if self.stopped:
            return
        if self._put_keys:
            self._drain()
        self._removed.append(key)

    def removed_many(self, keys: list[BlockKey]) -> None:
        if self.stopped:
            return
        if self._put_keys:
            self._drain()
        self._removed.extend(keys)

    def _drain(self) -> None:
        if self._put_keys:
            slots = self._put_slots
            self.put_batch(self._put_keys, slots[0] if len(slots) == 1 else np.concatenate(slots))
            self._put_keys, self._put_slots = [], []
        if self._removed:
            self.remove_batch(self._removed)
            self._removed = []

    def flush(self) -> bool:
        if self.stopped:
            return False
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
            blocks=len(self._index),
            reason="the journal cannot hold a snapshot of the live state",
        )

    def close(self) -> None:
        """Publish what is buffered and let go of the journal's memory."""
        self.flush()
        self._buf.release()
        self._source.release()


@attrs.frozen(eq=False)
class Followed:
    """A journal replayed ahead of time: the index it built, the G3 records kept aside, and
    where a writer resumes (None: with a snapshot)."""

    index: BlockIndex
    g3: dict[BlockKey, journal.Residency]
    position: journal.Position | None


class Replayed:
    """A journal replayed into a block index: G2 puts become READY records (checked by
    :meth:`BlockIndex.put_recovered`), G3 residencies are kept aside for the file tier."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.g3: dict[BlockKey, journal.Residency] = {}
        self.skipped = 0  # G2 puts left out: the index then differs from the journal

    def put(self, tier: int, keys: journal.Keys, values: Sequence[int], count: int) -> None:
        # The one place replayed journal keys (raw bytes) become block keys: the keys that
        # were put, byte for byte.
        if tier == journal.PUT_G2:
            self.skipped += self.index.put_recovered(cast("list[BlockKey]", keys), values)
        else:
            for i, key in enumerate(cast("list[BlockKey]", journal.listed(keys))):
                self.g3[key] = journal.Residency(tier, tuple(values[i * count : (i + 1) * count]))

    def remove(self, op: int, keys: journal.Keys) -> None:
        if op == journal.REMOVE:
            self.index.forget_recovered(cast("list[BlockKey]", keys))
        else:
            for key in cast("list[BlockKey]", journal.listed(keys)):
                self.g3.pop(key, None)

    def __len__(self) -> int:
        return len(self.index)

    def followed(self, position: journal.Position | None) -> Followed:
        """What a runtime takes over, the journal having been replayed up to ``position``."""
        return Followed(self.index, self.g3, None if self.skipped else position)


def recover(
    index: BlockIndex, buf: memoryview, log: Any
) -> tuple[Replayed, journal.Position | None]:
    """Replay ``buf`` into ``index`` (empty): what was replayed, and where a writer can
    resume the journal (None when it must start over with a snapshot: the index differs
    from the journal, or recovery was disabled)."""
    replay = journal.read(buf, lambda: Replayed(index))
    replayed: Replayed = replay.state
    log.info(
        "recovered",
        blocks=len(index),
        g3_records=len(replayed.g3),
        skipped=replayed.skipped,
        epoch=replay.epoch,
        frames=replay.frames,
        disabled=replay.disabled,
    )
    return replayed, None if replayed.skipped else replay.position
