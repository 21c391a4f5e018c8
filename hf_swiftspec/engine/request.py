"""What an engine is asked to do and what it gives back, independent of transformers' generate()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import StoppingCriteriaList

from ..policy import GoodputPolicy
from ..suffix import OutputHistory
from ..stats import RoundRecord, SwiftSpecStats
from ..tree import Proposal
from ..verify import Sampler, Verified


@dataclass
class DecodeRequest:
    """One batch-1 speculative generation.

    prompt:     (1, L) token ids, L >= 1: what the models run on
    padding:    (1, P) left padding before the prompt, P >= 0: the models never see it, but logits
                processors and stopping criteria get padding + prompt + new tokens, exactly the
                input_ids target.generate gives them (they may count or read the padding)
    policy:     chooses each round's draft expansions and tree size
    corpus:     token sequences the suffix proposals may copy from, besides the context
    history:    earlier outputs of the same model object, also copied from (None: none)
    on_tokens:  called with each round's new token ids (a list) as soon as they are verified
    """

    prompt: torch.Tensor
    sampler: Sampler
    stopping_criteria: StoppingCriteriaList
    max_new_tokens: int
    policy: GoodputPolicy
    corpus: list[list[int]] = field(default_factory=list)
    history: OutputHistory | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    padding: torch.Tensor | None = None


@dataclass
class DecodeResult:
    """New tokens with, per token, the processed scores and raw logits (1, V) the target used."""

    tokens: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    stats: SwiftSpecStats = field(default_factory=SwiftSpecStats)
    rounds: list[RoundRecord] = field(default_factory=list)

    def record_round(self, proposal: Proposal, verified: Verified, expansions: int) -> None:
        """Keep what the policy chose this round and where the accepted tokens came from."""
        accepted = verified.path[1:]  # the root's token is the target's own, not a proposal
        self.rounds.append(
            RoundRecord(
                budget=len(proposal.subtree),
                expansions=expansions,
                accepted=len(accepted),
                ngram_accepted=sum(1 for i in accepted if proposal.suffix[i] >= 0),
            )
        )

    def emit(self, verified: Verified, request: DecodeRequest) -> None:
        """Record one verification's tokens (with their scores and logits) and stream them."""
        self.tokens += verified.tokens
        self.scores += verified.scores
        self.logits += verified.logits
        if request.on_tokens is not None:
            request.on_tokens(verified.tokens)
