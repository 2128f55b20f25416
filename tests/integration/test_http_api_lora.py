"""LoRA adapters in the HTTP API, with the official `openai` client and real uvicorn in front of
`WordBackend` and an in-memory adapter set: a request naming an adapter carries its id to the
worker and is answered under its name; `/v1/models` lists adapters with their parent; the load
and unload routes answer as vLLM's do, errors in OpenAI's envelope, exist only when runtime
updates are allowed, and take only an admin key when keys are configured."""
from collections.abc import Iterator

import httpx
import openai
import pytest

from http_fakes import MODEL_NAME, WordBackend, load_test_tokenizer, model_info, serve
from pdserve.common.errors import InvalidRequestError, UnknownLoraAdapterError
from pdserve.common.stats import LoraAdapterInfo
from pdserve.common.api_keys import ApiKeys
from pdserve.router.openai.access.tenants import Tenant
from pdserve.router.openai.app import create_app


class FakeLoras:
    """`LoraAdapters` in memory: a path containing "bad" is no adapter."""

    def __init__(self) -> None:
        self.adapters = {"sql": LoraAdapterInfo("sql", 1234, "/adapters/sql")}

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        return list(self.adapters.values())

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        if name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if "bad" in path:
            raise InvalidRequestError(f"lora_path={path!r}: no adapter_config.json", "lora_path")
        self.adapters[name] = LoraAdapterInfo(name, 99, path)
        return self.adapters[name]

    async def unload_lora_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise UnknownLoraAdapterError(f"The lora adapter '{name}' cannot be found.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_test_tokenizer(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[tuple[str, WordBackend, FakeLoras]]:
    backend, loras = WordBackend(tokenizer), FakeLoras()
    with serve(create_app(backend, tokenizer, model_info(tokenizer), loras=loras, runtime_lora_updating=True)) as url:
        yield url, backend, loras


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_a_request_naming_an_adapter_runs_under_it_and_is_answered_under_its_name(server, client) -> None:
    _, backend, _ = server
    completion = client.completions.create(model="sql", prompt="Hello", max_tokens=2, temperature=0)
    assert completion.model == "sql" and backend.requests[-1].lora_id == 1234
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "sql" and backend.requests[-1].lora_id == 1234
    base = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert base.model == MODEL_NAME and backend.requests[-1].lora_id is None


def test_an_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)


def test_models_lists_each_adapter_with_its_parent(client) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert cards["sql"].parent == MODEL_NAME and cards["sql"].root == "/adapters/sql"
    assert getattr(cards[MODEL_NAME], "parent", None) is None


def test_load_and_unload_answer_as_vllm_does(server, client) -> None:
    url, backend, _ = server
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    client.completions.create(model="chat", prompt="Hello", max_tokens=2)
    assert backend.requests[-1].lora_id == 99
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="Hello", max_tokens=2)


@pytest.mark.parametrize("path, body, status, param", [
    ("load", {"lora_name": "sql", "lora_path": "/adapters/sql"}, 400, "lora_name"),
    ("load", {"lora_name": "x", "lora_path": "/bad"}, 400, "lora_path"),
    ("load", {"lora_name": "x"}, 400, "lora_path"),
    ("load", {"lora_name": 3, "lora_path": "/p"}, 400, "lora_name"),
    ("unload", {"lora_name": "never"}, 404, "lora_name"),
])
def test_bad_loads_and_unloads_are_refused_in_the_envelope(server, path, body, status, param) -> None:
    response = httpx.post(f"{server[0]}/v1/{path}_lora_adapter", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert [a.name for a in server[2].lora_adapters()] == ["sql"]


def test_a_server_without_adapters_refuses_loads(tokenizer) -> None:
    with serve(create_app(WordBackend(tokenizer), tokenizer, model_info(tokenizer),
                          runtime_lora_updating=True)) as url:
        response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
        models = httpx.get(f"{url}/v1/models").json()["data"]
    assert response.status_code == 400 and "serves no LoRA adapters" in response.json()["error"]["message"]
    assert [m["id"] for m in models] == [MODEL_NAME]


def test_without_the_switch_the_routes_do_not_exist_as_in_vllm(tokenizer) -> None:
    loras = FakeLoras()
    with serve(create_app(WordBackend(tokenizer), tokenizer, model_info(tokenizer), loras=loras)) as url:
        load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/adapters/x"})
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert (load.status_code, unload.status_code) == (404, 404)
    assert list(loras.adapters) == ["sql"]


ADMIN_KEY, ACME_KEY, BOLT_KEY = "sk-admin-000000", "sk-acme-111111", "sk-bolt-222222"


def test_with_keys_only_an_admin_key_loads_or_unloads_and_sees_folders(tokenizer) -> None:
    keys = ApiKeys({ADMIN_KEY: Tenant("ops"), ACME_KEY: Tenant("acme"), BOLT_KEY: Tenant("bolt")}, [ADMIN_KEY])
    loras = FakeLoras()
    app = create_app(WordBackend(tokenizer), tokenizer, model_info(tokenizer), loras=loras, api_keys=keys,
                     runtime_lora_updating=True)

    def call(url: str, path: str, body: dict, key: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"})

    def roots(url: str, key: str) -> dict[str, str]:
        cards = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
        return {card["id"]: card.get("root") for card in cards if card.get("parent")}

    with serve(app) as url:
        acme_load = call(url, "load_lora_adapter", {"lora_name": "acme", "lora_path": "/adapters/acme"}, ACME_KEY)
        assert acme_load.status_code == 403 and acme_load.json()["error"]["code"] == 403
        assert call(url, "load_lora_adapter", {"lora_name": "acme", "lora_path": "/adapters/acme"},
                    ADMIN_KEY).status_code == 200
        bolt_unload = call(url, "unload_lora_adapter", {"lora_name": "acme"}, BOLT_KEY)  # tenant B, A's adapter
        assert bolt_unload.status_code == 403
        assert set(loras.adapters) == {"sql", "acme"}
        assert roots(url, BOLT_KEY) == {"sql": "sql", "acme": "acme"}  # no folder shown to a tenant
        assert roots(url, ADMIN_KEY) == {"sql": "/adapters/sql", "acme": "/adapters/acme"}
        assert call(url, "unload_lora_adapter", {"lora_name": "acme"}, ADMIN_KEY).status_code == 200
