"""API keys and tenants through real processes on loopback: a `pdserve worker` (role both, tiny
checkpoint, prefix caching on) behind a `pdserve router` with a keys file (tenants acme and
bolt) and `PDSERVE_API_KEY` (tenant default); and `pdserve serve` handing the key options to
its router. Cache isolation is read from `usage.prompt_tokens_details.cached_tokens`."""
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.router.openai.access.tenants import Tenant, effective_cache_salt
from tests.integration.stack import (
    PDSERVE,
    START_TIMEOUT_S,
    children_of,
    command_of,
    free_port,
    make_tiny_checkpoint,
    start,
    stop,
    wait_for_worker,
)

pytestmark = pytest.mark.integration
ACME_KEY, BOLT_KEY, DEFAULT_KEY = "sk-acme-0123456789", "sk-bolt-9876543210", "sk-default-55555"
ALL_KEYS = (ACME_KEY, BOLT_KEY, DEFAULT_KEY)
# ~70 tokens: four full 16-token blocks, so a repeat hits at least 48 cached tokens
PROMPT = "The old lighthouse keeper climbed the stairs every night to light the lamp. " * 4
KEYED_ROUTES = [
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "Hello"}),  # vLLM's tokenizer routes sit beside /v1/, keyed as it is
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@dataclass
class Stack:
    url: str
    log: Path

    def call(self, method: str, path: str, body: dict | None = None, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=60.0)

    def cached_tokens(self, key: str, prompt: str, cache_salt: str | None = None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self.call("POST", "/v1/completions", body, key)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_until_serving(url: str, key: str, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), "a pdserve process exited during start"
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2.0).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not serving within {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# key tenant\n{ACME_KEY} acme\n{BOLT_KEY} bolt\n")
    return str(path)


@pytest.fixture(scope="module")
def stack(checkpoint: str, keys_file: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("logs")
    worker_port, router_port = free_port(), free_port()
    worker = start(["worker", "--model", checkpoint, "--port", str(worker_port), "--device", "cpu", "--dtype",
                    "float32", "--max-model-len", "512", "--max-kv-tokens", "8192", "--num-threads", "1",
                    "--cache-dir", ""], logs / "worker.log")
    processes = [worker]
    try:
        wait_for_worker(f"127.0.0.1:{worker_port}", worker)
        with open(logs / "router.log", "wb") as out:
            router = subprocess.Popen(
                [PDSERVE, "router", "--model", checkpoint, "--port", str(router_port), "--cache-dir", "",
                 "--worker", f"127.0.0.1:{worker_port}", "--api-keys-file", keys_file, "--log-level", "debug",
                 "--insecure-internal"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PDSERVE_API_KEY": DEFAULT_KEY})
        processes.append(router)
        url = f"http://127.0.0.1:{router_port}"
        wait_until_serving(url, ACME_KEY, processes)
        yield Stack(url, logs / "router.log")
    finally:
        for process in reversed(processes):
            stop(process)


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES, ids=[path for _, path, _ in KEYED_ROUTES])
@pytest.mark.parametrize("key", [None, "sk-wrong", ACME_KEY[:-1], ACME_KEY + "0"], ids=repr)
def test_a_keyed_route_without_a_valid_key_is_401_in_the_envelope(stack: Stack, method: str, path: str,
                                                               body: dict | None, key: str | None) -> None:
    response = stack.call(method, path, body, key)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("AuthenticationError", 401)
    assert error["message"] in ("invalid API key", "missing API key: send 'Authorization: Bearer <key>'")


@pytest.mark.parametrize("method, path, body", KEYED_ROUTES, ids=[path for _, path, _ in KEYED_ROUTES])
@pytest.mark.parametrize("key", ALL_KEYS, ids=["acme", "bolt", "default"])
def test_a_keyed_route_with_a_valid_key_is_200(stack: Stack, method: str, path: str, body: dict | None,
                                           key: str) -> None:
    response = stack.call(method, path, body, key)
    assert response.status_code == 200, response.text


def test_an_unknown_v1_path_is_401_before_404(stack: Stack) -> None:
    assert stack.call("GET", "/v1/nothing-here").status_code == 401
    assert stack.call("GET", "/v1/nothing-here", key=ACME_KEY).status_code == 404


@pytest.mark.parametrize("path", ["/health", "/health/live", "/health/ready", "/metrics"])
def test_health_and_metrics_are_open_by_default(stack: Stack, path: str) -> None:
    assert stack.call("GET", path).status_code == 200


def test_two_tenants_sending_the_same_prompt_never_share_a_block(stack: Stack) -> None:
    prompt = "Tenants apart. " + PROMPT
    assert stack.cached_tokens(ACME_KEY, prompt) == 0
    assert stack.cached_tokens(ACME_KEY, prompt) >= 48  # the positive control: the same tenant hits
    assert stack.cached_tokens(BOLT_KEY, prompt) == 0
    assert stack.cached_tokens(DEFAULT_KEY, prompt) == 0
    assert stack.cached_tokens(BOLT_KEY, prompt) >= 48


def test_a_client_cache_salt_narrows_within_its_tenant(stack: Stack) -> None:
    prompt = "Salted within. " + PROMPT
    assert stack.cached_tokens(ACME_KEY, prompt) == 0
    assert stack.cached_tokens(ACME_KEY, prompt, cache_salt="team-x") == 0
    assert stack.cached_tokens(ACME_KEY, prompt, cache_salt="team-x") >= 48
    assert stack.cached_tokens(ACME_KEY, prompt, cache_salt="team-y") == 0
    assert stack.cached_tokens(ACME_KEY, prompt) >= 48


def test_no_cache_salt_reaches_another_tenants_cache(stack: Stack) -> None:
    prompt = "Reaching across. " + PROMPT
    assert stack.cached_tokens(BOLT_KEY, prompt) == 0
    assert stack.cached_tokens(BOLT_KEY, prompt, cache_salt="s") == 0
    bolt_salts = [effective_cache_salt(Tenant("bolt"), s) for s in (None, "s")]
    for salt in ["bolt", "s", *bolt_salts]:
        assert stack.cached_tokens(ACME_KEY, prompt, cache_salt=salt) == 0, salt
    assert stack.cached_tokens(BOLT_KEY, prompt) >= 48  # bolt's own blocks are still there
    assert stack.cached_tokens(BOLT_KEY, prompt, cache_salt="s") >= 48


def test_no_key_reaches_the_router_log(stack: Stack) -> None:
    stack.call("GET", "/v1/models", key="sk-presented-but-wrong")
    log = stack.log.read_text(errors="replace")
    assert "API key(s) of 3 tenant(s)" in log
    assert not any(key in log for key in (*ALL_KEYS, "sk-presented-but-wrong"))


def test_serve_hands_the_key_options_to_its_router(checkpoint: str, keys_file: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.out", "wb") as out:
        serve = subprocess.Popen(
            [PDSERVE, "serve", "--aggregated", "--model", checkpoint, "--port", str(port), "--device", "cpu",
             "--dtype", "float32", "--max-model-len", "512", "--max-kv-tokens", "8192", "--cache-dir", "",
             "--api-keys-file", keys_file, "--protect-metrics"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PDSERVE_API_KEY": DEFAULT_KEY})
    try:
        wait_until_serving(url, DEFAULT_KEY, [serve])
        models = {key: httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
                  for key in (*ALL_KEYS, "sk-wrong")}
        assert models == {ACME_KEY: 200, BOLT_KEY: 200, DEFAULT_KEY: 200, "sk-wrong": 401}
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {BOLT_KEY}"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        commands = [command_of(pid) for pid in children_of(serve.pid)]
        assert any(" router " in command for command in commands)
        assert not any(key in command for command in commands for key in ALL_KEYS)
    finally:
        stop(serve)
    assert not any(key in (tmp_path / "serve.out").read_text(errors="replace") for key in ALL_KEYS)
