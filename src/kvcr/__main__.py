"""``kvcr`` (console script) and ``python -m kvcr``: kvcr's command line, one subcommand
per job. ``kvcr --help`` lists them; ``kvcr COMMAND --help`` describes one.

Exit codes: whatever the subcommand returns (see each), 2 for bad flags or an unknown
subcommand.
"""

from __future__ import annotations

import argparse
import sys

from kvcr import diagnose
from kvcr.diagnose.result import EXIT_BAD_FLAGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcr",
        description="kvcr's command line. The guard service is its own program, kvcr-guard.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    diagnose_parser = commands.add_parser(
        "diagnose",
        help="check this machine for kvcr and print a diagnostic record (--json for tickets, "
        "--bundle FILE for one archive)",
        description="Versions and import paths, NIXL backends, UCX transports and devices, "
        "a NIXL self-test, and optionally the control port and the guard service. Exit "
        "codes: 0 all checks ok (warnings allowed), 1 a check failed, 2 bad flags. With "
        "--bundle FILE: all of it, the tier config, its endpoints and a log's last minutes "
        "in one archive, secrets masked (0 written, 1 it cannot be, 2 bad flags).",
    )
    diagnose.add_arguments(diagnose_parser)
    diagnose_parser.set_defaults(run=diagnose.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or bad flags (2): argparse has printed why
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_FLAGS
    args.argv = argv
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
