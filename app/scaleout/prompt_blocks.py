"""What the ingress needs to hash a prompt's blocks the way a replica's engine will: its token ids (the
served model's tokenizer and chat template, through the same functions as the routes) and the caller's
cache root (the team's salt, learned from the replicas' answers).

The ingress does not authenticate: a replica does, and after a successful answer it tells the ingress
which cache root that key's requests use (`CacheRoot`). The ingress keeps it under the key's SHA-256 (as
the gateway stores keys), never the key. A key not seen yet, or not answered successfully, has no root:
its prompt gets no block hashes and routes by load, so no request ever matches another team's blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.gateway.keys import bearer_token, hash_key
from app.scaleout.prefix_routing import ROUTED_PATHS
from app.serving.tracker import cache_salt, team_of
from engine.config import EngineConfig
from engine.tenancy import Tenancy

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("tokenmill.scaleout")

MAX_KEYS = 10_000  # cache roots remembered, least recently used dropped first: 10k keys x ~100 bytes
TOKENIZER_RETRY_S = 10.0  # a model not converted yet (the replicas convert it as they start): look again


@dataclass(frozen=True)
class CacheRoot:
    """A replica's note after a successful answer: the cache root (Tenancy.cache_root) of the key that
    asked. Sent after the body; the ingress keeps it and never forwards it."""

    root: bytes | None


def cache_root_after(path: str, status: int | None, state: dict[str, Any], prefix_cache_scope: str) -> CacheRoot | None:
    """A replica's note after it answered `path` with `status`: the cache root of the key the app
    authenticated (app.api.deps.current_principal leaves it in request.state), computed as the engine's
    Tenancy computes it. None for other paths and failed answers (the key may be invalid)."""
    principal = state.get("principal")
    if path not in ROUTED_PATHS or status is None or status >= 300 or principal is None:
        return None
    salt = cache_salt(principal, prefix_cache_scope)
    return CacheRoot(Tenancy(team=team_of(principal), cache_salt=salt).cache_root)


class CacheRoots:
    """API key (by its SHA-256) -> the cache root its requests use."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._roots: OrderedDict[str, bytes | None] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, authorization: str | None, root: bytes | None) -> None:
        token = bearer_token(authorization)
        if not token:
            return
        key_hash = hash_key(token)
        with self._lock:
            self._roots[key_hash] = root
            self._roots.move_to_end(key_hash)
            while len(self._roots) > self.max_keys:
                self._roots.popitem(last=False)

    def of(self, authorization: str | None) -> tuple[bool, bytes | None]:
        """(known, root): known is False for a key no replica has vouched for yet."""
        token = bearer_token(authorization)
        if not token:
            return False, None
        key_hash = hash_key(token)
        with self._lock:
            if key_hash not in self._roots:
                return False, None
            self._roots.move_to_end(key_hash)
            return True, self._roots[key_hash]


class PromptTokens:
    """A request body's prompt token ids as the replica's engine will see them, for the served model
    (--model; other registry models get ids from this tokenizer too, which simply match no blocks)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.tokenizer: PreTrainedTokenizerBase | None = None  # once the model's folder exists
        self._next_try = 0.0
        self._lock = threading.Lock()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _load(self) -> PreTrainedTokenizerBase | None:
        # One loader at a time: transformers' lazy imports fail when two threads race through them.
        with self._lock:
            if self.tokenizer is None and self.clock() >= self._next_try:
                self._next_try = self.clock() + TOKENIZER_RETRY_S
                try:
                    from transformers import AutoTokenizer

                    from engine.loader import converted_folder

                    folder = converted_folder(self.config)  # never converts: the replicas do that
                    if folder is not None:
                        self.tokenizer = AutoTokenizer.from_pretrained(folder)
                except Exception:  # no tokenizer: routing by load only, as before this existed
                    log.exception("the ingress could not load the tokenizer; prefix affinity is off for now")
        return self.tokenizer

    def of(self, path: str, body: bytes) -> list[int] | None:
        """Blocking (the chat template, the tokenizer): run it off the event loop. None when the body has
        no prompt this can reproduce exactly (not JSON, tools, invalid): the replica judges it."""
        if path not in ROUTED_PATHS or not body or (tokenizer := self._load()) is None:
            return None
        try:
            if path == "/v1/chat/completions":
                return _chat_ids(tokenizer, body)
            return _completion_ids(tokenizer, body)
        except Exception:  # the replica answers invalid bodies with its own OpenAI-shaped error
            return None


def _chat_ids(tokenizer: PreTrainedTokenizerBase, body: bytes) -> list[int] | None:
    from app.serving.prompts import chat_prompt_ids
    from app.serving.schemas import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate_json(body)
    if request.tools or any(message.role == "tool" or message.tool_calls for message in request.messages):
        return None  # tools reshape the prompt (app.serving.structured.plan): not worth reproducing here
    return chat_prompt_ids(tokenizer, request.messages)


def _completion_ids(tokenizer: PreTrainedTokenizerBase, body: bytes) -> list[int]:
    from app.serving.prompts import completion_prompt_ids
    from app.serving.schemas import CompletionRequest

    request = CompletionRequest.model_validate_json(body)
    many = len(request.prompt) > 1  # a batch: its first prompt stands for it
    return completion_prompt_ids(tokenizer, request.prompt[0], 0, many)
