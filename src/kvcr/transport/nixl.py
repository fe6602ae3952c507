"""NIXL transport for peers, with native copies in the process (the agent, its memory and
its peers: nixl_agent.py, the only module that imports nixl; G3 files: nixl_files.py).

The agent runs without NIXL's progress thread; the runtime polls transfers instead, often
while any is in flight and not at all when idle. Local copies do not go through NIXL: a
loopback transfer is CMA, which pins and walks every page (on 4 KiB pages, ~0.5x memcpy);
they are ``memmove``\\ s on copy threads (copier.py), polled like any transfer.

Peer writes (destination-initiated, the source writes): the destination hands its
``metadata()`` to the source over the control channel; the source ``add_peer``\\ s it and
posts one WRITE of local descriptors into the destination's addresses, with a notification
that the destination reads from ``notifications()``. Facts this relies on, measured with
UCX between two processes on one host (NIXL 1.5.1):

- The data moves inside ``transfer()`` (CMA, synchronous, ~9 GB/s), but the transfer only
  becomes DONE after a round trip: the destination must call into NIXL (any call:
  ``get_new_notifs``) and then the source must call ``check_xfer_state``, which sends the
  notification. So the notification always comes after the data, and both sides must keep
  calling in while a write is pending: the source ``poll``\\ s its handle, the destination
  calls ``notifications()`` (or ``progress()``).
- NIXL checks remote descriptors against the source's copy of the destination's metadata,
  not against live registrations: a destination that deregisters memory must send fresh
  metadata (``add_peer`` then replaces the old copy) for the check to follow.
- A dead destination makes the write end with an error (``transfer()`` or
  ``check_xfer_state`` raise ``nixlRemoteDisconnectError``, within ~5 ms of the death); a
  hung one (SIGSTOP) leaves it PROC.

Between hosts UCX moves the data over TCP, and a write does not end when the link does
(measured between two network namespaces, 1 GiB WRITEs, the link cut 0.1 s in):

- With UCX's defaults the write stays PROC for good. Released (or its peer removed) while
  the link is down, it is not cancelled: when the link returns, UCX sends the rest, and it
  lands in memory the destination may have handed back by then. So a peer write still in
  flight is never released here (``release`` refuses it): it ends on its own.
- With a TCP user timeout (``UCX_TCP_USER_TIMEOUT``) the connection is closed once data
  stays unacknowledged that long: the write ends with ``nixlRemoteDisconnectError``, and
  nothing of it lands afterwards. TCP checks the timeout when its retransmission timer
  fires: one to two timeouts after the data was last acknowledged (1.6-3.0 s at 2 s).
  Unless the operator set one, the first agent of the process sets it to the operation
  timeout (``tcp_user_timeout``): a stalled write mostly ends before ``abandon_timeout_ms``
  (at least twice as long), and a write that does not is held until it does.
- After such an error the agent keeps that peer marked disconnected, even once the link is
  back: every later write to it fails. A peer whose transfer failed is therefore loaded
  again (``remove_remote_agent``, ``add_remote_agent`` with the same metadata, a new
  connection) before the next write to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.copier import Copier, CopyJob, copy_threads
from kvcr.transport.nixl_agent import STATES, NixlAgent, explain, tcp_user_timeout

_DISCONNECT = "nixlRemoteDisconnectError"


class _Disconnected(TransportError):
    """NIXL refused to post a write: the peer's connection is broken."""


class NixlXfer:
    """A posted transfer: the NIXL handle and what error messages need."""

    __slots__ = ("done", "handle", "over", "peer", "remote", "what")

    def __init__(self, handle: Any, what: str, peer: str | None, remote: Any) -> None:
        self.done = False  # NIXL said DONE (at its posting or a poll): no need to ask again
        self.over = False  # NIXL said it is over, DONE or failed: safe to release
        self.handle = handle
        self.what = what
        self.peer = peer  # None for a local copy
        self.remote = remote  # the prepared remote descriptor list of a peer write

    def __repr__(self) -> str:
        return f"NixlXfer({self.what!r}, peer={self.peer!r})"


