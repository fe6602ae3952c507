"""Starting warm from a journal: only records that point at valid, distinct slots become
blocks; G3 records are kept aside; the mirror then publishes what the index commits."""

from __future__ import annotations

from kvcr.guard import journal
from kvcr.logs import capture_events, get_logger
from kvcr.runtime.index import BlockIndex, BlockState, SlotPool
from kvcr.runtime.mirror import Mirror, recover

SIZE = 64 * 1024
LOG = get_logger("kvcr.test")


def written(entries: list[tuple[int, bytes, tuple[int, ...]]]) -> memoryview:
    """A journal holding ``entries`` as its one snapshot."""
    buf = bytearray(SIZE)
    journal.Writer(buf, lambda: entries)
    return memoryview(buf)


def index() -> BlockIndex:
    return BlockIndex([SlotPool("k", 4096, 8), SlotPool("v", 4096, 8)])


def test_valid_g2_records_become_ready_blocks_in_their_slots() -> None:
    idx = index()
    blocks, kept = recover(
        idx, written([(journal.PUT_G2, b"a", (3, 5)), (journal.PUT_G2, b"b", (0, 0))]), LOG
    )
    assert {(b.key, b.slots, b.state, b.claims) for b in blocks} == {
        (b"a", (3, 5), BlockState.READY, 0),
        (b"b", (0, 0), BlockState.READY, 0),
    }
    assert kept == {}
    assert idx.pools[0].free == 6 and idx.pools[1].free == 6
    assert [idx.pools[0].take() for _ in range(6)] == [1, 2, 4, 5, 6, 7]  # 0 and 3 stay taken


def test_records_that_do_not_fit_this_index_are_skipped_and_counted() -> None:
    entries = [
        (journal.PUT_G2, b"out-of-range", (8, 1)),
        (journal.PUT_G2, b"one-pool-only", (1,)),
        (journal.PUT_G2, b"first", (2, 2)),
        (journal.PUT_G2, b"same-slot", (2, 3)),
        (journal.PUT_G3, b"on-disk", (7, 4096)),
    ]
    idx = index()
    with capture_events() as events:
        blocks, kept = recover(idx, written(entries), LOG)
    assert [b.key for b in blocks] == [b"first"]
    assert kept == {b"on-disk": journal.Residency(journal.PUT_G3, (7, 4096))}
    (event,) = [e for e in events if e["event"] == "recovered"]
    assert event["skipped"] == 3 and event["blocks"] == 1 and event["g3_records"] == 1


def test_the_mirror_snapshots_the_index_and_publishes_commits_and_removals() -> None:
    idx = index()
    buf = written([(journal.PUT_G3, b"on-disk", (7, 4096))])
    _, kept = recover(idx, buf, LOG)
    mirror = Mirror(buf, idx, kept, group=3, log=LOG)
    idx.journal = mirror
    block = idx.add_filling(b"new", now=0.0)
    idx.commit(block, score=0.0)
    idx.flush_journal()
    replay = journal.read(buf)
    assert replay.state == {b"new": journal.Residency(journal.PUT_G2, block.slots)}
    assert replay.g3 == {b"on-disk": journal.Residency(journal.PUT_G3, (7, 4096))}
    idx.remove(block)
    idx.flush_journal()
    assert b"new" not in journal.read(buf).state
    assert 0 < mirror.fill_percent < 100


def test_a_key_the_journal_cannot_hold_is_served_but_not_recoverable() -> None:
    idx = index()
    buf = memoryview(bytearray(SIZE))
    idx.journal = Mirror(buf, idx, {}, group=0, log=LOG)
    block = idx.add_filling(b"x" * 70000, now=0.0)
    with capture_events() as events:
        idx.commit(block, score=0.0)
        idx.flush_journal()
    assert idx.get(b"x" * 70000).state is BlockState.READY
    assert journal.read(buf).state == {}
    assert [e["event"] for e in events] == ["recovery_mirror_skipped"]
    idx.remove(block)  # and its removal is no error either
    idx.flush_journal()


def test_a_journal_too_small_for_the_live_state_disables_recovery_loudly() -> None:
    idx = BlockIndex([SlotPool("", 4096, 4000)])
    buf = memoryview(bytearray(SIZE))
    with capture_events() as events:
        mirror = Mirror(buf, idx, {}, group=5, log=LOG)
        idx.journal = mirror
        for i in range(3000):
            idx.commit(idx.add_filling(b"key-%06d" % i, now=0.0), score=0.0)
        idx.flush_journal()
    disabled = [e for e in events if e["event"] == "KVCR pool recovery disabled"]
    assert disabled and disabled[0]["group"] == 5
    assert journal.read(buf).disabled and mirror.fill_percent == 100.0


def test_a_removal_is_published_before_its_slot_is_handed_out_again() -> None:
    idx = BlockIndex([SlotPool("", 4096, 1)])  # one slot: the next fill must reuse it
    buf = memoryview(bytearray(SIZE))
    idx.journal = Mirror(buf, idx, {}, group=0, log=LOG)
    old = idx.add_filling(b"old", now=0.0)
    idx.commit(old, score=0.0)
    idx.flush_journal()
    assert journal.read(buf).state == {b"old": journal.Residency(journal.PUT_G2, (0,))}

    idx.remove(old)  # evicted: buffered, not flushed by anyone
    new = idx.add_filling(b"new", now=0.0)  # the same slot, about to be rewritten

    assert new.slots == old.slots
    assert journal.read(buf).state == {}  # the journal no longer names it


def test_the_journal_fill_level_is_a_state_gauge() -> None:
    from kvcr.runtime.mirror import Mirror as M

    idx = index()
    mirror = M(memoryview(bytearray(SIZE)), idx, {}, group=0, log=LOG)
    before = mirror.fill_percent
    idx.journal = mirror
    for i in range(8):
        idx.commit(idx.add_filling(b"k%d" % i, now=0.0), score=0.0)
    idx.flush_journal()
    assert 0 <= before < mirror.fill_percent < 100
