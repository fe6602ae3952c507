"""Configuration values (contract section 3); the protocols an engine adapter implements,
which the contract also names here, are in :mod:`kvcr.engine_protocols`.

Each class validates itself at construction and raises ``ValueError`` naming the setting.
Checks that span several objects (pools against layouts, G3 against local DRAM, guard
against local DRAM) live in :func:`validate_setup`, which ``KVCR`` runs before it touches
any memory.

These are stdlib dataclasses rather than attrs classes on purpose: their signatures must
show factory defaults the way the contract's adapters introspect them.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import TypeGuard

# Re-exported: the contract names these protocols in kvcr.config.
from kvcr.engine_protocols import FrameworkControl, InventorySink, KeyAdapter, TelemetryStats  # noqa: F401
from kvcr.g3 import paths as g3_paths
from kvcr.types import LocalDramRegions, PoolBlockLayouts, RegionDescriptor

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MEM_TYPES = ("DRAM", "VRAM")
MAX_GROUPS = 4096  # pool groups of a guard service: bounds guard_index, and the guard's wire


class _ShortRepr(reprlib.Repr):
    """reprlib with small limits that never calls ``repr`` on a huge int (Python refuses
    ints over 4300 digits, with a ValueError that would hide which setting was wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 80
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_shown = _ShortRepr().repr  # a bounded repr of a value for error messages


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


U64 = 2**64  # addresses, sizes and counts are 64-bit


def _is_u64(value: object) -> bool:
    """A positive int that fits in 64 bits."""
    return _is_int(value) and 0 < value < U64


# Millisecond settings become float seconds: beyond 2**53 they would lose precision, and
# far beyond they would not convert at all (OverflowError at the first deadline).
MAX_MS = 2**53
MAX_FILE_BYTES = 2**63 - 1  # the largest file size (off_t)


def _require_positive_int(owner: str, name: str, value: object, limit: int | None = None) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {_shown(value)}")
    if limit is not None and value > limit:
        raise ValueError(f"{owner}: {name} must be at most {limit}, got {_shown(value)}")


def _normalize_layouts(value: object) -> PoolBlockLayouts:
    where = "KVCRConfig: pool_layouts"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{where} must be a non-empty list of (pool name, block size), got {_shown(value)}"
        )
    layouts: PoolBlockLayouts = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(
                f"{where}[{i}] must be a (pool name, block size) pair, got {_shown(item)}"
            )
        name, size = item
        if not isinstance(name, str) or ":" in name:
            raise ValueError(
                f"{where}[{i}]: pool name must be a string without ':', got {_shown(name)}"
            )
        if name in seen:
            raise ValueError(f"{where}[{i}]: pool name {_shown(name)} appears twice")
        if not _is_u64(size):
            raise ValueError(
                f"{where}[{i}]: block size of pool {_shown(name)} must be a positive int below 2**64, got {_shown(size)}"
            )
        seen.add(name)
        layouts.append((name, size))
    if "" in seen and len(layouts) > 1:
        raise ValueError(f"{where}: the empty pool name is allowed only when it is the only pool")
    return layouts


@dataclasses.dataclass(frozen=True)
class KVCRConfig:
    """``nixl_listen_port`` is accepted and validated for adapters that set it; kvcr itself
    exchanges NIXL metadata over the peer control channel and starts no NIXL listener."""

    nixl_agent_name: str
    pool_layouts: PoolBlockLayouts
    enable_telemetry: bool = False
    operation_timeout_ms: int = 1000
    abandon_timeout_ms: int = 5000
    capacity_low_watermark_percent: int = 0
    nixl_listen_port: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nixl_agent_name, str) or not self.nixl_agent_name:
            raise ValueError(
                f"KVCRConfig: nixl_agent_name must be a non-empty string, got {_shown(self.nixl_agent_name)}"
            )
        object.__setattr__(self, "pool_layouts", _normalize_layouts(self.pool_layouts))
        _require_positive_int(
            "KVCRConfig", "operation_timeout_ms", self.operation_timeout_ms, MAX_MS
        )
        _require_positive_int("KVCRConfig", "abandon_timeout_ms", self.abandon_timeout_ms, MAX_MS)
        if self.abandon_timeout_ms < 2 * self.operation_timeout_ms:
            raise ValueError(
                "KVCRConfig: abandon_timeout_ms must be >= 2 * operation_timeout_ms, got "
                f"{_shown(self.abandon_timeout_ms)} < 2 * {_shown(self.operation_timeout_ms)}"
            )
        watermark = self.capacity_low_watermark_percent
        if not _is_int(watermark) or not 0 <= watermark < 100:
            raise ValueError(
                f"KVCRConfig: capacity_low_watermark_percent must be an int in [0, 100), got {_shown(watermark)}"
            )
        port = self.nixl_listen_port
        if port is not None and (not _is_int(port) or not 0 < port < 65536):
            raise ValueError(
                f"KVCRConfig: nixl_listen_port must be None or a port in [1, 65535], got {_shown(port)}"
            )
        if not isinstance(self.enable_telemetry, bool):
            raise ValueError(
                f"KVCRConfig: enable_telemetry must be a bool, got {_shown(self.enable_telemetry)}"
            )

    @property
    def pool_names(self) -> list[str]:
        return [name for name, _ in self.pool_layouts]


