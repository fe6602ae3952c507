"""The NIXL transport on its own: segments, loopback copies, and how it refuses bad input."""

from __future__ import annotations

import numpy as np
import pytest

from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.nixl import NixlTransport

pytestmark = pytest.mark.integration


def wait_terminal(transport: NixlTransport, xfer: object) -> XferState:
    for _ in range(100_000):
        state = transport.poll(xfer)
        if state.terminal:
            return state
    raise AssertionError("transfer did not finish")


def test_a_batch_copy_across_segments_is_one_transfer() -> None:
    transport = NixlTransport("transport-test")
    pool = np.zeros(4 * 4096, dtype=np.uint8)
    region = np.random.default_rng(1).integers(0, 256, 8 * 8192, dtype=np.uint8)
    try:
        transport.open_local(
            [
                Segment("pool", pool.ctypes.data, 4096, 4),
                # a strided region: 4096-byte elements every 8192 bytes
                Segment("region", region.ctypes.data, 4096, 8, stride=8192),
            ]
        )
        # Descriptors: pool slots 0..3, then region elements 4..11.
        xfer = transport.post_local_read([0, 1, 2], [4 + 7, 4 + 0, 4 + 3], "test copy")
        assert wait_terminal(transport, xfer) is XferState.DONE
        transport.release(xfer)

        for slot, element in [(0, 7), (1, 0), (2, 3)]:
            src = region[element * 8192 : element * 8192 + 4096]
            assert (pool[slot * 4096 : (slot + 1) * 4096] == src).all()
        assert not pool[3 * 4096 :].any()
    finally:
        transport.close()


def test_an_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match=r"backend 'NOPE' failed to start"):
        NixlTransport("transport-bad-backend", backend="NOPE")


def test_descriptor_indices_out_of_range_are_refused_naming_the_operation() -> None:
    transport = NixlTransport("transport-range")
    pool = np.zeros(2 * 4096, dtype=np.uint8)
    try:
        transport.open_local([Segment("pool", pool.ctypes.data, 4096, 2)])
        with pytest.raises(TransportError, match="deposit op 7"):
            transport.post_local_read([0], [5], "deposit op 7")
    finally:
        transport.close()
