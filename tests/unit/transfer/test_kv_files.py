"""Block files of the disk tier: header round trip, checksums, and what a scan takes or leaves."""
import os

from pdserve.common.ids import BlockHash
from pdserve.transfer.kv_files import HEADER_BYTES, BlockFiles, BlockRecord, checksum

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


def test_truncated_unfinished_and_foreign_files_are_left_alone(tmp_path):
    files = BlockFiles(tmp_path, "fp", SIZE)
    write(files, 1, None)
    write(files, 2, None)
    os.truncate(files.path(key(2)), HEADER_BYTES + 10)  # a crash mid-copy, or a full disk
    (files.folder / ".abc.123.tmp").write_bytes(b"half")
    (files.folder / "README").write_text("mine")
    assert [r.block_hash for r in files.scan()] == [key(1)]
    assert files.num_corrupt_at_start == 1
    assert files.path(key(2)).exists() and (files.folder / "README").read_text() == "mine"
    assert not files.verify(key(2))
    files.delete(key(1))
    assert not files.path(key(1)).exists()