@dataclasses.dataclass(frozen=True)
class LocalDramOptions:
    pools: LocalDramRegions
    backend: str = "UCX"

    def __post_init__(self) -> None:
        where = "LocalDramOptions: pools"
        if not isinstance(self.pools, (list, tuple)) or not self.pools:
            raise ValueError(f"{where} must be a non-empty list of (pool name, address, size)")
        pools = []
        for i, item in enumerate(self.pools):
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise ValueError(
                    f"{where}[{i}] must be (pool name, address, size), got {_shown(item)}"
                )
            name, addr, size = item
            if not isinstance(name, str):
                raise ValueError(f"{where}[{i}]: pool name must be a string, got {_shown(name)}")
            if not _is_u64(addr):
                raise ValueError(
                    f"{where}[{i}]: address of pool {_shown(name)} must be a positive 64-bit int"
                )
            if not _is_u64(size):
                raise ValueError(
                    f"{where}[{i}]: size of pool {_shown(name)} must be a positive 64-bit int"
                )
            pools.append((name, addr, size))
        object.__setattr__(self, "pools", pools)
        _require_backend("LocalDramOptions", self.backend)


@dataclasses.dataclass(frozen=True)
class RemoteFWDramOptions:
    eager_ctrl_connect: bool = True
    opportunistic_query: bool = False
    metadata_retry_interval_ms: int = 100
    backend: str = "UCX"

    def __post_init__(self) -> None:
        for name in ("eager_ctrl_connect", "opportunistic_query"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"RemoteFWDramOptions: {name} must be a bool, got {_shown(value)}")
        _require_positive_int(
            "RemoteFWDramOptions",
            "metadata_retry_interval_ms",
            self.metadata_retry_interval_ms,
            MAX_MS,
        )
        _require_backend("RemoteFWDramOptions", self.backend)


@dataclasses.dataclass(frozen=True, kw_only=True)
class G3Options:
    """``paths`` may contain ``{agent}`` and ``{guard_index}``, expanded per instance
    (:mod:`kvcr.g3.paths`): an engine that gives every data-parallel rank the same options
    still gets one file per rank, as each file has a single owner."""

    paths: tuple[Path, ...]
    capacity_bytes_per_file: int
    backend: str = "POSIX"
    backend_options: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _g3_paths(self.paths))
        _require_positive_int(
            "G3Options", "capacity_bytes_per_file", self.capacity_bytes_per_file, MAX_FILE_BYTES
        )
        _require_backend("G3Options", self.backend)
        if not isinstance(self.backend_options, Mapping):
            raise ValueError(
                "G3Options: backend_options must be a mapping of str to str, got "
                f"{type(self.backend_options).__name__}"
            )
        opts = dict(self.backend_options)
        for k, v in opts.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(
                    f"G3Options: backend_options must map str to str, got {_shown(k)}: {_shown(v)}"
                )
        object.__setattr__(self, "backend_options", opts)


