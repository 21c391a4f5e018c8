"""Tree verification: lossless by construction.

Walk from the root. At each node take the target's own next token from its processed logits
(argmax, or a sample), with the logits processors fed the exact path as context. If a child
carries that token, move to it; otherwise stop. Every emitted token is therefore the token
`target.generate` would have produced at that position (greedy) or a draw from exactly the
distribution it would have sampled from.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
from swiftspec_kernels.fused import on_host_values
from swiftspec_kernels.tree_walk import walk_row_on_host
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..models.compat import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, logits_process
from .acceptance import (NO_STOPS, StopRule, cut_at_criteria, gumbel_noise, round_result, split_criteria,
                         walk_subtree)
from .device_round import DeviceSubtree
from .tree import Subtree, subtree_mask

__all__ = ["NO_STOPS", "StopRule", "split_criteria"]  # the acceptance rules, re-exported where callers look for them

# Processors whose output for a row depends on that row's logits alone, never on the tokens before
# it (input_ids) or their count: with only these, every tree node can be processed at once. Matched
# by exact type: a subclass may read input_ids, so it takes the node-by-node walk.
PATH_FREE_PROCESSORS = frozenset(
    getattr(logits_process, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "TopHLogitsWarper",
        "SuppressTokensLogitsProcessor",
        "LogitNormalization",
    )
    if hasattr(logits_process, name)
)


# Processors (exact types) whose output for a row depends on that row alone (its logits, its tokens,
# its length), never on the other rows of the batch: with only these, each row of a batch is walked
# on its own, its processors called with its own sequence, exactly as the batched call would treat it.
ROW_WISE_PROCESSORS = PATH_FREE_PROCESSORS | frozenset(
    getattr(logits_process, name)
    for name in (
        "RepetitionPenaltyLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "SuppressTokensAtBeginLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
        "WatermarkLogitsProcessor",
    )
    if hasattr(logits_process, name)
)
ROW_WISE_CRITERIA = (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria)
# Row-wise processors that generate() builds with one value per batch row in a field (a tensor whose
# first dimension is the batch): a row's own copy holds its own value.
PER_ROW_FIELDS = {logits_process.RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",)}


def batch_dependent(logits_processor, stopping_criteria) -> list[str]:
    """The processors and criteria a per-row walk cannot be shown to call as the batched loop does
    (they may read other rows, or keep per-batch state): their class names."""
    names = [type(p).__name__ for p in logits_processor if type(p) not in ROW_WISE_PROCESSORS]
    return names + [type(c).__name__ for c in stopping_criteria if type(c) not in ROW_WISE_CRITERIA]


def apply_processors(processors: LogitsProcessorList, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """processors(input_ids, scores), as LogitsProcessorList.__call__ without keyword arguments does it,
    minus its inspect.signature per processor and call (that costs more than the processing here,
    where the walk calls them once per row and node)."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def processors_for_row(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors as row `row` of a batch sees them alone (per-row fields cut to that row)."""
    out = LogitsProcessorList()
    for processor in processors:
        fields = [f for f in PER_ROW_FIELDS.get(type(processor), ()) if isinstance(getattr(processor, f), torch.Tensor)]
        if fields:
            processor = copy.copy(processor)
            for name in fields:
                setattr(processor, name, getattr(processor, name)[row : row + 1])
        out.append(processor)
    return out


