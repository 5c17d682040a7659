"""OpenAI request fields -> the engine's SamplingParams, with bad values reported under the OpenAI name.
Every route that runs the engine (chat, completions, responses) builds its SamplingParams here, so each
one applies the model's own sampling defaults the same way: to the fields the request leaves out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.errors import invalid_request
from app.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from app.registry.spec import ModelSpec
    from app.settings import Settings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default
# The fields a model's defaults fill in; max_tokens too, but each API defaults that in its own way.
DEFAULTABLE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(frozen=True)
class ModelSampling:
    """What the model a request runs on brings to its SamplingParams: the room for tokens, and the
    model's own defaults (app.registry.sampling_defaults) for the fields the request leaves out."""

    max_model_len: int
    max_tokens_cap: int
    defaults: Mapping[str, float | int] = field(default_factory=dict)

    def default_max_tokens(self, prompt_len: int, api_default: int | None = None) -> int:
        """For a request without max_tokens: the smaller of the model's default and the API's (the legacy
        completions API's 16 stays, as in vLLM), else until the context is full; never past the context
        or the cap, as the request did not ask for it. A max_tokens the request sets is not capped here."""
        room = max(1, min(self.max_tokens_cap, self.max_model_len - prompt_len))
        if "max_tokens" not in self.defaults:
            return room if api_default is None else api_default
        model_default = min(int(self.defaults["max_tokens"]), room)
        return model_default if api_default is None else min(model_default, api_default)


def sampling_defaults(spec: ModelSpec, settings: Settings) -> dict[str, float | int]:
    """What a request that sets none gets on the model of `spec`: its own defaults, with the server's
    --default-temperature over its temperature (an operator's override for every model, as vLLM's
    --override-generation-config goes over a checkpoint's generation config)."""
    defaults = dict(spec.sampling_defaults)
    if settings.default_temperature is not None:
        defaults["temperature"] = settings.default_temperature
    return defaults


def chat_sampling_params(body: ChatCompletionRequest, prompt_len: int, model: ModelSampling) -> SamplingParams:
    max_tokens: int | None
    if body.max_completion_tokens is not None:
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = body.max_tokens, "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("logprobs must be true when top_logprobs is set.", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if max_tokens is None:
        max_tokens = model.default_max_tokens(prompt_len)
    return _sampling_params(
        body, model, max_tokens, logprobs, names={"max_tokens": max_tokens_param, "logprobs": "top_logprobs"}
    )


def completion_sampling_params(body: CompletionRequest, prompt_len: int, model: ModelSampling) -> SamplingParams:
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = model.default_max_tokens(prompt_len, COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _sampling_params(body, model, max_tokens, body.logprobs, names={})


def defaulted(body: SamplingFields, defaults: Mapping[str, float | int]) -> dict[str, float | int | None]:
    """The request's sampling fields, each one it did not set (left out, or null) taken from the model's
    defaults. A value the request sets wins, even one equal to OpenAI's default (temperature 1.0)."""
    given = body.model_fields_set
    return {
        name: getattr(body, name) if name in given and getattr(body, name) is not None else defaults.get(name)
        for name in DEFAULTABLE_FIELDS
    }


def _sampling_params(
    body: SamplingFields, model: ModelSampling, max_tokens: int, logprobs: int | None, names: dict[str, str]
) -> SamplingParams:
    max_tokens_param = names.get("max_tokens", "max_tokens")
    if isinstance(max_tokens, int) and max_tokens > model.max_tokens_cap:
        raise invalid_request(
            f"{max_tokens_param} is too large: {max_tokens}. This server allows at most "
            f"{model.max_tokens_cap} completion tokens.",
            param=max_tokens_param,
        )
    try:
        logit_bias = {int(token): bias for token, bias in (body.logit_bias or {}).items()}
    except ValueError:
        raise invalid_request("logit_bias keys must be token ids.", param="logit_bias") from None
    if any(token < 0 for token in logit_bias):  # a negative id would index the vocabulary from its end
        raise invalid_request("logit_bias keys must be non-negative token ids.", param="logit_bias")
    fields: dict[str, Any] = dict(  # checked by SamplingParams itself, each under its OpenAI name
        n=body.n,
        max_tokens=max_tokens,
        **defaulted(body, model.defaults),
        logit_bias=logit_bias,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
    )
    try:
        return SamplingParams(**{name: value for name, value in fields.items() if value is not None})
    except InvalidParameter as error:
        param = names.get(error.param, error.param)
        raise invalid_request(str(error).replace(error.param, param, 1), param=param) from None
