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
from dataclasses import dataclass

import torch

from swiftspec_kernels.tree_merge import HASH_BITS, tree_merge

from ..steps.device_round import DeviceSubtree, DeviceTree, host_path_hash, path_hashes, to_device
from ..steps.tree import SuffixTree
from .suffix import index_for


def host_nodes(tokens: list[int], parents: list[int], scores: list[float], nodes: int) -> list[list[float]]:
    """One row's proposal as tree_merge reads it (swiftspec_kernels/tree_merge.py's layout): its FIELDS (5) rows
    of `nodes` values (tokens, parents among the nodes with -1 for the root's children, depths, scores, hashes),
    then `nodes` rows of ancestor bits (row k: whether k is an ancestor-or-self of each node), padded."""
    n, pad = len(tokens), nodes - len(tokens)
    depths, hashes, bits = [], [], []
    for i, (p, t) in enumerate(zip(parents, tokens)):
        depths.append(depths[p] + 1 if p >= 0 else 1)
        hashes.append(host_path_hash(hashes[p] if p >= 0 else 0, t))
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    rows = [tokens + [0] * pad, parents + [-1] * pad, depths + [0] * pad, scores + [float("-inf")] * pad,
            [h & HASH_BITS for h in hashes] + [-1] * pad]
    return rows + [[float(i < n and (bits[i] >> k) & 1) for i in range(nodes)] for k in range(nodes)]


def chosen_nodes(tokens: list[int], parents: list[int], probs: list[float], budget: int) -> list[list[float]]:
    """One row's verified subtree chosen on the host from its proposal alone (a round that grows nothing): the root and
    its best budget - 1 nodes by P(accepted), ties to the lower index (select_device's rule over the merged tree, where
    they are these nodes: the probabilities never rise along a path, so the best ones form a subtree), in index order,
    as CHOSEN_FIELDS (6) rows of `budget` values (node ids, tokens, local parents, depths, scores, valid; the root's
    token 0: the device's root goes there) and `budget` rows of its ancestor-or-self mask, padded as select_device pads
    (padding: parent -1, depth 0, a score of -inf, itself alone in the mask)."""
    keep = sorted(sorted(range(len(tokens)), key=lambda k: (-probs[k], k))[: budget - 1])
    local = {k: i + 1 for i, k in enumerate(keep)}
    ids, toks, pars, depths, scores, bits = [0], [0], [-1], [0], [0.0], [1]
    for k in keep:
        parent = local[parents[k]] if parents[k] >= 0 else 0
        ids.append(1 + k)
        toks.append(tokens[k])
        pars.append(parent)
        depths.append(depths[parent] + 1)
        scores.append(math.log(probs[k]))
        bits.append(bits[parent] | (1 << len(bits)))
    n, pad = len(ids), budget - len(ids)
    rows = [ids + list(range(n, budget)), toks + [0] * pad, pars + [-1] * pad, depths + [0] * pad,
            scores + [float("-inf")] * pad, [1.0] * n + [0.0] * pad]
    return rows + [[float((bits[i] >> j) & 1) if i < n else float(i == j) for j in range(budget)]
                   for i in range(budget)]


CHOSEN_FIELDS = 6  # chosen_nodes' rows per node before its mask: node ids, tokens, parents, depths, scores, valid


def chosen_subtree(packed: torch.Tensor, roots: torch.Tensor) -> DeviceSubtree:
    """The subtrees the host chose (packed (B, CHOSEN_FIELDS + T, T) float64, chosen_nodes' rows) as select_device's
    DeviceSubtree, each row's root token its device root (roots (B,) long)."""
    tokens = packed[:, 1].long()
    tokens[:, 0] = roots
    return DeviceSubtree(packed[:, 0].long(), tokens, packed[:, 2].long(), packed[:, 4].float(), packed[:, 5] > 0,
                         packed[:, 3].long(), packed[:, CHOSEN_FIELDS:] > 0)


def root_tree(roots: torch.Tensor) -> DeviceTree:
    """Each row's root alone (B, 1): draft-free mode's tree before the suffix nodes join it."""
    B = roots.shape[0]
    device = roots.device
    zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
    return DeviceTree(roots[:, None].clone(), torch.full((B, 1), -1, dtype=torch.long, device=device), zeros,
                      torch.zeros(B, 1, device=device), torch.ones(B, 1, 1, dtype=torch.bool, device=device),
                      torch.ones(B, dtype=torch.long, device=device), zeros)


