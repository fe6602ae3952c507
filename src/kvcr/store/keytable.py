"""Block keys -> records, with no Python object per key. Pure code over numpy arrays.

A block index of a million records cannot afford a dict: each entry costs a key object, an
int object and ~40 bytes of table (~150 B a key), and building it at a warm start makes a
million objects (~0.7 s). Here a key lives as a row of ``rows`` (zero-padded to the table's
width, at most :data:`MAX_WIDTH` bytes) with its length in ``lens``, both indexed by record,
and an open-addressing table of int32 (linear probing, at most a quarter full of live entries)
maps a hash of the row to the record. A key longer than ``MAX_WIDTH`` is filed under its
BLAKE2b digest (length code :data:`DIGEST`), the key itself kept aside by record: engines'
keys are content hashes of 8-32 bytes, so that path is for odd callers only.

Batches (a query, a deposit, a replayed journal frame) are probed with numpy: each key's home
entry first (most keys are settled there), then a window of entries a round for the others,
all keys at once; a single key is probed in Python with the same hash.

Removal leaves a tombstone; insertion goes only into empty entries, so every key already in
the table lies before the first empty entry of its probe sequence and an insertion finds it
(a duplicate is reported, never filed twice). The table is rebuilt without tombstones when
they and the live entries fill :data:`MAX_USED` of it.

Engine threads read (``find_many``) without locks while the runtime writes: a row is written
before the entry that points at it, a rebuilt table is swapped in whole, and a reader only
trusts an entry whose row equals its key, so a racing read answers as of before or after the
change, never a wrong record.
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Iterator, Sequence

import numpy as np

EMPTY, TOMB = -1, -2
DIGEST = 255  # the length code of a key filed under its digest
ABSENT = 254  # the length code of a probe that cannot match (never stored)
MAX_WIDTH = 64
DIGEST_BYTES = 32
PYTHON_BATCH = 16  # a batch this small is probed key by key, in Python
PYTHON_TAIL = 16  # keys still probing past a window go on one by one, in Python
MAX_USED = 0.7  # live entries and tombstones, as a share of the table, before a rebuild
_SEED = 0x9E3779B97F4A7C15
_MUL = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1
_FIN = 0x94D049BB133111EB
_U64_SEED, _U64_MUL, _U64_FIN = np.uint64(_SEED), np.uint64(_MUL), np.uint64(_FIN)
_U64_27, _U64_30, _U64_31, _U64_32 = (np.uint64(n) for n in (27, 30, 31, 32))
_UNPACK = [struct.Struct(f"<{n}Q").unpack_from for n in range(MAX_WIDTH // 8 + 1)]
WINDOW = 8  # entries a batch probe reads per key and round (8 bools: one word, _any_in_rows)
_STEPS = np.arange(WINDOW)


def _width_for(length: int) -> int:
    return max(DIGEST_BYTES, (length + 7) & ~7)


def _words_of(code: int) -> int:
    """How many 8-byte words of a row the hash reads: the key's own, not the padding."""
    return DIGEST_BYTES // 8 if code == DIGEST else (code + 7) // 8


def _hash_rows(words: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The hash of each row (``words``: n x at least each key's own words, little-endian
    uint64) and length code, over the key's own words only (an 8-byte key: one round)."""
    x: np.ndarray = (codes.astype(np.uint64) + np.uint64(1)) * _U64_SEED
    if not len(codes):
        return x
    first = int(codes[0])
    uniform = bool((codes == first).all())
    counts = None if uniform else np.where(codes == DIGEST, DIGEST_BYTES // 8, (codes + 7) // 8)
    rounds = _words_of(first) if counts is None else int(counts.max())
    for j in range(min(rounds, words.shape[1])):
        mixed = (x ^ words[:, j]) * _U64_MUL
        mixed ^= mixed >> _U64_32
        x = mixed if counts is None else np.where(j < counts, mixed, x)
    # splitmix64's finaliser: every input bit reaches the low bits (the home entry) and the
    # high ones (the tag), which one multiply does not do for a key's high bytes.
    x ^= x >> _U64_30
    x *= _U64_MUL
    x ^= x >> _U64_27
    x *= _U64_FIN
    x ^= x >> _U64_31
    return x


# Per k: the word that k bools fill, and its value when they are all True.
_ALL_TRUE = {
    k: (dtype, dtype(int.from_bytes(b"\x01" * k, "little")))
    for k, dtype in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64))
}


