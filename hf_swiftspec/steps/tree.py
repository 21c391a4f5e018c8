"""The draft's token tree in fixed-capacity tensors, and the operations on it.

Node 0 is the root: the last verified token, whose KV no model holds yet. Every other node is
a draft proposal; its score is the sum of draft log-probs from the root, so scores never rise
along a path and the top-k nodes by score (ties broken towards lower index, and a parent always
has a lower index than its child) form a connected subtree containing the root.

A node is *expanded* once the draft has run on it: its draft KV then sits at `kv_slot` in the
draft cache's tree region and its children (the draft's top-k next tokens) are in the tree.

The host keeps a `TreeView` of the live nodes (host lists): the choices a round makes on the tree (the
leaves to expand, the subtree to verify, the re-root's facts and kept nodes) are made from it, never by
reading the device. Only an expansion's children (tokens and scores the draft chose on the device) are
new to the host: `read_views` reads every stale tree of a batch in one sync; a re-root or reset edits
the view on the host as it edits the tensors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    """Fixed-capacity token tree (N = capacity). Only the first `size` nodes are live.

    tokens:    (N,) long   token id of each node
    parents:   (N,) long   parent index, -1 for the root
    depths:    (N,) long   distance from the root
    scores:    (N,) float32 cumulative draft log-prob from the root
    expanded:  (N,) bool   whether the draft has run on the node
    kv_slot:   (N,) long   index of the node's draft KV in the tree region, -1 if none
    ancestors: (N, N) bool ancestors[i, j]: j is i or an ancestor of i
    slot_nodes:(N,) long   node held by each tree-region KV slot
    size:      live nodes (host int)
    num_slots: expanded nodes = used KV slots (host int)
    root_token: token of the root (host int)
    view:      the live nodes as host lists (TreeView), or None while the device holds nodes the host has
               not read (an expansion's children: read_views)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    expanded: torch.Tensor
    kv_slot: torch.Tensor
    ancestors: torch.Tensor
    slot_nodes: torch.Tensor
    size: int = 1
    num_slots: int = 0
    root_token: int = 0
    view: "TreeView | None" = None

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]


@dataclass
class TreeView:
    """A TokenTree's live nodes as host lists (one entry per node; the fields of TokenTree with its name).
    scores: float32 values, exactly (the host does float32 arithmetic on them as the device does: `f32`)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]
    expanded: list[bool]
    kv_slot: list[int]

    @staticmethod
    def root(token: int) -> "TreeView":
        return TreeView([token], [-1], [0], [0.0], [False], [-1])

    def below(self, root: int) -> list[bool]:
        """Whether each node is `root` or under it (parents precede children)."""
        inside = [False] * len(self.parents)
        inside[root] = True
        for i in range(root + 1, len(self.parents)):
            p = self.parents[i]
            inside[i] = p >= 0 and inside[p]
        return inside

    def best_first(self, scores: list[float] | None = None) -> list[int]:
        """Node indices by score, best first, ties towards the lower index (the device's stable sort)."""
        scores = self.scores if scores is None else scores
        return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def f32(x: float) -> float:
    """x rounded to float32: a difference of two float32 values computed in float64 and rounded once more
    is the float32 difference exactly (float64 has more than twice float32's precision), as the device has it."""
    return struct.unpack("f", struct.pack("f", x))[0]


def read_views(trees: list[TokenTree]) -> None:
    """Give every tree whose view is stale (after an expansion) its view: one host sync for them all."""
    stale = [t for t in trees if t.view is None]
    if not stale:
        return
    parts = [
        torch.cat([
            torch.stack([t.tokens[: t.size], t.parents[: t.size], t.depths[: t.size], t.expanded[: t.size].long(),
                         t.kv_slot[: t.size]]).double().flatten(),  # ids and slots are exact in float64
            t.scores[: t.size].double(),
        ])
        for t in stale
    ]
    values = torch.cat(parts).tolist()
    start = 0
    for t in stale:
        n = t.size
        ints = [int(v) for v in values[start : start + 5 * n]]
        t.view = TreeView(ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n], values[start + 5 * n : start + 6 * n],
                          [bool(e) for e in ints[3 * n : 4 * n]], ints[4 * n : 5 * n])
        start += 6 * n


@dataclass
class Subtree:
    """The nodes one target step verifies, in topological order (T nodes, local index 0 = root).

    node_ids: list[int]  indices of the nodes in the draft's tree
    tokens:   list[int]  token of each node
    parents:  list[int]  local index of each node's parent, -1 for the root
    """

    node_ids: list[int]
    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)


