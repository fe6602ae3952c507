"""The compiled core, ``kvcr.store._core`` (``_core.c``), loaded once: there is no slow
fallback. A fallback in pure Python would make every engine call several times slower
without a word, so a missing or broken build stops ``import kvcr`` with what to do."""

from __future__ import annotations

from pathlib import Path

try:
    from kvcr.store import _core
except ImportError as exc:  # pragma: no cover - exercised by tests/unit/store/test_native.py
    where = Path(__file__).with_name("_core.abi3.so")
    raise ImportError(
        f"kvcr: cannot load its compiled core kvcr.store._core ({where}): {exc}. "
        "In a source checkout, build it with `uv sync --reinstall-package kvcr` (it needs a "
        "C compiler and Python's headers: apt install gcc python3-dev); otherwise reinstall "
        "the kvcr wheel for this platform (Linux x86_64, CPython 3.10 or later)."
    ) from exc

CORE_FILE = str(Path(_core.__file__ or "_core").resolve())  # which build was loaded
KeyCore = _core.KeyTable
CopyPool = _core.CopyPool
NativeJob = _core.CopyJob
take_free = _core.take_free
MAX_WIDTH: int = _core.MAX_WIDTH
DIGEST: int = _core.DIGEST
COPY_DONE: int = _core.COPY_DONE
COPY_ERR: int = _core.COPY_ERR

__all__ = [
    "COPY_DONE",
    "COPY_ERR",
    "DIGEST",
    "MAX_WIDTH",
    "CopyPool",
    "KeyCore",
    "NativeJob",
    "take_free",
]
