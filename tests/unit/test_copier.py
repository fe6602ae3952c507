"""Native in-process copies (kvcr.transport.copier over the compiled core's copy pool):
descriptor pairs copied byte-exact by copy threads that say when a copy ended on an eventfd,
small copies inline, bad descriptors refused naming the operation, and a copy in flight
never reported over (or cancelled) while a thread may still touch its memory (the pool's
gate, ``Copier.hold``, keeps threads inside a copy for as long as a test needs)."""

from __future__ import annotations

import select
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcr.transport.base import Segment, TransportError, XferState
from kvcr.transport.copier import INLINE_BYTES, Copier, CopyJob

BLOCK = 512 * 1024  # above INLINE_BYTES: one block goes to the copy threads
COUNT = 8


@pytest.fixture
def memory() -> tuple[np.ndarray, np.ndarray]:
    pool = np.zeros(BLOCK * COUNT, dtype=np.uint8)
    region = np.random.default_rng(3).integers(0, 255, BLOCK * COUNT, dtype=np.uint8)
    return pool, region


@pytest.fixture
def copier(memory: tuple[np.ndarray, np.ndarray]) -> Iterator[Copier]:
    pool, region = memory
    c = Copier("test", threads=2)
    c.open(
        [
            Segment("pool", pool.ctypes.data, BLOCK, COUNT),  # descriptors 0..7
            Segment("region", region.ctypes.data, BLOCK, COUNT),  # descriptors 8..15
        ]
    )
    yield c
    c.close()


def wait(job: CopyJob, timeout: float = 10.0) -> XferState:
    deadline = time.monotonic() + timeout
    while job.state is XferState.PROC:
        assert time.monotonic() < deadline, f"{job} did not end"
        time.sleep(0.001)
    return job.state


def element(array: np.ndarray, i: int) -> bytes:
    return array[i * BLOCK : (i + 1) * BLOCK].tobytes()


def test_descriptor_pairs_are_copied_byte_exact_by_the_copy_threads(memory, copier) -> None:
    pool, region = memory
    fd = copier.fileno()
    assert fd is not None and copier.drain() == 0

    job = copier.post([0, 1, 2, 5], [8 + 7, 8 + 0, 8 + 1, 8 + 3], "deposit op 1")

    assert wait(job) is XferState.DONE
    # The poller is woken by the eventfd, not left to its next poll.
    assert select.select([fd], [], [], 5)[0] == [fd]
    assert copier.drain() == 1 and select.select([fd], [], [], 0)[0] == []
    assert [element(pool, i) for i in (0, 1, 2, 5)] == [element(region, i) for i in (7, 0, 1, 3)]
    assert element(pool, 3) == bytes(BLOCK)  # nothing else written


def test_a_copy_larger_than_a_thread_share_is_split_and_still_exact(memory, copier) -> None:
    pool, region = memory
    # Adjacent on both sides: one run of 8 blocks, cut between the two threads mid-block.
    job = copier.post(list(range(COUNT)), [8 + i for i in range(COUNT)], "deliver op 2")

    assert wait(job) is XferState.DONE
    assert pool.tobytes() == region.tobytes()


def test_a_small_copy_is_done_inline_before_post_returns() -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    c = Copier("inline", threads=1)
    c.open([Segment("dst", dst.ctypes.data, 1024, 4), Segment("src", src.ctypes.data, 1024, 4)])
    try:
        assert INLINE_BYTES >= 4096
        job = c.post([0, 1, 2, 3], [4, 5, 6, 7], "deposit op 3")
        assert job.state is XferState.DONE
        assert dst.tobytes() == src.tobytes()
    finally:
        c.close()


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        ([0, 1], [8], "deposit op 4: 2 destinations for 1 sources"),
        ([0], [16], "deposit op 4: descriptor 16 is not one of 16"),
        ([-1], [8], "deposit op 4: descriptor -1 is not one of 16"),
        # Many descriptors are checked at once (numpy), with the same message.
        (
            [*range(8), 99, *range(8)],
            [*range(8, 16)] * 2 + [8],
            "deposit op 4: descriptor 99 is not one of 16",
        ),
    ],
)
def test_bad_descriptors_are_refused_naming_the_operation(copier, dst, src, message) -> None:
    with pytest.raises(TransportError) as raised:
        copier.post(dst, src, "deposit op 4")
    assert str(raised.value) == message


