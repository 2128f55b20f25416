"""pdserve.transfer: moves KV blocks between workers (see docs/transfer.md).

`KvTransport` is the interface; `nixl_transport.NixlTransport` the implementation (import it
from its module: it loads NIXL); `fake.FakeTransport` a test double for failure paths.
"""
from pdserve.transfer.interface import KvTransport, Notification, TransferHandle, TransferState
from pdserve.transfer.layout import KvLayoutSpec, check_compatible

__all__ = ["KvLayoutSpec", "KvTransport", "Notification", "TransferHandle", "TransferState", "check_compatible"]
