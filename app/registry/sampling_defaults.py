"""A model's own sampling defaults: what a request gets for the sampling fields it leaves out, instead of
OpenAI's (temperature 1.0 is too hot for a small model). They come from the checkpoint (its
generation_config.json, or a GGUF's general.sampling.* metadata), from the model card for the embedded
model, or from the admin; they are checked here with the engine's own limits, so a default can never
make a request fail."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.registry.files import read_regular
from app.registry.spec import RegistryError
from engine.sampling_params import InvalidParameter, SamplingParams

log = logging.getLogger("tokenmill.registry")

FIELD = "sampling_defaults"  # the admin API's field; errors name `sampling_defaults.<key>`
# The request fields a model may give a default for (chat, completions and responses share them).
SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)
WHOLE_NUMBER_KEYS = frozenset({"top_k", "max_tokens"})
# The embedded SmolLM2-135M-Instruct's (its GGUF carries no sampling metadata), chosen by
# bench/defaults_bench.py (bench/README.md has the table): with its model card's "temperature=0.2, top_p=0.9"
# alone, "What is the capital of France?" named Paris in 6 of 10 tries and some answers ran on in French to
# the end of the context (4,096 tokens). Greedy answered it in 10 of 10 (the first token decides whether the
# answer is English), frequency_penalty 0.5 ends loops by penalising the answer's own repeats (a
# repetition_penalty also counts the question's words, and steered answers away from them), and
# max_tokens 256 bounds what is left. top_p stays for a request that sets a temperature.
EMBEDDED_CHAT_DEFAULTS: dict[str, float | int] = {
    "temperature": 0.0,
    "top_p": 0.9,
    "frequency_penalty": 0.5,
    "max_tokens": 256,
}
# generation_config.json's names (transformers' GenerationConfig) -> ours. do_sample is not read: like
# vLLM, an explicit temperature is what counts.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's GGUF keys (gguf.Keys.General.SAMPLING_*) -> ours.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
MAX_GENERATION_CONFIG_BYTES = 1 * 2**20  # a real one is a few hundred bytes


def check_sampling_defaults(values: Mapping[str, Any]) -> dict[str, float | int]:
    """`values` as stored, or a RegistryError naming `sampling_defaults.<key>`: known keys only, numbers
    only (whole numbers for top_k and max_tokens), each within the range a request may use."""
    if not isinstance(values, Mapping):
        raise RegistryError(f"{FIELD} must be an object mapping field names to numbers.", param=FIELD)
    checked: dict[str, float | int] = {}
    for key, value in values.items():
        param = f"{FIELD}.{key}"
        if key not in SAMPLING_DEFAULT_KEYS:
            raise RegistryError(
                f"{param}: unknown sampling field {key!r}; a default may be set for {list(SAMPLING_DEFAULT_KEYS)}.",
                param=param,
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in WHOLE_NUMBER_KEYS and not (number and isinstance(value, int)):
            raise RegistryError(f"{param} must be a whole number, got {value!r}.", param=param)
        if not number or not math.isfinite(value):
            raise RegistryError(f"{param} must be a finite number, got {value!r}.", param=param)
        if key not in WHOLE_NUMBER_KEYS:
            value = float(value)
        try:
            SamplingParams(**{key: value})
        except InvalidParameter as error:
            raise RegistryError(f"{FIELD}.{error}, got {value!r}.", param=param) from None
        checked[key] = value
    return checked


def changed_sampling_defaults(current: Mapping[str, float | int], changes: Mapping[str, Any]) -> dict[str, float | int]:
    """`current` with `changes` merged in: a key set to null loses its default, the others are checked."""
    if not isinstance(changes, Mapping):
        raise RegistryError(f"{FIELD} must be an object mapping field names to numbers.", param=FIELD)
    for key in changes:
        if key not in SAMPLING_DEFAULT_KEYS:
            check_sampling_defaults({key: 0})  # refused with its name
    merged = {key: value for key, value in current.items() if changes.get(key, value) is not None}
    merged.update(check_sampling_defaults({key: value for key, value in changes.items() if value is not None}))
    return merged


def folder_sampling_defaults(folder: Path) -> dict[str, float | int]:
    """A checkpoint folder's generation_config.json, the defaults its authors ship (vLLM applies them too);
    none when it has no such file. A value the engine cannot use is skipped with a warning: the weights
    are still fine to serve."""
    try:
        config = json.loads(read_regular(folder / "generation_config.json", MAX_GENERATION_CONFIG_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as error:
        log.warning("%s/generation_config.json is unreadable, no sampling defaults from it: %s", folder, error)
        return {}
    if not isinstance(config, dict):
        return {}
    return _usable(
        {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if theirs in config},
        f"{folder}/generation_config.json",
    )


def gguf_sampling_defaults(header: Mapping[str, Any], where: Path) -> dict[str, float | int]:
    """The general.sampling.* metadata of a GGUF header, where its converter recorded them. They are
    float32s: 0.7 reads back as 0.699999988, so each is given to float32's precision (7 digits)."""
    found = {ours: header[theirs] for theirs, ours in GGUF_SAMPLING_KEYS.items() if theirs in header}
    return _usable(
        {key: float(f"{value:.7g}") if isinstance(value, float) else value for key, value in found.items()}, str(where)
    )


def _usable(found: dict[str, Any], where: str) -> dict[str, float | int]:
    usable = {}
    for key, value in found.items():
        if key in WHOLE_NUMBER_KEYS and isinstance(value, float) and value.is_integer():
            value = int(value)  # GGUF stores top_k as an int32, but a hand-written JSON may say 40.0
        try:
            usable.update(check_sampling_defaults({key: value}))
        except RegistryError as error:
            log.warning("%s: not used as a sampling default: %s", where, error)
    return usable
