"""The ingress hashes the very token ids and cache root a replica's engine gets (app.scaleout.prompt_blocks):
the replica's app, run as a Ray Serve replica runs it (run_asgi), against what the ingress computes."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.scaleout.asgi_forward import ForwardedRequest, ResponseStart, run_asgi
from app.scaleout.prefix_routing import prompt_blocks
from app.scaleout.prompt_blocks import CacheRoot, CacheRoots, PromptTokens, cache_root_after
from engine.config import EngineConfig
from tests.support.gateway import FAKE_MODEL, FakeEngine

KEY = "sk-routing-test-key"


class RecordingEngine(FakeEngine):
    """FakeEngine with a real tokenizer, remembering the prompt ids and tenancy of each generate()."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, prompt_token_ids, params, tenancy=None, capacity=True):
        self.prompts.append(list(prompt_token_ids))
        async for output in super().generate(request_id, prompt_token_ids, params, tenancy):
            yield output


@pytest.fixture(scope="module")
def replica(tiny_llama_dir):
    from transformers import AutoTokenizer

    from app.main import create_app
    from app.settings import Settings

    engine = RecordingEngine(AutoTokenizer.from_pretrained(tiny_llama_dir))
    app = create_app(Settings(api_key=KEY), engine)
    return app, engine


def answer(app, path: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    """(status, request.state) of one request run as a replica runs it."""
    state: dict = {}
    request = ForwardedRequest(
        method="POST",
        path=path,
        query_string=b"",
        headers=[(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        body=json.dumps(body).encode(),
        client=("10.0.0.1", 1),
    )

    async def run() -> int:
        items = [item async for item in run_asgi(app, request, state=state)]
        return next(item for item in items if isinstance(item, ResponseStart)).status

    return asyncio.run(run()), state


SYSTEM = "You are the support assistant of Initech. Refunds are possible within 30 days. " * 8


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {
                "model": FAKE_MODEL,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
            },
        ),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": SYSTEM}),
        ("/v1/completions", {"model": FAKE_MODEL, "prompt": [SYSTEM, "second"]}),
    ],
)
def test_the_ingress_hashes_the_prompt_and_cache_root_the_replicas_engine_gets(replica, tiny_llama_dir, path, body):
    app, engine = replica
    status, state = answer(app, path, {**body, "max_tokens": 2})
    assert status == 200
    note = cache_root_after(path, status, state, "team")
    assert note == CacheRoot(engine.tenancies[-1].cache_root)  # the salt the engine hashed this request with
    roots = CacheRoots()
    roots.learn(f"Bearer {KEY}", note.root)
    known, root = roots.of(f"Bearer {KEY}")
    ids = PromptTokens(EngineConfig(model=str(tiny_llama_dir))).of(path, json.dumps(body).encode())
    first_prompt = engine.prompts[-2] if isinstance(body.get("prompt"), list) else engine.prompts[-1]
    assert known and ids == first_prompt
    assert len(prompt_blocks(ids, 16, root)) == (len(first_prompt) - 1) // 16 > 4


def test_a_refused_key_teaches_the_ingress_nothing(replica):
    app, _ = replica
    body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, state = answer(app, "/v1/chat/completions", body, key="sk-wrong")
    assert status == 401
    assert cache_root_after("/v1/chat/completions", status, state, "team") is None
    assert cache_root_after("/v1/embeddings", 200, {"principal": object()}, "team") is None


def test_cache_roots_are_kept_by_key_hash_and_bounded():
    roots = CacheRoots(max_keys=2)
    roots.learn("Bearer sk-a", b"root-a")
    roots.learn("Bearer sk-b", None)  # the global cache: a known root of None
    assert roots.of("Bearer sk-a") == (True, b"root-a") and roots.of("Bearer sk-b") == (True, None)
    assert "sk-a" not in repr(roots._roots)  # the key itself is never kept
    roots.learn("Bearer sk-c", b"root-c")  # over the bound: the least recently used (sk-a, read first) goes
    assert roots.of("Bearer sk-a") == (False, None) and roots.of("Bearer sk-b")[0]
    assert roots.of(None) == (False, None) and roots.of("Basic abc") == (False, None)


def test_bodies_the_ingress_cannot_reproduce_get_no_tokens(tiny_llama_dir):
    tokens = PromptTokens(EngineConfig(model=str(tiny_llama_dir)))
    tools = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    assert tokens.of("/v1/chat/completions", json.dumps(tools).encode()) is None
    assert tokens.of("/v1/chat/completions", b"not json") is None
    assert tokens.of("/v1/embeddings", b'{"input": "x"}') is None
    missing = PromptTokens(EngineConfig(model=str(tiny_llama_dir / "nowhere")))
    assert missing.of("/v1/completions", b'{"model": "m", "prompt": "x"}') is None  # no tokenizer: no affinity
