"""This machine's network interfaces and their addresses (getifaddrs), and which interface
carries a host address. UCX names TCP devices by interface, so this is what
``UCX_NET_DEVICES`` has to name for peers to reach a worker at that address."""

from __future__ import annotations

import ctypes
import ipaddress
import socket

import attrs

_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


class _Sockaddr(ctypes.Structure):
    _fields_ = (("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14))


class _Ifaddrs(ctypes.Structure):
    pass


# struct ifaddrs from <ifaddrs.h>; the union ifa_ifu is one pointer.
_Ifaddrs._fields_ = (
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
)


@attrs.frozen
class Interface:
    name: str
    up: bool
    loopback: bool
    addresses: tuple[str, ...]


def _address(sa: _Sockaddr) -> str | None:
    raw = ctypes.string_at(ctypes.addressof(sa), 28)
    if sa.family == socket.AF_INET:  # sin_port, then sin_addr
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if sa.family == socket.AF_INET6:  # sin6_port, sin6_flowinfo, then sin6_addr
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return None


def interfaces() -> list[Interface]:
    """Every interface with its IPv4 and IPv6 addresses, in the kernel's order."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, tuple[int, list[str]]] = {}
    try:
        node = head
        while ctypes.cast(node, ctypes.c_void_p).value is not None:
            entry = node.contents
            name = (entry.name or b"?").decode(errors="replace")
            addresses = found.setdefault(name, (entry.flags, []))[1]
            if entry.addr:
                address = _address(entry.addr.contents)
                if address is not None:
                    addresses.append(address)
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return [
        Interface(name, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK), tuple(addresses))
        for name, (flags, addresses) in found.items()
    ]


def resolve(host: str) -> list[str]:
    """The addresses ``host`` (a name or an address) stands for; OSError if none."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    seen: dict[str, None] = {}
    for family, *_, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            seen[str(ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))] = None
    return list(seen)


def owner(address: str, among: list[Interface]) -> Interface | None:
    """The interface that has ``address``; loopback addresses (127/8, ::1) belong to the
    loopback interface even when only 127.0.0.1 is configured on it."""
    ip = ipaddress.ip_address(address)
    for interface in among:
        if any(ipaddress.ip_address(a) == ip for a in interface.addresses):
            return interface
    if ip.is_loopback:
        return next((i for i in among if i.loopback), None)
    return None
