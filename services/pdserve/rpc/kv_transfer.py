"""Protobuf conversion for the KvTransfer service (handshake and prefill orders)."""
from pdserve.common.disagg import PrefillOrder, PrefillResult
from pdserve.common.ids import BlockId, WorkerId
from pdserve.rpc import convert
from pdserve.rpc.gen import kv_transfer_pb2 as kpb
from pdserve.rpc.gen import request_pb2 as rpb


def order_to_proto(order: PrefillOrder) -> kpb.PrefillRequest:
    return kpb.PrefillRequest(
        request=convert.request_to_proto(order.request), decode_worker_id=order.decode_worker_id,
        first_block=order.first_block, dest_block_ids=list(order.dest_block_ids), timeout_s=order.timeout_s,
    )


def order_from_proto(msg: kpb.PrefillRequest) -> PrefillOrder:
    return PrefillOrder(
        convert.request_from_proto(msg.request), WorkerId(msg.decode_worker_id), msg.first_block,
        tuple(BlockId(b) for b in msg.dest_block_ids), msg.timeout_s,
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


def handshake(worker_id: WorkerId, metadata: bytes) -> kpb.HandshakeRequest:
    return kpb.HandshakeRequest(worker_id=worker_id, metadata=metadata)


def handshake_reply(worker_id: WorkerId, metadata: bytes) -> kpb.HandshakeResponse:
    return kpb.HandshakeResponse(worker_id=worker_id, metadata=metadata)


__all__ = ["handshake", "handshake_reply", "order_from_proto", "order_to_proto", "result_from_proto",
           "result_to_proto", "rpb"]
