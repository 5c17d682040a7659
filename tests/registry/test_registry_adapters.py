"""LoRA adapters as registered models, end to end on a real server: registered on a loaded base model (admin
API and CLI), each a model id of its own in /v1/models with its own aliases, team access and price sheet,
served in the base's batches (chat, Responses and Batch APIs), named in usage rows; a wrong base is a 400
naming the mismatch, and nothing is stored."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from app.cli.main import main as tokenmill
from engine.config import EngineConfig
from engine.loader import load_model
from tests.engine.test_lora import make_adapter
from tests.registry.test_registry_server import Server
from tests.support.batches import download, submit, wait_for
from tests.support.gateway import ADMIN_KEY, sqlite_gateway, usage_rows
from tests.support.server import running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("served-adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "ft-a": make_adapter(base, root / "a", 1, r=8, lora_alpha=16, target_modules=every),
        "ft-b": make_adapter(base, root / "b", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama as the server's model, so adapters made on it here can be registered on it."""
    gateway = sqlite_gateway(tmp_path_factory.mktemp("adapter-server"))
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)
    with running_server(load_model(config), engine_config=config, gateway=gateway) as running:
        yield Server(running.url, running.app, gateway)


def base_name(server: Server) -> str:
    default = server.pool.default
    assert default is not None
    return default.name


def answer(server: Server, key: str, model: str) -> str:
    reply = server.client(key).chat.completions.create(model=model, messages=QUESTION, **GREEDY)
    assert reply.model == model or model in server.pool.specs[reply.model].aliases
    return reply.choices[0].message.content or ""


def wait_for_usage(server: Server, model: str, count: int = 1) -> list:
    deadline = time.monotonic() + 10
    while len(rows := [r for r in usage_rows(server.gateway) if r.model == model]) < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return rows


def test_an_adapter_is_a_model_of_its_own_served_in_the_base_batches(server, adapters):
    base = base_name(server)
    view = server.register(
        "ft-a",
        adapters["ft-a"],
        adapter_of=base,
        aliases=["team-a-model"],
        load=True,
        price_input_per_1m=2.0,
        price_output_per_1m=10.0,
    )
    assert (view["adapter_of"], view["architecture"], view["state"]) == (base, "lora", "loaded")
    server.register("ft-b", adapters["ft-b"], adapter_of=base, load=True)
    try:
        key = server.key()
        cards = {card.id: card for card in server.client(key).models.list()}
        assert {"ft-a", "team-a-model", "ft-b", base} <= set(cards)
        assert cards["ft-a"].model_extra["parent"] == base
        replies = {model: answer(server, key, model) for model in (base, "team-a-model", "ft-b")}
        assert len(set(replies.values())) == 3, f"adapters must answer differently from the base: {replies}"
        assert answer(server, key, "ft-a") == replies["team-a-model"]  # the alias is the same adapter
        rows = wait_for_usage(server, "ft-a", 2)
        assert all(row.completion_tokens == 8 for row in rows)
        assert rows[0].cost_nano_usd == round((rows[0].prompt_tokens * 2.0 + 8 * 10.0) / 1e6 * 1e9) > 0
        # the dashboard's overview has the adapter as a model, with its own tokens and the team's share of it
        sampler = server.app.state.dashboard.sampler
        sampler.sample()  # now, not at its next tick
        live = {m["current"]["name"]: m["current"] for m in sampler.live()["models"]}
        adapter_now, base_now = live["ft-a"], live[base]
        [share] = adapter_now["teams"]
        assert share["tokens_last_minute"] == 2 * (rows[0].prompt_tokens + 8)
        assert base_now["teams"][0]["tokens_last_minute"] > share["tokens_last_minute"]  # the engine's whole share
        # a team may be given the adapter and not the base
        adapter_only = server.key(allowed_models=["ft-b"])
        assert [card.id for card in server.client(adapter_only).models.list()] == ["ft-b"]
        with pytest.raises((openai.PermissionDeniedError, openai.NotFoundError)):
            answer(server, adapter_only, base)
        assert answer(server, adapter_only, "ft-b") == replies["ft-b"]
        # the base's engine serves the adapter: unloading the base unloads its adapters first
        removal = server.admin("DELETE", f"/models/{base}")
        assert removal.status_code == 409 and "ft-a" in removal.json()["error"]["message"]
    finally:
        server.admin("DELETE", "/models/ft-a")
        server.admin("DELETE", "/models/ft-b")


