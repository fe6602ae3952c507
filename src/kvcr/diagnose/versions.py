"""Versions and import paths: Python, kvcr (and whether it is the installed one), kvcr's
dependencies, and the engine-side packages (vLLM, torch and CUDA, Dynamo) where present."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import kvcr
from kvcr.diagnose import nixl_loader
from kvcr.diagnose.result import CheckResult
from kvcr.store.native import CORE_FILE


def python_check() -> CheckResult:
    uname = os.uname()
    details = {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "virtualenv": sys.prefix != sys.base_prefix,
        "kernel": f"{uname.sysname} {uname.release}",
        "machine": uname.machine,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
    }
    summary = (
        f"{details['version']} ({details['implementation']}) {sys.executable}; "
        f"{details['kernel']} {uname.machine}, {details['cpus_usable']} CPUs"
    )
    return CheckResult.ok("python", summary, details)


# -- kvcr --------------------------------------------------------------------------------------


def _direct_url(dist: importlib.metadata.Distribution) -> dict[str, Any]:
    text = dist.read_text("direct_url.json")
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def expected_package_dirs(dist: importlib.metadata.Distribution) -> list[Path]:
    """Where the distribution's files say the ``kvcr`` package lives: its own files for a
    regular install; for an editable one, the directories its ``.pth`` files add to
    ``sys.path`` (or the project's ``src/``)."""
    found: list[Path] = []
    for file in dist.files or []:
        if file.parts[:1] == ("kvcr",) and file.name == "__init__.py" and len(file.parts) == 2:
            found.append(Path(str(dist.locate_file(file))).parent)
        elif file.suffix == ".pth":
            pth = Path(str(dist.locate_file(file)))
            try:
                lines = pth.read_text().splitlines()
            except OSError:
                continue
            # .pth lines are directories to add (relative ones to the site directory), or
            # code ("import ...") to run.
            found += [
                pth.parent / line.strip() / "kvcr"
                for line in lines
                if line.strip() and not line.startswith("import")
            ]
    url = _direct_url(dist)
    if not found and url.get("dir_info", {}).get("editable"):
        project = Path(unquote(urlparse(str(url.get("url", ""))).path))
        found += [project / "src" / "kvcr", project / "kvcr"]
    return [p.resolve() for p in found]


def kvcr_check() -> CheckResult:
    imported = Path(kvcr.__file__ or "kvcr").resolve().parent
    try:
        dist = importlib.metadata.distribution("kvcr")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult.fail(
            "kvcr",
            f"imported from {imported}, but no kvcr distribution is installed",
            "install kvcr into this environment (`uv sync` in a checkout, or `pip install "
            "kvcr`), or run with the Python of the environment that has it",
            {"import_path": str(imported), "version": None},
        )
    url = _direct_url(dist)
    editable = bool(url.get("dir_info", {}).get("editable"))
    expected = expected_package_dirs(dist)
    details = {
        "version": dist.version,
        "import_path": str(imported),
        "distribution_path": str(Path(str(dist.locate_file(""))).resolve()),
        "expected_paths": [str(p) for p in expected],
        "editable": editable,
        "direct_url": url.get("url"),
        # Loaded, or ``import kvcr`` would have failed (store/native.py): which build.
        "compiled_core": CORE_FILE,
    }
    install = "editable install" if editable else "installed"
    if imported not in expected:
        return CheckResult.fail(
            "kvcr",
            f"{dist.version} imported from {imported}, but the installed kvcr is at "
            f"{', '.join(map(str, expected)) or 'an unknown place'}",
            "another kvcr shadows the installed one: run from outside the source tree, "
            "check PYTHONPATH and sys.path, or reinstall kvcr into this environment",
            details,
        )
    return CheckResult.ok("kvcr", f"{dist.version} from {imported} ({install})", details)


# -- dependencies ------------------------------------------------------------------------------

#: (distribution, module) pairs kvcr needs, besides NIXL.
REQUIRED = (("pyzmq", "zmq"), ("trio", "trio"), ("numpy", "numpy"))


def _module_path(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.origin not in (None, "namespace"):
        return str(Path(spec.origin).resolve().parent)
    locations = list(spec.submodule_search_locations or [])
    return str(locations[0]) if locations else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dependencies_check() -> CheckResult:
    packages: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    try:
        nixl = nixl_loader.load()
    except nixl_loader.NixlUnavailable as exc:
        packages["nixl"] = {"version": None, "path": None, "error": str(exc)}
        problems.append(f"NIXL does not import ({exc})")
    else:
        packages[nixl.distribution or "nixl"] = {
            "version": nixl.version,
            "path": nixl.path,
            "module": nixl.module,
        }
    for dist, module in REQUIRED:
        entry: dict[str, Any] = {"version": _version(dist), "path": _module_path(module)}
        try:
            imported = importlib.import_module(module)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            problems.append(f"{module} does not import ({entry['error']})")
        else:
            entry["path"] = str(Path(imported.__file__ or module).resolve().parent)
            if module == "zmq":
                entry["libzmq"] = imported.zmq_version()
        packages[dist] = entry
    summary = ", ".join(
        f"{name} {entry['version'] or '?'}"
        + (f" (libzmq {entry['libzmq']})" if "libzmq" in entry else "")
        for name, entry in packages.items()
    )
    details = {"packages": packages}
    if problems:
        return CheckResult.fail("dependencies", "; ".join(problems), nixl_loader.REINSTALL, details)
    return CheckResult.ok("dependencies", summary, details)


# -- the engine's side -------------------------------------------------------------------------

#: (label, distributions to try, module): reported when installed, never required.
OPTIONAL = (
    ("vllm", ("vllm",), "vllm"),
    ("torch", ("torch",), "torch"),
    ("dynamo", ("ai-dynamo", "ai-dynamo-runtime", "dynamo"), "dynamo"),
)


def _cuda() -> dict[str, Any]:
    """CUDA as torch sees it. Only called when torch is installed: importing it is the
    only way to ask, and kvcr itself never needs torch."""
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:
        return {"error": f"torch does not import: {type(exc).__name__}: {exc}"}
    cuda: dict[str, Any] = {"torch_cuda": getattr(torch.version, "cuda", None)}
    try:
        cuda["available"] = bool(torch.cuda.is_available())
        if cuda["available"]:
            count = int(torch.cuda.device_count())
            cuda["devices"] = [str(torch.cuda.get_device_name(i)) for i in range(count)]
    except Exception as exc:
        cuda["error"] = f"{type(exc).__name__}: {exc}"
    return cuda


def optional_check() -> CheckResult:
    packages: dict[str, dict[str, Any] | None] = {}
    for label, dists, module in OPTIONAL:
        # find_spec, not import: vLLM and Dynamo are slow to import, and their presence
        # is all this reports.
        if importlib.util.find_spec(module) is None:
            packages[label] = None
            continue
        version = next((v for v in map(_version, dists) if v is not None), None)
        packages[label] = {"version": version, "path": _module_path(module)}
    cuda = _cuda() if packages["torch"] is not None else None
    parts = [
        f"{label} {entry['version'] or '?'}" if entry else f"{label} -"
        for label, entry in packages.items()
    ]
    if cuda is not None:
        if "error" in cuda:
            parts.append("CUDA ?")
        elif cuda.get("available"):
            parts.append(f"CUDA {cuda['torch_cuda']} ({len(cuda.get('devices', []))} GPUs)")
        else:
            parts.append(f"CUDA {cuda['torch_cuda'] or '-'} (no GPU visible)")
    summary = ", ".join(parts)
    if all(entry is None for entry in packages.values()):
        summary += " (none installed: fine for kvcr alone)"
    details = {"packages": packages, "cuda": cuda}
    if cuda is not None and "error" in cuda:
        return CheckResult.warn(
            "engine",
            summary,
            f"torch is installed but CUDA cannot be queried ({cuda['error']}): reinstall the "
            "engine's torch, or remove it where kvcr runs without an engine",
            details,
        )
    return CheckResult.ok("engine", summary, details)
