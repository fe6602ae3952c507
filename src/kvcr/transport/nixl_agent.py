"""One NIXL agent as kvcr sets it up: the only module that imports the nixl package.

:class:`NixlAgent` is the agent with its backend, the memory it registered (a prepared
descriptor per element, whose index is the descriptor index transfers name), and the peers
whose metadata it loaded, each connected while it is greeted and loaded again after a
failed transfer. Transfers over it, and why peers are loaded again: ``nixl.py``. Besides
it: UCX's TCP user timeout (one value per process, read when an agent starts), the agent
name inside NIXL metadata, and what NIXL's exceptions mean in words.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcr.transport.base import Segment, TransportError, XferState

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim, where it is installed instead
    # no-redef: the same two names, bound by whichever package is installed.
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

STATES = {"DONE": XferState.DONE, "PROC": XferState.PROC, "ERR": XferState.ERR}

# NIXL raises one exception class per status code and says nothing else ("NIXL_ERR_...").
_REASONS = {
    "nixlNotFoundError": "not found (a destination range outside the peer's registered "
    "memory, or an unknown peer)",
    "nixlInvalidParamError": "invalid parameter (descriptor sizes or indices)",
    "nixlRemoteDisconnectError": "the peer disconnected (its process is gone, or the link "
    "to it was down past the TCP user timeout)",
    "nixlNotAllowedError": "not allowed",
    "nixlBackendError": "backend error",
}

# get_agent_metadata() starts with the serialized agent name: the tag, a little-endian
# 8-byte length, the name, "|". add_peer needs the name before loading the metadata, to
# replace the metadata of a restarted peer (NIXL refuses to load it over the old one).
_MD_PREFIX = b"nixlSerDes|Agent"

USER_TIMEOUT_ENV = "UCX_TCP_USER_TIMEOUT"


def tcp_user_timeout(timeout_ms: int) -> tuple[str, str]:
    """Give this process's UCX a TCP user timeout of ``timeout_ms`` unless the environment
    already names one (the operator's, or an earlier agent's: UCX reads it when an agent
    starts, so it is one value per process). Returns the value in force and who set it."""
    current = os.environ.get(USER_TIMEOUT_ENV)
    if current is not None:
        return current, "environment"
    value = f"{int(timeout_ms)}ms"
    os.environ[USER_TIMEOUT_ENV] = value
    return value, "kvcr"


def _ucx_settings() -> str:
    """The UCX settings a failed start most often comes from, as set here."""
    named = [f"{k}={os.environ[k]!r}" for k in ("UCX_NET_DEVICES", "UCX_TLS") if k in os.environ]
    where = f" ({', '.join(named)})" if named else ""
    return f"; check that UCX_NET_DEVICES names this host's interfaces{where}"


def explain(exc: BaseException) -> str:
    """What a NIXL exception means, with its own text."""
    name = type(exc).__name__
    return f"{_REASONS.get(name, name)} [{exc}]"


def metadata_agent_name(metadata: bytes) -> str:
    """The agent name in NIXL agent metadata; TransportError if it is not metadata."""
    start = len(_MD_PREFIX) + 8
    if not isinstance(metadata, bytes) or not metadata.startswith(_MD_PREFIX):
        raise TransportError("peer metadata is not NIXL agent metadata")
    size = int.from_bytes(metadata[len(_MD_PREFIX) : start], "little")
    raw = metadata[start : start + size]
    if not 0 < size <= 256 or len(raw) != size or metadata[start + size : start + size + 1] != b"|":
        raise TransportError("peer metadata is not NIXL agent metadata (bad agent name)")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise TransportError("peer metadata is not NIXL agent metadata (bad agent name)") from None


class NixlAgent:
    """An agent without NIXL's progress thread (it spins a full core per agent, see
    nixl-on-cpu.md), with one backend."""

    def __init__(self, name: str, backend: str) -> None:
        self.name = name
        self.native: Any = nixl_agent(
            name, nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        try:
            self.native.create_backend(backend, {})
        except Exception as exc:
            raise TransportError(
                f"NIXL agent {name!r}: backend {backend!r} failed to start: {exc}{_ucx_settings()}"
            ) from exc
        self._registrations: list[Any] = []
        self.local: Any = None  # the prepared list of every registered element
        self._opened: list[Segment] | None = None  # what open_local registered
        self.count = 0  # descriptors in ``local``
        self.sizes: np.ndarray = np.zeros(0, dtype=np.int64)  # their sizes, by index
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata loaded for it
        self._broken: set[str] = set()  # peers a transfer failed to: loaded again before use

    def open_local(self, segments: Sequence[Segment]) -> bool:
        """Register ``segments`` and prepare a descriptor per element; False when there was
        nothing new to register (no segments, or the same segments again: a transport
        opened ahead of its runtime, the guard's standby)."""
        if self._opened is not None:
            if list(segments) != self._opened:
                raise TransportError(f"NIXL agent {self.name!r}: opened over other memory already")
            return False
        self._opened = list(segments)
        if not segments:
            return False  # nothing of ours to move: peers may still be served nothing
        for seg in segments:
            try:
                reg = self.native.register_memory([(seg.addr, seg.span, 0, seg.name)], "DRAM")
            except Exception as exc:
                raise TransportError(
                    f"NIXL agent {self.name!r}: registering {seg.name!r} "
                    f"({seg.span} bytes at {seg.addr:#x}) failed: {exc}"
                ) from exc
            self._registrations.append(reg)
        descs = np.concatenate(
            [
                np.stack(
                    [
                        seg.addr + np.arange(seg.count, dtype=np.int64) * seg.pitch,
                        np.full(seg.count, seg.element_size, dtype=np.int64),
                        np.zeros(seg.count, dtype=np.int64),
                    ],
                    axis=1,
                )
                for seg in segments
            ]
        )
        self.count = len(descs)
        self.sizes = descs[:, 1].copy()
        self.local = self.native.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        return True

    def metadata(self) -> bytes:
        """See ``NixlTransport.metadata``."""
        try:
            return bytes(self.native.get_agent_metadata())
        except Exception as exc:
            raise TransportError(f"NIXL agent {self.name!r}: no metadata: {explain(exc)}") from exc

    # -- peers -----------------------------------------------------------------------------

    def knows(self, peer: str) -> bool:
        return peer in self._peers

    def add_peer(self, metadata: bytes) -> str:
        """See ``NixlTransport.add_peer``."""
        name = metadata_agent_name(metadata)
        if name == self.name:
            raise TransportError(f"add_peer: the metadata is this agent's own ({name!r})")
        if self._peers.get(name) == metadata and name not in self._broken:
            return name
        if name in self._peers:
            self.remove_peer(name)
        try:
            loaded = self.native.add_remote_agent(metadata)
        except Exception as exc:
            unreachable = (
                " (UCX finds no way to its addresses: check UCX_NET_DEVICES and UCX_TLS "
                "on both hosts)"
                if type(exc).__name__ == "nixlBackendError"
                else ""
            )
            raise TransportError(
                f"add_peer: NIXL refused the metadata of peer {name!r}: {explain(exc)}{unreachable}"
            ) from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:  # the metadata format moved under us: fail loudly, not silently
            self.native.remove_remote_agent(loaded)
            raise TransportError(
                f"add_peer: metadata names {name!r} but NIXL loaded it as {loaded!r}"
            )
        try:
            self.native.make_connection(name)
        except Exception as exc:
            self.native.remove_remote_agent(name)
            raise TransportError(
                f"add_peer: NIXL could not connect to peer {name!r}: {explain(exc)}"
            ) from exc
        self._peers[name] = metadata
        return name

    def remove_peer(self, agent: str) -> None:
        """See ``NixlTransport.remove_peer``."""
        self._broken.discard(agent)
        if self._peers.pop(agent, None) is None:
            return
        try:
            self.native.remove_remote_agent(agent)
        except Exception as exc:
            raise TransportError(f"remove_peer {agent!r}: {explain(exc)}") from exc

    def mark_broken(self, peer: str) -> None:
        """A transfer to ``peer`` failed: NIXL keeps it disconnected until it is loaded
        again, before the next write to it (unknown peers are ignored)."""
        if peer in self._peers:
            self._broken.add(peer)

    def reconnect(self, peer: str, what: str) -> None:
        """Load a broken peer again (a no-op for a sound one). Until this succeeds (the link
        may still be down) it stays known and broken, and the next write tries again."""
        if peer not in self._broken:
            return
        with contextlib.suppress(Exception):  # not loaded any more is fine
            self.native.remove_remote_agent(peer)
        try:
            self.native.add_remote_agent(self._peers[peer])
            self.native.make_connection(peer)
        except Exception as exc:
            raise TransportError(
                f"{what}: peer {peer!r} is disconnected, and loading it again failed: "
                f"{explain(exc)}"
            ) from exc
        self._broken.discard(peer)

    def close(self) -> None:
        """Forget every peer, release the prepared list and deregister the memory."""
        for agent in list(self._peers):
            with contextlib.suppress(TransportError):
                self.remove_peer(agent)
        if self.local is not None:
            self.local.release()
        self.local = None
        while self._registrations:
            self.native.deregister_memory(self._registrations.pop())
        self.native = None
