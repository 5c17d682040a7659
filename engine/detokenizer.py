"""Generated token ids to text, one token at a time: never half a character, stop strings cut."""

from __future__ import annotations

from engine.sampling_params import SamplingParams

# Prompt tokens decoded in front of the first output token, so the tokenizer sees the context that
# a leading space or a character split over tokens depends on (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a small window of recent tokens each step (prefix/read offsets, as in vLLM and TGI):
    the text the window adds beyond its already-emitted prefix is new, unless it still ends in a
    partial UTF-8 sequence, in which case it waits for the next token."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop_strings = params.stop
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)  # window[:read_offset] is already emitted (or prompt)
        self._prefix_text = self._decode(self._window)
        if self._prefix_text.endswith(REPLACEMENT_CHARACTER):
            # The prompt ends inside a character: decode the output on its own, as a full decode would.
            self._window, self._read_offset, self._prefix_text = [], 0, ""
        self._held_back = ""  # decoded text that may be the start of a stop string
        self._emitted: list[str] = []
        self._stopped = False
        self._finished = False

    @property
    def output_text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        """A stop string was hit; further tokens produce no text."""
        return self._stopped

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token; returns (new text to emit, hit a stop string)."""
        if self._stopped or self._finished:
            return "", self._stopped
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHARACTER):
            return "", False
        new_text = text[len(self._prefix_text) :]
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return self._emit(new_text, final=False)

    def flush(self) -> str:
        """Text still held back (a possible stop-string start, or an unfinished character) once the
        sequence ends for another reason. Later calls return ""."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        text = self._decode(self._window)
        pending = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        emitted, _ = self._emit(pending, final=True)
        return emitted

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, new_text: str, final: bool) -> tuple[str, bool]:
        # A stop string can only start inside the held-back text or the new text: anything
        # emitted earlier was, by construction, no prefix of one.
        text = self._held_back + new_text
        stop_start = first_stop(text, self._stop_strings)
        if stop_start is not None:
            self._stopped = True
            self._held_back = ""
            emitted = text[:stop_start]
        else:
            hold = 0 if final else longest_stop_prefix_suffix(text, self._stop_strings)
            emitted, self._held_back = text[: len(text) - hold], text[len(text) - hold :]
        if emitted:
            self._emitted.append(emitted)
        return emitted, self._stopped


def first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Start of the stop string that ends first in text (the one a character-by-character stream
    would meet first, whatever the token boundaries); on equal ends, the longer one."""
    found = [(start + len(stop), start) for stop in stop_strings if (start := text.find(stop)) >= 0]
    return min(found)[1] if found else None


def longest_stop_prefix_suffix(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest end of text that is the beginning of some stop string."""
    longest = max((len(stop) - 1 for stop in stop_strings), default=0)
    for length in range(min(longest, len(text)), 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) for stop in stop_strings):
            return length
    return 0
