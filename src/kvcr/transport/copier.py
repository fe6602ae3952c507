"""In-process copies of descriptor pairs on copy threads, off the GIL.

A NIXL loopback transfer does its copy with CMA (``process_vm_readv`` on our own pid):
the kernel pins and walks every page of both sides. On the 4 KiB pages that shared
mappings have (the adapter's secondary pool, the guard's ``/dev/shm`` pools: no
transparent huge pages for shared memory), about a quarter of the copy's CPU went to the
page walk, and the copy ran at ~0.5x memcpy. A plain ``memmove`` pays none of it.

A copy is posted on the runtime thread and, above ``INLINE_BYTES``, cut into about equal
chunks, one per copy thread, so the copy never runs on the runtime or the engine thread.
Small copies are done inline in ``post``: queueing them would cost more than the copy.
A chunk is one of two kinds:

- *rows*: many descriptors of one segment copied to many of another, elements of at most
  ``ROW_BYTES``; each segment is a 2-D numpy view (one row per element), and the chunk is
  one fancy-indexed numpy copy, which releases the GIL for the whole chunk. A thousand
  4 KiB blocks took ~3 ms as ``memmove`` calls (each retakes the GIL, and two copy threads
  ping-pong it) and take ~0.3 ms as rows;
- *runs*: anything else (few descriptors, large elements, several segments): address runs
  (adjacent descriptors on both sides merge into one run), one ``memmove`` each (``ctypes``
  releases the GIL for each; at 64 KiB and more that costs nothing).

Memory safety is the transports': a copy is terminal (``poll`` says DONE or ERR) only
once no thread touches its memory any more. ``release`` of a copy in flight cancels the
chunks not started yet; if a chunk is running, it raises ``TransportError`` and the copy
stays in flight until that chunk is over (a ``memmove`` cannot be interrupted), which is
what ``Transfers.cancel`` expects of a transfer that could not be cancelled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvcr.transport.base import Descriptors, Segment, TransportError, XferState

INLINE_BYTES = 256 * 1024  # copied in post, on the caller's thread (GIL released)
CHUNK_BYTES = 1024 * 1024  # the least a copy thread is given
SMALL_COPY = 16  # descriptors: fewer are turned into runs without numpy
ROW_BYTES = 1024 * 1024  # elements up to this are copied as rows; larger as runs
_memmove = ctypes.memmove  # a CFUNCTYPE: the GIL is released for the call


def _copy_rows(dst: np.ndarray, d: np.ndarray, src: np.ndarray, s: np.ndarray) -> None:
    """Rows ``s`` of ``src`` into rows ``d`` of ``dst`` (indices checked in range before),
    with numpy, which holds no GIL while it copies. A side whose rows are consecutive is
    sliced, so only the other is gathered or scattered, with no temporary."""
    if _consecutive(d) and dst.flags.c_contiguous:
        # mode="clip": "raise" would buffer ``out`` (a copy of it) to undo a bad index.
        np.take(src, s, axis=0, out=dst[d[0] : d[0] + len(d)], mode="clip")
    elif _consecutive(s):
        dst[d] = src[s[0] : s[0] + len(s)]
    else:
        dst[d] = src[s]


def _consecutive(rows: np.ndarray) -> bool:
    return int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool((np.diff(rows) == 1).all())


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


class Runs:
    """A chunk of address runs, one ``memmove`` each."""

    __slots__ = ("runs",)

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs

    def copy(self) -> None:
        for d, s, n in self.runs:
            _memmove(d, s, n)


class Rows:
    """A chunk of rows: ``src[s]`` into ``dst[d]``, one numpy call."""

    __slots__ = ("d", "dst", "s", "src")

    def __init__(self, dst: np.ndarray, d: np.ndarray, src: np.ndarray, s: np.ndarray) -> None:
        self.dst, self.d, self.src, self.s = dst, d, src, s

    def copy(self) -> None:
        _copy_rows(self.dst, self.d, self.src, self.s)


Chunk = Runs | Rows


class CopyJob:
    """A posted copy. ``state`` is written by the copy threads; ``poll`` reads it."""

    __slots__ = ("_left", "_lock", "cancelled", "error", "running", "state", "what")

    def __init__(self, what: str, chunks: int) -> None:
        self.what = what
        self.state = XferState.PROC if chunks else XferState.DONE
        self.error = ""
        self.cancelled = False
        self.running = 0  # chunks a thread is copying right now
        self._left = chunks
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CopyJob({self.what!r}, {self.state.value})"

    def begin(self) -> bool:
        """A thread takes a chunk: False if the copy was cancelled meanwhile."""
        with self._lock:
            if self.cancelled:
                return False
            self.running += 1
            return True

    def end(self, ran: bool, error: str = "") -> bool:
        """A chunk is over (``ran``: it was copied, not skipped). True if it was the last."""
        with self._lock:
            if ran:
                self.running -= 1
            self.error = self.error or error
            self._left -= 1
            if self._left:
                return False
            failed = self.cancelled or self.error
            self.state = XferState.ERR if failed else XferState.DONE
            return True

    def cancel(self) -> bool:
        """Skip the chunks not started; True if no chunk is running (nothing touches the
        memory once the chunks already queued have been skipped)."""
        with self._lock:
            self.cancelled = True
            self.error = self.error or "cancelled: still running at abandon_timeout_ms"
            return self.running == 0


class Copier:
    """Copy threads over the segments given to :meth:`open` (descriptors numbered in
    segment order, as the runtime numbers them)."""

    def __init__(self, name: str, threads: int) -> None:
        self._name = name
        self._threads_wanted = threads
        self._threads: list[threading.Thread] = []
        self._chunks: queue.SimpleQueue[tuple[CopyJob, Chunk] | None] = queue.SimpleQueue()
        self._descs = Descriptors([])
        self._rows: list[np.ndarray | None] = []  # per segment: its elements as rows
        self._on_done: Callable[[], None] | None = None

    def open(self, segments: Sequence[Segment]) -> None:
        self._descs = Descriptors(segments)
        self._rows = [_rows_view(seg) for seg in segments]
        for i in range(self._threads_wanted):
            thread = threading.Thread(
                target=self._work, name=f"kvcr-copy-{i}-{self._name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def notify_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a copy thread) when a queued copy becomes terminal."""
        self._on_done = callback

    def post(self, dst: Sequence[int], src: Sequence[int], what: str) -> CopyJob:
        chunks, total = self._chunked(dst, src, what)
        if total <= INLINE_BYTES or not self._threads:
            for chunk in chunks:
                chunk.copy()
            return CopyJob(what, 0)
        job = CopyJob(what, len(chunks))
        for chunk in chunks:
            self._chunks.put((job, chunk))
        return job

    def _chunked(
        self, dst: Sequence[int], src: Sequence[int], what: str
    ) -> tuple[list[Chunk], int]:
        """The copy cut into chunks for the copy threads (one up to ``INLINE_BYTES``, or if
        there are no threads), and its bytes."""
        if len(dst) != len(src):
            raise TransportError(f"{what}: {len(dst)} destinations for {len(src)} sources")
        if len(dst) <= SMALL_COPY:
            runs, total = self._few_runs(dst, src, what)
            return [Runs(r) for r in _split(runs, total, self._parts(total))], total
        d, s = np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)
        try:
            d_seg, d_rows = self._descs.locate(d)
            s_seg, s_rows = self._descs.locate(s)
        except IndexError as exc:
            raise TransportError(f"{what}: {exc}") from None
        if d_seg.min() == d_seg.max() and s_seg.min() == s_seg.max():
            dst_rows, src_rows = self._rows[int(d_seg[0])], self._rows[int(s_seg[0])]
            if dst_rows is not None and src_rows is not None:
                if dst_rows.shape[1] != src_rows.shape[1]:
                    raise self._size_mismatch(what, d, s, 0)
                total = len(d) * dst_rows.shape[1]
                parts = self._parts(total)
                cuts = zip(np.array_split(d_rows, parts), np.array_split(s_rows, parts))
                return [Rows(dst_rows, dc, src_rows, sc) for dc, sc in cuts], total
        runs, total = self._runs(
            d, s, self._descs.at(d_seg, d_rows), self._descs.at(s_seg, s_rows), what
        )
        return [Runs(r) for r in _split(runs, total, self._parts(total))], total

    def _parts(self, total: int) -> int:
        """Chunks for a copy of ``total`` bytes."""
        if total <= INLINE_BYTES or not self._threads:
            return 1
        return min(len(self._threads), max(1, total // CHUNK_BYTES))

    def _size_mismatch(self, what: str, d: np.ndarray, s: np.ndarray, i: int) -> TransportError:
        d_size, s_size = self._descs.size(int(d[i])), self._descs.size(int(s[i]))
        return TransportError(
            f"{what}: descriptor {int(s[i])} ({s_size} bytes) copied into "
            f"{int(d[i])} ({d_size} bytes)"
        )

    def _runs(
        self,
        d: np.ndarray,
        s: np.ndarray,
        dst: tuple[np.ndarray, np.ndarray],
        src: tuple[np.ndarray, np.ndarray],
        what: str,
    ) -> tuple[list[Run], int]:
        """The copy of descriptors ``d`` from ``s`` (``dst``, ``src``: their addresses and
        sizes) as address runs: adjacent descriptors on both sides merge into one run
        (computed with numpy: no Python step per descriptor)."""
        (d_addr, d_size), (s_addr, s_size) = dst, src
        if (d_size != s_size).any():
            raise self._size_mismatch(what, d, s, int(np.flatnonzero(d_size != s_size)[0]))
        ends = d_addr + d_size
        joined = (d_addr[1:] == ends[:-1]) & (s_addr[1:] == s_addr[:-1] + d_size[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        offsets = np.concatenate(([0], np.cumsum(d_size)))
        lengths = offsets[np.append(starts[1:], len(d))] - offsets[starts]
        runs = list(zip(d_addr[starts].tolist(), s_addr[starts].tolist(), lengths.tolist()))
        return runs, int(offsets[-1])

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
        """Forget a terminal copy; cancel one in flight (TransportError if a chunk is being
        copied: the copy stays in flight until it is over)."""
        if job.state is XferState.PROC and not job.cancel():
            raise TransportError(f"{job.what}: a copy thread is still copying it")

    def _work(self) -> None:
        while (item := self._chunks.get()) is not None:
            job, chunk = item
            ran = job.begin()
            error = ""
            if ran:
                try:
                    chunk.copy()
                except Exception as exc:  # ctypes argument errors; a bad address is a crash
                    error = f"{job.what}: copy failed: {exc!r}"
            if job.end(ran, error) and self._on_done is not None:
                # Raises once the runtime's loop is gone: nobody waits any more.
                with contextlib.suppress(Exception):
                    self._on_done()

    def close(self) -> None:
        """Stop the threads once the copies queued before are done (they are terminal then)."""
        for _ in self._threads:
            self._chunks.put(None)
        for thread in self._threads:
            thread.join(timeout=1.0)  # bounded: a copy stuck in the kernel must not hang close
        self._threads = []
        self._rows = []


def _rows_view(seg: Segment) -> np.ndarray | None:
    """``seg``'s elements as the rows of a 2-D uint8 array over its memory (nothing is
    read or allocated: the memory stays the owner's), or None if rows do not pay there."""
    if seg.count == 0 or seg.element_size > ROW_BYTES or seg.pitch < seg.element_size:
        return None
    memory = (ctypes.c_uint8 * seg.span).from_address(seg.addr)
    flat = np.frombuffer(memoryview(memory), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(
        flat, shape=(seg.count, seg.element_size), strides=(seg.pitch, 1)
    )


def _split(runs: list[Run], total: int, parts: int) -> list[list[Run]]:
    """``runs`` cut into ``parts`` lists of about ``total / parts`` bytes each (a run may be
    cut in two)."""
    if parts <= 1:
        return [runs]
    share = -(-total // parts)
    chunks: list[list[Run]] = [[]]
    room = share
    for run in runs:
        d, s, n = run
        while n > room and len(chunks) < parts:
            if room:
                chunks[-1].append((d, s, room))
                d, s, n = d + room, s + room, n - room
            chunks.append([])
            room = share
        chunks[-1].append((d, s, n))
        room -= n
    return [c for c in chunks if c]
