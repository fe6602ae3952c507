"""The compiled core's build (``kvcr.store._core``); the project's metadata is pyproject.toml's.

C over CPython's limited API (3.10), so one abi3 wheel serves every Python from
3.10 on. ``KVCR_SANITIZE=1`` builds it with AddressSanitizer and UBSan (``nox -s sanitize``).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

SANITIZE = os.environ.get("KVCR_SANITIZE") == "1"
FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]
if SANITIZE:
    FLAGS = [
        "-O1",
        "-g",
        "-std=c11",
        "-Wall",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
    ]

setup(
    ext_modules=[
        Extension(
            "kvcr.store._core",
            sources=[f"src/kvcr/store/{name}.c" for name in ("_core", "_keytable", "_copies")],
            depends=["src/kvcr/store/_core.h"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
            extra_compile_args=FLAGS,
            extra_link_args=["-fsanitize=address,undefined"] if SANITIZE else [],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