def merge_suffix(tree: DeviceTree, packed: torch.Tensor) -> DeviceTree:
    """The draft's tree (B, N) and the suffix nodes (packed: (B, 5 + S, S) float64, SuffixProposals.propose's
    one copied tensor) as one tree (B, N + S), tree.merge_suffix on the device, in ONE fused operator
    (swiftspec_kernels.tree_merge: a Triton kernel on a GPU, its torch reference elsewhere).

    A suffix node whose path the draft grew (the same path hash) is that draft node, which keeps the higher of the
    two scores (both never rise along a path, so neither does the maximum, and every prefix of select_device's
    ranking stays a connected tree). The others become nodes N, N + 1, ... in their order (parents first), each
    below its parent (the draft's twin, or a node of its own), its ancestors those of the deepest of its ancestors
    the draft grew and its own; the ones merged away and the padding follow, dead (-inf, past the row's size). One
    operator whatever S (the reference: a fixed number, no pass per node or depth). Every round's tree carries its
    hashes (growth, root_tree); one built without them (tests) gets path_hashes' first, N passes."""
    hashes = tree.hashes if tree.hashes is not None else path_hashes(tree)
    return DeviceTree(*tree_merge(tree.tokens, tree.parents, tree.depths, tree.scores, tree.ancestors, tree.size,
                                  hashes, packed))


@dataclass
class SuffixProposals:
    """Each round's suffix proposals of the device round's rows (each row's SuffixIndex is the host's, kept with the
    row: device_sides.RowOnHost.suffix), as one device tensor; with a host drafter's nodes merged in where the draft
    proposes from the host (drafters/device_host.py: the same tensor, the round's one copy).

    ngram_size: the suffix index's (0: no index, the tensor carries a host drafter's offers alone)
    nodes: S, the nodes a row offers a round (the policy's largest T less the root: a proposal may fill a tree)
    limit: the models' context (no node is placed past it), or None
    branching: False proposes the most frequent path alone (a chain call's: engine/device_chains.py)
    """

    ngram_size: int
    nodes: int
    limit: int | None
    device: torch.device
    branching: bool = True  # False: the proposal is one path (a chain call's, engine/device_chains.py)

    def index_for(self, request, tokens: list[int]):
        """A joining row's index over its prompt, the request's corpus and the model's earlier outputs (None: no
        suffix proposals, ngram_size 0)."""
        if not self.ngram_size:
            return None
        return index_for(tokens, self.ngram_size, request.corpus, request.history, self.branching)

    def propose(self, index) -> SuffixTree:
        """A row's proposal of at most S nodes from its index (on the host), none placed past the models' context."""
        room = None if self.limit is None else max(self.limit - len(index.tokens), 0)
        return index.propose(self.nodes, room)

    def pack_chosen(self, offers: list, budget: int) -> torch.Tensor:
        """(B, CHOSEN_FIELDS + T, T) float64 every cache row's subtree of T = budget nodes chosen from its offer alone
        (chosen_nodes; None: the root alone, a dead row too), in one pinned, non-blocking host-to-device copy: a round
        that grows nothing needs neither the merge nor the selection on the device."""
        rows = [chosen_nodes(o.tree.tokens, o.tree.parents, o.probs, budget) if o is not None
                else chosen_nodes([], [], [], budget) for o in offers]
        return to_device(rows, self.device, torch.float64)

    def pack(self, offers: list) -> torch.Tensor:
        """(B, 5 + S, S) float64 every cache row's offer (policy/sizing.Offer: its suffix proposal, a host drafter's
        merged in where there is one; None: nothing, a dead row too) in
        host_nodes' layout, each node scored by the log of its calibrated P(accepted), in one pinned, non-blocking
        host-to-device copy."""
        rows = [host_nodes(o.tree.tokens, o.tree.parents, [math.log(p) for p in o.probs], self.nodes) if o is not None
                else host_nodes([], [], [], self.nodes) for o in offers]
        return to_device(rows, self.device, torch.float64)
