"""The key table: block keys -> records with no Python object per key (store/keytable.py)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr.store.keytable import MAX_WIDTH, KeyTable


def recs(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.intp)


def test_a_filed_key_is_found_one_at_a_time_and_in_batches() -> None:
    table = KeyTable(16)
    assert table.add_many([b"a", b"b"], recs(3, 7)).tolist() == [-1, -1]
    assert table.find(b"a") == 3 and table.get(b"b") == 7 and table.get(b"c") is None
    assert table.find_many([b"b", b"c", b"a"]).tolist() == [7, -1, 3]
    assert b"a" in table and b"c" not in table and len(table) == 2
    assert table.key(7) == b"b" and table.keys(recs(3, 7)) == [b"a", b"b"]


def test_keys_that_differ_only_in_trailing_zero_bytes_are_different_keys() -> None:
    table = KeyTable(8)
    table.add_many([b"", b"\x00", b"a", b"a\x00", b"a\x00\x00"], recs(0, 1, 2, 3, 4))
    assert table.find_many([b"a\x00", b"", b"a\x00\x00", b"a", b"\x00"]).tolist() == [3, 0, 4, 2, 1]
    assert table.keys(recs(0, 1, 3)) == [b"", b"\x00", b"a\x00"]


def test_a_longer_key_widens_the_table_and_every_key_stays_found() -> None:
    table = KeyTable(8)
    assert table.width == 32
    table.add_many([b"k" * 32, b"x"], recs(0, 1))
    table.add(b"w" * 40, 2)
    assert table.width == 40
    assert table.find_many([b"k" * 32, b"x", b"w" * 40, b"w" * 39]).tolist() == [0, 1, 2, -1]
    assert table.key(2) == b"w" * 40


def test_a_key_longer_than_the_widest_row_is_filed_under_its_digest() -> None:
    table = KeyTable(8)
    long_key = bytes(range(200))
    table.add_many([long_key, b"short"], recs(5, 6))
    assert table.width == 32  # not widened for it
    assert table.find(long_key) == 5 and table.find(long_key[:-1] + b"!") == -1
    assert table.find_many([long_key, b"short"]).tolist() == [5, 6]
    assert table.key(5) == long_key and table.keys(recs(5, 6)) == [long_key, b"short"]
    table.remove(5)
    assert table.find(long_key) == -1


def test_a_key_that_has_a_record_is_not_filed_again() -> None:
    table = KeyTable(8)
    table.add(b"a", 1)
    assert table.add_many([b"b", b"a"], recs(2, 3)).tolist() == [-1, 1]
    with pytest.raises(KeyError, match="already has record 1"):
        table.add(b"a", 4)
    assert table.find(b"a") == 1 and len(table) == 2


def test_of_a_key_repeated_in_one_batch_one_record_is_filed_and_the_others_name_it() -> None:
    table = KeyTable(8)
    holders = table.add_many([b"d", b"e", b"d", b"d"], recs(0, 1, 2, 3)).tolist()
    filed = table.find(b"d")
    assert filed in (0, 2, 3) and holders[1] == -1
    assert sorted(holders[i] for i in (0, 2, 3)) == sorted([-1, filed, filed])
    assert len(table) == 2


def test_removal_leaves_the_others_found_and_replace_moves_a_key() -> None:
    table = KeyTable(64)
    keys = [bytes([i]) * 9 for i in range(40)]
    table.add_many(keys, np.arange(40))
    table.remove_many(np.arange(0, 40, 2))
    table.remove(1)
    assert table.find_many(keys).tolist() == [-1 if i % 2 == 0 or i == 1 else i for i in range(40)]
    table.replace(3, 50)
    assert table.find(keys[3]) == 50 and len(table) == 19
    with pytest.raises(KeyError, match="record 3 has no key"):
        table.remove(3)


@pytest.mark.parametrize("length", [8, 16, 24, 32, 40, 64])
def test_a_batch_finds_keys_at_their_home_entry_past_it_and_behind_tombstones(length: int) -> None:
    # 400 records in 2,048 entries, half of them removed and refilled: many keys sit past
    # their home entry or behind a tombstone there. A batch of one key length is read a row
    # at a time (lengths of 1, 2, 4 or 8 words) or word by word (3 and 5).
    table = KeyTable(400, width=length)
    first = [i.to_bytes(2, "little") * (length // 2) for i in range(400)]
    table.add_many(first, np.arange(400))
    table.remove_many(np.arange(0, 400, 2))
    refill = [(i + 1000).to_bytes(2, "little") * (length // 2) for i in range(0, 400, 2)]
    table.add_many(refill, np.arange(0, 400, 2))
    live = dict(zip(first[1::2], range(1, 400, 2))) | dict(zip(refill, range(0, 400, 2)))
    gone = first[::2]
    batch = [*live, *gone]
    assert table.find_many(batch).tolist() == [*live.values()] + [-1] * len(gone)


def test_churn_reuses_tombstones_so_the_table_is_not_rebuilt_and_loses_nothing() -> None:
    table = KeyTable(100)
    live: dict[bytes, int] = {}
    for round_ in range(300):
        fresh = [f"{round_}:{i}".encode() for i in range(60)]
        free = sorted(set(range(100)) - set(live.values()))[:60]
        assert table.add_many(fresh, np.array(free)).tolist() == [-1] * 60
        live.update(zip(fresh, free))
        gone = list(live)[:60]
        table.remove_many(np.array([live.pop(k) for k in gone]))
    assert sorted(table.items()) == sorted(live.items())
    assert table.find_many(list(live)).tolist() == list(live.values())
    # 18,000 insertions, each after a removal, into 512 entries of which 100 are live: a
    # table that never filled a tombstone again would be rebuilt every (0.7 x 512 - 100)
    # insertions, 70 times; refilling them, it was rebuilt far less often.
    assert 0 < table.rebuilds < 50


Filer = Callable[[KeyTable, list[bytes], dict[bytes, int], np.ndarray], None]


def churn(file: Filer) -> None:
    """60 rounds of 100 new keys, each round's filed by ``file`` (given the table, the new
    keys, the live ones and free records for the new ones) into a table of 300 records
    (2,048 entries: long probe runs once most hold keys or tombstones), 100 removed once
    150 are live: every live key stays found under its record."""
    table = KeyTable(300)
    live: dict[bytes, int] = {}
    for round_ in range(60):
        fresh = [f"{round_}:{i}".encode() for i in range(100)]
        free = np.array(sorted(set(range(300)) - set(live.values()))[:100])
        file(table, fresh, live, free)
        live.update(zip(fresh, free.tolist()))
        gone = list(live)[:100] if len(live) > 150 else []
        table.remove_many(np.array([live.pop(k) for k in gone], dtype=np.intp))
    assert len(table) == len(live)
    assert table.find_many(list(live)).tolist() == list(live.values())
    assert sorted(table.items()) == sorted(live.items())


def test_keys_a_lookup_found_absent_go_into_the_first_free_entries_and_are_found() -> None:
    def file(table: KeyTable, fresh: list[bytes], live: dict[bytes, int], free: np.ndarray):
        assert table.find_many(fresh).tolist() == [-1] * 100
        stamp = table.filings
        assert table.add_many(fresh, free, absent_at=stamp).tolist() == [-1] * 100

    churn(file)


def test_a_filing_since_the_lookup_voids_its_word_and_the_keys_are_looked_for_again() -> None:
    table = KeyTable(16)
    assert table.find_many([b"a", b"b"]).tolist() == [-1, -1]
    stamp = table.filings
    table.add(b"b", 9)  # meanwhile (the caller yielded, another operation filed it)
    assert table.add_many([b"a", b"b"], recs(1, 2), absent_at=stamp).tolist() == [-1, 9]
    assert table.find_many([b"a", b"b"]).tolist() == [1, 9] and len(table) == 2


def test_keys_a_probe_found_absent_are_filed_where_it_found_room_and_are_found() -> None:
    def file(table: KeyTable, fresh: list[bytes], live: dict[bytes, int], free: np.ndarray):
        batch = fresh + list(live)[:20]  # some filed already: only the absent ones are filed
        probe = table.probe(batch)
        assert probe.found.tolist() == [-1] * 100 + [live[k] for k in batch[100:]]
        absent = np.flatnonzero(probe.found < 0)
        assert table.add_probed(probe, absent, free).tolist() == [-1] * 100

    churn(file)


def test_a_probe_is_not_trusted_once_a_key_was_filed_after_it() -> None:
    table = KeyTable(64)
    batch = [bytes([i]) * 8 for i in range(40)]
    probe = table.probe(batch)
    table.add(batch[7], 63)  # meanwhile
    holders = table.add_probed(probe, np.arange(40), np.arange(40))
    assert holders.tolist() == [-1] * 7 + [63] + [-1] * 32
    assert table.find_many(batch).tolist() == [*range(7), 63, *range(8, 40)]


def test_rows_of_one_length_go_in_without_bytes_objects_and_read_back_as_keys() -> None:
    keys = [i.to_bytes(8, "big") for i in range(5000)]
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(5000, 8)
    table = KeyTable(5000)
    assert (table.add_rows(rows, np.arange(5000)) == -1).all()
    assert (table.find_many(keys) == np.arange(5000)).all()
    # Into a table that has keys (one probe step a round), with one key already there.
    more = KeyTable(5000)
    more.add(keys[10], 4999)
    holders = more.add_rows(rows[:100], np.arange(100))
    assert holders.tolist() == [-1] * 10 + [4999] + [-1] * 89


def test_a_full_table_of_keys_adds_no_object_the_collector_tracks() -> None:
    table = KeyTable(50_000)
    gc.collect()
    before = len(gc.get_objects())
    for start in range(0, 50_000, 1000):
        batch = [i.to_bytes(16, "little") for i in range(start, start + 1000)]
        table.add_many(batch, np.arange(start, start + 1000))
    gc.collect()
    assert len(table) == 50_000
    assert len(gc.get_objects()) - before < 50


keys_strategy = st.binary(min_size=0, max_size=MAX_WIDTH + 20)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add_absent", "remove", "find"]),
            st.lists(keys_strategy, max_size=40),
        ),
        max_size=40,
    )
)
def test_the_table_agrees_with_a_dict(steps: list[tuple[str, list[bytes]]]) -> None:
    table, model = KeyTable(200), {}
    free = list(range(200))
    for action, keys in steps:
        if action == "add":
            batch = keys[: len(free)]
            given_recs = [free.pop() for _ in batch]
            holders = table.add_many(batch, np.array(given_recs, dtype=np.intp)).tolist()
            for key, rec, holder in zip(batch, given_recs, holders):
                if holder < 0:
                    assert key not in model
                    model[key] = rec
                else:
                    free.append(rec)
            assert all(model[k] == h for k, h in zip(batch, holders) if h >= 0)
        elif action == "add_absent":  # what a deposit files after its lookup
            batch = list(dict.fromkeys(keys))
            probe = table.probe(batch)
            absent = np.flatnonzero(probe.found < 0)[: len(free)]
            given_recs = [free.pop() for _ in absent]
            holders = table.add_probed(probe, absent, np.array(given_recs, dtype=np.intp))
            assert holders.tolist() == [-1] * len(absent)
            model.update(zip([batch[i] for i in absent.tolist()], given_recs))
        elif action == "remove":
            gone = {model.pop(k) for k in keys if k in model}
            table.remove_many(np.array(sorted(gone), dtype=np.intp))
            free.extend(gone)
        assert table.find_many(keys).tolist() == [model.get(k, -1) for k in keys]
        assert [table.find(k) for k in keys] == [model.get(k, -1) for k in keys]
        assert len(table) == len(model)
    assert sorted(table.items()) == sorted(model.items())
