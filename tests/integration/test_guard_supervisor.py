"""The guard service's supervisor: a failing Guard stops the whole service, which then
exits non-zero, logs why, and still removes its files (the service run in this process)."""

from __future__ import annotations

import logging

import pytest

from kvcr.guard import cli
from kvcr.guard.guard import Guard
from kvcr.logs import capture_events

pytestmark = pytest.mark.integration


def test_a_failing_guard_stops_the_service_with_a_nonzero_exit(tmp_path, monkeypatch) -> None:
    real_run = Guard.run

    async def run(self: Guard) -> None:
        if self.index == 1:
            raise OSError("pidfd watch broke")
        await real_run(self)

    monkeypatch.setattr(Guard, "run", run)
    kvcr_logger = logging.getLogger("kvcr")  # the program configures it: restore it after
    monkeypatch.setattr(kvcr_logger, "handlers", list(kvcr_logger.handlers))
    monkeypatch.setattr(kvcr_logger, "propagate", kvcr_logger.propagate)
    monkeypatch.setattr(kvcr_logger, "level", kvcr_logger.level)
    (tmp_path / "pools").mkdir()
    argv = [
        "--socket-path",
        str(tmp_path / "g.sock"),
        "--pool-dir",
        str(tmp_path / "pools"),
        "--guard-count",
        "2",
        "--pool-sizes-gb",
        "0.001",
        "--compatibility-digest",
        "d",
    ]
    with capture_events() as events:
        assert cli.main(argv) == 1

    names = [e["event"] for e in events]
    failed = next(e for e in events if e["event"] == "guard_failed")
    assert failed["group"] == 1 and "pidfd watch broke" in failed["error"]
    assert names.index("guard_failed") < names.index("service_stopped")
    assert "service_failed" in names
    assert list((tmp_path / "pools").iterdir()) == []
    assert not (tmp_path / "g.sock").exists()
