"""``kvcr diagnose --bundle FILE``: the whole diagnostic record of a machine in one
gzip-compressed tar archive, every member scrubbed of every secret this process can know.

The archive holds one directory, ``kvcr-diagnose-<host>-<UTC stamp>/``, with
``MANIFEST.json`` first: each member, what it holds, and for a part that failed or was
skipped, why (a part that fails does not fail the bundle). A secret is masked where a
variable named like one is shown, and its value (and its hex and base64 forms) is replaced
with ``<redacted>`` wherever else it appears: in the tier config, in argv, in the logs.
The cluster key is a secret whether it comes from ``KVCR_CLUSTER_KEY``, from the file
``KVCR_CLUSTER_KEY_FILE`` names, or from the environment of ``--engine-pid``'s process.

Exit codes: 0 when the archive is written (whatever the checks found: it says), 1 when it
cannot be written, 2 for bad flags (a tier config or log that cannot be read included).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvcr.diagnose import logtail, parts, redact, render, tierconfig
from kvcr.diagnose.result import EXIT_FAILED, EXIT_OK, Report, Status

FORMAT = "kvcr-diagnose-bundle/1"
DEFAULT_LOG_MINUTES = 30
LOG_MEMBER = "logs/kvcr.log"
#: Flags that only mean something with --bundle.
BUNDLE_ONLY = ("tier_config", "engine_config", "engine_pid", "log_path")


class CannotWrite(OSError):
    """The archive cannot be written; the message names its path."""


@attrs.define
class Plan:
    """What a bundle run found before its checks: where it writes, and what it reads."""

    target: Path
    temp: Path
    tier: tierconfig.TierConfig | None
    engine: tierconfig.EngineProcess | None
    guard_from: str | None
    log_path: str | None
    log_minutes: float
    scrubber: redact.Scrubber
    problems: list[str]


@attrs.frozen
class Member:
    """``data`` None: not in the archive (``status`` skipped or failed, ``why`` says)."""

    name: str
    holds: str
    data: bytes | None = None
    status: str = "ok"
    why: str | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)

    def record(self) -> dict[str, Any]:
        size = None if self.data is None else len(self.data)
        entry = {"name": self.name, "holds": self.holds, "status": self.status, "bytes": size}
        return {**entry, **({"why": self.why} if self.why else {}), **self.extra}


def _stamp(now: datetime.datetime) -> str:
    return now.strftime("%Y%m%dT%H%M%SZ")


def _target(value: str, hostname: str, now: datetime.datetime) -> Path:
    """``--bundle``'s path; a directory gets a file named after the host and the time."""
    path = Path(value)
    if path.is_dir():
        return path / f"kvcr-diagnose-{hostname}-{_stamp(now)}.tar.gz"
    return path


def prepare(args: argparse.Namespace, hostname: str, now: datetime.datetime) -> Plan:
    """Read what the flags point at before the checks run (a minute of checks must not end
    in "bad flag"). Raises tierconfig.BadSource (exit 2) or CannotWrite (exit 1)."""
    engine = tier = None
    if args.engine_pid is not None:
        engine = tierconfig.engine_process(args.engine_pid)
        tier = tierconfig.from_engine(engine)
    elif args.engine_config is not None:
        tier = tierconfig.from_engine_config(args.engine_config)
    elif args.tier_config is not None:
        tier = tierconfig.from_flag(args.tier_config)
    guard_from = "--guard-socket" if args.guard_socket is not None else None
    if guard_from is None and tier is not None and tier.guard_socket is not None:
        # The guard the engine is configured with is the one whose status matters.
        args.guard_socket = tier.guard_socket
        guard_from = f"kvcr_service_socket_path of the tier config ({tier.source})"
    if args.log_path is not None:
        try:
            with open(args.log_path, "rb"):
                pass
        except OSError as exc:
            raise tierconfig.BadSource(
                f"--log-path {args.log_path}: cannot read it: {exc.strerror}"
            ) from None
    scrubber = redact.Scrubber()
    problems = [p for p in [scrubber.add_environment(os.environ)] if p]
    if engine is not None and (problem := scrubber.add_environment(engine.environ)):
        problems.append(f"--engine-pid {engine.pid}: {problem}")
    target = _target(args.bundle, hostname, now)
    try:
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        os.close(fd)
    except OSError as exc:
        raise CannotWrite(f"cannot write the bundle {target}: {exc.strerror}") from None
    return Plan(
        target, Path(temp), tier, engine, guard_from, args.log_path, args.log_minutes,
        scrubber, problems,
    )  # fmt: skip


