"""Block files of the disk tier: header round trip, checksums, what a scan takes, removes or
leaves, and the folders and links it refuses."""
import os

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.ids import BlockHash
from pdserve.transfer.kv_files import HEADER_BYTES, MAGIC, BlockFiles, BlockRecord, checksum

SIZE = 64


def key(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def write(files: BlockFiles, i: int, parent: int | None, payload: bytes = bytes(range(SIZE))) -> None:
    record = BlockRecord(key(i), key(parent) if parent is not None else None, 40 + i, SIZE, checksum(payload))
    fd, temporary = files.create(record)
    os.pwrite(fd, payload, HEADER_BYTES)
    os.close(fd)
    files.commit(temporary, key(i))


def test_a_scan_reads_headers_parents_first_and_verify_checks_the_bytes(tmp_path):
    files = BlockFiles(tmp_path, "fp", SIZE)
    write(files, 3, 2)
    write(files, 1, None)
    write(files, 2, 1)
    records = files.scan()
    assert [(r.block_hash, r.parent, r.priority) for r in records] == [
        (key(1), None, 41), (key(2), key(1), 42), (key(3), key(2), 43)]
    assert files.verify(key(2))
    with open(files.path(key(2)), "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(b"\xff")
    assert not files.verify(key(2)) and files.verify(key(3))


def test_a_truncated_block_file_is_removed_unfinished_and_foreign_files_are_left_alone(tmp_path):
    files = BlockFiles(tmp_path, "fp", SIZE)
    write(files, 1, None)
    write(files, 2, None)
    os.truncate(files.path(key(2)), HEADER_BYTES + 10)  # a crash mid-copy, or a full disk
    (files.folder / ".abc.123.tmp").write_bytes(b"half")
    (files.folder / "README").write_text("mine")
    assert [r.block_hash for r in files.scan()] == [key(1)]
    assert files.num_corrupt_at_start == 1
    assert not files.path(key(2)).exists() and (files.folder / "README").read_text() == "mine"
    assert (files.folder / ".abc.123.tmp").exists()
    assert not files.verify(key(2))
    files.delete(key(1))
    assert not files.path(key(1)).exists()


@pytest.mark.parametrize("body", [b"{}", b"[1, 2]", b'"text"', b'{"block_hash": 7, "parent": null}', b"{not json"])
def test_a_header_of_any_other_json_is_a_miss_counted_and_removed(tmp_path, body):
    files = BlockFiles(tmp_path, "fp", SIZE)
    write(files, 1, None)
    bad = files.path(key(2))
    bad.write_bytes((MAGIC + body + b"\n").ljust(HEADER_BYTES, b"\0") + bytes(SIZE))
    assert [r.block_hash for r in files.scan()] == [key(1)]
    assert files.num_corrupt_at_start == 1 and not bad.exists()
    assert not files.verify(key(2))


@pytest.mark.parametrize("which", ["root", "folder"])
def test_a_folder_others_may_write_to_is_refused(tmp_path, which):
    BlockFiles(tmp_path, "fp", SIZE)
    (tmp_path if which == "root" else tmp_path / "fp").chmod(0o777)
    with pytest.raises(ConfigError, match="no one else may write to"):
        BlockFiles(tmp_path, "fp", SIZE)


def test_links_are_never_followed(tmp_path):
    files = BlockFiles(tmp_path / "disk", "fp", SIZE)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    planted = files.folder / f".{key(1).hex()}.{os.getpid()}.tmp"  # where the next write of block 1 starts
    planted.symlink_to(outside)
    write(files, 1, None)
    assert outside.read_bytes() == b"keep" and files.verify(key(1))
    files.path(key(2)).symlink_to(files.path(key(1)))  # a block file that is a link to another
    assert not files.verify(key(2))
    with pytest.raises(OSError):
        files.open_for_read(key(2))
    assert [r.block_hash for r in files.scan()] == [key(1)] and files.num_corrupt_at_start == 1
