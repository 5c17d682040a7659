"""Token strings and raw bytes for logprobs, the way OpenAI shows them (" the", not "Ġthe")."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

from engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to a printable character."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def decoded(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """tokenizer.decode of one sequence: a string (transformers types it as a batch's list of them too)."""
    text = tokenizer.decode(token_ids)
    assert isinstance(text, str)
    return text


class TokenTexts:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._added = set(tokenizer.added_tokens_decoder)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._byte_of_char = {char: byte for byte, char in _bytes_to_unicode().items()}
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        assert isinstance(piece, str)  # one id: one token (transformers types both forms as one)
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(char in self._byte_of_char for char in piece):
            return bytes(self._byte_of_char[char] for char in piece)
        return decoded(self._tokenizer, [token_id]).encode()

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def shown(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """The entries a client sees: special tokens (the closing EOS) are not part of the text."""
        return [item for item in logprobs if item.token_id not in self.special_ids]
