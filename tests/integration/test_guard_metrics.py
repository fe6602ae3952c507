"""``kvcr-guard --metrics-port``: a live service scraped over HTTP, parsed with
prometheus_client's own parser; a port in use or a bad flag."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_guard_service import Claimant, claim

from guard_metrics import group_value, metrics_url, scrape
from procs import GuardProcess, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def guard(tmp_path: Path) -> Iterator[GuardProcess]:
    service = GuardProcess(tmp_path, extra=("--idle-timeout-s", "0.5", "--metrics-port", "0"))
    yield service
    assert service.stop() == 0, service.log()


def test_a_scrape_shows_each_groups_state_holder_and_journal(guard) -> None:
    samples = scrape(metrics_url(guard))

    assert samples[("kvcr_guard_up", ())] == 1
    assert samples[("kvcr_guard_start_time_seconds", ())] > 1.7e9
    for group in (0, 1):
        assert group_value(samples, "kvcr_guard_group_state", group, state="idle") == 1
        assert group_value(samples, "kvcr_guard_group_state", group, state="held") == 0
        assert group_value(samples, "kvcr_guard_group_holder_present", group) == 0
        assert group_value(samples, "kvcr_guard_takeovers_total", group) == 0
        assert group_value(samples, "kvcr_guard_claims_granted_total", group) == 0


def test_claims_granted_refused_and_a_takeover_are_counted(guard) -> None:
    url = metrics_url(guard)
    holder = Claimant(guard)
    refused = Claimant(guard, index=1, digest="another-digest")
    refused.close()
    samples = scrape(url)
    assert group_value(samples, "kvcr_guard_group_state", 0, state="held") == 1
    assert group_value(samples, "kvcr_guard_group_holder_present", 0) == 1
    assert group_value(samples, "kvcr_guard_claims_granted_total", 0) == 1
    refusals = {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "kvcr_guard_claims_refused_total"
    }
    assert sum(refusals.values()) == 1, refusals

    holder.kill()
    guard.wait_free(0)
    wait_until(lambda: guard.states()[0][0] == "serving", 30, "the guard serving group 0")
    samples = scrape(url)
    assert group_value(samples, "kvcr_guard_group_state", 0, state="serving") == 1
    assert group_value(samples, "kvcr_guard_group_holder_present", 0) == 0
    assert group_value(samples, "kvcr_guard_takeovers_total", 0) == 1
    assert group_value(samples, "kvcr_guard_group_journal_blocks", 0) == 0

    claim(guard).release()  # hands the group back
    samples = scrape(url)
    assert group_value(samples, "kvcr_guard_handbacks_total", 0) == 1
    assert group_value(samples, "kvcr_guard_claims_granted_total", 0) == 2


def test_other_paths_and_methods_are_answered_with_an_error(guard) -> None:
    url = metrics_url(guard)
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=10)
    assert missing.value.code == 404
    request = urllib.request.Request(url, data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as posted:
        urllib.request.urlopen(request, timeout=10)
    assert posted.value.code == 405


def test_a_metrics_port_in_use_is_logged_and_the_service_keeps_lending(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        guard = GuardProcess(tmp_path, extra=("--metrics-port", str(port)))
        try:
            wait_until(lambda: "metrics_failed" in guard.log(), 30, "metrics_failed logged")
            assert f"--metrics-port {port}" in guard.log()
            claim(guard).release()  # the service still lends its pools
        finally:
            assert guard.stop() == 0, guard.log()


def test_a_metrics_port_out_of_range_is_a_flag_error(tmp_path) -> None:
    pool_dir = tmp_path / "pools"
    pool_dir.mkdir()
    run = subprocess.run(
        [
            *(sys.executable, "-m", "kvcr.kvcr_service"),
            *("--socket-path", str(tmp_path / "g.sock"), "--pool-dir", str(pool_dir)),
            *("--guard-count", "1", "--pool-sizes-gb", "0.001", "--compatibility-digest", "d"),
            *("--metrics-port", "70000"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert "--metrics-port must be in 0..65535, got 70000" in run.stderr
