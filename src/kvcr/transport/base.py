"""The transport interface the runtime uses.

A transport owns a set of local memory segments (KVCR pools and engine regions). Each
element of each segment is one descriptor; descriptors are numbered globally in segment
order, so a whole operation, whatever regions it touches, is one transfer: a list of
destination descriptor indices and a list of source descriptor indices of equal sizes.

The interface is synchronous and never waits: ``post_local_read`` (or ``post_write`` to a
peer) starts a transfer and ``poll`` reports its state. The runtime's progress task decides
when to poll. A peer write completes only while both sides call in: the source polls its
handle, the destination calls ``notifications`` (or ``progress``).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np


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

    def element_addrs(self) -> range:
        """The address of every element, in order."""
        return range(self.addr, self.addr + self.count * self.pitch, self.pitch)


class Descriptors:
    """The descriptors of ``segments``, numbered in segment order: address and size of
    each by arithmetic on its segment, with no table per element (a pool of a million
    slots costs nothing to describe, and nothing the garbage collector walks)."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        counts = [seg.count for seg in segments]
        self.count = sum(counts)
        self._starts = [0]
        for n in counts[:-1]:
            self._starts.append(self._starts[-1] + n)
        self._segments = list(segments)
        self._starts_np = np.array(self._starts, dtype=np.int64)
        self._addr_np = np.array([s.addr for s in segments], dtype=np.int64)
        self._pitch_np = np.array([s.pitch for s in segments], dtype=np.int64)
        self._size_np = np.array([s.element_size for s in segments], dtype=np.int64)

    def addr(self, desc: int) -> int:
        if not 0 <= desc < self.count:
            raise IndexError(f"descriptor {desc} is not one of {self.count}")
        i = bisect.bisect_right(self._starts, desc) - 1
        return self._segments[i].element_addr(desc - self._starts[i])

    def size(self, desc: int) -> int:
        if not 0 <= desc < self.count:
            raise IndexError(f"descriptor {desc} is not one of {self.count}")
        return self._segments[bisect.bisect_right(self._starts, desc) - 1].element_size

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    def lookup(self, descs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and sizes (int64) of ``descs``, each checked in range (IndexError
        naming the first that is not)."""
        return self.at(*self.locate(descs))

    def at(self, seg: np.ndarray, elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and sizes of elements located by :meth:`locate`."""
        return self._addr_np[seg] + elements * self._pitch_np[seg], self._size_np[seg]

    def locate(self, descs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The segment of each of ``descs`` and its element there (int64), each checked in
        range (IndexError naming the first that is not)."""
        if len(descs) and (descs.min() < 0 or descs.max() >= self.count):
            bad = descs[(descs < 0) | (descs >= self.count)][0]
            raise IndexError(f"descriptor {int(bad)} is not one of {self.count}")
        seg = np.searchsorted(self._starts_np, descs, side="right") - 1
        return seg, descs - self._starts_np[seg]


@runtime_checkable
class LocalDoneWord(Protocol):
    """A transport whose local copies end on threads of their own and say so on an fd
    (the NIXL transport's copy pool): the runtime waits for that word instead of polling."""

    def local_done_fd(self) -> int | None:
        """An fd readable once a local copy became terminal (None: no such word)."""

    def drain_local_done(self) -> None:
        """Clear the fd's readiness (the runtime then polls its local copies)."""


class XferPoller(Protocol):
    """What following a posted transfer needs (a :class:`Transport`, or the G3 file
    transport, which posts its own kind of transfer)."""

    def poll(self, xfer: Any) -> XferState: ...

    def release(self, xfer: Any) -> None: ...


class Transport(Protocol):
    agent_name: str

    def open_local(self, segments: Sequence[Segment]) -> None:
        """Register the segments and prepare their descriptors (once, at startup)."""

    # Transfer handles are opaque to the runtime and each transport has its own type (NIXL's
    # handle, the fake's FakeXfer): the interface types them as Any.

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> Any:
        """Copy descriptor ``src[i]`` into ``dst[i]`` for every i; returns a transfer handle.
        ``what`` names the operation for error messages."""

    # -- peers: destination-initiated writes (the destination sends its metadata and
    # addresses over the control channel; the source adds it and writes) ------------------

    def metadata(self) -> bytes:
        """This agent's metadata for a peer's ``add_peer``; take it after ``open_local``."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name. Idempotent for the same
        metadata; new metadata under a known name (a restarted peer) replaces the old."""

    def remove_peer(self, agent: str) -> None:
        """Forget a peer; its transfers still in flight end (``poll`` raises)."""

    def post_write(
        self,
        src: Sequence[int],
        dst: Sequence[tuple[int, int]],
        peer: str,
        notif: bytes,
        what: str,
    ) -> Any:
        """One write of local descriptor ``src[i]`` into the peer's ``dst[i]`` (address,
        size; the size must be the descriptor's), then ``notif`` to the peer, which sees it
        in ``notifications()`` only after all the data. Returns a transfer handle."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Drain the notifications that arrived: (sender agent name, message). Peers' writes
        into this agent complete only while it calls this (or ``progress``) regularly."""

    def progress(self) -> None:
        """Let the transport make progress without consuming notifications."""

    # -- transfers ---------------------------------------------------------------------------

    def poll(self, xfer: Any) -> XferState:
        """The transfer's state. May raise TransportError when the transfer failed with a
        reason (for example the peer died): it is then over, as with ERR."""

    def release(self, xfer: Any) -> None:
        """Free the handle of a terminal transfer. (On a transfer still in flight it tries
        to cancel it, and raises TransportError if it cannot.)"""

    def close(self) -> None:
        """Deregister memory and drop the agent. Only call when nothing is in flight."""
