"""The guard's claim rules and group states, without sockets or processes."""

from __future__ import annotations

import attrs
import pytest

from kvcr.guard.protocol import GROUP_STATES, ClaimRequest, G3Description
from kvcr.guard.rules import GROUP, Group, GroupEvent, Groups, GroupState
from kvcr.statetable import IllegalMove

S, E = GroupState, GroupEvent

PID = 4242


def request(**changes) -> ClaimRequest:
    fields = {
        "guard_index": 0,
        "pool_layouts": [("k", 4096), ("v", 4096)],
        "compatibility_digest": "d1",
        "control_host": "127.0.0.1",
        "control_port": 0,
        "g3": None,
        "remote_fw_dram_backend": "UCX",
        "pid": PID,
    }
    fields.update(changes)
    return ClaimRequest(**fields)


@pytest.fixture
def groups() -> Groups:
    return Groups(2, [1 << 20, 1 << 20], "d1")


def test_every_legal_move_is_in_the_table_and_anything_else_raises() -> None:
    for state, moves in GROUP.moves.items():
        for event in GROUP.events:
            group = Group(index=3, pool_sizes=(1,), state=state)
            if event in moves:
                assert GROUP.allows(state, event)
                group.move(event)
                assert group.state is moves[event]
                assert moves[event] in GROUP.moves  # every target is a state of the table
            else:
                assert not GROUP.allows(state, event)
                with pytest.raises(IllegalMove, match=f"can't handle event '{event.value}'"):
                    group.move(event)
                assert group.state is state  # a refused move changes nothing


def test_the_group_table_lends_a_group_to_one_holder_at_a_time() -> None:
    assert GROUP.moves == {
        S.IDLE: {E.CLAIM: S.HELD, E.TAKEOVER: S.SERVING},
        S.HELD: {E.RELEASE: S.IDLE, E.HOLDER_EXIT: S.IDLE, E.FENCE: S.FENCING},
        S.SERVING: {E.CLAIM: S.HANDING_BACK, E.STOP: S.IDLE, E.UNSAFE: S.UNUSABLE},
        S.HANDING_BACK: {E.HANDED_BACK: S.HELD, E.STOP: S.IDLE, E.UNSAFE: S.UNUSABLE},
        S.UNUSABLE: {},
        S.FENCING: {E.HOLDER_EXIT: S.IDLE, E.RELEASE: S.IDLE},
        S.DETACHED: {E.REATTACH: S.HELD, E.ORPHANED: S.IDLE},
    }
    assert GROUP.events == set(GroupEvent) and set(GROUP.moves) == set(GroupState)
    assert [s for s in GroupState if GROUP.terminal(s)] == [S.UNUSABLE]
    # A group is detached only at the service's start, and never again after.
    assert GROUP.reachable(S.IDLE) == set(GroupState) - {S.DETACHED}
    assert GROUP.reachable(S.DETACHED) == set(GroupState)
    # A group is lent (held) only by a claim, of an idle group or of one handed back, or
    # by its worker re-attaching.
    into_held = {
        (s, e) for s, moves in GROUP.moves.items() for e, t in moves.items() if t is S.HELD
    }
    assert into_held == {
        (S.IDLE, E.CLAIM),
        (S.HANDING_BACK, E.HANDED_BACK),
        (S.DETACHED, E.REATTACH),
    }
    # A fenced holder's lease ends only with its process (or its own release): never a
    # takeover while it may still write.
    assert set(GROUP.moves[S.FENCING].values()) == {S.IDLE}


def test_a_detached_group_takes_only_its_workers_reattach(groups) -> None:
    groups.detach(0)
    assert groups[0].state is S.DETACHED and groups[0].terms is None
    plain = groups.check_claim(request(), PID)
    assert plain is not None and plain.code == "held"
    assert "re-attaches on its own" in plain.message
    assert groups.check_claim(request(reattach=True, control_port=5000), PID) is None
    lease = groups.grant(request(reattach=True, control_port=5000), 5000)
    assert groups[0].state is S.HELD and groups[0].lease == lease
    assert groups[0].terms is not None and groups[0].terms.control == ("127.0.0.1", 5000)
    # Later claims must match the terms the re-attach fixed, as after a first claim.
    groups.end_lease(0, lease.number, E.HOLDER_EXIT)
    other = groups.check_claim(request(remote_fw_dram_backend="TCP"), PID)
    assert other is not None and other.code == "backend_mismatch"


def test_a_reattach_of_a_group_that_is_not_detached_says_what_to_do(groups) -> None:
    refusal = groups.check_claim(request(reattach=True), PID)
    assert refusal is not None and refusal.code == "not_detached"
    assert "restart the engine to claim it afresh" in refusal.message
    assert "the group is idle" in refusal.message


