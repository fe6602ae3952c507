"""The guard service's claim rules and group states (pure: no sockets, files or clocks).

Theory of operation. The service owns ``count`` pool groups. A group is lent to one worker
at a time under a *lease*: a number, never reused, plus the pid of the holder. The first
granted claim fixes the group's *terms* (pool layout, G3 description, remote backend and
control address) for the group's life, because the pools' contents and the control endpoint
outlive any one worker; every later claim must present the same terms. The lease ends when
the holder releases it or when its process exits (the service learns that from the holder's
pidfd; see :mod:`kvcr.guard.service`).

When a holder *exits* (not when it releases), the service takes over: it serves the group's
committed blocks to peers on the group's endpoint (``serving``) until a new claim arrives,
then stops serving and hands the state back (``handing_back``) before the new lease starts.
A server that cannot stop in order (a transfer of it may still read the pools), or whose
runtime fails, leaves the group ``unusable``: it is never lent again by this service.

With ``--heartbeat-timeout-ms`` the holder's runtime must also beat on its claim's
connection; a holder silent for longer is *fenced*: the service SIGKILLs it (``fencing``)
and, once its process has exited, ends the lease as after any other exit and takes over.

A service that starts and finds a group file still mapped by a live worker (the service
before it died) adopts it ``detached``: nobody can claim it until that worker *re-attaches*
(a claim with ``reattach`` that hands over the file and the listener it holds), which fixes
the group's terms again; if the worker exits first, the group becomes ``idle``.

Every legal move of a group is in the table :data:`GROUP` (:mod:`kvcr.statetable`);
anything else is a bug and raises :class:`~kvcr.statetable.IllegalMove`. A refused claim
changes nothing.
"""

from __future__ import annotations

import attrs

from kvcr.guard.pools import JOURNAL_BYTES
from kvcr.guard.protocol import ClaimRequest, G3Description, GroupStatus
from kvcr.statetable import StrEnum, Table
from kvcr.store import journal


class GroupState(StrEnum):
    """A group's state; the value is what ``GroupStatus.state`` says on the wire
    (``protocol.GROUP_STATES``, in this order)."""

    IDLE = "idle"
    HELD = "held"
    SERVING = "serving"
    HANDING_BACK = "handing_back"
    UNUSABLE = "unusable"
    FENCING = "fencing"
    DETACHED = "detached"


class GroupEvent(StrEnum):
    """What happens to a group: a claim, its holder's release or exit, the service's own
    moves (takeover, stop, unsafe, handed back, fence), and a detached group's worker
    re-attaching or exiting (orphaned)."""

    CLAIM = "claim"
    TAKEOVER = "takeover"
    RELEASE = "release"
    HOLDER_EXIT = "holder_exit"
    STOP = "stop"
    UNSAFE = "unsafe"
    HANDED_BACK = "handed_back"
    FENCE = "fence"
    REATTACH = "reattach"
    ORPHANED = "orphaned"


_S, _E = GroupState, GroupEvent
GROUP: Table[GroupState, GroupEvent] = Table(
    "guard group",
    {
        _S.IDLE: {_E.CLAIM: _S.HELD, _E.TAKEOVER: _S.SERVING},
        _S.HELD: {_E.RELEASE: _S.IDLE, _E.HOLDER_EXIT: _S.IDLE, _E.FENCE: _S.FENCING},
        # SIGKILL sent; the lease ends when the process has exited (or released meanwhile).
        _S.FENCING: {_E.HOLDER_EXIT: _S.IDLE, _E.RELEASE: _S.IDLE},
        _S.SERVING: {_E.CLAIM: _S.HANDING_BACK, _E.STOP: _S.IDLE, _E.UNSAFE: _S.UNUSABLE},
        _S.HANDING_BACK: {_E.HANDED_BACK: _S.HELD, _E.STOP: _S.IDLE, _E.UNSAFE: _S.UNUSABLE},
        _S.UNUSABLE: {},
        _S.DETACHED: {_E.REATTACH: _S.HELD, _E.ORPHANED: _S.IDLE},
    },
)
CLAIMABLE = frozenset({GroupState.IDLE, GroupState.SERVING})


@attrs.frozen
class Refusal:
    """Why a claim (or a release) was refused: a protocol code and a message for humans."""

    code: str
    message: str


@attrs.frozen
class Terms:
    """What the group's first granted claim fixed."""

    layouts: tuple[tuple[str, int], ...]
    g3: G3Description | None
    backend: str
    control: tuple[str, int]  # as requested; port 0 = "any", then the bound port counts
    advertise: str | None = None  # the host peers use, if the claimant said


@attrs.frozen
class Lease:
    number: int
    pid: int


@attrs.define
class Group:
    index: int
    pool_sizes: tuple[int, ...]
    state: GroupState = GroupState.IDLE
    terms: Terms | None = None
    control_port: int | None = None  # the bound port of the group's listener, once bound
    lease: Lease | None = None
    unusable_reason: str | None = None

    def move(self, event: GroupEvent) -> None:
        self.state = GROUP.move(self.state, event, str(self.index))


