"""The fuzzed stack, and calls on a worker's gRPC port shared by the fuzz tests: a raw call with bytes in and out (no
(de)serialization, so any payload reaches the server), and the soundness check after a fuzz run."""
import time
from dataclasses import dataclass

import grpc

from pdserve.rpc.gen import request_pb2, worker_pb2, worker_pb2_grpc

SOUND_WITHIN_S = 30.0  # aborted requests free their blocks on the engine thread's next turns
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
MAX_TOKENS = 8


@dataclass(frozen=True)
class Baseline:
    """A worker before any fuzzing: its KV self-check at rest and its greedy answer to a fixed prompt."""

    integrity: worker_pb2.CheckKvIntegrityResponse
    tokens: list[int]


@dataclass(frozen=True)
class FuzzStack:
    router_url: str
    worker: str  # role both, behind the router
    prefill_worker: str
    decode_worker: str
    baselines: dict[str, Baseline]  # by worker address


def call_raw(channel: grpc.Channel, path: str, payload: bytes, is_stream: bool, timeout_s: float,
             max_messages: int = 4) -> tuple[grpc.StatusCode, str]:
    """Call `path` with `payload`; its status code and details. A stream is read for at most
    `max_messages` messages, then cancelled (code CANCELLED, details "")."""
    try:
        if not is_stream:
            channel.unary_unary(path)(payload, timeout=timeout_s)
            return grpc.StatusCode.OK, ""
        call = channel.unary_stream(path)(payload, timeout=timeout_s)
        for count, _ in enumerate(call, 1):
            if count >= max_messages:
                call.cancel()
                return grpc.StatusCode.CANCELLED, ""
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""


def greedy_tokens(address: str, request_id: str) -> list[int]:
    """The tokens a normal greedy request for `PROMPT` gets."""
    request = request_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT,
        sampling=request_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, n=1, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        outputs = list(worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60))
    assert outputs[-1].finish_reason == request_pb2.FINISH_REASON_LENGTH, outputs[-1]
    return [token for output in outputs for token in output.token_ids]


def integrity(address: str) -> worker_pb2.CheckKvIntegrityResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).CheckKvIntegrity(worker_pb2.CheckKvIntegrityRequest(), timeout=30)


def assert_worker_sound(address: str, baseline: worker_pb2.CheckKvIntegrityResponse, tokens: list[int]) -> None:
    """Within `SOUND_WITHIN_S`: the KV bookkeeping is intact with the blocks in use at `baseline`
    and nothing held for a peer; then a normal request still gets `tokens`."""
    deadline = time.monotonic() + SOUND_WITHIN_S
    report = integrity(address)
    while (report.num_used_blocks, report.num_held_for_peer) != (baseline.num_used_blocks, 0):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        report = integrity(address)
    assert (report.ok, report.error) == (True, "")
    assert (report.num_used_blocks, report.num_held_for_peer) == (baseline.num_used_blocks, 0)
    assert greedy_tokens(address, f"sound-{time.monotonic_ns()}") == tokens
