"""The commands engine threads send the runtime (through ``Shared.commands``).

The facade validates everything before it builds a command, so the runtime trusts their
shape. The engine's calls are slotted attrs classes, not frozen ones: a frozen class sets
each field through ``object.__setattr__`` (~0.45 us for a deposit's five, a quarter of the
call), and nothing reassigns a command's fields once it is queued (the runtime only reads
them). ``Hinted`` is a value the runtime keeps, and stays frozen.
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
    hint_age: float = 0.0  # seconds from the hint's submission to the call that uses it


@attrs.define
class Deposit:
    handle: int
    keys: list[BlockKey]
    sources: Mapping[BlockKey, tuple[int, ...]]  # key -> descriptor per pool
    no_evict: bool
    hints: Mapping[str, Any] | None


@attrs.define
class Deliver:
    handle: int
    keys: list[BlockKey]
    destinations: Mapping[BlockKey, tuple[int, ...]]  # key -> descriptor per pool
    remote: Hinted | None


@attrs.define
class Fetch:
    handle: int
    keys: list[BlockKey]
    remote: Hinted | None


@attrs.define
class Release:
    handles: Sequence[int]


@attrs.define
class Abort:
    handle: int
    keys: list[BlockKey] | None  # None: every key still pending


@attrs.define
class Connect:
    endpoint: str


@attrs.define
class Align:
    keys: list[BlockKey]
    use_current_time: bool


@attrs.define
class Confirm:
    """The engine has taken every result of an operation whose hint said ``move``: its
    peer may now drop the copies it wrote."""

    handle: int


@attrs.define
class Close:
    pass


OpCommand = Deposit | Deliver | Fetch
Command = Deposit | Deliver | Fetch | Release | Abort | Connect | Align | Confirm | Close
