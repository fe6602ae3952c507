"""Guard pool groups on real files: layout, creation, mapping, fork isolation, reclaim.

Each group is one file ``kvcr-group-<i>.pool`` mapped as ``[100 MiB journal][pool 0]...``.
Files here are the journal plus a few pages; nothing is mapped in loops.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcr.guard import pools
from kvcr.guard.pools import (
    JOURNAL_BYTES,
    GroupLayout,
    create_group_file,
    group_file_path,
    map_group,
    parse_pool_sizes_gb,
    plan_group,
    reclaim_orphans,
)

pytestmark = pytest.mark.integration

PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 2**30


@pytest.fixture
def small_layout() -> GroupLayout:
    return plan_group([2 * PAGE, 3 * PAGE])


@pytest.fixture
def group(tmp_path: Path, small_layout: GroupLayout) -> Iterator[pools.GroupFile]:
    g = create_group_file(tmp_path, 0, small_layout)
    yield g
    g.close(unlink=True)


# --- plan_group -----------------------------------------------------------------------------


def test_plan_group_rounds_down_to_the_page_and_packs_after_the_journal() -> None:
    layout = plan_group([PAGE + 1, 3 * PAGE - 1, PAGE])
    assert layout.journal == (0, JOURNAL_BYTES)
    assert layout.pools == (
        (JOURNAL_BYTES, PAGE),
        (JOURNAL_BYTES + PAGE, 2 * PAGE),
        (JOURNAL_BYTES + 3 * PAGE, PAGE),
    )
    assert layout.total_size == JOURNAL_BYTES + 4 * PAGE
    assert all(offset % PAGE == 0 and size % PAGE == 0 for offset, size in layout.pools)


@pytest.mark.parametrize("bad", [PAGE - 1, 0, -PAGE])
def test_plan_group_refuses_a_pool_below_one_page_naming_index_and_size(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"pool 1: size {bad} bytes is below one page"):
        plan_group([PAGE, bad])


def test_plan_group_refuses_an_empty_group() -> None:
    with pytest.raises(ValueError, match="at least one pool"):
        plan_group([])


# --- parse_pool_sizes_gb --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", [GIB]),
        ("1,2", [GIB, 2 * GIB]),
        (" 0.5 , 0.25 ", [GIB // 2, GIB // 4]),
        ("1e-3", [int(1e-3 * GIB) // PAGE * PAGE]),
        (f"{PAGE / GIB!r}", [PAGE]),
        (f"{(PAGE + 1) / GIB!r}", [PAGE]),
    ],
)
def test_parse_pool_sizes_gb_accepts(text: str, expected: list[int]) -> None:
    assert parse_pool_sizes_gb(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected comma-separated sizes"),
        ("   ", "expected comma-separated sizes"),
        ("1,,2", r"item 1 \(''\) is not a number"),
        ("1,", r"item 1 \(''\) is not a number"),
        ("abc", r"item 0 \('abc'\) is not a number"),
        ("1,2GB", r"item 1 \('2GB'\) is not a number"),
        ("0", r"item 0 \('0'\) must be positive"),
        ("1,-1", r"item 1 \('-1'\) must be positive"),
        ("nan", r"item 0 \('nan'\) is not a finite number"),
        ("inf", r"item 0 \('inf'\) is not a finite number"),
        ("1,-inf", r"item 1 \('-inf'\) is not a finite number"),
        (f"{(PAGE - 1) / GIB!r}", "is below one page"),
    ],
)
def test_parse_pool_sizes_gb_rejects_naming_the_flag_and_item(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=rf"^--pool-sizes-gb: .*{reason}"):
        parse_pool_sizes_gb(text)


# --- create_group_file ----------------------------------------------------------------------


def test_created_file_is_owner_only_even_with_a_permissive_umask(
    tmp_path: Path, small_layout: GroupLayout
) -> None:
    old = os.umask(0)
    try:
        g = create_group_file(tmp_path, 3, small_layout)
    finally:
        os.umask(old)
    try:
        assert g.path == tmp_path / "kvcr-group-3.pool"
        assert stat.S_IMODE(os.stat(g.path).st_mode) == 0o600
    finally:
        g.close(unlink=True)


def test_created_file_is_owner_only_even_with_a_restrictive_umask(
    tmp_path: Path, small_layout: GroupLayout
) -> None:
    old = os.umask(0o277)
    try:
        g = create_group_file(tmp_path, 0, small_layout)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(g.path).st_mode) == 0o600
    finally:
        g.close(unlink=True)


def test_creation_is_exclusive(
    tmp_path: Path, small_layout: GroupLayout, group: pools.GroupFile
) -> None:
    with pytest.raises(FileExistsError):
        create_group_file(tmp_path, 0, small_layout)
    assert group.path.exists()  # the failed attempt did not remove the existing file
    create_group_file(tmp_path, 1, small_layout).close(unlink=True)


def test_created_file_has_the_planned_size_fully_allocated(group: pools.GroupFile) -> None:
    st = os.stat(group.path)
    assert st.st_size == group.layout.total_size
    assert st.st_blocks * 512 >= group.layout.total_size


def test_created_file_is_held_with_a_shared_lock_until_closed(
    tmp_path: Path, small_layout: GroupLayout
) -> None:
    g = create_group_file(tmp_path, 0, small_layout)
    probe = os.open(g.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # other holders may share it
        fcntl.flock(probe, fcntl.LOCK_UN)
        g.close()
        assert g.closed
        assert g.path.exists()  # close() without unlink keeps the file
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
    g.close(unlink=True)  # idempotent: already closed, nothing to unlink
    assert g.path.exists()
    g.path.unlink()


def test_close_with_unlink_removes_the_file(group: pools.GroupFile) -> None:
    group.close(unlink=True)
    assert not group.path.exists()


def test_a_size_beyond_free_space_fails_at_creation_and_leaves_no_file(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    layout = plan_group([free + 2**40])
    with pytest.raises(OSError, match=r"cannot reserve \d+ bytes for pool group file") as info:
        create_group_file(tmp_path, 0, layout)
    assert info.value.errno == errno.ENOSPC
    assert str(layout.total_size) in str(info.value)
    assert "kvcr-group-0.pool" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EFBIG])
def test_fallocate_failure_is_named_and_removes_the_partial_file(
    tmp_path: Path, small_layout: GroupLayout, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    # The free-space pre-check passes; the filesystem still refuses (e.g. a race, a quota).
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(pools.os, "posix_fallocate", refuse)
    with pytest.raises(OSError, match=rf"{small_layout.total_size} bytes .*kvcr-group-2\.pool"):
        create_group_file(tmp_path, 2, small_layout)
    assert list(tmp_path.iterdir()) == []


# --- map_group ------------------------------------------------------------------------------


def test_mapping_is_writable_and_shared_with_other_mappings(group: pools.GroupFile) -> None:
    layout = group.layout
    first = map_group(group.fd, layout)
    second = map_group(group.path, layout)
    try:
        assert first.base_address % PAGE == 0
        assert first.journal_address == first.base_address
        assert first.pool_addresses == tuple(first.base_address + off for off, _ in layout.pools)

        off1, size1 = layout.pools[1]
        first.mmap[off1 : off1 + 5] = b"hello"
        first.mmap[off1 + size1 - 3 : off1 + size1] = b"end"
        assert second.mmap[off1 : off1 + 5] == b"hello"
        assert second.mmap[off1 + size1 - 3 : off1 + size1] == b"end"
        # The published addresses point at the same bytes.
        assert ctypes.string_at(second.pool_addresses[1], 5) == b"hello"
        ctypes.memmove(second.journal_address, b"journal", 7)
        assert first.mmap[:7] == b"journal"
    finally:
        first.close()
        second.close()
    assert first.closed
    first.close()  # idempotent


def test_mapping_refuses_a_file_of_the_wrong_size(group: pools.GroupFile) -> None:
    other = plan_group([PAGE])
    with pytest.raises(ValueError, match=r"is \d+ bytes, layout expects"):
        map_group(group.path, other)


def _fork_and_check(check: Callable[[], int]) -> int:
    """Run ``check()`` (returning an exit code) in a forked child; return its exit code."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 99
        try:
            code = check()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_forked_child_does_not_inherit_the_mapping(group: pools.GroupFile) -> None:
    mapping = map_group(group.fd, group.layout)
    try:
        path = str(group.path)
        assert path in Path("/proc/self/maps").read_text()

        def child() -> int:
            return 1 if path in Path("/proc/self/maps").read_text() else 0

        assert _fork_and_check(child) == 0
    finally:
        mapping.close()


