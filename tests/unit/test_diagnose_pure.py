"""kvcr diagnose's pure pieces: the result model, the two renderings, and the small rules
the checks apply (UCX_NET_DEVICES and UCX_TLS values, secrets, install locations)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from kvcr.diagnose import environment, netif
from kvcr.diagnose.control import endpoint_url
from kvcr.diagnose.render import FORMAT, RunInfo, document, to_json, to_text
from kvcr.diagnose.result import CheckResult, Report, Status
from kvcr.diagnose.versions import expected_package_dirs

RUN = RunInfo(
    kvcr_version="0.1.0",
    hostname="box",
    created_utc="2026-01-01T00:00:00+00:00",
    duration_s=1.23456,
    argv=("diagnose", "--json"),
)


def sample() -> Report:
    return Report(
        [
            CheckResult.ok("python", "3.11.7", {"version": "3.11.7"}),
            CheckResult.warn("ucx_host", "eth0 left out", "set UCX_NET_DEVICES=lo,eth0"),
            CheckResult.skipped("guard", "no --guard-socket given"),
        ]
    )


# -- result model ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.WARN, Status.FAIL])
def test_a_warning_or_failure_must_name_a_fix(status: Status) -> None:
    with pytest.raises(ValueError, match="needs a fix"):
        CheckResult("x", status, "broken")


def test_exit_code_and_outcome_follow_the_worst_check() -> None:
    ok = CheckResult.ok("a", "fine")
    warn = CheckResult.warn("b", "meh", "do this")
    fail = CheckResult.fail("c", "bad", "do that")
    skipped = CheckResult.skipped("d", "not asked")
    assert (Report([ok, skipped]).exit_code, Report([ok, skipped]).outcome) == (0, "ok")
    assert (Report([ok, warn]).exit_code, Report([ok, warn]).outcome) == (0, "warn")
    assert (Report([warn, fail]).exit_code, Report([warn, fail]).outcome) == (1, "fail")
    assert Report([ok, warn, fail, skipped]).counts() == {
        "ok": 1,
        "warn": 1,
        "fail": 1,
        "skipped": 1,
    }


def test_check_names_are_unique() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Report([CheckResult.ok("a", "x"), CheckResult.ok("a", "y")])


# -- rendering ---------------------------------------------------------------------------------


def test_json_document_has_stable_keys_and_checks_by_name() -> None:
    doc = json.loads(to_json(sample(), RUN))
    assert list(doc) == [
        "format",
        "kvcr_version",
        "hostname",
        "created_utc",
        "duration_s",
        "argv",
        "outcome",
        "exit_code",
        "counts",
        "checks",
    ]
    assert doc["format"] == FORMAT
    assert doc["duration_s"] == 1.235
    assert list(doc["checks"]) == ["python", "ucx_host", "guard"]
    assert doc["checks"]["ucx_host"] == {
        "status": "warn",
        "summary": "eth0 left out",
        "fix": "set UCX_NET_DEVICES=lo,eth0",
        "details": {},
    }
    assert (doc["outcome"], doc["exit_code"]) == ("warn", 0)


def test_json_survives_values_that_are_not_json() -> None:
    report = Report([CheckResult.ok("a", "x", {"path": Path("/tmp/x")})])
    assert json.loads(to_json(report, RUN))["checks"]["a"]["details"] == {"path": "/tmp/x"}
    assert document(report, RUN)["checks"]["a"]["details"]["path"] == Path("/tmp/x")


def test_text_is_an_aligned_table_with_fixes_and_extra_lines() -> None:
    report = Report(
        [
            *sample().checks,
            CheckResult("guard2", Status.OK, "2 groups", extra=("group  state", "0      idle")),
        ]
    )
    lines = to_text(report, RUN).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("check"))
    rows = lines[header : header + 5]
    assert [row.split()[0] for row in rows] == ["check", "python", "ucx_host", "guard", "guard2"]
    status_column = rows[0].index("status")
    assert all(
        row[status_column:].split()[0] in {"status", "ok", "warn", "skipped"} for row in rows
    )
    assert "  ucx_host (warn): set UCX_NET_DEVICES=lo,eth0" in lines
    assert lines[lines.index("guard2:") + 1 :][:2] == ["  group  state", "  0      idle"]
    assert lines[-1] == "result: warn (2 ok, 1 warn, 0 fail, 1 skipped); exit code 0"


# -- rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "device", "included"),
    [
        (None, "eth0", True),
        ("all", "eth0", True),
        ("lo", "eth0", False),
        ("lo", "lo", True),
        ("lo,eth0", "eth0", True),
        ("eth*", "eth0", True),
        ("^lo", "eth0", True),
        ("^lo,eth0", "eth0", False),
        ("mlx5_0:1,eth0", "eth0", True),
    ],
)
def test_net_devices_include(value: str | None, device: str, included: bool) -> None:
    assert environment.net_devices_include(value, device) is included


@pytest.mark.parametrize(
    ("tls", "status"),
    [("tcp,cma", Status.OK), ("all", Status.OK), ("^ib", Status.OK), ("sm,self", Status.FAIL)],
)
def test_ucx_tls_without_tcp_fails(
    monkeypatch: pytest.MonkeyPatch, tls: str, status: Status
) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    result = environment.check({})
    assert result.status is status
    if status is Status.FAIL:
        assert result.fix is not None
        assert "UCX_TLS" in result.fix


def test_empty_ucx_tls_fails_and_chatty_nixl_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "")
    assert environment.check({}).status is Status.FAIL
    monkeypatch.delenv("UCX_TLS")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "INFO")
    result = environment.check({})
    assert result.status is Status.WARN
    assert result.fix is not None
    assert "NIXL_LOG_LEVEL=WARN" in result.fix


def test_defaults_never_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    monkeypatch.delenv("UCX_MEM_EVENTS", raising=False)
    applied = environment.apply_defaults()
    assert "UCX_NET_DEVICES" not in applied
    assert applied["UCX_MEM_EVENTS"] == "no"


def test_secrets_stay_out_of_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCR_CLUSTER_KEY", "0123456789abcdef-secret")
    shown = environment.reported()["KVCR_CLUSTER_KEY"]
    assert "secret" not in shown
    assert "not shown" in shown


def test_loopback_addresses_belong_to_the_loopback_interface() -> None:
    interfaces = [
        netif.Interface("lo", True, True, ("127.0.0.1", "::1")),
        netif.Interface("eth0", True, False, ("192.0.2.2",)),
    ]
    assert netif.owner("127.0.0.53", interfaces) == interfaces[0]
    assert netif.owner("192.0.2.2", interfaces) == interfaces[1]
    assert netif.owner("198.51.100.1", interfaces) is None


def test_this_machine_has_a_loopback_interface_with_its_address() -> None:
    (lo,) = [i for i in netif.interfaces() if i.loopback]
    assert "127.0.0.1" in lo.addresses


def test_ipv6_endpoints_are_bracketed() -> None:
    assert endpoint_url("::1", 5) == "tcp://[::1]:5"
    assert endpoint_url("127.0.0.1", 5) == "tcp://127.0.0.1:5"
    assert endpoint_url("host.example", 5) == "tcp://host.example:5"


def _dist(
    site: Path, record: list[str], direct_url: dict | None = None
) -> importlib.metadata.Distribution:
    info = site / "kvcr-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcr\nVersion: 0.1.0\n")
    (info / "RECORD").write_text("".join(f"{line},,\n" for line in record))
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return importlib.metadata.PathDistribution(info)


def test_a_regular_install_expects_its_own_files(tmp_path: Path) -> None:
    dist = _dist(tmp_path, ["kvcr/__init__.py", "kvcr/api.py"])
    assert expected_package_dirs(dist) == [(tmp_path / "kvcr").resolve()]


def test_an_editable_install_expects_what_its_pth_adds(tmp_path: Path) -> None:
    src = tmp_path / "checkout" / "src"
    (tmp_path / "_editable_impl_kvcr.pth").write_text(f"{src}\n")
    editable = {"url": f"file://{tmp_path / 'checkout'}", "dir_info": {"editable": True}}
    dist = _dist(tmp_path, ["_editable_impl_kvcr.pth"], editable)
    assert expected_package_dirs(dist) == [(src / "kvcr").resolve()]
