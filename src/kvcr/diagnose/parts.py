"""The parts of a diagnostic bundle, each a JSON value built from a finished ``kvcr
diagnose`` report and this process: versions, import paths, the environment (masked), a
running engine's process, the guard's status and the self-test. Unscrubbed: the bundle
scrubs every part before it writes it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from kvcr.diagnose import guard, redact, selftest, tierconfig
from kvcr.diagnose.result import CheckResult, Report
from kvcr.transport.auth import KEY_ENV, KEY_FILE_ENV

#: Top-level modules whose import location a ticket needs (a stray copy shadows one).
MODULES = (
    "kvcr",
    "nixl_cu13",
    "nixl",
    "zmq",
    "trio",
    "numpy",
    "attrs",
    "structlog",
    "vllm",
    "torch",
    "dynamo",
)
NVIDIA_SMI_TIMEOUT_S = 10.0


def _details(report: Report, name: str) -> Mapping[str, Any]:
    try:
        return report.get(name).details
    except KeyError:
        return {}


def check_record(check: CheckResult) -> dict[str, Any]:
    return {
        "check": check.name,
        "status": check.status.value,
        "summary": check.summary,
        "fix": check.fix,
        "details": dict(check.details),
    }


def _package(entry: Mapping[str, Any] | None) -> dict[str, Any]:
    """A package as the versions part shows it: present or not, and where."""
    if not entry:
        return {"present": False}
    present = entry.get("version") is not None or entry.get("path") is not None
    return {"present": present, **entry}


def nvidia_smi() -> dict[str, Any]:
    """The driver's view of CUDA: present only where ``nvidia-smi`` is."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return {"present": False}
    try:
        out = subprocess.run(
            [path], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"present": True, "path": path, "error": f"{type(exc).__name__}: {exc}"}
    found = {
        label: (match[1] if (match := re.search(pattern, out.stdout)) else None)
        for label, pattern in (
            ("driver_version", r"Driver Version:\s*(\S+)"),
            ("cuda_version", r"CUDA Version:\s*(\S+)"),
        )
    }
    record: dict[str, Any] = {"present": True, "path": path, "exit_code": out.returncode, **found}
    if out.returncode != 0:
        record["error"] = (out.stderr or out.stdout).strip()[-2000:]
    return record


def versions(report: Report) -> dict[str, Any]:
    """Python, kvcr, NIXL, UCX, kvcr's dependencies, vLLM, Dynamo, torch and CUDA: each
    ``present`` or not ("where present": a machine without an engine has none of those)."""
    python = _details(report, "python")
    kvcr = _details(report, "kvcr")
    deps = dict(_details(report, "dependencies").get("packages", {}))
    nixl_name = next((n for n in deps if n.startswith("nixl")), None)
    nixl = deps.pop(nixl_name) if nixl_name else None
    ucx = _details(report, "ucx")
    engine = _details(report, "engine")
    packages = engine.get("packages", {})
    return {
        "python": {
            "present": True,
            **{k: python.get(k) for k in ("version", "implementation", "executable")},
        },
        "kvcr": {
            "present": kvcr.get("version") is not None,
            **{k: kvcr.get(k) for k in ("version", "import_path", "editable", "compiled_core")},
        },
        "nixl": {"distribution": nixl_name, **_package(nixl)},
        "ucx": {"present": "version" in ucx, **{k: ucx.get(k) for k in ("version", "library")}},
        "dependencies": {name: _package(entry) for name, entry in deps.items()},
        "vllm": _package(packages.get("vllm")),
        "dynamo": _package(packages.get("dynamo")),
        "torch": _package(packages.get("torch")),
        "cuda": {"torch": engine.get("cuda"), "nvidia_smi": nvidia_smi()},
    }


def _origin(module: str) -> dict[str, Any]:
    """Where ``module`` would be imported from, without importing it (vLLM and torch take
    seconds, and this is only about the path)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return {"present": False, "error": f"{type(exc).__name__}: {exc}"}
    if spec is None:
        return {"present": False}
    return {
        "present": True,
        "origin": spec.origin,
        "search_locations": list(spec.submodule_search_locations or []),
    }


def import_paths(report: Report) -> dict[str, Any]:
    return {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "PYTHONPATH": os.environ.get("PYTHONPATH"),
        "sys_path": list(sys.path),
        "modules": {module: _origin(module) for module in MODULES},
        "kvcr_expected_paths": _details(report, "kvcr").get("expected_paths"),
        "ucx_library": _details(report, "ucx").get("library"),
    }


def key_record(environ: Mapping[str, str]) -> dict[str, Any]:
    """Whether a cluster key is configured and where from: never the key, never its size."""
    key, _ = redact.cluster_key(environ)
    source = next((name for name in (KEY_ENV, KEY_FILE_ENV) if environ.get(name)), None)
    return {"configured": source is not None, "source": source, "readable": key is not None}


def environment(applied: Mapping[str, str]) -> dict[str, Any]:
    return {
        "variables": redact.masked(os.environ),
        "defaults_applied_by_diagnose": dict(applied),
        "cluster_key": key_record(os.environ),
        "masked_names": redact.SECRET_NAME.pattern,
    }


def engine_process(engine: tierconfig.EngineProcess) -> dict[str, Any]:
    return {
        "pid": engine.pid,
        "exe": engine.exe,
        "cwd": engine.cwd,
        "cmdline": list(engine.cmdline),
        "environment": redact.masked(engine.environ),
        "environment_readable": bool(engine.environ),
        "cluster_key": key_record(engine.environ),
    }


def guard_status(report: Report, source: str | None) -> dict[str, Any]:
    check = report.get(guard.NAME)
    return {**check_record(check), "socket_from": source, "table": list(check.extra)}


def self_test(report: Report) -> dict[str, Any]:
    return check_record(report.get(selftest.NAME))
