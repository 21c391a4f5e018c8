"""Tree verification: lossless by construction.

Walk from the root. At each node take the target's own next token from its processed logits
(argmax, or a sample), with the logits processors fed the exact path as context. If a child
carries that token, move to it; otherwise stop. Every emitted token is therefore the token
`target.generate` would have produced at that position (greedy) or a draw from exactly the
distribution it would have sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .tree import Subtree


@dataclass
class Sampler:
    """The target's next-token rule: generate()'s logits processors, then argmax or a sample.

    generator: explicit RNG for sampling, on the target's device (None for greedy).
    """

    logits_processor: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None = None

    def choose(self, context: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token (1,) and processed scores (1, V) given context (1, L) and raw logits (1, V)."""
        scores = self.logits_processor(context, logits)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            token = torch.argmax(scores, dim=-1)
        return token, scores


@dataclass
class Verified:
    """Outcome of one verification step.

    tokens:   emitted token ids, in order (m >= 1 unless the budget was already spent)
    path:     local subtree indices whose KV the target now holds and commits: the root and the
              accepted draft nodes (len == len(tokens)); the last emitted token is the next root
    scores:   processed scores (1, V) for each emitted token (for output_scores)
    logits:   raw logits (1, V) for each emitted token (for output_logits)
    finished: a stopping criterion fired or max_new_tokens was reached
    """

    tokens: list[int] = field(default_factory=list)
    path: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False


def verify_tree(
    logits: torch.Tensor,
    subtree: Subtree,
    context: torch.Tensor,
    sampler: Sampler,
    stopping_criteria: StoppingCriteriaList,
    max_tokens: int,
) -> Verified:
    """Walk the subtree with the target's choices.

    logits:  (T, V) float32 target logits at each subtree node (row i predicts the token after node i)
    context: (1, L) committed sequence ending with the root token
    max_tokens: tokens still allowed by max_new_tokens / max_length
    """
    children = {(p, tok): i for i, (p, tok) in enumerate(zip(subtree.parents, subtree.tokens)) if p >= 0}
    out = Verified()
    node = 0
    while len(out.tokens) < max_tokens:
        row = logits[node : node + 1]
        token, scores = sampler.choose(context, row.clone())
        context = torch.cat([context, token.unsqueeze(0).to(context.device)], dim=-1)
        token_id = int(token)
        out.tokens.append(token_id)
        out.path.append(node)
        out.scores.append(scores)
        out.logits.append(row)
        if len(stopping_criteria) and bool(stopping_criteria(context, scores).any()):
            out.finished = True
            return out
        node = children.get((node, token_id))
        if node is None:
            break
    out.finished = out.finished or len(out.tokens) >= max_tokens
    return out
