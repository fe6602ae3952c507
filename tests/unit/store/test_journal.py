"""The recovery journal: whatever happens to the buffer, a reader gets a state the writer
really published (whole frames only), never a misread one."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr.store import journal
from kvcr.store.journal.format import PUT_G2, PUT_G3
from kvcr.store.journal.replay import Residency, read
from kvcr.store.journal.writer import Writer
from kvcr.types import RecoveryMirrorError

SIZE = 64 * 1024  # two halves of ~32 KiB
SMALL = journal.DATA_START + 2 * 4096  # the smallest journal: hypothesis runs compact often


class Model(dict):
    """The holder's live state, as the writer asks for it at snapshots."""

    def live(self):
        return [(r.tier, k, r.values) for k, r in self.items()]


class Holder:
    """A writer and the state it publishes (what a worker's index would be)."""

    def __init__(self, buf, state=None, writer=Writer, **kw):
        self.model = Model(state or {})
        self.w = writer(buf, self.model.live, **kw)

    def put(self, key, values, tier=PUT_G2):
        self.w.put(key, values, tier)
        self.model[key] = Residency(tier, values)

    def remove(self, key):
        if self.model.pop(key, None) is not None:
            self.w.remove(key)

    def flush(self):
        return self.w.flush()

    def published(self):
        return dict(self.model) if not self.w.disabled else {}


class Recording(Writer):
    """A writer whose stores are logged with the flush they belong to (0: the start), so
    that a test can replay any prefix of them."""

    def __init__(self, buf, live, log):
        self.stores: list[tuple[int, bytes, int]] = log
        self.phase = 0
        super().__init__(buf, live)

    def flush(self) -> bool:
        self.phase += 1
        return super().flush()

    def write_at(self, offset: int, data: bytes) -> None:
        self.stores.append((offset, bytes(data), self.phase))
        super().write_at(offset, data)


def g2(*slots: int) -> Residency:
    return Residency(PUT_G2, slots)


def test_an_empty_buffer_replays_to_nothing() -> None:
    replay = read(bytearray(SIZE))
    assert replay.state == {} and replay.frames == 0 and not replay.disabled


def test_puts_and_removes_replay_in_order() -> None:
    buf = bytearray(SIZE)
    w = Holder(buf)
    w.put(b"a", (1, 7))
    w.put(b"b", (2, 8))
    w.flush()
    w.remove(b"a")
    w.put(b"c", (9,), tier=PUT_G3)
    w.flush()
    assert read(buf).state == {b"b": g2(2, 8)}
    assert read(buf).g3 == {b"c": Residency(PUT_G3, (9,))}


def test_a_key_can_be_in_g2_and_g3_and_leave_each_on_its_own() -> None:
    buf = bytearray(SIZE)
    w = Writer(buf, list)
    w.put(b"k", (1,))
    w.put(b"k", (5, 77), PUT_G3)
    w.flush()
    assert read(buf).state == {b"k": g2(1)} and read(buf).g3 == {b"k": Residency(PUT_G3, (5, 77))}
    w.remove(b"k")  # evicted from G2: still in G3
    w.flush()
    assert read(buf).state == {} and read(buf).g3 == {b"k": Residency(PUT_G3, (5, 77))}
    w.remove_batch([b"k"], journal.REMOVE_G3)
    w.flush()
    assert read(buf).g3 == {}


def test_a_batch_put_from_an_array_of_slots_is_the_batch_put_from_tuples() -> None:
    keys = [bytes([i]) * 8 for i in range(100)]
    slots = np.arange(200, dtype=np.uint64).reshape(100, 2)
    as_rows = journal.encode_batch(PUT_G2, keys, slots)
    assert as_rows == journal.encode_batch(PUT_G2, keys, [tuple(r) for r in slots.tolist()])
    buf = bytearray(SIZE)
    w = Writer(buf, list)
    # Keys of two lengths: put key by key.
    w.put_batch([*keys, b"odd length"], np.vstack([slots, np.array([[7, 9]], dtype=np.uint64)]))
    w.flush()
    assert read(buf).state == {
        **{k: g2(2 * i, 2 * i + 1) for i, k in enumerate(keys)},
        b"odd length": g2(7, 9),
    }


def test_unflushed_changes_are_not_published() -> None:
    buf = bytearray(SIZE)
    w = Holder(buf)
    w.put(b"a", (1,))
    assert read(buf).state == {}
    w.flush()
    assert read(buf).state == {b"a": g2(1)}


