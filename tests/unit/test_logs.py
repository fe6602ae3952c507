"""kvcr's logs: structlog events through stdlib logging, level from KVCR_LOG_LEVEL."""

from __future__ import annotations

import logging

import pytest

from kvcr import logs
from kvcr.logs import UtcFormatter


@pytest.fixture
def fresh_env_level(monkeypatch):
    """Let apply_env_level run again, and restore the kvcr logger afterwards."""
    logger = logging.getLogger("kvcr")
    level, handlers = logger.level, list(logger.handlers)
    monkeypatch.setattr(logs, "_env_applied", False)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_events_reach_stdlib_logging_rendered_as_event_and_fields(caplog):
    log = logs.get_logger("kvcr.test", agent="w0")
    with caplog.at_level(logging.INFO, logger="kvcr"):
        log.info("runtime_started", pools=["kv"])
    (record,) = [r for r in caplog.records if r.name == "kvcr.test"]
    assert record.levelno == logging.INFO
    assert record.getMessage() == "runtime_started agent='w0' pools=['kv']"


def test_kvcr_log_level_sets_the_kvcr_logger_level(monkeypatch, fresh_env_level, caplog):
    monkeypatch.setenv("KVCR_LOG_LEVEL", "error")
    log = logs.get_logger("kvcr.test")
    assert fresh_env_level.level == logging.ERROR
    log.warning("dropped")
    log.error("kept")
    assert [r.getMessage() for r in caplog.records if r.name == "kvcr.test"] == ["kept"]


def test_an_unknown_kvcr_log_level_names_the_variable(monkeypatch, fresh_env_level):
    monkeypatch.setenv("KVCR_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="KVCR_LOG_LEVEL: unknown level 'loud'"):
        logs.get_logger("kvcr.test")


def test_capture_events_sees_events_at_every_level(fresh_env_level):
    fresh_env_level.setLevel(logging.CRITICAL)
    with logs.capture_events() as events:
        logs.get_logger("kvcr.test").debug("quiet_event", n=1)
    assert events == [{"event": "quiet_event", "n": 1, "log_level": "debug"}]


def test_kvcrs_own_handlers_stamp_lines_in_utc_with_microseconds(monkeypatch) -> None:
    monkeypatch.setenv("TZ", "America/New_York")  # the host's zone must not leak in
    record = logging.LogRecord("kvcr.x", logging.INFO, __file__, 1, "ev k=1", None, None)
    record.created = 1_764_960_000.123456  # 2025-12-05T18:40:00.123456Z
    line = UtcFormatter().format(record)
    assert line == "2025-12-05T18:40:00.123456Z INFO kvcr.x ev k=1"
