"""Peer message authentication with a shared cluster key. Pure code.

Without a key, peer control messages travel as plain msgpack (see ``messages``): anyone who
can reach a worker's control port can ask it to write blocks into NIXL memory of their
choosing. With a cluster key (``KVCR_CLUSTER_KEY``, or a file named by
``KVCR_CLUSTER_KEY_FILE``), every message, control channel and NIXL notification alike, is
sealed::

    "KVA1" | sender incarnation (u64 BE) | sequence (u64 BE) | HMAC-SHA256[:16] | body

The MAC covers the header and the body. A receiver with a key drops (and counts) anything
that is not sealed with the same key, and anything it has already accepted: per sender
incarnation it keeps a window of the last ``WINDOW`` sequence numbers (messages of one
sender arrive over two channels, the control channel and NIXL notifications, so they may
be reordered; a window rather than "greater than the last" tolerates that). A message
replayed to a *restarted* receiver still reaches it, but cannot do harm there: a pull names
the incarnation it is meant for, and answers name request ids the new instance never
issued. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

KEY_ENV = "KVCR_CLUSTER_KEY"
KEY_FILE_ENV = "KVCR_CLUSTER_KEY_FILE"
MIN_KEY_BYTES = 16
MAGIC = b"KVA1"
HEADER = struct.Struct(">4sQQ")
TAG_BYTES = 16
SEALED_OVERHEAD = HEADER.size + TAG_BYTES
WINDOW = 1024
MAX_SENDERS = 4096  # incarnations remembered; only key holders can add one


UNAUTHENTICATED = ("unauthenticated", "replayed", "sealed_without_key")  # Rejected.reason


class Rejected(ValueError):
    """A message that fails authentication; ``reason`` is a bounded category."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def cluster_key_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The cluster key from the environment, or None when none is configured."""
    value, path = environ.get(KEY_ENV), environ.get(KEY_FILE_ENV)
    if value and path:
        raise ValueError(f"peer authentication: set {KEY_ENV} or {KEY_FILE_ENV}, not both")
    if path:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(
                f"peer authentication: cannot read {KEY_FILE_ENV}={path!r}: {exc.strerror}"
            ) from None
        source = f"{KEY_FILE_ENV}={path!r}"
    elif value:
        key, source = value.encode(), KEY_ENV
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"peer authentication: the key in {source} has {len(key)} bytes, "
            f"at least {MIN_KEY_BYTES} are needed"
        )
    return key


def unsealed(raw: bytes) -> bytes:
    """The message inside a sealed one, unchecked (for observers such as test fabrics)."""
    return raw[SEALED_OVERHEAD:] if raw[:4] == MAGIC else raw


class PeerAuth:
    """Seals this instance's outgoing messages and opens incoming ones."""

    def __init__(self, key: bytes | None, incarnation: int) -> None:
        self.key = key
        self.incarnation = incarnation
        self._sequence = itertools.count(1)
        self._seen: OrderedDict[int, tuple[int, int]] = OrderedDict()  # inc -> (top, mask)

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def seal(self, body: bytes) -> bytes:
        if self.key is None:
            return body
        header = HEADER.pack(MAGIC, self.incarnation, next(self._sequence))
        tag = hmac.digest(self.key, header + body, hashlib.sha256)[:TAG_BYTES]
        return header + tag + body

    def open(self, raw: bytes) -> tuple[int | None, bytes]:
        """(the sealed sender incarnation or None, the body); raises Rejected."""
        sealed = isinstance(raw, bytes) and raw[:4] == MAGIC
        if self.key is None:
            if sealed:
                raise Rejected(
                    "sealed_without_key",
                    f"peer message is sealed with a cluster key; set {KEY_ENV} here too",
                )
            return None, raw
        if not sealed or len(raw) < SEALED_OVERHEAD:
            raise Rejected("unauthenticated", "peer message is not sealed with the cluster key")
        header, tag = raw[: HEADER.size], raw[HEADER.size : SEALED_OVERHEAD]
        body = raw[SEALED_OVERHEAD:]
        expected = hmac.digest(self.key, header + body, hashlib.sha256)[:TAG_BYTES]
        if not hmac.compare_digest(tag, expected):
            raise Rejected("unauthenticated", "peer message: MAC does not match the cluster key")
        _, incarnation, sequence = HEADER.unpack(header)
        self._accept(incarnation, sequence)
        return incarnation, body

    def _accept(self, incarnation: int, sequence: int) -> None:
        """Anti-replay: each (incarnation, sequence) once, within a sliding window."""
        top, mask = self._seen.get(incarnation, (0, 0))
        if sequence > top:
            mask = ((mask << (sequence - top)) | 1) & ((1 << WINDOW) - 1)
            top = sequence
        else:
            age = top - sequence
            if age >= WINDOW or mask >> age & 1:
                raise Rejected(
                    "replayed", f"peer message: sequence {sequence} was seen or is too old"
                )
            mask |= 1 << age
        self._seen[incarnation] = (top, mask)
        self._seen.move_to_end(incarnation)
        if len(self._seen) > MAX_SENDERS:
            self._seen.popitem(last=False)
