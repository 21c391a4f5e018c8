"""What an engine is asked to do and what it gives back, independent of transformers' generate().

A request holds B sequences (rows). `BatchRows` is the one place that decides, as transformers'
own decoding loop does, when a row is done, whether it keeps decoding, and when the batch ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import StoppingCriteriaList

from ..policy.goodput import GoodputPolicy
from ..stats import RoundRecord, SwiftSpecStats
from ..drafters.suffix import OutputHistory
from ..steps.tree import Proposal
from ..steps.acceptance import NO_STOPS, StopRule, split_criteria
from ..steps.verify import Sampler, Verified


@dataclass
class DecodeRequest:
    """One speculative generation of B sequences (rows).

    prompt:         (B, L) token ids the models run on, L >= 1, left-padded where attention_mask is 0
    attention_mask: (B, L) 1 for prompt tokens, 0 for left padding; None: no padding
    contexts:       per row, (1, P + L') the input_ids target.generate gives processors and stopping
                    criteria before any new token (it may hold padding the models never see); None:
                    the prompt rows
    samplers:       per row, the target's next-token rule (its own noise when sampling)
    stopping_criteria: generate()'s criteria, called for each row on that row alone
    pads_finished:  a row done early stops and is padded to the batch's end (generate's rule when an
                    EOS criterion is present), rather than decoding on until every row is done
    policy:         chooses each round's draft expansions and tree size
    corpus:         token sequences the suffix proposals may copy from, besides the context
    history:        earlier outputs of the same model object, also copied from (None: none)
    on_tokens:      called with each round's new token ids (a list) as soon as they are verified (batch 1)
    keeps_scores / keeps_logits: whether each emitted token's (1, V) scores / logits are kept for the output
                    (generate's return_dict_in_generate with output_scores / output_logits); kept for
                    nothing else, they would hold tokens x V floats per row (262k vocabulary, 256 tokens:
                    0.5 GB a row)
    """

    prompt: torch.Tensor
    samplers: list[Sampler]
    stopping_criteria: StoppingCriteriaList
    max_new_tokens: int
    policy: GoodputPolicy
    attention_mask: torch.Tensor | None = None
    contexts: list[torch.Tensor] | None = None
    pads_finished: bool = True
    corpus: list[list[int]] = field(default_factory=list)
    history: OutputHistory | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    keeps_scores: bool = True
    keeps_logits: bool = True

    @property
    def batch_size(self) -> int:
        return self.prompt.shape[0]

    @property
    def sampler(self) -> Sampler:
        """Row 0's sampler (the only row of a single sequence)."""
        return self.samplers[0]

    def prompt_ids(self) -> list[list[int]]:
        """Each row's prompt without its padding."""
        if self.attention_mask is None:
            return self.prompt.tolist()
        return [row[mask.bool()].tolist() for row, mask in zip(self.prompt, self.attention_mask)]


@dataclass
class RowResult:
    """One row's new tokens with, per token, the processed scores and raw logits (1, V) the target used.

    done_at: how many new tokens the row had when a stopping criterion fired (or max_new_tokens was
        reached); None while it runs.
    verifications: target verifications the row took part in
    """

    tokens: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    done_at: int | None = None
    verifications: int = 0

    def add(self, outcome: Verified, keeps_scores: bool, keeps_logits: bool) -> None:
        """Fold in one verification's walk (its scores and logits only where the call keeps them: copies, a
        walk's rows are views into its whole (T, V) step)."""
        self.verifications += 1
        self.tokens += outcome.tokens
        if keeps_scores:
            self.scores += [s.clone() for s in outcome.scores]
        if keeps_logits:
            self.logits += [s.clone() for s in outcome.logits]

    @property
    def tau(self) -> float:
        """The row's tokens per verification it took part in."""
        return len(self.tokens) / self.verifications if self.verifications else 0.0


@dataclass
class DecodeResult:
    """Every row's result, the batch's length (`end` new tokens per row) and the call's statistics."""

    rows: list[RowResult] = field(default_factory=list)
    end: int = 0
    stats: SwiftSpecStats = field(default_factory=SwiftSpecStats)
    rounds: list[RoundRecord] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Row 0's tokens (the only row of a single sequence)."""
        return self.rows[0].tokens if self.rows else []

    @property
    def new_tokens(self) -> int:
        """Tokens verified over all rows (what the engine produced, before the batch's padding)."""
        return sum(min(len(r.tokens), self.end) for r in self.rows)

    def record_round(self, proposals: list[Proposal], verified: list[Verified | None], expansions: int) -> None:
        """Keep what the policy chose this round and where the accepted tokens came from."""
        self.rounds.append(round_record(proposals, verified, expansions))


def round_record(proposals: list[Proposal], verified: list[Verified | None], expansions: int) -> RoundRecord:
    """What the policy chose in one round (one proposal per row) and where its accepted tokens came from."""
    accepted = ngram = 0
    for proposal, outcome in zip(proposals, verified):
        if outcome is None:
            continue
        path = outcome.path[1:]  # the root's token is the target's own, not a proposal
        accepted += len(path)
        ngram += sum(1 for i in path if proposal.suffix[i] >= 0)
    return RoundRecord(
        budget=max(len(p.subtree) for p in proposals),
        expansions=expansions,
        accepted=accepted,
        ngram_accepted=ngram,
        rows=sum(v is not None for v in verified),
    )


@dataclass
class BatchRows:
    """The rows of a generation that still decode (`live`: the original index of each cache row, in
    order), as transformers' `_sample` runs them: a row is done once a stopping criterion fired for
    it or it reached max_new_tokens. With `pads_finished` a done row stops (target.generate pads it);
    without, every row keeps decoding real tokens until all are done, and the batch ends at the
    length the last one finished at (`end`), which every row then reaches.
    """

    result: DecodeResult
    max_new_tokens: int
    pads_finished: bool
    live: list[int]
    keeps_scores: bool = True
    keeps_logits: bool = True
    stops: StopRule = NO_STOPS  # the request's stopping criteria, split once (reading EOS ids is a host sync)
    on_tokens: Callable[[list[int]], None] | None = None  # the request's streamer of each row's new tokens

    @classmethod
    def start(cls, request: DecodeRequest) -> "BatchRows":
        result = DecodeResult(rows=[RowResult() for _ in range(request.batch_size)])
        return cls(
            result, request.max_new_tokens, request.pads_finished, list(range(request.batch_size)),
            request.keeps_scores, request.keeps_logits, split_criteria(request.stopping_criteria), request.on_tokens,
        )

    @property
    def end(self) -> int | None:
        """New tokens per row once every row is done (None before)."""
        rows = self.result.rows
        return None if any(r.done_at is None for r in rows) else max(r.done_at for r in rows)

    def budgets(self) -> list[int]:
        """Per live row, the most tokens it may still emit."""
        limit = self.end if self.end is not None else self.max_new_tokens
        return [limit - len(self.result.rows[i].tokens) for i in self.live]

    def criteria(self) -> list[StopRule]:
        """Per live row, the rule its walk stops at: none once the row is done (it only decodes on)."""
        rows = self.result.rows
        return [self.stops if rows[i].done_at is None else NO_STOPS for i in self.live]

    def record(self, verified: list[Verified | None], on_tokens=None) -> list[int]:
        """Fold in one round's walks (one per live row); returns the cache rows that keep decoding (in
        increasing order; `keep` then drops the others)."""
        for b, outcome in enumerate(verified):
            row = self.result.rows[self.live[b]]
            row.add(outcome, self.keeps_scores, self.keeps_logits)
            if on_tokens is not None:
                on_tokens(outcome.tokens)
            if outcome.finished and row.done_at is None:
                row.done_at = len(row.tokens)
        end = self.end
        rows = self.result.rows
        limit = end if end is not None else self.max_new_tokens  # a done row never needs more than this
        keep = [
            b for b, i in enumerate(self.live)
            if rows[i].done_at is None or not (self.pads_finished or len(rows[i].tokens) >= limit)
        ]
        if not keep:
            self.result.end = end
        return keep

    def fold_round(self, proposed, verified: list[Verified]) -> list[int]:
        """The round's walks folded in, streamed (engine/rounds.py's RoundRows); the cache rows that keep decoding."""
        return self.record(verified, self.on_tokens)

    def record_round(self, proposed, verified: list[Verified]) -> None:
        """The round's RoundRecord, for the call's stats."""
        self.result.record_round(proposed.proposals, verified, proposed.expansions)

    def keep(self, order: list[int]) -> None:
        """Keep only the live rows `order` (cache row order[i] becomes row i), as the caches do."""
        self.live = [self.live[b] for b in order]