def test_a_new_holder_starts_a_new_epoch_from_what_it_recovered() -> None:
    buf = bytearray(SIZE)
    first = Holder(buf)
    first.put(b"a", (1,))
    first.put(b"b", (2,))
    first.flush()
    recovered = read(buf)

    second = Holder(buf, recovered.state)
    second.remove(b"a")
    second.flush()

    replay = read(buf)
    assert replay.state == {b"b": g2(2)} and replay.epoch == recovered.epoch + 1


def test_a_full_half_is_compacted_into_a_snapshot_of_the_live_state() -> None:
    buf = bytearray(SIZE)
    w = Holder(buf)
    for i in range(2000):  # churn: far more history than a half holds
        w.put(b"k%d" % (i % 10), (i,))
        w.flush()
    assert w.w.compactions > 2 and not w.w.disabled and 0 < w.w.fill < 1
    assert read(buf).state == {b"k%d" % j: g2(1990 + j) for j in range(10)}


def test_a_live_state_too_big_for_a_snapshot_disables_recovery_until_it_shrinks() -> None:
    buf = bytearray(SIZE)
    w = Holder(buf)
    for i in range(3000):
        w.put(b"key-%06d" % i, (i, i))
    assert w.flush() is False and w.w.disabled and w.w.fill == 1.0
    replay = read(buf)
    assert replay.disabled and replay.state == {}  # nothing stale or partial is served

    for i in range(2900):
        w.remove(b"key-%06d" % i)
    assert w.flush() is True and not w.w.disabled
    assert read(buf).state == {b"key-%06d" % i: g2(i, i) for i in range(2900, 3000)}


def test_a_key_the_journal_cannot_describe_is_refused_and_changes_nothing() -> None:
    buf = bytearray(SIZE)
    w = Writer(buf, list)
    w.put(b"x" * 70000, (1,))
    assert "70000-byte key" in str(w.last_refusal)
    w.put(b"k", tuple(range(300)))
    assert isinstance(w.last_refusal, RecoveryMirrorError) and "300 values" in str(w.last_refusal)
    assert w.refused == 2 and w.flush() and read(buf).state == {}


def test_a_buffer_too_small_for_a_journal_is_refused() -> None:
    with pytest.raises(journal.JournalError, match="too small"):
        Writer(bytearray(4096), list)


# --- crashes and corruption (hypothesis) ----------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 40), st.integers(0, 1 << 40)),
        st.tuples(st.just("remove"), st.integers(0, 40), st.just(0)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
    ),
    max_size=300,
)


def run(ops_list, log):
    """Run the writer over ``ops_list``; return the published states, one per flush (the
    first is the empty start)."""
    buf = bytearray(SMALL)
    w = Holder(buf, writer=Recording, log=log)
    states = [w.published()]
    for op, k, v in ops_list:
        key = b"key-%d" % k
        if op == "put":
            w.put(key, (v, k))
        elif op == "remove":
            w.remove(key)
        else:
            w.flush()
            states.append(w.published())  # {} while disabled: nothing may be served
    return buf, states


def replay_prefix(stores, upto: int, partial: bytes | None, at: int) -> bytearray:
    buf = bytearray(SMALL)
    for offset, data, _ in stores[:upto]:
        buf[offset : offset + len(data)] = data
    if partial is not None:
        buf[at : at + len(partial)] = partial
    return buf


SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(ops_list=ops)
def test_without_a_crash_the_reader_sees_the_last_flush(ops_list) -> None:
    buf, states = run(ops_list, [])
    assert read(buf).state == states[-1]


@SETTINGS
@given(ops_list=ops, cut=st.floats(0, 1), torn=st.floats(0, 1), seed=st.integers(0, 1 << 30))
def test_a_crash_at_any_store_leaves_the_last_flush_or_the_one_in_progress(
    ops_list, cut, torn, seed
) -> None:
    stores: list[tuple[int, bytes, int]] = []
    _, states = run(ops_list, stores)
    upto = int(cut * len(stores))
    partial, at = None, 0
    if upto == len(stores):  # every store landed
        acceptable = [states[-1]]
    else:  # the store the crash interrupted: some of its bytes landed
        at, data, phase = stores[upto]
        acceptable = [states[max(phase - 1, 0)], states[phase]]
        rng = random.Random(seed)
        landed = bytearray(replay_prefix(stores, upto, None, 0)[at : at + len(data)])
        for i in range(len(data)):
            if rng.random() < torn:
                landed[i] = data[i]
        partial = bytes(landed)
    state = read(replay_prefix(stores, upto, partial, at)).state
    assert state in acceptable