def test_a_detached_group_whose_worker_left_is_idle_and_claimable(groups) -> None:
    groups.detach(1)
    groups.move(1, E.ORPHANED)
    assert groups[1].state is S.IDLE
    assert groups.check_claim(request(guard_index=1), PID) is None


def test_a_group_whose_file_does_not_fit_is_unusable_with_the_reason(groups) -> None:
    groups.detach(0, "group file /p/kvcr-group-0.pool is 3 bytes")
    refusal = groups.check_claim(request(), PID)
    assert refusal is not None and refusal.code == "held"
    assert "kvcr-group-0.pool is 3 bytes" in refusal.message
    assert groups.check_claim(request(guard_index=1), PID) is None  # the others still are


def test_fencing_a_lease_that_ended_changes_nothing(groups) -> None:
    lease = groups.grant(request(), 5000)
    assert groups.fence(0, lease.number)
    assert groups[0].state is S.FENCING
    assert not groups.fence(0, lease.number)  # already fencing
    assert groups.end_lease(0, lease.number, E.HOLDER_EXIT)
    assert groups[0].state is S.IDLE and not groups.fence(0, lease.number)


def test_an_illegal_move_names_the_group_its_event_and_its_state() -> None:
    group = Group(index=3, pool_sizes=(1,), state=S.HELD)
    with pytest.raises(IllegalMove) as raised:
        group.move(E.CLAIM)
    assert str(raised.value) == "guard group 3: can't handle event 'claim' in state 'held'"


def test_the_states_are_the_wires_group_states_in_order() -> None:
    assert [s.value for s in GroupState] == list(GROUP_STATES)


def test_an_unusable_group_is_never_lent_again_and_the_refusal_says_why(groups) -> None:
    groups.grant(request(), 5000)
    assert groups.end_lease(0, groups[0].lease.number, E.HOLDER_EXIT)
    groups.move(0, E.TAKEOVER)
    groups.move(0, E.CLAIM)  # a claimant arrived: the server is being handed back
    groups.mark_unusable(0, "a transfer of its server may still read its pools")

    assert groups[0].state is S.UNUSABLE
    refusal = groups.check_claim(request(), PID)
    assert refusal is not None and refusal.code == "held"
    assert "cannot be lent again (a transfer of its server may still read its pools)" in (
        refusal.message
    )
    assert groups.check_claim(request(guard_index=1), PID) is None  # the others still are


def test_a_grant_holds_the_group_under_a_fresh_lease(groups) -> None:
    assert groups.check_claim(request(), PID) is None
    first = groups.grant(request(), 5000)
    assert groups[0].state is S.HELD and first.pid == PID
    assert groups.end_lease(0, first.number, E.RELEASE)
    second = groups.grant(request(), 5000)
    assert second.number > first.number  # lease numbers are never reused


@pytest.mark.parametrize(
    ("changes", "peer", "code", "text"),
    [
        ({"pid": PID + 1}, PID, "bad_request", "the connection is pid 4242"),
        ({"compatibility_digest": "d2"}, PID, "digest_mismatch", "'d2' does not match"),
        ({"guard_index": 2}, PID, "index_out_of_range", "indices 0..1"),
        ({"pool_layouts": [("k", 4096)]}, PID, "layout_mismatch", "1 pool layout(s) given"),
        (
            {"pool_layouts": [("k", 4096), ("v", 2 << 20)]},
            PID,
            "layout_mismatch",
            "'v' block size 2097152 exceeds",
        ),
    ],
)
def test_claims_that_break_a_rule_are_refused_with_a_reason(
    groups, changes, peer, code, text
) -> None:
    refusal = groups.check_claim(request(**changes), peer)
    assert refusal is not None and refusal.code == code and text in refusal.message


def test_a_served_group_is_claimable_and_handed_back_before_the_new_lease(groups) -> None:
    first = groups.grant(request(), 5000)
    groups.end_lease(0, first.number, E.HOLDER_EXIT)
    groups.move(0, E.TAKEOVER)
    assert groups[0].state is S.SERVING
    assert groups.check_claim(request(pid=7), 7) is None

    groups.move(0, E.CLAIM)  # the service stops serving: handing back
    assert groups.check_claim(request(pid=8), 8).code == "held"  # one claimant at a time
    lease = groups.grant(request(pid=7), 5000)
    assert groups[0].state is S.HELD and lease.pid == 7


