"""OpenAI request fields -> the engine's SamplingParams, with bad values reported under the OpenAI name."""
from __future__ import annotations

from dataclasses import dataclass

from app.errors import invalid_request
from app.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from engine.sampling_params import InvalidParameter, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default


@dataclass(frozen=True)
class TokenBudget:
    max_model_len: int
    max_tokens_cap: int
    default_temperature: float | None = None  # for a request that sets none (--default-temperature)


def chat_sampling_params(body: ChatCompletionRequest, prompt_len: int, budget: TokenBudget) -> SamplingParams:
    if body.max_completion_tokens is not None:
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_tokens_param = body.max_tokens, "max_tokens"
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("logprobs must be true when top_logprobs is set.", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, prompt_len, budget, max_tokens, logprobs,
                            names={"max_tokens": max_tokens_param, "logprobs": "top_logprobs"})


def completion_sampling_params(body: CompletionRequest, prompt_len: int, budget: TokenBudget) -> SamplingParams:
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return _sampling_params(body, prompt_len, budget, max_tokens, body.logprobs, names={})


def _sampling_params(body: SamplingFields, prompt_len: int, budget: TokenBudget, max_tokens: int | None,
                     logprobs: int | None, names: dict[str, str]) -> SamplingParams:
    max_tokens_param = names.get("max_tokens", "max_tokens")
    if max_tokens is None:
        # until the context is full, but no further than the cap
        max_tokens = max(1, min(budget.max_tokens_cap, budget.max_model_len - prompt_len))
    elif isinstance(max_tokens, int) and max_tokens > budget.max_tokens_cap:
        raise invalid_request(f"{max_tokens_param} is too large: {max_tokens}. This server allows at most "
                              f"{budget.max_tokens_cap} completion tokens.", param=max_tokens_param)
    try:
        logit_bias = {int(token): bias for token, bias in (body.logit_bias or {}).items()}
    except ValueError:
        raise invalid_request("logit_bias keys must be token ids.", param="logit_bias") from None
    if any(token < 0 for token in logit_bias):  # a negative id would index the vocabulary from its end
        raise invalid_request("logit_bias keys must be non-negative token ids.", param="logit_bias")
    fields = dict(
        n=body.n, max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else budget.default_temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=logit_bias, seed=body.seed, stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        logprobs=logprobs,
    )
    try:
        return SamplingParams(**{name: value for name, value in fields.items() if value is not None})
    except InvalidParameter as error:
        param = names.get(error.param, error.param)
        raise invalid_request(str(error).replace(error.param, param, 1), param=param) from None
