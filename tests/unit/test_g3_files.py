"""G3 files: created and reserved with their parents, locked for one instance, striped, and
trusted slot by slot only while the file and the slot's record are what the index expects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from damage import KINDS
from damage import damage as damage_file
from kvcr.g3.files import (
    PAGE,
    G3FileError,
    G3Files,
    Record,
    decode_record,
    encode_record,
    key_digest,
    record_area,
)

BLOCK = PAGE * 2


def files(tmp_path: Path, n: int = 2, slots: int = 8) -> G3Files:
    return G3Files(tuple(tmp_path / f"d{i}" / "g3.bin" for i in range(n)), BLOCK * slots, BLOCK)


def test_files_are_created_with_parents_reserved_and_striped(tmp_path) -> None:
    g3 = files(tmp_path)
    try:
        assert g3.capacity == 16
        for f in g3.files:
            assert f.path.stat().st_size == record_area(8) + 8 * BLOCK
            assert os.stat(f.path).st_blocks * 512 >= f.size  # allocated, not sparse
            assert f.path.stat().st_mode & 0o777 == 0o600
        assert [(g3.place(s)[0].index, g3.place(s)[1]) for s in range(4)] == [
            (0, record_area(8)),
            (1, record_area(8)),
            (0, record_area(8) + BLOCK),
            (1, record_area(8) + BLOCK),
        ]
        # The prepared NIXL list of slots (one strided row per file) has each slot where
        # positions() says: the same file and offset as place().
        rows = g3.slot_rows()
        expanded = [(f, off + i * pitch) for off, _, f, pitch, n in rows for i in range(n)]
        for slot, position in enumerate(g3.positions(range(g3.capacity))):
            f, offset = g3.place(slot)
            assert expanded[position] == (f.fd, offset)
    finally:
        g3.close()


def test_a_second_process_on_the_same_path_is_refused(tmp_path) -> None:
    g3 = files(tmp_path, n=1)
    try:
        code = (
            "import sys; from pathlib import Path; from kvcr.g3.files import G3Files\n"
            f"G3Files((Path({str(g3.files[0].path)!r}),), {8 * BLOCK}, {BLOCK})"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert out.returncode != 0
        assert "in use by another live KVCR instance" in out.stderr
        assert str(g3.files[0].path) in out.stderr and "{agent}" in out.stderr
    finally:
        g3.close()


def test_a_second_instance_in_this_process_is_refused_with_the_placeholders(tmp_path) -> None:
    g3 = files(tmp_path, n=2)
    try:
        # flock locks an open file, not a process: a second open of the path is refused too.
        with pytest.raises(G3FileError) as caught:
            G3Files((tmp_path / "other.bin", g3.files[1].path), 8 * BLOCK, BLOCK)
        text = str(caught.value)
        assert f"G3 file {g3.files[1].path}: in use by another live KVCR instance" in text
        assert "put {agent} (the NIXL agent name) or {guard_index}" in text
        assert "in paths[1]" in text and f"{tmp_path / 'd1' / 'g3-{agent}.bin'}" in text
    finally:
        g3.close()
    # The refused set let go of the file it had opened before the refusal.
    G3Files((tmp_path / "other.bin",), 8 * BLOCK, BLOCK).close()


def test_a_template_that_expanded_to_a_held_file_says_so(tmp_path) -> None:
    g3 = files(tmp_path, n=1)
    try:
        with pytest.raises(G3FileError) as caught:
            G3Files(
                (g3.files[0].path,),
                8 * BLOCK,
                BLOCK,
                templates=(tmp_path / "d0" / "{agent}.bin",),
            )
        text = str(caught.value)
        assert "in use by another live KVCR instance" in text
        assert "paths[0] ('" + str(tmp_path / "d0" / "{agent}.bin") + "') expanded" in text
        assert "own NIXL agent name ({agent}) or guard index ({guard_index})" in text
    finally:
        g3.close()


def test_an_existing_file_of_the_wrong_size_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "g3.bin"
    path.write_bytes(b"x" * 100)
    with pytest.raises(G3FileError, match=rf"G3 file {path}: existing file is 100 bytes"):
        G3Files((path,), 8 * BLOCK, BLOCK)


def test_no_room_is_an_error_at_startup(tmp_path) -> None:
    with pytest.raises(G3FileError, match="cannot reserve"):
        G3Files((tmp_path / "huge.bin",), (1 << 50) // BLOCK * BLOCK, BLOCK)


def test_records_round_trip_and_reject_anything_torn() -> None:
    record = Record(generation=7, digest=key_digest(b"k"), data_crc=123)
    raw = encode_record(record)
    assert len(raw) == 64 and decode_record(raw) == record
    assert decode_record(bytes(64)) is None
    flipped = bytearray(raw)
    flipped[5] ^= 1
    assert decode_record(bytes(flipped)) is None


def test_a_slot_is_trusted_only_with_its_key_and_generation(tmp_path) -> None:
    g3 = files(tmp_path)
    try:
        g3.write_record(5, Record(3, key_digest(b"key")))
        assert g3.check(5, b"key", 3)
        assert not g3.check(5, b"key", 4)  # stored again since
        assert not g3.check(5, b"other", 3)
        assert not g3.check(4, b"key", 3)
        g3.clear_record(5)
        assert not g3.check(5, b"key", 3)
    finally:
        g3.close()


def test_check_written_trusts_only_the_records_this_process_wrote_or_verified(tmp_path) -> None:
    g3 = files(tmp_path)
    try:
        g3.write_records({s: Record(10 + s, key_digest(b"k%d" % s)) for s in range(6)})
        assert g3.check_written(list(range(8))) == set(range(6))  # 6, 7: never written
        g3.clear_record(2)
        assert g3.check_written(list(range(6))) == {0, 1, 3, 4, 5}
        # A record someone else wrote is not ours, even if it decodes.
        os.pwrite(g3.files[1].fd, encode_record(Record(99, key_digest(b"x"))), 64 * (1 + 3 // 2))
        assert g3.check_written([3]) == set()
    finally:
        g3.close()
    again = files(tmp_path)
    try:
        assert again.check_written([0, 1]) == set()  # nothing verified yet in this process
        assert again.check_many({0: (b"k0", 10), 1: (b"k1", 99)}) == {0}
        assert again.check_written([0, 1]) == {0}
    finally:
        again.close()


@pytest.mark.parametrize("damage", KINDS)
def test_a_damaged_file_never_yields_a_hit_to_check_written(tmp_path, damage) -> None:
    g3 = files(tmp_path, n=1)
    try:
        g3.write_records({0: Record(1, key_digest(b"key")), 1: Record(2, key_digest(b"k2"))})
        assert g3.check_written([0, 1]) == {0, 1}
        damage_file(g3.files[0].path, damage)
        assert g3.check_written([0, 1]) == set()
    finally:
        g3.close()


@pytest.mark.parametrize("damage", KINDS)
def test_a_damaged_file_never_yields_a_hit(tmp_path, damage) -> None:
    g3 = files(tmp_path, n=1)
    try:
        g3.write_record(0, Record(1, key_digest(b"key")))
        assert g3.check(0, b"key", 1)
        path = g3.files[0].path
        damage_file(path, damage)
        assert not g3.check(0, b"key", 1)
    finally:
        g3.close()


def test_reopening_keeps_records_of_the_same_layout_and_resets_another(tmp_path) -> None:
    g3 = files(tmp_path, n=1)
    g3.write_record(2, Record(9, key_digest(b"key")))
    g3.close()
    again = files(tmp_path, n=1)
    try:
        assert again.check(2, b"key", 9)
    finally:
        again.close()
    # Same size, different stripe layout (2 files now): nothing in it is trusted.
    other = G3Files((tmp_path / "d0" / "g3.bin", tmp_path / "d9" / "g3.bin"), BLOCK * 8, BLOCK)
    try:
        assert not other.check(4, b"key", 9) and other.read_record(4) is None
    finally:
        other.close()


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(garbage=st.binary(min_size=64, max_size=64 * 9), offset=st.integers(0, 64 * 8))
def test_garbage_in_the_record_area_never_vouches_for_a_slot(
    tmp_path_factory, garbage, offset
) -> None:
    directory = tmp_path_factory.mktemp("g3fuzz")
    g3 = G3Files((directory / "g3.bin",), 8 * BLOCK, BLOCK)
    try:
        g3.write_record(3, Record(5, key_digest(b"real")))
        os.pwrite(g3.files[0].fd, garbage, 64 + offset)  # over records, maybe slot 3's
        assert g3.check_many({s: (b"other", 5) for s in range(8)}) == set()
        assert not any(g3.check(s, b"real", g) for s in range(8) for g in (0, 4, 6))
        record = g3.read_record(3)
        assert record is None or record == Record(5, key_digest(b"real"))
    finally:
        g3.close()


# --- files named after their instance ({agent}), without a guard: removed when it ends ----


def agent_files(tmp_path: Path, agent: str, *, ephemeral: bool = True) -> G3Files:
    template = tmp_path / "g3" / "kv-{agent}.bin"
    return G3Files(
        (tmp_path / "g3" / f"kv-{agent}.bin",),
        BLOCK * 4,
        BLOCK,
        templates=(template,),
        ephemeral=ephemeral,
    )


def test_a_dead_instances_file_is_removed_by_the_next_and_a_live_ones_kept(tmp_path) -> None:
    agent_files(tmp_path, "dead", ephemeral=False).close()  # as after a SIGKILL: left behind
    live = agent_files(tmp_path, "live")
    try:
        assert live.removed_orphans == [tmp_path / "g3" / "kv-dead.bin"]
        newer = agent_files(tmp_path, "newer")  # "live" holds its lock: kept
        assert newer.removed_orphans == []
        assert sorted(p.name for p in (tmp_path / "g3").iterdir()) == [
            "kv-live.bin",
            "kv-newer.bin",
        ]
        newer.close()
    finally:
        live.close()
    # Each removed its own file at close.
    assert list((tmp_path / "g3").iterdir()) == []


def test_only_g3_files_are_removed_never_other_or_empty_files_the_glob_matches(tmp_path) -> None:
    (tmp_path / "g3").mkdir()
    notes = tmp_path / "g3" / "kv-notes.bin"
    notes.write_bytes(b"not a G3 file, but long enough to hold a header" * 4)
    creating = tmp_path / "g3" / "kv-creating.bin"
    creating.touch()  # a file another instance may be about to lock
    g3 = agent_files(tmp_path, "me")
    try:
        assert g3.removed_orphans == []
        assert notes.exists() and creating.exists()
    finally:
        g3.close()


def test_a_file_is_kept_at_close_with_a_guard_or_a_name_not_of_the_instance(tmp_path) -> None:
    agent_files(tmp_path, "guarded", ephemeral=False).close()
    plain = G3Files((tmp_path / "plain.bin",), BLOCK * 4, BLOCK, ephemeral=True)
    plain.close()
    assert (tmp_path / "g3" / "kv-guarded.bin").exists()
    assert (tmp_path / "plain.bin").exists()
    # A guarded instance never sweeps either: the journal may still name those files.
    guarded = agent_files(tmp_path, "other", ephemeral=False)
    try:
        assert guarded.removed_orphans == []
        assert (tmp_path / "g3" / "kv-guarded.bin").exists()
    finally:
        guarded.close()
