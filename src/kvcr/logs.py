"""Structured logging: structlog events with stable names, level from ``KVCR_LOG_LEVEL``.

kvcr lives inside an engine process that owns logging, so the library never reconfigures
structlog globally. It wraps its own loggers with a level filter taken from
``KVCR_LOG_LEVEL`` (default ``WARNING`` for the library, the service sets its own) and
otherwise renders through whatever structlog configuration the process has.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import structlog

_LEVELS = {
    "CRITICAL": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
}


def level_from_env(default: str = "WARNING") -> int:
    """The level named by ``KVCR_LOG_LEVEL``; an unknown name is a ValueError naming it."""
    name = os.environ.get("KVCR_LOG_LEVEL", default).strip().upper()
    try:
        return _LEVELS[name]
    except KeyError:
        raise ValueError(
            f"KVCR_LOG_LEVEL: unknown level {name!r}, expected one of {sorted(_LEVELS)}"
        ) from None


def get_logger(name: str, **context: Any) -> Any:
    """A structlog logger for ``name`` that drops events below ``KVCR_LOG_LEVEL``."""
    level = level_from_env()

    def drop_below_level(_logger: Any, method: str, event: dict) -> dict:
        if _LEVELS.get(method.upper(), logging.INFO) < level:
            raise structlog.DropEvent
        return event

    processors = [drop_below_level, *structlog.get_config()["processors"]]
    return structlog.wrap_logger(None, processors=processors, logger_name=name, **context)
