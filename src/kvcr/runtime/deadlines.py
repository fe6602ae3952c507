"""The two deadlines of everything that can outlive its caller's patience.

``operation_timeout_ms`` answers the caller; ``abandon_timeout_ms`` is when memory a transfer
still holds is reported. Both are measured from one start: an operation's (restarted once a
first contact's link is ready), a pull's arrival at a source, or a source write's posting.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Deadlines:
    """The two deadlines of an operation (or of a source's pull), both measured from one
    start: ``operation_timeout_ms`` answers the caller, ``abandon_timeout_ms`` is when
    memory a transfer still holds is reported. Every deadline of an operation or a pull is
    computed here."""

    start: float
    deadline: float
    abandon_at: float

    @classmethod
    def starting(cls, start: float, config: Any) -> Deadlines:
        return cls(
            start,
            start + config.operation_timeout_ms / 1000,
            start + config.abandon_timeout_ms / 1000,
        )
