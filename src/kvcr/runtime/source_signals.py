"""What a source says about each pull it serves: the pull's block funnel at this side, its
phase timers, its span, and the log events that carry its transfer id (``xfer=``).

``source.py`` decides; this module only reports, so that the serving code reads as the
protocol and every signal of one pull is in one place. The destination's side of the same
signals is in ``destination.py``; ``docs/operations.md`` lists them all.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcr.runtime.lifecycle import SourceJob
from kvcr.telemetry import FUNNEL_HELD, FUNNEL_RESIDENT, FUNNEL_SUBMITTED, Telemetry


class SourceSignals:
    def __init__(self, telemetry: Telemetry, log: Any) -> None:
        self.telemetry = telemetry
        self.log = log

    def started(self, job: SourceJob) -> None:
        """A pull became a job: its phases are kept for its span when tracing is on."""
        if self.telemetry.tracing is not None:
            job.phases = []

    def phase(self, job: SourceJob, name: str, start: float, end: float, result: str) -> None:
        """One timed phase of the job (``framework_pin_wait``, ``transfer_post``, ...), on
        the runtime's clock: a duration sample, and a child span of the job's span."""
        self.telemetry.record(name, end - start, result)
        if job.phases is not None:
            job.phases.append((name, start, end, None))

    def held(self, job: SourceJob) -> None:
        """The funnel's source stages before the write: found, then held for it."""
        self.telemetry.count(FUNNEL_RESIDENT, job.found + len(job.pinned_keys))
        self.telemetry.count(FUNNEL_HELD, job.held)

    def submitted(self, keys: int) -> None:
        self.telemetry.count(FUNNEL_SUBMITTED, keys)

    def write_ended(self, job: SourceJob, now: float, ok: bool, keys: int, nbytes: int) -> None:
        """The NIXL write is terminal: ``transfer`` (its posting to now) and ``source_write``
        (the pull's arrival to now, with what it moved), and ``pull_written`` (debug)."""
        assert job.write_clock is not None  # set when it was posted
        result = "success" if ok else "failed"
        self.phase(job, "transfer", job.write_clock.start, now, result)
        moved = (keys, nbytes) if ok else (0, 0)
        self.telemetry.record("source_write", now - job.clock.start, result, *moved)
        if ok:
            job.written = keys
            if self.log.isEnabledFor(logging.DEBUG):
                self.log.debug(
                    "pull_written",
                    xfer=job.transfer_id,
                    resident=job.found + len(job.pinned_keys),
                    held=job.held,
                    keys=keys,
                    bytes=nbytes,
                    seconds=round(now - job.clock.start, 6),
                )

    def write_failed(self, job: SourceJob, keys: int, reason: str) -> None:
        """Why the write failed, with the funnel as far as it got (the destination's
        op_failed repeats the reason, and its pull_partial carries the same xfer)."""
        self.log.warning(
            "source_write_failed",
            to=job.agent,
            endpoint=job.msg.sender,
            xfer=job.transfer_id,
            resident=job.found + len(job.pinned_keys),
            held=job.held,
            keys=keys,
            reason=reason,
        )

    def ended(self, job: SourceJob, now: float, reason: str | None) -> None:
        """The job is over: a pull that ended unwritten (never posted) is a failed
        ``source_write``; the job's span, ``kvcr.source_write``, from the pull's arrival,
        under the destination's transfer id, failed with ``reason`` if one is given."""
        if job.write_clock is None:
            self.telemetry.record("source_write", now - job.clock.start, "failed")
        tracing = self.telemetry.tracing
        if tracing is None:
            return
        attributes: dict[str, str | int] = {
            "kvcr.xfer": job.transfer_id,
            "kvcr.peer": job.agent,
            "kvcr.keys": len(job.keys),
            "kvcr.resident": job.found + len(job.pinned_keys),
            "kvcr.held": job.held,
            "kvcr.written": job.written,
        }
        tracing.emit("kvcr.source_write", job.clock.start, attributes, job.phases or (), reason)