def test_forked_child_does_not_inherit_the_hold(group: pools.GroupFile) -> None:
    mapping = map_group(group.fd, group.layout)
    try:

        def child() -> int:
            # The child's copy of the lock fd is closed (not unlocked) right after fork.
            return 0 if group.closed else 2

        assert _fork_and_check(child) == 0
        # The parent still holds its lock after the child is gone.
        _, kept = reclaim_orphans(group.path.parent)
        assert kept == [group.path]
        assert not group.closed
    finally:
        mapping.close()


def test_orphan_is_reclaimable_even_while_a_forked_child_lives(
    tmp_path: Path, small_layout: GroupLayout
) -> None:
    """The whole point: a holder SIGKILLed while a child it forked lives on must not leave
    the file held by that child."""
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:  # the holder: creates and maps the group, forks, waits to be killed
        code = 99
        try:
            g = create_group_file(tmp_path, 0, small_layout)
            map_group(g.fd, small_layout)
            if os.fork() == 0:
                # The at-fork hooks have run by now: say so, then outlive the holder.
                os.write(w, os.getpid().to_bytes(4, "little"))
                time.sleep(60)  # killed by the test
                os._exit(0)
            time.sleep(60)
        finally:
            os._exit(code)
    os.close(w)
    child = 0
    try:
        child = int.from_bytes(os.read(r, 4), "little")
        assert child > 0
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)

        reclaimed, kept = reclaim_orphans(tmp_path)

        assert (reclaimed, kept) == ([group_file_path(tmp_path, 0)], [])
    finally:
        os.close(r)
        for pid in (holder, child):
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(holder, 0)


