"""Journal bytes from outside the process (a dead holder's mapping) replayed by the guard
and by the next holder.

Read top to bottom: a Writer runs random changes (G2 and G3 puts and removals, one by one
and in batches) and the states it published are recorded; then the buffer is damaged (bit
flips, random bytes, truncation, forged frames with a wrong crc, epoch or seq, copies of
older frames) and replayed. Replay never raises, and yields a state the writer published
(or nothing), never a mix or an entry nobody wrote. Frames with a valid crc but a forged
payload (anything a buggy holder could write) are decoded atomically and quickly, and the
warm start built on them only takes records that fit the index.
"""

from __future__ import annotations

import struct
import time
import zlib

from fuzzing import case, fuzz
from hypothesis import example, given
from hypothesis import strategies as st

from kvcr.logs import get_logger
from kvcr.runtime.mirror import recover
from kvcr.store import journal
from kvcr.store.index import BlockIndex
from kvcr.store.journal.format import FRAME_HEAD, FRAME_MAGIC
from kvcr.store.journal.replay import Follower, read
from kvcr.store.journal.writer import Writer
from kvcr.store.slots import SlotPool

SMALL = journal.DATA_START + 2 * 4096  # the smallest journal: compaction happens often
LOG = get_logger("kvcr.test")

changes = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["put", "put_g3"]), st.integers(0, 30), st.integers(0, 1 << 40)),
        st.tuples(
            st.sampled_from(["remove", "remove_g3", "flush"]), st.integers(0, 30), st.just(0)
        ),
        st.tuples(st.just("batch"), st.integers(1, 12), st.integers(0, 1 << 20)),
    ),
    max_size=120,
)


class Model:
    """The holder's live state, as its index and G3 tier would hold it."""

    def __init__(self) -> None:
        self.g2: dict[bytes, tuple[int, ...]] = {}
        self.g3: dict[bytes, tuple[int, ...]] = {}

    def live(self):
        for k, v in self.g2.items():
            yield (journal.PUT_G2, k, v)
        for k, v in self.g3.items():
            yield (journal.PUT_G3, k, v)

    def published(self, writer: Writer) -> tuple[dict, dict]:
        if writer.disabled:
            return {}, {}
        g2 = {k: journal.Residency(journal.PUT_G2, v) for k, v in self.g2.items()}
        g3 = {k: journal.Residency(journal.PUT_G3, v) for k, v in self.g3.items()}
        return g2, g3


def write(ops) -> tuple[bytearray, list[tuple[dict, dict]]]:
    """Run ``ops``; the buffer and every state the writer published (one per flush)."""
    buf = bytearray(SMALL)
    model = Model()
    w = Writer(buf, model.live)
    states = [model.published(w)]
    for op, k, v in ops:
        key = b"key-%d" % k
        if op == "put":
            model.g2[key] = (v, k)
            w.put(key, (v, k))
        elif op == "put_g3":
            model.g3[key] = (v, k + 1)
            w.put(key, (v, k + 1), journal.PUT_G3)
        elif op == "remove":
            if model.g2.pop(key, None) is not None:
                w.remove(key)
        elif op == "remove_g3":
            if model.g3.pop(key, None) is not None:
                w.remove(key, journal.REMOVE_G3)
        elif op == "batch":
            keys = [b"bat-%02d" % ((v + i) % 40) for i in range(k)]
            values = [(v + i,) for i in range(k)]
            model.g2.update(zip(keys, values))
            w.put_batch(keys, values)
        else:
            w.flush()
            states.append(model.published(w))
    w.flush()
    states.append(model.published(w))
    return buf, states


def frame(epoch: int, seq: int, payload: bytes, crc_ok: bool = True) -> bytes:
    head = FRAME_HEAD.pack(FRAME_MAGIC, len(payload), epoch, seq)
    crc = zlib.crc32(payload, zlib.crc32(head)) ^ (0 if crc_ok else 1)
    raw = head + payload + struct.pack("<I", crc)
    return raw + bytes(-len(raw) % 8)


@st.composite
def damage(draw: st.DrawFn, buf: bytearray) -> list[tuple[str, int]]:
    """Damage ``buf`` in place; returns what was done (for the failure report)."""
    replay = read(buf)
    done = []
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "bytes", "truncate", "forged", "stale-copy", "header"]))
        hot = replay.start + draw(st.integers(0, max(replay.used, 8)))  # where frames are
        at = draw(st.sampled_from([hot, draw(st.integers(0, len(buf) - 1))]))
        at = min(at, len(buf) - 1)
        if how == "flip":
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "bytes":
            data = draw(st.binary(min_size=1, max_size=64))
            buf[at : at + len(data)] = data[: len(buf) - at]
        elif how == "truncate":
            buf[at:] = bytes(len(buf) - at)
        elif how == "header":
            i = draw(st.integers(0, journal.DATA_START - 1))
            buf[i] = draw(st.integers(0, 255))
        else:
            # A whole frame right where the next one would go (or over the last one): with a
            # wrong crc, or from another epoch, or out of sequence. Only the crc-valid frame of
            # the right epoch and seq is a frame the writer could have written.
            epoch = replay.epoch + draw(st.sampled_from([0, -1, 1]))
            seq = replay.frames + draw(st.sampled_from([-1, 1, 2, 1 << 40]))
            payload = draw(st.binary(max_size=48))
            if how == "stale-copy":  # a crc-valid frame of an older epoch
                epoch, seq = max(replay.epoch - 1, 0), replay.frames
            raw = frame(epoch % (1 << 64), seq % (1 << 64), payload, draw(st.booleans()))
            pos = replay.start + replay.used
            buf[pos : pos + len(raw)] = raw[: max(0, len(buf) - pos)]
        done.append((how, at))
    return done


