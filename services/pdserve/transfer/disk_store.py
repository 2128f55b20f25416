"""The disk tier's bytes: block files written from host-tier slots and read back into device
blocks, through NIXL's POSIX back end (`nixl_files.py`; file format in `kv_files.py`)."""
import os

import torch

from pdserve.common.ids import BlockHash
from pdserve.transfer.kv_files import HEADER_BYTES, BlockFiles, BlockRecord, checksum


class DiskKvStore:
    """Spills host slots to files and loads files into blocks, staging through one host block."""

    def __init__(self, files: BlockFiles, host_slots: torch.Tensor, name: str) -> None:
        self.files = files
        self._host_slots = host_slots
        self._staging = torch.empty_like(host_slots[0])
        from pdserve.transfer.nixl_files import NixlFileIO  # NIXL is loaded only by a worker with a disk tier
        self._io = NixlFileIO(f"{name}-disk", [host_slots, self._staging])

    def spill(self, slot: int, block_hash: BlockHash, parent: BlockHash | None, priority: int) -> None:
        payload = self._host_slots[slot]
        raw = payload.view(torch.uint8).numpy()
        record = BlockRecord(block_hash, parent, priority, raw.nbytes, checksum(raw))
        fd, temporary = self.files.create(record)
        try:
            self._io.write(payload, fd, HEADER_BYTES)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.files.commit(temporary, block_hash)

    def load_into(self, block_hash: BlockHash, destination: torch.Tensor) -> None:
        """Read the block's file into `destination`; OSError, `destination` untouched, where the file
        is not this block's or its bytes do not match its header."""
        fd = self.files.open_for_read(block_hash)
        try:
            record = self.files.header_of(fd, block_hash)
            self._io.read(self._staging, fd, HEADER_BYTES)
        finally:
            os.close(fd)
        if checksum(self._staging.view(torch.uint8).numpy()) != record.checksum:
            raise OSError(f"{block_hash.hex()[:16]}: the block's bytes do not match its checksum")
        destination.copy_(self._staging)

    def close(self) -> None:
        self._io.close()
