"""``KVCRBindings``: the engine's side of the contract (section 4), checked at construction."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from kvcr.engine_protocols import FrameworkControl, KeyAdapter, TelemetryStats
from kvcr.policy import HOOKS as POLICY_HOOKS
from kvcr.policy import KVCachePolicy
from kvcr.types import BlockKey, PinRequestId, PinResult

# Bindings that are only told something: without one, nothing is queued for it.
NOTIFIED = ("inventory_sink", "capacity_needed_callback", "on_resilience_event")


def _callable(name: str, value: object, required: bool) -> None:
    if value is None and not required:
        return
    if not callable(value):
        raise ValueError(f"KVCRBindings: {name} must be callable, got {type(value).__name__}")


def _has_methods(name: str, value: object, methods: Sequence[str]) -> None:
    if value is None:
        return
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise ValueError(f"KVCRBindings: {name} lacks method(s) {missing}")


@attrs.frozen
class KVCRBindings:
    """The engine's side of the contract (section 4).

    kvcr calls ``request_pin``, ``poll_pin_results``, ``release_pin``, ``cancel_pin_request``,
    ``inventory_sink``, ``capacity_needed_callback``, ``stats_factory`` (and the stats
    object it returns) and ``on_resilience_event`` only on the engine's thread, from inside
    a call the engine makes (``poll_completed``, ``get_stats``, ``close``, construction),
    one at a time: adapters may keep their bookkeeping in plain, unlocked structures.
    ``key_adapter`` may be called from any thread; ``framework_control.send``/``recv`` and
    the ``policy`` hooks run on kvcr's runtime thread, one call at a time.
    """

    request_pin: Callable[[list[BlockKey]], PinRequestId]
    poll_pin_results: Callable[[], Iterable[tuple[PinRequestId, PinResult]]]
    release_pin: Callable[[str], bool]
    cancel_pin_request: Callable[[PinRequestId], None] | None = None
    framework_control: FrameworkControl | None = None
    key_adapter: KeyAdapter | None = None
    inventory_sink: Callable[..., None] | None = None
    capacity_needed_callback: Callable[[list[tuple[str, int]]], None] | None = None
    stats_factory: Callable[[], TelemetryStats] | None = None
    policy: KVCachePolicy | None = None
    on_resilience_event: Callable[[Exception], None] | None = None

    def __attrs_post_init__(self) -> None:
        _callable("request_pin", self.request_pin, True)
        _callable("poll_pin_results", self.poll_pin_results, True)
        _callable("release_pin", self.release_pin, True)
        for name in (
            "cancel_pin_request",
            "inventory_sink",
            "capacity_needed_callback",
            "stats_factory",
            "on_resilience_event",
        ):
            _callable(name, getattr(self, name), False)
        _has_methods("framework_control", self.framework_control, ("send", "recv"))
        _has_methods("key_adapter", self.key_adapter, ("encode", "decode"))
        _has_methods("policy", self.policy, POLICY_HOOKS)
