"""Huge pages for the guard's pools (``kvcr-guard --huge-pages``).

Shared memory gets no transparent huge pages on these hosts (``shmem_enabled`` is
``never``), so group files in ``/dev/shm`` are mapped with 4 KiB pages, and every copy
between processes on the host (UCX's CMA) pins and walks them one by one. With
``--huge-pages`` the pool directory is a hugetlbfs mount and the group files are backed by
huge pages the operator reserved beforehand (``vm.nr_hugepages``, or ``hugepages=`` at
boot): pages are reserved when a file is allocated, so the service checks up front that the
groups fit in the free huge pages and refuses with the numbers otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

FLAG = "--huge-pages"
_MEMINFO = Path("/sys/kernel/mm/hugepages")


def hugetlbfs_mount(directory: Path) -> str | None:
    """The hugetlbfs mount point ``directory`` is on, or None if it is on another file
    system (from ``/proc/self/mountinfo``: the longest mount point that contains it)."""
    target = os.path.realpath(directory)
    best, fstype = "", ""
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            kind = fields[fields.index("-") + 1]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, kind
    return best if fstype == "hugetlbfs" else None


def free_huge_pages(page_size: int) -> int:
    path = _MEMINFO / f"hugepages-{page_size // 1024}kB" / "free_hugepages"
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def fit(
    pool_dir: Path, pool_sizes: Sequence[int], journal_bytes: int, groups: int
) -> tuple[list[int], int]:
    """Check that ``groups`` groups (the journal, then ``pool_sizes``) can live in huge
    pages under ``pool_dir``; return the pool sizes rounded down to the huge page and the
    huge page size. ValueError names the flag and the numbers otherwise."""
    mount = hugetlbfs_mount(pool_dir)
    if mount is None:
        raise ValueError(
            f"{FLAG}: --pool-dir {pool_dir} is not on a hugetlbfs mount (mount one there: "
            "mount -t hugetlbfs -o pagesize=2M none DIR)"
        )
    page = os.statvfs(pool_dir).f_bsize  # hugetlbfs reports its huge page size here
    if journal_bytes % page:
        raise ValueError(
            f"{FLAG}: {pool_dir} has {page // 1024} kB pages, which do not divide the "
            f"{journal_bytes >> 20} MiB journal region (use pagesize=2M)"
        )
    sizes = []
    for index, size in enumerate(pool_sizes):
        rounded = size // page * page
        if not rounded:
            raise ValueError(
                f"{FLAG}: --pool-sizes-gb item {index} ({size} bytes) is below one huge page "
                f"({page // 1024} kB)"
            )
        sizes.append(rounded)
    needed = groups * (journal_bytes + sum(sizes)) // page
    free = free_huge_pages(page)
    if needed > free:
        raise ValueError(
            f"{FLAG}: {groups} group(s) need {needed} huge pages of {page // 1024} kB, "
            f"{free} are free (reserve {needed - free} more: raise vm.nr_hugepages, or "
            "hugepages= at boot)"
        )
    return sizes, page
