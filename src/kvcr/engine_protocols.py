"""The protocols an engine adapter implements (contract sections 3, 7 and 8): what kvcr
calls on the engine's objects. The contract names them in :mod:`kvcr.config`, which
re-exports them; kvcr's own modules import them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvcr.types import BlockKey, InventoryEvent


@runtime_checkable
class TelemetryStats(Protocol):
    """The engine's metrics interval (``stats_factory``). kvcr calls its methods only on the
    engine's thread, inside ``poll_completed`` and ``get_stats`` (contract section 4)."""

    def increase_counter(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = ()
    ) -> None: ...

    def set_gauge(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = ()
    ) -> None: ...

    def observe_histogram(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = ()
    ) -> None: ...

    def reduce(self) -> dict: ...

    def is_empty(self) -> bool: ...


@runtime_checkable
class FrameworkControl(Protocol):
    """The peer control channel. kvcr calls ``send`` and ``recv`` from its own runtime
    thread, one call at a time; both must return at once."""

    def send(self, endpoint: str, message: bytes) -> bool: ...

    def recv(self) -> list[bytes]: ...


class SharedListenerControl(FrameworkControl, Protocol):
    """A :class:`FrameworkControl` that can receive on a listener the guard service bound
    (what ``guard_config`` needs), such as ``ZmqPeerControlChannel``."""

    def control_bind_address(self) -> tuple[str, int]: ...

    def adopt_listener(self, listener_fd: int) -> None: ...


@runtime_checkable
class KeyAdapter(Protocol):
    """Engine block hashes <-> kvcr keys: a pure function, called from any thread."""

    def encode(self, framework_key: object) -> BlockKey: ...

    def decode(self, key: BlockKey) -> int | bytes: ...


# Called on the engine's thread, inside poll_completed (get_stats, close), before the results
# of the operations whose blocks it announces.
InventorySink = Callable[[InventoryEvent], None]
