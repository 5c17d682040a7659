"""From request to prompt token ids: the model's chat template for chat, plain encoding for completions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.errors import invalid_request
from app.serving.schemas import ChatMessage, Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage]) -> list[int]:
    conversation = [
        {"role": "system" if message.role == "developer" else message.role, "content": message.content or ""}
        for message in messages
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # templates raise on conversations they refuse (e.g. roles out of turn)
        raise invalid_request(f"The chat template rejected these messages: {error}", param="messages") from error
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)  # a decorator hides encode's type
    return ids


def completion_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, index: int, many: bool) -> list[int]:
    param = f"prompt.[{index}]" if many else "prompt"
    ids: list[int]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        vocab_size = len(tokenizer)
        if any(not 0 <= token_id < vocab_size for token_id in prompt):
            raise invalid_request(f"Token ids must be between 0 and {vocab_size - 1}.", param=param)
        ids = list(prompt)
    if not ids:
        raise invalid_request("The prompt must not be empty.", param=param)
    return ids
