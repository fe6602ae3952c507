"""NIXL transfers between host memory and G3 files (the file tier's data path).

A NIXL agent of its own, with only the file backend (``POSIX`` on CPU-only machines, or
any NIXL file backend by name, with its options passed through), so that the peer agent's
UCX set-up is untouched. It registers the same host segments as the main transport, in the
same order, so descriptor indices mean the same thing in both; and the G3 files, each as
one FILE region. A transfer is one batch: host descriptors on one side, ``(file, offset,
size)`` ranges on the other, posted as one NIXL transfer (the agent names itself as the
remote, as NIXL wants for file I/O).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcr.transport.base import Segment, TransportError, XferState

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:  # the meta package's shim, where it is installed instead
    # no-redef: the same two names, bound by whichever package is installed.
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

_STATES = {"DONE": XferState.DONE, "PROC": XferState.PROC, "ERR": XferState.ERR}


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
        self._local: list[tuple[int, int]] = []  # descriptor index -> (address, size)
        self._files: list[tuple[int, int]] = []  # file index -> (fd, size)

    def open(self, segments: Sequence[Segment], files: Sequence[tuple[int, int]]) -> None:
        """Register the host segments (all their elements, in order) and the files."""
        try:
            if segments:
                self._registrations.append(
                    self._agent.register_memory([(s.addr, s.span, 0, "") for s in segments], "DRAM")
                )
            self._registrations.append(
                self._agent.register_memory([(0, size, fd, "") for fd, size in files], "FILE")
            )
        except Exception as exc:
            self.close()
            raise TransportError(f"G3: cannot register memory or files with NIXL: {exc}") from exc
        self._local = [
            (s.element_addr(i), s.element_size) for s in segments for i in range(s.count)
        ]
        self._files = list(files)

    def post(
        self, op: str, local: Sequence[int], ranges: Sequence[tuple[int, int]], what: str
    ) -> Any:
        """``op`` "WRITE" (host -> file) or "READ" (file -> host): local descriptor
        ``local[i]`` with file range ``ranges[i]`` = (file index, offset), same size."""
        try:
            host = [(*self._local[d], 0) for d in local]
            remote = [
                (offset, size, self._files[f][0])
                for (f, offset), (_, size) in zip(ranges, (self._local[d] for d in local))
            ]
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(host, "DRAM"),
                self._agent.get_xfer_descs(remote, "FILE"),
                self.agent_name,
            )
            state = self._agent.transfer(handle)
        except Exception as exc:
            raise TransportError(f"{what}: G3 {op.lower()} could not be posted: {exc}") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"{what}: G3 {op.lower()} failed at post")
        return handle

    def poll(self, xfer: Any) -> XferState:
        try:
            return _STATES[self._agent.check_xfer_state(xfer)]
        except Exception as exc:
            raise TransportError(f"G3 transfer failed: {exc}") from exc

    def release(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:
            raise TransportError(f"G3 transfer could not be released: {exc}") from exc

    def close(self) -> None:
        """Deregister everything. Only when no transfer is in flight."""
        while self._registrations:
            self._agent.deregister_memory(self._registrations.pop())