def _json(scrubber: redact.Scrubber, value: Any) -> bytes:
    text = json.dumps(scrubber.value(value), indent=2, default=str, ensure_ascii=False)
    return scrubber.bytes(text.encode("utf-8", "surrogateescape") + b"\n")


def _part(
    scrubber: redact.Scrubber,
    name: str,
    holds: str,
    build: Callable[[], tuple[Any, str | None]],
    skip: str | None = None,
) -> Member:
    """A member from ``build`` (its value, and why the part failed when it did); a build
    that raises becomes a failed part, not a failed bundle."""
    if skip is not None:
        return Member(name, holds, status="skipped", why=skip)
    try:
        value, failed = build()
    except Exception as exc:
        crashed = scrubber.text(f"{type(exc).__name__}: {exc}")
        return Member(name, holds, status="failed", why=crashed)
    why = scrubber.text(failed) if failed else None
    return Member(name, holds, _json(scrubber, value), "failed" if why else "ok", why)


def _check_part(record: dict[str, Any]) -> tuple[Any, str | None]:
    return record, record["summary"] if record["status"] == Status.FAIL.value else None


def _endpoints(tier: tierconfig.TierConfig) -> tuple[Any, str | None]:
    record = tierconfig.endpoints(tier.tier)
    silent = [
        f"rank {r['rank']} {side} {r[side]['endpoint']}"
        for r in record.get("ranks", [])
        for side in ("bind", "advertised")
        if not r[side]["answers"]
    ]
    problem = record.get("error") or record.get("advertise_error")
    if silent:
        problem = f"{'; '.join(silent)}: no answer" + (f"; {problem}" if problem else "")
    return record, problem


def _log(plan: Plan) -> Member:
    holds = f"the last {plan.log_minutes:g} minutes of {plan.log_path} (secrets scrubbed)"
    if plan.log_path is None:
        return Member(LOG_MEMBER, "kvcr's log", status="skipped", why="no --log-path given")
    try:
        tail = logtail.tail(plan.log_path, plan.log_minutes)
    except OSError as exc:
        why = f"cannot read {plan.log_path}: {exc.strerror}"
        return Member(LOG_MEMBER, holds, status="failed", why=why)
    text = redact.mask_assignments(tail.data.decode("utf-8", "surrogateescape"))
    data = plan.scrubber.bytes(text.encode("utf-8", "surrogateescape"))
    extra = {"source": plan.log_path, "minutes": plan.log_minutes, "tail": tail.record()}
    return Member(LOG_MEMBER, holds, data, extra=extra)


