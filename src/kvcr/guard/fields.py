"""The checked fields of the guard's wire messages (``protocol.py``): attrs validators that
run on construction, so that a message built in code and one decoded from a frame obey the
same rules. Each names the field and what was wrong; an int is an int (not a bool or a
string), and every size and string is bounded.
"""

from __future__ import annotations

import reprlib
from typing import Any

import attrs

from kvcr.config import MAX_GROUPS

U64 = 1 << 64
MAX_POOLS = 64
MAX_NAME = 256
MAX_PATH = 4096
MAX_BACKEND_OPTIONS = 64


def int_in(lo: int, hi: int) -> Any:
    """An int (not a bool) in [lo, hi]."""

    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        if type(value) is not int:
            raise TypeError(f"{attr.name}: expected int, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{attr.name} must be in [{lo}, {hi}], got {value}")

    return check


def optional_int(lo: int, hi: int) -> Any:
    inner = int_in(lo, hi)

    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        if value is not None:
            inner(inst, attr, value)

    return check


def check_str(name: str, value: Any, lo: int, hi: int, forbid: str = "") -> None:
    if type(value) is not str:
        raise TypeError(f"{name}: expected str, got {type(value).__name__}")
    if not lo <= len(value) <= hi:
        raise ValueError(f"{name} must be {lo}..{hi} characters, got {len(value)}")
    for ch in forbid:
        if ch in value:
            raise ValueError(f"{name} must not contain {ch!r}")


def str_of(lo: int, hi: int, forbid: str = "") -> Any:
    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        check_str(attr.name, value, lo, hi, forbid)

    return check


def boolean(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if type(value) is not bool:
        raise TypeError(f"{attr.name}: expected bool, got {type(value).__name__}")


def one_of(choices: tuple[str, ...]) -> Any:
    def check(_inst: object, attr: attrs.Attribute, value: Any) -> None:
        if value not in choices or type(value) is not str:
            raise ValueError(
                f"{attr.name} must be one of {list(choices)}, got {reprlib.repr(value)}"
            )

    return check


def list_of(item: Any, lo: int, hi: int) -> Any:
    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        if type(value) is not list:
            raise TypeError(f"{attr.name}: expected list, got {type(value).__name__}")
        if not lo <= len(value) <= hi:
            raise ValueError(f"{attr.name} must have {lo}..{hi} entries, got {len(value)}")
        for i, x in enumerate(value):
            item(f"{attr.name}[{i}]", x)

    return check


def pool_entry(width: int) -> Any:
    """(name, size) or (name, offset, size): name 0..256 chars without ':' (the empty name is
    the single unnamed pool), size > 0."""

    def check(name: str, value: Any) -> None:
        if type(value) is not tuple or len(value) != width:
            raise TypeError(f"{name}: expected a {width}-tuple, got {reprlib.repr(value)}")
        check_str(f"{name}[0]", value[0], 0, MAX_NAME, forbid=":")
        for j, x in enumerate(value[1:], start=1):
            if type(x) is not int:
                raise TypeError(f"{name}[{j}]: expected int, got {type(x).__name__}")
            lo = 1 if j == width - 1 else 0  # sizes are positive, offsets may be 0
            if not lo <= x < U64:
                raise ValueError(f"{name}[{j}] must be in [{lo}, 2**64), got {x}")

    return check


def pools(width: int, lo: int) -> Any:
    """A list of pool entries with unique names."""
    each = list_of(pool_entry(width), lo, MAX_POOLS)

    def check(inst: object, attr: attrs.Attribute, value: Any) -> None:
        each(inst, attr, value)
        names = [entry[0] for entry in value]
        if len(set(names)) != len(names):
            raise ValueError(f"{attr.name}: pool names must be unique")

    return check


def to_tuples(value: Any) -> Any:
    """Accept lists for pool entries (as they come off the wire) and store tuples."""
    if type(value) is list:
        return [tuple(x) if type(x) is list else x for x in value]
    return value


def each_str(lo: int, hi: int) -> Any:
    return lambda name, x: check_str(name, x, lo, hi)


def str_map(_inst: object, attr: attrs.Attribute, value: Any) -> None:
    if type(value) is not dict:
        raise TypeError(f"{attr.name}: expected map, got {type(value).__name__}")
    if len(value) > MAX_BACKEND_OPTIONS:
        raise ValueError(f"{attr.name} has {len(value)} entries, at most {MAX_BACKEND_OPTIONS}")
    for k, v in value.items():
        check_str(f"{attr.name} key", k, 1, MAX_NAME)
        check_str(f"{attr.name}[{k!r}]", v, 0, MAX_PATH)


u64 = int_in(0, U64 - 1)
pid_field = int_in(1, (1 << 31) - 1)
group_index = int_in(0, MAX_GROUPS - 1)
port_field = int_in(0, 65535)
bound_port = int_in(1, 65535)
