"""The source's memory of pull requests it has acted on (``SeenPulls``). Pure code."""

from __future__ import annotations

from kvcr.runtime import seen_pulls
from kvcr.runtime.seen_pulls import SeenPulls


def test_a_request_is_new_once() -> None:
    seen = SeenPulls()
    assert seen.add(7, 1) is True
    assert seen.add(7, 1) is False
    assert seen.add(8, 1) is True  # another destination incarnation


def test_forgotten_requests_count_as_seen(monkeypatch) -> None:
    monkeypatch.setattr(seen_pulls, "SEEN_PULLS", 3)
    seen = SeenPulls()
    assert all(seen.add(7, req) for req in (2, 3, 4, 5))  # 2 is forgotten into the floor
    assert seen.add(7, 2) is False
    assert seen.add(7, 1) is False  # never seen, but as old as a forgotten one: refused
    assert seen.add(7, 6) is True


def test_a_replaced_incarnation_is_forgotten() -> None:
    seen = SeenPulls()
    seen.add(7, 1)
    seen.forget(7)
    assert seen.add(7, 1) is True


def test_the_least_recently_pulling_incarnation_goes_first(monkeypatch) -> None:
    monkeypatch.setattr(seen_pulls, "SEEN_INCARNATIONS", 2)
    seen = SeenPulls()
    seen.add(1, 1)
    seen.add(2, 1)
    seen.add(1, 2)  # incarnation 1 pulled again: 2 is now the oldest
    seen.add(3, 1)
    assert seen.add(1, 1) is False
    assert seen.add(2, 1) is True  # forgotten
