"""Ways a file on disk gets damaged under a running process (for G3 integrity tests)."""

from __future__ import annotations

import os
from pathlib import Path

KINDS = ("delete", "truncate", "replace", "zero")


def damage(path: Path, how: str) -> None:
    """``delete`` it, ``truncate`` it to one page, ``replace`` it at its path by a copy
    (same bytes, another file), or ``zero`` every byte of it."""
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        os.truncate(path, 4096)
    elif how == "replace":
        copy = path.with_suffix(".new")
        copy.write_bytes(path.read_bytes())
        copy.replace(path)
    elif how == "zero":
        with open(path, "r+b") as f:
            f.write(bytes(path.stat().st_size))
    else:
        raise ValueError(f"unknown damage {how!r}")