def test_a_held_group_is_refused_naming_the_holder(groups) -> None:
    groups.grant(request(), 5000)
    refusal = groups.check_claim(request(pid=7), 7)
    assert refusal.code == "held" and "held by pid 4242" in refusal.message


G3 = G3Description(
    paths=["/g3/a"], capacity_bytes_per_file=1 << 30, backend="POSIX", backend_options={}
)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"pool_layouts": [("k", 8192), ("v", 4096)]}, "layout_mismatch"),
        ({"pool_layouts": [("v", 4096), ("k", 4096)]}, "layout_mismatch"),
        ({"g3": G3}, "g3_mismatch"),
        ({"remote_fw_dram_backend": "LIBFABRIC"}, "backend_mismatch"),
        ({"control_host": "127.0.0.2"}, "control_mismatch"),
        ({"control_port": 6000}, "control_mismatch"),
    ],
)
def test_the_first_claim_fixes_the_terms_for_the_groups_life(groups, changes, code) -> None:
    lease = groups.grant(request(), 5000)
    groups.end_lease(0, lease.number, E.HOLDER_EXIT)

    refusal = groups.check_claim(request(**changes), PID)

    assert refusal is not None and refusal.code == code
    assert groups[0].state is S.IDLE  # a refusal changes nothing


def test_the_bound_port_or_the_first_requested_address_both_match(groups) -> None:
    groups.end_lease(0, groups.grant(request(), 5000).number, E.RELEASE)
    assert groups.check_claim(request(control_port=5000), PID) is None
    assert groups.check_claim(request(control_port=0), PID) is None


def test_only_the_holder_releases_and_only_its_current_lease(groups) -> None:
    lease = groups.grant(request(), 5000)
    assert groups.check_release(0, lease.number, PID + 1).message.endswith(
        "held by pid 4242, not by pid 4243"
    )
    assert "not the group's current lease" in groups.check_release(0, lease.number + 1, PID).message
    assert groups.check_release(5, lease.number, PID).code == "index_out_of_range"
    assert groups.check_release(0, lease.number, PID) is None


def test_a_release_racing_the_holders_exit_ends_the_lease_once(groups) -> None:
    lease = groups.grant(request(), 5000)
    assert groups.end_lease(0, lease.number, E.HOLDER_EXIT) is True
    assert groups.end_lease(0, lease.number, E.RELEASE) is False
    assert groups[0].state is S.IDLE and groups[0].lease is None


def test_status_lists_every_group_with_its_holder_terms_and_endpoint(groups) -> None:
    groups.grant(request(guard_index=1), 5001)
    status = groups.status()
    assert all(type(s.state) is str for s in status)  # the wire's plain strings
    fields = ("index", "state", "holder_pid", "layouts", "control_port")
    assert [attrs.asdict(s, filter=lambda a, _: a.name in fields) for s in status] == [
        {"index": 0, "state": "idle", "holder_pid": None, "layouts": [], "control_port": None},
        {
            "index": 1,
            "state": "held",
            "holder_pid": PID,
            "layouts": [("k", 4096), ("v", 4096)],
            "control_port": 5001,
        },
    ]


def test_a_service_needs_at_least_one_group() -> None:
    with pytest.raises(ValueError, match="guard count must be >= 1"):
        Groups(0, [4096], "d")


def test_a_group_too_large_for_its_journal_is_refused_at_the_claim_with_the_numbers() -> None:
    # 1M blocks of 4 KiB in one pool fit the 100 MiB journal (40 bytes a key at 32-byte
    # keys, 52 MB a half); 2M do not; 1.2M fit in one pool, not with a slot in a second.
    fits = Groups(1, [4096 << 20], "d1")
    assert fits.check_claim(request(pool_layouts=[("", 4096)]), PID) is None
    too_many = Groups(1, [4096 << 21], "d1")
    refusal = too_many.check_claim(request(pool_layouts=[("", 4096)]), PID)
    assert refusal is not None and refusal.code == "layout_mismatch"
    assert "pools hold 2097152 blocks" in refusal.message
    assert "needs 83886" in refusal.message and "104857600-byte recovery journal" in refusal.message
    one_pool = Groups(1, [4096 * 1_200_000], "d1")
    assert one_pool.check_claim(request(pool_layouts=[("", 4096)]), PID) is None
    two_pools = Groups(1, [4096 * 1_200_000] * 2, "d1")
    assert two_pools.check_claim(request(), PID) is not None
    # G3 files count too: their keys are journaled beside the pool's.
    g3 = G3Description(["/g3/a", "/g3/b"], 4096 << 19, "POSIX", {})
    assert fits.check_claim(request(pool_layouts=[("", 4096)], g3=g3), PID) is not None
