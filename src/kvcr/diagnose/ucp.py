"""The UCX library NIXL's UCX plugin runs on, asked directly through ctypes.

The nixl wheel bundles its own libucp (under a hashed name), so the system's ``ucx_info``,
if any, describes another UCX. Its version comes from ``ucp_get_version_string``; the
transports and devices from a UCP context made with the process's UCX configuration (plus
an optional ``NET_DEVICES`` override) and printed by ``ucp_context_print_info``: the same
resources a NIXL agent started here would get.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import re
import tempfile
from pathlib import Path

_RESOURCE = re.compile(r"^#\s+resource\s+\d+\s+:\s+md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)\s*$")
# ucp_params_t.field_mask / .features: the first two 64-bit words of the struct.
_PARAM_FIELD_FEATURES = 1 << 0
_FEATURE_RMA = 1 << 1
_FEATURE_AM = 1 << 6
# Larger than any ucp_params_t: fields past the two set here are zero and not read.
_PARAMS_WORDS = 128


class UcpError(Exception):
    """The UCX library cannot be found, loaded or asked."""


def loaded_libraries() -> list[Path]:
    """The libucp files this process has mapped (after a NIXL UCX backend started)."""
    found: list[Path] = []
    with contextlib.suppress(OSError), open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            # address perms offset dev inode path: only the path has a slash
            path = line.rstrip("\n").partition("/")[2]
            if path and Path("/" + path).name.startswith("libucp"):
                resolved = Path("/" + path).resolve()
                if resolved not in found:
                    found.append(resolved)
    return found


def bundled_library(nixl_module_path: str) -> Path | None:
    """The libucp the nixl wheel ships next to its package (``<package>.libs``)."""
    package = Path(nixl_module_path).parent
    for pattern in (f"{package}.libs/libucp*.so*", f"{package}.libs/**/libucp*.so*"):
        hits = sorted(glob.glob(pattern, recursive=True))
        if hits:
            return Path(hits[0]).resolve()
    return None


class Ucp:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._lib = ctypes.CDLL(str(path))
            self._libc = ctypes.CDLL(None)
        except OSError as exc:
            raise UcpError(f"cannot load {path}: {exc}") from exc
        self._lib.ucp_get_version_string.restype = ctypes.c_char_p
        self._libc.fopen.restype = ctypes.c_void_p
        self._libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
        self._libc.fclose.argtypes = (ctypes.c_void_p,)
        self._lib.ucp_context_print_info.argtypes = (ctypes.c_void_p, ctypes.c_void_p)

    def version(self) -> str:
        raw = self._lib.ucp_get_version_string()
        return raw.decode() if raw else "?"

    def _api(self) -> tuple[int, int]:
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        self._lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        return major.value, minor.value

    def resources(self, net_devices: str | None = None) -> list[str]:
        """``transport/device`` pairs a UCP context gets with the current configuration,
        ``UCX_NET_DEVICES`` replaced by ``net_devices`` when given."""
        config = ctypes.c_void_p()
        status = self._lib.ucp_config_read(None, None, ctypes.byref(config))
        if status != 0:
            raise UcpError(f"ucp_config_read failed (status {status}): check the UCX_* variables")
        try:
            if net_devices is not None:
                status = self._lib.ucp_config_modify(config, b"NET_DEVICES", net_devices.encode())
                if status != 0:
                    raise UcpError(f"UCX refuses NET_DEVICES={net_devices!r} (status {status})")
            params = (ctypes.c_uint64 * _PARAMS_WORDS)()
            params[0] = _PARAM_FIELD_FEATURES
            params[1] = _FEATURE_RMA | _FEATURE_AM
            context = ctypes.c_void_p()
            major, minor = self._api()
            status = self._lib.ucp_init_version(major, minor, params, config, ctypes.byref(context))
        finally:
            self._lib.ucp_config_release(config)
        if status != 0:
            raise UcpError(f"ucp_init failed (status {status}): check the UCX_* variables")
        try:
            return self._print_info(context)
        finally:
            self._lib.ucp_cleanup(context)

    def _print_info(self, context: ctypes.c_void_p) -> list[str]:
        with tempfile.NamedTemporaryFile("r", prefix="kvcr-diagnose-ucp-") as out:
            stream = self._libc.fopen(out.name.encode(), b"w")
            if not stream:
                raise UcpError(f"cannot open {out.name} for UCX's context description")
            try:
                self._lib.ucp_context_print_info(context, stream)
            finally:
                self._libc.fclose(stream)
            text = out.read()
        return [m.group(1) for m in map(_RESOURCE.match, text.splitlines()) if m]
