"""The target's acceptance rules, written once for every round (the host round's walks, the asynchronous engine's,
the device round's): which token the target chooses after each node, how the walk follows the tree with those
choices, and where generate() stops.

    choices   greedy_choices (argmax of the processed scores), or sampled_choices: Gumbel-max with noise that is a
              pure function of (seed, row, position, token) (gumbel_noise), so the token at a position depends on its
              context and the seed only, never on the tree verified: exact draws from the target's distribution
    walk      walk_subtree: from the root, the target's choice after each node, into the child carrying it while there
              is one, for every row at once as fixed-shape tensor ops (no read), with the EOS and length rules
    stops     StopRule: EOS ids and max_length (inside the walk), and the criteria only the host can call (stop strings,
              max_time, custom ones), applied to the read walk's prefixes: cut_at_criteria

Processors that read the path (a repetition penalty) cannot choose every node at once: verify.walk_nodes walks those
node by node with the same StopRule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import StoppingCriteriaList

from swiftspec_kernels.tree_walk import tree_walk

from ..models.compat import EosTokenCriteria, MaxLengthCriteria
from .device_round import DeviceSubtree

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


def greedy_choices(scores: torch.Tensor) -> torch.Tensor:
    """The target's greedy choice (B, T) after every node, from processed scores (B, T, V)."""
    return scores.argmax(dim=-1)


def sampled_choices(scores: torch.Tensor, noise: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The target's sampled choice (B, T) after every node: verify.Sampler.choose_rows' rule, Gumbel-max with
    each row's noise for the node's position, `(scores.double() + noise[depth]).argmax()`.

    scores: (B, T, V) processed scores (the path-free processors applied; others need the host's walk)
    noise:  (B, D, V) float64 Gumbel noise of each row for positions context length + d, d < D
            (Sampler.gumbel of the row's sampler: it depends on the seed, the row and the position alone,
            so the host draws it before the round from what it already knows, with no read)
    depths: (B, T) long each node's depth (< D)
    """
    B, T, V = scores.shape
    per_node = noise.gather(1, depths[:, :, None].expand(B, T, V))  # (B, T, V)
    return (scores.double() + per_node).argmax(dim=-1)


@dataclass
class Walk:
    """Each row's accepted path (B rows, T nodes verified).

    path:     (B, T) long local indices of the walked nodes, root first; -1 past `count`
    tokens:   (B, T) long the emitted tokens (the target's choice after each walked node); -1 past `count`
    count:    (B,) long   tokens emitted (>= 1 when max_tokens >= 1); the last one is the next root
    finished: (B,) bool   an EOS was emitted or max_tokens reached
    """

    path: torch.Tensor
    tokens: torch.Tensor
    count: torch.Tensor
    finished: torch.Tensor


def walk_subtree(choices: torch.Tensor, subtree: DeviceSubtree, max_tokens: torch.Tensor,
                eos: torch.Tensor | None = None) -> Walk:
    """The walk and its EOS and length rules, for every row at once (every round's: the host round reads its result,
    the device round reads it with the rest of the round's): one fused operator (swiftspec_kernels.tree_walk: a
    Triton kernel on a GPU, its torch reference elsewhere), no read.

    choices:    (B, T) long the target's choice after each node (greedy_choices / sampled_choices)
    max_tokens: (B,) long tokens each row may still emit, max_length folded in (StopRule.budget)
    eos:        (E,) long EOS ids, or (B, E) each row's (-1: no id; a row that is done and decodes on has none),
                or None. Other stopping criteria (stop strings, max_time, custom ones) read
                the decoded text or the clock: the host applies them to the read result (cut_at_criteria).
    """
    B = choices.shape[0]
    if eos is None:
        eos = choices.new_empty(B, 0)
    elif eos.dim() == 1:
        eos = eos[None].expand(B, -1)
    return Walk(*tree_walk(choices, subtree.tokens, subtree.parents, subtree.valid, subtree.depths, subtree.mask,
                           max_tokens, eos))


def round_result(walk: Walk) -> torch.Tensor:
    """The round's one host read: (B, 2 + T) long, per row [count, finished, tokens...]."""
    return torch.cat([walk.count[:, None], walk.finished.long()[:, None], walk.tokens], dim=1)


class StopRule(NamedTuple):
    """generate()'s stopping criteria as a walk applies them: EOS ids, the smallest max_length (the length
    counts the whole sequence, left padding included, as transformers counts it), and the criteria left to
    call (split_criteria makes one; once per call: reading the EOS ids is a host sync)."""

    eos: set[int]
    max_length: float
    others: StoppingCriteriaList

    def budget(self, max_tokens: int, length: int) -> int:
        """The tokens a walk after a sequence of `length` may emit: max_tokens, cut where max_length is reached (the
        token that reaches it is emitted, as generate() emits it; at least one where any is left)."""
        if self.max_length == float("inf"):
            return max_tokens
        return min(max_tokens, max(int(self.max_length) - length, 1 if max_tokens else 0))

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


def cut_at_criteria(tokens: list[int], sequence: list[int] | torch.Tensor, rule: StopRule,
                    scores: list[torch.Tensor] | None = None) -> int | None:
    """Where the criteria only the host can call (rule.others: stop strings, max_time, custom ones) stop a walk that
    emitted `tokens` after `sequence` (host ints, or a (1, L) tensor): called on each prefix in turn, as generate()
    calls them after each token. Returns the tokens past the first prefix they fire at (0: at the last token), or None
    where none fired."""
    if not rule.others or not tokens:
        return None
    base = sequence if isinstance(sequence, torch.Tensor) else torch.tensor([sequence])
    full = torch.cat([base, torch.tensor([tokens], dtype=base.dtype, device=base.device)], dim=-1)
    L = base.shape[1]
    for j in range(len(tokens)):
        if bool(rule.others(full[:, : L + j + 1], scores[j] if scores else None).any()):
            return len(tokens) - j - 1
    return None
