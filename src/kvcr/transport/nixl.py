"""NIXL transport: the only module that imports nixl.

The agent runs without NIXL's progress thread (it spins a full core per agent, see
nixl-on-cpu.md); the runtime polls transfers instead, often while any is in flight and not
at all when idle. Local copies are loopback READs: the destination is the initiator's local
side, which measured ~1.4x faster than WRITE for the same descriptors on these machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcr.transport.base import Segment, TransportError, XferState

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim, where it is installed instead
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

_STATES = {"DONE": XferState.DONE, "PROC": XferState.PROC, "ERR": XferState.ERR}


class NixlTransport:
    def __init__(self, agent_name: str, backend: str = "UCX") -> None:
        self.agent_name = agent_name
        self._agent: Any = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        try:
            self._agent.create_backend(backend, {})
        except Exception as exc:
            raise TransportError(
                f"NIXL agent {agent_name!r}: backend {backend!r} failed to start: {exc}"
            ) from exc
        self._registrations: list[Any] = []
        self._local: Any = None
        self._loopback: Any = None
        self._count = 0

    def open_local(self, segments: Sequence[Segment]) -> None:
        for seg in segments:
            try:
                reg = self._agent.register_memory([(seg.addr, seg.span, 0, seg.name)], "DRAM")
            except Exception as exc:
                raise TransportError(
                    f"NIXL agent {self.agent_name!r}: registering {seg.name!r} "
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
        self._count = len(descs)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        self._loopback = self._agent.prep_xfer_dlist(self.agent_name, descs, "DRAM")

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> Any:
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local, list(dst), self._loopback, list(src)
            )
        except Exception as exc:
            raise TransportError(f"{what}: NIXL refused the transfer: {exc}") from exc
        state = self._agent.transfer(handle)
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"{what}: NIXL failed to post the transfer")
        return handle

    def poll(self, xfer: Any) -> XferState:
        return _STATES[self._agent.check_xfer_state(xfer)]

    def release(self, xfer: Any) -> None:
        self._agent.release_xfer_handle(xfer)

    def close(self) -> None:
        for handle in (self._local, self._loopback):
            if handle is not None:
                handle.release()
        self._local = self._loopback = None
        while self._registrations:
            self._agent.deregister_memory(self._registrations.pop())
        self._agent = None
