"""Behaviour of the public value types in ``kvcr.types`` (contract section 2)."""

from __future__ import annotations

import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr.types import (
    BlockKey,
    BlockMeta,
    CacheTier,
    InventoryEvent,
    KVCRStartupError,
    MemoryRef,
    OpEntryResult,
    OpEntryStatus,
    PinRequestId,
    PlacementAction,
    PlacementFailure,
    QueryStatus,
    RecoveryMirrorError,
    RegionDescriptor,
    ReleaseHandle,
    TransferError,
)

KEY_A = BlockKey(b"key-a")
KEY_B = BlockKey(b"key-b")


# --- enums -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enum_cls", "names"),
    [
        (OpEntryStatus, ["SUCCESS", "DROPPED", "FAILED"]),
        (QueryStatus, ["HIT", "FETCHING", "FETCHABLE", "MISS"]),
        (PlacementAction, ["KEEP", "DROP", "COPY_TO", "MOVE_TO"]),
    ],
)
def test_enum_has_exactly_the_contract_members_whose_values_equal_their_names(enum_cls, names):
    assert [member.name for member in enum_cls] == names
    assert [member.value for member in enum_cls] == names


def test_cache_tier_values_are_the_contract_strings_not_the_member_names():
    assert {tier.name: tier.value for tier in CacheTier} == {
        "FW_G1": "HBM",
        "FW_G2": "FW_DRAM",
        "LOCAL_G2": "DRAM",
        "REMOTE_G2": "REMOTE_G2",
        "G3": "G3",
    }


def test_cache_tier_can_be_looked_up_by_its_contract_value():
    assert CacheTier("DRAM") is CacheTier.LOCAL_G2
    assert CacheTier("HBM") is CacheTier.FW_G1


@pytest.mark.parametrize(
    ("new_type", "raw"),
    [(BlockKey, b"\x00\x01"), (PinRequestId, 7), (ReleaseHandle, 42)],
)
def test_new_types_are_their_underlying_value_at_runtime(new_type, raw):
    assert new_type(raw) == raw
    assert type(new_type(raw)) is type(raw)


# --- value objects: frozen, compared by value ------------------------------------------------


def _meta(**overrides) -> BlockMeta:
    fields = {
        "block_key": KEY_A,
        "size_bytes": 4096,
        "access_count": 1,
        "last_access": 1.5,
        "resident_tiers": frozenset({CacheTier.LOCAL_G2}),
    }
    fields.update(overrides)
    return BlockMeta(**fields)


VALUE_OBJECT_FACTORIES = {
    "RegionDescriptor": lambda: RegionDescriptor(addr=0x1000, size=256, count=4, label="p"),
    "MemoryRef": lambda: MemoryRef(end_point_name="agent", label="p", element_index=3),
    "OpEntryResult": lambda: OpEntryResult(
        OpEntryStatus.SUCCESS,
        [MemoryRef(end_point_name="agent", element_index=0)],
        ReleaseHandle(9),
    ),
    "InventoryEvent": lambda: InventoryEvent((KEY_A, KEY_B), CacheTier.G3, False),
    "BlockMeta": _meta,
    "PlacementFailure": lambda: PlacementFailure(
        (PlacementAction.MOVE_TO, CacheTier.G3), CacheTier.LOCAL_G2, "disk full", 2
    ),
}


@pytest.mark.parametrize("factory", VALUE_OBJECT_FACTORIES.values(), ids=VALUE_OBJECT_FACTORIES)
def test_value_object_equals_an_independently_built_copy(factory):
    first, second = factory(), factory()
    assert first is not second
    assert first == second


@pytest.mark.parametrize("factory", VALUE_OBJECT_FACTORIES.values(), ids=VALUE_OBJECT_FACTORIES)
def test_value_object_differs_when_one_field_differs(factory):
    original = factory()
    first_field = attrs.fields(type(original))[0]
    changed_value = "other" if isinstance(getattr(original, first_field.name), str) else None
    assert attrs.evolve(original, **{first_field.name: changed_value}) != original


@pytest.mark.parametrize("factory", VALUE_OBJECT_FACTORIES.values(), ids=VALUE_OBJECT_FACTORIES)
def test_value_object_rejects_attribute_assignment(factory):
    obj = factory()
    first_field = attrs.fields(type(obj))[0].name
    with pytest.raises(AttributeError):
        setattr(obj, first_field, None)


