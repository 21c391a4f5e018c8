"""What an engine is asked to do and what it gives back, independent of transformers' generate()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import StoppingCriteriaList

from ..policy import DepthPolicy
from ..stats import SwiftSpecStats
from ..verify import Sampler, Verified


@dataclass
class DecodeRequest:
    """One batch-1 speculative generation.

    prompt:     (1, L) token ids, L >= 1
    on_tokens:  called with each round's new token ids (a list) as soon as they are verified
    """

    prompt: torch.Tensor
    sampler: Sampler
    stopping_criteria: StoppingCriteriaList
    max_new_tokens: int
    tree_budget: int
    depth: DepthPolicy
    on_tokens: Callable[[list[int]], None] | None = None


@dataclass
class DecodeResult:
    """New tokens with, per token, the processed scores and raw logits (1, V) the target used."""

    tokens: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    stats: SwiftSpecStats = field(default_factory=SwiftSpecStats)

    def emit(self, verified: Verified, request: DecodeRequest) -> None:
        """Record one verification's tokens (with their scores and logits) and stream them."""
        self.tokens += verified.tokens
        self.scores += verified.scores
        self.logits += verified.logits
        if request.on_tokens is not None:
            request.on_tokens(verified.tokens)
