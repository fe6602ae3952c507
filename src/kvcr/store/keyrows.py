"""What a block key is filed under in the key table: its row, length code and hash. Pure code.

A key lives as a row (zero-padded to the table's width, at most :data:`MAX_WIDTH` bytes)
with its length as its code. A key longer than ``MAX_WIDTH`` is filed under its BLAKE2b
digest (length code :data:`DIGEST`): engines' keys are content hashes of 8-32 bytes, so that
path is for odd callers only. The hash reads a row as little-endian words, the key's own
words only: a batch is hashed with numpy (:func:`hash_rows`), a single key in Python
(:func:`hash_one`), to the same value.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

DIGEST = 255  # the length code of a key filed under its digest
ABSENT = 254  # the length code of a probe that cannot match (never stored)
MAX_WIDTH = 64
DIGEST_BYTES = 32
_SEED = 0x9E3779B97F4A7C15
_MUL = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1
_FIN = 0x94D049BB133111EB
_U64_SEED, _U64_MUL, _U64_FIN = np.uint64(_SEED), np.uint64(_MUL), np.uint64(_FIN)
_U64_27, _U64_30, _U64_31, U64_32 = (np.uint64(n) for n in (27, 30, 31, 32))
_UNPACK = [struct.Struct(f"<{n}Q").unpack_from for n in range(MAX_WIDTH // 8 + 1)]


def width_for(length: int) -> int:
    return max(DIGEST_BYTES, (length + 7) & ~7)


def words_of(code: int) -> int:
    """How many 8-byte words of a row the hash reads: the key's own, not the padding."""
    return DIGEST_BYTES // 8 if code == DIGEST else (code + 7) // 8


def hash_rows(words: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The hash of each row (``words``: n x at least each key's own words, little-endian
    uint64) and length code, over the key's own words only (an 8-byte key: one round)."""
    x: np.ndarray = (codes.astype(np.uint64) + np.uint64(1)) * _U64_SEED
    if not len(codes):
        return x
    first = int(codes[0])
    uniform = bool((codes == first).all())
    counts = None if uniform else np.where(codes == DIGEST, DIGEST_BYTES // 8, (codes + 7) // 8)
    rounds = words_of(first) if counts is None else int(counts.max())
    for j in range(min(rounds, words.shape[1])):
        mixed = (x ^ words[:, j]) * _U64_MUL
        mixed ^= mixed >> U64_32
        x = mixed if counts is None else np.where(j < counts, mixed, x)
    # splitmix64's finaliser: every input bit reaches the low bits (the home entry) and the
    # high ones (the tag), which one multiply does not do for a key's high bytes.
    x ^= x >> _U64_30
    x *= _U64_MUL
    x ^= x >> _U64_27
    x *= _U64_FIN
    x ^= x >> _U64_31
    return x


def identity(key: bytes, width: int) -> tuple[bytes, int]:
    """The padded row and length code of ``key`` at ``width`` (code ABSENT: a key of
    this length cannot be in a table this narrow)."""
    length = len(key)
    if length <= width:
        return key + bytes(width - length), length
    if length > MAX_WIDTH:
        digest = hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()
        return digest + bytes(width - DIGEST_BYTES), DIGEST
    return bytes(width), ABSENT


def identities(
    keys: Sequence[bytes], width: int, longest: int | None = None
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
    idents = [identity(k, width) for k in keys]
    words = np.frombuffer(b"".join(row for row, _ in idents), dtype="<u8")
    return words.reshape(n, width // 8), np.array([c for _, c in idents], dtype=np.intp)


def hash_one(row: bytes | bytearray, code: int) -> int:
    x = ((code + 1) * _SEED) & _MASK64
    for word in _UNPACK[words_of(code)](row):
        x = ((x ^ word) * _MUL) & _MASK64
        x ^= x >> 32
    x = ((x ^ (x >> 30)) * _MUL) & _MASK64
    x = ((x ^ (x >> 27)) * _FIN) & _MASK64
    return x ^ (x >> 31)
