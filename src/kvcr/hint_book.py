"""Per-request memory of router hints: ``HintBook`` (pure code, bounded)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from kvcr.hints import DEFAULT_MAX_REQUESTS, RouterHint, describe_value


class HintBook:
    """The hints of live requests, at most ``max_requests`` of them (oldest evicted first).

    - ``submit`` stores a hint for a request id (any hashable, including ``None``), with the
      time it came (any clock the caller reads; ``submitted_at`` gives it back). A second
      submission for the same id replaces the hint, clears its failed mark and makes it the
      newest, so ``None`` (a hint for "no particular request") is replaced by each new ``None``
      submission like any other id.
    - When full, submitting a new id evicts the oldest submitted ids and returns them, so an
      adapter that never calls ``discard`` cannot grow memory without bound.
    - ``mark_failed`` keeps the hint (``get`` still returns it for diagnostics) but from then on
      ``covers`` answers False and ``failed`` True, until the id is discarded or resubmitted.
      Marking an unknown id does nothing and returns False (a late failure after ``discard``
      must not resurrect an entry).
    """

    __slots__ = ("_entries", "_max_requests")

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if type(max_requests) is not int or max_requests < 1:
            raise ValueError(
                f"HintBook: max_requests must be a positive int, got {describe_value(max_requests)}"
            )
        self._max_requests = max_requests
        # request id -> (hint, failed, when submitted)
        self._entries: OrderedDict[Hashable, tuple[RouterHint, bool, float]] = OrderedDict()

    @property
    def max_requests(self) -> int:
        return self._max_requests

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._entries

    def submit(
        self, request_id: Hashable, hint: RouterHint, at: float = 0.0
    ) -> tuple[Hashable, ...]:
        """Remember ``hint`` for ``request_id``, submitted ``at``; returns the request ids
        evicted to make room."""
        if not isinstance(hint, RouterHint):
            raise TypeError(f"HintBook.submit: expected a RouterHint, got {describe_value(hint)}")
        entries = self._entries
        entries.pop(request_id, None)
        evicted = []
        while len(entries) >= self._max_requests:
            evicted.append(entries.popitem(last=False)[0])
        entries[request_id] = (hint, False, at)
        return tuple(evicted)

    def discard(self, request_id: Hashable) -> bool:
        """Forget the request's hint; False if there was none."""
        return self._entries.pop(request_id, None) is not None

    def get(self, request_id: Hashable) -> RouterHint | None:
        """The request's hint (also when failed), or None."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry[0]

    def mark_failed(self, request_id: Hashable) -> bool:
        """A remote operation for the request failed: stop offering its hint. False if the
        request has no hint."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        self._entries[request_id] = (entry[0], True, entry[2])
        return True

    def submitted_at(self, request_id: Hashable) -> float | None:
        """When the request's hint was submitted (the ``at`` it came with), or None."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry[2]

    def failed(self, request_id: Hashable) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry[1]

    def covers(self, request_id: Hashable, block_hash: int | bytes) -> bool:
        """Whether the request has a live (not failed) hint covering ``block_hash``. Without
        one the answer is False and ``block_hash`` is not examined."""
        entry = self._entries.get(request_id)
        if entry is None or entry[1]:
            return False
        return entry[0].covers(block_hash)
