"""The pieces of ``kvcr diagnose --bundle`` that need no NIXL: the log tail, masking and
scrubbing, finding the tier config (in files and in a real process's command line), probing
endpoints over real sockets, and the manifest's view of parts that fail."""

from __future__ import annotations

import base64
import datetime
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcr.diagnose import bundle, logtail, redact, tierconfig

UTC = datetime.timezone.utc
KEY = "k3y-Of-the-Cluster-0123456789"


def asctime(moment: datetime.datetime) -> str:
    """logging's asctime: local time, milliseconds after a comma."""
    local = moment.astimezone()
    return local.strftime("%Y-%m-%d %H:%M:%S") + f",{local.microsecond // 1000:03d}"


def iso(moment: datetime.datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


END = datetime.datetime(2026, 12, 5, 18, 37, 29, 642123, tzinfo=UTC)


def minutes_before(n: float) -> datetime.datetime:
    return END - datetime.timedelta(minutes=n)


# -- the log tail ------------------------------------------------------------------------------


def test_both_stamps_parse_to_the_same_moment() -> None:
    assert logtail.stamp(f"{iso(END)} INFO x".encode()) == END
    assert logtail.stamp(f"{asctime(END)} INFO x".encode()) == END.replace(microsecond=642000)
    assert logtail.stamp(b"2026-12-05T18:37:29+01:00 x") == datetime.datetime(
        2026, 12, 5, 17, 37, 29, tzinfo=UTC
    )
    for line in (b"  File x", b"2026-13-45 10:00:00,000 x", b"2026-12-05 is a day", b""):
        assert logtail.stamp(line) is None


def sample_log(path: Path) -> Path:
    path.write_text(
        "printed before logging started\n"
        f"{asctime(minutes_before(45))} INFO kvcr.a old record\n"
        "Traceback (most recent call last): belongs to the old record\n"
        f"{iso(minutes_before(29))} WARNING kvcr.b first in the window\n"
        "  continuation of the first\n"
        f"{asctime(minutes_before(10))} INFO kvcr.c middle\n"
        f"{iso(END)} ERROR kvcr.d last\n"
        "  continuation of the last\n"
    )
    return path


@pytest.mark.parametrize("block", [5, 64, 2**16])
def test_the_tail_is_the_records_within_the_minutes_before_the_last_stamp(
    tmp_path: Path, block: int
) -> None:
    tail = logtail.tail(sample_log(tmp_path / "kvcr.log"), 30, block=block)
    assert tail.data.decode().splitlines() == [
        f"{iso(minutes_before(29))} WARNING kvcr.b first in the window",
        "  continuation of the first",
        f"{asctime(minutes_before(10))} INFO kvcr.c middle",
        f"{iso(END)} ERROR kvcr.d last",
        "  continuation of the last",
    ]
    assert (tail.first, tail.last, tail.lines, tail.truncated) == (
        minutes_before(29),
        END,
        5,
        False,
    )


def test_a_file_inside_the_window_is_kept_whole(tmp_path: Path) -> None:
    path = sample_log(tmp_path / "kvcr.log")
    tail = logtail.tail(path, 60, block=7)
    assert tail.data == path.read_bytes()
    assert tail.scanned_bytes == tail.file_bytes


def test_a_huge_file_is_read_from_its_end(tmp_path: Path) -> None:
    """8 GiB of hole before the last records: a tail that read it whole would not finish."""
    path = tmp_path / "huge.log"
    recent = f"{asctime(minutes_before(1))} INFO kvcr.x recent\n{iso(END)} INFO kvcr.x last\n"
    with open(path, "wb") as file:
        file.seek(8 * 2**30)
        file.write(f"\n{asctime(minutes_before(90))} INFO kvcr.x old\n{recent}".encode())
    started = time.monotonic()
    tail = logtail.tail(path, 5)
    assert time.monotonic() - started < 2
    assert tail.data.decode() == recent
    assert tail.file_bytes > 8 * 2**30 and tail.scanned_bytes <= 2**16


def test_the_size_limit_cuts_at_a_record(tmp_path: Path) -> None:
    path = tmp_path / "kvcr.log"
    lines = [f"{iso(minutes_before(1))} INFO record {i}\n  detail {i}\n" for i in range(100)]
    path.write_text("".join(lines))
    tail = logtail.tail(path, 30, max_bytes=1000, block=64)
    assert tail.truncated and len(tail.data) <= 1000
    assert tail.data.decode().startswith(f"{iso(minutes_before(1))} INFO record ")
    assert tail.data.decode().endswith("  detail 99\n")


def test_a_file_without_stamps_gives_its_end(tmp_path: Path) -> None:
    path = tmp_path / "plain.log"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = logtail.tail(path, 30, max_bytes=100)
    assert tail.data.decode().endswith("line 999\n") and len(tail.data) <= 100
    assert tail.first is None and tail.last is None


def test_minutes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="minutes must be positive"):
        logtail.tail(sample_log(tmp_path / "kvcr.log"), 0)


