"""Structured logging: structlog events with stable names, written through stdlib logging.

kvcr lives inside an engine process that owns logging, so it never reconfigures structlog
or the root logger. Each event is rendered as ``event key=value ...`` and handed to the
stdlib logger ``kvcr.<module>``, so it lands wherever the engine sends its logs.

``KVCR_LOG_LEVEL`` sets the level of the ``kvcr`` logger. When it is set and nothing in the
process has configured logging, kvcr adds one stderr handler so that the operator who asked
for the logs sees them. Handlers kvcr installs itself (that one, and ``kvcr-guard``'s) stamp
each line in UTC with microseconds (:class:`UtcFormatter`), so that the logs of two hosts
line up; every event of a peer transfer carries its id (``xfer=``) on both sides.

:func:`capture_events` records events as dicts (with ``event`` and ``log_level``), whatever
the level: tests use it to check what was logged.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

_LEVELS = {
    "CRITICAL": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
}
_taps: list[list[dict[str, Any]]] = []
_configured = threading.Lock()
_env_applied = False


def parse_level(name: str) -> int:
    """A level name (case-insensitive); an unknown name is a ValueError naming it."""
    try:
        return _LEVELS[name.strip().upper()]
    except KeyError:
        raise ValueError(
            f"KVCR_LOG_LEVEL: unknown level {name!r}, expected one of {sorted(_LEVELS)}"
        ) from None


def apply_env_level() -> None:
    """Apply ``KVCR_LOG_LEVEL`` to the ``kvcr`` logger (once per process)."""
    global _env_applied  # noqa: PLW0603 - a process-wide, once-only setting
    with _configured:
        if _env_applied:
            return
        _env_applied = True
        name = os.environ.get("KVCR_LOG_LEVEL")
        if not name:
            return
        logger = logging.getLogger("kvcr")
        logger.setLevel(parse_level(name))
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(UtcFormatter())
            logger.addHandler(handler)


class UtcFormatter(logging.Formatter):
    """``2026-12-05T18:37:29.642123Z LEVEL logger event key=value ...``: ISO 8601 in UTC
    with microseconds, whatever the host's time zone."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _tap(_logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    for tap in _taps:
        tap.append({**event, "log_level": method})
    return event


def _render(_logger: WrappedLogger, _method: str, event: EventDict) -> str:
    name = event.pop("event", "")
    fields = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in event.items())
    return f"{name} {fields}" if fields else str(name)


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger writing to the stdlib logger ``name``, bound to ``context``."""
    apply_env_level()
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            _tap,
            structlog.stdlib.filter_by_level,
            structlog.processors.format_exc_info,
            _render,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        **context,
    )


@contextlib.contextmanager
def capture_events() -> Iterator[list[dict[str, Any]]]:
    """Record every kvcr event emitted inside the block, at any level."""
    tap: list[dict[str, Any]] = []
    _taps.append(tap)
    try:
        yield tap
    finally:
        _taps.remove(tap)
