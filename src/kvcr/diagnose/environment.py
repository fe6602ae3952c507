"""The NIXL/UCX environment: the defaults of a CPU-only machine, and what is in force.

UCX and NIXL read these variables when the first agent of a process starts (NIXL's logger
when it is imported), so :func:`apply_defaults` must run before anything imports nixl.
"""

from __future__ import annotations

import fnmatch
import os

from kvcr.diagnose.redact import shown_value
from kvcr.diagnose.result import CheckResult

NAME = "environment"

#: The developer defaults (docs/dev-guide.md): set only where the environment has no value.
DEFAULTS = {"UCX_NET_DEVICES": "lo", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"}

_REPORTED_PREFIXES = ("UCX_", "NIXL_", "KVCR_")
_CHATTY_NIXL_LEVELS = {"TRACE", "DEBUG", "INFO"}


def apply_defaults() -> dict[str, str]:
    """Set :data:`DEFAULTS` where unset; returns the names this run set (name -> value)."""
    applied = {}
    for name, value in DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied


def net_devices_include(value: str | None, device: str) -> bool:
    """Whether a ``UCX_NET_DEVICES`` value lets UCX use network ``device``. Unset or
    ``all``: every device; ``^a,b``: all but those; otherwise a list (``*`` patterns)."""
    if value is None or value.strip() in ("", "all"):
        return True
    exclude = value.startswith("^")
    names = [n.strip() for n in value.lstrip("^").split(",") if n.strip()]
    # A device may be named with a port suffix (mlx5_0:1); interfaces never carry one.
    listed = any(fnmatch.fnmatchcase(device, n.split(":")[0]) for n in names)
    return listed != exclude


def reported() -> dict[str, str]:
    # Values that must not end up in a ticket (the peer cluster key) are masked.
    return {
        name: shown_value(name, value)
        for name, value in sorted(os.environ.items())
        if name.startswith(_REPORTED_PREFIXES)
    }


def check(applied: dict[str, str]) -> CheckResult:
    """What a NIXL agent started now would read, and the settings known to break it."""
    details = {
        "variables": reported(),
        "defaults_applied_by_diagnose": applied,
    }
    shown = [f"{n}={os.environ[n]}" for n in DEFAULTS]
    shown.append(f"UCX_TLS={os.environ['UCX_TLS']}" if "UCX_TLS" in os.environ else "UCX_TLS unset")
    summary = ", ".join(shown)
    if applied:
        summary += f" (defaults set here for {', '.join(sorted(applied))})"
    tls = os.environ.get("UCX_TLS")
    if tls is not None and not tls.strip():
        return CheckResult.fail(
            NAME, summary, "UCX_TLS is set but empty, which UCX rejects: unset UCX_TLS", details
        )
    if tls is not None and not _tls_allows_tcp(tls):
        return CheckResult.fail(
            NAME,
            summary,
            f"UCX_TLS={tls} leaves out tcp, and NIXL's UCX backend needs it for peer error "
            "handling (sm,self alone fails at backend creation): unset UCX_TLS",
            details,
        )
    if os.environ["NIXL_LOG_LEVEL"].strip().upper() in _CHATTY_NIXL_LEVELS:
        return CheckResult.warn(
            NAME,
            summary,
            f"NIXL_LOG_LEVEL={os.environ['NIXL_LOG_LEVEL']} makes NIXL print INFO lines on "
            "the engine's stdout: set NIXL_LOG_LEVEL=WARN",
            details,
        )
    return CheckResult.ok(NAME, summary, details)


def _tls_allows_tcp(value: str) -> bool:
    names = [n.strip() for n in value.lstrip("^").split(",")]
    if value.startswith("^"):
        return "tcp" not in names
    return "all" in names or "tcp" in names