# -- masking and scrubbing ---------------------------------------------------------------------


def test_secret_names_are_masked_and_url_credentials_dropped() -> None:
    shown = redact.masked(
        {
            "KVCR_CLUSTER_KEY": KEY,
            "HF_TOKEN": "hf_abcdefgh",
            "AWS_SECRET_ACCESS_KEY": "x" * 40,
            "DB_PASSWORD": "hunter22",
            "GOOGLE_APPLICATION_CREDENTIALS": "/etc/creds.json",
            "ETCD_ENDPOINTS": "http://root:s3cretpw@etcd:2379",
            "UCX_TLS": "tcp,self",
        }
    )
    assert shown["KVCR_CLUSTER_KEY"] == f"<set, {len(KEY)} characters, not shown>"
    assert all("not shown" in shown[n] for n in shown if n not in ("ETCD_ENDPOINTS", "UCX_TLS"))
    assert shown["ETCD_ENDPOINTS"] == "http://<redacted>@etcd:2379"
    assert shown["UCX_TLS"] == "tcp,self"


def test_every_form_of_a_secret_is_scrubbed() -> None:
    scrub = redact.Scrubber([KEY.encode()])
    raw = KEY.encode()
    forms = [raw, raw.hex().encode(), raw.hex().upper().encode(), base64.b64encode(raw)]
    forms.append(base64.urlsafe_b64encode(raw).rstrip(b"="))
    text = b" | ".join([b"a", *forms, b"z"])
    assert scrub.bytes(text) == b" | ".join([b"a", *[b"<redacted>"] * len(forms), b"z"])
    assert scrub.replaced == len(forms)


def test_json_values_are_scrubbed_before_escaping() -> None:
    key = 'quo"te\\and-more-bytes'
    scrub = redact.Scrubber([key.encode()])
    value = {key: [key, {"note": f"x{key}y"}], "n": 1}
    assert scrub.value(value) == {"<redacted>": ["<redacted>", {"note": "x<redacted>y"}], "n": 1}


def test_the_key_file_is_read_and_short_values_are_only_masked(tmp_path: Path) -> None:
    (tmp_path / "cluster.key").write_text(f"  {KEY}\n")
    scrub = redact.Scrubber()
    problem = scrub.add_environment(
        {"KVCR_CLUSTER_KEY_FILE": str(tmp_path / "cluster.key"), "SOME_TOKEN": "1"}
    )
    assert problem is None
    assert scrub.text(f"key {KEY} token 1") == "key <redacted> token 1"
    missing = redact.Scrubber().add_environment({"KVCR_CLUSTER_KEY_FILE": "/no/such/key"})
    assert missing == "KVCR_CLUSTER_KEY_FILE: cannot read the key file: No such file or directory"


def test_secret_assignments_in_free_text_are_masked() -> None:
    line = 'x KVCR_CLUSTER_KEY=abcdefgh api_key: "qwertyuiop" token=12 blocks=7'
    assert redact.mask_assignments(line) == (
        'x KVCR_CLUSTER_KEY=<redacted> api_key: "<redacted>" token=12 blocks=7'
    )
    assert redact.mask_assignments("Authorization: Bearer abcdefgh") == (
        "Authorization: Bearer <redacted>"
    )
    assert redact.mask_assignments("etcd at http://u:pw@etcd:2379 down") == (
        "etcd at http://<redacted>@etcd:2379 down"
    )
    # Log fields that only look alike stay: a ticket needs them.
    fields = "deposit keys=1024 key=b'0123abcd' forbid_extra_keys=True"
    assert redact.mask_assignments(fields) == fields


# -- the tier config ---------------------------------------------------------------------------

TIER = {"type": "kvcr", "router_capabilities": ["router_hint"], "control_ports": [5601]}
TRANSFER = {
    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"secondary_tiers": [{"type": "cpu"}, TIER]},
}


@pytest.mark.parametrize(
    "doc",
    [
        TIER,
        TRANSFER,
        {"kv-transfer-config": TRANSFER},
        {"kv_transfer_config": json.dumps(TRANSFER)},
    ],
)
def test_the_kvcr_tier_is_found_in_each_shape(doc: object) -> None:
    assert tierconfig.kvcr_tier(doc, "here") == TIER


def test_a_config_without_a_kvcr_tier_names_its_source(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"kv-transfer-config": {"kv_connector_extra_config": {}}}))
    with pytest.raises(tierconfig.BadSource, match=f"--engine-config {path}: kv-transfer-config"):
        tierconfig.from_engine_config(str(path))
    with pytest.raises(tierconfig.BadSource, match="--tier-config: not JSON"):
        tierconfig.from_flag("{not json")
    with pytest.raises(tierconfig.BadSource, match="--tier-config: cannot read /no/such"):
        tierconfig.from_flag("/no/such/file.json")


