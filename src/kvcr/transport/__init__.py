"""Transports move bytes between registered memory segments: NIXL for real, and an
in-memory fake with fault injection for deterministic tests."""

from kvcr.transport.base import Segment, Transport, TransportError, XferState

__all__ = ["Segment", "Transport", "TransportError", "XferState"]
