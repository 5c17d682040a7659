"""llguidance behind the engine's Guide protocol: grammars compiled once per tokenizer and cached, one
matcher per sequence, and a per-step mask computed in Rust (with the GIL released).

Why llguidance: it installs as one abi3 wheel, compiles a JSON schema or a Lark grammar (with inline
`%json` schemas, which tool calls need) in milliseconds, and computes a mask in tens of microseconds
on CPU, lazily, without precomputing a whole-vocabulary automaton per schema.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

import llguidance
import llguidance.hf
import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stub only
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger("tokenmill.structured")

# Compact JSON the way the model writes it (`{"a": 1, "b": [2, 3]}`): no free whitespace, which a small
# model could otherwise repeat until max_tokens.
JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 256


class GrammarError(ValueError):
    """The schema or grammar cannot be enforced; the message says why (it goes to the client)."""


def json_schema_grammar(schema: dict[str, Any], *, lenient: bool = False) -> str:
    """The llguidance grammar for a JSON schema. Lenient: unsupported keywords are ignored, not refused."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_LAYOUT, "lenient": lenient})
    except ValueError as error:
        raise GrammarError(str(error)) from None


def check_json_schema(schema: dict[str, Any]) -> None:
    """GrammarError unless the schema can be enforced as written."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(json_schema_grammar(schema))
    if is_error:
        raise GrammarError("; ".join(messages))


def json_schema_lark(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark nonterminal body, with our layout (for grammars that embed JSON)."""
    return "%json " + json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_LAYOUT}})


class GrammarCompiler:
    """Per tokenizer: the llguidance tokenizer (built once, ~1.5 s) and an LRU of compiled grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._hf_tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, GrammarGuideFactory] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                # Typed as a fast tokenizer, which llguidance checks: others it refuses (ValueError).
                self._ll_tokenizer = llguidance.hf.from_tokenizer(cast("PreTrainedTokenizerFast", self._hf_tokenizer))
            return self._ll_tokenizer

    def compile(self, grammar: str) -> GrammarGuideFactory:
        """A guide factory for the grammar (llguidance JSON or Lark); GrammarError if it is refused."""
        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
        factory = self._build(grammar)
        with self._lock:
            self._cache[grammar] = factory
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return factory

    def _build(self, grammar: str) -> GrammarGuideFactory:
        tokenizer = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError("; ".join(messages))
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        factory = GrammarGuideFactory(template, tokenizer.vocab_size, tokenizer.eos_token)
        if not factory.new_guide().allowed_tokens().any():
            raise GrammarError("no output can satisfy this schema")
        return factory


_compilers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


class GrammarGuideFactory:
    """One compiled grammar; each sequence gets a copy of the fresh matcher (cheap: the grammar is shared)."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self._template = template
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def new_guide(self) -> GrammarGuide:
        with self._lock:
            matcher = self._template.deep_copy()
        return GrammarGuide(matcher, self.vocab_size, self.eos_token_id)


class GrammarGuide:
    """engine.guide.Guide over one llguidance matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._failed = False

    def allowed_tokens(self) -> torch.Tensor:
        if not self._failed:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            if self._matcher.is_error():
                self._fail()
        if self._failed:
            only_eos = torch.zeros(self._vocab_size, dtype=torch.bool)
            only_eos[self._eos_token_id] = True
            return only_eos
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self._vocab_size]
        return torch.from_numpy(bits).view(torch.bool)  # 0/1 bytes: a view, not a (slow) conversion

    def advance(self, token_id: int) -> None:
        if not self._failed and not self._matcher.consume_token(token_id):
            self._fail()

    @property
    def done(self) -> bool:
        return self._failed or self._matcher.is_stopped()

    def _fail(self) -> None:
        # Cannot happen while the sampler honours the mask; if it does (a parser limit), end the output.
        log.warning("constrained decoding stopped: %s", self._matcher.get_error())
        self._failed = True