def test_responses_and_batch_apis_take_adapter_ids(server, adapters):
    base = base_name(server)
    server.register("ft-batch", adapters["ft-a"], adapter_of=base, load=True)
    try:
        key = server.key()
        chat = answer(server, key, "ft-batch")
        client = server.client(key)
        response = client.responses.create(
            model="ft-batch", input="What is the capital of France?", temperature=0, max_output_tokens=8
        )
        assert response.model == "ft-batch" and response.output_text
        line = {
            "custom_id": "one",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "ft-batch", "messages": QUESTION, "temperature": 0, "max_tokens": 8, "ignore_eos": True},
        }
        batch = wait_for(client, submit(client, [line]).id, timeout=60)
        assert batch.status == "completed", batch
        [output] = download(client, batch.output_file_id)
        body = output["response"]["body"]
        assert body["model"] == "ft-batch" and body["choices"][0]["message"]["content"] == chat
        assert len(wait_for_usage(server, "ft-batch", 3)) >= 3  # chat, response and batch line
    finally:
        server.admin("DELETE", "/models/ft-batch")


def test_a_wrong_base_is_a_400_naming_the_mismatch_and_nothing_is_stored(server, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    before = server.admin("GET", "/models").json()
    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    get_peft_model(other, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        tmp_path / "wrong"
    )
    for path, needle in ((tmp_path / "wrong", "q_proj"), (tmp_path / "missing", "not a folder")):
        response = server.admin(
            "POST", "/models", json={"name": "wrong-ft", "path": str(path), "adapter_of": base_name(server)}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("adapter_mismatch", "path")
        assert needle in error["message"]
    unknown = server.admin("POST", "/models", json={"name": "x", "path": str(tmp_path), "adapter_of": "nobody"})
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (400, "adapter_of")
    assert server.admin("GET", "/models").json() == before
    assert server.admin("GET", "/models/wrong-ft").status_code == 404


def test_the_cli_registers_an_adapter(server, adapters, capsys):
    common = ["--url", server.url, "--admin-key", ADMIN_KEY]
    base = base_name(server)
    code = tokenmill(["models", "add", "cli-ft", "--adapter-of", base, "--path", str(adapters["ft-b"]), *common])
    assert code == 0
    try:
        assert tokenmill(["models", "load", "cli-ft", *common]) == 0
        assert server.state("cli-ft") == "loaded"
        assert answer(server, server.key(), "cli-ft")
        capsys.readouterr()
        assert tokenmill(["models", "add", "cli-bad", "--adapter-of", base, "--path", "/no/such", *common]) == 1
        assert (
            "adapter_mismatch" in capsys.readouterr().err or server.admin("GET", "/models/cli-bad").status_code == 404
        )
    finally:
        httpx.delete(f"{server.url}/admin/api/models/cli-ft", headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def test_the_models_page_registers_an_adapter_and_shows_its_base(server, adapters):
    from tests.support.dashboard import DashboardClient

    base = base_name(server)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        page = DashboardClient(client=http, gateway=server.gateway, app=server.app)  # type: ignore[arg-type]
        page.log_in()

        def submit(**fields: str) -> httpx.Response:  # a form field is named `path`: no page.post(path, ...)
            return http.post("/admin/models", data={"csrf_token": page.csrf, "kind": "chat", **fields})

        response = submit(name="page-ft", path=str(adapters["ft-b"]), adapter_of=base, load="on")
        assert response.status_code == 303, response.text
        try:
            html = http.get("/admin/models").text
            card = html[html.index('data-model="page-ft"') :]
            assert f'LoRA adapter of <a href="#{base}" data-field="adapter_of">{base}</a>' in card[:2000]
            assert server.state("page-ft") == "loaded"
            wrong = submit(name="page-bad", path="/no/such", adapter_of=base)
            assert wrong.status_code == 400 and "not a folder" in wrong.text
        finally:
            server.admin("DELETE", "/models/page-ft")


def test_vllm_load_and_unload_lora_adapter_endpoints(server, adapters):
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"lora_name": "vllm-ft", "lora_path": str(adapters["ft-a"])}
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)
    assert loaded.status_code == 200 and "vllm-ft" in loaded.text, loaded.text
    try:
        key = server.key()
        assert server.client(key).models.retrieve("vllm-ft").model_extra["parent"] == base_name(server)
        assert answer(server, key, "vllm-ft")
        team_key = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert team_key.status_code in (401, 403)  # the admin key only
    finally:
        removed = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "vllm-ft"}, headers=headers)
    assert removed.status_code == 200, removed.text
    assert server.admin("GET", "/models/vllm-ft").status_code == 404
    again = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "vllm-ft"}, headers=headers)
    assert (again.status_code, again.json()["error"]["param"]) == (400, "lora_name")
