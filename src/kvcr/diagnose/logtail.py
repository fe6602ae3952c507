"""The last minutes of a log file, read backwards from its end (a log of days is never
loaded whole): the records stamped within ``minutes`` of the file's last stamp.

A record starts at a line that opens with a timestamp; the lines after it without one (a
traceback, a wrapped message) belong to it. Two stamps are read: logging's ``asctime``
(``2026-12-05 18:37:29,642``, local time, what kvcr writes today) and ISO 8601
(``2026-12-05T18:37:29.642123Z``; without a zone it is local time too), so one file may
mix them while a deployment moves from one to the other.

The window ends at the file's last stamp, not at the clock: an engine that died an hour
ago left its last minutes at the end of its log, and those are what a ticket needs.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import attrs

#: The most a tail carries: a chatty DEBUG log must not make the bundle unmailable.
MAX_BYTES = 32 * 2**20
_BLOCK = 2**16
_STAMP = re.compile(
    rb"\[?(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?"
    rb"(Z|[+-]\d{2}:?\d{2})?(?![\d:])"
)


def stamp(line: bytes) -> datetime.datetime | None:
    """The moment a line opens with (aware), or None when it does not open with one."""
    match = _STAMP.match(line)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, zone = match[7], match[8]
    micros = int(fraction.ljust(6, b"0")[:6]) if fraction else 0
    try:
        moment = datetime.datetime(year, month, day, hour, minute, second, micros)
    except ValueError:  # 2026-13-45: a number that looks like a stamp, not a stamp
        return None
    if zone is None:
        return moment.astimezone()  # naive: local time, as logging's asctime writes it
    if zone == b"Z":
        return moment.replace(tzinfo=datetime.timezone.utc)
    sign = -1 if zone[:1] == b"-" else 1
    digits = zone[1:].replace(b":", b"")
    offset = datetime.timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    return moment.replace(tzinfo=datetime.timezone(sign * offset))


@attrs.frozen
class LogTail:
    """``data``: whole lines, as they are in the file. ``first``/``last``: the stamps of the
    first and last record in it (None without any). ``truncated``: :data:`MAX_BYTES` ended
    the read before the window's start. ``scanned_bytes``: how much of the file was read."""

    data: bytes
    lines: int
    first: datetime.datetime | None
    last: datetime.datetime | None
    file_bytes: int
    scanned_bytes: int
    truncated: bool

    def record(self) -> dict[str, object]:
        return {
            "lines": self.lines,
            "bytes": len(self.data),
            "first_stamp": self.first.isoformat() if self.first else None,
            "last_stamp": self.last.isoformat() if self.last else None,
            "file_bytes": self.file_bytes,
            "scanned_bytes": self.scanned_bytes,
            "truncated": self.truncated,
        }


def tail(
    path: str | Path, minutes: float, *, max_bytes: int = MAX_BYTES, block: int = _BLOCK
) -> LogTail:
    """The records of ``path`` stamped within ``minutes`` of its last stamp (OSError if it
    cannot be read). A file without stamps gives its last ``max_bytes``."""
    if minutes <= 0:
        raise ValueError(f"log tail: minutes must be positive, got {minutes}")
    kept: list[bytes] = []  # whole lines, last first
    start = 0  # len(kept) when the earliest record in the window was kept
    last: datetime.datetime | None = None
    first: datetime.datetime | None = None
    cutoff: datetime.datetime | None = None
    kept_bytes = 0
    truncated = done = False
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        pos = size
        pending = b""  # the start of a line whose beginning is in the next block back
        while pos > 0 and not done:
            step = min(block, pos)
            pos -= step
            file.seek(pos)
            chunk = file.read(step) + pending
            lines = chunk.splitlines(keepends=True)
            # The first piece may be the end of a line that began further back.
            pending = lines.pop(0) if pos > 0 and lines else b""
            for line in reversed(lines):
                moment = stamp(line)
                if moment is not None:
                    if last is None:
                        last = moment
                        cutoff = moment - datetime.timedelta(minutes=minutes)
                    elif cutoff is not None and moment < cutoff:
                        done = True  # the record before the window: the lines after it are its own
                        break
                if kept_bytes + len(line) > max_bytes:
                    truncated = done = True
                    break
                kept.append(line)
                kept_bytes += len(line)
                if moment is not None:
                    start, first = len(kept), moment
        scanned = size - pos
    # Ended at an older record or at the size limit: start at a record's first line (lines
    # before it belong to a record not in the tail). Reached the file's start: keep it all.
    if (done or truncated) and start:
        kept = kept[:start]
    data = b"".join(reversed(kept))
    return LogTail(data, len(kept), first, last, size, scanned, truncated)
