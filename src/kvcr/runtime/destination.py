"""The destination side of a peer pull: ``deliver`` into engine memory and ``fetch`` into
local G2 from the peer a request's router hint names.

Either sends one ``Pull`` over a ready link (``links.py``) naming the keys and where to
write them, and waits, under the operation's deadline, for the source's NIXL notification
``Written`` (or an ``Over`` control message when the source writes nothing). A partial
answer is normal: the keys the source wrote succeed, the rest fail.

Memory the source may write stays held until the source confirms that it is done with the
pull: ``Written``, ``Over``, or a ``ProbeAck`` saying ``over``, or the source is known gone
(a new incarnation answered at its endpoint). When an operation gives up earlier (its
deadline, abort, close), its entries fail at once, the engine is told the memory is
``uncertain`` (before the FAILED entries), the source is probed with ``cancel``, probed again
at ``abandon_timeout_ms``, and ``quiesced`` follows the confirmation. The pull's states are
``lifecycle.PULL``; a ``move`` hint's confirmation is ``moves.py``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import trio

from kvcr.runtime.lifecycle import JobState, PullEvent, PullState, RemotePull
from kvcr.runtime.links import Links
from kvcr.runtime.local import LocalG2
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.moves import Unconfirmed
from kvcr.runtime.ops import DROPPED, FAILED, SUCCESS, Operation, Outbox
from kvcr.runtime.plane import Plane
from kvcr.runtime.timer import FAST_WINDOW_S
from kvcr.store.index import BlockIndex
from kvcr.telemetry import FUNNEL_COMPLETED, FUNNEL_PLANNED, FUNNEL_PUBLISHED, Telemetry
from kvcr.tracing import Phase
from kvcr.transport import messages as m
from kvcr.transport.base import TransportError
from kvcr.types import BlockKey, BlockMeta, CacheTier, OpEntryResult, PlacementAction

# A pull's data is due about when the source could have copied it at this rate; the
# destination polls fast until then (plus the window), slowly after.
EXPECTED_BYTES_PER_S = 5e9
_STORE = (PlacementAction.COPY_TO, CacheTier.LOCAL_G2)


class Destination:
    def __init__(
        self,
        *,
        plane: Plane,
        links: Links,
        index: BlockIndex,
        local: LocalG2 | None,
        memory: MemoryMap,
        outbox: Outbox,
        telemetry: Telemetry,
        log: Any,
    ) -> None:
        self.plane = plane
        self.links = links
        self.index = index
        self.local = local
        self.memory = memory
        self.outbox = outbox
        self.telemetry = telemetry  # the pulls' block funnel (telemetry.FUNNEL)
        self.log = log
        self.unconfirmed = Unconfirmed(log)
        self._reqs = itertools.count(1)

    # -- the engine's operations -------------------------------------------------------------

    async def deliver(
        self,
        op: Operation,
        destinations: Mapping[BlockKey, tuple[int, ...]],
        keys: Sequence[BlockKey],
        endpoint: str,
    ) -> None:
        pending = op.pending
        keys = [k for k in keys if k in pending]
        dst = self.memory.ranges([d for k in keys for d in destinations[k]])
        pull = await self._pull(op, endpoint, keys, dst, [])
        written = {keys[i] for i in pull.written} if pull is not None else set()
        answers = {k: SUCCESS if k in written else FAILED for k in keys if k in pending}
        self._answer(op, endpoint, pull, keys, answers)

    async def fetch(self, op: Operation, keys: Sequence[BlockKey], endpoint: str) -> None:
        local = self.local
        if local is None:
            op.failure = "fetch: this instance has no local DRAM pools to fetch into"
            self.outbox.answer(op, dict.fromkeys(keys, FAILED))
            return
        answers: dict[BlockKey, OpEntryResult] = {}
        accepted: list[BlockKey] = []
        for key in keys:
            if not op.live(key):
                continue
            meta = BlockMeta(key, self.memory.bytes_per_key, 0, None, frozenset())
            action, _ = local.decide_ingest(meta, CacheTier.REMOTE_G2, True, _STORE, None)
            if action is PlacementAction.DROP:
                answers[key] = DROPPED
            elif self.index.get(key) is not None:
                answers[key] = FAILED  # filled meanwhile by someone else: not ours to claim
            else:
                accepted.append(key)
        granted = local.reserve(len(accepted), f"fetch op {op.handle}") if accepted else 0
        for key in accepted[granted:]:
            answers[key] = FAILED
        self.outbox.answer(op, answers)
        now = trio.current_time()
        blocks = self.index.add_filling_batch(accepted[:granted], now)
        if not blocks:
            return
        for block in blocks:
            op.filling[block.key] = block
        bases = self.memory.pool_base
        dst = self.memory.ranges(
            [base + slot for b in blocks for base, slot in zip(bases, b.slots)]
        )
        keys = [b.key for b in blocks]
        released: set[int] = set()

        def free_withdrawn() -> None:
            # The source can no longer write: slots of records the operation gave up on
            # (withdrawn from the index) are free again.
            for block in blocks:
                if not self.index.holds(block) and id(block) not in released:
                    released.add(id(block))
                    self.index.release_slots(block)

        sent: list[RemotePull] = []
        try:
            pull = await self._pull(op, endpoint, keys, dst, sent, free_withdrawn)
        finally:
            if not sent:  # never asked for: nothing can write these slots
                for block in blocks:
                    if self.index.holds(block):
                        self.index.remove(block)
                        local.fill_waiters.over(block)
        for block in blocks:
            op.filling.pop(block.key, None)
        if pull is None:
            return  # never asked for: the blocks were removed above
        # Withdrawn blocks are left to free_withdrawn, which frees them once the source is over.
        written = {keys[i] for i in pull.written}
        fetched = local.commit_fetched(op, blocks, written, CacheTier.REMOTE_G2)
        if op.remote.no_retain:
            local.drop_at_release(a.release_handle for a in fetched.values() if a.success)
        self._answer(op, endpoint, pull, keys, fetched)

    def _answer(
        self,
        op: Operation,
        endpoint: str,
        pull: RemotePull | None,
        keys: Sequence[BlockKey],
        answers: Mapping[BlockKey, OpEntryResult],
    ) -> None:
        """Answer the pulled keys; a partial answer names the operation's failure (for its
        op_failed log), and a move pull waits for the engine to take its results."""
        succeeded = sum(1 for a in answers.values() if a.success)
        op.remote.moved += succeeded
        self.telemetry.count(FUNNEL_PUBLISHED, succeeded)
        if pull is not None and succeeded < len(pull.keys):
            self._partial(op, pull, succeeded, pull.reason or None)
        if succeeded < len(answers):
            missing = len(answers) - succeeded
            op.failure = op.failure or f"{op.kind}: the source lacked {missing} of the keys"
        if op.remote.move and pull is not None:
            indices = [
                i for i in pull.written if (a := answers.get(keys[i])) is not None and a.success
            ]
            if indices:
                self.unconfirmed.add(op.handle, endpoint, pull.req, indices)
        self.outbox.answer(op, answers)

    def confirm(self, handle: int) -> None:
        """The engine has taken every result of operation ``handle``: a move pull's source
        may now drop what it wrote."""
        entry = self.unconfirmed.pop(handle)
        if entry is None or self.plane.endpoint is None:
            return
        endpoint, req, indices = entry
        self.plane.send(
            endpoint, m.Confirm(self.plane.endpoint, self.plane.incarnation, req, indices)
        )
        self.plane.wake()

    # -- one pull --------------------------------------------------------------------------

    async def _pull(
        self,
        op: Operation,
        endpoint: str,
        keys: list[BlockKey],
        dst: list[tuple[int, int]],
        sent: list[RemotePull],
        on_over: Any = None,
    ) -> RemotePull | None:
        """Send the pull and wait for its answer; None if it could not be sent. ``sent``
        receives the pull once it is on its way (then the source may write)."""
        # Anything but keys written (nothing, an error, the deadline while setting up or
        # waiting) is a failed remote operation: it marks the request's hint failed.
        op.remote.failed = True
        self.telemetry.count(FUNNEL_PLANNED, len(keys))
        for attempt in (1, 2):
            try:
                pull = await self._send(op, endpoint, keys, dst)
            except TransportError as exc:
                op.failure = str(exc)
                return None
            sent.append(pull)
            if on_over is not None:
                pull.on_over.append(on_over)
            try:
                await pull.done.wait()
            finally:
                if not pull.done.is_set():
                    self._no_word(pull)
                    self._abandon(pull)
                    self._partial(op, pull, 0, "the destination gave up waiting for it")
                if op.phases is not None:
                    self._phases(op.phases, pull)
            # A pull turned away unread (by a restarted source's new incarnation, or by a
            # source that had no greeting from us) was never acted on: asking again, after
            # greeting the endpoint again, is safe (once).
            if not (pull.turned_away and attempt == 1):
                break
            self.log.info(
                "pull_resent",
                op=op.handle,
                endpoint=endpoint,
                xfer=self._xfer(pull),
                reason=pull.reason,
            )
        self.telemetry.count(FUNNEL_COMPLETED, len(pull.written))
        if pull.written:
            op.remote.failed = False
        else:
            op.failure = op.failure or f"{op.kind}: the source had none of the keys ({pull.reason})"
        return pull

    async def _send(
        self, op: Operation, endpoint: str, keys: list[BlockKey], dst: list[tuple[int, int]]
    ) -> RemotePull:
        """Send one pull once the link is ready. The pull is registered in ``op.xfers``
        until the source can no longer write."""
        if self.plane.endpoint is None:
            raise TransportError(
                f"{op.kind} op {op.handle}: the control channel has no endpoint to be answered at"
            )
        began = trio.current_time()
        link = await self.links.ready(op, endpoint)
        ready = trio.current_time()
        if op.phases is not None and ready > began:  # a link was set up for it
            op.phases.append(("peer_setup", began, ready, None))
        pull = RemotePull(next(self._reqs), link, link.incarnation, keys)
        nbytes = sum(n for _, n in dst)
        pull.due = trio.current_time() + nbytes / EXPECTED_BYTES_PER_S + FAST_WINDOW_S
        link.pulls[pull.req] = pull
        op.xfers[pull] = frozenset(keys)
        op.remote.xfer = self._xfer(pull)
        if self._debug():
            self.log.debug(
                "pull_sent", op=op.handle, endpoint=endpoint, xfer=op.remote.xfer, keys=len(keys)
            )
        pull.on_over.append(lambda: self.outbox.xfer_terminal(op, pull))
        self.plane.send(
            endpoint,
            m.Pull(
                self.plane.endpoint,
                self.plane.incarnation,
                link.incarnation,
                pull.req,
                cast("list[bytes]", keys),  # keys are bytes on the wire; Pull only reads them
                len(self.memory.block_sizes),
                m.Pull.pack(dst),
                op.remote.move,
            ),
        )
        if self.telemetry.enabled:
            pull.sent_at = trio.current_time()
        self.plane.wake()
        return pull

    def _partial(self, op: Operation, pull: RemotePull, published: int, reason: str | None) -> None:
        """One event per partial pull, with the funnel as this side saw it; the source's own
        stages are in its log under the same xfer (pull_written or source_write_failed:
        resident, held, keys submitted)."""
        self.log.info(
            "pull_partial",
            op=op.handle,
            xfer=self._xfer(pull),
            planned=len(pull.keys),
            completed=len(pull.written),
            published=published,
            reason=reason,
        )

    def _xfer(self, pull: RemotePull) -> str:
        return m.xfer_id(self.plane.incarnation, pull.req)

    def _debug(self) -> bool:
        """Whether debug events are on (they cost a render each, per pull, otherwise)."""
        return bool(self.log.isEnabledFor(logging.DEBUG))

    def _abandon(self, pull: RemotePull) -> None:
        """The operation gave up on ``pull`` while the source may still write: probe it
        (cancelling the pull if it has not started writing). Its memory stays held."""
        if pull.state is not PullState.SENT:
            return
        pull.move(PullEvent.GIVE_UP)
        self._probe(pull)

    def quarantine(self, op: Operation, pull: RemotePull) -> None:
        """``abandon_timeout_ms`` passed with no word from the source: say so, ask again."""
        pull.move(PullEvent.ABANDON_DEADLINE)
        self.log.warning(
            "pull_abandoned",
            op=op.handle,
            endpoint=pull.link.endpoint,
            xfer=self._xfer(pull),
            reason="no confirmation from the source by abandon_timeout_ms; memory stays held",
        )
        self._probe(pull)

    def _probe(self, pull: RemotePull) -> None:
        """Ask the source whether it is over with ``pull``, cancelling it if not started."""
        plane = self.plane
        assert plane.endpoint is not None  # _send sent nothing without one
        plane.send(pull.link.endpoint, m.Probe(plane.endpoint, plane.incarnation, pull.req, True))

    # -- the source's answers ----------------------------------------------------------------

    def _find_pull(self, endpoint: str, incarnation: int, req: int) -> RemotePull | None:
        """The pull ``req`` at ``endpoint``. Only an answer about one of our pulls in flight
        may reveal a restarted source; anything else is not evidence of a restart."""
        link = self.links.get(endpoint)
        if link is None or req not in link.pulls:
            return None
        if not self.links.note_incarnation(link, incarnation):
            return link.pulls.get(req) if link.incarnation == incarnation else None
        return link.pulls.get(req)

    def on_written(self, sender: str, msg: m.Written, since: float = 0.0) -> None:
        """The source's notification of pull ``msg.req``; ``since`` is the earliest time
        it can have reached this host unseen (the plane's previous poll of NIXL)."""
        pull = None
        for link in self.links.links.values():
            if link.agent == sender and link.incarnation == msg.incarnation:
                pull = link.pulls.get(msg.req)
                break
        if pull is None:
            self.plane.drop("unknown_written", f"{sender} req {msg.req}")
            return
        indices = sorted(set(msg.indices))
        if any(i >= len(pull.keys) for i in indices):
            self.plane.drop("bad_written", f"{sender} req {msg.req}: index out of range")
            pull.reason = "the source named keys it was not asked for"
            indices = []
        if self._debug():
            self.log.debug("pull_arrived", xfer=self._xfer(pull), keys=len(indices))
        waiting = pull.state is PullState.SENT  # not given up: its wait is timed here
        pull.finish(PullEvent.WRITTEN, indices, pull.reason)
        if pull.sent_at and waiting:
            # The source's completion -> this side has the word, on this host's clock: the
            # word cannot have waited longer than since the previous poll, nor arrived
            # before the pull left; its handling (the pull's finish) is included.
            start, now = max(since, pull.sent_at), trio.current_time()
            self.telemetry.record("notification", max(now - start, 0.0), "success")
            pull.notified = (min(start, now), now)

    def _phases(self, phases: list[Phase], pull: RemotePull) -> None:
        """A pull's child spans of its operation's span: the pull, sending to its end
        here (its transfer id names the source's span of it), and the notification."""
        attributes: dict[str, str | int] = {
            "kvcr.xfer": self._xfer(pull),
            "kvcr.keys": len(pull.keys),
            "kvcr.written": len(pull.written),
        }
        phases.append(("pull", pull.sent_at, trio.current_time(), attributes))
        if pull.notified is not None:
            phases.append(("notification", *pull.notified, None))

    def _no_word(self, pull: RemotePull) -> None:
        """The operation stopped waiting for ``pull`` before any word came: the notification
        phase failed after the whole wait (bounded by the operation's deadline)."""
        if pull.sent_at:
            waited = trio.current_time() - pull.sent_at
            self.telemetry.record("notification", max(waited, 0.0), "failed")

    def on_over(self, msg: m.Over) -> None:
        link = self.links.get(msg.sender)
        if (
            link is not None
            and link.incarnation
            and link.incarnation != msg.incarnation
            and msg.req in link.pulls  # a restarted source turning one of our pulls away
        ):
            self.links.note_incarnation(link, msg.incarnation)
            return
        pull = self._find_pull(msg.sender, msg.incarnation, msg.req)
        if pull is None:
            self.plane.drop("unknown_over", f"{msg.sender} req {msg.req}")
            return
        event = PullEvent.OVER
        if msg.reason in (m.NOT_GREETED, m.OTHER_INCARNATION):
            # The process at the endpoint never took our greeting (or not this pull): greet it
            # again before anything else is sent there.
            event = PullEvent.REFUSED_UNREAD
            if pull.link.ready.is_set():
                pull.link.ready = trio.Event()
        self._drain()
        pull.finish(event, [], msg.reason)

    def on_probe_ack(self, msg: m.ProbeAck) -> None:
        pull = self._find_pull(msg.sender, msg.incarnation, msg.req)
        if pull is None:
            return  # the pull ended meanwhile: a late answer is normal
        if msg.state == JobState.OVER:
            self._drain()
            pull.finish(PullEvent.PROBE_OVER, [], pull.reason or "the source dropped the pull")

    def _drain(self) -> None:
        """Apply what already reached this host of a write whose source has given up on it,
        before its memory is handed back: over TCP the data comes before the source's word
        (same path, in order) but may still wait in a socket for NIXL's next call."""
        try:
            self.plane.transport.progress()
        except TransportError as exc:
            self.log.warning("transport_progress_failed", error=str(exc))
