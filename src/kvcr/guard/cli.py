"""``kvcr-guard``: run the guard service, or ask a running one for its status.

    kvcr-guard --socket-path S --pool-dir D --guard-count N --pool-sizes-gb A,B \\
               --compatibility-digest X [--log-level L] [--metrics-port P [--metrics-host H]]
               [--heartbeat-timeout-ms N]
    kvcr-guard status --socket-path S [--json]

Exit codes: 0 clean shutdown (SIGINT / SIGTERM) or status shown; 1 the service failed or
could not start (the message says why); 2 bad flags.
"""

from __future__ import annotations

import argparse
import grp
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from kvcr.config import MAX_GROUPS
from kvcr.errors import KVCRServiceError
from kvcr.guard import hugepages
from kvcr.guard.client import KVCRClient
from kvcr.guard.heartbeat import BEAT_MS, MIN_TIMEOUT_MS
from kvcr.guard.pools import JOURNAL_BYTES, parse_pool_sizes_gb
from kvcr.guard.protocol import MAX_DIGEST, GroupStatus
from kvcr.guard.service import GuardService, ServiceConfig, ServiceStartError
from kvcr.logs import UtcFormatter, get_logger, parse_level

# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


class FlagError(ValueError):
    """A flag is out of range; the message names it."""


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcr-guard",
        description="Own kvcr pool groups in shared memory and lend them to workers. "
        "`kvcr-guard status --socket-path S` shows who holds what.",
    )
    p.add_argument("--socket-path", required=True, help="Unix socket workers claim on")
    p.add_argument("--pool-dir", required=True, help="writable directory for the group files")
    p.add_argument("--guard-count", required=True, type=int, help="number of pool groups (>= 1)")
    p.add_argument(
        "--pool-sizes-gb",
        required=True,
        help="comma-separated GiB per ordered pool of every group, e.g. 4,0.5",
    )
    p.add_argument(
        "--compatibility-digest", required=True, help="exact string every claimant must present"
    )
    p.add_argument("--log-level", default=None, help="default: $KVCR_LOG_LEVEL or INFO")
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=5.0,
        help="close a connection that sends nothing for this long (default 5)",
    )
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="back the pools with reserved huge pages: --pool-dir must be a hugetlbfs mount "
        "with enough free pages (pool sizes are rounded down to the huge page)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this TCP port (0: any free port, logged as "
        "metrics_serving); off by default",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1)",
    )
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=None,
        help=f"fence a holder whose runtime sends no heartbeat for this long (at least "
        f"{MIN_TIMEOUT_MS}; holders beat every {BEAT_MS} ms): SIGKILL it, then serve its "
        "blocks as after a crash. Off by default: holders are fenced by their exit alone",
    )
    p.add_argument(
        "--allow-gid",
        default=None,
        help="also let members of this group (name or id) claim: the socket becomes 0660 "
        "with this group (default: the service's own uid only)",
    )
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcr-guard status", description="Show the pool groups.")
    p.add_argument("--socket-path", required=True)
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.add_argument("--timeout-s", type=float, default=5.0)
    return p


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """Check every flag of the serve command; FlagError names the bad one."""
    if not 1 <= args.guard_count <= MAX_GROUPS:
        raise FlagError(f"--guard-count must be in 1..{MAX_GROUPS}, got {args.guard_count}")
    try:
        sizes = parse_pool_sizes_gb(args.pool_sizes_gb)
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    digest = args.compatibility_digest
    if not digest or len(digest) > MAX_DIGEST:
        raise FlagError(f"--compatibility-digest must be 1..{MAX_DIGEST} characters")
    pool_dir = Path(args.pool_dir)
    if not pool_dir.is_dir():
        raise FlagError(f"--pool-dir {pool_dir}: not an existing directory")
    if not os.access(pool_dir, os.W_OK | os.X_OK):
        raise FlagError(f"--pool-dir {pool_dir}: not writable")
    socket_path = Path(args.socket_path)
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise FlagError(f"--socket-path {socket_path}: longer than {MAX_SOCKET_PATH} bytes")
    if not socket_path.parent.is_dir():
        raise FlagError(f"--socket-path {socket_path}: directory {socket_path.parent} is missing")
    if not (math.isfinite(args.idle_timeout_s) and args.idle_timeout_s > 0):
        raise FlagError(f"--idle-timeout-s must be a positive number, got {args.idle_timeout_s}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise FlagError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if not args.metrics_host:
        raise FlagError("--metrics-host must be an address, got an empty string")
    heartbeat = args.heartbeat_timeout_ms
    if heartbeat is not None and heartbeat < MIN_TIMEOUT_MS:
        raise FlagError(
            f"--heartbeat-timeout-ms must be at least {MIN_TIMEOUT_MS} (holders beat every "
            f"{BEAT_MS} ms, and a loaded host delays a thread by tens of ms), got {heartbeat}"
        )
    huge_page = None
    if args.huge_pages:
        try:
            sizes, huge_page = hugepages.fit(pool_dir, sizes, JOURNAL_BYTES, args.guard_count)
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    return ServiceConfig(
        huge_page_size=huge_page,
        allowed_gid=_group_id(args.allow_gid) if args.allow_gid is not None else None,
        socket_path=socket_path,
        pool_dir=pool_dir,
        guard_count=args.guard_count,
        pool_sizes=sizes,
        compatibility_digest=digest,
        idle_timeout_s=args.idle_timeout_s,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        heartbeat_timeout_s=None if heartbeat is None else heartbeat / 1000,
    )


def _group_id(value: str) -> int:
    if value.isdigit():
        gid = int(value)
        if gid >= 1 << 32:
            raise FlagError(f"--allow-gid {value}: not a group id")
    else:
        try:
            gid = grp.getgrnam(value).gr_gid
        except KeyError:
            raise FlagError(f"--allow-gid {value}: no such group") from None
    # The socket and the group files are given to this group: only root or a member may.
    if os.geteuid() != 0 and gid not in (os.getegid(), *os.getgroups()):
        raise FlagError(f"--allow-gid {value}: this service's user is not in group {gid}")
    return gid


def _setup_logging(level_name: str | None) -> None:
    level = parse_level(level_name or os.environ.get("KVCR_LOG_LEVEL") or "INFO")
    logger = logging.getLogger("kvcr")
    logger.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(UtcFormatter())
    logger.handlers[:] = [handler]
    logger.propagate = False


async def _run(service: GuardService, log: Any) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("signal_received", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)


def serve(argv: list[str]) -> int:
    parser = serve_parser()
    args = parser.parse_args(argv)
    try:
        _setup_logging(args.log_level)
        config = service_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    log = get_logger("kvcr.guard")
    try:
        trio.run(_run, GuardService(config, log), log)
    except ServiceStartError as exc:
        log.error("service_start_failed", error=str(exc))
        print(f"kvcr-guard: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            return 0
        log.error("service_failed", error=repr(exc))
        print(f"kvcr-guard: the service failed: {exc!r}", file=sys.stderr)
        return 1
    return 0


def group_record(g: GroupStatus) -> dict[str, Any]:
    """One group as ``kvcr-guard status --json`` shows it."""
    return {
        "group": g.index,
        "state": g.state,
        "holder_pid": g.holder_pid,
        "control_port": g.control_port,
        "journal_blocks": g.journal_blocks,
        "journal_fill_percent": g.journal_fill_percent,
        "recovery_disabled": g.recovery_disabled,
        "fenced": g.fenced,
        "last_beat_ms": g.last_beat_ms,
        "served_blocks": g.served_blocks,
        "served_g3_blocks": g.served_g3_blocks,
        "layouts": [list(x) for x in g.layouts],
    }


def status_table(groups: list[GroupStatus]) -> str:
    rows = [
        (
            *("group", "state", "holder", "last beat", "fenced", "control port", "journal"),
            *("served", "layouts"),
        )
    ]
    for g in groups:
        if g.recovery_disabled:
            journal = "recovery disabled"
        elif g.journal_blocks is None:
            journal = "-"
        else:
            journal = f"{g.journal_blocks} blocks, {g.journal_fill_percent}% full"
        rows.append(
            (
                str(g.index),
                g.state,
                "-" if g.holder_pid is None else str(g.holder_pid),
                "-" if g.last_beat_ms is None else f"{g.last_beat_ms} ms ago",
                str(g.fenced),
                "-" if g.control_port is None else str(g.control_port),
                journal,
                f"{g.served_blocks} (G3 {g.served_g3_blocks})",
                ", ".join(f"{name or '<default>'}:{size}" for name, size in g.layouts) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows
    )


def status(argv: list[str]) -> int:
    args = _status_parser().parse_args(argv)
    client = KVCRClient(args.socket_path)
    client.timeout_s = args.timeout_s
    try:
        groups = client.status()
    except KVCRServiceError as exc:
        print(f"kvcr-guard status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        doc = [group_record(g) for g in groups]
        print(json.dumps({"socket_path": args.socket_path, "groups": doc}))
    else:
        print(status_table(groups))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        return status(argv[1:])
    return serve(argv)