def _same_control(
    terms: Terms, bound_port: int | None, host: str, port: int, advertise: str | None
) -> bool:
    if host != terms.control[0]:
        return False
    if advertise is not None and terms.advertise is not None and advertise != terms.advertise:
        return False
    return port in (terms.control[1], bound_port) or (port == 0 and terms.control[1] == 0)


class Groups:
    """All pool groups of one service and the rules that lend them."""

    def __init__(
        self, count: int, pool_sizes: list[int], digest: str, journal_bytes: int = JOURNAL_BYTES
    ) -> None:
        if count < 1:
            raise ValueError(f"guard count must be >= 1, got {count}")
        self.digest = digest
        self.journal_bytes = journal_bytes
        self.groups = [Group(index=i, pool_sizes=tuple(pool_sizes)) for i in range(count)]
        self._next_lease = 1

    def __getitem__(self, index: int) -> Group:
        return self.groups[index]

    def check_claim(self, request: ClaimRequest, peer_pid: int) -> Refusal | None:
        """The reason to refuse ``request`` from process ``peer_pid``, or None to grant it."""
        what = f"claim of group {request.guard_index}"
        if request.pid != peer_pid:
            return Refusal(
                "bad_request",
                f"{what}: request says pid {request.pid} but the connection is pid {peer_pid}",
            )
        if request.compatibility_digest != self.digest:
            return Refusal(
                "digest_mismatch",
                f"{what}: compatibility digest {request.compatibility_digest!r} does not match "
                f"the service's {self.digest!r}",
            )
        if not 0 <= request.guard_index < len(self.groups):
            return Refusal(
                "index_out_of_range",
                f"{what}: the service has {len(self.groups)} group(s), "
                f"indices 0..{len(self.groups) - 1}",
            )
        group = self.groups[request.guard_index]
        if request.reattach or group.state is GroupState.DETACHED:
            refusal = _check_reattach(what, group, request.reattach)
            if refusal is not None:
                return refusal
        elif group.state is GroupState.UNUSABLE:
            return Refusal(
                "held",
                f"{what}: the group cannot be lent again ({group.unusable_reason}); restart "
                "the service to reuse it",
            )
        elif group.state not in CLAIMABLE:
            holder = f" by pid {group.lease.pid}" if group.lease else ""
            return Refusal(
                "held",
                f"{what}: group is {group.state}{holder}; it is free again when the holder "
                "releases it or exits",
            )
        return self._check_layout(what, group, request) or self._check_terms(what, group, request)

    def _check_layout(self, what: str, group: Group, request: ClaimRequest) -> Refusal | None:
        sizes = group.pool_sizes
        if len(request.pool_layouts) != len(sizes):
            return Refusal(
                "layout_mismatch",
                f"{what}: {len(request.pool_layouts)} pool layout(s) given, the group has "
                f"{len(sizes)} pool(s) of {list(sizes)} bytes",
            )
        names = [name for name, _ in request.pool_layouts]
        if "" in names and len(names) > 1:
            return Refusal(
                "layout_mismatch",
                f"{what}: the unnamed pool ('') must be the only pool, layouts name {names}",
            )
        for (name, block), size in zip(request.pool_layouts, sizes):
            if block > size:
                return Refusal(
                    "layout_mismatch",
                    f"{what}: pool {name!r} block size {block} exceeds its pool of {size} bytes",
                )
        return self._check_journal(what, group, request)

    def _check_journal(self, what: str, group: Group, request: ClaimRequest) -> Refusal | None:
        """A full group must fit one snapshot in its journal, or recovery would be disabled
        once it fills: say so now, with the numbers, rather than at the overflow."""
        layouts = request.pool_layouts
        blocks = min(size // block for (_, block), size in zip(layouts, group.pool_sizes))
        g3 = request.g3
        g3_blocks = len(g3.paths) * (g3.capacity_bytes_per_file // layouts[0][1]) if g3 else 0
        need = journal.snapshot_bytes(blocks, len(layouts), g3_blocks)
        half = journal.half_bytes(self.journal_bytes)
        if need <= half:
            return None
        in_g3 = f" and its G3 files {g3_blocks}" if g3_blocks else ""
        return Refusal(
            "layout_mismatch",
            f"{what}: the group's pools hold {blocks} blocks{in_g3}; a snapshot of their keys "
            f"({journal.SIZING_KEY_BYTES}-byte keys) needs {need} bytes, and half of the "
            f"{self.journal_bytes}-byte recovery journal holds {half}: use larger blocks, "
            "smaller pools or more groups",
        )

    def _check_terms(self, what: str, group: Group, request: ClaimRequest) -> Refusal | None:
        terms = group.terms
        if terms is None:
            return None
        layouts = tuple(request.pool_layouts)
        if layouts != terms.layouts:
            return Refusal(
                "layout_mismatch",
                f"{what}: pool layouts {list(layouts)} differ from the group's "
                f"{list(terms.layouts)}",
            )
        if request.g3 != terms.g3:
            return Refusal(
                "g3_mismatch", f"{what}: G3 configuration {request.g3} differs from {terms.g3}"
            )
        if request.remote_fw_dram_backend != terms.backend:
            return Refusal(
                "backend_mismatch",
                f"{what}: remote backend {request.remote_fw_dram_backend!r} differs from the "
                f"group's {terms.backend!r}",
            )
        host, port = request.control_host, request.control_port
        if not _same_control(terms, group.control_port, host, port, request.control_advertise):
            bound = f"{terms.control[0]}:{group.control_port}"
            return Refusal(
                "control_mismatch",
                f"{what}: control address {host}:{port} differs from the group's endpoint {bound}",
            )
        return None

    def grant(self, request: ClaimRequest, control_port: int) -> Lease:
        """Lend the group (check_claim returned None, and a serving group was handed back
        first); ``control_port`` is its bound listener. A re-attach fixes the terms anew:
        the service that fixed them before is gone."""
        group = self.groups[request.guard_index]
        if request.reattach:
            group.move(GroupEvent.REATTACH)
            group.terms = None
        else:
            handing_back = group.state is GroupState.HANDING_BACK
            group.move(GroupEvent.HANDED_BACK if handing_back else GroupEvent.CLAIM)
        if group.terms is None:
            group.terms = Terms(
                layouts=tuple(request.pool_layouts),
                g3=request.g3,
                backend=request.remote_fw_dram_backend,
                control=(request.control_host, request.control_port),
                advertise=request.control_advertise,
            )
        group.control_port = control_port
        group.lease = Lease(self._next_lease, request.pid)
        self._next_lease += 1
        return group.lease

    def move(self, index: int, event: GroupEvent) -> None:
        """A move the service makes itself: ``takeover``, ``claim`` of a serving group (it
        is being handed back), ``stop``."""
        self.groups[index].move(event)

    def detach(self, index: int, reason: str | None = None) -> None:
        """At start: the group's file is mapped by a live worker of a dead service (its
        terms are unknown until that worker re-attaches). With ``reason``, the file does not
        fit this service's flags: the group can never be lent by it."""
        group = self.groups[index]
        if reason is None:
            group.state = GroupState.DETACHED
        else:
            group.state, group.unusable_reason = GroupState.UNUSABLE, reason

    def fence(self, index: int, lease: int) -> bool:
        """Start fencing ``lease`` (its holder missed its heartbeat deadline); False if it
        already ended."""
        group = self.groups[index]
        if group.lease is None or group.lease.number != lease or group.state is not _S.HELD:
            return False
        group.move(GroupEvent.FENCE)
        return True

    def mark_unusable(self, index: int, reason: str) -> None:
        """The group's server could not stop in order (or failed): never lend it again."""
        group = self.groups[index]
        group.move(GroupEvent.UNSAFE)
        group.unusable_reason = reason

    def check_release(self, index: int, lease: int, peer_pid: int) -> Refusal | None:
        what = f"release of group {index} lease {lease}"
        if not 0 <= index < len(self.groups):
            return Refusal("index_out_of_range", f"{what}: no such group")
        current = self.groups[index].lease
        if current is None or current.number != lease:
            return Refusal("bad_request", f"{what}: not the group's current lease")
        if current.pid != peer_pid:
            return Refusal(
                "bad_request", f"{what}: held by pid {current.pid}, not by pid {peer_pid}"
            )
        return None

    def end_lease(self, index: int, lease: int, event: GroupEvent) -> bool:
        """End ``lease`` by ``event`` (``RELEASE`` or ``HOLDER_EXIT``); False if it already ended
        (a release and the holder's exit can race: the first one wins)."""
        group = self.groups[index]
        if group.lease is None or group.lease.number != lease:
            return False
        group.move(event)
        group.lease = None
        return True

    def status(self) -> list[GroupStatus]:
        return [
            GroupStatus(
                index=g.index,
                state=g.state.value,  # the wire's plain string
                holder_pid=g.lease.pid if g.lease else None,
                layouts=list(g.terms.layouts) if g.terms else [],
                control_port=g.control_port,
            )
            for g in self.groups
        ]


def _check_reattach(what: str, group: Group, reattach: bool) -> Refusal | None:
    """A detached group takes re-attaches only, and only a detached group takes them."""
    if group.state is GroupState.DETACHED and not reattach:
        return Refusal(
            "held",
            f"{what}: a live worker of the service that ran before still maps the group; it "
            "re-attaches on its own, and the group is free once that worker exits",
        )
    if group.state is not GroupState.DETACHED:
        return Refusal(
            "not_detached",
            f"{what} (re-attach): this service did not find the group mapped by a live "
            f"worker when it started (the group is {group.state}): it lends a new file, "
            "so restart the engine to claim it afresh",
        )
    return None
