"""``kvcr diagnose``: the flags, the checks in order, and the report on stdout (or, with
``--bundle``, in an archive: :mod:`kvcr.diagnose.bundle`).

Exit codes: 0 every check ok (warnings and skipped checks allowed), 1 a check failed,
2 bad flags (argparse). With ``--bundle``: 0 the archive is written, 1 it cannot be.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator

from kvcr.diagnose import (
    backends,
    bundle,
    control,
    environment,
    guard,
    network,
    render,
    selftest,
    tierconfig,
    versions,
)
from kvcr.diagnose.result import EXIT_BAD_FLAGS, EXIT_FAILED, CheckResult, Report

DEFAULT_SELF_TEST_MIB = 64
MAX_SELF_TEST_MIB = 1024
MAX_LOG_MINUTES = 7 * 24 * 60

CRASH_FIX = "this is a bug in kvcr diagnose: report it with the --json output"


def _int_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of minutes, got {text!r}") from None
    if not 0 < value <= MAX_LOG_MINUTES:
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_LOG_MINUTES}], got {text}")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document (for tickets) instead of a table",
    )
    parser.add_argument(
        "--host",
        type=_non_empty,
        default=None,
        help="this machine's address that peers reach the worker at: which interface carries "
        "it, what UCX offers there, and the --control-port check binds on it (default: lo "
        "only, 127.0.0.1)",
    )
    parser.add_argument(
        "--control-port",
        type=_int_in(1, 65535),
        default=None,
        metavar="PORT",
        help="check that a worker's peer control endpoint can bind this TCP port and pass a "
        "message over it",
    )
    parser.add_argument(
        "--guard-socket",
        type=_non_empty,
        default=None,
        metavar="PATH",
        help="the guard service's Unix socket (its --socket-path): show its status",
    )
    parser.add_argument(
        "--self-test-mib",
        type=_int_in(1, MAX_SELF_TEST_MIB),
        default=DEFAULT_SELF_TEST_MIB,
        metavar="N",
        help=f"size of each self-test buffer in MiB (default {DEFAULT_SELF_TEST_MIB})",
    )
    parser.add_argument(
        "--skip-self-test", action="store_true", help="skip the NIXL transfer self-test"
    )
    _add_bundle_arguments(parser)


def _add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "bundle", "one archive for a ticket (docs/operations.md, `kvcr diagnose --bundle`)"
    )
    group.add_argument(
        "--bundle",
        type=_non_empty,
        default=None,
        metavar="FILE",
        help="write every check, versions, import paths, the environment (secrets masked), "
        "the tier config and its endpoints, the guard's status and the last minutes of "
        "--log-path into this .tar.gz (a directory: a file named after host and time)",
    )
    sources = group.add_mutually_exclusive_group()
    sources.add_argument(
        "--tier-config",
        type=_non_empty,
        default=None,
        metavar="JSON|FILE",
        help="the kvcr tier config (or the whole --kv-transfer-config), as JSON or a file",
    )
    sources.add_argument(
        "--engine-config",
        type=_non_empty,
        default=None,
        metavar="FILE",
        help="the engine's config file (vLLM's --config YAML or JSON) holding kv-transfer-config",
    )
    sources.add_argument(
        "--engine-pid",
        type=_int_in(1, 2**22),
        default=None,
        metavar="PID",
        help="a running engine: its --kv-transfer-config or --config, and its environment (masked)",
    )
    group.add_argument(
        "--log-path",
        type=_non_empty,
        default=None,
        metavar="FILE",
        help="kvcr's log file (the engine's log, or the guard's): its last --log-minutes",
    )
    group.add_argument(
        "--log-minutes",
        type=_minutes,
        default=bundle.DEFAULT_LOG_MINUTES,
        metavar="N",
        help=f"minutes of --log-path up to its last line (default {bundle.DEFAULT_LOG_MINUTES})",
    )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While the checks run, whatever writes to stdout (NIXL's logger, native libraries)
    goes to stderr: stdout carries the report alone, so that --json output parses."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """A check that raises becomes a failed check: the rest of the report still matters."""
    try:
        return check()
    except Exception as exc:
        return CheckResult.fail(
            name, f"the check itself failed: {type(exc).__name__}: {exc}", CRASH_FIX
        )


def checks(args: argparse.Namespace, applied: dict[str, str]) -> list[CheckResult]:
    ucx: list[network.Ucx] = []

    def ucx_view() -> network.Ucx:
        if not ucx:  # after nixl_backends: the UCX library NIXL loaded is then mapped
            ucx.append(network.discover(applied))
        return ucx[0]

    mib = None if args.skip_self_test else args.self_test_mib
    plan: list[tuple[str, Callable[[], CheckResult]]] = [
        ("python", versions.python_check),
        ("kvcr", versions.kvcr_check),
        ("dependencies", versions.dependencies_check),
        ("engine", versions.optional_check),
        (environment.NAME, lambda: environment.check(applied)),
        (backends.NAME, backends.check),
        ("ucx", lambda: network.ucx_check(ucx_view())),
        ("ucx_lo", lambda: network.lo_check(ucx_view())),
        ("ucx_host", lambda: network.host_check(ucx_view(), args.host)),
        (selftest.NAME, lambda: selftest.check(mib)),
        (control.NAME, lambda: control.check(args.control_port, args.host)),
        (guard.NAME, lambda: guard.check(args.guard_socket)),
    ]
    return [_guarded(name, check) for name, check in plan]


def _kvcr_version() -> str:
    try:
        return importlib.metadata.version("kvcr")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _bundle_plan(
    args: argparse.Namespace, hostname: str, now: datetime.datetime
) -> bundle.Plan | int | None:
    """The bundle's plan, None without --bundle, or the exit code of a run that ends here."""
    if args.bundle is None:
        given = [f"--{n.replace('_', '-')}" for n in bundle.BUNDLE_ONLY if getattr(args, n)]
        if given:
            print(f"kvcr diagnose: {', '.join(given)} needs --bundle FILE", file=sys.stderr)
            return EXIT_BAD_FLAGS
        return None
    try:
        return bundle.prepare(args, hostname, now)
    except tierconfig.BadSource as exc:
        print(f"kvcr diagnose: {exc}", file=sys.stderr)
        return EXIT_BAD_FLAGS
    except bundle.CannotWrite as exc:
        print(f"kvcr diagnose: {exc}", file=sys.stderr)
        return EXIT_FAILED


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    now = datetime.datetime.now(datetime.timezone.utc)
    created = now.isoformat(timespec="seconds")
    hostname = socket.gethostname()
    plan = _bundle_plan(args, hostname, now)
    if isinstance(plan, int):
        return plan
    try:
        # Before anything imports NIXL: it and UCX read these once, when they start.
        applied = environment.apply_defaults()
        with _stdout_to_stderr():
            report = Report(checks(args, applied))
    except BaseException:
        if plan is not None:
            bundle.discard(plan)
        raise
    info = render.RunInfo(
        kvcr_version=_kvcr_version(),
        hostname=hostname,
        created_utc=created,
        duration_s=time.monotonic() - started,
        argv=tuple(args.argv),
    )
    if plan is not None:
        return bundle.write(plan, report, info, applied, as_json=args.json)
    print(render.to_json(report, info) if args.json else render.to_text(report, info))
    return report.exit_code
