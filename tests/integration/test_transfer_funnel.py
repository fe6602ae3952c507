"""The block funnel of a peer pull on two real worker processes: each reduction provoked
(a key the source lacks, a key its engine cannot pin, a destination that gives up while the
source waits on its engine), each side's ``kvcr_transfer_blocks`` stages counted, the
destination's one ``pull_partial`` event joined to the source's log by its transfer id, and
each side's phase timers on the success and the failure path. A write that fails (the link
cut mid-write), and a partial pull across two network namespaces, are in test_two_hosts.py."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from procs import SourceWorker
from soak import BLOCK, OPERATION_TIMEOUT_S

pytestmark = pytest.mark.integration

SIZES = (BLOCK, 16, 64)
STAGES = ("peer_planned", "peer_resident", "peer_held", "peer_submitted")
STAGES += ("peer_completed", "peer_published")


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[SourceWorker, SourceWorker, dict]]:
    env = {"KVCR_LOG_LEVEL": "DEBUG", "KVCR_TEST_SPANS": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in ("source", "destination")}
    source = SourceWorker("src", SIZES, env=env, log=logs["source"])
    destination = SourceWorker("dst", SIZES, env=env, log=logs["destination"])
    try:
        yield source, destination, logs
    finally:
        source.stop()
        destination.stop()


def funnel(worker: SourceWorker) -> dict[str, float]:
    counters = worker("counters")
    return {stage: counters.get(f"kvcr_transfer_blocks{{{stage}}}", 0) for stage in STAGES}


def phases(worker: SourceWorker) -> dict[str, list[float]]:
    """The worker's kvcr_duration_seconds samples so far, by "scope,result"."""
    samples = worker("durations")
    assert all(0 <= v < 60 for values in samples.values() for v in values), samples
    return samples


def field(line: str, name: str) -> str:
    found = re.search(rf" {name}=('[^']*'|\S+)", line)
    assert found, (name, line)
    return found.group(1).strip("'")


def test_a_lacked_key_and_an_unpinnable_one_show_where_the_blocks_went(pair) -> None:
    source, destination, logs = pair
    assert set(source("soak_deposit", [1, 2], False).values()) == {"SUCCESS"}  # in G2
    source("engine_has", [(3, 20, 3)])  # only its engine holds 3; nobody holds 4
    result = destination("soak_deliver", [1, 2, 3, 4], source.endpoint)
    statuses = {k: s for k, (s, _) in result["entries"].items()}
    assert statuses == {1: "SUCCESS", 2: "SUCCESS", 3: "SUCCESS", 4: "FAILED"}
    mine, theirs = funnel(destination), funnel(source)
    assert (mine["peer_planned"], mine["peer_completed"], mine["peer_published"]) == (4, 3, 3)
    # The source found 2 in G2 and its engine pinned 1 of the 2 it was asked for.
    assert (theirs["peer_resident"], theirs["peer_held"], theirs["peer_submitted"]) == (3, 3, 3)
    [partial] = [
        ln for ln in logs["destination"].read_text().splitlines() if " pull_partial " in ln
    ]
    assert [field(partial, k) for k in ("planned", "completed", "published")] == ["4", "3", "3"]
    xfer = field(partial, "xfer")
    [written] = [ln for ln in logs["source"].read_text().splitlines() if " pull_written " in ln]
    assert field(written, "xfer") == xfer
    assert [field(written, k) for k in ("resident", "held", "keys")] == ["3", "3", "3"]
    # Every phase of the pull, each on the side that lives it, on that side's own clock.
    mine, theirs = phases(destination), phases(source)
    assert {
        "peer_setup,success",  # the first contact (destination)
        "hint_age,partial",  # the router's hint, submitted -> used
        "control_hello_ack,success",
        "control_written,success",  # the notification's handling
        "notification,success",  # the source's completion -> the destination has the word
        "remote_deliver,partial",  # the whole operation
    } <= set(mine)
    assert {
        "control_hello,success",
        "control_pull,success",
        "framework_pin_wait,success",  # the engine pinned key 3 (and had no key 4)
        "transfer_post,success",
        "transfer,success",
        "source_write,success",
    } <= set(theirs)
    # The same pull in OpenTelemetry, where the process has it: one span on each worker,
    # joined by the transfer id, the phases as children.
    [deliver] = [s for s in destination("spans") if s["name"] == "kvcr.deliver"]
    [write] = [s for s in source("spans") if s["name"] == "kvcr.source_write"]
    assert deliver["attributes"]["kvcr.xfer"] == write["attributes"]["kvcr.xfer"] == xfer
    assert not deliver["ok"] and write["ok"]  # the deliver failed key 4; the write did not
    assert {"pull", "notification"} <= {
        s["name"] for s in destination("spans") if s["parent"] == "kvcr.deliver"
    }
    assert {"framework_pin_wait", "transfer_post", "transfer"} == {
        s["name"] for s in source("spans") if s["parent"] == "kvcr.source_write"
    }


def test_a_destination_that_gives_up_publishes_nothing_and_says_so(pair) -> None:
    source, destination, logs = pair
    source("engine_has", [(7, 21, 7)])
    source("hold_pins", True)  # the source's engine never answers the pin
    try:
        result = destination("soak_deliver", [7], source.endpoint)
    finally:
        source("hold_pins", False)
    assert {k: s for k, (s, _) in result["entries"].items()} == {7: "FAILED"}
    mine = funnel(destination)
    assert (mine["peer_planned"], mine["peer_completed"], mine["peer_published"]) == (1, 0, 0)
    [partial] = [
        ln for ln in logs["destination"].read_text().splitlines() if " pull_partial " in ln
    ]
    assert [field(partial, k) for k in ("planned", "completed", "published")] == ["1", "0", "0"]
    # Nothing was submitted at the source: its write never started.
    assert funnel(source)["peer_submitted"] == 0
    # The failure path of the same phases: the destination waited its whole operation
    # deadline for a word that never came; the source's pin wait was cut short by the
    # destination's cancel, so its handling of the pull ended unwritten.
    mine, theirs = phases(destination), phases(source)
    assert {"hint_age,failed", "notification,failed", "remote_deliver,failed"} <= set(mine)
    [waited], [whole] = mine["notification,failed"], mine["remote_deliver,failed"]
    # The wait runs from the pull's sending to the moment the operation stopped waiting:
    # at its deadline (worker_proc's: 2 s from the deliver) or a scheduler's step after it,
    # so it is bounded by the whole operation, not by 2 s, and falls short of the deadline
    # by the first contact at most (a few ms on loopback; 0.5 s is generous).
    assert whole >= OPERATION_TIMEOUT_S
    assert OPERATION_TIMEOUT_S - 0.5 <= waited <= whole
    assert {"control_pull,success", "control_probe,success"} <= set(theirs)
    assert {"framework_pin_wait,failed", "source_write,failed"} <= set(theirs)
    assert not any(label.startswith("transfer") for label in theirs)  # nothing was posted
