"""A lease's heartbeats as the service sees them (pure: no sockets, clocks passed in).

Theory of operation. With ``kvcr-guard --heartbeat-timeout-ms N`` a grant tells the holder
to beat every :data:`BEAT_MS` on the claim's connection, which stays open for the lease's
life. The beats come from the holder's runtime thread (a thread of the hold's own until the
runtime runs), so they prove that the process is scheduled and that its runtime's loop
turns; whether the engine's own threads make progress is the engine's business. The grant
counts as the first beat: a holder is fenced once ``N`` ms pass with no accepted beat.

A beat is *accepted* when its sequence number is above every earlier one and it comes at
least :data:`MIN_GAP_S` after the last accepted beat; anything else changes nothing and is
counted by kind (``duplicate``: a number already seen, ``early``: a flood faster than any
holder beats). So a malformed or hostile stream can never keep a silent holder's lease
alive for longer than one real beat does, nor cost the service more than a frame decode.
"""

from __future__ import annotations

import attrs

from kvcr.statetable import StrEnum

BEAT_MS = 50  # how often a holder beats (the grant says so)
MIN_TIMEOUT_MS = 1000  # below this, scheduling noise on a loaded host would fence live workers
MIN_GAP_S = 0.010  # beats closer than this are a flood, not a sign of life


class Verdict(StrEnum):
    """What became of one beat; the value labels ``kvcr_guard_heartbeats_refused``."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    EARLY = "early"


@attrs.define
class Beats:
    """One lease's heartbeats: when the last accepted one came, and the highest number."""

    timeout_s: float
    last: float  # the grant, then each accepted beat (the service's monotonic clock)
    seq: int = -1

    @property
    def deadline(self) -> float:
        return self.last + self.timeout_s

    def beat(self, seq: int, now: float) -> Verdict:
        if seq <= self.seq:
            return Verdict.DUPLICATE
        if now - self.last < MIN_GAP_S:
            return Verdict.EARLY
        self.seq, self.last = seq, now
        return Verdict.ACCEPTED

    def missed(self, now: float) -> float | None:
        """Seconds since the last accepted beat, once past the deadline; else None."""
        silent = now - self.last
        return silent if silent >= self.timeout_s else None
