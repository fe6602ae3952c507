"""The commands engine threads send the runtime (through ``Shared.commands``).

The facade validates everything before it builds a command, so the runtime trusts their
shape; they are frozen so that nothing the engine thread still holds can change under the
runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvcr.types import BlockKey


@attrs.frozen
class Hinted:
    """Keys a request's router hint sends to a peer: its endpoint, the request (whose hint
    is marked failed if the pull gets nothing), the keys it covers, and the hint's mode
    (``move``: its mode is "move") and no_retain (contract section 6)."""

    endpoint: str
    request: object
    keys: frozenset[BlockKey]
    move: bool = False
    no_retain: bool = False


@attrs.frozen
class Deposit:
    handle: int
    keys: list[BlockKey]
    sources: Mapping[BlockKey, tuple[int, ...]]  # key -> descriptor per pool
    no_evict: bool
    hints: Mapping[str, Any] | None


@attrs.frozen
class Deliver:
    handle: int
    keys: list[BlockKey]
    destinations: Mapping[BlockKey, tuple[int, ...]]  # key -> descriptor per pool
    remote: Hinted | None


@attrs.frozen
class Fetch:
    handle: int
    keys: list[BlockKey]
    remote: Hinted | None


@attrs.frozen
class Release:
    handles: Sequence[int]


@attrs.frozen
class Abort:
    handle: int
    keys: list[BlockKey] | None  # None: every key still pending


@attrs.frozen
class Connect:
    endpoint: str


@attrs.frozen
class Align:
    keys: list[BlockKey]
    use_current_time: bool


@attrs.frozen
class Confirm:
    """The engine has taken every result of an operation whose hint said ``move``: its
    peer may now drop the copies it wrote."""

    handle: int


@attrs.frozen
class Close:
    pass


OpCommand = Deposit | Deliver | Fetch
Command = Deposit | Deliver | Fetch | Release | Abort | Connect | Align | Confirm | Close
