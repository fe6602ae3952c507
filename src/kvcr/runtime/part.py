"""What every part of the runtime reads, under one set of names.

The runtime, its peer and source planes, the remote reader and the G2 residency all read the
one frozen :class:`~kvcr.runtime.build.Context` and the one
:class:`~kvcr.runtime.build.Shared`; these properties are the short names their code
uses, looked up there rather than copied into each part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcr.config import KVCRConfig
    from kvcr.runtime.build import Context, Shared
    from kvcr.runtime.memory import MemoryMap
    from kvcr.runtime.ops import Outbox
    from kvcr.telemetry import Telemetry


class Part:
    context: Context
    shared: Shared

    def __init__(self, context: Context, shared: Shared) -> None:
        self.context = context
        self.shared = shared

    @property
    def config(self) -> KVCRConfig:
        return self.context.config

    @property
    def memory(self) -> MemoryMap:
        return self.context.memory

    @property
    def log(self) -> Any:
        return self.context.log

    @property
    def telemetry(self) -> Telemetry:
        return self.shared.telemetry

    @property
    def outbox(self) -> Outbox:
        return self.shared.outbox