def new_tree(root_token: int, capacity: int, device: torch.device | str) -> TokenTree:
    """A tree holding only the root, with room for `capacity` nodes."""
    long = dict(dtype=torch.long, device=device)
    tree = TokenTree(
        tokens=torch.zeros(capacity, **long),
        parents=torch.full((capacity,), -1, **long),
        depths=torch.zeros(capacity, **long),
        scores=torch.full((capacity,), float("-inf"), dtype=torch.float32, device=device),
        expanded=torch.zeros(capacity, dtype=torch.bool, device=device),
        kv_slot=torch.full((capacity,), -1, **long),
        ancestors=torch.zeros(capacity, capacity, dtype=torch.bool, device=device),
        slot_nodes=torch.zeros(capacity, **long),
    )
    clear_tree(tree, root_token)
    return tree


def reset_tree(tree: TokenTree, root_token: int) -> None:
    """Empty the tree in place, leaving a single unexpanded root carrying `root_token`."""
    if tree.size == 1 and tree.num_slots == 0:  # a lone unexpanded root: nothing else was set since
        tree.tokens[0] = root_token
        tree.root_token = root_token
        if tree.view is not None:
            tree.view.tokens[0] = root_token
        else:
            tree.view = TreeView.root(root_token)
        return
    clear_tree(tree, root_token)


def clear_tree(tree: TokenTree, root_token: int) -> None:
    """reset_tree by rewriting every field."""
    tree.tokens[0] = root_token
    tree.parents[0] = -1
    tree.depths[0] = 0
    tree.scores.fill_(float("-inf"))
    tree.scores[0] = 0.0
    tree.expanded.zero_()
    tree.kv_slot.fill_(-1)
    tree.ancestors[: tree.size, : tree.size] = False  # only live nodes ever set a bit
    tree.ancestors[0, 0] = True
    tree.size, tree.num_slots, tree.root_token = 1, 0, root_token
    tree.view = TreeView.root(root_token)


def select_leaves(tree: TokenTree, width: int, within: int | None = None, below_depth: int | None = None,
                  fixed: bool = False) -> torch.Tensor:
    """Indices (w,) of the best unexpanded nodes, best first (ties towards the lower index), w <= width:
    the one leaf selection of every round.

    within: only consider the best `within` nodes of the tree. With within = tree_budget this
    picks exactly the leaves whose children could still enter the subtree the target will
    verify; none left means that subtree is final.
    below_depth: only leaves shallower than this (their children must still fit the context).
    fixed: return exactly `width` indices with no host sync (a capturable step: the schedule guarantees
        that many leaves); else as many as there are (from the host's view: no sync; one without it: how many).
    """
    view = tree.view
    if view is not None and not fixed:
        order = view.best_first()[:within]
        leaves = [n for n in order if not view.expanded[n] and (below_depth is None or view.depths[n] < below_depth)]
        return torch.tensor(leaves[:width], dtype=torch.long, device=tree.tokens.device)
    order = torch.sort(tree.scores[: tree.size], descending=True, stable=True).indices
    if within is not None:
        order = order[:within]
    eligible = ~tree.expanded[order]
    if below_depth is not None:
        eligible &= tree.depths[order] < below_depth
    if fixed:  # the eligible first, each group still best first (a stable sort of a few booleans)
        return order[torch.sort((~eligible).to(torch.uint8), stable=True).indices[:width]]
    return order[eligible][:width]


def room_for_expansion(tree: TokenTree, num_leaves: int, children_per_leaf: int) -> bool:
    """Whether expanding `num_leaves` leaves fits in the tree's capacity."""
    return tree.size + num_leaves * children_per_leaf <= tree.capacity


def expansion_inputs(tree: TokenTree, leaves: torch.Tensor, prefix_len: int):
    """Assign KV slots to `leaves` and build the draft forward's inputs.

    Returns input_ids (1, w), position_ids (1, w) and the tree-region mask (w, S) over the
    S = num_slots + w KV slots after this step: leaf q sees slot s iff the node in s is q or
    one of its ancestors.
    """
    w = leaves.shape[0]
    tree.view = None  # the children the expansion adds are the device's
    slots = torch.arange(tree.num_slots, tree.num_slots + w, device=leaves.device)
    tree.kv_slot[leaves] = slots
    tree.slot_nodes[slots] = leaves
    tree.expanded[leaves] = True
    tree.num_slots += w
    mask = tree.ancestors[leaves][:, tree.slot_nodes[: tree.num_slots]]  # (w, S)
    position_ids = (prefix_len + tree.depths[leaves]).unsqueeze(0)
    return tree.tokens[leaves].unsqueeze(0), position_ids, mask


