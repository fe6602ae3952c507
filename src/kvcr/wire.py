"""What went wrong in a structured wire message, for both of kvcr's protocols (peer
control messages and guard frames): the leaf reasons of a cattrs validation error, each
with the path of the field it is about (``keys[3]``, ``g3.paths[0]``)."""

from __future__ import annotations

import reprlib
from typing import Any

import cattrs
import msgpack


def describe(exc: BaseException, path: str = "") -> str:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        where = f"{path}: " if path else ""
        return f"{where}unexpected field(s) {sorted(exc.extra_fields)[:8]}"
    if isinstance(exc, cattrs.BaseValidationError):
        parts = []
        for inner in exc.exceptions:
            sub = path
            for note in getattr(inner, "__notes__", ()):
                if isinstance(note, cattrs.AttributeValidationNote):
                    sub = f"{path}.{note.name}" if path else note.name
                elif isinstance(note, cattrs.IterableValidationNote):
                    sub = f"{path}[{note.index}]"
            parts.append(describe(inner, sub))
        return "; ".join(parts)
    if isinstance(exc, KeyError):
        return f"missing field {path or reprlib.repr(exc.args[0])}"
    if exc.args and isinstance(exc.args[0], str):
        text = exc.args[0]  # attrs validators add the Attribute as further args
    else:
        text = str(exc) or type(exc).__name__
    if not path:
        return text
    return f"{path}{text}" if text.startswith("[") else f"{path}: {text}"


def strict_scalars(converter: cattrs.Converter, types: tuple[type, ...]) -> None:
    """Structure each of ``types`` only from exactly that type: on the wire an int is an
    int, never a bool, a float or a numeric string."""
    for cls in types:

        def hook(value: Any, _type: type, cls: type = cls) -> Any:
            if type(value) is not cls:
                raise TypeError(f"expected {cls.__name__}, got {type(value).__name__}")
            return value

        converter.register_structure_hook(cls, hook)


def pack(converter: cattrs.Converter, version: int, message: Any) -> bytes:
    """The msgpack map both protocols send: ``{"v": version, "t": TYPE, ...fields}``."""
    body = converter.unstructure(message)
    packed: bytes = msgpack.packb({"v": version, "t": message.TYPE, **body}, use_bin_type=True)
    return packed