def _g3_paths(value: object) -> tuple[Path, ...]:
    where = "G3Options: paths"
    if isinstance(value, (str, bytes, os.PathLike)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{where} must be a non-empty sequence of file paths, got {_shown(value)}")
    if not value:
        raise ValueError(f"{where} must be a non-empty sequence of file paths")
    paths: list[Path] = []
    identities: dict[object, Path] = {}
    for i, raw in enumerate(value):
        if not isinstance(raw, (str, os.PathLike)) or isinstance(raw, bytes) or not str(raw):
            raise ValueError(f"{where}[{i}] must be a non-empty str or Path, got {_shown(raw)}")
        g3_paths.placeholders(str(raw), f"{where}[{i}]")
        try:
            path = Path(raw)
            resolved, identity = g3_paths.file_identity(path)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"{where}[{i}] ({_shown(raw)}) cannot be resolved: {exc}") from None
        # Templates alias like names: two spellings of one template name one file for every
        # instance. Different templates that meet only once expanded are caught then.
        for other_identity in (identity, resolved):
            if other_identity in identities:
                raise ValueError(
                    f"{where}[{i}]: {path} aliases {identities[other_identity]} (same file)"
                )
        identities[identity] = identities[resolved] = path
        paths.append(path)
    return tuple(paths)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstanceG3Options(G3Options):
    """The G3 options of one instance (:func:`for_instance`): ``paths`` are its own files,
    placeholders expanded; ``templates`` are the paths as configured, for messages."""

    templates: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        templates = tuple(Path(t) for t in (self.templates or self.paths))
        if len(templates) != len(self.paths):
            raise ValueError(
                f"InstanceG3Options: templates must be one per path, got {len(templates)} "
                f"for {len(self.paths)}"
            )
        object.__setattr__(self, "templates", templates)


@dataclasses.dataclass(frozen=True)
class KVCRBackendConfigs:
    framework_regions: list[RegionDescriptor] = dataclasses.field(default_factory=list)
    local_dram: LocalDramOptions | None = None
    g3: G3Options | None = None
    remote_fw_dram: RemoteFWDramOptions = dataclasses.field(default_factory=RemoteFWDramOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.framework_regions, (list, tuple)):
            raise ValueError(
                "KVCRBackendConfigs: framework_regions must be a list of RegionDescriptor, got "
                f"{type(self.framework_regions).__name__}"
            )
        for name, cls, optional in (
            ("local_dram", LocalDramOptions, True),
            ("g3", G3Options, True),
            ("remote_fw_dram", RemoteFWDramOptions, False),
        ):
            value = getattr(self, name)
            if not isinstance(value, cls) and not (optional and value is None):
                expected = f"a {cls.__name__}" + (" or None" if optional else "")
                raise ValueError(
                    f"KVCRBackendConfigs: {name} must be {expected}, got {type(value).__name__}"
                )
        regions = list(self.framework_regions)
        labels: set[str] = set()
        for i, region in enumerate(regions):
            where = f"KVCRBackendConfigs: framework_regions[{i}]"
            if not isinstance(region, RegionDescriptor):
                raise ValueError(f"{where} must be a RegionDescriptor, got {type(region).__name__}")
            if not isinstance(region.label, str):
                raise ValueError(f"{where}: label must be a str, got {_shown(region.label)}")
            if region.label in labels:
                raise ValueError(f"{where}: label {_shown(region.label)} is not unique")
            labels.add(region.label)
            _validate_region(where, region)
        object.__setattr__(self, "framework_regions", regions)


def _validate_region(where: str, region: RegionDescriptor) -> None:
    if region.mem_type not in MEM_TYPES:
        raise ValueError(
            f"{where}: mem_type must be one of {MEM_TYPES}, got {_shown(region.mem_type)}"
        )
    for name in ("addr", "size", "count"):
        value = getattr(region, name)
        if not _is_u64(value):
            raise ValueError(f"{where}: {name} must be a positive 64-bit int, got {_shown(value)}")
    if not _is_int(region.stride) or (region.stride and not region.size <= region.stride < U64):
        raise ValueError(
            f"{where}: stride must be 0 or >= size ({region.size}), got {_shown(region.stride)}"
        )
    if not _is_int(region.device_Id) or not 0 <= region.device_Id < U64:
        raise ValueError(f"{where}: device_Id must be a non-negative 64-bit int")


@dataclasses.dataclass(frozen=True)
class KVCRGuardConfig:
    kvcr_service_socket_path: str
    guard_index: int
    compatibility_digest: str

    def __post_init__(self) -> None:
        if not isinstance(self.kvcr_service_socket_path, (str, os.PathLike)) or not str(
            self.kvcr_service_socket_path
        ):
            raise ValueError("KVCRGuardConfig: kvcr_service_socket_path must be a non-empty path")
        if not _is_int(self.guard_index) or not 0 <= self.guard_index < MAX_GROUPS:
            raise ValueError(
                f"KVCRGuardConfig: guard_index must be an int in [0, {MAX_GROUPS - 1}], got {_shown(self.guard_index)}"
            )
        if not isinstance(self.compatibility_digest, str) or not self.compatibility_digest:
            raise ValueError("KVCRGuardConfig: compatibility_digest must be a non-empty string")