def add_children(tree: TokenTree, leaves: torch.Tensor, child_logprobs: torch.Tensor, child_tokens: torch.Tensor) -> None:
    """Append k children under each of the w `leaves`.

    child_logprobs: (w, k) draft log-probs of the children given their leaf
    child_tokens:   (w, k) their token ids
    """
    w, k = child_tokens.shape
    if w != leaves.shape[0]:
        raise RuntimeError(f"add_children got children for {w} leaves but {leaves.shape[0]} leaves were expanded")
    start, end = tree.size, tree.size + w * k
    if end > tree.capacity:
        raise RuntimeError(f"token tree overflow: {end} nodes > capacity {tree.capacity}")
    tree.view = None  # the children's tokens and scores are the device's until read_views
    new = torch.arange(start, end, device=leaves.device)
    parents = leaves[:, None].expand(w, k).reshape(-1)
    tree.tokens[start:end] = child_tokens.reshape(-1)
    tree.parents[start:end] = parents
    tree.depths[start:end] = tree.depths[parents] + 1
    tree.scores[start:end] = (tree.scores[leaves].unsqueeze(1) + child_logprobs.float()).reshape(-1)
    tree.ancestors[start:end] = tree.ancestors[parents]
    tree.ancestors[new, new] = True
    tree.size = end


def graft_node(tree: TokenTree, parent: int, token: int) -> int:
    """Append one unexpanded node carrying `token` under `parent` (a token another drafter proposed there);
    returns its index. Its score is its weakest sibling's (the draft did not rank it among its top children,
    so its own log-prob is at most that), or the parent's without one, until a forward that ran the parent
    gives the real one."""
    node = tree.size
    if node >= tree.capacity:
        raise RuntimeError(f"token tree overflow: {node + 1} nodes > capacity {tree.capacity}")
    tree.view = None  # its score is the device's
    live = slice(0, node)
    siblings = torch.where(tree.parents[live] == parent, tree.scores[live], tree.scores[parent])
    tree.tokens[node] = token
    tree.parents[node] = parent
    tree.depths[node] = tree.depths[parent] + 1
    tree.scores[node] = siblings.min()
    tree.ancestors[node] = tree.ancestors[parent]
    tree.ancestors[node, node] = True
    tree.size = node + 1
    return node


