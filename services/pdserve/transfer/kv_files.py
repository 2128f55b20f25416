"""The disk tier's files: one per KV block, `<folder>/<fingerprint>/<block key hex>.kv`.

A file is a 4 KiB header — a magic line and JSON: the block key, its parent's, its retention
priority, the payload's size and BLAKE2b checksum — then the block's bytes (written and read
through NIXL's POSIX back end, `nixl_files.py`). A file is written under a temporary name and
renamed into place, so a crash leaves no half-written block under a block key. The fingerprint
names the model, the KV block format and the block-key algorithm: files of another model or
format sit in another folder and are never read as this one's. A block file of this fingerprint
whose header does not read, or whose bytes do not match it, is a miss: counted and removed.
Anything else in the folder is left alone. The folders must belong to this user and be
writable by no one else (else another user could plant blocks); temporary files are created
new, never through a link.
"""
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import ConfigError
from pdserve.common.ids import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"pdserve-kv-block v1\n"
HEADER_BYTES = 4096
SUFFIX = ".kv"


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a block file's header says."""

    block_hash: BlockHash
    parent: BlockHash | None
    priority: int
    num_bytes: int
    checksum: str
    mtime: float = 0.0


def fingerprint(identity: dict[str, object]) -> str:
    """A folder name for one model + KV format + block-key algorithm."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def checksum(payload: memoryview | bytes) -> str:
    return hashlib.blake2b(payload, digest_size=32).hexdigest()


class BlockFiles:
    """The block files of one fingerprint under `root`."""

    def __init__(self, root: str | Path, fingerprint_hex: str, bytes_per_block: int) -> None:
        self.root = Path(root)
        self.folder = self.root / fingerprint_hex
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for folder in (self.root, self.folder):
            _check_private(folder)
        self.bytes_per_block = bytes_per_block
        self.num_corrupt_at_start = 0

    def path(self, block_hash: BlockHash) -> Path:
        return self.folder / f"{block_hash.hex()}{SUFFIX}"

    def create(self, record: BlockRecord) -> tuple[int, Path]:
        """An open temporary file with `record`'s header, sized for the payload; (fd, its path)."""
        temporary = self.folder / f".{record.block_hash.hex()}.{os.getpid()}.tmp"
        temporary.unlink(missing_ok=True)  # one an earlier process of this pid left (never followed)
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.ftruncate(fd, HEADER_BYTES + record.num_bytes)
        os.pwrite(fd, _header(record), 0)
        return fd, temporary

    def commit(self, temporary: Path, block_hash: BlockHash) -> None:
        os.replace(temporary, self.path(block_hash))

    def open_for_read(self, block_hash: BlockHash) -> int:
        return os.open(self.path(block_hash), os.O_RDONLY | os.O_NOFOLLOW)

    def header_of(self, fd: int, block_hash: BlockHash) -> BlockRecord:
        """The header of an open block file, checked against the block it should hold (OSError if not)."""
        record = _parse(os.pread(fd, HEADER_BYTES, 0))
        if record is None or record.block_hash != block_hash or record.num_bytes != self.bytes_per_block:
            raise OSError(f"{self.path(block_hash).name}: not a header of this block")
        return record

    def delete(self, block_hash: BlockHash) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def verify(self, block_hash: BlockHash) -> bool:
        """The file holds a whole block whose bytes match its header's checksum."""
        try:
            fd = self.open_for_read(block_hash)
            with open(fd, "rb") as f:
                record = _parse(f.read(HEADER_BYTES))
                payload = f.read()
        except OSError:
            return False
        return (record is not None and record.block_hash == block_hash and record.num_bytes == len(payload)
                == self.bytes_per_block and checksum(payload) == record.checksum)

    def scan(self) -> list[BlockRecord]:
        """Every block file of this fingerprint whose header reads, parents before children,
        most recently written first among equals. Unreadable ones are counted and removed; other
        files are left alone with a warning."""
        records, strangers = [], []
        for path in sorted(self.folder.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                continue  # a write a crash interrupted; it never reached its name
            if path.suffix != SUFFIX:
                strangers.append(path.name)
                continue
            try:
                with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                    record = _parse(f.read(HEADER_BYTES))
                    stat = os.fstat(f.fileno())
            except OSError:
                record = None
            if (record is None or record.num_bytes != self.bytes_per_block
                    or stat.st_size != HEADER_BYTES + record.num_bytes or path.stem != record.block_hash.hex()):
                self.num_corrupt_at_start += 1
                log.warning("disk KV cache: %s is not a whole block file; removed", path)
                path.unlink(missing_ok=True)
                continue
            records.append(BlockRecord(record.block_hash, record.parent, record.priority, record.num_bytes,
                                       record.checksum, stat.st_mtime))
        if strangers:
            log.warning("disk KV cache: %d files in %s are not block files; left alone (e.g. %s)",
                        len(strangers), self.folder, strangers[0])
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p != self.folder]
        if others:
            log.info("disk KV cache: %d folders of other models or formats in %s left alone", len(others), self.root)
        return _parents_first(records)


def _header(record: BlockRecord) -> bytes:
    body = json.dumps({"block_hash": record.block_hash.hex(), "parent": record.parent.hex() if record.parent else None,
                       "priority": record.priority, "num_bytes": record.num_bytes, "checksum": record.checksum})
    header = MAGIC + body.encode() + b"\n"
    if len(header) > HEADER_BYTES:
        raise ValueError("block header too long")
    return header.ljust(HEADER_BYTES, b"\0")


def _parse(header: bytes) -> BlockRecord | None:
    """The header's record; None for anything that is not one (whatever JSON it holds)."""
    if len(header) != HEADER_BYTES or not header.startswith(MAGIC):
        return None
    try:
        data = json.loads(header[len(MAGIC):].split(b"\n", 1)[0])
        parent = data["parent"]
        return BlockRecord(BlockHash(bytes.fromhex(data["block_hash"])),
                           BlockHash(bytes.fromhex(parent)) if parent else None,
                           int(data["priority"]), int(data["num_bytes"]), str(data["checksum"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_private(folder: Path) -> None:
    """Refuse a folder of another user's, or one others may write to."""
    info = folder.stat()
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ConfigError("disk_cache_dir", str(folder),
                          f"owned by uid {info.st_uid} with mode {info.st_mode & 0o777:o}: the disk KV tier needs "
                          f"a folder of this user's (uid {os.geteuid()}) that no one else may write to")


def _parents_first(records: list[BlockRecord]) -> list[BlockRecord]:
    by_key = {r.block_hash: r for r in records}
    depth: dict[BlockHash, int] = {}

    def depth_of(key: BlockHash) -> int:
        chain, current = [], key
        while current in by_key and current not in depth and current not in chain:
            chain.append(current)
            current = by_key[current].parent  # type: ignore[assignment]
        base = depth.get(current, 0) if current is not None else 0
        for i, k in enumerate(reversed(chain)):
            depth[k] = base + i + 1
        return depth[key]

    return sorted(records, key=lambda r: (depth_of(r.block_hash), -r.mtime))
