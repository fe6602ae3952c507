"""Behaviour of ``kvcr.config``: defaults, per-class validation and ``validate_setup``
(contract section 3). Every rejected setting raises ``ValueError`` whose message names it."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcr.config import (
    PAGE_SIZE,
    FrameworkControl,
    G3Options,
    KeyAdapter,
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    LocalDramOptions,
    RemoteFWDramOptions,
    TelemetryStats,
    validate_setup,
)
from kvcr.types import BlockKey, RegionDescriptor

BLOCK = PAGE_SIZE
ADDR = 0x7F00_0000_0000


def make_config(**overrides) -> KVCRConfig:
    fields = {"nixl_agent_name": "agent-0", "pool_layouts": [("p", BLOCK)]}
    fields.update(overrides)
    return KVCRConfig(**fields)


def make_region(**overrides) -> RegionDescriptor:
    fields = {"addr": ADDR, "size": 256, "count": 4, "label": "p"}
    fields.update(overrides)
    return RegionDescriptor(**fields)


def make_g3(tmp_path: Path, **overrides) -> G3Options:
    fields = {"paths": (tmp_path / "g3-0",), "capacity_bytes_per_file": 4 * BLOCK}
    fields.update(overrides)
    return G3Options(**fields)


def make_guard(**overrides) -> KVCRGuardConfig:
    fields = {
        "kvcr_service_socket_path": "/run/kvcr.sock",
        "guard_index": 0,
        "compatibility_digest": "digest-1",
    }
    fields.update(overrides)
    return KVCRGuardConfig(**fields)


def local_dram_for(layouts, blocks_per_pool: int = 8) -> LocalDramOptions:
    return LocalDramOptions(
        [
            (name, ADDR + i * (1 << 30), size * blocks_per_pool)
            for i, (name, size) in enumerate(layouts)
        ]
    )


def _signature(cls) -> list[tuple]:
    return [(p.name, p.default, p.kind) for p in inspect.signature(cls).parameters.values()]


# --- field order and defaults ----------------------------------------------------------------

EMPTY = inspect.Parameter.empty
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
KW = inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (
            KVCRConfig,
            [
                ("nixl_agent_name", EMPTY, POS),
                ("pool_layouts", EMPTY, POS),
                ("enable_telemetry", False, POS),
                ("operation_timeout_ms", 1000, POS),
                ("abandon_timeout_ms", 5000, POS),
                ("capacity_low_watermark_percent", 0, POS),
                ("nixl_listen_port", None, POS),
            ],
        ),
        (LocalDramOptions, [("pools", EMPTY, POS), ("backend", "UCX", POS)]),
        (
            RemoteFWDramOptions,
            [
                ("eager_ctrl_connect", True, POS),
                ("opportunistic_query", False, POS),
                ("metadata_retry_interval_ms", 100, POS),
                ("backend", "UCX", POS),
            ],
        ),
        (
            KVCRGuardConfig,
            [
                ("kvcr_service_socket_path", EMPTY, POS),
                ("guard_index", EMPTY, POS),
                ("compatibility_digest", EMPTY, POS),
            ],
        ),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_constructor_has_the_contract_fields_in_order_with_contract_defaults(cls, expected):
    assert _signature(cls) == expected


def test_g3_options_fields_are_all_keyword_only_in_contract_order():
    params = inspect.signature(G3Options).parameters
    assert list(params) == ["paths", "capacity_bytes_per_file", "backend", "backend_options"]
    assert all(p.kind is KW for p in params.values())
    assert params["paths"].default is EMPTY
    assert params["capacity_bytes_per_file"].default is EMPTY


def test_g3_options_rejects_positional_arguments(tmp_path):
    with pytest.raises(TypeError):
        G3Options((tmp_path / "f",), BLOCK, "POSIX")  # type: ignore[misc]


def test_g3_options_backend_options_default_to_an_empty_mapping(tmp_path):
    assert dict(make_g3(tmp_path).backend_options) == {}


def test_backend_configs_defaults_match_the_contract():
    configs = KVCRBackendConfigs()
    assert configs.framework_regions == []
    assert configs.local_dram is None
    assert configs.g3 is None
    assert configs.remote_fw_dram == RemoteFWDramOptions()
    assert [f.name for f in dataclasses.fields(KVCRBackendConfigs)] == [
        "framework_regions",
        "local_dram",
        "g3",
        "remote_fw_dram",
    ]


def test_backend_configs_instances_do_not_share_their_default_region_list():
    first, second = KVCRBackendConfigs(), KVCRBackendConfigs()
    assert first.framework_regions is not second.framework_regions


def test_kvcr_config_accepts_every_field_positionally_in_contract_order():
    config = KVCRConfig("agent", [("p", BLOCK)], True, 10, 20, 5, 4321)
    assert config.nixl_agent_name == "agent"
    assert config.pool_layouts == [("p", BLOCK)]
    assert config.enable_telemetry is True
    assert config.operation_timeout_ms == 10
    assert config.abandon_timeout_ms == 20
    assert config.capacity_low_watermark_percent == 5
    assert config.nixl_listen_port == 4321


@pytest.mark.parametrize(
    "build",
    [
        make_config,
        lambda: LocalDramOptions([("p", ADDR, BLOCK)]),
        RemoteFWDramOptions,
        KVCRBackendConfigs,
        make_guard,
    ],
    ids=["KVCRConfig", "LocalDramOptions", "RemoteFWDramOptions", "KVCRBackendConfigs", "guard"],
)
def test_config_objects_are_frozen_and_compare_by_value(build):
    first, second = build(), build()
    assert first == second
    field = dataclasses.fields(first)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(first, field, None)


def test_g3_options_are_frozen_and_compare_by_value(tmp_path):
    assert make_g3(tmp_path) == make_g3(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_g3(tmp_path).capacity_bytes_per_file = 1  # type: ignore[misc]


# --- KVCRConfig: pool_layouts ----------------------------------------------------------------


@pytest.mark.parametrize(
    "layouts",
    [
        [("p", BLOCK)],
        [("k", 4096), ("v", 8192), ("mla", 1)],
        [("", 512)],
    ],
    ids=["one-pool", "several-pools", "sole-empty-name"],
)
def test_valid_pool_layouts_are_kept_in_order(layouts):
    config = make_config(pool_layouts=layouts)
    assert config.pool_layouts == layouts
    assert config.pool_names == [name for name, _ in layouts]


def test_pool_layouts_given_as_tuples_become_a_list_of_pairs():
    config = make_config(pool_layouts=(["k", 4096], ["v", 8192]))
    assert config.pool_layouts == [("k", 4096), ("v", 8192)]


@pytest.mark.parametrize(
    ("layouts", "reason"),
    [
        ([], "non-empty"),
        (None, "non-empty"),
        ("p", "non-empty"),
        ({"p": 4096}, "non-empty"),
        ([("p",)], "pair"),
        ([("p", 4096, 0)], "pair"),
        (["p4096"], "pair"),
        ([(7, 4096)], "pool name must be a string"),
        ([(b"p", 4096)], "pool name must be a string"),
        ([("a:b", 4096)], "without ':'"),
        ([("p", 4096), ("p", 8192)], "appears twice"),
        ([("p", 0)], "block size of pool 'p' must be a positive int"),
        ([("p", -4096)], "block size of pool 'p' must be a positive int"),
        ([("p", True)], "block size of pool 'p' must be a positive int"),
        ([("p", 4096.0)], "block size of pool 'p' must be a positive int"),
        ([("p", "4096")], "block size of pool 'p' must be a positive int"),
        ([("", 4096), ("q", 4096)], "empty pool name is allowed only when it is the only pool"),
        ([("q", 4096), ("", 4096)], "empty pool name is allowed only when it is the only pool"),
    ],
)
def test_invalid_pool_layouts_are_rejected_naming_the_setting_and_the_problem(layouts, reason):
    with pytest.raises(ValueError, match="pool_layouts") as excinfo:
        make_config(pool_layouts=layouts)
    assert reason in str(excinfo.value)


# Property tests below draw a valid value, then (usually) corrupt one part of it, and compare
# the outcome with an independent oracle: accepted exactly when the oracle says valid, and
# otherwise a ValueError naming the setting. Nothing else may ever be raised.

_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=3),
    st.binary(max_size=2),
)
_NAME_WITHOUT_COLON = st.text(max_size=3).filter(lambda name: ":" not in name)


@st.composite
def pool_layouts_inputs(draw):
    items = draw(
        st.lists(
            st.tuples(_NAME_WITHOUT_COLON.filter(bool), st.integers(1, 2**64)),
            min_size=1,
            max_size=4,
            unique_by=lambda item: item[0],
        )
    )
    i = draw(st.integers(0, len(items) - 1))
    name, size = items[i]
    corruption = draw(
        st.sampled_from(
            [None, "size", "name", "colon", "repeat", "empty-name", "shape", "lists", "outer"]
        )
    )
    if corruption == "size":
        items[i] = (name, draw(_JUNK))
    elif corruption == "name":
        items[i] = (draw(_JUNK), size)
    elif corruption == "colon":
        items[i] = (name + ":" + draw(st.sampled_from(["", "*", "0"])), size)
    elif corruption == "repeat":
        items.insert(draw(st.integers(0, len(items))), (name, draw(st.integers(1, 2**20))))
    elif corruption == "empty-name":
        items[i] = ("", size)  # valid only when it is the only pool
    elif corruption == "shape":
        items[i] = draw(
            st.one_of(st.just(()), st.just((name,)), st.just((name, size, size)), _JUNK)
        )
    elif corruption == "lists":
        items = [list(item) for item in items]
    elif corruption == "outer":
        return draw(
            st.one_of(
                st.just([]), st.just(tuple(items)), st.just(dict(items)), st.just(items[0]), _JUNK
            )
        )
    return items


def _is_valid_layout(layouts) -> bool:
    """Contract section 3, written independently of kvcr.config."""
    if not isinstance(layouts, (list, tuple)) or not layouts:
        return False
    names = []
    for item in layouts:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return False
        name, size = item
        if not isinstance(name, str) or ":" in name:
            return False
        if type(size) is not int or not 0 < size < 2**64:
            return False
        names.append(name)
    if len(set(names)) != len(names):
        return False
    return not ("" in names and len(names) > 1)


@settings(max_examples=300)
@given(layouts=pool_layouts_inputs())
def test_pool_layouts_are_accepted_exactly_when_valid_and_otherwise_raise_value_error(layouts):
    valid = _is_valid_layout(layouts)
    try:
        config = make_config(pool_layouts=layouts)
    except ValueError as error:
        assert not valid, f"rejected a valid layout: {error}"
        assert "pool_layouts" in str(error)
    else:
        assert valid, f"accepted an invalid layout: {layouts!r}"
        assert config.pool_layouts == [tuple(item) for item in layouts]


# --- KVCRConfig: other settings --------------------------------------------------------------


@pytest.mark.parametrize("name", ["", None, 5, b"agent"])
def test_nixl_agent_name_must_be_a_non_empty_string(name):
    with pytest.raises(ValueError, match="nixl_agent_name"):
        make_config(nixl_agent_name=name)


@pytest.mark.parametrize("setting", ["operation_timeout_ms", "abandon_timeout_ms"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1000", None])
def test_timeouts_must_be_positive_ints(setting, value):
    with pytest.raises(ValueError, match=setting):
        make_config(**{setting: value})


@pytest.mark.parametrize(("operation", "abandon"), [(1000, 1999), (1000, 1000), (3000, 5000)])
def test_abandon_timeout_below_twice_the_operation_timeout_is_rejected(operation, abandon):
    with pytest.raises(
        ValueError, match=r"abandon_timeout_ms must be >= 2 \* operation_timeout_ms"
    ):
        make_config(operation_timeout_ms=operation, abandon_timeout_ms=abandon)


def test_abandon_timeout_of_exactly_twice_the_operation_timeout_is_accepted():
    config = make_config(operation_timeout_ms=700, abandon_timeout_ms=1400)
    assert config.abandon_timeout_ms == 1400


@pytest.mark.parametrize("percent", [0, 1, 50, 99])
def test_watermark_percent_in_range_is_accepted(percent):
    assert (
        make_config(capacity_low_watermark_percent=percent).capacity_low_watermark_percent
        == percent
    )


@pytest.mark.parametrize("percent", [-1, 100, 101, True, 10.0, "10", None])
def test_watermark_percent_outside_0_to_99_or_not_an_int_is_rejected(percent):
    with pytest.raises(ValueError, match="capacity_low_watermark_percent"):
        make_config(capacity_low_watermark_percent=percent)


@pytest.mark.parametrize("port", [None, 1, 5600, 65535])
def test_listen_port_none_or_in_range_is_accepted(port):
    assert make_config(nixl_listen_port=port).nixl_listen_port == port


@pytest.mark.parametrize("port", [0, -1, 65536, True, 5600.0, "5600"])
def test_listen_port_outside_1_to_65535_or_not_an_int_is_rejected(port):
    with pytest.raises(ValueError, match="nixl_listen_port"):
        make_config(nixl_listen_port=port)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_enable_telemetry_must_be_a_bool(flag):
    with pytest.raises(ValueError, match="enable_telemetry"):
        make_config(enable_telemetry=flag)


@st.composite
def numeric_settings(draw):
    operation = draw(st.integers(1, 10**6))
    settings_ = {
        "operation_timeout_ms": operation,
        "abandon_timeout_ms": 2 * operation + draw(st.integers(0, 10**6)),
        "capacity_low_watermark_percent": draw(st.integers(0, 99)),
        "nixl_listen_port": draw(st.one_of(st.none(), st.integers(1, 65535))),
    }
    corrupted = draw(st.sampled_from([None, *settings_]))
    if corrupted is not None:
        settings_[corrupted] = draw(_JUNK)
    return corrupted, settings_


def _numeric_settings_are_valid(operation, abandon, percent, port) -> bool:
    """Contract section 3, written independently of kvcr.config."""
    if any(type(v) is not int for v in (operation, abandon, percent)):
        return False
    if port is not None and (type(port) is not int or not 1 <= port <= 65535):
        return False
    return 0 < operation <= 2**53 and 2 * operation <= abandon <= 2**53 and 0 <= percent <= 99


@settings(max_examples=300)
@given(drawn=numeric_settings())
def test_numeric_settings_are_accepted_exactly_when_valid_and_otherwise_name_the_setting(drawn):
    corrupted, values = drawn
    valid = _numeric_settings_are_valid(*values.values())
    try:
        make_config(**values)
    except ValueError as error:
        assert not valid, f"rejected valid settings: {error}"
        assert corrupted in str(error)
    else:
        assert valid, f"accepted invalid settings: {values!r}"


# --- LocalDramOptions ------------------------------------------------------------------------


def test_local_dram_pools_given_as_lists_become_a_list_of_triples():
    options = LocalDramOptions((["k", ADDR, BLOCK], ["v", ADDR + BLOCK, BLOCK]))
    assert options.pools == [("k", ADDR, BLOCK), ("v", ADDR + BLOCK, BLOCK)]
    assert options.backend == "UCX"


@pytest.mark.parametrize(
    ("pools", "reason"),
    [
        ([], "non-empty"),
        (None, "non-empty"),
        ([("p", ADDR)], r"\(pool name, address, size\)"),
        (["p"], r"\(pool name, address, size\)"),
        ([(1, ADDR, BLOCK)], "pool name must be a string"),
        ([("p", 0, BLOCK)], "address of pool 'p'"),
        ([("p", -ADDR, BLOCK)], "address of pool 'p'"),
        ([("p", True, BLOCK)], "address of pool 'p'"),
        ([("p", ADDR, 0)], "size of pool 'p'"),
        ([("p", ADDR, float(BLOCK))], "size of pool 'p'"),
    ],
)
def test_invalid_local_dram_pools_are_rejected(pools, reason):
    with pytest.raises(ValueError, match=r"LocalDramOptions: pools.*" + reason):
        LocalDramOptions(pools)


@pytest.mark.parametrize("backend", ["", None, 3])
def test_local_dram_backend_must_be_a_backend_name(backend):
    with pytest.raises(ValueError, match="LocalDramOptions: backend"):
        LocalDramOptions([("p", ADDR, BLOCK)], backend=backend)


# --- RemoteFWDramOptions ---------------------------------------------------------------------


@pytest.mark.parametrize("interval", [0, -100, True, 0.5])
def test_metadata_retry_interval_must_be_a_positive_int(interval):
    with pytest.raises(ValueError, match="metadata_retry_interval_ms"):
        RemoteFWDramOptions(metadata_retry_interval_ms=interval)


@pytest.mark.parametrize("backend", ["", None])
def test_remote_fw_dram_backend_must_be_a_backend_name(backend):
    with pytest.raises(ValueError, match="RemoteFWDramOptions: backend"):
        RemoteFWDramOptions(backend=backend)


# --- G3Options -------------------------------------------------------------------------------


def test_g3_paths_are_kept_in_order_as_a_tuple_of_paths(tmp_path):
    options = make_g3(tmp_path, paths=[str(tmp_path / "a"), tmp_path / "b"])
    assert options.paths == (tmp_path / "a", tmp_path / "b")


def test_g3_backend_options_are_copied_so_later_changes_do_not_leak_in(tmp_path):
    source = {"use_direct_io": "false"}
    options = make_g3(tmp_path, backend_options=source)
    source["use_direct_io"] = "true"
    assert options.backend_options == {"use_direct_io": "false"}


@pytest.mark.parametrize("paths", [(), [], None, "/var/g3", Path("/var/g3")])
def test_g3_paths_must_be_a_non_empty_sequence_of_paths(tmp_path, paths):
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=paths)


@pytest.mark.parametrize(
    "second",
    ["f", "./f", "sub/../f", "sub/./../f", "f/"],
    ids=["same", "dot-prefix", "parent-hop", "dot-and-parent", "trailing-slash"],
)
def test_g3_paths_naming_the_same_file_twice_are_rejected(tmp_path, second):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=(tmp_path / "f", f"{tmp_path}/{second}"))


def test_g3_relative_and_absolute_spellings_of_one_file_are_rejected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=("f", tmp_path / "f"))


def test_g3_symlink_aliasing_another_path_is_rejected(tmp_path):
    target = tmp_path / "data.g3"
    target.touch()
    link = tmp_path / "alias.g3"
    link.symlink_to(target)
    with pytest.raises(ValueError, match=r"G3Options: paths.*alias"):
        make_g3(tmp_path, paths=(target, link))


def test_g3_symlinked_directory_aliasing_is_rejected(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=(tmp_path / "real" / "f", tmp_path / "linked" / "f"))


def test_g3_hard_links_to_one_file_are_rejected(tmp_path):
    target = tmp_path / "data.g3"
    target.touch()
    os.link(target, tmp_path / "hardlink.g3")
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=(target, tmp_path / "hardlink.g3"))


_PATH_PARTS = st.lists(st.sampled_from(["a", "b", ".", "..", "a/b", "b/", "./a"]), max_size=3)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(relative=st.lists(_PATH_PARTS.map("/".join), min_size=1, max_size=4))
def test_g3_paths_are_accepted_exactly_when_they_name_distinct_files(tmp_path, relative):
    base = tmp_path / "x" / "y"  # deep enough that ".." never leaves tmp_path
    paths = [f"{base}/{r}" for r in relative]
    distinct = len({os.path.normpath(p) for p in paths}) == len(paths)
    try:
        options = make_g3(tmp_path, paths=paths)
    except ValueError as error:
        assert not distinct
        assert "paths" in str(error)
    else:
        assert distinct
        assert options.paths == tuple(Path(p) for p in paths)


def test_g3_empty_path_string_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=("",))


@pytest.mark.parametrize("paths", [5, [1], [None], [b"/var/g3"]], ids=repr)
def test_g3_paths_of_the_wrong_type_are_rejected_with_value_error(tmp_path, paths):
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=paths)


@pytest.mark.parametrize("kind", ["unknown-home", "symlink-loop"])
def test_g3_unresolvable_paths_are_rejected_with_value_error(tmp_path, kind):
    if kind == "unknown-home":
        path = "~kvcr-no-such-user-xyz/g3"
    else:
        (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
        (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
        path = str(tmp_path / "loop-a")
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=(path,))


def test_g3_path_with_a_nul_byte_is_rejected_naming_paths(tmp_path):
    with pytest.raises(ValueError, match="G3Options: paths"):
        make_g3(tmp_path, paths=(f"{tmp_path}/g3\x00",))


@pytest.mark.parametrize("capacity", [0, -BLOCK, True, float(BLOCK), str(BLOCK), None])
def test_g3_capacity_per_file_must_be_a_positive_int(tmp_path, capacity):
    with pytest.raises(ValueError, match="G3Options: capacity_bytes_per_file"):
        make_g3(tmp_path, capacity_bytes_per_file=capacity)


@pytest.mark.parametrize("backend", ["", None])
def test_g3_backend_must_be_a_backend_name(tmp_path, backend):
    with pytest.raises(ValueError, match="G3Options: backend"):
        make_g3(tmp_path, backend=backend)


@pytest.mark.parametrize(
    "backend_options",
    [{1: "x"}, {"x": 1}, {"x": None}, {b"x": "y"}],
    ids=["int-key", "int-value", "none-value", "bytes-key"],
)
def test_g3_backend_options_must_map_str_to_str(tmp_path, backend_options):
    with pytest.raises(ValueError, match="G3Options: backend_options must map str to str"):
        make_g3(tmp_path, backend_options=backend_options)


@pytest.mark.parametrize(
    "backend_options",
    [
        pytest.param(
            None,
        ),
        pytest.param(
            5,
        ),
        pytest.param(
            "ab",
        ),
    ],
    ids=repr,
)
def test_g3_backend_options_that_are_not_a_mapping_are_rejected_naming_the_setting(
    tmp_path, backend_options
):
    with pytest.raises(ValueError, match="G3Options: backend_options"):
        make_g3(tmp_path, backend_options=backend_options)


# --- KVCRBackendConfigs: framework regions ---------------------------------------------------


def test_framework_regions_with_unique_labels_are_kept_in_order():
    regions = (make_region(label="k:*"), make_region(label="v:0"), make_region(mem_type="VRAM"))
    assert KVCRBackendConfigs(framework_regions=regions).framework_regions == list(regions)


def test_framework_regions_with_a_repeated_label_are_rejected_naming_the_label():
    regions = [make_region(label="k"), make_region(label="v"), make_region(label="k", addr=1)]
    with pytest.raises(ValueError, match=r"framework_regions\[2\]: label 'k' is not unique"):
        KVCRBackendConfigs(framework_regions=regions)


def test_two_unlabelled_regions_are_rejected_as_duplicate_labels():
    with pytest.raises(ValueError, match=r"framework_regions\[1\]: label '' is not unique"):
        KVCRBackendConfigs(framework_regions=[make_region(label=""), make_region(label="")])


@pytest.mark.parametrize(
    ("fields", "setting"),
    [
        ({"size": 256, "stride": 255}, "stride"),
        ({"stride": -1}, "stride"),
        ({"stride": 256.0}, "stride"),
        ({"count": 0}, "count"),
        ({"count": -1}, "count"),
        ({"count": True}, "count"),
        ({"mem_type": "HBM"}, "mem_type"),
        ({"mem_type": "dram"}, "mem_type"),
        ({"addr": 0}, "addr"),
        ({"addr": -ADDR}, "addr"),
        ({"addr": None}, "addr"),
        ({"size": 0}, "size"),
        ({"size": True}, "size"),
        ({"device_Id": -1}, "device_Id"),
        ({"device_Id": "0"}, "device_Id"),
    ],
)
def test_region_with_an_invalid_field_is_rejected_naming_index_and_field(fields, setting):
    regions = [make_region(label="ok"), make_region(**fields)]
    with pytest.raises(ValueError, match=rf"framework_regions\[1\]: {setting}"):
        KVCRBackendConfigs(framework_regions=regions)


def test_region_stride_equal_to_size_is_accepted():
    region = make_region(size=256, stride=256)
    assert KVCRBackendConfigs(framework_regions=[region]).framework_regions == [region]


@pytest.mark.parametrize("entry", [None, {"addr": ADDR, "size": 1}, (ADDR, 1)], ids=repr)
def test_framework_region_that_is_not_a_region_descriptor_is_rejected(entry):
    with pytest.raises(ValueError, match=r"framework_regions\[0\] must be a RegionDescriptor"):
        KVCRBackendConfigs(framework_regions=[entry])


@st.composite
def region_fields(draw):
    size = draw(st.integers(1, 1 << 20))
    fields = {
        "mem_type": draw(st.sampled_from(["DRAM", "VRAM"])),
        "device_Id": draw(st.integers(0, 8)),
        "addr": draw(st.integers(1, 1 << 48)),
        "stride": draw(st.one_of(st.just(0), st.integers(size, 4 * size))),
        "count": draw(st.integers(1, 1 << 16)),
        "size": size,
        "label": draw(st.text(max_size=3)),  # non-str labels: see the xfail test below
    }
    corrupted = draw(
        st.sampled_from([None, "mem_type", "device_Id", "addr", "stride", "count", "size"])
    )
    if corrupted == "mem_type":
        fields["mem_type"] = draw(st.one_of(st.sampled_from(["HBM", "dram", ""]), _JUNK))
    elif corrupted is not None:
        fields[corrupted] = draw(st.one_of(st.integers(-4, 2 * size), _JUNK))
    return corrupted, fields


def _region_is_valid(fields) -> bool:
    """Contract section 2/3, written independently of kvcr.config."""
    numbers = [fields[name] for name in ("device_Id", "addr", "stride", "count", "size")]
    if fields["mem_type"] not in ("DRAM", "VRAM") or any(type(n) is not int for n in numbers):
        return False
    device, addr, stride, count, size = numbers
    u64 = 2**64  # addresses, sizes and counts are 64-bit
    return (
        0 <= device < u64
        and all(0 < n < u64 for n in (addr, count, size))
        and (stride == 0 or size <= stride < u64)
    )


@settings(max_examples=300)
@given(drawn=region_fields())
def test_regions_are_accepted_exactly_when_valid_and_otherwise_name_the_field(drawn):
    corrupted, fields = drawn
    valid = _region_is_valid(fields)
    try:
        KVCRBackendConfigs(framework_regions=[RegionDescriptor(**fields)])
    except ValueError as error:
        assert not valid, f"rejected a valid region: {error}"
        assert f"framework_regions[0]: {corrupted}" in str(error) or (
            corrupted == "size" and "framework_regions[0]: stride" in str(error)
        )
    else:
        assert valid, f"accepted an invalid region: {fields!r}"


def test_framework_regions_none_is_rejected_with_value_error():
    with pytest.raises(ValueError, match="framework_regions"):
        KVCRBackendConfigs(framework_regions=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "label",
    [
        pytest.param(
            ["k"],
        ),
        pytest.param(
            5,
        ),
        pytest.param(
            None,
        ),
    ],
    ids=repr,
)
def test_region_label_that_is_not_a_string_is_rejected(label):
    with pytest.raises(ValueError, match=r"framework_regions\[0\]: label"):
        KVCRBackendConfigs(framework_regions=[make_region(label=label)])


@pytest.mark.parametrize(
    ("fields", "setting"),
    [
        pytest.param(
            {"local_dram": [("p", ADDR, 8 * BLOCK)]},
            "local_dram",
            id="local_dram-list",
        ),
        pytest.param(
            {"local_dram": local_dram_for([("p", BLOCK)]), "g3": "/var/g3"},
            "g3",
            id="g3-str",
        ),
        pytest.param(
            {"remote_fw_dram": None},
            "remote_fw_dram",
            id="remote_fw_dram-none",
        ),
    ],
)
def test_backend_config_sections_of_the_wrong_type_are_rejected(fields, setting):
    with pytest.raises(ValueError, match=setting):
        validate_setup(make_config(), KVCRBackendConfigs(**fields), None)


# --- KVCRGuardConfig -------------------------------------------------------------------------


def test_guard_config_takes_its_fields_positionally_in_contract_order():
    guard = KVCRGuardConfig("/run/kvcr.sock", 3, "digest")
    assert guard.kvcr_service_socket_path == "/run/kvcr.sock"
    assert guard.guard_index == 3
    assert guard.compatibility_digest == "digest"


@pytest.mark.parametrize(
    ("fields", "setting"),
    [
        ({"kvcr_service_socket_path": ""}, "kvcr_service_socket_path"),
        ({"kvcr_service_socket_path": None}, "kvcr_service_socket_path"),
        ({"kvcr_service_socket_path": 7}, "kvcr_service_socket_path"),
        ({"guard_index": -1}, "guard_index"),
        ({"guard_index": True}, "guard_index"),
        ({"guard_index": "0"}, "guard_index"),
        ({"guard_index": 0.0}, "guard_index"),
        ({"compatibility_digest": ""}, "compatibility_digest"),
        ({"compatibility_digest": None}, "compatibility_digest"),
        ({"compatibility_digest": b"digest"}, "compatibility_digest"),
    ],
)
def test_invalid_guard_config_field_is_rejected_naming_it(fields, setting):
    with pytest.raises(ValueError, match=f"KVCRGuardConfig: {setting}"):
        make_guard(**fields)


# --- validate_setup --------------------------------------------------------------------------

TWO_POOLS = [("k", BLOCK), ("v", 2 * BLOCK)]


def test_local_dram_pools_matching_the_layouts_in_any_order_are_accepted():
    local = LocalDramOptions([("v", ADDR, 2 * BLOCK), ("k", ADDR + (1 << 30), BLOCK)])
    validate_setup(make_config(pool_layouts=TWO_POOLS), KVCRBackendConfigs(local_dram=local), None)


def test_setup_without_local_dram_or_guard_is_accepted():
    validate_setup(make_config(), KVCRBackendConfigs(), None)


@pytest.mark.parametrize(
    "pools",
    [
        [("k", ADDR, BLOCK)],
        [("k", ADDR, BLOCK), ("v", ADDR * 2, 2 * BLOCK), ("x", ADDR * 3, BLOCK)],
        [("k", ADDR, BLOCK), ("w", ADDR * 2, 2 * BLOCK)],
        [("k", ADDR, BLOCK), ("k", ADDR * 2, BLOCK)],
    ],
    ids=["missing-pool", "extra-pool", "renamed-pool", "repeated-pool"],
)
def test_local_dram_pools_must_match_the_layouts_by_name_once_each(pools):
    with pytest.raises(ValueError, match=r"LocalDramOptions: pools .* must match pool_layouts"):
        validate_setup(
            make_config(pool_layouts=TWO_POOLS),
            KVCRBackendConfigs(local_dram=LocalDramOptions(pools)),
            None,
        )


def test_local_dram_pool_smaller_than_one_block_is_rejected():
    local = LocalDramOptions([("k", ADDR, BLOCK), ("v", ADDR * 2, 2 * BLOCK - 1)])
    with pytest.raises(ValueError, match=r"LocalDramOptions: pool 'v' .* less than one block"):
        validate_setup(
            make_config(pool_layouts=TWO_POOLS), KVCRBackendConfigs(local_dram=local), None
        )


def test_local_dram_pool_of_exactly_one_block_is_accepted():
    local = LocalDramOptions([("k", ADDR, BLOCK), ("v", ADDR * 2, 2 * BLOCK)])
    validate_setup(make_config(pool_layouts=TWO_POOLS), KVCRBackendConfigs(local_dram=local), None)


def test_g3_with_local_dram_one_page_aligned_pool_and_whole_blocks_is_accepted(tmp_path):
    layouts = [("p", 2 * PAGE_SIZE)]
    backend = KVCRBackendConfigs(
        local_dram=local_dram_for(layouts),
        g3=make_g3(tmp_path, capacity_bytes_per_file=10 * 2 * PAGE_SIZE),
    )
    validate_setup(make_config(pool_layouts=layouts), backend, None)


def test_g3_with_a_guard_supplying_local_dram_is_accepted(tmp_path):
    validate_setup(make_config(), KVCRBackendConfigs(g3=make_g3(tmp_path)), make_guard())


def test_g3_without_local_dram_or_guard_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="g3 needs local DRAM"):
        validate_setup(make_config(), KVCRBackendConfigs(g3=make_g3(tmp_path)), None)


def test_g3_with_more_than_one_pool_is_rejected(tmp_path):
    backend = KVCRBackendConfigs(local_dram=local_dram_for(TWO_POOLS), g3=make_g3(tmp_path))
    with pytest.raises(ValueError, match="G3 needs exactly one pool, pool_layouts has 2"):
        validate_setup(make_config(pool_layouts=TWO_POOLS), backend, None)


@pytest.mark.parametrize("block", [PAGE_SIZE - 1, PAGE_SIZE + 512, PAGE_SIZE // 2])
def test_g3_block_size_that_is_not_page_aligned_is_rejected(tmp_path, block):
    layouts = [("p", block)]
    backend = KVCRBackendConfigs(
        local_dram=local_dram_for(layouts), g3=make_g3(tmp_path, capacity_bytes_per_file=block)
    )
    with pytest.raises(ValueError, match=r"block size of pool 'p' .* multiple of the page size"):
        validate_setup(make_config(pool_layouts=layouts), backend, None)


@pytest.mark.parametrize("capacity", [BLOCK + 1, 3 * BLOCK // 2, BLOCK - 1])
def test_g3_capacity_that_is_not_a_whole_number_of_blocks_is_rejected(tmp_path, capacity):
    backend = KVCRBackendConfigs(
        local_dram=local_dram_for([("p", BLOCK)]),
        g3=make_g3(tmp_path, capacity_bytes_per_file=capacity),
    )
    with pytest.raises(ValueError, match=r"capacity_bytes_per_file .* whole number of blocks"):
        validate_setup(make_config(), backend, None)


def test_guard_config_together_with_local_dram_is_rejected_as_a_conflict():
    backend = KVCRBackendConfigs(local_dram=local_dram_for([("p", BLOCK)]))
    with pytest.raises(ValueError, match=r"guard_config and backend_configs\.local_dram conflict"):
        validate_setup(make_config(), backend, make_guard())


def test_guard_config_without_local_dram_is_accepted():
    validate_setup(make_config(), KVCRBackendConfigs(), make_guard())


@pytest.mark.parametrize(
    ("args", "setting"),
    [
        (("config", KVCRBackendConfigs(), None), "config"),
        ((None, KVCRBackendConfigs(), None), "config"),
        ((make_config(), {}, None), "backend_configs"),
        ((make_config(), KVCRBackendConfigs(), {"guard_index": 0}), "guard_config"),
    ],
    ids=["config-str", "config-none", "backend_configs-dict", "guard_config-dict"],
)
def test_validate_setup_rejects_arguments_of_the_wrong_type_naming_them(args, setting):
    with pytest.raises(ValueError, match=f"{setting} must be a"):
        validate_setup(*args)


# --- protocols -------------------------------------------------------------------------------


class _MinimalStats:
    def increase_counter(self, name, value, labelvalues=()):
        pass

    def set_gauge(self, name, value, labelvalues=()):
        pass

    def observe_histogram(self, name, value, labelvalues=()):
        pass

    def reduce(self):
        return {}

    def is_empty(self):
        return True


class _MinimalControl:
    def send(self, endpoint, message):
        return True

    def recv(self):
        return []


class _MinimalKeyAdapter:
    def encode(self, framework_key):
        return BlockKey(bytes(framework_key))

    def decode(self, key):
        return int.from_bytes(key, "little")


@pytest.mark.parametrize(
    ("protocol", "duck"),
    [
        (TelemetryStats, _MinimalStats()),
        (FrameworkControl, _MinimalControl()),
        (KeyAdapter, _MinimalKeyAdapter()),
    ],
    ids=["TelemetryStats", "FrameworkControl", "KeyAdapter"],
)
def test_protocol_accepts_a_minimal_duck_typed_object(protocol, duck):
    assert isinstance(duck, protocol)


@pytest.mark.parametrize(
    ("protocol", "incomplete"),
    [
        (TelemetryStats, _MinimalControl()),
        (FrameworkControl, _MinimalKeyAdapter()),
        (KeyAdapter, _MinimalControl()),
    ],
    ids=["TelemetryStats", "FrameworkControl", "KeyAdapter"],
)
def test_protocol_rejects_an_object_missing_its_methods(protocol, incomplete):
    assert not isinstance(incomplete, protocol)
