"""Configuration from outside (an engine's config dict, guard flags): random values and
types in every field.

Read top to bottom: each config class, built from valid arguments with one or two fields
replaced by anything, either raises ValueError or TypeError whose message names the class
and a replaced field, or builds an object whose fields are all valid (it rebuilds equal
from its own fields, its timeouts convert to seconds, and changing the caller's lists
afterwards changes nothing in it). Then the guard's flags: ``--pool-sizes-gb`` text and the
whole serve command line.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from fuzzing import case, fuzz
from hypothesis import given
from hypothesis import strategies as st

from kvcr.config import (
    G3Options,
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    LocalDramOptions,
    RemoteFWDramOptions,
)
from kvcr.guard import cli
from kvcr.guard.pools import parse_pool_sizes_gb
from kvcr.types import RegionDescriptor

HUGE = st.sampled_from([2**63, 2**64, 10**400, -(10**400), 10**5000, -(10**5000)])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 1 << 20),
    HUGE,
    st.floats(allow_nan=True),
    st.sampled_from(["", ":", "a:b", "UCX", "POSIX", "a\x00b", "x" * 5000, "DRAM", "VRAM"]),
    st.text(max_size=10),
    st.binary(max_size=8),
    st.builds(object),
    st.just(Path("/")),
)
JUNK = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=4),
    st.lists(SCALARS, max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=3), SCALARS, max_size=3),
    st.lists(st.tuples(SCALARS, SCALARS), max_size=3),
    st.lists(st.tuples(SCALARS, SCALARS, SCALARS), max_size=3),
)


def region(**fields):
    return RegionDescriptor(**{"addr": 4096, "size": 4096, "count": 2, "label": "", **fields})


def valid(cls: type, tmp: Path) -> dict:
    """Valid keyword arguments for ``cls`` (lists are fresh each time)."""
    return {
        KVCRConfig: lambda: {"nixl_agent_name": "w0", "pool_layouts": [("k", 4096), ("v", 4096)]},
        LocalDramOptions: lambda: {"pools": [("k", 4096, 8192), ("v", 1 << 20, 8192)]},
        RemoteFWDramOptions: dict,
        G3Options: lambda: {
            "paths": (tmp / "a.bin", tmp / "b.bin"),
            "capacity_bytes_per_file": 8192,
        },
        KVCRBackendConfigs: lambda: {"framework_regions": [region(label="k"), region(label="v")]},
        KVCRGuardConfig: lambda: {
            "kvcr_service_socket_path": "/tmp/g.sock",
            "guard_index": 0,
            "compatibility_digest": "d",
        },
    }[cls]()


FIELD_JUNK = {  # values beyond JUNK that a field's own type could carry
    "framework_regions": st.lists(
        st.builds(
            region,
            mem_type=st.sampled_from(["DRAM", "VRAM", "HBM", 1]),
            addr=st.one_of(st.integers(-1, 1 << 48), HUGE, st.none()),
            size=st.one_of(st.integers(-1, 8192), st.floats()),
            count=st.one_of(st.integers(-1, 4), st.booleans()),
            stride=st.one_of(st.integers(-1, 9000), st.none()),
            device_Id=st.one_of(st.integers(-2, 2), st.text(max_size=2)),
            label=st.one_of(st.sampled_from(["", "k", "k"]), st.integers(0, 1)),
        ),
        max_size=3,
    ),
    "local_dram": st.sampled_from([None, "x", LocalDramOptions([("", 4096, 4096)])]),
    "g3": st.sampled_from([None, 0, {"paths": ()}]),
    "remote_fw_dram": st.sampled_from([None, RemoteFWDramOptions(), {}]),
}
CLASSES = [
    KVCRConfig,
    LocalDramOptions,
    RemoteFWDramOptions,
    G3Options,
    KVCRBackendConfigs,
    KVCRGuardConfig,
]


@st.composite
def mutated(draw: st.DrawFn, tmp: Path) -> tuple[type, dict, set[str]]:
    cls = draw(st.sampled_from(CLASSES))
    kwargs = valid(cls, tmp)
    names = [f.name for f in dataclasses.fields(cls)]
    chosen = draw(st.sets(st.sampled_from(names), min_size=1, max_size=2))
    for name in sorted(chosen):  # sets of str iterate in hash order: draw in a fixed one
        kwargs[name] = draw(FIELD_JUNK.get(name, JUNK) | JUNK)
    return cls, kwargs, chosen


def usable(obj: object) -> None:
    """Every field of a built config is valid: it rebuilds equal from its own fields, and
    its numbers are usable as such."""
    cls = type(obj)
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    assert cls(**fields) == obj
    for name, value in fields.items():
        if name.endswith("_ms"):  # used as float seconds
            assert type(value) is int and math.isfinite(value / 1000), (name, value)
        if name == "capacity_bytes_per_file":  # a file size
            assert type(value) is int and 0 < value < 2**63, (name, value)


@fuzz(600)
@given(data=st.data())
def test_any_field_value_builds_a_valid_config_or_raises_naming_the_field(
    tmp_path_factory, data
) -> None:
    case("config dict")
    tmp = tmp_path_factory.getbasetemp()
    cls, kwargs, chosen = data.draw(mutated(tmp), "mutated")
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        assert text.startswith(f"{cls.__name__}: "), text[:300]
        assert any(name in text for name in chosen), (chosen, text[:300])
        assert len(text) < 1000, f"unbounded message: {len(text)} characters"
        return
    usable(obj)
    # The object owns its containers: the caller's lists changing later change nothing.
    before = repr(obj)
    for value in kwargs.values():
        if isinstance(value, list):
            value.clear()
    assert repr(obj) == before


# --- guard flags --------------------------------------------------------------------------


SIZE_ITEMS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["1e300", "1e308", "1.8e308", "-0", "0x10", "1_0", " 2 ", "", "nan", "1e-300"]),
    st.integers(-5, 10**6).map(str),
    st.text(max_size=6),
)


@fuzz(800)
@given(text=st.lists(SIZE_ITEMS, min_size=1, max_size=4).map(",".join))
def test_pool_sizes_parse_to_whole_pages_or_an_error_naming_the_flag(text) -> None:
    case("guard flags")
    try:
        sizes = parse_pool_sizes_gb(text)
    except ValueError as exc:
        assert str(exc).startswith("--pool-sizes-gb: "), str(exc)
        assert len(str(exc)) < 400
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        assert all(type(s) is int and s >= page and s % page == 0 for s in sizes)


FLAG_VALUES = {
    "--guard-count": st.one_of(st.integers(-2, 5000).map(str), st.sampled_from(["x", "1.5", ""])),
    "--pool-sizes-gb": st.one_of(
        st.sampled_from(["0.001", "1e300", "0", "a,b"]), st.text(max_size=5)
    ),
    "--compatibility-digest": st.one_of(st.sampled_from(["d", "", "x" * 300]), st.text(max_size=5)),
    "--idle-timeout-s": st.one_of(
        st.floats(allow_nan=True).map(repr), st.sampled_from(["inf", "-1", "0", "x"])
    ),
    "--log-level": st.sampled_from(["INFO", "debug", "WARN", "LOUD", ""]),
}


@fuzz(400)
@given(data=st.data())
def test_serve_flags_give_a_service_config_or_a_flag_error_naming_the_flag(
    tmp_path_factory, data
) -> None:
    case("guard flags")
    tmp = tmp_path_factory.getbasetemp()
    flags = {
        "--socket-path": str(tmp / "g.sock"),
        "--pool-dir": str(tmp),
        "--guard-count": "2",
        "--pool-sizes-gb": "0.001",
        "--compatibility-digest": "d",
    }
    changed = data.draw(
        st.sets(
            st.sampled_from([*FLAG_VALUES, "--socket-path", "--pool-dir"]), min_size=1, max_size=2
        )
    )
    for flag in sorted(changed):
        if flag in ("--socket-path", "--pool-dir"):
            flags[flag] = data.draw(
                st.sampled_from(["", "/nonexistent/x", "/" + "p" * 200, "a\x00b", str(tmp / "f")])
            )
        else:
            flags[flag] = data.draw(FLAG_VALUES[flag])
    argv = [x for flag, value in flags.items() for x in (flag, value) if flag != "--log-level"]
    try:
        args = cli.serve_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2  # argparse: a value of the wrong type, said on stderr
        return
    try:
        config = cli.service_config(args)
    except cli.FlagError as exc:
        assert any(flag in str(exc) for flag in changed), (changed, str(exc))
    else:
        assert isinstance(config.guard_count, int) and config.guard_count >= 1
        assert math.isfinite(config.idle_timeout_s) and config.idle_timeout_s > 0
