"""UCX as NIXL runs it here: its version and the transports and devices in use, and what
UCX offers on ``lo`` and on the interface that carries ``--host``."""

from __future__ import annotations

import os

import attrs

from kvcr.diagnose import netif, nixl_loader
from kvcr.diagnose.environment import net_devices_include
from kvcr.diagnose.result import CheckResult, Status
from kvcr.diagnose.ucp import Ucp, UcpError, bundled_library, loaded_libraries

NEEDED_TLS = "unset (or a list with tcp: peer error handling needs it)"


@attrs.frozen
class Ucx:
    """What every UCX check reads: the library (None, and why, when it cannot be asked),
    this machine's interfaces, and the operator's own UCX_NET_DEVICES (None: unset)."""

    ucp: Ucp | None
    problem: str | None
    interfaces: list[netif.Interface]
    operator_net_devices: str | None


def discover(defaults_applied: dict[str, str]) -> Ucx:
    interfaces = netif.interfaces()
    operator = None if "UCX_NET_DEVICES" in defaults_applied else os.environ.get("UCX_NET_DEVICES")
    try:
        nixl = nixl_loader.load()
    except nixl_loader.NixlUnavailable as exc:
        return Ucx(None, f"NIXL does not import ({exc})", interfaces, operator)
    # The wheel's own libucp, unless NIXL runs on another one (a NIXL built against the
    # system's UCX): then the one it mapped.
    mapped = loaded_libraries()
    path = bundled_library(nixl.path)
    if path is None or (mapped and path not in mapped):
        path = mapped[0] if mapped else None
    if path is None:
        return Ucx(None, f"no libucp loaded or next to {nixl.path}", interfaces, operator)
    try:
        return Ucx(Ucp(path), None, interfaces, operator)
    except UcpError as exc:
        return Ucx(None, str(exc), interfaces, operator)


def ucx_check(ucx: Ucx) -> CheckResult:
    if ucx.ucp is None:
        return CheckResult.warn(
            "ucx",
            f"UCX cannot be asked: {ucx.problem}",
            f"the UCX details are missing from this report; {nixl_loader.REINSTALL}",
        )
    try:
        in_use = ucx.ucp.resources()
    except UcpError as exc:
        return CheckResult.fail(
            "ucx",
            f"UCX {ucx.ucp.version()}: {exc}",
            "UCX rejects this process's configuration: check the UCX_* variables "
            "(the environment check lists them) and the UCX warnings on stderr",
            {"version": ucx.ucp.version(), "library": str(ucx.ucp.path)},
        )
    details = {
        "version": ucx.ucp.version(),
        "library": str(ucx.ucp.path),
        "in_use": in_use,
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
        "UCX_TLS": os.environ.get("UCX_TLS"),
    }
    summary = f"{details['version']}; in use: {', '.join(in_use) or 'nothing'}"
    transports = {r.partition("/")[0] for r in in_use}
    if "tcp" not in transports:
        return CheckResult.fail(
            "ucx",
            summary,
            "UCX has no TCP transport, which NIXL's UCX backend needs: make "
            "UCX_NET_DEVICES name an interface that is up (lo on one host) and unset UCX_TLS",
            details,
        )
    if "cma" not in transports:
        return CheckResult.warn(
            "ucx",
            summary,
            "no CMA: same-host transfers fall back to TCP (~1.1 GB/s instead of ~5-9). CMA "
            "needs ptrace between the worker processes: /proc/sys/kernel/yama/ptrace_scope 0 "
            "or 1, and CAP_SYS_PTRACE in containers",
            details,
        )
    return CheckResult.ok("ucx", summary, details)


def _needed(device: str) -> dict[str, str]:
    return {
        "UCX_NET_DEVICES": f"{device} (alone, or in a list such as lo,{device})"
        if device != "lo"
        else "lo (alone, or in a list with the interfaces peers on other hosts use)",
        "UCX_TLS": NEEDED_TLS,
    }


