"""Protobuf conversion for the KvTransfer service (handshake and prefill orders)."""
from pdserve.common.disagg import Hello, PrefillOrder, PrefillResult
from pdserve.common.ids import BlockId, WorkerId
from pdserve.rpc import convert
from pdserve.rpc.gen import kv_transfer_pb2 as kpb
from pdserve.rpc.gen import request_pb2 as rpb


def order_to_proto(order: PrefillOrder) -> kpb.PrefillRequest:
    return kpb.PrefillRequest(
        request=convert.request_to_proto(order.request), decode_worker_id=order.decode_worker_id,
        first_block=order.first_block, dest_block_ids=list(order.dest_block_ids), deadline=order.deadline,
        start_by=order.start_by, nonce=order.nonce, grant=order.grant,
    )


def order_from_proto(msg: kpb.PrefillRequest) -> PrefillOrder:
    return PrefillOrder(
        convert.request_from_proto(msg.request), WorkerId(msg.decode_worker_id), msg.first_block,
        tuple(BlockId(b) for b in msg.dest_block_ids), msg.deadline, msg.start_by, msg.nonce, msg.grant,
    )


def result_to_proto(result: PrefillResult) -> kpb.PrefillResponse:
    msg = kpb.PrefillResponse(first_token=result.first_token, num_cached_tokens=result.num_cached_tokens,
                              num_blocks=result.num_blocks, num_bytes=result.num_bytes)
    if result.logprob is not None:
        msg.logprob.CopyFrom(convert.logprob_to_proto(result.logprob))
    return msg


def result_from_proto(msg: kpb.PrefillResponse) -> PrefillResult:
    logprob = convert.logprob_from_proto(msg.logprob) if msg.HasField("logprob") else None
    return PrefillResult(msg.first_token, logprob, msg.num_cached_tokens, msg.num_blocks, msg.num_bytes)


def hello_to_request(hello: Hello) -> kpb.HandshakeRequest:
    return kpb.HandshakeRequest(worker_id=hello.worker_id, metadata=hello.metadata,
                                deployment_id=hello.deployment_id, order_key=hello.order_key,
                                lora_ids=sorted(hello.lora_ids))


def hello_from_request(msg: kpb.HandshakeRequest) -> Hello:
    return Hello(WorkerId(msg.worker_id), msg.metadata, msg.deployment_id, msg.order_key, frozenset(msg.lora_ids))


def hello_to_reply(hello: Hello) -> kpb.HandshakeResponse:
    return kpb.HandshakeResponse(worker_id=hello.worker_id, metadata=hello.metadata,
                                 deployment_id=hello.deployment_id, lora_ids=sorted(hello.lora_ids))


def hello_from_reply(msg: kpb.HandshakeResponse) -> Hello:
    return Hello(WorkerId(msg.worker_id), msg.metadata, msg.deployment_id, lora_ids=frozenset(msg.lora_ids))


__all__ = ["hello_from_reply", "hello_from_request", "hello_to_reply", "hello_to_request", "order_from_proto", "order_to_proto", "result_from_proto",
           "result_to_proto", "rpb"]
