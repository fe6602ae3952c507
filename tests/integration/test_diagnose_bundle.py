"""``kvcr diagnose --bundle`` as a subprocess against a live guard service and a live control
endpoint: every member of the archive, and a planted cluster key found in none of them."""

from __future__ import annotations

import base64
import datetime
import gzip
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from procs import GuardProcess, free_port

pytestmark = pytest.mark.integration

SCRIPT = Path(sys.executable).parent / "kvcr"
KEY = "planted-Cluster-Key-9f8e7d6c5b4a"
ENGINE_KEY = "the-Engine-s-own-Key-0a1b2c3d4e5f"
MEMBERS = [
    "MANIFEST.json",
    "diagnose.json",
    "diagnose.txt",
    "versions.json",
    "import_paths.json",
    "environment.json",
    "tier_config.json",
    "endpoints.json",
    "guard_status.json",
    "selftest.json",
    "logs/kvcr.log",
]


def kvcr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "diagnose", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def forms(secret: str) -> list[bytes]:
    raw = secret.encode()
    return [raw, raw.hex().encode(), base64.b64encode(raw).rstrip(b"=")]


def read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        names = tar.getnames()
        roots = {name.split("/", 1)[0] for name in names}
        assert len(roots) == 1, names
        (root,) = roots
        files = {}
        for member in tar.getmembers():
            extracted = tar.extractfile(member)
            assert extracted is not None, member.name
            files[member.name.removeprefix(f"{root}/")] = extracted.read()
    assert root.startswith(f"kvcr-diagnose-{socket.gethostname()}-")
    return files