def test_yaml_without_pyyaml_says_what_is_missing(tmp_path: Path) -> None:
    try:
        import yaml  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("PyYAML is installed here: the YAML path is taken instead")
    path = tmp_path / "vllm.yaml"
    path.write_text("kv-transfer-config:\n  kv_connector: OffloadingConnector\n")
    with pytest.raises(tierconfig.BadSource, match=f"--engine-config {path}: not JSON .*PyYAML"):
        tierconfig.from_engine_config(str(path))


def test_a_tier_config_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tier.json"
    path.write_text(json.dumps(TRANSFER))
    found = tierconfig.from_flag(str(path))
    assert (found.source, found.tier) == (f"--tier-config {path}", TIER)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process whose command line carries an engine's flags (as vLLM's would)."""
    (tmp_path / "vllm.json").write_text(json.dumps({"kv-transfer-config": TRANSFER}))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "serve", "--config", "vllm.json"],
        cwd=tmp_path,
        env={"KVCR_CLUSTER_KEY": KEY, "PATH": "/usr/bin"},
    )
    deadline = time.monotonic() + 10
    while b"--config" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # until exec'd
        assert time.monotonic() < deadline, "the engine stand-in did not start"
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_a_running_engines_config_and_environment_are_read(
    engine: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    found = tierconfig.engine_process(engine.pid)
    assert found.cmdline[-2:] == ("--config", "vllm.json")
    assert found.environ["KVCR_CLUSTER_KEY"] == KEY
    assert found.cwd == str(tmp_path)
    tier = tierconfig.from_engine(found)
    assert tier.tier == TIER and str(tmp_path / "vllm.json") in tier.source


def test_a_process_that_is_no_engine_is_refused() -> None:
    with pytest.raises(tierconfig.BadSource, match="neither --kv-transfer-config nor --config"):
        tierconfig.from_engine(tierconfig.engine_process(__import__("os").getpid()))
    with pytest.raises(tierconfig.BadSource, match="--engine-pid 4194304: no such process"):
        tierconfig.engine_process(4194304)


def test_flag_values_in_both_spellings() -> None:
    argv = ["vllm", "--kv_transfer_config={}", "--kv-transfer-config", "[1]"]
    assert tierconfig._flag_value(argv, tierconfig.TRANSFER_FLAGS) == "[1]"
    assert tierconfig._flag_value(["--config"], tierconfig.CONFIG_FLAGS) is None


# -- endpoints ---------------------------------------------------------------------------------


def test_endpoints_answer_where_something_listens() -> None:
    with socket.socket() as listener, socket.socket() as closed:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        live, dead = listener.getsockname()[1], closed.getsockname()[1]
        record = tierconfig.endpoints(
            {"control_ports": [live, dead], "control_advertise_host": "127.0.0.1"}
        )
    assert record["bind_is_wildcard"] and record["advertise_default_used"] is False
    first, second = record["ranks"]
    assert first["bind"]["endpoint"] == f"tcp://0.0.0.0:{live}"
    assert first["bind"]["probed"] == "127.0.0.1"
    assert first["bind"]["answers"] and first["advertised"]["answers"]
    assert not second["bind"]["answers"] and "refused" in second["bind"]["error"]


def test_bad_control_ports_are_recorded_not_raised() -> None:
    record = tierconfig.endpoints({"control_ports": "5601"})
    assert "control_ports must be a list of ports" in record["error"]
    wildcard = tierconfig.endpoints({"control_ports": [1], "control_advertise_host": "0.0.0.0"})
    assert "wildcard" in wildcard["advertise_error"]


# -- parts and the manifest --------------------------------------------------------------------


def test_a_part_that_raises_fails_alone_and_its_message_is_scrubbed() -> None:
    scrub = redact.Scrubber([KEY.encode()])

    def broken() -> tuple[object, str | None]:
        raise RuntimeError(f"cannot parse {KEY}")

    failed = bundle._part(scrub, "x.json", "x", broken)
    assert (failed.status, failed.data, failed.why) == (
        "failed",
        None,
        "RuntimeError: cannot parse <redacted>",
    )
    skipped = bundle._part(scrub, "y.json", "y", broken, skip="no --y given")
    assert skipped.record() == {
        "name": "y.json",
        "holds": "y",
        "status": "skipped",
        "bytes": None,
        "why": "no --y given",
    }
    found = bundle._part(scrub, "z.json", "z", lambda: ({"k": KEY}, "z did not answer"))
    assert found.status == "failed" and found.data is not None
    assert json.loads(found.data) == {"k": "<redacted>"}