def test_descriptors_of_different_sizes_are_refused() -> None:
    a = np.zeros(8192, dtype=np.uint8)
    c = Copier("sizes", threads=1)
    c.open(
        [Segment("small", a.ctypes.data, 1024, 4), Segment("big", a.ctypes.data + 4096, 2048, 2)]
    )
    try:
        with pytest.raises(TransportError, match=r"descriptor 4 \(2048 bytes\) copied into 0"):
            c.post([0], [4], "fetch op 5")
        with pytest.raises(TransportError, match=r"descriptor 4 \(2048 bytes\) copied into 0"):
            c.post([0] * 17, [4] * 17, "fetch op 5")  # the numpy path
    finally:
        c.close()


def test_a_copy_being_copied_cannot_be_cancelled_and_ends_only_when_its_thread_is_done(
    memory, copier
) -> None:
    pool, region = memory
    copier.hold(True)
    job = copier.post([0], [8], "deliver op 6")
    assert copier.hold(True, wait_for=1) == 1  # a thread took it, and waits to copy it

    with pytest.raises(TransportError, match="deliver op 6: a copy thread is still copying it"):
        copier.release(job)
    time.sleep(0.01)
    assert job.state is XferState.PROC  # still touching the memory: not over

    copier.hold(False)
    assert wait(job) is XferState.ERR  # over now, and not a success: it was given up
    assert "abandon_timeout_ms" in job.error
    assert element(pool, 0) == element(region, 0)  # the running part finished its copy


def test_a_copy_not_started_yet_is_cancelled_at_once(memory, copier) -> None:
    copier.hold(True)
    # Both threads inside the first copy's two parts; the second copy waits in the queue.
    first = copier.post(list(range(4)), [8 + i for i in range(4)], "deposit op 7")
    assert copier.hold(True, wait_for=2) == 2
    second = copier.post([6], [14], "deposit op 8")

    copier.release(second)  # nothing of it runs: cancelled, and nothing will touch it

    copier.hold(False)
    assert wait(first) is XferState.DONE
    assert wait(second) is XferState.ERR
    assert element(memory[0], 6) == bytes(BLOCK)  # never written


@settings(max_examples=60, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 63), st.integers(0, 63)), max_size=48, unique_by=lambda p: p[0]
    )
)
def test_any_descriptor_pairs_few_or_many_are_copied_byte_exact(pairs) -> None:
    # Beyond SMALL_COPY descriptors the runs are worked out with numpy: same bytes.
    pool = np.zeros(1024 * 64, dtype=np.uint8)
    region = np.random.default_rng(len(pairs)).integers(0, 255, 1024 * 64, dtype=np.uint8)
    c = Copier("any", threads=2)
    c.open(
        [Segment("pool", pool.ctypes.data, 1024, 64), Segment("r", region.ctypes.data, 1024, 64)]
    )
    try:
        job = c.post([d for d, _ in pairs], [64 + s for _, s in pairs], "deposit op 6")
        assert wait(job) is XferState.DONE
        for d, s in pairs:
            assert (
                pool[d * 1024 : (d + 1) * 1024].tobytes()
                == region[s * 1024 : (s + 1) * 1024].tobytes()
            )
    finally:
        c.close()


def strided_memory(count: int, size: int, pitch: int) -> tuple[np.ndarray, np.ndarray]:
    """A pool of ``count`` elements and a region whose elements are ``pitch`` apart (an
    engine's layer-interleaved layout): the gaps between them must never be written."""
    pool = np.zeros(count * size, dtype=np.uint8)
    region = np.random.default_rng(count).integers(0, 255, count * pitch, dtype=np.uint8)
    return pool, region


