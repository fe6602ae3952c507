"""NIXL transfers between host memory and G3 files (the file tier's data path).

A NIXL agent of its own, with only the file backend (``POSIX`` on CPU-only machines, or
any NIXL file backend by name, with its options passed through), so that the peer agent's
UCX set-up is untouched. It registers the same host segments as the main transport, in the
same order, so descriptor indices mean the same thing in both; and the G3 files, each as
one FILE region. A transfer is one batch: host descriptors on one side, file slots on the
other, posted as one NIXL transfer (the agent names itself as the remote, as NIXL wants for
file I/O).

Both sides are prepared once, as NIXL descriptor lists of every host element and every file
slot, and a transfer picks from them by index: building a 256-descriptor transfer from
address tuples costs ~330 µs of the ~2 ms a batch of 64 KiB blocks takes, picking ~50 µs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.nixl_agent import STATES, nixl_agent, nixl_agent_config


class NixlFileTransport:
    def __init__(self, agent_name: str, backend: str, options: dict[str, str]) -> None:
        self.agent_name = agent_name
        self._agent = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=False, backends=[])
        )
        try:
            self._agent.create_backend(backend, dict(options))
        except Exception as exc:
            raise TransportError(
                f"G3: NIXL file backend {backend!r} failed to start (options {options}): {exc}"
            ) from exc
        self._registrations: list[Any] = []
        self._prepared: list[Any] = []  # [host elements, file slots]

    def open(
        self, segments: Sequence[Segment], files: Sequence[tuple[int, int]], slots: Sequence[Any]
    ) -> None:
        """Register the host segments (at least one) and the files (``(fd, size)`` each),
        and prepare the descriptor lists: every host element, segment after segment, and the
        file slots as ``slots`` lists them (rows of ``(offset, size, fd, pitch, count)``: ``count`` slots
        of ``size`` bytes, ``pitch`` apart from ``offset`` in file ``fd``), whose order the
        slot indices of :meth:`post` refer to."""
        try:
            self._registrations.append(
                self._agent.register_memory([(s.addr, s.span, 0, "") for s in segments], "DRAM")
            )
            self._registrations.append(
                self._agent.register_memory([(0, size, fd, "") for fd, size in files], "FILE")
            )
            host = [(s.addr, s.element_size, 0, s.pitch, s.count) for s in segments]
            self._prepared = [
                self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(host, np.int64), "DRAM"),
                self._agent.prep_xfer_dlist(self.agent_name, np.array(slots, np.int64), "FILE"),
            ]
        except Exception as exc:
            self.close()
            raise TransportError(f"G3: cannot register memory or files with NIXL: {exc}") from exc

    def post(self, op: str, local: list[int], slots: list[int], what: str) -> Any:
        """``op`` "WRITE" (host -> file) or "READ" (file -> host) between host descriptor
        ``local[i]`` and prepared file slot ``slots[i]``, of the same size."""
        try:
            host, files = self._prepared
            handle = self._agent.make_prepped_xfer(op, host, local, files, slots)
            state = self._agent.transfer(handle)
        except Exception as exc:
            raise TransportError(f"{what}: G3 {op.lower()} could not be posted: {exc}") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"{what}: G3 {op.lower()} failed at post")
        return handle

    def poll(self, xfer: Any) -> XferState:
        try:
            return STATES[self._agent.check_xfer_state(xfer)]
        except Exception as exc:
            raise TransportError(f"G3 transfer failed: {exc}") from exc

    def release(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:
            raise TransportError(f"G3 transfer could not be released: {exc}") from exc

    def close(self) -> None:
        """Deregister everything. Only when no transfer is in flight."""
        while self._prepared:
            self._agent.release_dlist_handle(self._prepared.pop())
        while self._registrations:
            self._agent.deregister_memory(self._registrations.pop())