@fuzz(400)
@given(ops=changes, data=st.data())
def test_damaged_journal_replays_to_a_published_state_or_nothing(ops, data) -> None:
    case("journal bytes")
    buf, states = write(ops)
    follower = Follower(buf)
    before = follower.poll()
    assert (before.state, before.g3) == states[-1]
    data.draw(damage(buf), "damage")

    replay = read(buf)  # never raises for a buffer large enough to hold a journal

    assert (replay.state, replay.g3) in [*states, ({}, {})]
    # A follower that read the journal before the damage only adds whole frames after it.
    after = follower.poll()
    assert (after.state, after.g3) in [*states, ({}, {})]


@fuzz(300)
@given(raw=st.binary(max_size=SMALL + 64))
def test_any_buffer_replays_to_nothing_or_is_refused_as_too_small(raw) -> None:
    case("journal bytes")
    try:
        replay = read(bytearray(raw))
    except journal.JournalError as exc:
        assert "too small" in str(exc)
        assert len(raw) < journal.DATA_START + 2 * 4096
    else:
        assert replay.state == {} and replay.g3 == {}  # random bytes hold no valid header


# --- crc-valid frames with forged payloads --------------------------------------------------

ENTRY_OPS = st.sampled_from([*journal.OPS, journal.BATCH, 0, 6, 255])


@st.composite
def forged_payloads(draw: st.DrawFn) -> bytes:
    """Entries whose fields are drawn independently: lengths, counts and ops that may not
    match the bytes that follow; batches that claim up to 2**32 - 1 entries."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(ENTRY_OPS)
        if op == journal.BATCH:
            out += journal.BATCH_HEAD.pack(
                journal.BATCH,
                draw(ENTRY_OPS),
                draw(
                    st.one_of(st.integers(0, 8), st.just(0xFFFFFFFF), st.integers(0, (1 << 32) - 1))
                ),
                draw(st.sampled_from([0, 1, 4, 0xFFFF])),
                draw(st.sampled_from([0, 1, 2, 255])),
            )
        else:
            out += journal.ENTRY_HEAD.pack(op, draw(st.sampled_from([0, 1, 4, 0xFFFF])))
        out += draw(st.binary(max_size=40))
    return bytes(out)[: draw(st.integers(1, len(out)))]


@fuzz(500)
@given(payload=forged_payloads())
@example(payload=journal.BATCH_HEAD.pack(journal.BATCH, journal.REMOVE_G3, 0xFFFFFFFF, 0, 0))
def test_a_forged_payload_is_applied_whole_or_not_at_all_and_quickly(payload) -> None:
    case("journal bytes")
    state = journal.DictState()
    state[b"before"] = journal.Residency(journal.PUT_G2, (1,))
    started = time.perf_counter()
    ok = journal.apply_payload(state, payload)
    # Decoding costs time in proportion to the payload, whatever its headers claim.
    assert time.perf_counter() - started < 0.5
    if not ok:
        assert state == {b"before": journal.Residency(journal.PUT_G2, (1,))} and state.g3 == {}


@fuzz(200)
@given(payloads=st.lists(forged_payloads(), min_size=1, max_size=5))
def test_a_warm_start_over_forged_frames_takes_only_records_that_fit_the_index(payloads) -> None:
    case("journal bytes")
    buf = bytearray(SMALL)
    Writer(buf, list)  # a fresh epoch 1, frame seq 0 next
    pos = read(buf).start
    for seq, payload in enumerate(payloads):
        raw = frame(1, seq, payload)
        if pos + len(raw) > journal.DATA_START + read(buf).half_size:
            break
        buf[pos : pos + len(raw)] = raw
        pos += len(raw)
    index = BlockIndex([SlotPool("k", 4096, 8), SlotPool("v", 4096, 8)])

    replayed, _ = recover(index, memoryview(buf), LOG)

    blocks = list(index.blocks())
    taken = [[b.slots[p] for b in blocks] for p in range(2)]
    for p, slots in enumerate(taken):
        assert len(set(slots)) == len(slots) and all(0 <= s < 8 for s in slots)
        assert index.pools[p].free == 8 - len(slots)
    assert index.audit()["double"] == 0
    assert all(r.tier == journal.PUT_G3 for r in replayed.g3.values())


def test_a_batch_claiming_billions_of_empty_entries_is_decoded_at_once() -> None:
    # Regression: a crc-valid frame whose batch entry claims 2**32 - 1 removals of the empty
    # key (zero bytes each) made every reader loop 4 billion times, appending to a list,
    # which froze the guard service's journal follower. Those entries are all the same
    # removal, so the batch now applies as one.
    payload = journal.BATCH_HEAD.pack(journal.BATCH, journal.REMOVE, 0xFFFFFFFF, 0, 0)
    g2 = journal.DictState()
    g2.update({b"": journal.Residency(journal.PUT_G2, (1,)), b"k": journal.Residency(1, (2,))})
    started = time.perf_counter()
    assert journal.apply_payload(g2, payload)
    # Four billion turns take minutes; a second leaves room for a loaded machine's preemption.
    assert time.perf_counter() - started < 1.0
    assert g2 == {b"k": journal.Residency(1, (2,))}
