"""Pool-group files of the guard service (contract section 10).

A group is one file ``kvcr-group-<index>.pool`` in ``--pool-dir``, laid out as
``[100 MiB recovery journal][pool 0][pool 1]...`` with every region page-aligned. The file
is created exclusively, owner-only (0600), and its blocks are reserved up front with
``posix_fallocate`` so that a full disk is an error at startup and never a SIGBUS on a later
page fault.

Liveness is the file lock: every holder of a group keeps a shared ``flock``. At startup,
:func:`reclaim_orphans` deletes the group files nobody holds (left by a dead service) and
leaves the ones a live process still holds.

Neither the hold nor the mappings reach forked children: the lock fd is closed in the child
right after ``fork`` (without unlocking, which would drop the parent's lock), the mapping is
``MADV_DONTFORK``, and the mapping's own fd is a separate open file description carrying no
lock. Everything is ``O_CLOEXEC``, so nothing reaches an ``exec``'d program either.
"""

from __future__ import annotations

import errno
import fcntl
import math
import mmap
import os
import reprlib
import stat
import weakref
from collections.abc import Iterable
from pathlib import Path

import attrs

JOURNAL_BYTES = 100 * 1024 * 1024
GROUP_FILE_GLOB = "kvcr-group-*.pool"
POOL_SIZES_FLAG = "--pool-sizes-gb"
GIB = 2**30


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _round_to_page(size: int) -> int:
    page = page_size()
    return size - size % page


def group_file_path(directory: Path, index: int) -> Path:
    return Path(directory) / f"kvcr-group-{index}.pool"


def _regions(regions: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple(regions)


@attrs.frozen
class GroupLayout:
    """Where each region lives in a group file; all offsets and sizes are page multiples.

    ``journal`` and each entry of ``pools`` are ``(offset, size)`` in bytes.
    """

    journal: tuple[int, int]
    pools: tuple[tuple[int, int], ...] = attrs.field(converter=_regions)
    total_size: int


def plan_group(pool_sizes: list[int]) -> GroupLayout:
    """Lay out the journal then the pools in order, each size rounded down to the page.

    Raises ValueError (naming the pool index and size) for a pool below one page, and for an
    empty pool list.
    """
    if not pool_sizes:
        raise ValueError("a pool group needs at least one pool")
    page = page_size()
    journal = (0, JOURNAL_BYTES)  # 100 MiB is a multiple of every Linux page size
    offset = JOURNAL_BYTES
    pools: list[tuple[int, int]] = []
    for index, size in enumerate(pool_sizes):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"pool {index}: size {size!r} is not an integer byte count")
        rounded = _round_to_page(size)
        if rounded < page:
            raise ValueError(f"pool {index}: size {size} bytes is below one page ({page} bytes)")
        pools.append((offset, rounded))
        offset += rounded
    return GroupLayout(journal=journal, pools=pools, total_size=offset)


def parse_pool_sizes_gb(text: str) -> list[int]:
    """Parse ``--pool-sizes-gb``: comma-separated positive finite GiB (fractions allowed).

    Returns byte sizes, each rounded down to the page. Raises ValueError naming the flag and
    the bad item for an empty list or item, a non-number, zero, a negative, nan/inf, or a
    size below one page.
    """
    if not text.strip():
        raise ValueError(
            f"{POOL_SIZES_FLAG}: expected comma-separated sizes in GiB, got {reprlib.repr(text)}"
        )
    page = page_size()
    sizes: list[int] = []
    for index, raw in enumerate(text.split(",")):
        item = raw.strip()
        where = f"{POOL_SIZES_FLAG}: item {index} ({reprlib.repr(raw)})"
        try:
            gib = float(item)
        except ValueError:
            raise ValueError(f"{where} is not a number") from None
        if not math.isfinite(gib):
            raise ValueError(f"{where} is not a finite number")
        if gib <= 0:
            raise ValueError(f"{where} must be positive")
        if not math.isfinite(gib * GIB):
            raise ValueError(f"{where} is too large")
        size = _round_to_page(int(gib * GIB))
        if size < page:
            raise ValueError(f"{where} is below one page ({page} bytes)")
        sizes.append(size)
    return sizes


