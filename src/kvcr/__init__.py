"""kvcr: KV Cache Runner, a host-DRAM and file KV-cache tier for LLM inference engines."""

from kvcr.api import KVCR, KVCRBindings
from kvcr.errors import (
    KVCRGuardProtocolError,
    KVCRMsgFramingError,
    KVCRServiceError,
    KVCRSocketError,
)
from kvcr.guard.client import KVCRClient, KVCRPoolHold
from kvcr.hints import ROUTER_HINT_CAPABILITIES, ROUTER_HINT_KEY
from kvcr.telemetry import (
    DURATION_METRIC,
    STATE_METRIC,
    TRANSFER_BLOCKS_METRIC,
    TRANSFER_BYTES_METRIC,
)

__all__ = [
    "DURATION_METRIC",
    "KVCR",
    "ROUTER_HINT_CAPABILITIES",
    "ROUTER_HINT_KEY",
    "STATE_METRIC",
    "TRANSFER_BLOCKS_METRIC",
    "TRANSFER_BYTES_METRIC",
    "KVCRBindings",
    "KVCRClient",
    "KVCRGuardProtocolError",
    "KVCRMsgFramingError",
    "KVCRPoolHold",
    "KVCRServiceError",
    "KVCRSocketError",
]
