from pdserve.rpc.gen import request_pb2 as _request_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATUS_UNSPECIFIED: _ClassVar[ServingStatus]
    SERVING_STATUS_SERVING: _ClassVar[ServingStatus]
    SERVING_STATUS_NOT_SERVING: _ClassVar[ServingStatus]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
SERVING_STATUS_UNSPECIFIED: ServingStatus
SERVING_STATUS_SERVING: ServingStatus
SERVING_STATUS_NOT_SERVING: ServingStatus
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class StreamOutputsRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class OutputBatch(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_request_pb2.RequestOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[_request_pb2.RequestOutput, _Mapping]]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "lora_id", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    lora_id: int
    path: str
    def __init__(self, name: _Optional[str] = ..., lora_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckKvIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckKvIntegrityResponse(_message.Message):
    __slots__ = ("ok", "error", "num_held_for_peer", "num_used_blocks")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FOR_PEER_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    num_held_for_peer: int
    num_used_blocks: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., num_held_for_peer: _Optional[int] = ..., num_used_blocks: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status: ServingStatus
    reason: str
    def __init__(self, status: _Optional[_Union[ServingStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "num_used_blocks", "num_prefill_tokens_queued", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_preemptions", "num_host_blocks", "num_host_cached_blocks", "num_offloaded_blocks", "num_onboarded_blocks", "num_disk_blocks", "num_disk_cached_blocks", "num_spilled_blocks", "num_loaded_blocks", "num_corrupt_disk_blocks", "num_host_cached_bytes", "num_disk_cached_bytes", "prefix_cache_host_hit_tokens", "prefix_cache_disk_hit_tokens", "num_dropped_by_priority")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ONBOARDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_DISK_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_used_blocks: int
    num_prefill_tokens_queued: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_host_blocks: int
    num_host_cached_blocks: int
    num_offloaded_blocks: int
    num_onboarded_blocks: int
    num_disk_blocks: int
    num_disk_cached_blocks: int
    num_spilled_blocks: int
    num_loaded_blocks: int
    num_corrupt_disk_blocks: int
    num_host_cached_bytes: int
    num_disk_cached_bytes: int
    prefix_cache_host_hit_tokens: int
    prefix_cache_disk_hit_tokens: int
    num_dropped_by_priority: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_prefill_tokens_queued: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_host_cached_blocks: _Optional[int] = ..., num_offloaded_blocks: _Optional[int] = ..., num_onboarded_blocks: _Optional[int] = ..., num_disk_blocks: _Optional[int] = ..., num_disk_cached_blocks: _Optional[int] = ..., num_spilled_blocks: _Optional[int] = ..., num_loaded_blocks: _Optional[int] = ..., num_corrupt_disk_blocks: _Optional[int] = ..., num_host_cached_bytes: _Optional[int] = ..., num_disk_cached_bytes: _Optional[int] = ..., prefix_cache_host_hit_tokens: _Optional[int] = ..., prefix_cache_disk_hit_tokens: _Optional[int] = ..., num_dropped_by_priority: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: EngineStats
    def __init__(self, stats: _Optional[_Union[EngineStats, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "max_model_len", "tokens_per_block", "block_hash_algorithm", "role", "vocab_size", "eos_token_ids", "lora_adapters", "lora_enabled", "max_loras")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    tokens_per_block: int
    block_hash_algorithm: str
    role: WorkerRole
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    lora_enabled: bool
    max_loras: int
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., block_hash_algorithm: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., lora_enabled: _Optional[bool] = ..., max_loras: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("info", "deployment_id", "worker_id")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    deployment_id: str
    worker_id: str
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., deployment_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...