@pytest.fixture
def listener() -> Iterator[int]:
    """A live control endpoint: a TCP socket listening on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_bundle_holds_the_whole_record_and_no_key(tmp_path: Path, listener: int) -> None:
    guard = GuardProcess(tmp_path, env={"KVCR_CLUSTER_KEY": KEY})
    try:
        silent = free_port()  # a port nothing listens on
        tier = {
            "type": "kvcr",
            "router_capabilities": ["router_hint"],
            "control_host": "0.0.0.0",
            "control_advertise_host": "127.0.0.1",
            "control_ports": [listener, silent],
            "kvcr_service_socket_path": guard.socket_path,
            "compatibility_digest": guard.digest,
            "note": f"someone pasted the key here: {KEY}",
        }
        transfer = {"kv_connector_extra_config": {"secondary_tiers": [tier]}}
        (tmp_path / "transfer.json").write_text(json.dumps(transfer))
        # Planted in the guard's real log: raw, as an assignment, and hex-encoded.
        old = datetime.datetime.now() - datetime.timedelta(hours=3)
        stamp = old.strftime("%Y-%m-%d %H:%M:%S,000")
        log = Path(guard.log_path)
        original = log.read_text()
        log.write_text(
            f"{stamp} INFO kvcr.old three hours ago, out of the window\n"
            + original
            + f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%S.%fZ} "
            f"WARNING kvcr.test peer sent {KEY} KVCR_CLUSTER_KEY={KEY}\n"
            f"  continuation with the hex form {KEY.encode().hex()}\n"
        )
        proc = kvcr(
            "--bundle", str(tmp_path), "--tier-config", str(tmp_path / "transfer.json"),
            "--log-path", str(log), "--self-test-mib", "1",
            env={"KVCR_CLUSTER_KEY": KEY, "HF_TOKEN": "hf_not_for_tickets"},
        )  # fmt: skip
    finally:
        assert guard.stop() == 0, guard.log()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (archive,) = tmp_path.glob("kvcr-diagnose-*.tar.gz")
    assert f"wrote {archive} ({archive.stat().st_size} bytes, {len(MEMBERS)} members)" in (
        proc.stdout
    )
    assert archive.stat().st_mode & 0o077 == 0  # it holds an environment: owner only
    files = read_archive(archive)
    assert list(files) == MEMBERS

    # Nothing carries the key: no member, no byte of the archive's tar stream.
    stream = gzip.decompress(archive.read_bytes())
    for secret in (*forms(KEY), b"hf_not_for_tickets"):
        assert secret not in stream
        assert [name for name, data in files.items() if secret in data] == []

    manifest = json.loads(files["MANIFEST.json"])
    assert manifest["format"] == "kvcr-diagnose-bundle/1"
    entries = {m["name"]: m for m in manifest["members"]}
    assert list(entries) == [*MEMBERS[:6], "engine_process.json", *MEMBERS[6:]]
    assert entries["engine_process.json"]["status"] == "skipped"
    assert entries["endpoints.json"]["status"] == "failed"
    assert f"tcp://127.0.0.1:{silent}" in entries["endpoints.json"]["why"]
    for name in MEMBERS[1:]:
        assert entries[name]["bytes"] == len(files[name]), name
        if name != "endpoints.json":
            assert entries[name]["status"] == "ok", entries[name]
    assert manifest["redaction"]["secrets_known"] is True
    assert manifest["redaction"]["replacements"] >= 3  # the tier note, the log twice

    diagnose = json.loads(files["diagnose.json"])
    assert diagnose["format"] == "kvcr-diagnose/1"
    assert diagnose["checks"]["guard"]["status"] == "ok"
    assert "result: " in files["diagnose.txt"].decode()

    versions = json.loads(files["versions.json"])
    assert versions["kvcr"]["present"] and versions["nixl"]["present"]
    assert versions["ucx"]["version"].count(".") == 2
    assert versions["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    for absent in ("vllm", "torch", "dynamo"):  # not installed here: said so
        assert versions[absent] == {"present": False}
    assert "nvidia_smi" in versions["cuda"]

    paths = json.loads(files["import_paths.json"])
    assert paths["sys_path"] and paths["modules"]["kvcr"]["present"]
    assert paths["modules"]["vllm"] == {"present": False}

    environment = json.loads(files["environment.json"])
    assert environment["variables"]["KVCR_CLUSTER_KEY"].endswith("not shown>")
    assert environment["variables"]["HF_TOKEN"].endswith("not shown>")
    assert environment["cluster_key"] == {
        "configured": True,
        "source": "KVCR_CLUSTER_KEY",
        "readable": True,
    }

    config = json.loads(files["tier_config.json"])
    assert config["source"] == f"--tier-config {tmp_path / 'transfer.json'}"
    assert config["tier"]["control_ports"] == [listener, silent]
    assert config["tier"]["note"] == "someone pasted the key here: <redacted>"

    ranks = json.loads(files["endpoints.json"])["ranks"]
    assert [(r["bind"]["answers"], r["advertised"]["answers"]) for r in ranks] == [
        (True, True),
        (False, False),
    ]

    guard_status: dict[str, Any] = json.loads(files["guard_status.json"])
    assert guard_status["status"] == "ok"
    assert guard_status["socket_from"].startswith("kvcr_service_socket_path of the tier config")
    assert len(guard_status["details"]["groups"]) == 2
    assert guard_status["table"][0].split()[:2] == ["group", "state"]

    selftest = json.loads(files["selftest.json"])
    assert selftest["status"] in {"ok", "warn"}
    assert selftest["details"]["bytes_verified"] is True and selftest["details"]["mib"] == 1

    text = files["logs/kvcr.log"].decode()
    assert "out of the window" not in text
    assert text.startswith(original.splitlines()[0])  # the guard's own records, whole
    assert "peer sent <redacted> KVCR_CLUSTER_KEY=<redacted>" in text
    assert text.endswith("  continuation with the hex form <redacted>\n")
    assert entries["logs/kvcr.log"]["tail"]["truncated"] is False


def test_a_key_file_is_scrubbed_and_json_goes_to_stdout(tmp_path: Path) -> None:
    (tmp_path / "cluster.key").write_text(KEY + "\n")
    log = tmp_path / "engine.log"
    log.write_text(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S},000 INFO kvcr.x {KEY}\n")
    target = tmp_path / "out.tar.gz"
    proc = kvcr(
        "--bundle", str(target), "--skip-self-test", "--json", "--log-path", str(log),
        "--tier-config", json.dumps({"control_ports": [1], "secret": KEY}),
        env={"KVCR_CLUSTER_KEY_FILE": str(tmp_path / "cluster.key")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["bundle"], summary["bytes"]) == (str(target), target.stat().st_size)
    files = read_archive(target)
    assert KEY.encode() not in gzip.decompress(target.read_bytes())
    assert files["logs/kvcr.log"].endswith(b"INFO kvcr.x <redacted>\n")
    statuses = {m["name"]: m["status"] for m in summary["members"][1:]}
    assert statuses["guard_status.json"] == statuses["engine_process.json"] == "skipped"
    assert statuses["selftest.json"] == "ok"  # skipped by flag: recorded as the check says
    assert json.loads(files["selftest.json"])["status"] == "skipped"


@pytest.fixture
def engine(tmp_path: Path, listener: int) -> Iterator[subprocess.Popen[bytes]]:
    """A real process started as vLLM would be, with its own key (in a key file named
    relative to its working directory) that the diagnose process itself does not have."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "cluster.key").write_text(ENGINE_KEY + "\n")
    tier = {"type": "kvcr", "control_ports": [listener], "control_advertise_host": "127.0.0.1"}
    transfer = {"kv_connector_extra_config": {"secondary_tiers": [{**tier, "x": ENGINE_KEY}]}}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "serve", "m",
         f"--kv-transfer-config={json.dumps(transfer)}"],
        cwd=tmp_path / "engine",
        env={"PATH": "/usr/bin", "KVCR_CLUSTER_KEY_FILE": "cluster.key"},
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while b"--kv-transfer-config" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the engine stand-in did not start"
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def test_a_running_engines_config_environment_and_key(
    tmp_path: Path, engine: subprocess.Popen[bytes], listener: int
) -> None:
    target = tmp_path / "engine.tar.gz"
    proc = kvcr("--bundle", str(target), "--skip-self-test", "--engine-pid", str(engine.pid))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = read_archive(target)
    stream = gzip.decompress(target.read_bytes())
    assert [f for f in forms(ENGINE_KEY) if f in stream] == []
    process = json.loads(files["engine_process.json"])
    assert process["pid"] == engine.pid and process["cwd"] == str(tmp_path / "engine")
    assert process["cluster_key"] == {
        "configured": True,
        "source": "KVCR_CLUSTER_KEY_FILE",
        "readable": True,
    }
    assert process["environment"]["KVCR_CLUSTER_KEY_FILE"].endswith("not shown>")
    config = json.loads(files["tier_config.json"])
    assert config["source"].startswith(f"--engine-pid {engine.pid} (--kv-transfer-config")
    assert config["tier"]["x"] == "<redacted>"
    (rank,) = json.loads(files["endpoints.json"])["ranks"]
    assert rank["port"] == listener and rank["bind"]["answers"] and rank["advertised"]["answers"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--tier-config", "{}"], "--tier-config needs --bundle FILE"),
        (["--bundle", "B", "--tier-config", "{nope"], "--tier-config: not JSON"),
        (["--bundle", "B", "--tier-config", "{}"], "--tier-config: no kvcr tier"),
        (["--bundle", "B", "--log-path", "/no/such.log"], "--log-path /no/such.log: cannot"),
        (["--bundle", "B", "--engine-config", "/no/such.yaml"], "--engine-config /no/such.yaml"),
        (["--bundle", "B", "--log-minutes", "0"], "--log-minutes"),
        (["--bundle", "B", "--tier-config", "{}", "--engine-pid", "1"], "not allowed with"),
    ],
)
def test_bad_bundle_flags_exit_2_naming_them(tmp_path: Path, args: list[str], named: str) -> None:
    proc = kvcr(*[str(tmp_path / "b.tgz") if a == "B" else a for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_an_archive_that_cannot_be_written_exits_1_naming_it(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "b.tar.gz"
    proc = kvcr("--bundle", str(target), "--skip-self-test")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"cannot write the bundle {target}: No such file or directory" in proc.stderr
