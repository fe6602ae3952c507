"""A hold's tie to the guard service: the lease's *link* (the claim's connection, kept open
for the lease's life), the heartbeats sent on it, and re-attaching after the service died.

Theory of operation. The service never writes on a link; it only closes it (it died, or
it refused a beat). So the link's end is how a worker learns that its service is gone,
whether or not the service asks for heartbeats. The link belongs to one thread at a time:

- from the grant until a runtime keeps it, a thread of the hold's (``kvcr-guard-beat``)
  beats every ``beat_s`` and watches for the end; a bare hold keeps it for good, which
  proves that its process is alive;
- a KVCR runtime keeps it from its own loop (:meth:`Tie.keep`), so that a runtime stuck in
  a native call stops beating and gets fenced; when the runtime stops (its engine closes it,
  or it failed with the pools still held), the thread beats again until the hold is
  released, since the lease still lasts;
- when the link ends, :meth:`Tie.keep` says so (``lost``: the runtime stops journaling),
  then asks every :data:`REATTACH_FIRST_S` .. :data:`REATTACH_MAX_S` (doubling) for a claim
  with ``reattach``; once a restarted service grants it, the runtime resumes (``back``).
  A refusal is logged once per distinct reason and retried: the operator may restart the
  service with the right flags.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import attrs
import trio

from kvcr.errors import KVCRGuardProtocolError, KVCRServiceError
from kvcr.guard import protocol as wire

CHECK_S = 0.5  # how often the thread looks for the link's end when no beats are required
REATTACH_FIRST_S = 0.25
REATTACH_MAX_S = 4.0
THREAD_NAME = "kvcr-guard-beat"


@attrs.frozen
class Grant:
    """What a claim granted, as the tie needs it: the lease, its link, the beat interval."""

    lease: int
    link: socket.socket
    beat_s: float  # 0: the service requires no beats


class Tie:
    def __init__(self, index: int, grant: Grant, reattach: Callable[[], Grant], log: Any) -> None:
        """``reattach``: a blocking re-attach claim (raises KVCRServiceError)."""
        self.index = index
        self._reattach = reattach
        self.log = log
        self._lock = threading.Lock()  # one beat at a time; guards the fields below
        self._grant = grant
        self._seq = 0
        self.lost = False
        self._closed = False
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        grant.link.setblocking(False)
        self.start_thread()

    @property
    def lease(self) -> int:
        return self._grant.lease

    # -- one beat ------------------------------------------------------------------------

    def _tick(self) -> bool:
        """Beat once (when beats are required) and look for the link's end: False once it
        ended. A service that does not read (stopped, or slow) costs a skipped beat: its
        deadline judges, not this side."""
        with self._lock:
            if self.lost or self._closed:
                return not self.lost
            link = self._grant.link
            try:
                link.recv(1, socket.MSG_PEEK)  # returns only at EOF or with a refusal
                ended = True
            except BlockingIOError:
                ended = False
            except OSError:
                ended = True
            if not ended and self._grant.beat_s:
                beat = wire.Heartbeat(guard_index=self.index, lease=self.lease, seq=self._seq)
                self._seq += 1
                try:
                    link.send(wire.encode_frame(beat))
                except BlockingIOError:
                    pass
                except OSError:
                    ended = True
            if ended:
                self._mark_lost()
            return not ended

    def _mark_lost(self) -> None:
        if not self.lost:
            self.lost = True
            self.log.error(
                "guard_lost",
                group=self.index,
                lease=self.lease,
                reason="the guard service closed the lease's link (it stopped or died): "
                "serving goes on, recovery is off until the group is re-attached",
            )

    # -- the thread ----------------------------------------------------------------------

    def start_thread(self) -> None:
        """Beat from a thread of the hold's own (no runtime keeps the link)."""
        with self._lock:
            if self._thread is not None or self._closed or self.lost:
                return
            stop = self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._beat_in_thread, args=(stop,), name=THREAD_NAME, daemon=True
            )
            self._thread.start()

    def _beat_in_thread(self, stop: threading.Event) -> None:
        while not stop.wait(self._grant.beat_s or CHECK_S):
            if not self._tick():
                return

    def stop_thread(self) -> None:
        with self._lock:
            thread, stop = self._thread, self._stop
            self._thread = self._stop = None
        if thread is not None and stop is not None:
            stop.set()
            if thread is not threading.current_thread():
                thread.join()

    # -- the runtime's loop --------------------------------------------------------------

    async def keep(self, lost: Callable[[], None], back: Callable[[], None]) -> None:
        """Beat from the calling trio loop until cancelled; ``lost()`` when the link ends,
        ``back()`` once re-attached (both on this loop). Cancelled, the thread beats again."""
        self.stop_thread()
        try:
            while True:
                if not self.lost:
                    await self._beat_until_lost()
                lost()
                await self._reattach_until_granted()
                back()
        finally:
            self.start_thread()

    async def _beat_until_lost(self) -> None:
        while True:
            link, every = self._grant.link, self._grant.beat_s
            with trio.move_on_after(every or CHECK_S):
                await trio.lowlevel.wait_readable(link)  # the service never writes but to end
            if not self._tick():
                return

    async def _reattach_until_granted(self) -> None:
        delay, said = REATTACH_FIRST_S, None
        while True:
            await trio.sleep(delay)
            delay = min(2 * delay, REATTACH_MAX_S)
            try:
                grant = await trio.to_thread.run_sync(self._reattach)
            except KVCRGuardProtocolError as exc:  # a service that refuses: say why, once
                if str(exc) != said:
                    said = str(exc)
                    self.log.error("reattach_refused", group=self.index, reason=said)
                continue
            except KVCRServiceError as exc:  # none listens yet
                self.log.debug("reattach_failed", group=self.index, error=str(exc))
                continue
            grant.link.setblocking(False)
            with self._lock:
                old, self._grant = self._grant, grant
                self._seq, self.lost = 0, False
            old.link.close()
            self.log.warning("guard_reattached", group=self.index, lease=grant.lease)
            return

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """The lease is over (released): stop beating and close the link."""
        self.stop_thread()
        with self._lock:
            self._closed = True
            self._grant.link.close()

    def forget_in_child(self) -> None:
        """After ``fork``, in the child: the link is the parent's (no thread came along)."""
        self._closed = True
        self._thread = self._stop = None
        self._grant.link.close()
