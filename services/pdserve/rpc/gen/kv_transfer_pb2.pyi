from pdserve.rpc.gen import request_pb2 as _request_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("worker_id", "metadata", "deployment_id", "order_key", "lora_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ORDER_KEY_FIELD_NUMBER: _ClassVar[int]
    LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    metadata: bytes
    deployment_id: str
    order_key: bytes
    lora_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., metadata: _Optional[bytes] = ..., deployment_id: _Optional[str] = ..., order_key: _Optional[bytes] = ..., lora_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("worker_id", "metadata", "deployment_id", "lora_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    metadata: bytes
    deployment_id: str
    lora_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., metadata: _Optional[bytes] = ..., deployment_id: _Optional[str] = ..., lora_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "decode_worker_id", "first_block", "dest_block_ids", "deadline", "start_by", "nonce", "grant")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DEST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    START_BY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    request: _request_pb2.GenerateRequest
    decode_worker_id: str
    first_block: int
    dest_block_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline: float
    start_by: float
    nonce: bytes
    grant: bytes
    def __init__(self, request: _Optional[_Union[_request_pb2.GenerateRequest, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., first_block: _Optional[int] = ..., dest_block_ids: _Optional[_Iterable[int]] = ..., deadline: _Optional[float] = ..., start_by: _Optional[float] = ..., nonce: _Optional[bytes] = ..., grant: _Optional[bytes] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "logprob", "num_cached_tokens", "num_blocks", "num_bytes")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: _request_pb2.TokenLogprob
    num_cached_tokens: int
    num_blocks: int
    num_bytes: int
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[_Union[_request_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...
