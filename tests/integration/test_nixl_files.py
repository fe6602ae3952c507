"""G3's data path on real NIXL (POSIX backend): host blocks to striped G3 file slots and
back, byte-exact; bad descriptors and backends are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvcr.g3.files import G3Files
from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.nixl_files import NixlFileTransport

pytestmark = pytest.mark.integration

BLOCK = 64 * 1024


def wait(t: NixlFileTransport, xfer: object) -> XferState:
    while (state := t.poll(xfer)) is XferState.PROC:
        pass
    t.release(xfer)
    return state


def test_blocks_go_to_striped_file_slots_and_come_back_byte_exact(tmp_path) -> None:
    files = G3Files((tmp_path / "a" / "g3", tmp_path / "b" / "g3"), 8 * BLOCK, BLOCK)
    src = np.random.default_rng(1).integers(0, 255, 6 * BLOCK, dtype=np.uint8)
    dst = np.zeros(6 * BLOCK, dtype=np.uint8)
    t = NixlFileTransport("g3-test", "POSIX", {})
    try:
        t.open(
            [Segment("src", src.ctypes.data, BLOCK, 6), Segment("dst", dst.ctypes.data, BLOCK, 6)],
            [(f.fd, f.size) for f in files.files],
            files.slot_rows(),
        )
        slots = files.positions([3, 0, 7, 12, 5, 9])
        assert wait(t, t.post("WRITE", list(range(6)), slots, "store")) is XferState.DONE
        assert wait(t, t.post("READ", list(range(6, 12)), slots, "fill")) is XferState.DONE
        assert np.array_equal(src, dst)
        # The bytes are where the stripe says: slot 3 is the second slot of file 1.
        with open(files.files[1].path, "rb") as f:
            f.seek(files.area + BLOCK)
            assert f.read(BLOCK) == src[:BLOCK].tobytes()
    finally:
        t.close()
        files.close()


def test_an_unknown_file_backend_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match="G3: NIXL file backend 'NOPE' failed to start"):
        NixlFileTransport("g3-bad", "NOPE", {})