class NixlTransport:
    #: Poll with sub-millisecond timers (see runtime/timer.py).
    fine_timing = True

    def __init__(
        self,
        agent_name: str,
        backend: str = "UCX",
        copiers: int | None = None,
        user_timeout_ms: int | None = None,
    ) -> None:
        """``user_timeout_ms``: the TCP user timeout to give UCX (see the module docstring
        and :func:`tcp_user_timeout`); None leaves UCX's configuration as it is."""
        self.agent_name = agent_name
        self.user_timeout: tuple[str, str] | None = None
        if user_timeout_ms is not None:
            self.user_timeout = tcp_user_timeout(user_timeout_ms)
        self._copier = Copier(agent_name, copy_threads() if copiers is None else copiers)
        self._agent = NixlAgent(agent_name, backend)
        self._notifs: list[tuple[str, bytes]] = []  # drained by progress(), not yet handed out

    def open_local(self, segments: Sequence[Segment]) -> None:
        """Register ``segments`` and prepare a descriptor per element. Again with the same
        segments, nothing (a transport opened ahead of its runtime, the guard's standby)."""
        if self._agent.open_local(segments):
            self._copier.open(segments)

    def post_local_read(self, dst: Sequence[int], src: Sequence[int], what: str) -> CopyJob:
        """A copy inside this process: native, on the copy threads (see copier.py)."""
        return self._copier.post(dst, src, what)

    def local_done_fd(self) -> int | None:
        """An eventfd, readable once a local copy became terminal (see copier.py)."""
        return self._copier.fileno()

    def drain_local_done(self) -> None:
        """Clear :meth:`local_done_fd`'s readiness (the runtime then polls its copies)."""
        self._copier.drain()

    # -- peers -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's NIXL metadata for a peer's ``add_peer`` (~0.3 KiB + ~0.1 KiB per
        registered segment). Take it after ``open_local``: it describes only the memory
        registered when it is taken."""
        return self._agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata so that ``post_write`` can target it; returns its agent name.

        The same metadata again is a no-op. New metadata for a known agent name (a restarted
        peer, or a peer whose registrations changed) replaces the old: the old is removed
        first, which ends the transfers still in flight to that peer with an error.

        The connection to the peer is opened here (``make_connection``), while the peer is
        being greeted, so that its first transfer does not pay the one-time setup (10-20 ms
        warm, much more on a machine that just booted) inside an operation's deadline."""
        return self._agent.add_peer(metadata)

    def remove_peer(self, agent: str) -> None:
        """Forget a peer (unknown names are ignored). Transfers still in flight to it end:
        their ``poll`` raises TransportError; release them as usual."""
        self._agent.remove_peer(agent)

    def post_write(
        self,
        src: Sequence[int],
        dst: Sequence[tuple[int, int]],
        peer: str,
        notif: bytes,
        what: str,
    ) -> NixlXfer:
        """One WRITE: local descriptor ``src[i]`` to the peer's ``dst[i] = (addr, nbytes)``;
        ``nbytes`` must be that descriptor's size. The peer gets ``notif`` from
        ``notifications()`` after all the data. Returns a handle for ``poll``/``release``."""
        if not self._agent.knows(peer):
            raise TransportError(f"{what}: peer {peer!r} is not known (no add_peer)")
        self._agent.reconnect(peer, what)  # loaded again first if a transfer to it failed
        if len(src) != len(dst) or not src:
            raise TransportError(
                f"{what}: {len(src)} source descriptors for {len(dst)} destinations "
                f"at peer {peer!r}"
            )
        try:
            index = np.asarray(src, dtype=np.int64).reshape(len(src))
            pairs = np.asarray(dst, dtype=np.int64).reshape(len(dst), 2)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TransportError(
                f"{what}: malformed descriptors for peer {peer!r}: {exc}"
            ) from None
        bad = (index < 0) | (index >= self._agent.count)
        if bad.any():
            raise TransportError(
                f"{what}: source descriptor {int(index[bad][0])} out of range "
                f"(0..{self._agent.count - 1}) for peer {peer!r}"
            )
        sizes = self._agent.sizes[index]
        wrong = np.flatnonzero((sizes != pairs[:, 1]) | (pairs[:, 0] <= 0))
        if wrong.size:
            i = int(wrong[0])
            raise TransportError(
                f"{what}: destination {i} at peer {peer!r} is {int(pairs[i, 1])} bytes at "
                f"{int(pairs[i, 0]):#x}, source descriptor {int(index[i])} is {int(sizes[i])} bytes"
            )
        remote_descs = np.zeros((len(pairs), 3), dtype=np.int64)
        remote_descs[:, :2] = pairs
        try:
            return self._write(index, remote_descs, peer, notif, what)
        except _Disconnected:
            # Refused at post, so nothing of it moved: the connection went bad since the
            # last write (a link failure seen from the other direction, say). Load the peer
            # again and post once more, on fresh prepared lists.
            self._agent.mark_broken(peer)
            self._agent.reconnect(peer, what)
            return self._write(index, remote_descs, peer, notif, what)

    def _write(
        self, index: np.ndarray, remote_descs: np.ndarray, peer: str, notif: bytes, what: str
    ) -> NixlXfer:
        try:
            remote = self._agent.native.prep_xfer_dlist(peer, remote_descs, "DRAM")
        except Exception as exc:
            raise TransportError(
                f"{what}: NIXL refused the destination at peer {peer!r}: {explain(exc)}"
            ) from exc
        try:
            handle = self._agent.native.make_prepped_xfer(
                "WRITE",
                self._agent.local,
                index.astype(np.int32),
                remote,
                np.arange(len(remote_descs), dtype=np.int32),
                notif,
            )
        except Exception as exc:
            remote.release()
            raise TransportError(
                f"{what}: NIXL refused the write to peer {peer!r}: {explain(exc)}"
            ) from exc
        return self._post(NixlXfer(handle, what, peer, remote))

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived, as (sender agent name, message), in arrival order per
        sender. Calling this is also what lets peers' writes into this agent complete."""
        self.progress()
        out, self._notifs = self._notifs, []
        return out

    def progress(self) -> None:
        """Call into NIXL (connection setup, peers' writes into this agent) without handing
        out notifications: they are kept for the next ``notifications()``."""
        try:
            new = self._agent.native.get_new_notifs()
        except Exception as exc:
            raise TransportError(
                f"NIXL agent {self.agent_name!r}: reading notifications failed: {explain(exc)}"
            ) from exc
        for sender, messages in new.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            self._notifs.extend((name, bytes(message)) for message in messages)

    # -- transfers -------------------------------------------------------------------------

    def _post(self, xfer: NixlXfer) -> NixlXfer:
        try:
            state = self._agent.native.transfer(xfer.handle)
        except Exception as exc:
            self._drop(xfer)
            failed = _Disconnected if type(exc).__name__ == _DISCONNECT else TransportError
            raise failed(self._failed(xfer, "NIXL failed to post it", exc)) from exc
        if state == "ERR":
            self._drop(xfer)
            raise TransportError(self._failed(xfer, "NIXL failed to post it"))
        xfer.done = xfer.over = state == "DONE"
        return xfer

    def poll(self, xfer: NixlXfer | CopyJob) -> XferState:
        """The transfer's state. Raises TransportError when NIXL reports it failed with a
        reason (the peer died or was removed): it is then over, as with ERR; release it."""
        if type(xfer) is CopyJob:
            return xfer.state
        assert isinstance(xfer, NixlXfer)
        if xfer.done:  # every call into NIXL is a GIL hand-over (~15 µs next to a busy engine)
            return XferState.DONE
        try:
            state = STATES[self._agent.native.check_xfer_state(xfer.handle)]
        except Exception as exc:
            self._ended(xfer, failed=True)
            raise TransportError(self._failed(xfer, "the transfer failed", exc)) from exc
        if state is not XferState.PROC:
            self._ended(xfer, failed=state is XferState.ERR)
        return state

    def _ended(self, xfer: NixlXfer, failed: bool) -> None:
        """A poll found the transfer over. The peer of a failed one is loaded again before
        the next write to it."""
        xfer.over = True
        xfer.done = not failed  # a failed one keeps answering its failure when polled
        if failed and xfer.peer is not None:
            self._agent.mark_broken(xfer.peer)

    def release(self, xfer: NixlXfer | CopyJob) -> None:
        """Free the handle of a terminal transfer, or cancel a local copy still in flight.
        A peer write still in flight is refused (TransportError, the write stays in flight):
        UCX over TCP does not cancel it but resumes it when the link returns (see the
        module docstring)."""
        if type(xfer) is CopyJob:
            self._copier.release(xfer)
            return
        assert isinstance(xfer, NixlXfer)
        # A poll said whether it is over; Transfers.cancel asks without one, so ask NIXL.
        if xfer.peer is not None and not xfer.over and self._in_flight(xfer):
            raise TransportError(
                self._failed(xfer, "still in flight; a peer write is never cancelled")
            )
        try:
            self._agent.native.release_xfer_handle(xfer.handle)
        except Exception as exc:
            raise TransportError(self._failed(xfer, "NIXL could not release it", exc)) from exc
        if xfer.remote is not None:
            xfer.remote.release()
            xfer.remote = None

    def _in_flight(self, xfer: NixlXfer) -> bool:
        try:
            return bool(self._agent.native.check_xfer_state(xfer.handle) == "PROC")
        except Exception:  # it failed: over
            return False

    def _drop(self, xfer: NixlXfer) -> None:
        # if NIXL cannot release it, its handle wrapper keeps it for cleanup at agent exit
        with contextlib.suppress(TransportError):
            self.release(xfer)

    @staticmethod
    def _failed(xfer: NixlXfer, what_happened: str, exc: BaseException | None = None) -> str:
        where = "" if xfer.peer is None else f" to peer {xfer.peer!r}"
        reason = "" if exc is None else f": {explain(exc)}"
        return f"{xfer.what}{where}: {what_happened}{reason}"

    def close(self) -> None:
        self._copier.close()
        self._agent.close()
