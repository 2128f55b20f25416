"""The internal gRPC plane of `pdserve serve` (mutual TLS by default), called from outside it.

Every method of every worker refuses a caller without a certificate of serve's authority (plain
text, no client certificate, or one of another authority); a caller with a valid certificate of
another identity (the router's) can neither replace a peer nor order writes into a decode
worker's blocks; and requests still complete with KV moved from the prefill worker.
"""
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve.common import pki
from pdserve.common.tls import TlsConfig
from pdserve.rpc.gen import kv_events_pb2, kv_transfer_pb2, request_pb2, worker_pb2
from tests.fuzz.worker_calls import call_raw
from tests.integration.stack import (
    banner_address,
    free_port,
    make_tiny_checkpoint,
    serve_credentials_dir,
    start_serve,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALL_TIMEOUT_S = 10.0
PROMPT = "The history of the city is long. " * 6  # a few blocks: the prefill worker computes it
WORKER_METHODS = [m for m in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods]
EVENT_METHODS = [m for m in kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"].methods]
TRANSFER_METHODS = [m for m in kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].methods]


@dataclass
class Serve:
    process: subprocess.Popen
    url: str
    prefill: str  # gRPC addresses
    decode: str

    @property
    def router_tls(self) -> TlsConfig:
        return TlsConfig.from_dir(serve_credentials_dir(self.process.pid))


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    directory = tmp_path_factory.mktemp("tls-serve")
    checkpoint = make_tiny_checkpoint(directory / "tiny")
    port = free_port()
    process, banner = start_serve(directory, [
        "--model", str(checkpoint), "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "512", "--max-kv-tokens", "4096", "--cache-dir", "", "--startup-timeout", "150"])
    try:
        assert "  internal gRPC: mutual TLS, a throwaway authority for this launch" in banner
        yield Serve(process, f"http://127.0.0.1:{port}", banner_address(banner, "prefill"),
                    banner_address(banner, "decode"))
    finally:
        process.terminate()
        process.wait(60)


def complete(url: str, prompt: str = PROMPT) -> tuple[str, dict[str, str]]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = json.load(response)["choices"][0]["text"]
        header = response.headers["x-pdserve-route"]
    return text, dict(part.split("=", 1) for part in header.split(";"))


def path_of(method) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def outsiders(serve: Serve) -> dict[str, grpc.ChannelCredentials | None]:
    """Callers without a certificate of serve's authority: plain text, TLS that trusts the
    server but shows no certificate, and a certificate of another authority."""
    ours = serve.router_tls
    stranger = pki.Authority.create("another deployment").issue("router")
    return {
        "plain text": None,
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ours.ca_cert),
        "another authority's certificate": grpc.ssl_channel_credentials(
            root_certificates=ours.ca_cert, private_key=stranger.key, certificate_chain=stranger.cert),
    }


def channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def test_a_completion_moves_its_kv_from_the_prefill_worker_over_the_default_tls(serve: Serve) -> None:
    _, route = complete(serve.url)
    assert route["prefilled_by"] == serve.prefill, route


def test_every_method_of_every_worker_refuses_a_caller_without_a_certificate_of_the_authority(serve: Serve) -> None:
    refused = []
    for who, credentials in outsiders(serve).items():
        for address, methods in ((serve.prefill, WORKER_METHODS + EVENT_METHODS + TRANSFER_METHODS),
                                 (serve.decode, WORKER_METHODS + EVENT_METHODS)):
            with channel(address, credentials) as ch:
                for method in methods:
                    code, details = call_raw(ch, path_of(method), b"", method.server_streaming, CALL_TIMEOUT_S, 1)
                    refused.append((who, address, method.name, code))
    assert {code for *_, code in refused} == {grpc.StatusCode.UNAVAILABLE}, [r for r in refused
                                                                          if r[3] != grpc.StatusCode.UNAVAILABLE]
    assert len(refused) == 3 * (2 * len(WORKER_METHODS) + 2 * len(EVENT_METHODS) + len(TRANSFER_METHODS))
    with channel(serve.decode, grpc.ssl_channel_credentials(  # the positive control: serve's own router
            serve.router_tls.ca_cert, serve.router_tls.key, serve.router_tls.cert)) as ch:
        code, _ = call_raw(ch, "/pdserve.v1.Worker/GetInfo", b"", False, CALL_TIMEOUT_S)
    assert code == grpc.StatusCode.OK


def test_another_identity_cannot_replace_a_peer_or_order_writes_into_its_blocks(serve: Serve) -> None:
    before, _ = complete(serve.url)
    tls = serve.router_tls
    assert tls.identity == "router"
    decode_id = f"decode@{serve.decode}"
    credentials = grpc.ssl_channel_credentials(tls.ca_cert, tls.key, tls.cert)
    handshake = kv_transfer_pb2.HandshakeRequest(worker_id=decode_id, metadata=b"x", order_key=b"k" * 32)
    order = kv_transfer_pb2.PrefillRequest(
        request=request_pb2.GenerateRequest(request_id="forged", prompt_token_ids=list(range(1, 40)),
                                            sampling=request_pb2.SamplingParams(max_tokens=1, n=1, top_p=1.0)),
        decode_worker_id=decode_id, first_block=0, dest_block_ids=[0, 1], timeout_s=5.0, grant=b"g" * 32)
    with grpc.secure_channel(serve.prefill, credentials) as ch:
        for path, message in (("/pdserve.v1.KvTransfer/Handshake", handshake),
                              ("/pdserve.v1.KvTransfer/Prefill", order)):
            code, details = call_raw(ch, path, message.SerializeToString(), False, CALL_TIMEOUT_S)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (path, code, details)
            assert "identity 'router' may not" in details and decode_id in details
        own = kv_transfer_pb2.HandshakeRequest(worker_id="router", metadata=b"x", deployment_id="another")
        code, details = call_raw(ch, "/pdserve.v1.KvTransfer/Handshake", own.SerializeToString(), False,
                                 CALL_TIMEOUT_S)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "deployment 'another'" in details
    after, _ = complete(serve.url)  # the decode worker's cached blocks are as they were
    assert after == before
    _, route = complete(serve.url, "A new prompt, not cached anywhere yet. " * 5)
    assert route["prefilled_by"] == serve.prefill  # the decode worker's peer is still the prefill worker
    for address in (serve.prefill, serve.decode):
        with grpc.secure_channel(address, credentials) as ch:
            reply = ch.unary_unary("/pdserve.v1.Worker/CheckKvIntegrity",
                                   response_deserializer=worker_pb2.CheckKvIntegrityResponse.FromString)(
                worker_pb2.CheckKvIntegrityRequest().SerializeToString(), timeout=CALL_TIMEOUT_S)
            assert reply.ok, (address, reply)