@pytest.mark.parametrize(
    "factory",
    [
        VALUE_OBJECT_FACTORIES[name]
        for name in ("RegionDescriptor", "MemoryRef", "InventoryEvent", "BlockMeta")
    ],
    ids=["RegionDescriptor", "MemoryRef", "InventoryEvent", "BlockMeta"],
)
def test_hashable_value_objects_hash_equal_when_equal(factory):
    assert hash(factory()) == hash(factory())
    assert len({factory(), factory()}) == 1


@pytest.mark.parametrize(
    ("cls", "field_names"),
    [
        (RegionDescriptor, ["mem_type", "device_Id", "addr", "stride", "count", "size", "label"]),
        (MemoryRef, ["end_point_name", "label", "element_index"]),
        (OpEntryResult, ["status", "descriptors", "release_handle"]),
        (InventoryEvent, ["keys", "tier", "removed"]),
        (
            BlockMeta,
            [
                "block_key",
                "size_bytes",
                "access_count",
                "last_access",
                "resident_tiers",
                "position",
            ],
        ),
        (PlacementFailure, ["attempted", "source", "reason", "failure_count"]),
    ],
)
def test_value_object_fields_have_the_contract_names_in_contract_order(cls, field_names):
    assert [f.name for f in attrs.fields(cls)] == field_names


def test_region_descriptor_defaults_match_the_contract():
    region = RegionDescriptor(addr=0x2000, size=64)
    assert region.mem_type == "DRAM"
    assert region.device_Id == 0
    assert region.stride == 0
    assert region.count == 1
    assert region.label == ""


def test_memory_ref_label_defaults_to_the_empty_label():
    assert MemoryRef(end_point_name="agent", element_index=0).label == ""


def test_op_entry_result_defaults_to_no_descriptors_and_no_release_handle():
    result = OpEntryResult(OpEntryStatus.FAILED)
    assert result.descriptors is None
    assert result.release_handle is None


def test_block_meta_position_defaults_to_minus_one():
    assert _meta().position == -1


# --- keyword-only construction ---------------------------------------------------------------


def test_region_descriptor_rejects_positional_arguments():
    with pytest.raises(TypeError):
        RegionDescriptor("DRAM", 0, 0x1000, 0, 1, 64, "")  # type: ignore[misc]


def test_memory_ref_rejects_positional_arguments():
    with pytest.raises(TypeError):
        MemoryRef("agent", "", 0)  # type: ignore[misc]


@pytest.mark.parametrize("missing", ["addr", "size"])
def test_region_descriptor_requires_addr_and_size(missing):
    kwargs = {"addr": 0x1000, "size": 64}
    del kwargs[missing]
    with pytest.raises(TypeError, match=missing):
        RegionDescriptor(**kwargs)


@pytest.mark.parametrize("missing", ["end_point_name", "element_index"])
def test_memory_ref_requires_end_point_name_and_element_index(missing):
    kwargs = {"end_point_name": "agent", "element_index": 0}
    del kwargs[missing]
    with pytest.raises(TypeError, match=missing):
        MemoryRef(**kwargs)


def test_op_entry_result_accepts_its_fields_positionally():
    handle = ReleaseHandle(5)
    result = OpEntryResult(OpEntryStatus.SUCCESS, None, handle)
    assert result.release_handle == handle


# --- region addressing -----------------------------------------------------------------------


def test_contiguous_region_places_elements_back_to_back():
    region = RegionDescriptor(addr=0x1000, size=0x100, count=4)
    assert [region.element_addr(i) for i in range(4)] == [0x1000, 0x1100, 0x1200, 0x1300]
    assert region.span == 0x400


def test_strided_region_places_elements_one_stride_apart():
    region = RegionDescriptor(addr=0x1000, size=0x100, stride=0x400, count=3)
    assert [region.element_addr(i) for i in range(3)] == [0x1000, 0x1400, 0x1800]


def test_strided_region_span_ends_at_the_last_element_not_at_the_last_stride():
    region = RegionDescriptor(addr=0x1000, size=0x100, stride=0x400, count=3)
    assert region.span == 2 * 0x400 + 0x100


