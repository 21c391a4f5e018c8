"""Suffix proposals (drafters/suffix.py) in the device round (engine/device_sides.py, round="device").

The suffix index stays on the host: its proposals are host data (the prompt, the output so far, a corpus and earlier
calls' outputs, in Python dicts). Each round the host builds each row's proposal from its own copy of the sequence
(the round's one read brought the tokens), scores its nodes as the host round does (policy.suffix_probs: P(accepted)
from match length, frequency and depth; the node's score is its log, on the scale of the draft's cumulative
log-probs, which the host round's prior calibrates as exp(score)), pads it to S nodes and copies it to the device in
ONE host-to-device copy, read back never. On the device:

  merge_suffix   the draft's tree (N nodes) and the S suffix nodes as one tree of N + S: a suffix node that follows
                 a draft node is that node (it takes the higher score, tree.merge_suffix's rule), the others hang
                 below it as nodes of their own, placed right after the draft's (dead ones last), so
                 device_round.select_device ranks both kinds together and picks T;
  root_tree      draft-free mode's tree before the merge: each row's root alone (no draft model, no growth).

Every shape is fixed by (B rows, N, S, T), so both phases replay (steps/phase_graphs.py). A walk through suffix nodes commits tokens the
draft never ran: it catches up on them before its next growth (device_drafters.DraftModelOnDevice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..policy.goodput import GoodputPolicy
from ..policy.shapes import PLAIN, Shape, ShapeMenu
from ..steps.device_round import HASH_BITS, DeviceTree, host_path_hash, path_hashes, to_device
from .suffix import index_for

FIELDS = 5  # the copied tensor's rows per proposal: tokens, parents, depths, scores, hashes (then ancestor bits)


@dataclass
class SuffixNodes:
    """B rows' suffix proposals, S nodes each (parents before children), on the device.

    tokens:    (B, S) long    each node's token (padding: 0)
    parents:   (B, S) long    its parent among the S, -1 for a child of the root (and for padding)
    depths:    (B, S) long    distance from the root (1 for the root's children; padding: 0)
    scores:    (B, S) float32 log P(accepted) (policy.suffix_probs's, never above the parent's); -inf for padding
    hashes:    (B, S) long    its path's hash (device_round.host_path_hash, HASH_BITS of it)
    ancestors: (B, S, S) bool ancestors[b, i, k]: k is i or an ancestor of i among the S
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    hashes: torch.Tensor
    ancestors: torch.Tensor

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "SuffixNodes":
        """From the one copied tensor (B, FIELDS + S, S) float64 (SuffixProposals.propose's: the fields, then each
        node's ancestor bits as a row)."""
        return cls(packed[:, 0].long(), packed[:, 1].long(), packed[:, 2].long(), packed[:, 3].float(),
                   packed[:, 4].long(), packed[:, FIELDS:].transpose(1, 2) > 0)


def host_nodes(tokens: list[int], parents: list[int], scores: list[float], nodes: int) -> list[list[float]]:
    """One row's proposal as SuffixNodes.unpack reads it: FIELDS rows of `nodes` values, then `nodes` rows of ancestor
    bits (row k: whether k is an ancestor-or-self of each node), padded."""
    n, pad = len(tokens), nodes - len(tokens)
    depths, hashes, bits = [], [], []
    for i, (p, t) in enumerate(zip(parents, tokens)):
        depths.append(depths[p] + 1 if p >= 0 else 1)
        hashes.append(host_path_hash(hashes[p] if p >= 0 else 0, t))
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    rows = [tokens + [0] * pad, parents + [-1] * pad, depths + [0] * pad, scores + [float("-inf")] * pad,
            [h & HASH_BITS for h in hashes] + [-1] * pad]
    return rows + [[float(i < n and (bits[i] >> k) & 1) for i in range(nodes)] for k in range(nodes)]


def root_tree(roots: torch.Tensor) -> DeviceTree:
    """Each row's root alone (B, 1): draft-free mode's tree before the suffix nodes join it."""
    B = roots.shape[0]
    device = roots.device
    zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
    return DeviceTree(roots[:, None].clone(), torch.full((B, 1), -1, dtype=torch.long, device=device), zeros,
                      torch.zeros(B, 1, device=device), torch.ones(B, 1, 1, dtype=torch.bool, device=device),
                      torch.ones(B, dtype=torch.long, device=device), zeros)


def merge_suffix(tree: DeviceTree, suffix: SuffixNodes, depth: int | None = None) -> DeviceTree:
    """The draft's tree (B, N) and the suffix nodes (B, S) as one tree (B, N + S), tree.merge_suffix on the device.

    A suffix node whose path the draft grew (the same path hash) is that draft node, which keeps the higher of the
    two scores (both never rise along a path, so neither does the maximum, and every prefix of select_device's
    ranking stays a connected tree). The others become nodes N, N + 1, ... in their order (parents first), each
    below its parent (the draft's twin, or a node of its own), its ancestors those of the deepest of its ancestors
    the draft grew and its own; the ones merged away and the padding follow, dead (-inf, past the row's size). A
    fixed number of operations whatever S: no pass per node or depth. depth: unused (the hashes match any depth)."""
    B, N = tree.tokens.shape
    S = suffix.tokens.shape[1]
    hashes = tree.hashes if tree.hashes is not None else path_hashes(tree)
    live = suffix.scores > float("-inf")
    grown = tree.scores > float("-inf")  # (B, N)
    same = ((hashes & HASH_BITS)[:, None, :] == suffix.hashes[:, :, None]) & live[:, :, None] & grown[:, None, :]
    same[:, :, 0] = False  # the root is no suffix node's twin
    twin = torch.where(same.any(-1), same.long().argmax(-1), -1)  # (B, S) the draft node it is, -1: none
    twinned = twin >= 0
    own = live & ~twinned  # (B, S) nodes of their own
    count = own.sum(dim=1)  # (B,)
    place = torch.where(own, own.long().cumsum(1) - 1, count[:, None] + (~own).long().cumsum(1) - 1)  # a permutation
    at = suffix.parents.clamp(min=0)
    parents = torch.where(suffix.parents < 0, 0, torch.where(twinned.gather(1, at), twin.gather(1, at),
                                                              N + place.gather(1, at)))
    # each own node's draft ancestors: those of its deepest twinned ancestor (the root where none is)
    reach = suffix.ancestors & twinned[:, None, :]  # (B, S, S)
    deepest = (reach * suffix.depths[:, None, :]).argmax(-1)  # (B, S)
    attach = torch.where(reach.any(-1), twin.gather(1, deepest), 0)
    rows = torch.cat([tree.ancestors.gather(1, attach[:, :, None].expand(B, S, N)),
                      torch.zeros(B, S, S, dtype=torch.bool, device=twin.device).scatter_(
                          2, place[:, None, :].expand(B, S, S), suffix.ancestors & own[:, None, :])], dim=2)
    rows = rows & own[:, :, None]  # (B, S, N + S) merged-away and padding rows see nothing
    ancestors = torch.cat([torch.cat([tree.ancestors, tree.ancestors.new_zeros(B, N, S)], dim=2),
                           torch.zeros_like(rows).scatter_(1, place[:, :, None].expand_as(rows), rows)], dim=1)

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        return torch.full_like(values, fill).scatter_(1, place, torch.where(own, values, fill))

    draft_scores = torch.cat([tree.scores, tree.scores.new_full((B, 1), float("-inf"))], dim=1).scatter_reduce(
        1, torch.where(twinned, twin, N), suffix.scores, reduce="amax")[:, :N]
    return DeviceTree(
        tokens=torch.cat([tree.tokens, placed(suffix.tokens, 0)], dim=1),
        parents=torch.cat([tree.parents, placed(parents, -1)], dim=1),
        depths=torch.cat([tree.depths, placed(suffix.depths, 0)], dim=1),
        scores=torch.cat([draft_scores, placed(suffix.scores, float("-inf"))], dim=1),
        ancestors=ancestors,
        size=tree.size + count,
        hashes=torch.cat([hashes, placed(suffix.hashes, 0)], dim=1),
    )


def draft_free_menu(config) -> ShapeMenu:
    """Draft-free mode's shapes: no growth, the best tree_budget nodes (root included) of the suffix proposal
    verified; tree_budget not given, 8 (the device menu's largest) or the plain round, as their rounds price them."""
    return ShapeMenu((Shape(0, 0, config.tree_budget),) if config.tree_budget else (Shape(0, 0, 8), Shape(*PLAIN)))


@dataclass
class SuffixProposals:
    """Each round's suffix proposals of the device round's rows (each row's SuffixIndex is the host's, kept with the
    row: device_sides.RowOnHost.suffix), as one device tensor.

    nodes: S, the suffix nodes a row proposes a round (the menu's largest T less the root: a proposal may fill a tree)
    limit: the models' context (no node is placed past it), or None
    """

    ngram_size: int
    nodes: int
    limit: int | None
    device: torch.device
    policy: GoodputPolicy = field(default_factory=GoodputPolicy)  # its priors score the nodes, as a first call's do

    def index_for(self, request, tokens: list[int]):
        """A joining row's index over its prompt, the request's corpus and the model's earlier outputs."""
        return index_for(tokens, self.ngram_size, request.corpus, request.history)

    def propose(self, indices: list) -> torch.Tensor:
        """(B, FIELDS + S, S) float64 each cache row's proposal of at most S nodes (SuffixNodes.unpack's layout; a row
        whose index is None, a dead row, proposes nothing), scored by the log of the policy's prior P(accepted), in
        one pinned, non-blocking host-to-device copy."""
        rows = []
        for index in indices:
            tokens, parents, scores = [], [], []
            if index is not None:
                room = None if self.limit is None else max(self.limit - len(index.tokens), 0)
                tree = index.propose(self.nodes, room)
                probs, _ = self.policy.suffix_probs(tree)
                tokens, parents, scores = tree.tokens, tree.parents, [math.log(p) for p in probs]
            rows.append(host_nodes(tokens, parents, scores, self.nodes))
        return to_device(rows, self.device, torch.float64)
