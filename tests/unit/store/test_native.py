"""The compiled core (``kvcr.store._core``, loaded by store/native.py) at its boundary: no
fallback when it cannot load, malformed batches raise and change nothing, the table agrees
with a dict through every key length, rebuild and widening, and a million calls leak no
reference and no memory; a pool's free slots are handed out as a Python model does. ``nox -s
sanitize`` runs this file under ASan and UBSan."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcr.store.keytable import MAX_WIDTH, KeyTable
from kvcr.store.native import KeyCore, take_free


def intp(*values: int) -> bytes:
    """Records as the core takes them: native intp bytes."""
    return np.array(values, dtype=np.intp).tobytes()


def digest32(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=32).digest()


# ---- no fallback ---------------------------------------------------------------------------


def test_a_core_that_cannot_load_stops_import_kvcr_with_the_file_and_the_fix() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["kvcr.store._core"] = None  # as if the .so were missing or broken
        try:
            import kvcr
        except ImportError as exc:
            print(type(exc).__name__, "|", exc, "|", type(exc.__cause__).__name__)
            sys.exit(3)
        print("imported", kvcr.__file__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3, (done.stdout, done.stderr)  # no silent fallback
    kind, message, cause = (part.strip() for part in done.stdout.split("|"))
    assert kind == "ImportError" and cause == "ModuleNotFoundError"
    assert "kvcr.store._core" in message and "_core.abi3.so" in message  # the file
    assert "uv sync --reinstall-package kvcr" in message and "C compiler" in message  # the fix
    assert "python3-dev" in message


# ---- the boundary: malformed batches raise and leave the table as it was -------------------

CAP = 16


def state(table: Any) -> tuple[Any, ...]:
    """Everything a call could have changed."""
    recs = np.frombuffer(table.live(), np.intp)
    keys = table.keys_of(recs.tobytes()) if len(recs) else []
    return (
        len(table),
        sorted(zip(keys, recs.tolist())),
        table.width,
        table.used,
        table.size,
        table.filings,
        table.rebuilds,
    )


@pytest.fixture
def core() -> Any:
    """A core table over records 0..15 with short and long keys in records 0-3."""
    table = KeyCore(CAP, 32, digest32)
    assert table.file([b"k0", b"k1" * 20, b"L" * 100, b""], intp(0, 1, 2, 3), False) == bytearray(
        intp(-1, -1, -1, -1)
    )
    return table


FLAGS = bytearray(CAP)
ANSWERS = list(range(8))

MALFORMED: list[tuple[str, type[Exception], str, Callable[[Any], object]]] = [
    # Records out of range, or negative.
    (
        "file: a record past the end",
        ValueError,
        "outside 0..15",
        lambda t: t.file([b"x"], intp(CAP), False),
    ),
    ("file: a negative record", ValueError, "outside", lambda t: t.file([b"x"], intp(-1), False)),
    (
        "file: the last good record, then a bad one",
        ValueError,
        "outside",
        lambda t: t.file([b"x", b"y"], intp(4, 1 << 40), False),
    ),
    (
        "file_rows: a record past the end",
        ValueError,
        "outside",
        lambda t: t.file_rows(b"ab", 2, intp(CAP)),
    ),
    ("drop: a record past the end", ValueError, "outside", lambda t: t.drop(intp(0, CAP))),
    ("drop: a negative record", ValueError, "outside", lambda t: t.drop(intp(-5))),
    ("keys_of: a negative record", ValueError, "outside", lambda t: t.keys_of(intp(-1))),
    ("key: a record past the end", ValueError, "outside", lambda t: t.key(CAP)),
    ("key: a negative record", ValueError, "outside", lambda t: t.key(-1)),
    # Records bytes of the wrong length, or not bytes.
    (
        "file: fewer records than keys",
        ValueError,
        "for 2 keys",
        lambda t: t.file([b"x", b"y"], intp(5), False),
    ),
    (
        "file: more records than keys",
        ValueError,
        "for 1 keys",
        lambda t: t.file([b"x"], intp(5, 6), False),
    ),
    (
        "file: records not a whole number of intp",
        ValueError,
        "bytes of records",
        lambda t: t.file([b"x"], intp(5)[:7], False),
    ),
    (
        "file: records as a bytearray",
        TypeError,
        "intp bytes",
        lambda t: t.file([b"x"], bytearray(intp(5)), False),
    ),
    ("file: records as a list", TypeError, "intp bytes", lambda t: t.file([b"x"], [5], False)),
    (
        "file_rows: records for fewer rows",
        ValueError,
        "for 2 keys",
        lambda t: t.file_rows(b"abcd", 2, intp(5)),
    ),
    (
        "drop: records not a whole number of intp",
        ValueError,
        "bytes of records",
        lambda t: t.drop(intp(0, 1)[:9]),
    ),
    (
        "keys_of: records not a whole number of intp",
        ValueError,
        "bytes of records",
        lambda t: t.keys_of(b"\x00" * 3),
    ),
    # A key that is not bytes, anywhere in a batch.
    (
        "file: a str key after good ones",
        TypeError,
        "must be bytes",
        lambda t: t.file([b"x", b"y" * 99, "z"], intp(5, 6, 7), False),
    ),
    (
        "file: a bytearray key",
        TypeError,
        "must be bytes",
        lambda t: t.file([bytearray(b"x")], intp(5), False),
    ),
    (
        "file: keys as bytes (ints inside)",
        TypeError,
        "must be bytes",
        lambda t: t.file(b"ab", intp(5, 6), False),
    ),
    ("file: keys not a sequence", TypeError, "", lambda t: t.file(5, intp(5), False)),
    ("lookup: None among keys", TypeError, "must be bytes", lambda t: t.lookup([b"k0", None])),
    ("find: a str key", TypeError, "must be bytes", lambda t: t.find("k0")),
    (
        "answers: an int among keys",
        TypeError,
        "must be bytes",
        lambda t: t.answers([b"k0", 1], FLAGS, ANSWERS),
    ),
    # The flags and the answers table of answers().
    (
        "answers: flags shorter than the capacity",
        ValueError,
        "cover every record",
        lambda t: t.answers([b"k0"], bytearray(CAP - 1), ANSWERS),
    ),
    (
        "answers: flags as bytes",
        TypeError,
        "bytearray",
        lambda t: t.answers([b"k0"], bytes(CAP), ANSWERS),
    ),
    (
        "answers: a table of 7",
        ValueError,
        "8 answers",
        lambda t: t.answers([b"k0"], FLAGS, ANSWERS[:7]),
    ),
    (
        "answers: a table of 9",
        ValueError,
        "8 answers",
        lambda t: t.answers([b"k0"], FLAGS, [*ANSWERS, 8]),
    ),
    (
        "answers: a table as a tuple",
        TypeError,
        "list",
        lambda t: t.answers([b"k0"], FLAGS, tuple(ANSWERS)),
    ),
    # A record given twice.
    (
        "file: a record given twice",
        ValueError,
        "record 5 is given twice",
        lambda t: t.file([b"x", b"y"], intp(5, 5), False),
    ),
    (
        "file: a record given twice, absent keys",
        ValueError,
        "given twice",
        lambda t: t.file([b"x", b"y", b"z"], intp(5, 6, 5), True),
    ),
    (
        "file: a record given twice, long keys",
        ValueError,
        "given twice",
        lambda t: t.file([b"x" * 70, b"y" * 70], intp(7, 7), False),
    ),
    (
        "file: a record given twice, one key already filed",
        ValueError,
        "given twice",
        lambda t: t.file([b"k0", b"y"], intp(5, 5), False),
    ),
    (
        "file_rows: a record given twice",
        ValueError,
        "record 9 is given twice",
        lambda t: t.file_rows(b"aabbcc", 2, intp(8, 9, 9)),
    ),
    (
        "drop: a record given twice",
        ValueError,
        "record 1 is given twice",
        lambda t: t.drop(intp(0, 1, 1)),
    ),
    (
        "drop: a long key's record given twice",
        ValueError,
        "given twice",
        lambda t: t.drop(intp(2, 3, 2)),
    ),
    # Drop of a record without a key; file of a record that has one.
    (
        "drop: one record without a key",
        KeyError,
        "record 9 has no key",
        lambda t: t.drop(intp(0, 2, 9)),
    ),
    (
        "keys_of: a record without a key",
        KeyError,
        "record 4 has no key",
        lambda t: t.keys_of(intp(0, 4)),
    ),
    ("key: a record without a key", KeyError, "record 4 has no key", lambda t: t.key(4)),
    (
        "file: a record that has a key",
        ValueError,
        "record 1 already has a key",
        lambda t: t.file([b"new", b"x"], intp(5, 1), False),
    ),
    (
        "file: a long key's record",
        ValueError,
        "record 2 already has a key",
        lambda t: t.file([b"new"], intp(2), True),
    ),
    (
        "file_rows: a record that has a key",
        ValueError,
        "record 3 already has a key",
        lambda t: t.file_rows(b"ab", 2, intp(3)),
    ),
    # file_rows: bytes that are not rows of the length.
    (
        "file_rows: 5 bytes in rows of 2",
        ValueError,
        "not rows of 2",
        lambda t: t.file_rows(b"abcde", 2, intp(5, 6)),
    ),
    (
        "file_rows: rows wider than 64",
        ValueError,
        "not rows of 65",
        lambda t: t.file_rows(b"a" * 65, 65, intp(5)),
    ),
    (
        "file_rows: a negative length",
        ValueError,
        "not rows",
        lambda t: t.file_rows(b"ab", -2, intp(5)),
    ),
    (
        "file_rows: bytes in rows of 0",
        ValueError,
        "not rows of 0",
        lambda t: t.file_rows(b"ab", 0, intp(5)),
    ),
    ("file_rows: rows as a str", TypeError, "", lambda t: t.file_rows("ab", 2, intp(5))),
    (
        "file_rows: rows as a bytearray",
        TypeError,
        "",
        lambda t: t.file_rows(bytearray(b"ab"), 2, intp(5)),
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [pytest.param(call, error, match, id=name) for name, error, match, call in MALFORMED],
)
def test_a_malformed_call_raises_and_leaves_the_table_as_it_was(
    core: Any, call: Callable[[Any], object], error: type[Exception], match: str
) -> None:
    before = state(core)
    with pytest.raises(error, match=match or None):
        call(core)
    assert state(core) == before
    # Still whole: every key found, and a good batch goes in after the bad one.
    assert np.frombuffer(core.lookup([b"k0", b"k1" * 20, b"L" * 100, b""]), np.intp).tolist() == [
        0,
        1,
        2,
        3,
    ]
    assert core.file([b"after"], intp(15), False) == bytearray(intp(-1))
    assert core.find(b"after") == 15 and len(core) == 5


def test_a_digest_of_the_wrong_kind_raises_and_files_nothing() -> None:
    for digest, error in (
        (lambda key: b"short", ValueError),
        (lambda key: "x" * 32, ValueError),
        (lambda key: 1 / 0, ZeroDivisionError),
    ):
        table = KeyCore(8, 32, digest)
        table.file([b"short"], intp(0), False)
        before = state(table)
        with pytest.raises(error):
            table.file([b"a", b"L" * 65], intp(1, 2), False)
        with pytest.raises(error):
            table.find(b"L" * 65)
        assert state(table) == before


@pytest.mark.parametrize(
    ("capacity", "width", "digest", "error"),
    [
        (-1, 32, digest32, ValueError),
        (2**29, 32, digest32, ValueError),  # past INT32_MAX / 4
        (2**70, 32, digest32, OverflowError),
        (8, -1, digest32, ValueError),
        (8, MAX_WIDTH + 1, digest32, ValueError),
        (8, 32, b"not callable", ValueError),
        ("8", 32, digest32, TypeError),
    ],
)
def test_a_capacity_or_width_out_of_range_is_refused_at_construction(
    capacity: Any, width: Any, digest: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        KeyCore(capacity, width, digest)
    if not isinstance(digest, bytes):
        with pytest.raises(error):
            KeyTable(capacity, width)


def test_the_smallest_and_widest_tables_take_their_keys() -> None:
    empty = KeyTable(0)
    assert empty.find_many([b"a", b"L" * 99]).tolist() == [-1, -1] and len(empty) == 0
    with pytest.raises(ValueError, match="outside"):
        empty.add(b"a", 0)
    wide = KeyTable(4, width=MAX_WIDTH)
    assert wide.width == MAX_WIDTH
    wide.add_many([b"w" * MAX_WIDTH, b""], np.arange(2))
    assert wide.find_many([b"w" * MAX_WIDTH, b""]).tolist() == [0, 1]


def test_every_key_length_is_found_and_read_back() -> None:
    # 0 and 1 to 64 bytes (rows), and longer (a digest): each with a twin that differs only in
    # its last byte, and one a trailing zero longer.
    lengths = range(MAX_WIDTH + 40)
    keys = [bytes((n * 7 + j) % 251 + 1 for j in range(n)) for n in lengths]
    twins = [k[:-1] + bytes([k[-1] ^ 0xFF]) for k in keys if k] + [k + b"\x00" for k in keys]
    table = KeyTable(len(keys) + len(twins))
    for start in range(0, len(keys), 17):  # the table widens batch by batch
        chunk = keys[start : start + 17]
        assert table.add_many(chunk, np.arange(start, start + len(chunk))).tolist() == [-1] * len(
            chunk
        )
    assert table.width == MAX_WIDTH
    assert table.find_many(keys).tolist() == list(range(len(keys)))
    assert table.find_many(twins).tolist() == [-1] * len(twins)
    assert table.keys(np.arange(len(keys))) == keys
    table.add_many(twins, np.arange(len(keys), len(keys) + len(twins)))
    assert table.find_many(keys + twins).tolist() == list(range(len(keys) + len(twins)))
    assert sorted(table.items()) == sorted(zip(keys + twins, range(len(keys) + len(twins))))


# ---- the table against a dict ---------------------------------------------------------------

MODEL_CAP = 24  # 128 entries: churn fills them with tombstones within a few rounds


def key_of_length(length: int, seed: int) -> bytes:
    return bytes((seed + 31 * j) % 256 for j in range(length))


# Few distinct seeds, every length: batches repeat keys, and keys already filed come again.
KEYS = st.builds(key_of_length, st.integers(0, MAX_WIDTH + 36), st.integers(0, 3))


class NativeTableModel(RuleBasedStateMachine):
    """The compiled table (through KeyTable) against a dict of key -> record, the width it
    must have, and the answers ``query`` would read."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(MODEL_CAP)
        self.model: dict[bytes, int] = {}
        self.seen: set[bytes] = set()
        self.width = 32
        self.fresh = 0
        self.flags = bytearray(MODEL_CAP)
        self.answers = [object() for _ in range(8)]

    def free(self) -> list[int]:
        return sorted(set(range(MODEL_CAP)) - set(self.model.values()))

    def widen(self, lengths: list[int]) -> None:
        rows = [n for n in lengths if n <= MAX_WIDTH]
        if rows and max(rows) > self.width:
            self.width = (max(rows) + 7) // 8 * 8

    def expect_filed(self, keys: list[bytes], recs: list[int], seen: bool = True) -> list[int]:
        """The holders a filing of ``keys`` under ``recs`` gives, one key after another."""
        holders = []
        for key, rec in zip(keys, recs):
            holders.append(self.model.get(key, -1))
            self.model.setdefault(key, rec)
        if seen:  # asked for again after every step
            self.seen.update(keys)
        self.widen([len(k) for k in keys])
        return holders

    @initialize(flags=st.binary(min_size=MODEL_CAP, max_size=MODEL_CAP))
    def set_flags(self, flags: bytes) -> None:
        self.flags[:] = flags

    @rule(keys=st.lists(KEYS, max_size=12))
    def file(self, keys: list[bytes]) -> None:
        recs = self.free()[: len(keys)]
        keys = keys[: len(recs)]
        holders = self.table.add_many(keys, np.array(recs, dtype=np.intp))
        assert holders.tolist() == self.expect_filed(keys, recs)

    @rule(keys=st.lists(KEYS, max_size=12, unique=True), meanwhile=st.booleans())
    def file_probed(self, keys: list[bytes], meanwhile: bool) -> None:
        """What a deposit does: look up, then file the absent keys with no compare, unless
        something was filed in between (then they are compared again)."""
        probe = self.table.probe(keys)
        assert probe.found.tolist() == [self.model.get(k, -1) for k in keys]
        absent = np.flatnonzero(probe.found < 0)
        free = self.free()
        absent = absent[: len(free)]
        if meanwhile and len(absent) and len(free) > len(absent):
            early = keys[int(absent[0])]
            self.table.add(early, free[-1])
            self.expect_filed([early], [free[-1]])
        recs = free[: len(absent)]
        absent_keys = [keys[i] for i in absent.tolist()]
        expected = [self.model.get(k, -1) for k in absent_keys]
        holders = self.table.add_probed(probe, absent, np.array(recs, dtype=np.intp))
        assert holders.tolist() == expected
        self.expect_filed(absent_keys, recs)

    @rule(length=st.integers(0, MAX_WIDTH + 8), seeds=st.lists(st.integers(0, 5), max_size=10))
    def file_rows(self, length: int, seeds: list[int]) -> None:
        recs = self.free()[: len(seeds)]
        keys = [key_of_length(length, s) for s in seeds[: len(recs)]]
        rows = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), length)
        holders = self.table.add_rows(rows, np.array(recs, dtype=np.intp))
        assert holders.tolist() == self.expect_filed(keys, recs)
        if length <= MAX_WIDTH:
            self.widen([length])  # rows of a length widen the table even if none is new

    @precondition(lambda self: self.model)
    @rule(picks=st.lists(st.integers(0, MODEL_CAP), max_size=MODEL_CAP))
    def remove(self, picks: list[int]) -> None:
        live = list(self.model.items())
        gone = dict(live[p % len(live)] for p in picks)
        self.table.remove_many(np.array(list(gone.values()), dtype=np.intp))
        for key in gone:
            del self.model[key]

    @precondition(lambda self: self.model and len(self.model) < MODEL_CAP)
    @rule(pick=st.integers(0, MODEL_CAP))
    def replace(self, pick: int) -> None:
        key, old = list(self.model.items())[pick % len(self.model)]
        new = self.free()[0]
        self.table.replace(old, new)
        self.model[key] = new

    @precondition(lambda self: len(self.model) <= MODEL_CAP - 8)
    @rule(
        rounds=st.integers(10, 30),
        absent=st.booleans(),
        lengths=st.lists(st.integers(0, 90), min_size=1, max_size=4),
    )
    def churn(self, rounds: int, absent: bool, lengths: list[int]) -> None:
        """Fill every free record with new keys and drop them again, round after round (at
        least ``rounds``, and until the table was rebuilt): tombstones fill the table."""
        table = self.table
        cleared = 0  # rebuilds that cleared tombstones (not those that widened the rows)
        round_ = 0
        while round_ < rounds or not cleared:
            assert round_ < 500, "churn never rebuilt the table"
            recs = self.free()
            keys = []
            for i in range(len(recs)):
                self.fresh += 1
                stem = f"{self.fresh}:".encode()
                n = max(len(stem), lengths[(round_ + i) % len(lengths)])
                keys.append((stem * n)[:n])
            width, rebuilds = table.width, table.rebuilds
            if absent:
                probe = table.probe(keys)
                found = np.arange(len(keys))
                holders = table.add_probed(probe, found, np.array(recs, dtype=np.intp))
            else:
                holders = table.add_many(keys, np.array(recs, dtype=np.intp))
            cleared += table.rebuilds - rebuilds - (table.width != width)
            assert holders.tolist() == self.expect_filed(keys, recs, seen=False)
            gone = [self.model.pop(k) for k in keys]
            table.remove_many(np.array(gone, dtype=np.intp))
            round_ += 1
        kept = keys[-2:]  # the last round leaves two behind
        self.table.add_many(kept, np.array(recs[:2], dtype=np.intp))
        self.expect_filed(kept, recs[:2])

    @invariant()
    def agrees_with_the_dict(self) -> None:
        table, model = self.table, self.model
        assert len(table) == len(model) and table.width == self.width
        assert table.used * 10 <= table.size * 7
        keys = list(model)
        asked = keys + sorted(self.seen - set(keys)) + [k + b"\x00" for k in keys[:8]] + [b"never"]
        expected = [model.get(k, -1) for k in asked]
        assert [table.find(k) for k in asked] == expected
        assert table.find_many(asked).tolist() == expected
        said = table.answers(asked, self.flags, self.answers)
        assert all(
            got is self.answers[0 if rec < 0 else self.flags[rec] & 7]
            for got, rec in zip(said, expected)
        )
        recs = np.array([model[k] for k in keys], dtype=np.intp)
        assert table.keys(recs) == keys
        assert [table.key(int(r)) for r in recs] == keys
        assert sorted(table.items()) == sorted(model.items())
        assert sorted(table.records().tolist()) == sorted(model.values())
        for rec in set(range(MODEL_CAP)) - set(model.values()):
            with pytest.raises(KeyError):
                table.key(rec)