# --- reclaim_orphans ------------------------------------------------------------------------
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(120)
"""


def test_reclaim_deletes_unheld_files_and_keeps_held_ones(
    tmp_path: Path, small_layout: GroupLayout
) -> None:
    orphan = create_group_file(tmp_path, 0, small_layout)
    orphan.close()  # its service died: the file stays, nobody holds it
    held = create_group_file(tmp_path, 1, small_layout)
    held.close()  # now held only by the subprocess below
    ours = create_group_file(tmp_path, 2, small_layout)  # held by this very process
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("not a pool")

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(held.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"

        reclaimed, kept = reclaim_orphans(tmp_path)
        assert reclaimed == [orphan.path]
        assert kept == [held.path, ours.path]
        assert not orphan.path.exists()
        assert held.path.exists() and ours.path.exists() and unrelated.exists()
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()

    reclaimed, kept = reclaim_orphans(tmp_path)
    assert (reclaimed, kept) == ([held.path], [ours.path])
    ours.close()
    assert reclaim_orphans(tmp_path) == ([ours.path], [])
    assert sorted(tmp_path.iterdir()) == [unrelated]


def test_reclaim_leaves_symlinks_alone(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("x")
    link = tmp_path / "kvcr-group-0.pool"
    link.symlink_to(target)
    assert reclaim_orphans(tmp_path) == ([], [link])
    assert link.is_symlink() and target.exists()


def test_reclaim_of_an_empty_directory(tmp_path: Path) -> None:
    assert reclaim_orphans(tmp_path) == ([], [])
