"""Block payloads between host memory and files through NIXL's POSIX back end.

One NIXL agent of its own (POSIX only) per worker, with the host buffers registered once; each
file is registered for one transfer and released after it. A transfer is bounded by
`timeout_s`: one still running then is an error, and the caller treats the block as missing.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import nixl  # noqa: F401  (loads the backend package that nixl._api aliases)
from nixl._api import nixl_agent, nixl_agent_config

from pdserve.common.errors import TransferError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
POLL_S = 0.0002


class NixlFileIO:
    """READ and WRITE between registered host tensors and file descriptors."""

    def __init__(self, name: str, buffers: list[torch.Tensor], timeout_s: float = 30.0) -> None:
        self._agent = nixl_agent(name, nixl_agent_config(backends=["POSIX"]))
        self._name = name
        self._registered = self._agent.register_memory(buffers)
        self._timeout_s = timeout_s

    def write(self, source: torch.Tensor, fd: int, offset: int) -> None:
        self._transfer("WRITE", source, fd, offset)

    def read(self, destination: torch.Tensor, fd: int, offset: int) -> None:
        self._transfer("READ", destination, fd, offset)

    def _transfer(self, op: str, local: torch.Tensor, fd: int, offset: int) -> None:
        num_bytes = local.numel() * local.element_size()
        file_region = [(offset, num_bytes, fd, "")]
        registered = self._agent.register_memory(file_region, "FILE")
        handle = None
        try:
            handle = self._agent.initialize_xfer(op, self._agent.get_xfer_descs([local]),
                                                 self._agent.get_xfer_descs([(offset, num_bytes, fd)], "FILE"),
                                                 self._name)
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self._timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"disk {op} of {num_bytes} bytes did not finish within {self._timeout_s:g} s")
                time.sleep(POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"disk {op} of {num_bytes} bytes failed")
        except TransferError:
            raise
        except Exception as exc:  # NIXL raises its own error types
            raise TransferError(f"disk {op} failed: {exc}") from exc
        finally:
            if handle is not None:
                self._agent.release_xfer_handle(handle)
            self._agent.deregister_memory(registered)

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)
