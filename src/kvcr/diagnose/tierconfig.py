"""The kvcr tier config of a deployment, wherever the operator points: given on the
command line, read from an engine's config file, or read from a running engine's command
line; and its control endpoints, bound and advertised, probed for an answer.

vLLM (and Dynamo's vLLM worker) take kvcr's config as one entry of
``--kv-transfer-config``'s ``kv_connector_extra_config.secondary_tiers``, the one whose
``type`` is ``"kvcr"``. An engine's config file is vLLM's ``--config`` file: YAML (or JSON)
whose keys are its flags, ``kv-transfer-config`` among them. A running engine's config is
what its ``/proc/PID/cmdline`` says: kvcr cannot ask vLLM for the config it holds, so a
config changed after the start, or set through Python, is not seen.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvcr.diagnose.control import endpoint_url
from kvcr.transport.auth import KEY_FILE_ENV

#: The flags that carry the tier config on an engine's command line (vLLM accepts either
#: spelling of a flag).
TRANSFER_FLAGS = ("--kv-transfer-config", "--kv_transfer_config")
CONFIG_FLAGS = ("--config",)
PROBE_TIMEOUT_S = 2.0
DEFAULT_CONTROL_HOST = "0.0.0.0"
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "*": "127.0.0.1", "": "127.0.0.1"}


class BadSource(ValueError):
    """A tier config source that cannot be read or holds no kvcr tier; the message names
    the flag and the resource."""


@attrs.frozen
class TierConfig:
    """``tier``: the kvcr tier's settings; ``source``: where they were found."""

    source: str
    tier: Mapping[str, Any]

    @property
    def guard_socket(self) -> str | None:
        path = self.tier.get("kvcr_service_socket_path")
        return path if isinstance(path, str) and path else None


@attrs.frozen
class EngineProcess:
    """A running engine as /proc shows it; ``environ`` unmasked (the caller masks it)."""

    pid: int
    exe: str | None
    cwd: str | None
    cmdline: tuple[str, ...]
    environ: Mapping[str, str]


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as json_error:
        try:
            import yaml  # type: ignore[import-untyped]  # vLLM's config files are YAML
        except ImportError:
            raise BadSource(
                f"{where}: not JSON ({json_error}), and reading YAML needs PyYAML, which "
                "this Python lacks (vLLM installs it: run kvcr diagnose with the engine's "
                "Python)"
            ) from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise BadSource(f"{where}: neither JSON nor YAML: {exc}") from None


