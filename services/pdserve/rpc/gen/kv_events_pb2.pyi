from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StorageTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORAGE_TIER_UNSPECIFIED: _ClassVar[StorageTier]
    STORAGE_TIER_DEVICE: _ClassVar[StorageTier]
    STORAGE_TIER_HOST: _ClassVar[StorageTier]
    STORAGE_TIER_DISK: _ClassVar[StorageTier]
STORAGE_TIER_UNSPECIFIED: StorageTier
STORAGE_TIER_DEVICE: StorageTier
STORAGE_TIER_HOST: StorageTier
STORAGE_TIER_DISK: StorageTier

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "tier", "priority", "lora_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    tier: StorageTier
    priority: int
    lora_id: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., tier: _Optional[_Union[StorageTier, str]] = ..., priority: _Optional[int] = ..., lora_id: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: StorageTier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class BlockUpdated(_message.Message):
    __slots__ = ("block_hash", "tier", "priority", "old_tier")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OLD_TIER_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    tier: StorageTier
    priority: int
    old_tier: StorageTier
    def __init__(self, block_hash: _Optional[bytes] = ..., tier: _Optional[_Union[StorageTier, str]] = ..., priority: _Optional[int] = ..., old_tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "updated", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    updated: BlockUpdated
    cleared: AllCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., updated: _Optional[_Union[BlockUpdated, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("epoch", "events")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, epoch: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_hash", "tier")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    tier: StorageTier
    def __init__(self, block_hash: _Optional[bytes] = ..., tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("epoch", "next_seq", "blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    next_seq: int
    blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    def __init__(self, epoch: _Optional[str] = ..., next_seq: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ...) -> None: ...