@dataclass
class Sampler:
    """The target's next-token rule: generate()'s logits processors, then argmax or a sample.

    Sampling is Gumbel-max with noise drawn per sequence position (gumbel_noise: a function of the seed,
    the row and the position), so the token at a position depends on its context and the seed only, never on
    the tree that was verified: every node at one depth shares that depth's noise, and the walk
    uses one node per depth, so the emitted tokens are exact draws from the target's distribution,
    and a seed reproduces them whatever trees the policy chose. Each row of a batch has noise of
    its own (gumbel_noise keys it by the row), so rows are independent draws.

    generator: explicit RNG for sampling, on the target's device (None for greedy); the seed is
        drawn from it on first use.
    row: the batch row this sampler draws for.
    """

    logits_processor: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None = None
    seed: int | None = None
    row: int = 0

    def for_rows(self, rows: int) -> list["Sampler"]:
        """One sampler per batch row, with the processors as that row sees them and this one's seed
        (drawn now if needed)."""
        if self.do_sample:
            self.draw_seed()
        return [
            dataclasses.replace(self, row=b, logits_processor=processors_for_row(self.logits_processor, b))
            for b in range(rows)
        ]

    def draw_seed(self) -> int:
        if self.seed is None:
            self.seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.generator.device))
        return self.seed

    @property
    def path_free(self) -> bool:
        """Whether the processors ignore the path, so all nodes can be processed in one call."""
        return all(type(p) in PATH_FREE_PROCESSORS for p in self.logits_processor)

    def gumbel(self, positions: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """Gumbel noise (n, V) float64 for each of `positions` (absolute sequence positions): gumbel_noise's."""
        seed = self.draw_seed()
        at = torch.tensor([positions], dtype=torch.long, device=device)
        return gumbel_noise(torch.tensor([seed], device=device), torch.tensor([self.row], device=device), at, vocab)[0]

    def pick(self, scores: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Tokens (n,) from processed scores (n, V): argmax, or a draw for the row's position."""
        if not self.do_sample:
            return torch.argmax(scores, dim=-1)
        return torch.argmax(scores.double() + self.gumbel(positions, scores.shape[-1], scores.device), dim=-1)

    def choose_rows(self, context: torch.Tensor, logits: torch.Tensor,
                    depths: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For path-free processors: next token (T,) and processed scores (T, V) of every row at once.

        depths: each row's depth in the tree (host ints; or a (T,) tensor, which is never read on the
            host: a sampled row's noise is then drawn for every depth below T and indexed on the device);
            its token is for position context length + depth.
        """
        scores = apply_processors(self.logits_processor, context, logits)
        if not self.do_sample:
            return torch.argmax(scores, dim=-1), scores
        if not isinstance(depths, torch.Tensor):
            return self.pick(scores, [context.shape[1] + d for d in depths]), scores
        noise = self.gumbel([context.shape[1] + d for d in range(depths.shape[0])], scores.shape[-1], scores.device)
        return (scores.double() + noise[depths]).argmax(dim=-1), scores

    def choose(self, context: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token (1,) and processed scores (1, V) given context (1, L) and raw logits (1, V)."""
        scores = apply_processors(self.logits_processor, context, logits)
        return self.pick(scores, [context.shape[1]]), scores


@dataclass
class Verified:
    """Outcome of one verification step.

    tokens:   emitted token ids, in order (m >= 1 unless the budget was already spent)
    path:     local subtree indices whose KV the target now holds and commits: the root and the
              accepted draft nodes (len == len(tokens)); the last emitted token is the next root
    scores:   processed scores (1, V) for each emitted token (for output_scores)
    logits:   raw logits (1, V) for each emitted token (for output_logits)
    finished: a stopping criterion fired or max_new_tokens was reached
    features: (len(path), D) the target's hidden states at the path's nodes, for drafters that read them
              (an EAGLE-3 head); None otherwise
    """

    tokens: list[int] = field(default_factory=list)
    path: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    features: torch.Tensor | None = None


def verify_tree(logits: torch.Tensor, subtree: Subtree, context: torch.Tensor, sampler: Sampler,
                stopping_criteria: "StoppingCriteriaList | StopRule", max_tokens: int) -> Verified:
    """Walk the subtree with the target's choices (verify_rows for one row).

    logits:  (T, V) float32 target logits at each subtree node (row i predicts the token after node i)
    context: (1, L) committed sequence ending with the root token
    max_tokens: tokens still allowed by max_new_tokens / max_length
    """
    return verify_rows([logits], [subtree], [context], [sampler], [stopping_criteria], [max_tokens])[0]


def children_of(parents: list[int], tokens: list[int], proposed: list[bool] | None = None) -> dict[tuple[int, int], int]:
    """(parent, token) -> the first proposed child carrying that token under that parent (local indices;
    parents precede children). proposed: False for padding, which a walk never enters (default: all)."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, token) in enumerate(zip(parents, tokens)):
        if p >= 0 and (proposed is None or proposed[i]):
            children.setdefault((p, token), i)
    return children


def verify_rows(logits: list, subtrees: list, contexts: list, samplers: list[Sampler], stopping_criteria: list,
                max_tokens: list[int]) -> list[Verified | None]:
    """Every row's walk of a batch (None where the row's subtree is None). The rows whose processors ignore the path
    are chosen at once and walked together by acceptance.walk_subtree (the device round's walk), read in one host
    sync; the others node by node (walk_nodes). Each walk is then cut where the host's criteria fire.

    logits[b]: (T_b, V) row b's logits at its subtree's nodes; contexts[b]: (1, L_b) its committed sequence;
    stopping_criteria[b]: generate()'s criteria or their StopRule."""
    rules = [c if isinstance(c, StopRule) else split_criteria(c) for c in stopping_criteria]
    out: list[Verified | None] = [None] * len(subtrees)
    together = [b for b, s in enumerate(subtrees) if s is not None and samplers[b].path_free]
    for b, verified in zip(together, walk_together([logits[b] for b in together], [subtrees[b] for b in together],
                                                   [contexts[b] for b in together], [samplers[b] for b in together],
                                                   [rules[b] for b in together], [max_tokens[b] for b in together])):
        out[b] = verified
    for b, subtree in enumerate(subtrees):
        if subtree is not None and b not in together:
            children = children_of(subtree.parents, subtree.tokens)
            out[b] = walk_nodes(logits[b], children, contexts[b], samplers[b], rules[b], max_tokens[b])
    return out


def walk_together(logits: list, subtrees: list[Subtree], contexts: list, samplers: list[Sampler],
                  rules: list[StopRule], max_tokens: list[int]) -> list[Verified]:
    """Path-free rows' walks: each row's choices after every node (its processors over all its nodes at once, then
    argmax or its Gumbel-max), the rows' subtrees in one (n, T) DeviceSubtree made of one host tensor, one
    walk_subtree, one read. A plain round's roots, and every walk on a CPU (where reading the choices is free and a
    loop over host lists beats the tensors' round trip), are walked on host values after one read of the choices."""
    if not subtrees:
        return []
    device = logits[0].device
    T = max(len(s) for s in subtrees)
    E = max([0] + [len(r.eos) for r in rules])
    chosen, packed = [], []
    on_cpu = on_host_values(logits[0])
    for row, subtree, context, sampler, rule, limit in zip(logits, subtrees, contexts, samplers, rules, max_tokens):
        n, pad = len(subtree), T - len(subtree)
        depths, bits = [], []
        for i, p in enumerate(subtree.parents):  # host ints (parents precede children): no read of the device
            depths.append(depths[p] + 1 if p >= 0 else 0)
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        # processors may write into the scores they get: give them a copy, or nothing to copy when there are none
        chosen.append(sampler.choose_rows(context, row.clone() if sampler.logits_processor else row, depths))
        if T == 1 or on_cpu:  # a plain round, or a CPU's, walks on the host (below): nothing to pack
            continue
        eos = sorted(rule.eos)
        packed.append(subtree.tokens + [0] * pad + subtree.parents + [-1] * pad + depths + [0] * pad
                      + [1] * n + [0] * pad + [rule.budget(limit, context.shape[1])] + eos + [-1] * (E - len(eos))
                      + (bits + [1 << (n + k) for k in range(pad)] if T <= 62 else []))
    if T == 1 or on_cpu:  # a plain round (roots alone), or a CPU's (a read is free): the choices read once, walked on
        return finish_walks(chosen, logits, contexts, rules,  # host lists
                            walks_on_host(chosen, subtrees, contexts, rules, max_tokens, T), T)
    host = torch.tensor(packed, dtype=torch.long).to(device)  # one copy: tokens, parents, depths, budgets, EOS, bits
    if T <= 62:  # each node's ancestor bits in one int64: the (n, T, T) mask in three operations
        bits = host[:, 4 * T + 1 + E :]
        mask = (bits[:, :, None] >> torch.arange(T, device=device)) & 1 > 0
    else:
        mask = torch.stack([padded_mask(s.parents, T, device) for s in subtrees])
    sub = DeviceSubtree(node_ids=host[:, :T], tokens=host[:, :T], parents=host[:, T : 2 * T], scores=None,
                        valid=host[:, 3 * T : 4 * T] > 0, depths=host[:, 2 * T : 3 * T], mask=mask)  # (ids, scores: unread)
    choices = [c for c, _ in chosen]
    choices = torch.stack([torch.nn.functional.pad(c, (0, T - c.shape[0])) for c in choices]) if len(choices) > 1 or \
        choices[0].shape[0] < T else choices[0][None]
    walk = walk_subtree(choices, sub, host[:, 4 * T], host[:, 4 * T + 1 : 4 * T + 1 + E] if E else None)
    read = torch.cat([round_result(walk), walk.path], dim=1).tolist()  # the walks' one read: counts, flags, tokens, paths
    return finish_walks(chosen, logits, contexts, rules, read, T)


def walks_on_host(chosen: list, subtrees: list[Subtree], contexts: list, rules: list[StopRule], max_tokens: list[int],
                  T: int) -> list[list[int]]:
    """Each row's walk as walk_subtree's read gives it (per row [count, finished, T tokens, T path nodes]), walked on
    host values (swiftspec_kernels' walk_row_on_host, the fused walk's loop) after one read of every row's choices."""
    choices = torch.cat([c for c, _ in chosen]).tolist()
    read, at = [], 0
    for subtree, context, rule, limit in zip(subtrees, contexts, rules, max_tokens):
        n = len(subtree)
        path, tokens, finished = walk_row_on_host(choices[at : at + n], subtree.tokens, subtree.parents, [True] * n,
                                                  rule.budget(limit, context.shape[1]), rule.eos)
        at += n
        pad = [-1] * (T - len(path))
        read.append([len(path), int(finished), *tokens, *pad, *path, *pad])
    return read


def finish_walks(chosen: list, logits: list, contexts: list, rules: list[StopRule], read: list[list[int]],
                 T: int) -> list[Verified]:
    """Each row's Verified from its read walk (per row [count, finished, T tokens, T path nodes]), with its
    scores and logits along the path, cut where the host's criteria fire."""
    out = []
    for (_, scores), row, context, rule, result in zip(chosen, logits, contexts, rules, read):
        count, finished = result[0], bool(result[1])
        verified = Verified(result[2 : 2 + count], result[2 + T : 2 + T + count], finished=finished)
        verified.scores = [scores[node : node + 1] for node in verified.path]
        verified.logits = [row[node : node + 1] for node in verified.path]
        cut = cut_at_criteria(verified.tokens, context, rule, verified.scores)
        if cut is not None:
            keep = count - cut
            del verified.tokens[keep:], verified.path[keep:], verified.scores[keep:], verified.logits[keep:]
            verified.finished = True
        out.append(verified)
    return out


def padded_mask(parents: list[int], T: int, device) -> torch.Tensor:
    """A subtree's ancestor-or-self mask (n, n) padded to (T, T), each padding node its own ancestor alone."""
    mask, _ = subtree_mask(parents, device)
    n = len(parents)
    return torch.nn.functional.pad(mask, (0, T - n, 0, T - n)) | torch.eye(T, dtype=torch.bool, device=device) & (
        torch.arange(T, device=device) >= n)[:, None]


def walk_nodes(logits, children: dict, context, sampler: Sampler, stopping_criteria, max_tokens: int) -> Verified:
    """The walk node by node, each node's processors fed the exact path that leads to it (the stop rule as every
    walk's: StopRule.fires after each token)."""
    stops = stopping_criteria if isinstance(stopping_criteria, StopRule) else split_criteria(stopping_criteria)
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
        if stops.fires(context, token_id, scores):
            out.finished = True
            return out
        node = children.get((node, token_id))
        if node is None:
            break
    out.finished = out.finished or len(out.tokens) >= max_tokens
    return out
