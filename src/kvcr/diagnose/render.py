"""A report as a table for people, or as one JSON document for tickets (pure code)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from kvcr.diagnose.result import Report, Status

#: Names the JSON layout; bump it when a key changes meaning or goes away.
FORMAT = "kvcr-diagnose/1"


@attrs.frozen
class RunInfo:
    """Where and when the report was made."""

    kvcr_version: str
    hostname: str
    created_utc: str  # ISO 8601
    duration_s: float
    argv: tuple[str, ...]


def document(report: Report, run: RunInfo) -> dict[str, Any]:
    """The JSON document: stable top-level keys, checks keyed by name in the order they ran."""
    return {
        "format": FORMAT,
        "kvcr_version": run.kvcr_version,
        "hostname": run.hostname,
        "created_utc": run.created_utc,
        "duration_s": round(run.duration_s, 3),
        "argv": list(run.argv),
        "outcome": report.outcome,
        "exit_code": report.exit_code,
        "counts": report.counts(),
        "checks": {
            c.name: {
                "status": c.status.value,
                "summary": c.summary,
                "fix": c.fix,
                "details": dict(c.details),
            }
            for c in report.checks
        },
    }


def to_json(report: Report, run: RunInfo) -> str:
    # default=str: a details value that is not JSON (a Path) must not cost the ticket its record.
    return json.dumps(document(report, run), indent=2, default=str)


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def to_text(report: Report, run: RunInfo) -> str:
    lines = [
        f"kvcr diagnose: kvcr {run.kvcr_version} on {run.hostname}, {run.created_utc} "
        f"({run.duration_s:.1f} s)",
        "",
    ]
    rows = [("check", "status", "summary")]
    rows += [(c.name, c.status.value, c.summary) for c in report.checks]
    lines += table(rows)
    fixes = [c for c in report.checks if c.fix and c.status in (Status.FAIL, Status.WARN)]
    if fixes:
        lines += ["", "fixes:"]
        lines += [f"  {c.name} ({c.status.value}): {c.fix}" for c in fixes]
    for check in report.checks:
        if check.extra:
            lines += ["", f"{check.name}:"]
            lines += [f"  {line}" for line in check.extra]
    counts = ", ".join(f"{n} {status}" for status, n in report.counts().items())
    lines += ["", f"result: {report.outcome} ({counts}); exit code {report.exit_code}"]
    return "\n".join(lines)
