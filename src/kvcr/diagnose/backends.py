"""Which NIXL backend plugins this installation has, and whether the two kvcr uses start:
UCX (host memory between workers) and POSIX (host memory to G3 files)."""

from __future__ import annotations

import os
from typing import Any

from kvcr.diagnose import nixl_loader
from kvcr.diagnose.result import CheckResult

NAME = "nixl_backends"

#: Backend -> what kvcr needs it for. Without UCX kvcr cannot run; without POSIX, no G3.
BACKENDS = {"UCX": "peer transfers", "POSIX": "G3 files"}

UCX_FIX = (
    "NIXL's UCX backend does not start: unset UCX_TLS, make UCX_NET_DEVICES name this "
    "host's interfaces (lo on one host), and check the UCX warnings on stderr"
)


def check() -> CheckResult:
    try:
        nixl = nixl_loader.load()
    except nixl_loader.NixlUnavailable as exc:
        return CheckResult.fail(NAME, f"NIXL does not import: {exc}", nixl_loader.REINSTALL)
    try:
        agent = nixl.agent(
            f"kvcr-diagnose-probe-{os.getpid()}",
            nixl.config(enable_prog_thread=False, backends=[]),
        )
    except Exception as exc:
        return CheckResult.fail(
            NAME,
            f"a NIXL agent does not start: {type(exc).__name__}: {exc}",
            "NIXL finds no plugins: check NIXL_PLUGIN_DIR (unset it to use the wheel's "
            f"plugins), then {nixl_loader.REINSTALL}",
            {"nixl_plugin_dir": os.environ.get("NIXL_PLUGIN_DIR")},
        )
    plugins = sorted(str(p) for p in agent.get_plugin_list())
    started: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        if backend not in plugins:
            started[backend] = {"ok": False, "error": "no such plugin"}
            continue
        try:
            agent.create_backend(backend, {})
        except Exception as exc:
            started[backend] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        else:
            mem_types = agent.get_backend_mem_types(backend)
            started[backend] = {"ok": True, "mem_types": [str(m) for m in mem_types]}
    del agent
    details = {
        "plugins": plugins,
        "backends": started,
        "nixl_plugin_dir": os.environ.get("NIXL_PLUGIN_DIR"),
    }
    loaded = [b for b, r in started.items() if r["ok"]]
    summary = f"{', '.join(loaded) or 'none'} start; plugins found: {', '.join(plugins)}"
    broken = [b for b, r in started.items() if not r["ok"]]
    if "UCX" in broken:
        return CheckResult.fail(NAME, f"UCX backend: {started['UCX']['error']}", UCX_FIX, details)
    if broken:
        backend = broken[0]
        use = BACKENDS[backend]
        return CheckResult.warn(
            NAME,
            f"{backend} backend: {started[backend]['error']} ({use} will not work)",
            f"kvcr needs the {backend} backend only for {use}; if you use them, "
            f"{nixl_loader.REINSTALL}",
            details,
        )
    return CheckResult.ok(NAME, summary, details)
