"""Errors raised by the guard-service client and the control channel (contract section 10)."""

from __future__ import annotations


class KVCRServiceError(RuntimeError):
    """Base of every error that talking to the guard service can raise."""


class KVCRSocketError(KVCRServiceError):
    """The service is unreachable, the connection was lost, or it did not answer in time."""


class KVCRMsgFramingError(KVCRServiceError):
    """A frame on the guard socket is malformed, truncated or too large."""


class KVCRGuardProtocolError(KVCRServiceError):
    """The service refused a request or answered with something the protocol does not allow."""
