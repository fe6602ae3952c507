"""A ``move`` hint's confirmation, all three legs: the source drops the copies it moved only
once the engine at the destination has taken every result of the operation that pulled them.

1. The engine thread (``api.py``) follows each operation under a move hint until
   ``poll_completed`` has handed the engine all of its results (:class:`Untaken`), then sends
   the runtime a ``Confirm`` command.
2. The destination's runtime remembers which pull wrote which of the operation's keys
   (:class:`Unconfirmed`), and on that command sends the source one ``Confirm`` message.
3. The source remembers, per pull it wrote, the keys that came from its own G2
   (:class:`Copies`; engine memory is the engine's to keep), and drops them on the message.

Each leg is bounded: what falls out of a bound is never confirmed, and the source keeps its
copies (the safe side: a copy too many, never a block lost).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvcr.transport.messages import xfer_id
from kvcr.types import BlockKey, OpResult

if TYPE_CHECKING:
    from kvcr.runtime.lifecycle import SourceJob

MAX_UNCONFIRMED = 4096  # move pulls awaiting the engine's poll; older ones are never confirmed
MAX_MOVES = 4096  # move pulls written and awaiting Confirm; older ones keep their copies


class Untaken:
    """Engine thread: operations under a move hint -> keys whose result it has not taken."""

    def __init__(self) -> None:
        self._keys: dict[int, set[BlockKey]] = {}

    def __bool__(self) -> bool:
        return bool(self._keys)

    def follow(self, handle: int, keys: Iterable[BlockKey]) -> None:
        self._keys[handle] = set(keys)

    def taken(self, results: Iterable[OpResult]) -> list[int]:
        """The operations among ``results`` whose every result the engine now has."""
        done = []
        for handle, entries in results:
            waiting = self._keys.get(handle)
            if waiting is None:
                continue
            waiting.difference_update(entries)
            if not waiting:
                del self._keys[handle]
                done.append(handle)
        return done


class Unconfirmed:
    """Destination: operation -> (source endpoint, pull request, indices that succeeded)."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._pulls: OrderedDict[int, tuple[str, int, list[int]]] = OrderedDict()

    def add(self, handle: int, endpoint: str, req: int, indices: list[int]) -> None:
        self._pulls[handle] = (endpoint, req, indices)
        if len(self._pulls) > MAX_UNCONFIRMED:
            # The engine never polled that one: its source keeps its copies (the safe side).
            old, _ = self._pulls.popitem(last=False)
            self._log.info("move_unconfirmed", op=old, reason="results never polled")

    def pop(self, handle: int) -> tuple[str, int, list[int]] | None:
        return self._pulls.pop(handle, None)


class Copies:
    """Source: (destination incarnation, req) -> (its endpoint, the pull's keys written from
    local G2 by index): a move pull's copies, dropped when the destination confirms."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._moves: OrderedDict[tuple[int, int], tuple[str, dict[int, BlockKey]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._moves)

    def written(self, job: SourceJob, indices: list[int]) -> None:
        """A move pull was written: remember which of its keys came from local G2 (engine
        memory is the engine's to keep or drop) until the destination confirms them."""
        from_g2 = {block.key for block in job.claims}
        keys = job.keys
        ours = {i: keys[i] for i in indices if keys[i] in from_g2}
        if ours:
            self.add(job.msg.incarnation, job.msg.req, job.msg.sender, ours)

    def add(self, incarnation: int, req: int, endpoint: str, ours: dict[int, BlockKey]) -> None:
        self._moves[(incarnation, req)] = (endpoint, ours)
        if len(self._moves) > MAX_MOVES:
            (incarnation, req), _ = self._moves.popitem(last=False)
            self._log.info(
                "move_kept",
                xfer=xfer_id(incarnation, req),
                reason="no confirmation among the last moves",
            )

    def confirmed(
        self, incarnation: int, req: int, sender: str, indices: Iterable[int]
    ) -> list[BlockKey] | None:
        """The keys to drop for a ``Confirm``; None if it names no move this source wrote
        for ``sender`` (this process restarted since, or a stranger): keep everything."""
        entry = self._moves.get((incarnation, req))
        if entry is None or entry[0] != sender:
            return None
        del self._moves[(incarnation, req)]
        written = entry[1]
        return [written[i] for i in indices if i in written]
