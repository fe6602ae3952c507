"""``kvcr-guard --huge-pages``: the pools live in huge pages the operator reserved, on a
hugetlbfs mount the test creates (and removes, with the reservation it made); too few free
pages, or a pool directory that is not hugetlbfs, is refused at start with the numbers."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import GuardProcess

pytestmark = pytest.mark.integration

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
MIB = 1 << 20
# One group: the 100 MiB journal and one 2 MiB pool = 51 huge pages of 2 MiB.
GROUP_PAGES = 51


class HugePages:
    """A hugetlbfs mount at ``mount`` and a reservation of huge pages, both undone at the
    end (the reservation back to what it was)."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self._before = int(NR_HUGEPAGES.read_text())

    def reserve(self, pages: int) -> None:
        """Make ``pages`` more huge pages free than there are now (never fewer in total)."""
        NR_HUGEPAGES.write_text(str(self._before + pages))
        free = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
        if free < pages:
            pytest.skip(f"only {free} huge pages could be reserved (memory fragmented)")

    def undo(self) -> None:
        subprocess.run(["umount", str(self.mount)], check=False, capture_output=True)
        NR_HUGEPAGES.write_text(str(self._before))


@pytest.fixture
def huge(tmp_path: Path) -> Iterator[HugePages]:
    if os.geteuid() != 0:
        pytest.skip("mounting hugetlbfs and reserving huge pages needs root")
    mount = tmp_path / "pools"  # where GuardProcess puts its pool directory
    mount.mkdir()
    out = subprocess.run(
        ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)],
        check=False,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        pytest.skip(f"cannot mount hugetlbfs here: {out.stderr.strip()}")
    pages = HugePages(mount)
    try:
        yield pages
    finally:
        pages.undo()


def page_size_of(address: int) -> int:
    """The kernel page size (bytes) of this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "KernelPageSize:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pools_on_huge_pages_are_backed_by_them_and_shared(tmp_path, huge) -> None:
    huge.reserve(GROUP_PAGES)
    guard = GuardProcess(
        tmp_path, guard_count=1, pool_sizes_gb="0.001953125", extra=("--huge-pages",)
    )
    try:
        hold = guard.client.claim(0, [("", 4096)], guard.digest, ("127.0.0.1", 0))
        (_, address, size) = hold.local_dram.pools[0]
        assert size == 2 * MIB
        assert page_size_of(address) == 2 * MIB  # the claimant's mapping is huge pages
        ctypes.memmove(address, b"kept in a huge page", 19)
        path = hold.group_path
        hold.release()
        with open(path, "rb") as group:  # the same bytes, through the file
            group.seek(100 * MIB)
            assert group.read(19) == b"kept in a huge page"
        assert "huge_pages=True" in guard.log()
    finally:
        assert guard.stop() == 0, guard.log()
    assert list(huge.mount.iterdir()) == []  # the group file is gone, its pages free again


def serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "kvcr.kvcr_service", "--socket-path", str(tmp_path / "s")),
            *("--pool-dir", str(tmp_path / "pools"), "--guard-count", "2"),
            *("--pool-sizes-gb", "0.001953125", "--compatibility-digest", "d", "--huge-pages"),
            *flags,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_too_few_free_huge_pages_are_refused_with_the_numbers(tmp_path, huge) -> None:
    huge.reserve(GROUP_PAGES)  # enough for one group; two are asked for

    out = serve(tmp_path)

    assert out.returncode == 2
    assert "--huge-pages: 2 group(s) need 102 huge pages of 2048 kB" in out.stderr
    assert "51 are free (reserve 51 more: raise vm.nr_hugepages" in out.stderr
    assert not (tmp_path / "s").exists()  # nothing was started


def test_a_pool_dir_that_is_not_hugetlbfs_is_refused(tmp_path) -> None:
    (tmp_path / "pools").mkdir()

    out = serve(tmp_path)

    assert out.returncode == 2
    assert f"--pool-dir {tmp_path / 'pools'} is not on a hugetlbfs mount" in out.stderr