def test_many_blocks_of_one_segment_are_copied_by_the_threads_byte_exact() -> None:
    # 64 x 16 KiB = 1 MiB, above INLINE_BYTES: runs copied on the two copy threads,
    # gathered from a strided region into scattered pool slots, and back.
    size, pitch, count = 16 * 1024, 20 * 1024, 64
    pool, region = strided_memory(count, size, pitch)
    c = Copier("rows", threads=2)
    c.open(
        [
            Segment("pool", pool.ctypes.data, size, count),
            Segment("r", region.ctypes.data, size, count, pitch),
        ]
    )
    try:
        slots = np.random.default_rng(1).permutation(count)
        deposit = c.post(slots.tolist(), [count + i for i in range(count)], "deposit op 9")
        assert wait(deposit) is XferState.DONE
        # Copied by a copy thread, not inline: its end was written to the eventfd. (Its
        # state may read DONE at once: the threads never wait for the GIL.)
        assert c.drain() == 1
        for i, slot in enumerate(slots):
            assert (
                pool[slot * size : (slot + 1) * size].tobytes()
                == region[i * pitch : i * pitch + size].tobytes()
            )

        gaps = [region[i * pitch + size : (i + 1) * pitch].tobytes() for i in range(count)]
        back = np.random.default_rng(2).permutation(count)
        deliver = c.post([count + i for i in back], slots.tolist(), "deliver op 10")
        assert wait(deliver) is XferState.DONE
        for i, slot in zip(back, slots):
            assert (
                region[i * pitch : i * pitch + size].tobytes()
                == pool[slot * size : (slot + 1) * size].tobytes()
            )
        assert [region[i * pitch + size : (i + 1) * pitch].tobytes() for i in range(count)] == gaps
    finally:
        c.close()


def test_a_copy_of_many_blocks_being_copied_ends_only_when_its_threads_are_done() -> None:
    size, count = 64 * 1024, 32  # 2 MiB: two parts, one per thread
    pool, region = strided_memory(count, size, size)
    c = Copier("rows-cancel", threads=2)
    c.open(
        [
            Segment("pool", pool.ctypes.data, size, count),
            Segment("r", region.ctypes.data, size, count),
        ]
    )
    try:
        c.hold(True)
        job = c.post(list(range(count)), [count + i for i in range(count)], "deliver op 11")
        assert c.hold(True, wait_for=2) == 2
        with pytest.raises(
            TransportError, match="deliver op 11: a copy thread is still copying it"
        ):
            c.release(job)
        assert job.state is XferState.PROC
        c.hold(False)
        assert wait(job) is XferState.ERR
        assert pool.tobytes() == region.tobytes()  # both running parts finished their copy
    finally:
        c.close()


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 127), st.integers(0, 127)),
        min_size=17,
        max_size=96,
        unique_by=lambda p: p[0],
    )
)
def test_blocks_from_several_segments_are_copied_byte_exact_as_runs(pairs) -> None:
    # Destinations 0..63 in one segment, 64..127 in another: not one segment's rows.
    a = np.zeros(1024 * 64, dtype=np.uint8)
    b = np.zeros(1024 * 64, dtype=np.uint8)
    src = np.random.default_rng(len(pairs)).integers(0, 255, 1024 * 128, dtype=np.uint8)
    c = Copier("mixed", threads=2)
    c.open(
        [
            Segment("a", a.ctypes.data, 1024, 64),
            Segment("b", b.ctypes.data, 1024, 64),
            Segment("src", src.ctypes.data, 1024, 128),
        ]
    )
    try:
        job = c.post([d for d, _ in pairs], [128 + s for _, s in pairs], "deposit op 12")
        assert wait(job) is XferState.DONE
        both = np.concatenate((a, b))
        for d, s in pairs:
            assert (
                both[d * 1024 : (d + 1) * 1024].tobytes()
                == src[s * 1024 : (s + 1) * 1024].tobytes()
            )
    finally:
        c.close()
