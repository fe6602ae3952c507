"""Value types of kvcr's public API (contract section 2).

Every class here is an immutable value that compares by value. Engine adapters import these
names; their fields, order and defaults are part of the contract.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, NewType

import attrs

BlockKey = NewType("BlockKey", bytes)
PinHandle = str
PinRequestId = NewType("PinRequestId", int)
OpHandle = int
ReleaseHandle = NewType("ReleaseHandle", int)
ReleaseResult = tuple[ReleaseHandle, bool]
PoolBlockLayouts = list[tuple[str, int]]
LocalDramRegions = list[tuple[str, int, int]]


class OpEntryStatus(enum.Enum):
    SUCCESS = "SUCCESS"
    DROPPED = "DROPPED"
    FAILED = "FAILED"


class QueryStatus(enum.Enum):
    HIT = "HIT"
    FETCHING = "FETCHING"
    FETCHABLE = "FETCHABLE"
    MISS = "MISS"


class CacheTier(enum.Enum):
    FW_G1 = "HBM"
    FW_G2 = "FW_DRAM"
    LOCAL_G2 = "DRAM"
    REMOTE_G2 = "REMOTE_G2"
    G3 = "G3"


class PlacementAction(enum.Enum):
    KEEP = "KEEP"
    DROP = "DROP"
    COPY_TO = "COPY_TO"
    MOVE_TO = "MOVE_TO"


PlacementDecision = tuple[PlacementAction, CacheTier | None]


@attrs.frozen(kw_only=True)
class RegionDescriptor:
    """A registered memory region: element ``i`` lives at ``addr + i * (stride or size)``."""

    mem_type: str = "DRAM"
    device_Id: int = 0
    addr: int
    stride: int = 0
    count: int = 1
    size: int
    label: str = ""

    def element_addr(self, index: int) -> int:
        return self.addr + index * (self.stride or self.size)

    @property
    def span(self) -> int:
        """Bytes from ``addr`` to the end of the last element."""
        return (self.count - 1) * (self.stride or self.size) + self.size


@attrs.frozen(kw_only=True)
class MemoryRef:
    """One element of a registered region, owned by the NIXL agent ``end_point_name``."""

    end_point_name: str
    label: str = ""
    element_index: int


PinResult = tuple[PinHandle, Mapping[BlockKey, list[MemoryRef] | None]] | None


@attrs.frozen
class OpEntryResult:
    status: OpEntryStatus
    descriptors: list[MemoryRef] | None = None
    release_handle: ReleaseHandle | None = None

    @property
    def success(self) -> bool:
        return self.status is OpEntryStatus.SUCCESS


OpResult = tuple[OpHandle, Mapping[BlockKey, OpEntryResult]]


@attrs.frozen
class InventoryEvent:
    keys: tuple[BlockKey, ...]
    tier: CacheTier
    removed: bool


@attrs.frozen
class BlockMeta:
    """What a policy sees of a block."""

    block_key: BlockKey
    size_bytes: int
    access_count: int
    last_access: float | None
    resident_tiers: frozenset[CacheTier]
    position: int = -1


@attrs.frozen
class PlacementFailure:
    attempted: PlacementDecision
    source: CacheTier
    reason: str
    failure_count: int


class KVCRStartupError(RuntimeError):
    """Startup failed and native work could not be stopped: keep buffers alive until exit."""


class TransferError(RuntimeError):
    """A failed operation whose memory some transfer may still touch (``uncertain``), or the
    later notice that nothing can touch it any more (``quiesced``)."""

    def __init__(
        self,
        message: str,
        op_handle: OpHandle,
        *,
        state: str = "uncertain",
        source_blocks: tuple[BlockKey, ...] | None = None,
        source_owners: tuple[str, ...] | None = None,
        destination_regions: tuple[MemoryRef, ...] | None = None,
        destination_owner: str | None = None,
    ) -> None:
        if state not in ("uncertain", "quiesced"):
            raise ValueError(
                f"TransferError: state must be 'uncertain' or 'quiesced', not {state!r}"
            )
        super().__init__(message)
        self.message = message
        self.op_handle = op_handle
        self.state = state
        self.source_blocks = source_blocks
        self.source_owners = source_owners
        self.destination_regions = destination_regions
        self.destination_owner = destination_owner

    def __reduce__(  # keep keyword-only fields across pickling
        self,
    ) -> tuple[Callable[..., TransferError], tuple[str, OpHandle, dict[str, Any]]]:
        return (_rebuild_transfer_error, (self.message, self.op_handle, self.__dict__.copy()))


def _rebuild_transfer_error(message: str, op_handle: OpHandle, fields: dict) -> TransferError:
    kwargs = {
        k: fields[k]
        for k in (
            "state",
            "source_blocks",
            "source_owners",
            "destination_regions",
            "destination_owner",
        )
    }
    return TransferError(message, op_handle, **kwargs)


class RecoveryMirrorError(RuntimeError):
    """Recovery state cannot be described validly."""
