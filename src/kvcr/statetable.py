"""The one mechanism behind every lifecycle in kvcr: a table of legal moves over enum states.

A record whose life has rules (a peer pull, a source job, an operation, a guard's pool
group) keeps its state as a member of an enum and changes it only through
:meth:`Table.move`. The table is the whole of its rules: a move it does not list is a bug in
the caller and raises :class:`IllegalMove`, naming the record. Tests walk each table
(``tests/unit/test_transfer_lifecycle.py``, ``test_guard_rules.py``).

States and events are :class:`StrEnum` members, so a state says the same thing in a log
event or on the wire (``ProbeAck.state``, ``GroupStatus.state``) as in the code, and the code
compares members, never strings.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from typing import Generic, TypeVar

import attrs

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 has no enum.StrEnum: the same, as far as kvcr uses it

    class StrEnum(str, enum.Enum):
        """Members are their values: equal to, hashed and formatted as the string."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


class IllegalMove(RuntimeError):
    """A record was asked to make a move its table does not allow."""


@attrs.frozen
class Table(Generic[S, E]):
    name: str
    moves: Mapping[S, Mapping[E, S]]  # state -> {event: next state}; every state is a key

    def move(self, state: S, event: E, what: str) -> S:
        """The state after ``event``; ``what`` names the record in the error."""
        try:
            return self.moves[state][event]
        except KeyError:
            raise IllegalMove(
                f"{self.name} {what}: can't handle event {str(event.value)!r} "
                f"in state {str(state.value)!r}"
            ) from None

    def allows(self, state: S, event: E) -> bool:
        return event in self.moves[state]

    def terminal(self, state: S) -> bool:
        return not self.moves[state]

    @property
    def events(self) -> frozenset[E]:
        return frozenset(e for moves in self.moves.values() for e in moves)

    def reachable(self, start: S) -> frozenset[S]:
        """Every state a record in ``start`` can get to (``start`` included)."""
        seen = {start}
        todo = [start]
        while todo:
            for after in self.moves[todo.pop()].values():
                if after not in seen:
                    seen.add(after)
                    todo.append(after)
        return frozenset(seen)
