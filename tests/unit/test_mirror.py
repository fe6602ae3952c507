"""Starting warm from a journal: only records that point at valid, distinct slots become
blocks; G3 records are kept aside; the mirror then publishes what the index commits."""

from __future__ import annotations

from kvcr.logs import capture_events, get_logger
from kvcr.runtime.mirror import Mirror, recover
from kvcr.store import journal
from kvcr.store.index import BlockIndex
from kvcr.store.records import BlockState
from kvcr.store.slots import SlotPool

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
    replayed, resume = recover(
        idx, written([(journal.PUT_G2, b"a", (3, 5)), (journal.PUT_G2, b"b", (0, 0))]), LOG
    )
    assert {(b.key, b.slots, b.state, b.claims) for b in idx.blocks()} == {
        (b"a", (3, 5), BlockState.READY, 0),
        (b"b", (0, 0), BlockState.READY, 0),
    }
    assert replayed.g3 == {} and replayed.skipped == 0
    assert resume is not None  # the index is exactly the journal: a writer may go on
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
        replayed, resume = recover(idx, written(entries), LOG)
    assert [b.key for b in idx.blocks()] == [b"first"]
    assert replayed.g3 == {b"on-disk": journal.Residency(journal.PUT_G3, (7, 4096))}
    assert resume is None  # the journal names what the index left out: start over
    (event,) = [e for e in events if e["event"] == "recovered"]
    assert event["skipped"] == 3 and event["blocks"] == 1 and event["g3_records"] == 1


def test_the_mirror_snapshots_the_index_and_publishes_commits_and_removals() -> None:
    idx = index()
    buf = written([(journal.PUT_G3, b"on-disk", (7, 4096))])
    replayed, _ = recover(idx, buf, LOG)
    mirror = Mirror(buf, idx, replayed.g3, group=3, log=LOG)
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


def test_commits_of_one_flush_by_views_and_by_arrays_are_published_together() -> None:
    idx = index()
    buf = written([])
    replayed, _ = recover(idx, buf, LOG)
    idx.journal = Mirror(buf, idx, replayed.g3, group=3, log=LOG)
    fill = idx.add_fills([b"two", b"three"], now=0.0)
    block = idx.add_filling(b"one", now=0.0)
    idx.commit_fills(fill, None)  # both buffered until the flush
    idx.commit(block, score=0.0)
    idx.flush_journal()
    assert journal.read(buf).state == {
        b"one": journal.Residency(journal.PUT_G2, block.slots),
        **{b.key: journal.Residency(journal.PUT_G2, b.slots) for b in fill.views()},
    }


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


def filled(n: int, pools: int = 1) -> tuple[BlockIndex, memoryview]:
    """An index of n committed blocks mirrored into a journal big enough for them."""
    idx = BlockIndex([SlotPool(f"p{i}", 4096, n + 16) for i in range(pools)])
    buf = memoryview(bytearray(journal.DATA_START + 2 * journal.snapshot_bytes(n, pools)))
    idx.journal = Mirror(buf, idx, {}, group=0, log=LOG)
    keys = [b"key-%08d" % i for i in range(n)]
    for first in range(0, n, 1000):
        for block in idx.add_filling_batch(keys[first : first + 1000], now=float(first)):
            idx.commit(block, score=float(first))
        idx.flush_journal()
    return idx, buf


def contents(idx: BlockIndex) -> dict[bytes, tuple[int, ...]]:
    return {b.key: b.slots for b in idx.blocks() if b.state is BlockState.READY}


def test_a_hundred_thousand_blocks_come_back_in_the_slots_they_had() -> None:
    before, buf = filled(100_000, pools=2)
    for block in list(before.blocks())[::7]:  # some evicted since: journaled removals
        before.remove(block)
    before.flush_journal()
    after = BlockIndex([SlotPool(f"p{i}", 4096, 100_016) for i in range(2)])
    _, resume = recover(after, buf, LOG)
    assert contents(after) == contents(before)
    assert [p.free for p in after.pools] == [p.free for p in before.pools]
    assert after.audit()["double"] == 0 and resume is not None


def test_a_warm_start_resumes_the_journal_so_the_next_holder_finds_both() -> None:
    _, buf = filled(10_000)
    epoch = journal.read(buf).epoch
    second = BlockIndex([SlotPool("p0", 4096, 10_016)])
    replayed, resume = recover(second, buf, LOG)
    second.journal = Mirror(buf, second, replayed.g3, group=0, log=LOG, resume=resume)
    (block,) = second.add_filling_batch([b"later"], now=0.0)
    second.commit(block, 0.0)
    second.flush_journal()
    replay = journal.read(buf)
    assert replay.epoch == epoch  # no snapshot of 10k blocks at start: appended after them
    third = BlockIndex([SlotPool("p0", 4096, 10_016)])
    recover(third, buf, LOG)
    assert contents(third) == contents(second) and b"later" in third


def test_a_record_left_out_is_never_resurrected_by_a_later_replay() -> None:
    # b and c both name slot 2; b wins, c is left out. Resuming would keep c in the
    # journal, and once b leaves, a later replay would give c the slot that now holds d.
    buf = written([(journal.PUT_G2, b"b", (2, 2)), (journal.PUT_G2, b"c", (2, 3))])
    idx = index()
    replayed, resume = recover(idx, buf, LOG)
    assert resume is None
    idx.journal = Mirror(buf, idx, replayed.g3, group=0, log=LOG, resume=resume)
    idx.remove(idx.get(b"b"))
    idx.flush_journal()
    later = index()
    recover(later, buf, LOG)
    assert b"c" not in later