def top_children(logits: torch.Tensor, width: int, vocab_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The children an expansion adds under each of its w leaves, from the draft's logits (w, V): the
    `width` likeliest tokens below `vocab_limit` (ids the target can embed), as (log-probs, token ids),
    (w, width) each: add_children's arguments. Every drafter of a model's tree grows it this way."""
    return torch.log_softmax(logits[:, :vocab_limit], dim=-1).topk(width, dim=-1)


def select_subtree(tree: TokenTree, budget: int, root: int = 0) -> tuple[Subtree, list[float]]:
    """The best `budget` nodes by score (a connected subtree containing the root), in index order,
    with their scores.

    root: the node to select below as if the tree were re-rooted there (scores relative to it), before
    reroot() moves it to index 0 (the asynchronous draft chooses the next subtree before it re-roots).
    From the host's view (no sync); without one, one host sync (two below another root): the target's
    verification walk needs tokens and parents on the host.
    """
    if tree.size == 1:
        return Subtree(node_ids=[0], tokens=[tree.root_token], parents=[-1]), [0.0]
    if tree.view is not None:
        return view_subtree(tree.view, budget, root)
    node_ids, parents_local = best_node_ids(tree, budget, root)
    scores = tree.scores[node_ids] - tree.scores[root] if root else tree.scores[node_ids]
    rows = torch.stack([node_ids, tree.tokens[node_ids], parents_local, scores.double()])
    ids, tokens, parents, scores = rows.tolist()
    return Subtree(node_ids=[int(i) for i in ids], tokens=[int(t) for t in tokens], parents=[int(p) for p in parents]), scores


def view_subtree(view: TreeView, budget: int, root: int = 0) -> tuple[Subtree, list[float]]:
    """select_subtree from the host's view: best_node_ids' choice, node for node."""
    scores = view.scores
    if root:
        inside = view.below(root)
        scores = [s if b else float("-inf") for s, b in zip(scores, inside)]
        budget = min(budget, sum(inside))
    node_ids = sorted(view.best_first(scores)[:budget])
    local = {node: i for i, node in enumerate(node_ids)}
    parents = [local.get(view.parents[n], -1) if view.parents[n] >= 0 else -1 for n in node_ids]
    base = view.scores[root]
    chosen = [f32(view.scores[n] - base) if root else view.scores[n] for n in node_ids]
    return Subtree(node_ids=node_ids, tokens=[view.tokens[n] for n in node_ids], parents=parents), chosen


def best_node_ids(tree: TokenTree, budget: int, root: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, no sync: the best `budget` nodes by score, in index order (T,) (topological:
    parents precede children), and each one's parent as an index into them (T,) (-1 for the root).
    Below another `root` (select_subtree), only the nodes under it: one sync, how many."""
    scores = tree.scores[: tree.size]
    if root:
        below = tree.ancestors[: tree.size, root]
        scores = torch.where(below, scores, float("-inf"))
        budget = min(budget, int(below.sum()))
    order = torch.sort(scores, descending=True, stable=True).indices
    node_ids = order[:budget].sort().values
    local = torch.full((tree.size,), -1, dtype=torch.long, device=node_ids.device)
    local[node_ids] = torch.arange(node_ids.shape[0], device=node_ids.device)
    parent_ids = tree.parents[node_ids]
    return node_ids, torch.where(parent_ids >= 0, local[parent_ids.clamp(min=0)], -1)


@dataclass
class SuffixTree:
    """A suffix proposal (drafters/suffix.py) hanging under the tree's root (N nodes, parents before children;
    root not included).

    tokens:      token of each node
    parents:     index of each node's parent in these lists, -1 for a child of the root
    counts:      how many of the merged occurrences continue with the path to the node
    occurrences: how many occurrences were merged (the root's count)
    match:       how many tokens the matched suffix spans (0: nothing matched, no nodes)
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    occurrences: int = 0
    match: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def parent_count(self, i: int) -> int:
        p = self.parents[i]
        return self.occurrences if p < 0 else self.counts[p]

    def frequency(self, i: int) -> float:
        """Share of the occurrences that continue with the path to node i."""
        return self.counts[i] / self.occurrences


@dataclass
class Proposal:
    """A subtree for the target with what the policy knew of each node (T nodes, root first).

    probs:  calibrated P(node accepted) the policy used
    scores: draft score of each node, None for a node only the suffix proposal holds
    suffix: calibration bucket of each node the suffix proposal holds (policy.suffix_bucket), -1 if none
    match:  how many tokens the suffix proposal's match spanned (0: none)
    offered: the whole suffix proposal of the round, verified or not, as (tokens, parents, buckets)
            lists (the policy checks it against the tokens the target goes on to emit)
    """

    subtree: Subtree
    probs: list[float]
    scores: list[float | None]
    suffix: list[int]
    match: int = 0
    offered: tuple[list[int], list[int], list[int]] = ([], [], [])

    @property
    def ranked_probs(self) -> list[float]:
        """The probabilities best first."""
        return sorted(self.probs, reverse=True)


def merge_suffix(draft: Subtree, scores: list[float], probs: list[float], tokens: list[int], parents: list[int],
                 suffix_probs: list[float], buckets: list[int], match: int = 0) -> Proposal:
    """The union of the draft's candidates and a suffix proposal hanging from the root.

    tokens / parents / suffix_probs / buckets: the suffix nodes, parents first (parent -1: the root).
    Where a suffix node follows a draft node it reuses it (and the node takes the higher of the two
    probabilities), so one verification serves both; elsewhere it becomes a new node (node id -1).
    Probabilities stay non-increasing along every path.
    """
    node_ids, merged_tokens, merged_parents = list(draft.node_ids), list(draft.tokens), list(draft.parents)
    probs, scores = list(probs), list(scores)
    suffix = [-1] * len(merged_tokens)
    children = {(p, t): i for i, (p, t) in enumerate(zip(merged_parents, merged_tokens)) if p >= 0}
    where: list[int] = []  # merged index of each suffix node
    for token, parent, p, bucket in zip(tokens, parents, suffix_probs, buckets):
        node = where[parent] if parent >= 0 else 0
        child = children.get((node, token))
        if child is None:
            child = children[(node, token)] = len(merged_tokens)
            node_ids.append(-1)
            merged_tokens.append(token)
            merged_parents.append(node)
            probs.append(0.0)
            scores.append(None)
            suffix.append(-1)
        probs[child] = min(max(probs[child], p), probs[node])
        suffix[child] = bucket
        where.append(child)
    return Proposal(
        Subtree(node_ids, merged_tokens, merged_parents), probs, scores, suffix, match if tokens else 0,
        (list(tokens), list(parents), list(buckets)),
    )


def ranked(proposal: Proposal) -> list[int]:
    """Node indices best first: by probability, ties towards the lower index (parents first),
    so every prefix of the ranking is a connected subtree containing the root."""
    return sorted(range(len(proposal.probs)), key=lambda i: (-proposal.probs[i], i))


def best_subtree(proposal: Proposal, order: list[int], budget: int) -> Proposal:
    """The proposal cut to its `budget` best nodes (`order` from `ranked`), in topological order."""
    keep = sorted(order[:budget])
    local = {old: new for new, old in enumerate(keep)}
    sub = proposal.subtree
    return Proposal(
        Subtree(
            node_ids=[sub.node_ids[i] for i in keep],
            tokens=[sub.tokens[i] for i in keep],
            parents=[local[sub.parents[i]] if sub.parents[i] >= 0 else -1 for i in keep],
        ),
        probs=[proposal.probs[i] for i in keep],
        scores=[proposal.scores[i] for i in keep],
        suffix=[proposal.suffix[i] for i in keep],
        match=proposal.match,
        offered=proposal.offered,
    )


def subtree_mask(parents: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask (T, T) bool and depths (T,) long of a subtree given local parents.

    Each node's ancestors are kept as the bits of one host int, so the mask is built in two
    tensor ops whatever T (Python ints have no width limit; the bits are unpacked in 62-bit words).
    """
    T = len(parents)
    if T == 1:  # a plain step
        return torch.ones(1, 1, dtype=torch.bool, device=device), torch.zeros(1, dtype=torch.long, device=device)
    bits, depths = [0] * T, [0] * T
    for i, p in enumerate(parents):
        bits[i] = (bits[p] if p >= 0 else 0) | (1 << i)
        depths[i] = depths[p] + 1 if p >= 0 else 0
    words = [[(b >> (62 * w)) & ((1 << 62) - 1) for w in range((T + 61) // 62)] for b in bits]
    shifts = torch.arange(62, device=device)
    packed = torch.tensor(words, dtype=torch.long, device=device)  # (T, W)
    mask = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(T, -1)[:, :T]
    return mask, torch.tensor(depths, device=device)


def locate_child(tree: TokenTree, node: int, token: int) -> int | None:
    """Index of `node`'s child carrying `token`, or None; one host sync (a re-root reads the whole path at
    once instead: path_facts)."""
    hit = (tree.parents[: tree.size] == node) & (tree.tokens[: tree.size] == token)
    child = int(torch.where(hit.any(), hit.int().argmax(), -1))
    return child if child >= 0 else None


@dataclass
class PathFacts:
    """What re-rooting along an accepted path needs of the tree (path_facts: from the host's view, else one sync).

    ran:   how many of the path's first nodes the draft has run (their KV is in the tree region)
    slots: those nodes' KV slots (ran,)
    child: the last node's child carrying the next token (None: none, or the path left the tree or its run part)
    child_ran: whether that child has run
    """

    ran: int
    slots: list[int]
    child: int | None
    child_ran: bool


def path_facts(tree: TokenTree, path: list[int], token: int) -> PathFacts:
    """PathFacts of `path` (node ids, root first; -1 for a node the tree does not hold, which ends its
    run part) and `token`, the target's next one. One host sync: the tree's nodes read at once (a few
    hundred ints), then looked up on the host instead of a dozen small device ops; none from the host's view."""
    if tree.view is not None:
        view = tree.view
        parents, tokens, expanded, slots = view.parents, view.tokens, view.expanded, view.kv_slot
    else:
        parents, tokens, expanded, slots = torch.stack(
            [tree.parents[: tree.size], tree.tokens[: tree.size], tree.expanded[: tree.size].long(),
             tree.kv_slot[: tree.size]]
        ).tolist()
    ran = next((j for j, node in enumerate(path) if node < 0 or not expanded[node]), len(path))
    child = None
    if ran == len(path):
        last = path[-1]
        child = next((i for i in range(last + 1, len(parents)) if parents[i] == last and tokens[i] == token), None)
    return PathFacts(ran, [slots[node] for node in path[:ran]], child, child is not None and bool(expanded[child]))


def kept_nodes(tree: TokenTree, new_root: int) -> torch.Tensor:
    """The nodes (n,) reroot(tree, new_root) keeps, increasing, the new root first: node kept[i] becomes i
    (from the host's view: no sync)."""
    if tree.view is not None:
        return torch.tensor(kept_ids(tree.view, new_root), dtype=torch.long, device=tree.tokens.device)
    return tree.ancestors[: tree.size, new_root].nonzero().flatten()


def kept_ids(view: TreeView, new_root: int) -> list[int]:
    """kept_nodes on the host: `new_root` and the nodes under it, increasing."""
    return [i for i, inside in enumerate(view.below(new_root)) if inside]


def reroot(tree: TokenTree, new_root: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Keep only the subtree under `new_root` (which must be a live node), in place (`keep`: kept_nodes'
    answer, if the caller has it).

    Returns the old KV slots (K,) of the surviving expanded nodes, in their new slot order, so the
    draft cache can move their KV behind the new prefix in the same gather as the verified path: host ints
    where the host has the tree's view (which it re-roots alike: nothing read), else a tensor.
    """
    view = tree.view
    keep = kept_nodes(tree, new_root) if keep is None else keep  # (n,) increasing, root first
    n = keep.shape[0]
    remap = torch.full((tree.size,), -1, dtype=torch.long, device=keep.device)
    remap[keep] = torch.arange(n, device=keep.device)
    old_slots = tree.kv_slot[keep]
    if view is not None:
        kept_host = kept_ids(view, new_root)
        slots_host = sorted(view.kv_slot[i] for i in kept_host if view.kv_slot[i] >= 0)
        kept_slots = torch.tensor(slots_host, dtype=torch.long, device=keep.device)  # (K,)
    else:
        kept_slots = old_slots[old_slots >= 0].sort().values  # (K,)
    slot_remap = torch.full((max(tree.num_slots, 1),), -1, dtype=torch.long, device=keep.device)
    slot_remap[kept_slots] = torch.arange(kept_slots.shape[0], device=keep.device)

    parents = tree.parents[keep]
    tree.parents[:n] = torch.where(parents >= 0, remap[parents.clamp(min=0)], -1)
    tree.parents[0] = -1
    tree.tokens[:n] = tree.tokens[keep]
    tree.depths[:n] = tree.depths[keep] - tree.depths[new_root]
    tree.scores[:n] = tree.scores[keep] - tree.scores[new_root]
    tree.scores[n:] = float("-inf")
    tree.expanded[:n] = tree.expanded[keep]
    tree.expanded[n:] = False
    tree.kv_slot[:n] = torch.where(old_slots >= 0, slot_remap[old_slots.clamp(min=0)], -1)
    tree.kv_slot[n:] = -1
    tree.ancestors[:n, :n] = tree.ancestors[keep][:, keep]
    tree.ancestors[n:] = False
    tree.ancestors[:, n:] = False
    num_kept = kept_slots.shape[0]
    tree.slot_nodes[:num_kept] = remap[tree.slot_nodes[kept_slots]]
    tree.size, tree.num_slots = n, num_kept
    if view is None:
        return kept_slots
    tree.view = rerooted_view(view, new_root, kept_host, slots_host)
    return slots_host


def rerooted_view(view: TreeView, new_root: int, kept: list[int], kept_slots: list[int]) -> TreeView:
    """The view of the tree reroot() leaves: nodes `kept` (increasing, new_root first) renumbered in order,
    the expanded ones' KV slots `kept_slots` (old slot numbers) renumbered in theirs; values as the device
    computes them (scores in float32)."""
    node = {old: new for new, old in enumerate(kept)}
    slot = {old: new for new, old in enumerate(kept_slots)}
    depth, score = view.depths[new_root], view.scores[new_root]
    return TreeView(
        tokens=[view.tokens[i] for i in kept],
        parents=[-1] + [node[view.parents[i]] for i in kept[1:]],
        depths=[view.depths[i] - depth for i in kept],
        scores=[f32(view.scores[i] - score) for i in kept],
        expanded=[view.expanded[i] for i in kept],
        kv_slot=[slot[view.kv_slot[i]] if view.kv_slot[i] >= 0 else -1 for i in kept],
    )