def test_single_element_region_spans_exactly_one_element():
    assert RegionDescriptor(addr=0x1000, size=96, stride=4096).span == 96


@st.composite
def valid_regions(draw):
    size = draw(st.integers(min_value=1, max_value=1 << 20))
    stride = draw(st.one_of(st.just(0), st.integers(min_value=size, max_value=1 << 22)))
    return RegionDescriptor(
        addr=draw(st.integers(min_value=1, max_value=1 << 48)),
        size=size,
        stride=stride,
        count=draw(st.integers(min_value=1, max_value=1 << 16)),
    )


@given(region=valid_regions(), data=st.data())
def test_element_addr_follows_the_contract_formula(region, data):
    index = data.draw(st.integers(min_value=0, max_value=region.count - 1))
    step = region.stride or region.size
    assert region.element_addr(index) == region.addr + index * step


@given(region=valid_regions(), data=st.data())
def test_elements_of_a_valid_region_never_overlap_and_stay_inside_the_span(region, data):
    index = data.draw(st.integers(min_value=0, max_value=region.count - 1))
    start = region.element_addr(index)
    end = start + region.size
    assert region.addr <= start
    assert end <= region.addr + region.span
    if index + 1 < region.count:
        assert end <= region.element_addr(index + 1)


@given(region=valid_regions())
def test_last_element_ends_exactly_at_the_span(region):
    assert region.element_addr(region.count - 1) + region.size == region.addr + region.span


# --- OpEntryResult.success -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "success"),
    [(OpEntryStatus.SUCCESS, True), (OpEntryStatus.DROPPED, False), (OpEntryStatus.FAILED, False)],
)
def test_op_entry_result_is_a_success_only_for_success_status(status, success):
    assert OpEntryResult(status).success is success


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("error_cls", [KVCRStartupError, TransferError, RecoveryMirrorError])
def test_kvcr_errors_are_runtime_errors(error_cls):
    assert issubclass(error_cls, RuntimeError)


def test_transfer_error_defaults_to_uncertain_with_no_memory_named():
    error = TransferError("copy failed", 17)
    assert str(error) == "copy failed"
    assert error.message == "copy failed"
    assert error.op_handle == 17
    assert error.state == "uncertain"
    assert error.source_blocks is None
    assert error.source_owners is None
    assert error.destination_regions is None
    assert error.destination_owner is None


def _full_transfer_error() -> TransferError:
    return TransferError(
        "fetch failed",
        23,
        state="quiesced",
        source_blocks=(KEY_A, KEY_B),
        source_owners=("framework", "kvcr"),
        destination_regions=(MemoryRef(end_point_name="peer", label="p:0", element_index=5),),
        destination_owner="kvcr",
    )


def _transfer_error_fields(error: TransferError) -> tuple:
    return (
        type(error),
        str(error),
        error.args,
        error.message,
        error.op_handle,
        error.state,
        error.source_blocks,
        error.source_owners,
        error.destination_regions,
        error.destination_owner,
    )


def test_transfer_error_exposes_every_constructor_argument_as_an_attribute():
    error = _full_transfer_error()
    assert error.state == "quiesced"
    assert error.source_blocks == (KEY_A, KEY_B)
    assert error.source_owners == ("framework", "kvcr")
    assert error.destination_regions == (
        MemoryRef(end_point_name="peer", label="p:0", element_index=5),
    )
    assert error.destination_owner == "kvcr"


def test_transfer_error_fields_after_op_handle_are_keyword_only():
    with pytest.raises(TypeError):
        TransferError("m", 1, "quiesced")  # type: ignore[misc]


@pytest.mark.parametrize("state", ["failed", "UNCERTAIN", "", None])
def test_transfer_error_rejects_a_state_outside_the_contract(state):
    with pytest.raises(ValueError, match="state"):
        TransferError("m", 1, state=state)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_transfer_error_survives_a_pickle_round_trip_with_all_fields(protocol):
    error = _full_transfer_error()
    restored = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert _transfer_error_fields(restored) == _transfer_error_fields(error)


def test_transfer_error_with_default_fields_survives_a_pickle_round_trip():
    error = TransferError("boom", 3)
    restored = pickle.loads(pickle.dumps(error))
    assert _transfer_error_fields(restored) == _transfer_error_fields(error)
