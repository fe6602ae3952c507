"""Block keys -> records, with no Python object per key. Pure code over numpy arrays.

A block index of a million records cannot afford a dict: each entry costs a key object, an
int object and ~40 bytes of table (~150 B a key), and building it at a warm start makes a
million objects (~0.7 s). Here a key lives as a row of ``rows`` with its length in ``lens``,
both indexed by record (``keyrows.py``: what a key is filed under), and an open-addressing
table of int32 maps a hash of the row to the record (``keyprobe.py``: the entries and
lookups; ``keyplace.py``: filing records into them). A key longer than
:data:`~kvcr.store.keyrows.MAX_WIDTH` is filed under its digest, the key itself kept aside
by record.

The table is rebuilt without tombstones when they and the live entries fill
:data:`MAX_USED` of it. Engine threads read (``find_many``) without locks while the runtime
writes (see ``keyprobe.py`` for why that is safe).
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence

import numpy as np

from kvcr.store.keyplace import place, place_absent, place_sorted
from kvcr.store.keyprobe import (
    EMPTY,
    STEPS,
    TOMB,
    WINDOW,
    Layout,
    Probe,
    any_in_rows,
    match_homes,
    matches,
    probe_one,
)
from kvcr.store.keyrows import (
    ABSENT,
    DIGEST,
    MAX_WIDTH,
    U64_32,
    hash_one,
    hash_rows,
    identities,
    identity,
    width_for,
)

PYTHON_BATCH = 16  # a batch this small is probed key by key, in Python
PYTHON_TAIL = 16  # keys still probing past a window go on one by one, in Python
MAX_USED = 0.7  # live entries and tombstones, as a share of the table, before a rebuild


class KeyTable:
    """Block keys -> records in ``range(capacity)``; a record holds at most one key."""

    def __init__(self, capacity: int, width: int = 32) -> None:
        self.capacity = capacity
        self._lens_bytes = bytearray(capacity)
        self.lens = np.frombuffer(self._lens_bytes, np.uint8)
        # Where each record's entry is (stale once the record's key is gone: a removal
        # checks that the entry still names the record). A removal then writes a tombstone
        # without hashing the key or probing for it, a cache miss less per key at 1M.
        self._entry_ints = array.array("i", bytes(4 * capacity))
        self._entry = np.frombuffer(self._entry_ints, np.int32)
        self._long: dict[int, bytes] = {}  # record -> key, for keys filed under a digest
        # At most a quarter full of live keys: short probe runs, and room for tombstones
        # between rebuilds (one per ~2.5 million insertions under churn at a million).
        self._size = 1 << max(4, (4 * capacity - 1).bit_length())
        self._lay = Layout(capacity, width_for(min(width, MAX_WIDTH)), self._size)
        self._count = 0
        self._used = 0  # live entries and tombstones
        # Bumped by every filing: a batch found absent when it read this is absent still,
        # as long as it reads the same (removals leave keys absent).
        self.filings = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.find(key) >= 0

    @property
    def width(self) -> int:
        return self._lay.width

    def find(self, key: bytes) -> int:
        """The record of ``key``, or -1."""
        lay = self._lay
        row, code = identity(key, lay.width)
        if code == ABSENT:
            return -1
        h = hash_one(row, code)
        return probe_one(lay, self._lens_bytes, row, code, h & lay.mask, h >> 32)

    def get(self, key: bytes, default: int | None = None) -> int | None:
        rec = self.find(key)
        return default if rec < 0 else rec

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """The record of each key, -1 where it has none (intp)."""
        return self._find_many(keys, False).found

    def probe(self, keys: Sequence[bytes]) -> Probe:
        """:meth:`find_many`, keeping what filing the keys found absent needs (their rows,
        hashes, and where each one's probe sequence has its first free entry): for
        :meth:`add_probed`, which then files them without probing again."""
        return self._find_many(keys, True)

    def _find_many(self, keys: Sequence[bytes], keep: bool) -> Probe:
        n = len(keys)
        filings = self.filings
        if n <= PYTHON_BATCH:  # numpy's fixed cost per call would outweigh the batch
            found = np.array([self.find(k) for k in keys] if self._count else [-1] * n, np.intp)
            return Probe(keys, found, filings)
        found = np.full(n, -1, dtype=np.intp)
        if not self._count and not keep:
            return Probe(keys, found, filings)
        lay = self._lay
        words, codes = identities(keys, lay.width)
        hashes = hash_rows(words, codes)
        home = (hashes & np.uint64(lay.mask)).astype(np.intp)
        tag = (hashes >> U64_32).astype(np.uint32)
        todo, pos, tag, at_home = match_homes(lay, self.lens, found, home, tag, words, codes)
        # For filing the absent ones: each key's first free entry, its home or one of the
        # window after it (nearly all have one there: the others are filed from home).
        free = np.where(at_home < 0, home, -1) if keep else None
        first_window = True
        while len(todo) > PYTHON_TAIL:
            at = pos[:, None] + STEPS  # wrapped by the takes
            held = lay.slots.take(at, mode="wrap")
            i, rec = matches(lay, self.lens, at, held, tag, words[todo], codes[todo])
            found[todo[i]] = rec
            if free is not None and first_window:
                open_ = held < 0
                entry = np.where(any_in_rows(open_), (pos + open_.argmax(axis=1)) & lay.mask, -1)
                free[todo] = np.where(free[todo] >= 0, free[todo], entry)
            first_window = False
            # Keys whose window had neither their record nor an empty entry read on.
            going = ~any_in_rows(held == EMPTY)
            going[i] = False
            todo, pos, tag = todo[going], (pos[going] + WINDOW) & lay.mask, tag[going]
        # The few in long probe sequences: a numpy round each would cost more than Python.
        for i, p, t in zip(todo.tolist(), pos.tolist(), tag.tolist()):
            row = words[i].tobytes() + bytes(lay.width - 8 * words.shape[1])
            found[i] = probe_one(lay, self._lens_bytes, row, int(codes[i]), p, t)
        if free is None or (codes >= ABSENT).any():
            return Probe(keys, found, filings)  # digests and too-wide keys: add_many's way
        return Probe(keys, found, filings, lay, words, codes, hashes, free)

    def key(self, rec: int) -> bytes:
        """The key of a record that has one."""
        code = self._lens_bytes[rec]
        if code == DIGEST:
            return self._long[rec]
        w = self._lay.width
        return bytes(self._lay.row_bytes[rec * w : rec * w + code])

    def keys(self, recs: np.ndarray) -> list[bytes]:
        """The keys of records that have one (one C pass when they share a length)."""
        if not len(recs):
            return []
        codes = self.lens[recs]
        code = int(codes[0])
        if code != DIGEST and code and bool((codes == code).all()):
            rows = np.ascontiguousarray(self._lay.rows[recs, :code])
            keys: list[bytes] = rows.view(f"V{code}").ravel().tolist()
            return keys
        return [self.key(rec) for rec in recs.tolist()]

    def records(self) -> np.ndarray:
        """Every record with a key, in no particular order."""
        slots = self._lay.slots
        return slots[slots >= 0].astype(np.intp)

    def items(self) -> Iterator[tuple[bytes, int]]:
        recs = self.records()
        return zip(self.keys(recs), recs.tolist())

    def add(self, key: bytes, rec: int) -> None:
        """File ``key`` under ``rec`` (KeyError if the key has a record)."""
        holder = self.add_many([key], np.array([rec], dtype=np.intp))
        if holder[0] >= 0:
            raise KeyError(f"key table: {key!r} already has record {int(holder[0])}")

    def add_many(
        self, keys: Sequence[bytes], recs: np.ndarray, absent_at: int | None = None
    ) -> np.ndarray:
        """File each key under its record (``recs``: distinct, without keys); returns, per
        key, the record that holds it instead (-1: filed). A key that already had a record is
        not filed again; of a key repeated in ``keys``, one record is filed and the others
        name it.

        ``absent_at``: the caller found these keys distinct and absent (:meth:`find_many`)
        when :attr:`filings` read this. If it still does, each key goes into the first free
        entry of its probe sequence, with no key compared on the way (half the work)."""
        n = len(keys)
        if not n:
            return np.empty(0, dtype=np.intp)
        longest = widest = max(map(len, keys))
        if widest > MAX_WIDTH:  # digests are 32 bytes: only the others can widen the rows
            widest = max((n for n in map(len, keys) if n <= MAX_WIDTH), default=0)
        if widest > self._lay.width:
            self._rebuild(width_for(widest))
        lay = self._lay
        words, codes = identities(keys, lay.width, longest)
        long = np.flatnonzero(codes == DIGEST)
        for i in long.tolist():
            self._long[int(recs[i])] = keys[i]
        return self._file(recs, words, codes, absent_at == self.filings)

    def add_probed(self, probe: Probe, absent: np.ndarray, recs: np.ndarray) -> np.ndarray:
        """:meth:`add_many` for keys of ``probe`` it found absent (``absent``: their indices
        in it, distinct keys), each under its record in ``recs``. If nothing was filed
        since the probe and the table was not rebuilt, each goes into the free entry the
        probe found for it (of two that wanted one entry, the other into the next free one;
        a key the probe found none for, into the first free one from its home): no probe
        again."""
        lay, n = self._lay, len(absent)
        if (
            probe.free is None
            or probe.layout is not lay
            or probe.filings != self.filings
            or self._used + n > MAX_USED * self._size
        ):
            keys = [probe.keys[i] for i in absent.tolist()]
            return self.add_many(keys, recs, probe.filings)
        assert probe.words is not None and probe.codes is not None and probe.hashes is not None
        self.filings += 1
        words = probe.words.take(absent, axis=0)
        k = words.shape[1]
        lay.words[recs, :k] = words  # rows first: an entry is only read after its row
        if k < lay.width // 8:
            lay.words[recs, k:] = 0
        self.lens[recs] = probe.codes.take(absent)
        hashes, free = probe.hashes.take(absent), probe.free.take(absent)
        # From the free entry the probe found (the entries before it hold keys or
        # tombstones), else from the key's home.
        start = np.where(free >= 0, free, (hashes & np.uint64(lay.mask)).astype(np.intp))
        used = place_absent(lay, self._entry, recs, hashes, start)
        self._count += n
        self._used += used
        return np.full(n, -1, dtype=np.intp)

    def add_rows(self, rows: np.ndarray, recs: np.ndarray) -> np.ndarray:
        """:meth:`add_many` for keys given as rows of one length (``rows``: n x length
        uint8, e.g. a journal batch's keys in place): no object per key."""
        n, length = rows.shape
        if length > MAX_WIDTH:
            return self.add_many([bytes(r) for r in rows], recs)
        if length > self._lay.width:
            self._rebuild(width_for(length))
        padded = np.zeros((n, max(8, (length + 7) & ~7)), dtype=np.uint8)
        padded[:, :length] = rows
        return self._file(recs, padded.view("<u8"), np.full(n, length, dtype=np.intp))

    def _file(
        self, recs: np.ndarray, words: np.ndarray, codes: np.ndarray, absent: bool = False
    ) -> np.ndarray:
        self.filings += 1
        lay = self._lay
        if self._used + len(recs) > MAX_USED * self._size:
            self._rebuild(lay.width)
            lay = self._lay
        # Rows first: an entry is only ever read after the row it points at.
        k = words.shape[1]
        lay.words[recs, :k] = words
        if k < lay.width // 8:
            lay.words[recs, k:] = 0
        self.lens[recs] = codes
        hashes = hash_rows(words, codes)
        if absent:
            holders, used = (
                np.full(len(recs), -1, dtype=np.intp),
                place_absent(lay, self._entry, recs, hashes),
            )
        elif self._used:
            holders, used = place(lay, self.lens, self._entry, recs, hashes, k)
        else:
            holders = place_sorted(lay, self.lens, self._entry, recs, hashes)
            used = int((holders < 0).sum())
        self._count += int((holders < 0).sum())
        self._used += used
        return holders

    def remove(self, rec: int) -> None:
        """Drop the key of ``rec`` (KeyError if it has none): in Python, one key."""
        p = self._entry_ints[rec]
        if self._lay.slot_ints[p] != rec:
            raise KeyError(f"key table: record {rec} has no key")
        self._lay.slot_ints[p] = TOMB
        self._long.pop(rec, None)
        self._count -= 1

    def remove_many(self, recs: np.ndarray) -> None:
        """Drop the keys of distinct records that have one."""
        if not len(recs):
            return
        at = self._entry.take(recs)
        slots = self._lay.slots
        held = slots.take(at) == recs
        if not held.all():
            raise KeyError(f"key table: record {int(recs[~held][0])} has no key")
        slots[at] = TOMB
        if self._long:
            for rec in recs.tolist():
                self._long.pop(rec, None)
        self._count -= len(recs)

    def replace(self, old: int, new: int) -> None:
        """File the key of ``old`` under ``new`` instead (``new``: without a key)."""
        key = self.key(old)
        self.remove(old)
        self.add(key, new)

    def _rebuild(self, width: int) -> None:
        """A fresh table (no tombstones) at ``width``, swapped in whole."""
        old = self._lay
        recs = self.records()
        lay = Layout(self.capacity, width, self._size)
        keep = min(width, old.width)
        lay.rows[:, :keep] = old.rows[:, :keep]
        place_sorted(lay, self.lens, self._entry, recs, hash_rows(lay.words[recs], self.lens[recs]))
        self._lay = lay
        self._used = self._count
