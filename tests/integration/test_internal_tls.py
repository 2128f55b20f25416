"""The internal gRPC plane of `pdserve serve` (mutual TLS by default), called from outside it.

Every method of every worker refuses a caller without a certificate of serve's authority (plain
text, no client certificate, or one of another authority); a caller with a valid certificate of
another role (the router's) or of another identity (the decode worker's, speaking for another)
can neither replace a peer nor order writes into a decode worker's blocks; a decode worker
reaches a prefill worker only under the id the router learned from it; and requests still
complete with KV moved from the prefill worker.
"""
import asyncio
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve.common import pki
from pdserve.common.ids import RequestId, WorkerId
from pdserve.common.request import GenerationRequest, SamplingParams
from pdserve.common.tls import TlsConfig
from pdserve.rpc.gen import kv_events_pb2, kv_transfer_pb2, request_pb2, worker_pb2
from pdserve.rpc.worker_client import GrpcBackend
from tests.fuzz.worker_calls import call_raw
from tests.integration.stack import (
    banner_address,
    children_of,
    command_of,
    free_port,
    make_tiny_checkpoint,
    serve_credentials_dir,
    start_serve,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALL_TIMEOUT_S = 10.0
PROMPT = "The history of the city is long. " * 6  # a few blocks: the prefill worker computes it
WORKER_METHODS = [m for m in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods]
LORA_METHODS = [m for m in worker_pb2.DESCRIPTOR.services_by_name["LoraAdapters"].methods]
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

    def credentials_of(self, role: pki.Role) -> TlsConfig:
        """The credentials serve gave its process of `role` (from its --tls-dir)."""
        for pid in children_of(self.process.pid):
            args = command_of(pid).split()
            if "--tls-dir" in args and (tls := TlsConfig.from_dir(args[args.index("--tls-dir") + 1])).role == role:
                return tls
        raise AssertionError(f"serve runs no process of role {role}")


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
    stranger = pki.Authority.create("another deployment").issue("router", pki.Role.ROUTER)
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


def test_a_decode_worker_reaches_the_prefill_worker_only_under_the_id_the_router_learned_from_it(serve: Serve) -> None:
    """The prefill worker's GetInfo names its id, its certificate's identity, and the router
    passes it on. Told another id for that address, as after another worker claimed it there,
    the decode worker prefills the prompt itself: the certificate answering is not that worker's."""
    async def scenario() -> tuple[WorkerId | None, list[str]]:
        prefill = GrpcBackend(serve.prefill, rpc_timeout_s=CALL_TIMEOUT_S, tls=serve.router_tls)
        decode = GrpcBackend(serve.decode, rpc_timeout_s=CALL_TIMEOUT_S, generate_timeout_s=60.0,
                             tls=serve.router_tls)
        try:
            learned = (await prefill.info()).worker_id
            prefilled_by = []
            for i, told in enumerate([WorkerId("prefill@10.0.0.9:50051"), learned]):
                prompt = tuple(range(1000 + 100 * i, 1064 + 100 * i))  # 64 tokens no worker has cached
                request = GenerationRequest(RequestId(f"told-{i}"), prompt, SamplingParams(max_tokens=2))
                outputs = [out async for out in decode.generate(request, serve.prefill, told)]
                prefilled_by.append(outputs[0].prefilled_by)
            return learned, prefilled_by
        finally:
            await prefill.close()
            await decode.close()

    learned, prefilled_by = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert learned == serve.credentials_of(pki.Role.PREFILL).identity == f"prefill@{serve.prefill}"
    assert prefilled_by == ["local", serve.prefill]


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


def test_a_prefill_workers_certificate_calls_nothing_of_the_routers_on_a_decode_worker(serve: Serve) -> None:
    """Not Generate naming a prefill address of its choosing, nor Abort, nor adapters, nor KV events."""
    prefill = serve.credentials_of(pki.Role.PREFILL)
    credentials = grpc.ssl_channel_credentials(prefill.ca_cert, prefill.key, prefill.cert)
    with grpc.secure_channel(serve.decode, credentials) as ch:
        refused = {method.name: call_raw(ch, path_of(method), b"", method.server_streaming, CALL_TIMEOUT_S, 1)
                   for method in WORKER_METHODS + LORA_METHODS + EVENT_METHODS}
    assert {name: code for name, (code, _) in refused.items()} == {
        name: grpc.StatusCode.PERMISSION_DENIED for name in refused}
    assert refused["Generate"][1].endswith(
        f"/pdserve.v1.Worker/Generate is open to router; the caller 'prefill@{serve.prefill}' has role 'prefill'")


def forged(worker_id: str, deployment_id: str = "") -> list[tuple[str, bytes]]:
    """A handshake as `worker_id`, and an order to write into its blocks 0 and 1."""
    handshake = kv_transfer_pb2.HandshakeRequest(worker_id=worker_id, metadata=b"x", order_key=b"k" * 32,
                                                 deployment_id=deployment_id)
    order = kv_transfer_pb2.PrefillRequest(
        request=request_pb2.GenerateRequest(request_id="forged", prompt_token_ids=list(range(1, 40)),
                                            sampling=request_pb2.SamplingParams(max_tokens=1, n=1, top_p=1.0)),
        decode_worker_id=worker_id, first_block=0, dest_block_ids=[0, 1], grant=b"g" * 32)
    return [("/pdserve.v1.KvTransfer/Handshake", handshake.SerializeToString()),
            ("/pdserve.v1.KvTransfer/Prefill", order.SerializeToString())]


def test_another_role_or_identity_cannot_replace_a_peer_or_order_writes_into_its_blocks(serve: Serve) -> None:
    before, _ = complete(serve.url)
    router, decode = serve.router_tls, serve.credentials_of(pki.Role.DECODE)
    assert (router.identity, decode.identity) == ("router", f"decode@{serve.decode}")
    credentials = grpc.ssl_channel_credentials(router.ca_cert, router.key, router.cert)
    with grpc.secure_channel(serve.prefill, credentials) as ch:  # the router's certificate: not a decode worker
        for path, message in forged(decode.identity):
            code, details = call_raw(ch, path, message, False, CALL_TIMEOUT_S)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (path, code, details)
            assert details.endswith(f"{path} is open to decode; the caller 'router' has role 'router'"), details
    prefill_id = f"prefill@{serve.prefill}"
    credentials = grpc.ssl_channel_credentials(decode.ca_cert, decode.key, decode.cert)
    with grpc.secure_channel(serve.prefill, credentials) as ch:
        for path, message in forged(prefill_id):  # a decode worker's certificate speaks for it alone
            code, details = call_raw(ch, path, message, False, CALL_TIMEOUT_S)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (path, code, details)
            assert f"identity {decode.identity!r} may not" in details and prefill_id in details
        (_, handshake), _ = forged(decode.identity, deployment_id="another")
        code, details = call_raw(ch, "/pdserve.v1.KvTransfer/Handshake", handshake, False, CALL_TIMEOUT_S)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "deployment 'another'" in details
    after, _ = complete(serve.url)  # the decode worker's cached blocks are as they were
    assert after == before
    _, route = complete(serve.url, "A new prompt, not cached anywhere yet. " * 5)
    assert route["prefilled_by"] == serve.prefill  # the decode worker's peer is still the prefill worker
    credentials = grpc.ssl_channel_credentials(router.ca_cert, router.key, router.cert)
    for address in (serve.prefill, serve.decode):
        with grpc.secure_channel(address, credentials) as ch:
            reply = ch.unary_unary("/pdserve.v1.Worker/CheckKvIntegrity",
                                   response_deserializer=worker_pb2.CheckKvIntegrityResponse.FromString)(
                worker_pb2.CheckKvIntegrityRequest().SerializeToString(), timeout=CALL_TIMEOUT_S)
            assert reply.ok, (address, reply)
