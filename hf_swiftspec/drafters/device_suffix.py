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
from ..steps.device_round import DeviceTree, to_device
from .suffix import index_for

FIELDS = 4  # the copied tensor's rows per proposal: tokens, parents, depths, scores


@dataclass
class SuffixNodes:
    """B rows' suffix proposals, S nodes each (parents before children), on the device.

    tokens:  (B, S) long    each node's token (padding: 0)
    parents: (B, S) long    its parent among the S, -1 for a child of the root (and for padding)
    depths:  (B, S) long    distance from the root (1 for the root's children; padding: 0)
    scores:  (B, S) float32 log P(accepted) (policy.suffix_probs's, never above the parent's); -inf for padding
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "SuffixNodes":
        """From the one copied tensor (B, FIELDS, S) float64 (DeviceSuffix.propose's)."""
        return cls(packed[:, 0].long(), packed[:, 1].long(), packed[:, 2].long(), packed[:, 3].float())


def root_tree(roots: torch.Tensor) -> DeviceTree:
    """Each row's root alone (B, 1): draft-free mode's tree before the suffix nodes join it."""
    B = roots.shape[0]
    device = roots.device
    return DeviceTree(roots[:, None].clone(), torch.full((B, 1), -1, dtype=torch.long, device=device),
                      torch.zeros(B, 1, dtype=torch.long, device=device), torch.zeros(B, 1, device=device),
                      torch.ones(B, 1, 1, dtype=torch.bool, device=device), torch.ones(B, dtype=torch.long, device=device))


def draft_twins(tree: DeviceTree, suffix: SuffixNodes, depth: int) -> torch.Tensor:
    """(B, S) long the draft node each suffix node is (the same token below the same node), -1: none. Found depth
    by depth: a draft node is at most `depth` below the root, so `depth` passes of (B, S, N) compares."""
    B, N = tree.tokens.shape
    live = suffix.scores > float("-inf")
    twin = torch.full(suffix.tokens.shape, -1, dtype=torch.long, device=suffix.tokens.device)
    ids = torch.arange(N, device=twin.device)
    grown = tree.scores > float("-inf")  # (B, N)
    for _ in range(min(depth, suffix.tokens.shape[1])):
        parent = torch.where(suffix.parents < 0, 0, twin.gather(1, suffix.parents.clamp(min=0)))  # (B, S) -1: none
        same = ((tree.parents[:, None, :] == parent[:, :, None]) & (tree.tokens[:, None, :] == suffix.tokens[:, :, None])
                & grown[:, None, :] & (live & (parent >= 0))[:, :, None])  # (B, S, N): at most one per suffix node
        twin = torch.where(same, ids, -1).amax(dim=-1)
    return twin


def merge_suffix(tree: DeviceTree, suffix: SuffixNodes, depth: int) -> DeviceTree:
    """The draft's tree (B, N) and the suffix nodes (B, S) as one tree (B, N + S), tree.merge_suffix on the device.

    A suffix node whose path the draft grew is that draft node, which keeps the higher of the two scores (both
    never rise along a path, so neither does the maximum, and every prefix of select_device's ranking stays a
    connected tree). The others become nodes N, N + 1, ... in their order (parents first), their parents the draft's
    or their own; the ones merged away and the padding follow, dead (-inf, past the row's size). depth: the draft
    tree's deepest level (0: the root alone)."""
    B, N = tree.tokens.shape
    S = suffix.tokens.shape[1]
    device = tree.tokens.device
    twin = draft_twins(tree, suffix, depth)
    live = suffix.scores > float("-inf")
    own = live & (twin < 0)  # (B, S) nodes of their own
    count = own.sum(dim=1)  # (B,)
    place = torch.where(own, own.long().cumsum(1) - 1, count[:, None] + (~own).long().cumsum(1) - 1)  # a permutation
    at = suffix.parents.clamp(min=0)
    parent_twin = twin.gather(1, at)
    parents = torch.where(suffix.parents < 0, 0, torch.where(parent_twin >= 0, parent_twin, N + place.gather(1, at)))

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        return torch.full_like(values, fill).scatter_(1, place, torch.where(own, values, fill))

    draft_scores = torch.cat([tree.scores, tree.scores.new_full((B, 1), float("-inf"))], dim=1).scatter_reduce(
        1, torch.where(live & (twin >= 0), twin, N), suffix.scores, reduce="amax")[:, :N]
    new_parents = placed(parents, -1)  # (B, S) merged ids
    M = N + S
    ancestors = torch.zeros(B, M, M, dtype=torch.bool, device=device)
    ancestors[:, :N, :N] = tree.ancestors
    for i in range(S):  # parents first: node N + i's parent's row is complete when i comes
        parent = new_parents[:, i]
        row = ancestors.gather(1, parent.clamp(min=0)[:, None, None].expand(B, 1, M))[:, 0] & (parent >= 0)[:, None]
        row[:, N + i] = parent >= 0
        ancestors[:, N + i] = row
    return DeviceTree(
        tokens=torch.cat([tree.tokens, placed(suffix.tokens, 0)], dim=1),
        parents=torch.cat([tree.parents, new_parents], dim=1),
        depths=torch.cat([tree.depths, placed(suffix.depths, 0)], dim=1),
        scores=torch.cat([draft_scores, placed(suffix.scores, float("-inf"))], dim=1),
        ancestors=ancestors,
        size=tree.size + count,
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
        """(B, FIELDS, S) float64 each cache row's proposal of at most S nodes (SuffixNodes.unpack's layout; a row
        whose index is None, a dead row, proposes nothing), scored by the log of the policy's prior P(accepted), in
        one pinned, non-blocking host-to-device copy."""
        rows = []
        for index in indices:
            tokens, parents, depths, scores = [], [], [], []
            if index is not None:
                room = None if self.limit is None else max(self.limit - len(index.tokens), 0)
                tree = index.propose(self.nodes, room)
                probs, _ = self.policy.suffix_probs(tree)
                tokens, parents, scores = tree.tokens, tree.parents, [math.log(p) for p in probs]
                for p in tree.parents:
                    depths.append(depths[p] + 1 if p >= 0 else 1)
            pad = self.nodes - len(tokens)
            rows.append([tokens + [0] * pad, parents + [-1] * pad, depths + [0] * pad, scores + [float("-inf")] * pad])
        return to_device(rows, self.device, torch.float64)
