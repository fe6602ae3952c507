"""The G3 file set: local files that hold evicted blocks, with integrity records.

Every file of ``G3Options.paths`` is laid out as::

    [file header (64 B) | slot records (64 B each) | pad to the page][slot 0][slot 1]...

and is ``record area + capacity_bytes_per_file`` bytes long, created with its parents,
reserved to its full size (a full disk fails at startup, not at the first spill), and held
with an exclusive ``flock`` for the life of the instance: a second instance on the same
path, in another process or in this one, is refused (with a hint at the placeholders that
give each instance its own file, ``paths.py``). Without a guard, a file named after its
instance (``{agent}``) holds nothing once the instance ends: it is removed at close, and
such files of instances that died are removed when the next instance opens its own. Slots
are striped across the files (global slot ``i`` lives in file ``i % nfiles``), so that
consecutive slots spread over all disks.

A slot's record says which key it holds (a 16-byte BLAKE2b digest of the key), in which
*generation* (a number that grows with every store), and carries its own CRC; the data of a
slot is trusted only while its record matches what the index expects. A file that was
deleted, truncated, replaced by another file or zero-filled never yields a hit: the file
checks (:meth:`G3Files.file_ok`) and the record checks (:meth:`G3Files.check`) catch each.

The files keep in memory the record bytes last written or verified for each slot (64 bytes a
slot, like the record area itself): checking the slots this process stored is then one read
and one byte comparison per run of records (:meth:`G3Files.check_written`), instead of
decoding and hashing every record twice per read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from kvcr.g3 import paths as g3_paths

PAGE = os.sysconf("SC_PAGE_SIZE")
FILE_MAGIC = 0x4B563346  # "KV3F"
RECORD_MAGIC = 0x4B563352  # "KV3R"
VERSION = 1
FILE_HEADER = struct.Struct("<IIQQII")  # magic, version, block size, slots, index, nfiles
RECORD = struct.Struct("<IQ16sI")  # magic, generation, key digest, data crc (0: none)
RECORD_SIZE = 64
CRC = struct.Struct("<I")


class G3FileError(OSError):
    """A G3 file cannot be used; the message names the file and the reason."""


def key_digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16).digest()


def record_area(slots_per_file: int) -> int:
    """Bytes before the first slot of a file: header and records, rounded up to the page."""
    size = RECORD_SIZE * (1 + slots_per_file)
    return (size + PAGE - 1) // PAGE * PAGE


@attrs.frozen
class Record:
    generation: int
    digest: bytes
    data_crc: int = 0


_PAD = bytes(RECORD_SIZE - RECORD.size - CRC.size)


def encode_record(record: Record) -> bytes:
    return encode(record.generation, record.digest, record.data_crc)


def encode(generation: int, digest: bytes, data_crc: int = 0) -> bytes:
    """A record's 64 bytes (:func:`encode_record` without a :class:`Record` object)."""
    body = RECORD.pack(RECORD_MAGIC, generation, digest, data_crc)
    return body + CRC.pack(zlib.crc32(body)) + _PAD


def decode_record(raw: bytes) -> Record | None:
    """The record in ``raw`` (64 bytes), or None if it is empty, torn or not a record."""
    if len(raw) < RECORD.size + CRC.size:
        return None
    body = raw[: RECORD.size]
    (crc,) = CRC.unpack_from(raw, RECORD.size)
    if zlib.crc32(body) != crc:
        return None
    magic, generation, digest, data_crc = RECORD.unpack(body)
    if magic != RECORD_MAGIC or generation == 0:
        return None
    return Record(generation, digest, data_crc)


@attrs.define(eq=False)
class G3File:
    path: Path
    fd: int
    index: int
    slots: int
    identity: tuple[int, int]  # (st_dev, st_ino) of the file we created or opened
    size: int


