"""Staging a pull's G3 keys in bounce slots (``bounce.py``), for the source to write them.

The source (``source.py``) serves a pull's keys from local G2 (claimed), from G3 (staged
here) and from engine pins, in one write. For the keys that only G3 holds, this lends
bounce slots and reads the blocks into them with the G3 tier's read, which checks each
slot's on-disk record after the copy (``runtime/g3.py``): a file deleted, truncated,
replaced or rewritten under the read makes its keys misses, never wrong bytes to a peer.

The read is part of the pull's ``pending`` state (``lifecycle.JOB``), under the same
deadline as its pins (``operation_timeout_ms`` from the pull's arrival). The slots are the
job's until the job is over *and* the read is terminal, whichever comes last: a job that
gives up while its read runs leaves the slots to the read's completion, and the write
that sends them out ends before the job does.
"""

from __future__ import annotations

from typing import Any

from kvcr.runtime.bounce import BounceSlots
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.lifecycle import JobState, SourceJob
from kvcr.runtime.transfers import Xfer
from kvcr.telemetry import SCOPE_G3_SERVE
from kvcr.types import BlockKey


class Staging:
    def __init__(self, *, g3: G3Tier, slots: BounceSlots, log: Any) -> None:
        self.g3 = g3
        self.slots = slots
        self.log = log
        self.short = 0  # G3 keys turned away because every bounce slot was lent

    def wanted(self, job: SourceJob, found: dict[int, list[int]]) -> list[int]:
        """The indices of the pull's keys that ``found`` lacks and G3 holds, ready."""
        g3, keys = self.g3, job.keys
        return [i for i in range(len(keys)) if i not in found and keys[i] in g3]

    def read(self, job: SourceJob, indices: list[int]) -> Xfer | None:
        """Lend bounce slots to the keys at ``indices`` (as many as are free) and start
        reading them from G3. Once the read is terminal, ``job.staged`` maps each index
        whose bytes arrived and were vouched for to its bounce descriptor. Returns the read
        still in flight, or None once it is over (or nothing was read)."""
        descs = self.slots.take(len(indices))
        if len(descs) < len(indices):
            self.short += len(indices) - len(descs)
            self.log.info(
                "bounce_slots_short",
                xfer=job.transfer_id,
                g3_keys=len(indices),
                lent=len(descs),
                reason="every bounce slot is lent to other pulls; the rest are misses",
            )
        if not descs:
            return None
        pairs = list(zip(indices, descs))
        job.bounce = descs
        job.reading = True
        keys = job.keys

        def then(_xfer: Xfer | None, got: set[BlockKey]) -> None:
            job.reading = False
            job.staged = {i: d for i, d in pairs if keys[i] in got}
            if job.state is JobState.OVER:  # the job gave up meanwhile: nothing writes them
                self.release(job)

        what = f"source read {job.transfer_id} for {job.agent}"
        return self.g3.read([(keys[i], d) for i, d in pairs], what, then, SCOPE_G3_SERVE)

    def release(self, job: SourceJob) -> None:
        """The job is over: its bounce slots are free again, unless its read still runs
        (then the read's completion frees them)."""
        if job.bounce and not job.reading:
            self.slots.give(job.bounce)
            job.bounce = []