class Recording(Mirror):
    """A mirror whose stores are logged, so that a test can crash it after any of them,
    and the states it published (one per flush)."""

    stores: list[tuple[int, bytes]]
    states: list[dict[bytes, tuple[int, ...]]]

    def write_at(self, offset: int, data: bytes) -> None:
        self.stores.append((offset, bytes(data)))
        super().write_at(offset, data)

    def flush(self) -> bool:
        ok = super().flush()
        self.states.append(contents(self._index))
        return ok


def test_a_crash_at_any_store_after_a_bulk_replay_recovers_a_published_state() -> None:
    """A worker starts warm over 10k blocks, then evicts and fills (each flush publishes a
    state), and dies at some store: the next replay yields the state published last, or
    the one being published, whichever store it was; also when the start needed a
    snapshot (a record left out)."""
    for skip in (False, True):
        first, buf = filled(10_000)
        if skip:  # a record naming a slot another key holds: the replay leaves it out
            mirror = first.journal
            assert isinstance(mirror, Mirror)
            mirror.put(b"bad", (0,))
            mirror.flush()
        original = bytes(buf)
        idx = BlockIndex([SlotPool("p0", 4096, 10_016)])
        replayed, resume = recover(idx, buf, LOG)
        assert (resume is None) is skip
        idx.queue_recovered(None)
        Recording.stores, Recording.states = [], [contents(idx)]
        idx.journal = Recording(buf, idx, replayed.g3, group=0, log=LOG, resume=resume)
        for round_ in range(3):
            assert len(idx.evict(50)) == 50
            new = [b"new-%d-%d" % (round_, i) for i in range(50)]
            for block in idx.add_filling_batch(new, now=1.0):  # publishes the evictions
                idx.commit(block, 1.0)
            idx.flush_journal()
        stores, states = Recording.stores, Recording.states
        for upto in range(len(stores) + 1):
            crashed = bytearray(original)
            for offset, data in stores[:upto]:
                crashed[offset : offset + len(data)] = data
            if upto < len(stores):  # half of the interrupted store landed
                offset, data = stores[upto]
                half = len(data) // 2
                crashed[offset : offset + half] = data[:half]
            again = BlockIndex([SlotPool("p0", 4096, 10_016)])
            recover(again, memoryview(crashed), LOG)
            assert contents(again) in states, (skip, upto)


def test_a_key_put_again_moves_to_its_latest_slots_and_frees_the_old_ones() -> None:
    buf = memoryview(bytearray(SIZE))
    writer = journal.Writer(buf, list)
    writer.put_batch([b"a", b"b"], [(0, 0), (1, 1)])
    writer.flush()
    writer.put_batch([b"b", b"c"], [(5, 6), (2, 2)])  # b again, never removed
    writer.flush()
    writer.put_batch([b"a"], [(7, 7)])  # from here the replay goes key by key
    writer.flush()
    idx = index()
    recover(idx, buf, LOG)
    assert contents(idx) == {b"a": (7, 7), b"b": (5, 6), b"c": (2, 2)}
    assert [p.free for p in idx.pools] == [5, 5] and idx.ready_count == 3
    assert idx.audit()["double"] == 0 and idx.audit()["quarantined"] == 0


def test_a_detached_mirror_leaves_a_journal_nobody_trusts_and_writes_nothing() -> None:
    idx = index()
    buf = written([])
    replayed, _ = recover(idx, buf, LOG)
    mirror = Mirror(buf, idx, replayed.g3, group=2, log=LOG)
    idx.journal = mirror
    kept = idx.add_filling(b"kept", now=0.0)
    idx.commit(kept, score=0.0)
    idx.flush_journal()
    with capture_events() as events:
        mirror.detach()  # the guard service is gone
    assert [e["event"] for e in events] == ["KVCR pool recovery disabled"]
    assert "re-attached" in events[0]["reason"]
    lost = journal.read(buf)
    assert lost.disabled and lost.state == {}  # an heir starts cold, never from stale slots
    before = bytes(buf)
    idx.remove(kept)  # its slot is handed out again: the journal must not say where it was
    later = idx.add_filling(b"later", now=0.0)
    idx.commit(later, score=0.0)
    mirror.g3_committed_many([b"on-disk"], [(4, 99)])
    idx.flush_journal()
    assert not mirror.flush() and not mirror.recording and mirror.fill_percent == 100
    assert bytes(buf) == before  # not one byte written while detached
    assert mirror.position() is None  # nobody may resume this journal


def test_reattached_the_mirror_journals_again_from_a_snapshot_of_the_live_state() -> None:
    idx = index()
    buf = written([(journal.PUT_G3, b"old-g3", (1, 5))])
    replayed, _ = recover(idx, buf, LOG)
    mirror = Mirror(buf, idx, replayed.g3, group=2, log=LOG)
    idx.journal = mirror
    mirror.detach()
    # While detached: G2 and G3 change (the G3 records are still tracked for the snapshot).
    block = idx.add_filling(b"while-away", now=0.0)
    idx.commit(block, score=0.0)
    mirror.g3_removed_many([b"old-g3"])
    mirror.g3_committed_many([b"new-g3"], [(2, 7)])
    epoch = journal.read(buf).epoch
    with capture_events() as events:
        mirror.attach()
    assert [e["event"] for e in events] == ["KVCR pool recovery enabled again"]
    assert mirror.recording
    replay = journal.read(buf)
    assert not replay.disabled and replay.epoch > epoch
    assert replay.state == {b"while-away": journal.Residency(journal.PUT_G2, block.slots)}
    assert replay.g3 == {b"new-g3": journal.Residency(journal.PUT_G3, (2, 7))}
    # And it goes on publishing changes as before.
    idx.remove(block)
    idx.flush_journal()
    assert journal.read(buf).state == {}