def _rows_equal(rows: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """Which rows of ``rows`` (n x at least k uint64 words) begin with the same row of
    ``mine`` (n x k). For k of 1, 2, 4 or 8 the n x k comparison is read as one word a row,
    as :func:`_any_in_rows` does (``all(axis=1)`` costs several times more)."""
    equal = rows[:, : mine.shape[1]] == mine
    as_word = _ALL_TRUE.get(mine.shape[1])
    if as_word is None:
        every: np.ndarray = equal.all(axis=1)
        return every
    dtype, all_true = as_word
    every = equal.view(dtype).ravel() == all_true
    return every


def _any_in_rows(mask: np.ndarray) -> np.ndarray:
    """``mask.any(axis=1)`` for a fresh n x WINDOW bool array, read as one word a row
    (numpy's reduction along a short axis costs several times more)."""
    any_: np.ndarray = mask.view(np.uint64).ravel() != 0
    return any_


class _Layout:
    """The parts a reader needs at once (swapped whole when the table is rebuilt). Each
    array is a Python buffer (fast to index one element at a time) under a numpy view."""

    __slots__ = (
        "mask",
        "row_bytes",
        "rows",
        "slot_ints",
        "slots",
        "tag_ints",
        "tags",
        "width",
        "words",
    )

    def __init__(self, capacity: int, width: int, size: int) -> None:
        self.width = width
        self.row_bytes = bytearray(capacity * width)
        self.rows = np.frombuffer(self.row_bytes, np.uint8).reshape(capacity, width)
        self.words = self.rows.view("<u8")  # capacity x width/8
        self.slot_ints = array.array("i", bytes(4 * size))
        self.slots = np.frombuffer(self.slot_ints, np.int32)
        self.slots[:] = EMPTY
        self.tag_ints = array.array("I", bytes(4 * size))  # a hash's high half, by entry
        self.tags = np.frombuffer(self.tag_ints, np.uint32)
        self.mask = size - 1


class Probe:
    """A batch of keys looked up (:meth:`KeyTable.probe`): each one's record (``found``, -1:
    none), the table's count of filings then, and for filing the absent ones without a
    second probe (None where the batch did not keep them): the layout probed, the keys'
    rows, length codes and hashes, and each key's first free entry (-1: none found)."""

    __slots__ = ("codes", "filings", "found", "free", "hashes", "keys", "layout", "words")

    def __init__(
        self,
        keys: Sequence[bytes],
        found: np.ndarray,
        filings: int,
        layout: _Layout | None = None,
        words: np.ndarray | None = None,
        codes: np.ndarray | None = None,
        hashes: np.ndarray | None = None,
        free: np.ndarray | None = None,
    ) -> None:
        self.keys, self.found, self.filings, self.layout = keys, found, filings, layout
        self.words, self.codes, self.hashes, self.free = words, codes, hashes, free


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
        self._lay = _Layout(capacity, _width_for(min(width, MAX_WIDTH)), self._size)
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

    # -- identities: what a key is filed under ------------------------------------------------

    @staticmethod
    def _identity(key: bytes, width: int) -> tuple[bytes, int]:
        """The padded row and length code of ``key`` at ``width`` (code ABSENT: a key of
        this length cannot be in a table this narrow)."""
        length = len(key)
        if length <= width:
            return key + bytes(width - length), length
        if length > MAX_WIDTH:
            digest = hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()
            return digest + bytes(width - DIGEST_BYTES), DIGEST
        return bytes(width), ABSENT

    def _identities(
        self, keys: Sequence[bytes], width: int, longest: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The rows and length codes of ``keys``: rows as n x k little-endian uint64, where k
        (at most ``width`` / 8) covers the longest key's own words; zero-padded.
        ``longest``: the longest key's length, if the caller has it (a pass over the keys
        costs ~60 us a thousand)."""
        n = len(keys)
        if n and isinstance(keys[0], bytes):
            # The usual batch: keys of one length (content hashes), joined in one C call.
            joined, first = b"".join(keys), len(keys[0])
            uniform = first <= width and len(joined) == n * first
            if uniform and (max(map(len, keys)) if longest is None else longest) == first:
                if first % 8 == 0:
                    return (
                        np.frombuffer(joined, dtype="<u8").reshape(n, first // 8),
                        np.full(n, first, dtype=np.intp),
                    )
                rows = np.zeros((n, (first + 7) & ~7), dtype=np.uint8)
                rows[:, :first] = np.frombuffer(joined, dtype=np.uint8).reshape(n, first)
                return rows.view("<u8"), np.full(n, first, dtype=np.intp)
        lens = np.fromiter(map(len, keys), dtype=np.intp, count=n)
        if n and int(lens.max()) <= width:
            padded = max(8, (int(lens.max()) + 7) & ~7)
            rows = np.array(keys, dtype=f"S{padded}")  # zero-padded, in C
            return rows.view("<u8").reshape(n, padded // 8), lens
        idents = [self._identity(k, width) for k in keys]
        words = np.frombuffer(b"".join(row for row, _ in idents), dtype="<u8")
        return words.reshape(n, width // 8), np.array([c for _, c in idents], dtype=np.intp)

    @staticmethod
    def _hash_one(row: bytes | bytearray, code: int) -> int:
        x = ((code + 1) * _SEED) & _MASK64
        for word in _UNPACK[_words_of(code)](row):
            x = ((x ^ word) * _MUL) & _MASK64
            x ^= x >> 32
        x = ((x ^ (x >> 30)) * _MUL) & _MASK64
        x = ((x ^ (x >> 27)) * _FIN) & _MASK64
        return x ^ (x >> 31)

    # -- reads --------------------------------------------------------------------------------

    def find(self, key: bytes) -> int:
        """The record of ``key``, or -1."""
        lay = self._lay
        row, code = self._identity(key, lay.width)
        if code == ABSENT:
            return -1
        h = self._hash_one(row, code)
        return self._probe(lay, row, code, h & lay.mask, h >> 32)

    def _probe(self, lay: _Layout, row: bytes, code: int, p: int, tag: int) -> int:
        """The record filed at or after entry ``p`` for ``row`` and ``code``, or -1."""
        slots, tags, rows, lens = lay.slot_ints, lay.tag_ints, lay.row_bytes, self._lens_bytes
        w, mask = lay.width, lay.mask
        while True:
            rec = slots[p]
            if rec == EMPTY:
                return -1
            if (
                rec >= 0
                and tags[p] == tag
                and lens[rec] == code
                and rows[rec * w : rec * w + w] == row
            ):
                return rec
            p = (p + 1) & mask

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
        words, codes = self._identities(keys, lay.width)
        hashes = _hash_rows(words, codes)
        home = (hashes & np.uint64(lay.mask)).astype(np.intp)
        tag = (hashes >> _U64_32).astype(np.uint32)
        todo, pos, tag, at_home = self._match_homes(lay, found, home, tag, words, codes)
        # For filing the absent ones: each key's first free entry, its home or one of the
        # window after it (nearly all have one there: the others are filed from home).
        free = np.where(at_home < 0, home, -1) if keep else None
        first_window = True
        while len(todo) > PYTHON_TAIL:
            at = pos[:, None] + _STEPS  # wrapped by the takes
            held = lay.slots.take(at, mode="wrap")
            i, rec = self._matches(lay, at, held, tag, words[todo], codes[todo])
            found[todo[i]] = rec
            if free is not None and first_window:
                open_ = held < 0
                entry = np.where(_any_in_rows(open_), (pos + open_.argmax(axis=1)) & lay.mask, -1)
                free[todo] = np.where(free[todo] >= 0, free[todo], entry)
            first_window = False
            # Keys whose window had neither their record nor an empty entry read on.
            going = ~_any_in_rows(held == EMPTY)
            going[i] = False
            todo, pos, tag = todo[going], (pos[going] + WINDOW) & lay.mask, tag[going]
        # The few in long probe sequences: a numpy round each would cost more than Python.
        for i, p, t in zip(todo.tolist(), pos.tolist(), tag.tolist()):
            row = words[i].tobytes() + bytes(lay.width - 8 * words.shape[1])
            found[i] = self._probe(lay, row, int(codes[i]), p, t)
        if free is None or (codes >= ABSENT).any():
            return Probe(keys, found, filings)  # digests and too-wide keys: add_many's way
        return Probe(keys, found, filings, lay, words, codes, hashes, free)

    def _match_homes(
        self,
        lay: _Layout,
        found: np.ndarray,
        home: np.ndarray,
        tag: np.ndarray,
        words: np.ndarray,
        codes: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A lookup's first round, at each key's home entry alone: most keys that have a
        record are filed there (the table is at most a quarter full: ~88 % of them), and
        most that have none find it empty. One entry a key, not a window: ~25 % less for a
        batch of present keys. Sets ``found`` for the keys it finds; returns the others
        that must read on (their indices, the entry after their home, their tags) and what
        each key's home entry held."""
        held = lay.slots.take(home)
        both = np.flatnonzero((lay.tags.take(home) == tag) & (held >= 0))
        rec = held.take(both)
        same = (self.lens.take(rec) == codes.take(both)) & _rows_equal(
            lay.words.take(rec, axis=0), words.take(both, axis=0)
        )
        hit = both[same]
        found[hit] = rec[same]
        going = held != EMPTY
        going[hit] = False
        todo = np.flatnonzero(going)
        return todo, (home.take(todo) + 1) & lay.mask, tag.take(todo), held

    def _matches(
        self,
        lay: _Layout,
        at: np.ndarray,
        held: np.ndarray,
        tag: np.ndarray,
        words: np.ndarray,
        codes: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The entries of windows (``at``, modulo the table's size, holding ``held``) that hold the given rows (which
        window, the record there). Rows are compared only where the tags agree; a key is
        filed once, so a window has at most one. An entry past an empty one is trusted too:
        it can only have been filled since the probe began, and then the key is in."""
        # Few numpy calls, each over as few elements as can be: a call costs microseconds
        # of its own, more than its work at these sizes.
        both = np.flatnonzero(lay.tags.take(at, mode="wrap") == tag[:, None])
        rec = held.ravel().take(both)
        live = rec >= 0  # a tombstone keeps the tag it had
        if not live.all():
            both, rec = both[live], rec[live]
        i = both // WINDOW
        same = (self.lens.take(rec) == codes.take(i)) & _rows_equal(
            lay.words.take(rec, axis=0), words.take(i, axis=0)
        )
        return i[same], rec[same]

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

    # -- writes (the runtime's thread only) ----------------------------------------------------

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
            self._rebuild(_width_for(widest))
        lay = self._lay
        words, codes = self._identities(keys, lay.width, longest)
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
        used = self._place_absent(lay, recs, hashes, start)
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
            self._rebuild(_width_for(length))
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
        hashes = _hash_rows(words, codes)
        if absent:
            holders, used = (
                np.full(len(recs), -1, dtype=np.intp),
                self._place_absent(lay, recs, hashes),
            )
        elif self._used:
            holders, used = self._place(lay, recs, hashes, k)
        else:
            holders = self._place_sorted(lay, recs, hashes)
            used = int((holders < 0).sum())
        self._count += int((holders < 0).sum())
        self._used += used
        return holders

    def _place(
        self, lay: _Layout, recs: np.ndarray, hashes: np.ndarray, span: int | None = None
    ) -> tuple[np.ndarray, int]:
        """Put each record into the first free entry (a tombstone or empty) of its probe
        sequence, all at once, a window of entries a round, once the sequence up to its first
        empty entry holds no record of its key; a record whose key is met on the way is not
        placed. Returns (the record met, else -1; how many empty entries were used): reusing
        tombstones keeps a table under steady churn from filling up with them, so it is
        rarely rebuilt. ``span``: how many words of a row its key spans at most (None: all)."""
        n = len(recs)
        holders = np.full(n, -1, dtype=np.intp)
        todo = np.arange(n)
        home = (hashes & np.uint64(lay.mask)).astype(np.intp)
        pos, tag = home.copy(), (hashes >> _U64_32).astype(np.uint32)
        free = np.full(n, -1, dtype=np.intp)  # the first tombstone met in earlier windows
        slots, used = lay.slots, 0
        while len(todo):
            at = (pos[:, None] + _STEPS) & lay.mask
            held = slots.take(at)
            mine = recs[todo]
            mine_words = lay.words.take(mine, axis=0)[:, :span]
            i, holder = self._matches(lay, at, held, tag, mine_words, self.lens.take(mine))
            holders[todo[i]] = holder
            done = np.zeros(len(todo), dtype=bool)
            done[i] = True
            open_ = held < 0  # EMPTY or TOMB
            first = np.where(
                _any_in_rows(open_),
                np.take_along_axis(at, open_.argmax(axis=1)[:, None], 1)[:, 0],
                -1,
            )
            free = np.where(free < 0, first, free)
            # Only a window with an empty entry ends the search for the key.
            ends = _any_in_rows(held == EMPTY) & ~done
            k = np.flatnonzero(ends)
            target = free[k]
            # A tombstone found in an earlier window may have been taken since.
            held_now = slots[target]
            taken = k[held_now >= 0]
            k, target, was_empty = k[held_now < 0], target[held_now < 0], held_now[held_now < 0]
            # Several may want one entry: each writes, one write stays, it won.
            slots[target] = mine[k]
            won = slots[target] == mine[k]
            lay.tags[target[won]] = tag[k[won]]
            self._entry[mine[k[won]]] = target[won]
            used += int((was_empty[won] == EMPTY).sum())
            done[k[won]] = True
            # A loser starts over from its home: the winner may hold its key, behind it.
            lost = np.concatenate([k[~won], taken])
            pos[lost], free[lost] = home[todo[lost]], -1
            step = ~ends & ~done
            pos = np.where(step, (pos + WINDOW) & lay.mask, pos)
            keep = ~done
            todo, pos, tag, free = todo[keep], pos[keep], tag[keep], free[keep]
        return holders, used

    def _place_absent(
        self, lay: _Layout, recs: np.ndarray, hashes: np.ndarray, start: np.ndarray | None = None
    ) -> int:
        """:meth:`_place` for distinct keys known absent: each into the first free entry
        (a tombstone or empty) of its probe sequence, as it is met; no key is compared, and
        the search ends there, not at the first empty entry. ``start``: where each key's
        search begins (None: its home; a later entry only if none before it is empty).
        Returns how many empty entries were used."""
        slots, mask = lay.slots, lay.mask
        pos = (hashes & np.uint64(mask)).astype(np.intp) if start is None else start
        tag = (hashes >> _U64_32).astype(np.uint32)
        todo, used = recs, 0
        while len(todo):
            held = slots.take(pos[:, None] + _STEPS, mode="wrap")
            open_ = held < 0  # EMPTY or TOMB
            k = np.flatnonzero(_any_in_rows(open_))
            first = open_.argmax(axis=1).take(k)
            target = (pos.take(k) + first) & mask
            was = held[k, first]
            # Several may want one entry: each writes, one write stays, it won.
            mine = todo.take(k)
            slots[target] = mine
            won = slots[target] == mine
            lay.tags[target[won]] = tag.take(k)[won]
            self._entry[mine[won]] = target[won]
            used += int(np.count_nonzero(was[won] == EMPTY))
            # A loser reads its window again (the entry it lost is taken now); a key whose
            # window had no free entry reads the next one.
            going = np.ones(len(todo), dtype=bool)
            going[k[won]] = False
            stepping = np.ones(len(todo), dtype=bool)
            stepping[k] = False
            pos = np.where(stepping, (pos + WINDOW) & mask, pos)
            todo, pos, tag = todo[going], pos[going], tag[going]
        return used

    def _place_sorted(self, lay: _Layout, recs: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """:meth:`_place` into an empty table, in one pass: sorted by home entry, each goes
        to the later of its home and the entry after the previous one (what linear probing
        gives). The sort key is (home, tag), so equal keys end up side by side."""
        order_key = ((hashes & np.uint64(lay.mask)) << _U64_32) | (hashes >> _U64_32)
        order = np.argsort(order_key)
        ordered = order_key[order]
        twins = np.flatnonzero(ordered[1:] == ordered[:-1]) + 1
        if len(twins):
            r, prev = recs[order[twins]], recs[order[twins - 1]]
            same = (self.lens[r] == self.lens[prev]) & (lay.words[r] == lay.words[prev]).all(1)
            if same.any():  # a caller's duplicate (rare): one probe sequence at a time
                return self._place(lay, recs, hashes)[0]
        homes = (ordered >> _U64_32).astype(np.intp)
        steps = np.arange(len(order))
        at = np.maximum.accumulate(homes - steps) + steps
        inside = at <= lay.mask
        if inside.all():
            lay.slots[at] = recs[order]
            lay.tags[at] = ordered.astype(np.uint32)
            self._entry[recs[order]] = at
            return np.full(len(recs), -1, dtype=np.intp)
        lay.slots[at[inside]] = recs[order[inside]]
        lay.tags[at[inside]] = ordered[inside].astype(np.uint32)
        self._entry[recs[order[inside]]] = at[inside]
        holders = np.full(len(recs), -1, dtype=np.intp)
        wrapped = order[~inside]  # past the end of the table: round to its start
        holders[wrapped] = self._place(lay, recs[wrapped], hashes[wrapped])[0]
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
        lay = _Layout(self.capacity, width, self._size)
        keep = min(width, old.width)
        lay.rows[:, :keep] = old.rows[:, :keep]
        self._place_sorted(lay, recs, _hash_rows(lay.words[recs], self.lens[recs]))
        self._lay = lay
        self._used = self._count
