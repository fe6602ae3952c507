"""In-process copies of descriptor pairs, on copy threads that never take the GIL.

A NIXL loopback transfer does its copy with CMA (``process_vm_readv`` on our own pid):
the kernel pins and walks every page of both sides. On the 4 KiB pages that shared
mappings have (the adapter's secondary pool, the guard's ``/dev/shm`` pools: no
transparent huge pages for shared memory), about a quarter of the copy's CPU went to the
page walk, and the copy ran at ~0.5x memcpy. A plain ``memmove`` pays none of it.

A copy is posted on the runtime thread as address runs (adjacent descriptors on both sides
merge into one run), and, above ``INLINE_BYTES``, handed to the compiled core's copy pool
(``kvcr/store/_copies.c``): pthreads that take about equal shares of the bytes, copy them
with ``memmove`` and, at a copy's end, write to an eventfd (:meth:`Copier.fileno`) that the
runtime's transfer poller waits on in trio. No copy thread ever takes the GIL: Python copy
threads took it to take each chunk, to copy, and to wake the runtime, and on a busy 2-core
machine each hand-over of the GIL costs tens of microseconds. Small copies are done inline
in ``post`` (``ctypes.memmove`` lets the GIL go for each run): handing them over would cost
more than the copy.

Memory safety is the transports': a copy is terminal (``poll`` says DONE or ERR) only
once no thread touches its memory any more. ``release`` of a copy in flight cancels the
parts not started yet; if a part is being copied, it raises ``TransportError`` and the copy
stays in flight until that part is over (a ``memmove`` cannot be interrupted), which is
what ``Transfers.cancel`` expects of a transfer that could not be cancelled. Every
descriptor is checked against its segments before an address is worked out.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numpy as np

from kvcr.store.native import COPY_DONE, COPY_ERR, CopyPool, NativeJob
from kvcr.transport.base import Descriptors, Segment, TransportError, XferState

INLINE_BYTES = 256 * 1024  # copied in post, on the caller's thread (GIL released)
CHUNK_BYTES = 1024 * 1024  # the least a copy thread is given
SMALL_COPY = 16  # descriptors: fewer are turned into runs without numpy
_memmove = ctypes.memmove  # a CFUNCTYPE: the GIL is released for the call
_STATES = {0: XferState.PROC, COPY_DONE: XferState.DONE, COPY_ERR: XferState.ERR}
_ABANDONED = "cancelled: still running at abandon_timeout_ms"


def copy_threads() -> int:
    """``KVCR_COPY_THREADS`` (default 2, at most the CPUs this process may run on)."""
    raw = os.environ.get("KVCR_COPY_THREADS", "")
    cpus = len(os.sched_getaffinity(0))
    if not raw:
        return max(1, min(2, cpus))
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if not 1 <= threads <= 64:
        raise ValueError(f"KVCR_COPY_THREADS must be an integer from 1 to 64, got {raw!r}")
    return threads


Run = tuple[int, int, int]  # destination address, source address, bytes


class CopyJob:
    """A posted copy: the pool's job (None: copied inline, DONE at once)."""

    __slots__ = ("_native", "what")

    def __init__(self, what: str, native: NativeJob | None) -> None:
        self.what = what
        self._native = native

    def __repr__(self) -> str:
        return f"CopyJob({self.what!r}, {self.state.value})"

    @property
    def state(self) -> XferState:
        return XferState.DONE if self._native is None else _STATES[self._native.state]

    @property
    def error(self) -> str:
        # The pool ends a copy in ERR only when it was cancelled (a memmove cannot fail).
        return _ABANDONED if self.state is XferState.ERR else ""

    def cancel(self) -> bool:
        """Skip the parts not started; True if no part is being copied."""
        return self._native is None or self._native.cancel()


