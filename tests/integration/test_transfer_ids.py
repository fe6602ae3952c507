"""One transfer id in both workers' logs: the destination mints it (its incarnation and the
pull's request number, carried in the pull), and every event of that transfer on either
side says ``xfer=...``; kvcr's own log lines are stamped in UTC with microseconds, so two
hosts' logs can be joined on the id and ordered by time. Two real worker processes."""

from __future__ import annotations

import datetime
import re

import pytest

from procs import SourceWorker
from soak import BLOCK

pytestmark = pytest.mark.integration

SIZES = (BLOCK, 16, 64)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z) (DEBUG|INFO|WARNING|ERROR) ")


def events(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if f" {name} " in line]


def xfer_of(line: str) -> str:
    found = re.search(r"xfer='([0-9a-f]{16}\.\d+)'", line)
    assert found, line
    return found.group(1)


def test_a_partial_pull_is_one_id_in_the_destinations_and_the_sources_logs(tmp_path) -> None:
    env = {"KVCR_LOG_LEVEL": "DEBUG"}
    logs = {name: tmp_path / f"{name}.log" for name in ("source", "destination")}
    source = SourceWorker("src", SIZES, env=env, log=logs["source"])
    destination = SourceWorker("dst", SIZES, env=env, log=logs["destination"])
    try:
        assert set(source("soak_deposit", [1, 2], False).values()) == {"SUCCESS"}
        result = destination("soak_deliver", [1, 2, 3], source.endpoint)  # 3: nobody has it
        assert {k: s for k, (s, _) in result["entries"].items()} == {
            1: "SUCCESS",
            2: "SUCCESS",
            3: "FAILED",
        }
    finally:
        source.stop()
        destination.stop()
    theirs, ours = logs["source"].read_text(), logs["destination"].read_text()
    [sent] = events(ours, "pull_sent")
    [failed] = events(ours, "op_failed")
    [written] = events(theirs, "pull_written")
    xfer = xfer_of(sent)
    assert xfer_of(failed) == xfer == xfer_of(written)
    assert "the source lacked 1 of the keys" in failed
    # Every line kvcr wrote starts with the same kind of stamp: UTC, microseconds.
    for text in (theirs, ours):
        stamped = [line for line in text.splitlines() if " kvcr" in line]
        assert stamped and all(STAMP.match(line) for line in stamped), stamped[:3]
    when = [
        datetime.datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
        for line in (sent, written, failed)
    ]
    assert when == sorted(when)  # sent, then written at the source, then answered