NativeTableModel.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, derandomize=True, database=None
)
test_the_native_table_agrees_with_a_dict = NativeTableModel.TestCase


# ---- a million calls leak nothing -----------------------------------------------------------

MILLION = 1_000_000


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_million_calls_leak_no_reference_and_no_memory() -> None:
    def digest(key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=32).digest()

    capacity = 64
    table = KeyCore(capacity, 32, digest)
    filed = [bytes([i, 255 - i]) * (3 + i % 13) for i in range(20)] + [
        bytes([i]) * 80 for i in range(4)
    ]
    table.file(filed, np.arange(24, dtype=np.intp).tobytes(), False)
    batch = [filed[0], filed[21], b"absent-key", filed[7]]
    movers = [b"mover-one", b"mover-two" * 5, b"M" * 90, b"mover-four"]
    mover_recs = np.arange(40, 44, dtype=np.intp).tobytes()
    filed_recs = np.arange(24, dtype=np.intp).tobytes()
    flags = bytearray(b"\x01\x02\x03\x04\x05\x06\x07\x00" * (capacity // 8))
    answers = [object() for _ in range(8)]
    watched: list[object] = [
        *filed,
        *batch,
        *movers,
        *answers,
        digest,
        flags,
        mover_recs,
        filed_recs,
        batch,
        movers,
    ]

    def loops(scale: int) -> None:
        # 1,000,000 calls at scale 1: 300k find, 200k lookup, 150k answers, 2 x 100k
        # file + drop, 100k key, 50k keys_of.
        find, lookup, answer, file, drop, key, keys_of = (
            table.find,
            table.lookup,
            table.answers,
            table.file,
            table.drop,
            table.key,
            table.keys_of,
        )
        for _ in range(300_000 // 4 // scale):
            find(batch[0]), find(batch[1]), find(batch[2]), find(batch[3])
        for _ in range(200_000 // scale):
            lookup(batch)
        for _ in range(150_000 // scale):
            answer(batch, flags, answers)
        for _ in range(100_000 // scale):
            file(movers, mover_recs, False)
            drop(mover_recs)
        for _ in range(100_000 // 4 // scale):
            key(0), key(21), key(22), key(5)
        for _ in range(50_000 // scale):
            keys_of(filed_recs)

    loops(scale=100)  # warm: caches, free lists, the interpreter's specialisations
    gc.collect()
    refs = [sys.getrefcount(obj) for obj in watched]
    objects = len(gc.get_objects())
    resident = rss()
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        loops(scale=1)
        gc.collect()
        traced_after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    gc.collect()
    assert [sys.getrefcount(obj) for obj in watched] == refs
    assert len(gc.get_objects()) - objects <= 5
    assert traced_after - traced_before < 64 * 1024
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan keeps freed memory aside
        # The core's own allocations (a batch's identities) are not traced: a leak of them
        # would grow the process by tens of MiB over 100k filings.
        assert rss() - resident < 16 * 2**20
    assert np.frombuffer(table.lookup(batch), np.intp).tolist() == [0, 21, -1, 7]
    assert len(table) == 24 and table.keys_of(filed_recs) == filed


# ---- a pool's free slots -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    taken=st.lists(st.booleans(), max_size=300).map(bytearray),
    start=st.integers(0, 300),
    count=st.integers(0, 300),
)
def test_take_free_hands_out_the_lowest_free_slots_as_a_python_model_does(
    taken: bytearray, start: int, count: int
) -> None:
    start = min(start, len(taken))
    free = [i for i in range(start, len(taken)) if not taken[i]]
    before = bytes(taken)
    if count > len(free):  # too few: an error, and nothing marked
        with pytest.raises(ValueError, match="free slots wanted"):
            take_free(taken, start, count)
        assert bytes(taken) == before
        return
    slots, after = take_free(taken, start, count)
    assert np.frombuffer(slots, np.intp).tolist() == free[:count]
    assert after == (free[count - 1] + 1 if count else start)
    assert [i for i in range(len(taken)) if taken[i] != before[i]] == free[:count]
    assert all(taken[i] == 1 for i in free[:count])


@pytest.mark.parametrize(("start", "count"), [(-1, 0), (0, -1), (9, 0)])
def test_take_free_refuses_a_start_or_count_outside_the_pool(start: int, count: int) -> None:
    taken = bytearray(8)
    with pytest.raises(ValueError, match="outside a pool of 8"):
        take_free(taken, start, count)
    assert taken == bytearray(8)
