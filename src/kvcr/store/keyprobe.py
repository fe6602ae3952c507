"""The key table's entries and how a lookup probes them. Pure code.

An open-addressing table of int32 (linear probing, at most a quarter full of live entries)
maps a key's hash to its record; the keys' rows, indexed by record, sit beside it in one
:class:`Layout`. Batches (a query, a deposit, a replayed journal frame) are probed with
numpy: each key's home entry first (:func:`match_homes`: most keys are settled there), then
a window of entries a round for the others (:func:`matches`), all keys at once; a single key
is probed in Python (:func:`probe_one`) with the same hash.

Engine threads read without locks while the runtime writes: a row is written before the
entry that points at it, a rebuilt layout is swapped in whole, and a reader only trusts an
entry whose row equals its key, so a racing read answers as of before or after the change,
never a wrong record.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

EMPTY, TOMB = -1, -2
WINDOW = 8  # entries a batch probe reads per key and round (8 bools: one word, any_in_rows)
STEPS = np.arange(WINDOW)


# Per k: the word that k bools fill, and its value when they are all True.
_ALL_TRUE = {
    k: (dtype, dtype(int.from_bytes(b"\x01" * k, "little")))
    for k, dtype in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64))
}


def rows_equal(rows: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """Which rows of ``rows`` (n x at least k uint64 words) begin with the same row of
    ``mine`` (n x k). For k of 1, 2, 4 or 8 the n x k comparison is read as one word a row,
    as :func:`any_in_rows` does (``all(axis=1)`` costs several times more)."""
    equal = rows[:, : mine.shape[1]] == mine
    as_word = _ALL_TRUE.get(mine.shape[1])
    if as_word is None:
        every: np.ndarray = equal.all(axis=1)
        return every
    dtype, all_true = as_word
    every = equal.view(dtype).ravel() == all_true
    return every


def any_in_rows(mask: np.ndarray) -> np.ndarray:
    """``mask.any(axis=1)`` for a fresh n x WINDOW bool array, read as one word a row
    (numpy's reduction along a short axis costs several times more)."""
    any_: np.ndarray = mask.view(np.uint64).ravel() != 0
    return any_


class Layout:
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
        layout: Layout | None = None,
        words: np.ndarray | None = None,
        codes: np.ndarray | None = None,
        hashes: np.ndarray | None = None,
        free: np.ndarray | None = None,
    ) -> None:
        self.keys, self.found, self.filings, self.layout = keys, found, filings, layout
        self.words, self.codes, self.hashes, self.free = words, codes, hashes, free


def probe_one(lay: Layout, lens: bytearray, row: bytes, code: int, p: int, tag: int) -> int:
    """The record filed at or after entry ``p`` for ``row`` and ``code``, or -1."""
    slots, tags, rows = lay.slot_ints, lay.tag_ints, lay.row_bytes
    w, mask = lay.width, lay.mask
    while True:
        rec = slots[p]
        if rec == EMPTY:
            return -1
        if rec >= 0 and tags[p] == tag and lens[rec] == code and rows[rec * w : rec * w + w] == row:
            return rec
        p = (p + 1) & mask


def match_homes(
    lay: Layout,
    lens: np.ndarray,
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
    same = (lens.take(rec) == codes.take(both)) & rows_equal(
        lay.words.take(rec, axis=0), words.take(both, axis=0)
    )
    hit = both[same]
    found[hit] = rec[same]
    going = held != EMPTY
    going[hit] = False
    todo = np.flatnonzero(going)
    return todo, (home.take(todo) + 1) & lay.mask, tag.take(todo), held


def matches(
    lay: Layout,
    lens: np.ndarray,
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
    same = (lens.take(rec) == codes.take(i)) & rows_equal(
        lay.words.take(rec, axis=0), words.take(i, axis=0)
    )
    return i[same], rec[same]