def _read(path: Path, where: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise BadSource(f"{where}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise BadSource(f"{where}: {path} is not text") from None


def kvcr_tier(doc: Any, where: str) -> dict[str, Any]:
    """The kvcr tier in ``doc``: the tier itself, a kv-transfer-config, or an engine config
    file's mapping (``kv-transfer-config`` as a mapping or as JSON text)."""
    if not isinstance(doc, Mapping):
        raise BadSource(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("type") == "kvcr" or "control_ports" in doc:
        return dict(doc)
    for key in ("kv-transfer-config", "kv_transfer_config"):
        if key in doc:
            inner = doc[key]
            if isinstance(inner, str):
                inner = _parse(inner, f"{where}: {key}")
            return kvcr_tier(inner, f"{where}: {key}")
    extra = doc.get("kv_connector_extra_config")
    tiers = extra.get("secondary_tiers") if isinstance(extra, Mapping) else None
    if isinstance(tiers, Sequence):
        for tier in tiers:
            if isinstance(tier, Mapping) and tier.get("type") == "kvcr":
                return dict(tier)
        raise BadSource(
            f'{where}: kv_connector_extra_config.secondary_tiers has no tier of type "kvcr"'
        )
    raise BadSource(
        f"{where}: no kvcr tier: expected a tier (with control_ports), a kv-transfer-config "
        "(kv_connector_extra_config.secondary_tiers), or an engine config file with "
        "kv-transfer-config"
    )


def from_flag(value: str) -> TierConfig:
    """``--tier-config``: JSON text (an object) or the path of a JSON or YAML file."""
    where = "--tier-config"
    if value.lstrip().startswith("{"):
        return TierConfig(where, kvcr_tier(_parse(value, where), where))
    path = Path(value)
    return TierConfig(f"{where} {path}", kvcr_tier(_parse(_read(path, where), where), where))


def from_engine_config(value: str) -> TierConfig:
    """``--engine-config``: vLLM's ``--config`` file (YAML or JSON)."""
    where = f"--engine-config {value}"
    return TierConfig(where, kvcr_tier(_parse(_read(Path(value), where), where), where))


def _flag_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The value of the last of ``flags`` in ``argv`` (``--flag V`` or ``--flag=V``)."""
    found = None
    for i, arg in enumerate(argv):
        name, equals, rest = arg.partition("=")
        if name in flags:
            found = rest if equals else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def engine_process(pid: int) -> EngineProcess:
    where = f"--engine-pid {pid}"
    proc = Path("/proc") / str(pid)
    try:
        raw = (proc / "cmdline").read_bytes()
    except FileNotFoundError:
        raise BadSource(f"{where}: no such process") from None
    except OSError as exc:
        raise BadSource(f"{where}: cannot read its command line: {exc.strerror}") from None
    if not raw:
        raise BadSource(f"{where}: it has no command line (a kernel thread, or it has exited)")
    try:
        environ_raw = (proc / "environ").read_bytes()
    except OSError:  # another user's process: its command line is still world-readable
        environ_raw = b""
    environ = dict(
        entry.partition("=")[::2]
        for entry in environ_raw.decode(errors="surrogateescape").split("\0")
        if "=" in entry
    )

    def link(name: str) -> str | None:
        try:
            return os.readlink(proc / name)
        except OSError:
            return None

    cwd = link("cwd")
    key_file = environ.get(KEY_FILE_ENV)
    if key_file and cwd and not os.path.isabs(key_file):  # relative to the engine, not here
        environ[KEY_FILE_ENV] = os.path.join(cwd, key_file)
    cmdline = tuple(raw.decode(errors="surrogateescape").split("\0")[:-1])
    return EngineProcess(pid, link("exe"), cwd, cmdline, environ)


def from_engine(engine: EngineProcess) -> TierConfig:
    """``--engine-pid``: the engine's ``--kv-transfer-config``, or its ``--config`` file."""
    where = f"--engine-pid {engine.pid}"
    text = _flag_value(engine.cmdline, TRANSFER_FLAGS)
    if text is not None:
        source = f"{where} ({TRANSFER_FLAGS[0]} on its command line)"
        return TierConfig(source, kvcr_tier(_parse(text, source), source))
    config = _flag_value(engine.cmdline, CONFIG_FLAGS)
    if config is not None:
        path = Path(engine.cwd or "/") / config  # an absolute config path stays as it is
        source = f"{where} (--config {path})"
        return TierConfig(source, kvcr_tier(_parse(_read(path, source), source), source))
    raise BadSource(
        f"{where}: its command line has neither {TRANSFER_FLAGS[0]} nor --config "
        "(is it the engine's process? `pgrep -af 'vllm|dynamo'` lists candidates)"
    )


# -- endpoints ---------------------------------------------------------------------------------


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Whether a TCP connect to ``host:port`` succeeds (a wildcard host is probed on
    loopback, where a listener bound to it answers too)."""
    target = _WILDCARDS.get(host.strip("[]"), host.strip("[]"))
    record: dict[str, Any] = {"endpoint": endpoint_url(host.strip("[]"), port), "probed": target}
    try:
        infos = socket.getaddrinfo(target, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return {**record, "answers": False, "error": f"does not resolve: {exc}"}
    record["addresses"] = sorted({str(info[4][0]) for info in infos})
    started = time.monotonic()
    try:
        with socket.create_connection((target, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return {**record, "answers": False, "error": str(exc) or type(exc).__name__}
    return {**record, "answers": True, "connect_ms": round((time.monotonic() - started) * 1e3, 2)}


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def endpoints(tier: Mapping[str, Any], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Each rank's control endpoint as it binds and as peers are told to reach it, probed."""
    host = tier.get("control_host", DEFAULT_CONTROL_HOST)
    advertise = tier.get("control_advertise_host")
    record: dict[str, Any] = {
        "control_host": host,
        "control_advertise_host": advertise,
        # The adapter's default: peers are told this machine's host name.
        "advertise_default_used": advertise is None,
    }
    ports = tier.get("control_ports")
    if not isinstance(host, str) or not (advertise is None or isinstance(advertise, str)):
        return {**record, "error": "control_host and control_advertise_host must be strings"}
    if not isinstance(ports, list) or not ports or not all(map(_is_port, ports)):
        return {**record, "error": f"control_ports must be a list of ports, got {ports!r}"}
    advertised = advertise if advertise is not None else socket.gethostname()
    if advertised.strip("[]") in _WILDCARDS:
        record["advertise_error"] = (
            f"control_advertise_host {advertised!r} is a wildcard: peers cannot reach it"
        )
    try:
        wildcard = ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        wildcard = False
    record["bind_is_wildcard"] = wildcard
    record["ranks"] = [
        {
            "rank": rank,
            "port": port,
            "bind": probe(host, port, timeout_s),
            "advertised": probe(advertised, port, timeout_s),
        }
        for rank, port in enumerate(ports)
    ]
    return record
