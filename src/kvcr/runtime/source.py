"""The source side of peer reuse: serving a destination's pull.

A pull names keys and where to write them. The source claims the keys it holds in local
G2, reads those only its G3 holds into bounce slots (``staging.py``), asks the engine to
pin the others (``request_pin``), and writes everything it has in one NIXL WRITE whose
notification (``Written``) names what was written; when it writes nothing, or the write
fails, it sends ``Over`` instead. Claims, bounce slots and pins are released only when the
write is terminal (bounce slots: and the G3 read into them).

A pull is acted on at most once: the source remembers the requests it served, refused or
declared over in a probe answer, so a duplicate, or a pull that arrives after the probe the
destination sent when it gave up on it, is dropped instead of writing into memory the
destination may already have handed back.

Deadlines (``deadlines.Deadlines``; the states are ``lifecycle.JOB``): a pull still waiting for
pins or its G3 read ``operation_timeout_ms`` after its arrival is dropped (``Over``). A write is timed
from its posting: still running ``operation_timeout_ms`` later, it stalls this source,
which refuses new pulls until it ends; still running at ``abandon_timeout_ms``, it is
cancelled if the transport can (NIXL peer writes never are), otherwise the pinned engine
memory is ``uncertain``
(``TransferError``) and ``quiesced`` follows when the write is terminal. A destination's
``Probe`` with ``cancel`` drops a pull that has not started writing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from kvcr.config import KVCRConfig
from kvcr.runtime.bounce import BounceSlots
from kvcr.runtime.deadlines import Deadlines
from kvcr.runtime.g3 import G3Tier
from kvcr.runtime.lifecycle import (
    LATE,
    WRITING,
    JobEvent,
    JobState,
    MemoryState,
    SourceJob,
    wire_state,
)
from kvcr.runtime.local import LocalG2
from kvcr.runtime.memory import MemoryMap
from kvcr.runtime.moves import Copies
from kvcr.runtime.ops import Outbox
from kvcr.runtime.pins import Pins
from kvcr.runtime.plane import Plane
from kvcr.runtime.seen_pulls import SeenPulls
from kvcr.runtime.source_signals import SourceSignals
from kvcr.runtime.staging import Staging
from kvcr.runtime.transfers import WRITE_SETTLE_S, Transfers, Xfer
from kvcr.store.index import BlockIndex
from kvcr.telemetry import Telemetry
from kvcr.transport import messages as m
from kvcr.transport.base import Transport, TransportError
from kvcr.types import TransferError


class Source:
    def __init__(
        self,
        *,
        plane: Plane,
        transfers: Transfers[Transport],
        index: BlockIndex,
        local: LocalG2 | None,
        g3: G3Tier | None,  # its ready blocks are served too, through ``bounce``
        bounce: BounceSlots | None,
        pins: Pins,
        memory: MemoryMap,
        config: KVCRConfig,
        outbox: Outbox,
        telemetry: Telemetry,
        op_ids: Callable[[], int],  # the handles of the TransferErrors it reports
        log: Any,
    ) -> None:
        self.plane = plane
        self.transport = plane.transport
        self.transfers = transfers
        self.index = index
        self.local = local
        self.pins = pins
        self.memory = memory
        self.config = config
        self.outbox = outbox
        self.telemetry = telemetry
        self.signals = SourceSignals(telemetry, log)
        self.op_ids = op_ids
        self.log = log
        self.agents_by_incarnation: dict[int, str] = {}  # destinations we have metadata of
        self.jobs: dict[tuple[int, int], SourceJob] = {}  # (dst incarnation, req) -> job
        self.seen = SeenPulls()
        self.written_blocks = 0  # keys written to destinations, for the guard's metrics
        self.g3_blocks = 0  # ... of which read from G3 for the write
        self.staging = (
            Staging(g3=g3, slots=bounce, log=log) if g3 is not None and bounce is not None else None
        )
        self.moves = Copies(log)  # a move pull's copies, dropped when the destination confirms
        self.closing = False
        self._settled = trio.Event()  # set whenever a job leaves "pending"

    async def stop(self) -> None:
        """At close: refuse new pulls and drop those that have not started writing, and wait
        until they have released their claims and pins (writes in flight end on their own)."""
        self.closing = True
        for job in list(self.jobs.values()):
            if job.state is JobState.PENDING:
                job.scope.cancel()
        # A cancelled pin wait ends at its next checkpoint: this is bounded only for safety.
        with trio.move_on_after(self.config.operation_timeout_ms / 1000):
            while any(job.state is JobState.PENDING for job in self.jobs.values()):
                self._settled = trio.Event()
                await self._settled.wait()
            return
        self.log.error("source_stop_late", reason="pulls still preparing past the timeout")

    @property
    def writing(self) -> bool:
        return any(job.state in WRITING for job in list(self.jobs.values()))

    @property
    def stalled(self) -> bool:
        """A write ran past its operation timeout: this source refuses new pulls until the
        late writes end."""
        # list() copies in one step: get_stats reads this from an engine thread.
        return any(job.state in LATE for job in list(self.jobs.values()))

    def on_hello(self, msg: m.Hello) -> None:
        new = msg.incarnation not in self.agents_by_incarnation
        started = time.perf_counter()
        try:
            agent = self.transport.add_peer(msg.metadata)  # and connects to it (NIXL)
        except Exception as exc:
            self.plane.drop("bad_metadata", f"{msg.sender}: {exc}")
            return
        if new:  # how long a first contact took: on a cold machine, the evidence
            self.log.info(
                "peer_added",
                agent=agent,
                endpoint=msg.sender,
                connect_ms=round((time.perf_counter() - started) * 1000, 2),
            )
        for incarnation, name in list(self.agents_by_incarnation.items()):
            if name == agent and incarnation != msg.incarnation:
                del self.agents_by_incarnation[incarnation]  # that process is gone
                self.seen.forget(incarnation)
        self.agents_by_incarnation[msg.incarnation] = agent
        self.plane.send(
            msg.sender,
            m.HelloAck(
                self.plane.my_endpoint(),
                self.plane.incarnation,
                msg.incarnation,
                self.transport.agent_name,
            ),
        )
        self.plane.wake()

    def on_pull(self, msg: m.Pull) -> None:
        key = (msg.incarnation, msg.req)
        if not self.seen.add(msg.incarnation, msg.req):
            # Served, refused, or declared over already: the destination may be reusing the
            # memory by now. No answer: it has one, or its probe gets "over".
            self.plane.drop("duplicate_pull", f"{msg.sender} req {msg.req}")
            return
        reason = None
        agent = self.agents_by_incarnation.get(msg.incarnation)
        if msg.target != self.plane.incarnation:
            reason = m.OTHER_INCARNATION
        elif agent is None:
            reason = m.NOT_GREETED
        elif msg.pools != len(self.memory.block_sizes):
            reason = (
                f"the destination has {msg.pools} pools per key, this source has "
                f"{len(self.memory.block_sizes)}"
            )
        elif self.closing:
            reason = "this source is closing"
        elif self.stalled:
            reason = "this source's transfers are stalled; it refuses new writes"
        elif self.local is None and not self.memory.regions:
            reason = "this source has neither pools nor framework regions"
        if reason is not None:
            self.log.info(
                "pull_refused",
                endpoint=msg.sender,
                xfer=m.xfer_id(msg.incarnation, msg.req),
                keys=len(msg.keys),
                reason=reason,
            )
            self.plane.send(
                msg.sender,
                m.Over(self.plane.my_endpoint(), self.plane.incarnation, msg.req, reason),
            )
            return
        assert agent is not None  # no agent is a reason to refuse
        job = SourceJob(msg, agent, clock=Deadlines.starting(trio.current_time(), self.config))
        self.signals.started(job)
        self.jobs[key] = job
        job.scope.deadline = job.clock.deadline
        try:
            wanted = self._claim_local(job)
        except Exception as exc:  # a bug must not leak claims
            self.log.exception("source_job_failed", xfer=job.transfer_id, error=repr(exc))
            self._end_job(job, "the source failed to prepare the write")
            return
        staging = self.staging
        from_g3 = staging.wanted(job, wanted) if staging is not None else []
        job.found = len(wanted) + len(from_g3)
        if len(wanted) == len(msg.keys) or not (self.memory.regions or from_g3):
            # Everything is in local G2, or there is nowhere else to take the rest from
            # (no G3 block of it, no engine memory to pin): write now, without a task hop.
            self._post(job, wanted)
            return
        self.plane.spawn(self._serve, job, wanted, from_g3)

    def on_probe(self, msg: m.Probe) -> None:
        job = self.jobs.get((msg.incarnation, msg.req))
        state = wire_state(job.state) if job is not None else JobState.OVER
        if job is None:
            # "over" is a promise that this pull never writes: if the Pull itself is still
            # on its way (delayed, reordered behind this probe), it must be refused.
            self.seen.add(msg.incarnation, msg.req)
        if job is not None and state is JobState.PENDING and msg.cancel:
            job.scope.cancel()
            state = JobState.OVER
        self.plane.send(
            msg.sender,
            m.ProbeAck(self.plane.my_endpoint(), self.plane.incarnation, msg.req, state.value),
        )

    async def _serve(
        self, job: SourceJob, wanted: dict[int, list[int]], from_g3: list[int]
    ) -> None:
        try:
            await self._gather(job, wanted, from_g3)
        except Exception as exc:  # a bug must not leak claims, bounce slots or pins
            self.log.exception("source_job_failed", xfer=job.transfer_id, error=repr(exc))
            if job.state is JobState.PENDING:
                self._end_job(job, "the source failed to prepare the write")

    async def _gather(
        self, job: SourceJob, wanted: dict[int, list[int]], from_g3: list[int]
    ) -> None:
        """Read the keys ``from_g3`` into bounce slots and ask the engine to pin the keys
        held nowhere else, both under the pull's deadline, then write."""
        with job.scope:
            read = None
            if from_g3:
                assert self.staging is not None
                read = self.staging.read(job, from_g3)
            if self.memory.regions:  # G3 keys that got no bounce slot may be pinned
                await self._pin_missing(job, wanted, set(from_g3[: len(job.bounce)]))
            if read is not None:
                await read.done.wait()
        if job.scope.cancelled_caught:
            late = trio.current_time() >= job.clock.deadline
            self._end_job(job, "timed out preparing the write" if late else "cancelled")
            return
        for i, desc in job.staged.items():
            wanted[i] = [desc]
        self._post(job, wanted)

    async def _pin_missing(
        self, job: SourceJob, wanted: dict[int, list[int]], staged: set[int]
    ) -> None:
        """Ask the engine to pin the keys neither local G2 nor a G3 read (``staged``)
        provides."""
        keys = job.keys
        missing = [i for i in range(len(keys)) if i not in wanted and i not in staged]
        if not missing:
            return
        pin_started = trio.current_time()
        what = f"source write {job.transfer_id} to {job.agent}"
        pin = None
        try:
            pin = await self.pins.pin([keys[i] for i in missing], what)
        finally:  # a wait cut short (the destination's cancel, the deadline) failed too
            result = "success" if pin is not None else "failed"
            self.signals.phase(job, "framework_pin_wait", pin_started, trio.current_time(), result)
        if pin is not None:
            job.pins.append(pin)
            for i in missing:
                refs = pin.refs.get(keys[i])
                descs = self._resolve_pinned(refs) if refs is not None else None
                if descs is not None:
                    wanted[i] = descs
                    job.pinned_keys.append(keys[i])

    def _post(self, job: SourceJob, wanted: dict[int, list[int]]) -> None:
        """Write every wanted key whose destination ranges fit, in one transfer."""
        msg = job.msg
        job.held = len(wanted)
        self.signals.held(job)
        flat, pools, sizes = msg.ranges(), msg.pools, self.memory.block_sizes
        count = len(msg.keys)
        if len(wanted) == count and list(flat[1::2]) == sizes * count:
            # Every key is here and every range fits (the usual case): no per-key checks.
            src = [d for i in range(count) for d in wanted[i]]
            dst = list(zip(flat[0::2], flat[1::2]))
            self._write(job, src, dst, list(range(count)))
            return
        src = []
        dst = []
        indices: list[int] = []
        for i in sorted(wanted):
            entry = flat[2 * pools * i : 2 * pools * (i + 1)]
            if list(entry[1::2]) != sizes:
                self.plane.drop("bad_destination", f"req {msg.req}: sizes do not match key {i}")
                continue
            indices.append(i)
            src.extend(wanted[i])
            dst.extend(zip(entry[0::2], entry[1::2]))
        if not indices:
            self._end_job(job, "none of the keys is here")
            return
        self._write(job, src, dst, indices)

    def _claim_local(self, job: SourceJob) -> dict[int, list[int]]:
        wanted: dict[int, list[int]] = {}
        if self.local is None:
            return wanted
        now = trio.current_time()
        bases = self.memory.pool_base
        claim, claims = self.local.claim, job.claims
        for i, block in enumerate(self.index.ready_views(job.keys)):
            if block is not None:
                claim(block, now)
                claims.append(block)
                wanted[i] = [base + slot for base, slot in zip(bases, block.slots)]
        return wanted

    def _resolve_pinned(self, refs: object) -> list[int] | None:
        try:
            return list(self.memory.resolve_key("pin result", 0, b"", refs))
        except ValueError as exc:
            self.plane.drop("bad_pin_refs", str(exc))
            return None

    def _write(
        self,
        job: SourceJob,
        src: list[int],
        dst: list[tuple[int, int]],
        indices: list[int],
    ) -> None:
        msg = job.msg
        what = f"source write {job.transfer_id} to {job.agent}"
        notif = self.plane.auth.seal(m.encode(m.Written(self.plane.incarnation, msg.req, indices)))
        nbytes = sum(n for _, n in dst)

        def terminal(xfer: Xfer) -> None:
            self.signals.write_ended(job, trio.current_time(), xfer.ok, len(indices), nbytes)
            if xfer.ok:
                self.written_blocks += len(indices)
                if job.staged:
                    self.g3_blocks += sum(1 for i in indices if i in job.staged)
                if msg.move:
                    self.moves.written(job, indices)
                self._end_job(job, None)
            else:
                self._write_failed(job, len(indices), f"the write failed: {xfer.error}")

        timed = self.telemetry.enabled
        posting = trio.current_time() if timed else 0.0
        try:
            handle = self.transport.post_write(src, dst, job.agent, notif, what)
        except TransportError as exc:
            if timed:
                self.signals.phase(job, "transfer_post", posting, trio.current_time(), "failed")
            self._write_failed(job, len(indices), f"the write could not be posted: {exc}")
            return
        if timed:
            self.signals.phase(job, "transfer_post", posting, trio.current_time(), "success")
        self.signals.submitted(len(indices))
        job.move(JobEvent.POST)
        self._settled.set()
        job.write_clock = Deadlines.starting(trio.current_time(), self.config)
        job.xfer = self.transfers.track(handle, what, nbytes, terminal, settle_s=WRITE_SETTLE_S)
        if job.state in WRITING:  # (track ends a transfer that is already over at once)
            self.plane.spawn(self._watch_write, job)
        self.plane.wake()

    def on_confirm(self, msg: m.Confirm) -> None:
        """The destination of a move pull has the keys for good: drop our copies (those not
        being read right now; a reader's claim keeps its block)."""
        keys = self.moves.confirmed(msg.incarnation, msg.req, msg.sender, msg.indices)
        if keys is None:
            # Not a move we wrote (this process restarted since, or a stranger): keep all.
            self.plane.drop("unknown_confirm", f"{msg.sender} req {msg.req}")
            return
        if self.local is not None and keys:
            dropped = self.local.drop_unclaimed(keys, "moved")
            self.log.info(
                "move_confirmed",
                xfer=m.xfer_id(msg.incarnation, msg.req),
                keys=len(keys),
                dropped=len(dropped),
            )

    def _write_failed(self, job: SourceJob, keys: int, reason: str) -> None:
        """Say why in the log and to the destination (its op_failed names the reason)."""
        self.signals.write_failed(job, keys, reason)
        self._end_job(job, reason)

    async def _watch_write(self, job: SourceJob) -> None:
        """A write running past the operation timeout stalls this source; one still running
        at the abandon timeout is cancelled if the transport can; if not (a NIXL peer
        write), the engine's pinned memory is reported uncertain until it ends."""
        xfer, clock = job.xfer, job.write_clock
        assert xfer is not None and clock is not None
        with trio.move_on_at(clock.deadline):
            await xfer.done.wait()
        if xfer.done.is_set():
            return
        if not self.stalled:
            self.log.warning("source_stalled", to=job.agent, xfer=job.transfer_id)
        job.move(JobEvent.LATE)
        with trio.move_on_at(clock.abandon_at):
            await xfer.done.wait()
        if xfer.done.is_set():
            return
        if self.transfers.cancel(xfer):
            self.log.warning("source_write_cancelled", to=job.agent, xfer=job.transfer_id)
            return
        job.move(JobEvent.ABANDON_DEADLINE)
        handle = self.op_ids()
        if job.pinned_keys:
            self.outbox.report(self._source_error(job, handle, MemoryState.UNCERTAIN))
        await xfer.done.wait()
        if job.pinned_keys:
            self.outbox.report(self._source_error(job, handle, MemoryState.QUIESCED))

    def _source_error(self, job: SourceJob, handle: int, state: MemoryState) -> TransferError:
        """Only engine memory is reported: KVCR's own claimed slots are KVCR's to hold."""
        return TransferError(
            f"source write {job.transfer_id} to {job.agent}: still running past abandon_timeout_ms",
            handle,
            state=state.value,
            source_blocks=tuple(job.pinned_keys),
            source_owners=("framework",),
        )

    def _end_job(self, job: SourceJob, reason: str | None) -> None:
        """The write is over (or never happened): release claims and pins, tell the
        destination when it will get no notification."""
        was_stalled = self.stalled
        self.signals.ended(job, trio.current_time(), reason)
        job.move(JobEvent.END)
        self._settled.set()
        for block in job.claims:
            assert self.local is not None  # only local G2 blocks are claimed
            self.local.unclaim(block)
        job.claims.clear()
        for pin in job.pins:
            self.pins.release(pin)
        job.pins.clear()
        if self.staging is not None:
            self.staging.release(job)
        self.jobs.pop((job.msg.incarnation, job.msg.req), None)
        if reason is not None:
            self.plane.send(
                job.msg.sender,
                m.Over(self.plane.my_endpoint(), self.plane.incarnation, job.msg.req, reason),
            )
        if was_stalled and not self.stalled:
            self.log.info("source_recovered")