# Group files and mappings alive in this process; see _after_fork_in_child.
_live_files: weakref.WeakSet[GroupFile] = weakref.WeakSet()


@attrs.define(eq=False)
class GroupFile:
    """An exclusively created group file whose shared lock this object holds until close()."""

    path: Path
    layout: GroupLayout
    _fd: int | None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"group file {self.path} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self, *, unlink: bool = False) -> None:
        """Release the shared lock and close; with ``unlink`` also delete the file. Idempotent.

        Unlinking does not invalidate existing mappings; the space is freed when the last
        one goes.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            _live_files.discard(self)
            if unlink:
                # Unlink while still holding the lock: a concurrent reclaim cannot see a
                # lock-free file that is about to be removed anyway.
                self.path.unlink(missing_ok=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _drop_in_child(self) -> None:
        # Never LOCK_UN here: the lock belongs to the open file description shared with the
        # parent, and unlocking it would release the parent's hold.
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def create_group_file(
    directory: Path, index: int, layout: GroupLayout, group: int | None = None
) -> GroupFile:
    """Create ``kvcr-group-<index>.pool`` exclusively, mode 0600 (0660 with ``group``), fully
    allocated, and lock it.

    Raises FileExistsError if the file exists. If the space cannot be reserved (ENOSPC,
    EFBIG, or fewer free bytes than ``layout.total_size``) raises OSError naming the file
    and the size, and removes the partial file.

    The file is unlocked between its creation and the ``flock`` below; a concurrent
    :func:`reclaim_orphans` on the same directory could delete it in that window, so run
    reclaim before creating, from the one service that owns the directory.
    """
    if index < 0:
        raise ValueError(f"group index must be >= 0, got {index}")
    path = group_file_path(directory, index)
    size = layout.total_size
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        # Owner-only, or owner and ``group`` (the service's allowed group: a claimant
        # reopens the descriptor it receives, which checks the file's mode). Set here, not
        # at open: the creation mode is filtered by the umask.
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, 0o600 if group is None else 0o660)
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        # A hugetlbfs mount without a size limit reports no blocks at all: the service
        # checked the free huge pages itself (hugepages.fit), and fallocate reserves them.
        if vfs.f_blocks and size > free:
            # Checked first so that an impossible reservation never fills the filesystem
            # on the way to ENOSPC (ext4 allocates extents until it runs out).
            raise OSError(
                errno.ENOSPC,
                f"cannot reserve {size} bytes for pool group file {path}: "
                f"only {free} bytes free on its filesystem",
            )
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size} bytes for pool group file {path}: "
                    f"{os.strerror(exc.errno)}",
                ) from exc
            raise
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    created = GroupFile(path=path, layout=layout, fd=fd)
    _live_files.add(created)
    return created


@attrs.define(eq=False)
class GroupMapping:
    """A shared read-write mapping of a whole group file, not inherited across fork.

    ``base_address`` is the address of byte 0; ``journal_address`` and ``pool_addresses``
    (in pool order) are absolute addresses for registration with a transfer engine.

    The caller must not close() while a transfer may still touch the memory: unmapping
    under an in-flight DMA/memcpy is a use-after-free. close() also fails (BufferError)
    while memoryviews of ``mmap`` are alive.
    """

    path: Path
    layout: GroupLayout
    mmap: mmap.mmap
    base_address: int
    journal_address: int
    pool_addresses: tuple[int, ...]

    @property
    def closed(self) -> bool:
        return self.mmap.closed

    def close(self) -> None:
        """Unmap. Idempotent."""
        self.mmap.close()


def map_group(source: int | Path, layout: GroupLayout) -> GroupMapping:
    """Map a whole group file (an fd, e.g. ``GroupFile.fd``, or a path) MAP_SHARED read-write.

    An fd is reopened through ``/proc/self/fd`` so that the mapping keeps its own open file
    description: the group's lock never outlives its GroupFile through the mapping. Raises
    ValueError if the file size differs from ``layout.total_size``.
    """
    if isinstance(source, int):
        path = Path(os.readlink(f"/proc/self/fd/{source}"))
        fd = os.open(f"/proc/self/fd/{source}", os.O_RDWR | os.O_CLOEXEC)
    else:
        path = Path(source)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        actual = os.fstat(fd).st_size
        if actual != layout.total_size:
            raise ValueError(
                f"group file {path} is {actual} bytes, layout expects {layout.total_size}"
            )
        mm = mmap.mmap(
            fd, layout.total_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)  # mmap keeps its own dup of the (lock-free) description
    try:
        mm.madvise(mmap.MADV_DONTFORK)
        base = _buffer_address(mm)
    except BaseException:
        mm.close()
        raise
    return GroupMapping(
        path=path,
        layout=layout,
        mmap=mm,
        base_address=base,
        journal_address=base + layout.journal[0],
        pool_addresses=tuple(base + offset for offset, _ in layout.pools),
    )


def _buffer_address(mm: mmap.mmap) -> int:
    import ctypes

    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # release the buffer export, or mm.close() would raise BufferError


def reclaim_orphans(directory: Path) -> tuple[list[Path], list[Path]]:
    """Delete the group files in ``directory`` that no live process holds.

    A file whose exclusive non-blocking lock succeeds has no holder and is deleted
    (reclaimed); one whose lock would block is held by a live process, possibly this one,
    and is left alone (kept). Anything that is not a regular file is also kept. Returns
    ``(reclaimed, kept)``, sorted by path.
    """
    reclaimed: list[Path] = []
    kept: list[Path] = []
    for path in sorted(Path(directory).glob(GROUP_FILE_GLOB)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: not ours to delete
                kept.append(path)
                continue
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kept.append(path)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                kept.append(path)
                continue
            # Only delete the inode we locked, not a file created under the name since.
            try:
                current = os.lstat(path)
            except FileNotFoundError:
                continue
            if (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino):
                path.unlink()
                reclaimed.append(path)
        finally:
            os.close(fd)
    return reclaimed, kept


def unheld(path: Path, fd: int) -> bool:
    """Whether no process holds a lock on the group file open as ``fd`` (the caller holds
    none on it). Probed through a description of its own: a lock on it is never ours."""
    probe = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(probe)  # drops the probe's lock, if it got one


def adopt_group_file(directory: Path, index: int, layout: GroupLayout) -> GroupFile:
    """Open ``kvcr-group-<index>.pool``, which a live worker of an earlier service still
    maps, without locking it (see :meth:`Guard.wait_detached`). Raises ValueError naming the
    file and both sizes if it does not have ``layout``'s size (the earlier service had other
    ``--pool-sizes-gb``), OSError if it cannot be opened."""
    path = group_file_path(directory, index)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"group file {path} is not a regular file")
        if st.st_size != layout.total_size:
            raise ValueError(
                f"group file {path} is {st.st_size} bytes, a live worker still maps it, and "
                f"this service's {POOL_SIZES_FLAG} make groups of {layout.total_size} bytes"
            )
    except BaseException:
        os.close(fd)
        raise
    adopted = GroupFile(path=path, layout=layout, fd=fd)
    _live_files.add(adopted)
    return adopted


def _after_fork_in_child() -> None:
    for group in list(_live_files):
        group._drop_in_child()
    _live_files.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def share_group_file(source_fd: int, layout: GroupLayout) -> GroupFile:
    """Take a shared hold on a group file received from the service.

    The file is reopened through ``/proc/self/fd`` so that the hold has an open file
    description of its own: the lock then belongs to this process alone (a ``flock`` on the
    received descriptor would be the service's own lock). ``source_fd`` stays the caller's.
    Raises ValueError if the file size differs from ``layout.total_size``.
    """
    path = Path(os.readlink(f"/proc/self/fd/{source_fd}"))
    fd = os.open(f"/proc/self/fd/{source_fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual != layout.total_size:
            raise ValueError(
                f"group file {path} is {actual} bytes, layout expects {layout.total_size}"
            )
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    group = GroupFile(path=path, layout=layout, fd=fd)
    _live_files.add(group)
    return group