def _require_backend(owner: str, backend: object) -> None:
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"{owner}: backend must be a NIXL backend name, got {_shown(backend)}")


def validate_setup(
    config: KVCRConfig,
    backend_configs: KVCRBackendConfigs,
    guard_config: KVCRGuardConfig | None,
) -> None:
    """Checks that span several configuration objects."""
    if not isinstance(config, KVCRConfig):
        raise ValueError(f"KVCR: config must be a KVCRConfig, got {type(config).__name__}")
    if not isinstance(backend_configs, KVCRBackendConfigs):
        raise ValueError(
            f"KVCR: backend_configs must be a KVCRBackendConfigs, got {type(backend_configs).__name__}"
        )
    if guard_config is not None and not isinstance(guard_config, KVCRGuardConfig):
        raise ValueError(
            f"KVCR: guard_config must be a KVCRGuardConfig, got {type(guard_config).__name__}"
        )
    local = backend_configs.local_dram
    if guard_config is not None and local is not None:
        raise ValueError(
            "KVCR: guard_config and backend_configs.local_dram conflict: "
            "with a guard service the pools come from the service"
        )
    if local is not None:
        validate_pools_against_layouts(config.pool_layouts, local)
    if backend_configs.g3 is not None:
        if local is None and guard_config is None:
            raise ValueError("KVCRBackendConfigs: g3 needs local DRAM (local_dram or a guard)")
        validate_g3_layout(config.pool_layouts, backend_configs.g3)
        if guard_config is None:
            for i, path in enumerate(backend_configs.g3.paths):
                where = f"G3Options: paths[{i}]"
                if "guard_index" in g3_paths.placeholders(str(path), where):
                    raise ValueError(f"{where} ({_shown(str(path))}): {g3_paths.NEEDS_GUARD}")


def for_instance(
    config: KVCRConfig, backend_configs: KVCRBackendConfigs, guard_index: int | None
) -> KVCRBackendConfigs:
    """``backend_configs`` as one instance uses them: its G3 files are the configured paths
    with ``{agent}`` and ``{guard_index}`` expanded (:mod:`kvcr.g3.paths`). Expanding twice
    changes nothing."""
    g3 = backend_configs.g3
    if g3 is None or isinstance(g3, InstanceG3Options):
        return backend_configs
    files = g3_paths.expand(g3.paths, agent=config.nixl_agent_name, guard_index=guard_index)
    mine = InstanceG3Options(
        paths=files,
        capacity_bytes_per_file=g3.capacity_bytes_per_file,
        backend=g3.backend,
        backend_options=g3.backend_options,
        templates=g3.paths,
    )
    return dataclasses.replace(backend_configs, g3=mine)


def validate_pools_against_layouts(layouts: PoolBlockLayouts, local: LocalDramOptions) -> None:
    names = [name for name, _, _ in local.pools]
    wanted = [name for name, _ in layouts]
    if sorted(names) != sorted(wanted) or len(set(names)) != len(names):
        raise ValueError(
            f"LocalDramOptions: pools {names} must match pool_layouts {wanted} by name, once each"
        )
    sizes = dict(layouts)
    for name, _addr, size in local.pools:
        if size < sizes[name]:
            raise ValueError(
                f"LocalDramOptions: pool {_shown(name)} has {size} bytes, less than one block "
                f"({sizes[name]} bytes)"
            )


def validate_g3_layout(layouts: PoolBlockLayouts, g3: G3Options) -> None:
    if len(layouts) != 1:
        raise ValueError(f"G3Options: G3 needs exactly one pool, pool_layouts has {len(layouts)}")
    name, block = layouts[0]
    if block % PAGE_SIZE:
        raise ValueError(
            f"G3Options: block size of pool {_shown(name)} ({block}) must be a multiple of the page size ({PAGE_SIZE})"
        )
    if g3.capacity_bytes_per_file % block:
        raise ValueError(
            f"G3Options: capacity_bytes_per_file ({_shown(g3.capacity_bytes_per_file)}) must be a whole "
            f"number of blocks of {block} bytes"
        )
