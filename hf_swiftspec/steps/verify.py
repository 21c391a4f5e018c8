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
from typing import NamedTuple

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..models.compat import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, logits_process
from .tree import Subtree

MASK64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


GOLDEN = _int64(0x9E3779B97F4A7C15)
MIX = (_int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """z >> k as unsigned 64-bit (torch shifts int64 arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 tensors (multiplications wrap, as the 64-bit original's)."""
    z = z ^ _shift_right(z, 30)
    z = z * MIX[0]
    z = z ^ _shift_right(z, 27)
    z = z * MIX[1]
    return z ^ _shift_right(z, 31)


def gumbel_noise(seeds: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise (B, D, V) float64 for each row's positions: a counter-based generator, so the noise of a (seed,
    row, position, token) is a pure function of the four, drawn on the device with no generator state and no host
    data (the device round draws it inside its replayed verification).

    seeds (B,) long: each row's seed; rows (B,) long: its row number (rows of a batch are independent draws);
    positions (B, D) long: absolute sequence positions. Uniforms from splitmix64 of the four (53 bits, in (0, 1)),
    then -log(-log(u))."""
    state = splitmix64(seeds + GOLDEN * (rows + 1))  # (B,)
    state = splitmix64(state[:, None] + GOLDEN * (positions + 1))  # (B, D)
    tokens = torch.arange(1, vocab + 1, device=positions.device)
    bits = _shift_right(splitmix64(state[:, :, None] + GOLDEN * tokens), 11)  # (B, D, V) 53 random bits
    u = (bits.double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


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
    children = children_of(subtree.parents, subtree.tokens)
    if sampler.path_free:
        return walk_rows(logits, children, context, sampler, stopping_criteria, max_tokens)
    return walk_nodes(logits, children, context, sampler, stopping_criteria, max_tokens)


def children_of(parents: list[int], tokens: list[int], proposed: list[bool] | None = None) -> dict[tuple[int, int], int]:
    """(parent, token) -> the first proposed child carrying that token under that parent (local indices;
    parents precede children). proposed: False for padding, which a walk never enters (default: all)."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, token) in enumerate(zip(parents, tokens)):
        if p >= 0 and (proposed is None or proposed[i]):
            children.setdefault((p, token), i)
    return children


def walk_path(choice: list[int], children: dict[tuple[int, int], int], max_tokens: int) -> Verified:
    """The walk, for every round (the adaptive one, the static one): from the root, emit the target's choice
    after the current node and move to the child carrying it, while there is one and tokens are left.
    Returns the path (root first) and the emitted tokens (the last is the next root); walk_to_stop cuts it."""
    out = Verified()
    node = 0
    while node is not None and len(out.path) < max_tokens:
        out.path.append(node)
        out.tokens.append(choice[node])
        node = children.get((node, choice[node]))
    return out


def walk_rows(logits, children: dict, context, sampler: Sampler, stopping_criteria, max_tokens: int) -> Verified:
    """The walk when no processor depends on the path: every row processed and chosen at once
    (one host sync), then the walk itself on the host, then the stopping criteria on its prefixes."""
    tokens, scores = choose_nodes(logits, children, context, sampler)
    return walk_to_stop(walk_path(tokens.tolist(), children, max_tokens), scores, logits, context, stopping_criteria,
                        max_tokens)  # fmt: skip


def choose_nodes(logits, children: dict, context, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """For path-free processors: the target's choice (T,) after every node and the processed scores (T, V),
    on the device (nothing read)."""
    depths = [0] * len(logits)
    for (parent, _), child in children.items():
        depths[child] = depths[parent] + 1  # children come after their parents
    # processors may write into the scores they get: give them a copy, or nothing to copy when there are none
    return sampler.choose_rows(context, logits.clone() if sampler.logits_processor else logits, depths)


def verify_rows(logits: list, subtrees: list, contexts: list, samplers: list[Sampler], stopping_criteria: list,
                max_tokens: list[int]) -> list[Verified | None]:
    """verify_tree for every row of a batch (None where the row's subtree is None), the choices of all the
    path-free rows read in one host sync: a round's walks cost one read, not one a row.

    logits[b]: (T_b, V) row b's logits at its subtree's nodes; contexts[b]: (1, L_b) its committed sequence."""
    children = [None if s is None else children_of(s.parents, s.tokens) for s in subtrees]
    together = [b for b, s in enumerate(subtrees) if s is not None and samplers[b].path_free]
    chosen = {b: choose_nodes(logits[b], children[b], contexts[b], samplers[b]) for b in together}
    choices = torch.cat([chosen[b][0] for b in together]).tolist() if together else []
    out: list[Verified | None] = []
    start = 0
    for b, subtree in enumerate(subtrees):
        if subtree is None:
            out.append(None)
        elif b in chosen:
            walked = walk_path(choices[start : start + len(subtree)], children[b], max_tokens[b])
            start += len(subtree)
            out.append(walk_to_stop(walked, chosen[b][1], logits[b], contexts[b], stopping_criteria[b], max_tokens[b]))
        else:
            out.append(walk_nodes(logits[b], children[b], contexts[b], samplers[b], stopping_criteria[b], max_tokens[b]))
    return out


def walk_to_stop(out: Verified, scores: torch.Tensor, logits: torch.Tensor, context: torch.Tensor,
                 stopping_criteria: "StoppingCriteriaList | StopRule", max_tokens: int) -> Verified:
    """The one stop rule: a walk cut where generate() would stop (an EOS token, max_length, any other
    criterion called on each prefix), with each emitted token's scores and logits (T, V rows of the
    walked nodes) and whether the row is done.

    stopping_criteria: generate()'s criteria, or their StopRule (what every engine passes: split once per call)."""
    eos, max_length, others = (
        stopping_criteria if isinstance(stopping_criteria, StopRule) else split_criteria(stopping_criteria)
    )
    if others:
        new = torch.tensor([out.tokens], dtype=context.dtype, device=context.device)
        full = torch.cat([context, new], dim=-1)
    for j, node in enumerate(out.path):
        length = context.shape[1] + j + 1  # the sequence's length once token j is appended
        if out.tokens[j] in eos or length >= max_length or (
            others and bool(others(full[:, :length], scores[node : node + 1]).any())
        ):
            del out.path[j + 1 :], out.tokens[j + 1 :]
            out.finished = True
            break
    # (1, V) views of each emitted token's row, like the node-by-node walk's; BatchRows copies the ones it keeps
    # (only for generate's output_scores / output_logits), so a walk copies no vocabulary-wide row
    out.scores = [scores[node : node + 1] for node in out.path]
    out.logits = [logits[node : node + 1] for node in out.path]
    out.finished = out.finished or len(out.tokens) >= max_tokens
    return out


class StopRule(NamedTuple):
    """generate()'s stopping criteria as a walk applies them: EOS ids, the smallest max_length (the length
    counts the whole sequence, left padding included, as transformers counts it), and the criteria left to
    call (split_criteria makes one; once per call: reading the EOS ids is a host sync)."""

    eos: set[int]
    max_length: float
    others: StoppingCriteriaList

    def fires(self, sequence: torch.Tensor, token: int, scores: torch.Tensor) -> bool:
        """Whether generate() stops once `token` ends `sequence` (1, L) (its scores (1, V))."""
        return token in self.eos or sequence.shape[1] >= self.max_length or (
            len(self.others) > 0 and bool(self.others(sequence, scores).any())
        )


NO_STOPS = StopRule(set(), float("inf"), StoppingCriteriaList())  # a row that is done only decodes on


def split_criteria(stopping_criteria: StoppingCriteriaList) -> StopRule:
    """The StopRule of generate()'s criteria. Only criteria of exactly transformers' EosTokenCriteria /
    MaxLengthCriteria type become a set lookup / a length limit; anything else, subclasses included, is
    called."""
    eos: set[int] = set()
    max_length = float("inf")
    others = StoppingCriteriaList()
    for criterion in stopping_criteria:
        if type(criterion) is EosTokenCriteria:
            eos.update(criterion.eos_token_id.flatten().tolist())
        elif type(criterion) is MaxLengthCriteria:
            max_length = min(max_length, criterion.max_length)
        else:
            others.append(criterion)
    return StopRule(eos, max_length, others)


def walk_nodes(logits, children: dict, context, sampler: Sampler, stopping_criteria, max_tokens: int) -> Verified:
    """The walk node by node, each node's processors fed the exact path that leads to it (the stop rule
    as walk_to_stop's)."""
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