class Copier:
    """Copies over the segments given to :meth:`open` (descriptors numbered in segment
    order, as the runtime numbers them), on ``threads`` copy threads."""

    def __init__(self, name: str, threads: int) -> None:
        self._name = name
        self._threads = threads
        self._pool: CopyPool | None = None
        self._descs = Descriptors([])

    def open(self, segments: Sequence[Segment]) -> None:
        self._descs = Descriptors(segments)
        if self._threads and self._pool is None:
            self._pool = CopyPool(self._threads)

    def fileno(self) -> int | None:
        """An eventfd, readable once a copy handed to the threads became terminal since the
        last :meth:`drain` (None before :meth:`open` or without threads)."""
        return None if self._pool is None else self._pool.fileno()

    def drain(self) -> int:
        """Copies ended since the last drain (clears :meth:`fileno`'s readiness)."""
        return 0 if self._pool is None else self._pool.drain()

    def post(self, dst: Sequence[int], src: Sequence[int], what: str) -> CopyJob:
        if len(dst) != len(src):
            raise TransportError(f"{what}: {len(dst)} destinations for {len(src)} sources")
        if len(dst) <= SMALL_COPY:
            runs, total = self._few_runs(dst, src, what)
            if total <= INLINE_BYTES or self._pool is None:
                for d, s, n in runs:
                    _memmove(d, s, n)
                return CopyJob(what, None)
            packed = np.array(runs, dtype=np.uint64).tobytes()
        else:
            table, total = self._runs(dst, src, what)
            if total <= INLINE_BYTES or self._pool is None:
                for d, s, n in table.tolist():
                    _memmove(d, s, n)
                return CopyJob(what, None)
            packed = table.tobytes()
        parts = max(1, total // CHUNK_BYTES)
        return CopyJob(what, self._pool.post(packed, parts))

    def _size_mismatch(self, what: str, d: np.ndarray, s: np.ndarray, i: int) -> TransportError:
        d_size, s_size = self._descs.size(int(d[i])), self._descs.size(int(s[i]))
        return TransportError(
            f"{what}: descriptor {int(s[i])} ({s_size} bytes) copied into "
            f"{int(d[i])} ({d_size} bytes)"
        )

    def _runs(self, dst: Sequence[int], src: Sequence[int], what: str) -> tuple[np.ndarray, int]:
        """The copy of descriptors ``dst`` from ``src`` as address runs (n x 3 uint64:
        destination, source, bytes): adjacent descriptors on both sides merge into one
        (computed with numpy: no Python step per descriptor)."""
        d, s = np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)
        try:
            d_addr, d_size = self._descs.lookup(d)
            s_addr, s_size = self._descs.lookup(s)
        except IndexError as exc:
            raise TransportError(f"{what}: {exc}") from None
        if (d_size != s_size).any():
            raise self._size_mismatch(what, d, s, int(np.flatnonzero(d_size != s_size)[0]))
        ends = d_addr + d_size
        joined = (d_addr[1:] == ends[:-1]) & (s_addr[1:] == s_addr[:-1] + d_size[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        offsets = np.concatenate(([0], np.cumsum(d_size)))
        lengths = offsets[np.append(starts[1:], len(d))] - offsets[starts]
        table = np.empty((len(starts), 3), dtype=np.uint64)
        table[:, 0], table[:, 1], table[:, 2] = d_addr[starts], s_addr[starts], lengths
        return table, int(offsets[-1])

    def _few_runs(self, dst: Sequence[int], src: Sequence[int], what: str) -> tuple[list[Run], int]:
        """:meth:`_runs` for a few descriptors, without numpy's fixed cost."""
        descs = self._descs
        runs: list[Run] = []
        total = 0
        d_end = s_end = -1
        for d, s in zip(dst, src):
            try:
                da, sa, n, m = descs.addr(d), descs.addr(s), descs.size(d), descs.size(s)
            except IndexError as exc:
                raise TransportError(f"{what}: {exc}") from None
            if m != n:
                raise TransportError(
                    f"{what}: descriptor {s} ({m} bytes) copied into {d} ({n} bytes)"
                )
            if da == d_end and sa == s_end:
                last = runs[-1]
                runs[-1] = (last[0], last[1], last[2] + n)
            else:
                runs.append((da, sa, n))
            d_end, s_end = da + n, sa + n
            total += n
        return runs, total

    def poll(self, job: CopyJob) -> XferState:
        return job.state

    def release(self, job: CopyJob) -> None:
        """Forget a terminal copy; cancel one in flight (TransportError if a part is being
        copied: the copy stays in flight until it is over)."""
        if job.state is XferState.PROC and not job.cancel():
            raise TransportError(f"{job.what}: a copy thread is still copying it")

    def hold(self, held: bool, wait_for: int = 0) -> int:
        """Tests: while ``held``, a copy thread that takes a part waits before copying it
        (counted as being copied); ``wait_for``: until that many threads wait. Returns how
        many do."""
        if self._pool is None:
            raise TransportError(f"copier {self._name}: no copy threads to hold")
        at: int = self._pool.hold(held, wait_for)
        return at

    def close(self) -> None:
        """Stop the threads once the copies queued before are done (they are terminal then)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
