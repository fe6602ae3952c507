"""The transport interface the runtime uses.

A transport owns a set of local memory segments (KVCR pools and engine regions). Each
element of each segment is one descriptor; descriptors are numbered globally in segment
order, so a whole operation, whatever regions it touches, is one transfer: a list of
destination descriptor indices and a list of source descriptor indices of equal sizes.

The interface is synchronous and never waits: ``post_local_read`` starts a transfer and
``poll`` reports its state. The runtime's progress task decides when to poll.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs


class XferState(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"

    @property
    def terminal(self) -> bool:
        return self is not XferState.PROC


class TransportError(RuntimeError):
    """The transport refused or lost a transfer; the message names the operation."""


@attrs.frozen
class Segment:
    """``count`` elements of ``element_size`` bytes, element ``i`` at ``addr + i * pitch``."""

    name: str
    addr: int
    element_size: int
    count: int
    stride: int = 0

    @property
    def pitch(self) -> int:
        return self.stride or self.element_size

    @property
    def span(self) -> int:
        return (self.count - 1) * self.pitch + self.element_size

    def element_addr(self, index: int) -> int:
        return self.addr + index * self.pitch


class Transport(Protocol):
    agent_name: str

    def open_local(self, segments: Sequence[Segment]) -> None:
        """Register the segments and prepare their descriptors (once, at startup)."""

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> object:
        """Copy descriptor ``src[i]`` into ``dst[i]`` for every i; returns a transfer handle.
        ``what`` names the operation for error messages."""

    def poll(self, xfer: object) -> XferState: ...

    def release(self, xfer: object) -> None:
        """Free the handle of a terminal transfer."""

    def close(self) -> None:
        """Deregister memory and drop the agent. Only call when nothing is in flight."""