@SETTINGS
@given(
    ops_list=ops,
    in_header=st.booleans(),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
)
def test_a_flipped_bit_never_yields_an_unpublished_state(ops_list, in_header, where, bit) -> None:
    buf, states = run(ops_list, [])
    replay = read(buf)
    if in_header:
        i = int(where * (journal.DATA_START - 1))
    else:  # somewhere in the frames the reader just used
        i = replay.start + int(where * max(replay.used - 1, 0))
    buf[i] ^= 1 << bit
    assert read(buf).state in states


@SETTINGS
@given(ops_list=ops, length=st.integers(0, SMALL))
def test_a_truncated_or_zeroed_tail_keeps_only_whole_frames(ops_list, length) -> None:
    buf, states = run(ops_list, [])
    buf[length:] = bytes(len(buf) - length)
    assert read(buf).state in [*states, {}]


@SETTINGS
@given(
    batches=st.lists(
        st.tuples(
            st.sampled_from([PUT_G2, PUT_G3, journal.REMOVE]),
            st.lists(st.integers(0, 60), min_size=1, max_size=20, unique=True),
            st.integers(1, 3),
        ),
        max_size=30,
    )
)
def test_batches_replay_like_the_same_changes_one_by_one(batches) -> None:
    one, many = bytearray(SIZE), bytearray(SIZE)
    w1, w2 = Writer(one, list), Writer(many, list)
    for op, ks, count in batches:
        keys = [b"key-%02d" % k for k in ks]
        if op == journal.REMOVE:
            for k in keys:
                w1.remove(k)
            w2.remove_batch(keys)
        else:
            values = [tuple(range(k, k + count)) for k in ks]
            for k, v in zip(keys, values):
                w1.put(k, v, op)
            w2.put_batch(keys, values, op)
        assert w1.flush() and w2.flush()
    assert read(one).state == read(many).state and read(one).g3 == read(many).g3


def test_keys_of_mixed_lengths_in_a_batch_are_published_one_by_one() -> None:
    buf = bytearray(SIZE)
    w = Writer(buf, list)
    w.put_batch([b"a", b"bb", b"ccc"], [(1,), (2,), (3,)])
    w.remove_batch([b"a", b"ccc"])
    w.flush()
    assert read(buf).state == {b"bb": g2(2)}


def test_a_crash_at_every_store_of_a_churning_run_leaves_a_flush_whole() -> None:
    rng = random.Random(11)
    ops_list = []
    for _ in range(600):
        k = rng.randrange(40)
        ops_list.append(
            ("put", k, rng.randrange(1 << 40)) if rng.random() < 0.7 else ("remove", k, 0)
        )
        if rng.random() < 0.3:
            ops_list.append(("flush", 0, 0))
    stores: list[tuple[int, bytes, int]] = []
    _, states = run(ops_list, stores)
    headers = [i for i, (offset, _, _) in enumerate(stores) if offset < journal.DATA_START]
    assert len(headers) > 3  # it compacted several times
    for upto in range(len(stores) + 1):
        if upto == len(stores):
            acceptable = [states[-1]]
            partial, at = None, 0
        else:
            at, data, phase = stores[upto]
            acceptable = [states[max(phase - 1, 0)], states[phase]]
            partial = data[: len(data) // 2]  # half of the interrupted store landed
        state = read(replay_prefix(stores, upto, partial, at)).state
        assert state in acceptable, f"crash at store {upto} of {len(stores)}"


def test_a_follower_applies_only_new_frames_and_starts_over_after_a_snapshot() -> None:
    buf = bytearray(SMALL)
    holder = Holder(buf)
    follower = journal.Follower(buf)
    holder.put(b"a", (1,))
    holder.flush()
    assert follower.poll().state == {b"a": g2(1)}
    holder.put(b"b", (2,))
    holder.flush()
    first = follower.poll()
    assert first.state == {b"a": g2(1), b"b": g2(2)} and first.frames == 2
    for i in range(400):  # churn until the writer compacts into the other half
        holder.put(b"c", (i,))
        holder.flush()
    assert holder.w.compactions > 1
    assert follower.poll().state == read(buf).state == {b"a": g2(1), b"b": g2(2), b"c": g2(399)}
