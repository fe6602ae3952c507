"""Block keys -> records, with no Python object per key: the compiled core's table
(``_core.c``), with the numpy-shaped calls the block index uses.

A block index of a million records cannot afford a dict: each entry costs a key object, an
int object and ~40 bytes of table (~150 B a key), and building it at a warm start makes a
million objects (~0.7 s). In C, a key lives as a row of a rows array (zero-padded to the
table's width, 32 to 64 bytes, with its length beside it), and an open-addressing table of
int32 entries, at most a quarter full of live keys, maps a hash of the row to the record:
~53 B a record at width 32. A key longer than :data:`MAX_WIDTH` is filed under its BLAKE2b
digest, the key itself kept aside by record. The table is rebuilt without tombstones when
they and the live entries fill 70 % of it.

Engine threads read (:meth:`KeyTable.find_many`, ``answers``) while the runtime writes:
every call holds the GIL from start to end and the table is never half written when it
could let the GIL go (see ``_core.c``).

Arrays cross the boundary as native ``intp`` bytes in and bytearrays out (numpy views them
without a copy): the limited API of CPython 3.10, one wheel for every later Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np

from kvcr.store.native import MAX_WIDTH, KeyCore

__all__ = ["MAX_WIDTH", "KeyTable", "Probe"]

_digest = partial(hashlib.blake2b, digest_size=32)


def _long_digest(key: bytes) -> bytes:
    return _digest(key).digest()


def _intp(recs: np.ndarray) -> bytes:
    """Records as the core takes them (native intp bytes)."""
    return np.ascontiguousarray(recs, dtype=np.intp).tobytes()


class Probe:
    """A batch of keys looked up (:meth:`KeyTable.probe`): each one's record (``found``, -1:
    none) and the table's :attr:`~KeyTable.filings` when it looked, so that
    :meth:`KeyTable.add_probed` can file the absent ones without comparing keys again."""

    __slots__ = ("filings", "found", "keys")

    def __init__(self, keys: Sequence[bytes], found: np.ndarray, filings: int) -> None:
        self.keys, self.found, self.filings = keys, found, filings


class KeyTable(KeyCore):
    """Block keys -> records in ``range(capacity)``; a record holds at most one key.

    The core's own calls: ``find(key)`` -> rec or -1; ``answers(keys, flags, table)`` (what
    ``query`` says of each key, one call); ``lookup``, ``file``, ``file_rows``, ``drop``,
    ``key``, ``keys_of``, ``live``; ``width``, ``capacity``, ``filings`` (bumped by every
    filing), ``used`` and ``size``."""

    def __init__(self, capacity: int, width: int = 32) -> None:
        super().__init__(capacity, width, _long_digest)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.find(key) >= 0

    def get(self, key: bytes, default: int | None = None) -> int | None:
        rec: int = self.find(key)
        return default if rec < 0 else rec

    def find_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """The record of each key, -1 where it has none (intp)."""
        return np.frombuffer(self.lookup(keys), np.intp)

    def probe(self, keys: Sequence[bytes]) -> Probe:
        """:meth:`find_many`, remembering when it looked: for :meth:`add_probed`."""
        filings = self.filings
        return Probe(keys, self.find_many(keys), filings)

    def keys(self, recs: np.ndarray) -> list[bytes]:
        """The keys of records that have one (KeyError if one has none)."""
        keys: list[bytes] = self.keys_of(_intp(recs)) if len(recs) else []
        return keys

    def records(self) -> np.ndarray:
        """Every record with a key, in no particular order."""
        return np.frombuffer(self.live(), np.intp)

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
        entry of its probe sequence, with no key compared on the way."""
        absent = absent_at is not None and absent_at == self.filings
        return np.frombuffer(self.file(keys, _intp(recs), absent), np.intp)

    def add_probed(self, probe: Probe, absent: np.ndarray, recs: np.ndarray) -> np.ndarray:
        """:meth:`add_many` of the keys of ``probe`` it found absent (``absent``: their
        indices in it, distinct keys), each under its record in ``recs``: with no key
        compared if nothing was filed since the probe."""
        keys = [probe.keys[i] for i in absent.tolist()]
        return self.add_many(keys, recs, probe.filings)

    def add_rows(self, rows: np.ndarray, recs: np.ndarray) -> np.ndarray:
        """:meth:`add_many` for keys given as rows of one length (``rows``: n x length
        uint8, e.g. a journal batch's keys in place): no object per key."""
        n, length = rows.shape
        if length > MAX_WIDTH:
            return self.add_many([bytes(r) for r in rows], recs)
        data = np.ascontiguousarray(rows, dtype=np.uint8).tobytes()
        if not length:  # empty keys: one row each, of nothing
            return self.add_many([b""] * n, recs)
        return np.frombuffer(self.file_rows(data, length, _intp(recs)), np.intp)

    def remove(self, rec: int) -> None:
        """Drop the key of ``rec`` (KeyError if it has none)."""
        self.drop(np.array([rec], dtype=np.intp).tobytes())

    def remove_many(self, recs: np.ndarray) -> None:
        """Drop the keys of distinct records that have one (KeyError, and nothing dropped,
        if one has none)."""
        if len(recs):
            self.drop(_intp(recs))

    def replace(self, old: int, new: int) -> None:
        """File the key of ``old`` under ``new`` instead (``new``: without a key)."""
        key = self.key(old)
        self.remove(old)
        self.add(key, new)