def members(
    plan: Plan, report: Report, info: render.RunInfo, applied: dict[str, str]
) -> list[Member]:
    scrub = plan.scrubber
    tier, engine = plan.tier, plan.engine
    no_tier = "no --tier-config, --engine-config or --engine-pid given"
    no_guard = "no --guard-socket given" + (
        ", and the tier config names no kvcr_service_socket_path" if tier else ""
    )
    return [
        Member(
            "diagnose.json",
            "every check of `kvcr diagnose --json`",
            _json(scrub, render.document(report, info)),
        ),
        Member(
            "diagnose.txt",
            "the same checks as `kvcr diagnose` prints them",
            scrub.bytes(render.to_text(report, info).encode("utf-8", "surrogateescape")),
        ),
        _part(
            scrub,
            "versions.json",
            "Python, kvcr, NIXL, UCX, kvcr's dependencies, vLLM, Dynamo, torch, CUDA",
            lambda: (parts.versions(report), None),
        ),
        _part(
            scrub,
            "import_paths.json",
            "sys.path and where each package imports from",
            lambda: (parts.import_paths(report), None),
        ),
        _part(
            scrub,
            "environment.json",
            "this process's environment, secret-named values masked",
            lambda: (parts.environment(applied), None),
        ),
        _part(
            scrub,
            "engine_process.json",
            "the engine process's command line and environment (masked)",
            lambda: (parts.engine_process(engine) if engine else None, None),
            skip=None if engine else "no --engine-pid given",
        ),
        _part(
            scrub,
            "tier_config.json",
            "the kvcr tier config and where it was found",
            lambda: ({"source": tier.source, "tier": dict(tier.tier)} if tier else None, None),
            skip=None if tier else no_tier,
        ),
        _part(
            scrub,
            "endpoints.json",
            "each rank's bind and advertised control endpoint, and whether it answers",
            lambda: _endpoints(tier) if tier else (None, None),
            skip=None if tier else no_tier,
        ),
        _part(
            scrub,
            "guard_status.json",
            "the guard service's status",
            lambda: _check_part(parts.guard_status(report, plan.guard_from)),
            skip=None if plan.guard_from else no_guard,
        ),
        _part(
            scrub,
            "selftest.json",
            "the NIXL transfer self-test",
            lambda: _check_part(parts.self_test(report)),
        ),
        _log(plan),
    ]


def manifest(
    plan: Plan, report: Report, info: render.RunInfo, written: list[Member]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "kvcr_version": info.kvcr_version,
        "hostname": info.hostname,
        "created_utc": info.created_utc,
        "argv": list(info.argv),
        "diagnose_outcome": report.outcome,
        "diagnose_exit_code": report.exit_code,
        "members": [{"name": "MANIFEST.json", "holds": "this list"}]
        + [m.record() for m in written],
        "redaction": {
            "masked_names": redact.SECRET_NAME.pattern,
            "secrets_known": plan.scrubber.count > 0,
            "replacements": plan.scrubber.replaced,
            "problems": plan.problems,
        },
    }


def _add(archive: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o600
    archive.addfile(info, io.BytesIO(data))


def _write_archive(path: Path, root: str, written: list[Member], head: bytes) -> None:
    now = time.time()
    with open(path, "wb") as raw:
        # filename="": the gzip header names no file (the temporary one least of all).
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=int(now)) as compressed,
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            _add(tar, f"{root}/MANIFEST.json", head, now)
            for member in written:
                if member.data is not None:
                    _add(tar, f"{root}/{member.name}", member.data, now)
        raw.flush()
        os.fsync(raw.fileno())


def write(
    plan: Plan,
    report: Report,
    info: render.RunInfo,
    applied: dict[str, str],
    as_json: bool = False,
) -> int:
    """Write the archive (to a temporary file, then renamed: never half an archive at the
    path given) and say where it is."""
    created = datetime.datetime.fromisoformat(info.created_utc)
    root = f"kvcr-diagnose-{info.hostname}-{_stamp(created)}"
    try:
        written = members(plan, report, info, applied)
        head = _json(plan.scrubber, manifest(plan, report, info, written))
        _write_archive(plan.temp, root, written, head)
        os.replace(plan.temp, plan.target)
    except OSError as exc:
        plan.temp.unlink(missing_ok=True)
        print(f"kvcr diagnose: cannot write the bundle {plan.target}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BaseException:
        plan.temp.unlink(missing_ok=True)
        raise
    size = plan.target.stat().st_size
    if as_json:
        print(json.dumps({"bundle": str(plan.target), "bytes": size, **json.loads(head)}))
        return EXIT_OK
    kept = [m for m in written if m.data is not None]
    print(f"kvcr diagnose: wrote {plan.target} ({size} bytes, {len(kept) + 1} members)")
    print(f"  checks: {report.outcome} (exit code {report.exit_code} without --bundle)")
    for member in written:
        if member.status != "ok":
            print(f"  {member.name}: {member.status}: {member.why}")
    for problem in plan.problems:
        print(f"  redaction: {problem}")
    return EXIT_OK


def discard(plan: Plan) -> None:
    """Remove the temporary file of a run that ends before :func:`write`."""
    plan.temp.unlink(missing_ok=True)