class G3Files:
    """The open, locked, reserved files of one worker's G3 tier."""

    def __init__(
        self,
        paths: tuple[Path, ...],
        capacity_bytes_per_file: int,
        block: int,
        *,
        templates: Sequence[Path] | None = None,
        ephemeral: bool = False,
    ):
        """``templates``: ``G3Options.paths`` as configured, before expansion (for
        messages; by default the paths themselves). ``ephemeral``: no guard keeps a journal
        of these files, so nothing reads them once this instance ends; a file whose template
        names the instance (``{agent}``) is then removed at :meth:`close`, and the files
        that template named for instances that died are removed here
        (:func:`remove_orphans`)."""
        if capacity_bytes_per_file % block or block % PAGE:
            raise ValueError(
                f"G3: capacity {capacity_bytes_per_file} must be whole blocks of {block} bytes "
                f"and blocks whole pages of {PAGE}"
            )
        self.block = block
        self.slots_per_file = capacity_bytes_per_file // block
        self.area = record_area(self.slots_per_file)
        self.files: list[G3File] = []
        # Per file, the records this process wrote or verified, laid out as on disk (record
        # of local slot i at i * RECORD_SIZE); all zeros: nothing expected.
        self._expected: list[bytearray] = []
        names = paths if templates is None else templates
        # The files this instance removes at close, and the ones it removed now.
        globs = {
            Path(path): g3_paths.instances_glob(Path(t)) if ephemeral else None
            for path, t in zip(paths, names, strict=True)
        }
        self._ephemeral = {path for path, pattern in globs.items() if pattern is not None}
        self.removed_orphans: list[Path] = []
        try:
            for index, (path, template) in enumerate(zip(paths, names, strict=True)):
                if (pattern := globs[Path(path)]) is not None:
                    self.removed_orphans += remove_orphans(pattern, Path(path))
                self.files.append(self._open(Path(path), index, len(paths), Path(template)))
                self._expected.append(bytearray(RECORD_SIZE * self.slots_per_file))
        except BaseException:
            self.close()
            raise

    @property
    def capacity(self) -> int:
        """Slots in the whole tier."""
        return self.slots_per_file * len(self.files)

    def place(self, slot: int) -> tuple[G3File, int]:
        """The file holding global ``slot`` and the slot's byte offset in it."""
        f = self.files[slot % len(self.files)]
        return f, self.area + (slot // len(self.files)) * self.block

    def slot_rows(self) -> list[tuple[int, int, int, int, int]]:
        """Every slot, as one strided row per file: ``(offset, size, fd, pitch, count)``, file
        after file (how NIXL takes a prepared descriptor list of the slots)."""
        return [(self.area, self.block, f.fd, self.block, self.slots_per_file) for f in self.files]

    def positions(self, slots: Sequence[int]) -> list[int]:
        """Where each of ``slots`` is in :meth:`slot_rows` order."""
        n, per = len(self.files), self.slots_per_file
        return [s % n * per + s // n for s in slots]

    # -- files -------------------------------------------------------------------------------

    def _open(self, path: Path, index: int, nfiles: int, template: Path) -> G3File:
        size = self.area + self.slots_per_file * self.block
        where = f"G3 file {path}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise G3FileError(exc.errno, f"{where}: cannot open: {exc.strerror}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise G3FileError(
                    errno.EBUSY, f"{where}: {g3_paths.in_use(path, template, index)}"
                ) from None
            st = os.fstat(fd)
            header = FILE_HEADER.pack(
                FILE_MAGIC, VERSION, self.block, self.slots_per_file, index, nfiles
            )
            if st.st_size == 0:
                self._reserve(fd, size, where)
                os.pwrite(fd, header + CRC.pack(zlib.crc32(header)), 0)
            elif st.st_size != size:
                raise G3FileError(
                    errno.EINVAL,
                    f"{where}: existing file is {st.st_size} bytes, this configuration needs "
                    f"{size} (capacity {self.slots_per_file * self.block} + {self.area} of records)",
                )
            elif not self._header_matches(fd, header):
                # Another layout's file (or a zeroed one): start it over, trusting nothing in it.
                os.pwrite(fd, bytes(self.area), 0)
                os.pwrite(fd, header + CRC.pack(zlib.crc32(header)), 0)
            return G3File(path, fd, index, self.slots_per_file, (st.st_dev, st.st_ino), size)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _reserve(fd: int, size: int, where: str) -> None:
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        if size > free:
            raise G3FileError(
                errno.ENOSPC, f"{where}: cannot reserve {size} bytes, only {free} free"
            )
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.ftruncate(fd, 0)
            raise G3FileError(
                exc.errno, f"{where}: cannot reserve {size} bytes: {exc.strerror}"
            ) from None

    @staticmethod
    def _header_matches(fd: int, header: bytes) -> bool:
        raw = os.pread(fd, len(header) + CRC.size, 0)
        return raw == header + CRC.pack(zlib.crc32(header))

    def readable(self, slots: Iterable[int]) -> set[int]:
        """The indices of the files holding ``slots`` that are still whole and linked (one
        ``fstat`` each): worth reading from, to be verified after the read."""
        n = len(self.files)
        return {i for i in {s % n for s in slots} if self._whole(self.files[i])}

    @staticmethod
    def _whole(f: G3File) -> bool:
        """False once the file was deleted or truncated (one ``fstat``)."""
        try:
            st = os.fstat(f.fd)
        except OSError:
            return False
        return st.st_nlink > 0 and st.st_size == f.size

    def file_ok(self, f: G3File) -> bool:
        """False once the file was deleted, replaced at its path, or truncated."""
        try:
            at_path = os.stat(f.path)
        except OSError:
            return False
        return self._whole(f) and (at_path.st_dev, at_path.st_ino) == f.identity

    # -- records -----------------------------------------------------------------------------

    def write_record(self, slot: int, record: Record) -> None:
        self.write_records({slot: record})

    def clear_record(self, slot: int) -> None:
        self.write_records({slot: None})

    def read_record(self, slot: int) -> Record | None:
        return self.read_records([slot])[slot]

    def _runs(self, slots: Iterable[int]) -> list[tuple[G3File, int, list[int]]]:
        """``slots`` grouped into runs of consecutive records in one file: (file, local
        index of the run's first slot, the run's slots in order). Slots are striped, so in
        plain slot order every neighbour is in another file and a batch of consecutive slots
        would be one syscall per record instead of one per file: runs follow the order of
        :meth:`positions` (file by file), where they are plain consecutive numbers."""
        n, per = len(self.files), self.slots_per_file
        runs: list[tuple[G3File, int, list[int]]] = []
        current: list[int] = []
        last = -2
        for p in sorted(s % n * per + s // n for s in slots):
            local = p % per
            if p != last + 1 or local == 0:
                current = []
                runs.append((self.files[p // per], local, current))
            current.append(local * n + p // per)
            last = p
        return runs

    def write_records(self, records: Mapping[int, Record | None]) -> None:
        """Write (or clear, for None) many slots' records: one pwrite per run."""
        empty = bytes(RECORD_SIZE)
        self._write({s: empty if r is None else encode_record(r) for s, r in records.items()})

    def vouch(self, slots: Sequence[int], keys: Sequence[bytes], generation: int) -> None:
        """Record that ``slots[i]`` holds ``keys[i]`` as stored in generation
        ``generation + i`` (the record of :meth:`write_records`, without a
        :class:`Record` a slot: this is every store's path)."""
        self._write(
            {s: encode(generation + i, key_digest(k)) for i, (s, k) in enumerate(zip(slots, keys))}
        )

    def _write(self, raw: Mapping[int, bytes]) -> None:
        for f, first, run in self._runs(raw):
            data = b"".join([raw[s] for s in run])
            at = RECORD_SIZE * first  # the mirror has no file header
            self._expected[f.index][at : at + len(data)] = data
            os.pwrite(f.fd, data, RECORD_SIZE + at)

    def read_records(self, slots: list[int]) -> dict[int, Record | None]:
        """Many slots' records: one pread per run."""
        out: dict[int, Record | None] = {}
        for f, first, run in self._runs(slots):
            data = os.pread(f.fd, RECORD_SIZE * len(run), RECORD_SIZE * (1 + first))
            for i, slot in enumerate(run):
                out[slot] = decode_record(data[i * RECORD_SIZE : (i + 1) * RECORD_SIZE])
        return out

    def check_many(self, expected: Mapping[int, tuple[bytes, int]]) -> set[int]:
        """The slots of ``expected`` (slot -> (key, generation)) that their files and
        records still vouch for; each file is checked once. The records found sound become
        the ones :meth:`check_written` expects."""
        n = len(self.files)
        sound = self._sound_files(expected)
        candidates = [s for s in expected if s % n in sound]
        records = self.read_records(candidates)
        ok = set()
        for slot in candidates:
            record = records.get(slot)
            key, generation = expected[slot]
            if (
                record is not None
                and record.generation == generation
                and record.digest == key_digest(key)
            ):
                ok.add(slot)
                at = (slot // n) * RECORD_SIZE
                self._expected[slot % n][at : at + RECORD_SIZE] = encode_record(record)
        return ok

    def check_written(self, slots: list[int]) -> set[int]:
        """The ``slots`` whose files are sound and whose on-disk records are still the
        ones this process last wrote or verified there (a cleared slot never passes): the
        same guarantee as :meth:`check_many` for the key and generation recorded then, at
        the cost of one read and one comparison per run of records."""
        n = len(self.files)
        sound = self._sound_files(slots)
        ok: set[int] = set()
        for f, first, run in self._runs([s for s in slots if s % n in sound]):
            size = RECORD_SIZE * len(run)
            data = os.pread(f.fd, size, RECORD_SIZE * (1 + first))
            expected = memoryview(self._expected[f.index])[RECORD_SIZE * first :][:size]
            if data == expected and 0 not in bytes(expected[::RECORD_SIZE]):
                ok.update(run)  # the usual case: all as written, none cleared
                continue
            for i, s in enumerate(run):  # slot by slot
                mine = expected[i * RECORD_SIZE : (i + 1) * RECORD_SIZE]
                if mine[0] != 0 and data[i * RECORD_SIZE : (i + 1) * RECORD_SIZE] == mine:
                    ok.add(s)
        return ok

    def _sound_files(self, slots: Iterable[int]) -> set[int]:
        """The indices of the files holding ``slots`` that :meth:`file_ok` still trusts."""
        n = len(self.files)
        return {i for i in {s % n for s in slots} if self.file_ok(self.files[i])}

    def check(self, slot: int, key: bytes, generation: int) -> bool:
        """True if ``slot`` still holds ``key`` as stored in ``generation``, in a sound file."""
        return slot in self.check_many({slot: (key, generation)})

    def close(self) -> None:
        """Close the files (dropping their locks); an ephemeral file is removed first,
        while its lock still says it is ours."""
        files, self.files = self.files, []
        for f in files:
            if f.path in self._ephemeral:
                with contextlib.suppress(OSError):
                    if _same_file(f.path, f.identity):
                        os.unlink(f.path)
            with contextlib.suppress(OSError):
                os.close(f.fd)  # closing drops the lock


def _same_file(path: Path, identity: tuple[int, int]) -> bool:
    st = os.stat(path, follow_symlinks=False)
    return (st.st_dev, st.st_ino) == identity


def remove_orphans(pattern: str, own: Path) -> list[Path]:
    """Remove the G3 files that match ``pattern`` (a template's
    :func:`~kvcr.g3.paths.instances_glob`) but ``own``, of instances that are gone; return
    them.

    Without a guard nothing reads a G3 file once its instance ends: the index that knew its
    slots ended with it. An engine that names its agents afresh at every start (vLLM's
    adapter: ``KVCR-<uuid>``) gets a new file each time, and an instance that is killed (as
    vLLM 0.32 kills its engine core at shutdown) never removes its own: without this, each
    restart would leave ``capacity_bytes_per_file`` behind. A file is removed only if it
    is a regular, non-empty file with a G3 header and nobody holds its lock: a live
    instance holds its files' locks from before it writes the header to its end, and a file
    still empty may be one being created (its lock is not ours to take)."""
    removed: list[Path] = []
    for name in sorted(glob.glob(pattern)):
        path = Path(name)
        if path == own:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < FILE_HEADER.size:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live instance's file
            head = os.pread(fd, FILE_HEADER.size, 0)
            if FILE_HEADER.unpack(head)[0] != FILE_MAGIC:
                continue  # not a G3 file: the template's glob matched something else
            if _same_file(path, (st.st_dev, st.st_ino)):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