def _device_check(
    name: str, ucx: Ucx, interface: netif.Interface, why: str, details: dict[str, object]
) -> CheckResult:
    """Whether UCX offers TCP on ``interface`` and the operator's UCX_NET_DEVICES lets it."""
    device = interface.name
    details = {
        **details,
        "interface": device,
        "interface_up": interface.up,
        "needs": _needed(device),
    }
    if not interface.up:
        return CheckResult.fail(
            name,
            f"{why}: interface {device} is down",
            f"bring {device} up (`ip link set {device} up`), or use an address on an "
            "interface that is up",
            details,
        )
    offered: list[str] = []
    if ucx.ucp is not None:
        try:
            offered = ucx.ucp.resources(net_devices=device)
        except UcpError as exc:
            details["error"] = str(exc)
        details["transports"] = offered
        if f"tcp/{device}" not in offered:
            return CheckResult.fail(
                name,
                f"{why}: UCX offers no TCP transport on {device}",
                f"UCX cannot use {device}: unset UCX_TLS (or include tcp) and check the "
                "UCX warnings on stderr",
                details,
            )
    if ucx.ucp is None:
        summary = f"{why} (what UCX offers there is unknown: see the ucx check)"
    else:
        shared = sorted({r.partition("/")[0] for r in offered if r.endswith("/memory")})
        summary = f"{why}: tcp/{device}" + (f"; same host: {', '.join(shared)}" if shared else "")
    current = ucx.operator_net_devices
    details["UCX_NET_DEVICES"] = current
    if not net_devices_include(current, device):
        return CheckResult.warn(
            name,
            f"{summary}; UCX_NET_DEVICES={current} leaves {device} out",
            f"set UCX_NET_DEVICES={current},{device} (or add {device} to it) in the worker's "
            f"environment, or peers cannot reach it over {device}",
            details,
        )
    if current is None:
        summary += " (UCX_NET_DEVICES unset: every interface)"
    return CheckResult.ok(name, summary, details)


def lo_check(ucx: Ucx) -> CheckResult:
    lo = next((i for i in ucx.interfaces if i.loopback), None)
    if lo is None:
        return CheckResult.fail(
            "ucx_lo",
            "no loopback interface",
            "this network namespace has no loopback interface: `ip link set lo up`",
            {"interfaces": [attrs.asdict(i) for i in ucx.interfaces]},
        )
    return _device_check("ucx_lo", ucx, lo, "lo", {})


def host_check(ucx: Ucx, host: str | None) -> CheckResult:
    if host is None:
        return CheckResult.skipped("ucx_host", "no --host given")
    details: dict[str, object] = {"host": host}
    try:
        addresses = netif.resolve(host)
    except OSError as exc:
        return CheckResult.fail(
            "ucx_host",
            f"--host {host} does not resolve: {exc}",
            "pass an address of this machine (or a name that resolves to one) as --host",
            details,
        )
    details["addresses"] = addresses
    owners = [(a, netif.owner(a, ucx.interfaces)) for a in addresses]
    local = [(a, i) for a, i in owners if i is not None]
    if not local:
        mine = ", ".join(
            f"{i.name} {a}" for i in ucx.interfaces for a in i.addresses if not i.loopback
        )
        return CheckResult.fail(
            "ucx_host",
            f"--host {host} ({', '.join(addresses)}) is not an address of this machine",
            "--host is the address peers reach this worker at: pass one of this machine's "
            f"addresses ({mine or 'none but loopback'})",
            details,
        )
    address, interface = local[0]
    assert interface is not None
    named = host if host == address else f"{host} ({address})"
    result = _device_check("ucx_host", ucx, interface, f"{named} is on {interface.name}", details)
    # A host name that resolves to loopback (a common /etc/hosts entry) would be advertised
    # to peers on other hosts as an address they cannot reach.
    if result.status is Status.OK and interface.loopback and host not in (address, "localhost"):
        others = [a for i in ucx.interfaces if not i.loopback for a in i.addresses]
        return CheckResult.warn(
            "ucx_host",
            f"{result.summary}; the name {host} resolves to loopback",
            "peers on other hosts cannot reach a loopback address: pass the address they "
            f"reach this machine at as --host ({', '.join(others) or 'none configured'})",
            result.details,
        )
    return result
