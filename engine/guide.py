"""The engine's hook for constrained decoding: a guide says which tokens may come next.

The engine asks each guided sequence's guide for a mask before sampling, tells it the token chosen, and
stops the sequence when the guide says the constrained output is complete. What the constraint is (a
JSON schema, a tool call) is up to the guide; the engine knows only this interface.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Guide(Protocol):
    def allowed_tokens(self) -> torch.Tensor | None:
        """Bool mask over the vocabulary of tokens allowed next; None when anything goes."""

    def advance(self, token_id: int) -> None:
        """The sampled token; called once per generated token, in order."""

    @property
    def done(self) -> bool:
        """True once the output is complete: the engine then finishes the sequence with 'stop'."""


class GuideFactory(Protocol):
    def new_guide(self) -> Guide:
        """A fresh guide for one sequence (each of n sequences gets its own)."""
