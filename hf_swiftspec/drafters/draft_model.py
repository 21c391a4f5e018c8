"""A draft model's drafter: its token tree per row, grown best-first one forward at a time and re-rooted
on the target's verdict with its KV kept (one of the drafters of drafters/drafting.py).

DraftModelDrafter owns the draft model, its TreeCache and one TokenTree per batch row. Its cache holds,
per row, the committed tokens the target's cache holds (engine/workers.py), every verified token except
the current root, which is tree node 0 on both sides (the draft's cache may lag behind by its `pending`
tokens). Recurrent and hybrid draft models keep a `StateLog` (steps/recurrent.py) that puts their states
back on the accepted path after every commit.

A draft whose context is shorter than the target's (`window`) reads the last `window` tokens of a prompt
that does not fit, and when a row's text fills its context it forgets the row's KV and reads the last
`window` tokens again (one catch-up), so it drafts the whole generation at positions of its own; a
recurrent draft, whose states cannot be cut, stops drafting the row there instead (plain rounds past it).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..models.architectures import Architecture
from ..policy.goodput import GoodputPolicy
from ..stats import DraftCounters
from ..steps.capture import StepRunner
from ..steps.probes import describe
from ..steps.recurrent import StateLog, new_cache
from ..steps.step import RowQueries, run_step
from ..steps.tree import (
    Proposal,
    Subtree,
    TokenTree,
    add_children,
    expansion_inputs,
    graft_node,
    kept_nodes,
    locate_child,
    new_tree,
    path_facts,
    read_views,
    reroot,
    reset_tree,
    room_for_expansion,
    select_leaves,
    select_subtree,
    top_children,
)
from ..steps.verify import Verified


class DraftModelDrafter:
    """A draft model's token tree per row, grown best-first and re-rooted on verified tokens, its KV kept.

    pending[b]: committed tokens of row b whose draft KV is not computed yet (the prompt at the
    start, tokens of rounds that did not expand, the last accepted node when it was an unexpanded
    leaf). A row with pending tokens has a fresh tree; its next expansion runs them and the root as
    one causal chain; `catch_up` runs them alone, so that an expansion's time is an expansion's.
    """

    grows = True  # its tree grows within a round (drafting.py)
    reads_features = False  # whether it drafts from the target's hidden states (heads.py)

    def __init__(
        self, model: PreTrainedModel, capacity: int, tree_capacity: int, width: int, vocab_limit: int,
        attention: str = "sdpa", architecture: Architecture | None = None, max_positions: int | None = None,
        batch_size: int = 1, runner: StepRunner | None = None, window: int | None = None,
    ):
        self.model = model
        # the draft's own positions: no node is ever placed past them (both models' context where they are the
        # target's too; the draft's own where it reads a window of the text)
        self.max_positions = max_positions
        self.window = window  # tokens a row keeps when the text fills the draft's context (None: it never does)
        self.attention = attention
        self.architecture = architecture or describe(model, "draft")
        self.device = model.device
        self.runner = runner  # replayed forwards (capture.py), or None: every step eager
        self.cache = new_cache(self.architecture, capacity, batch_size, runner and runner.pool)
        self.states = StateLog(self.cache)  # recurrent states: saved after every forward (recurrent.py)
        self.attention_fallbacks: set[str] = set()  # why kernel-routed layers ran their own attention
        self.width = width
        self.vocab_limit = vocab_limit  # the draft never proposes ids the target cannot embed
        self.trees: list[TokenTree] = [new_tree(0, tree_capacity, self.device) for _ in range(batch_size)]
        self.pending: list[list[int]] = [[] for _ in range(batch_size)]
        self.committed: list[list[int]] = [[] for _ in range(batch_size)]  # every committed token, the root's too
        self.grafted: list[list[int] | None] = [None] * batch_size  # per row, the sent subtree's nodes in its tree (graft)
        self.new_roots: list[int] = [0] * batch_size  # per row, the node its deferred re-root keeps (accept, settle)
        self.unsettled: tuple | None = None  # what accept(defer=True) left to settle()
        self.stopped: list[bool] = [False] * batch_size  # rows a recurrent draft's context ran out on
        self.counters = DraftCounters()

    @property
    def tree(self) -> TokenTree:
        """Row 0's tree (the only row of a single sequence)."""
        return self.trees[0]

    @property
    def fresh(self) -> bool:
        """Whether row 0's tree holds the root alone."""
        return self.tree.size == 1

    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Begin a generation: per row, the prompt (token ids, no padding) minus its last token is
        pending, the last is the root. (features: the target's states, for drafters that read them.)"""
        for b, ids in enumerate(prompts):
            if self.window is not None and len(ids) > self.max_positions - slide_margin(self.max_positions):
                ids = ids[-self.window :]  # the last part of the prompt that fits the draft's context
            self.pending[b] = ids[:-1]
            self.committed[b] = list(ids)
            self.grafted[b] = None
            self.stopped[b] = False
            reset_tree(self.trees[b], ids[-1])

    @property
    def catch_up_tokens(self) -> int:
        """Tokens the draft runs before its next expansion: every row's pending ones, once some row holds
        more than the one its root expansion takes along."""
        return sum(len(p) for p in self.pending) if any(len(p) > 1 for p in self.pending) else 0

    def expand(self, within: int | None = None, rows: list[bool] | None = None) -> int:
        """One draft forward over the best `width` unexpanded leaves of every row's tree (among its best
        `within` nodes if given; only the rows `rows` marks, if given); returns how many leaves were
        expanded over all rows (0: none left, or the trees are full)."""
        queries, leaves_of, pending_of = [], [], []
        read_views(self.trees)  # the last expansion's children, if no proposal read them since: one read
        for b, tree in enumerate(self.trees):
            leaves = select_leaves(tree, self.width, within, self.depth_room(b))
            if (rows is not None and not rows[b]) or not leaves.shape[0] or not room_for_expansion(
                tree, leaves.shape[0], self.width
            ):
                queries.append(RowQueries.none(self.device))
                leaves_of.append(None)
                pending_of.append(0)
                continue
            queries.append(self.expansion_queries(b, leaves))
            leaves_of.append(leaves)
            pending_of.append(len(self.pending[b]))
        if not any(leaves is not None for leaves in leaves_of):
            return 0
        logits = self.run(queries)
        self.states.save(self.cache.length)
        self.counters.forwards += 1
        self.counters.expansions += 1
        expanded = 0
        for b, leaves in enumerate(leaves_of):
            if leaves is None:
                continue
            self.ran_leaves(b, leaves, pending_of[b])
            if pending_of[b]:  # the chain before the root is committed now
                self.cache.prefix_lens[b] += pending_of[b]
                self.pending[b] = []
            add_children(self.trees[b], leaves, *self.children(logits[b][pending_of[b] :]))
            expanded += leaves.shape[0]
        return expanded

    def graft(self, b: int, subtree: Subtree) -> int:
        """Make every node of row b's subtree, just sent for verification, a node of its tree, and run those
        the draft has not run in one forward (asynchronous engines, while the target verifies): whichever
        path the target accepts then ends at an expanded node, and the re-root finds the new root among
        its children unless the draft did not rank the target's token among its top `width`. Nodes only
        another drafter proposed (node id -1: a suffix proposal) join the tree here, their scores from the
        forward that ran their parents. Returns the forwards run (0 or 1: nothing to run, no room, a row
        whose root has not run yet, or a recurrent draft)."""
        tree = self.trees[b]
        if self.pending[b] or self.states.active or not bool(tree.expanded[0]):
            return 0
        ids, added = list(subtree.node_ids), []
        for i in range(1, len(ids)):
            parent = ids[subtree.parents[i]]
            if ids[i] >= 0 or parent < 0 or tree.size >= tree.capacity:
                continue  # a tree node already; or below a node that found no room, or none left: stays -1
            # the token may sit under a draft node the subtree left out; a grafted parent has no children yet
            child = None if parent in added else locate_child(tree, parent, subtree.tokens[i])
            if child is None:
                child = graft_node(tree, parent, subtree.tokens[i])
                added.append(child)
            ids[i] = child
        self.grafted[b] = ids
        nodes = torch.tensor([n for n in ids if n >= 0], dtype=torch.long, device=self.device)
        ran, depths = torch.stack([tree.expanded[nodes].long(), tree.depths[nodes]]).tolist()
        room = self.depth_room(b)
        run = [n for n, done, d in zip(nodes.tolist(), ran, depths) if not done and (room is None or d < room)]
        if not run or not room_for_expansion(tree, len(run), self.width):
            return 0
        leaves = torch.tensor(run, dtype=torch.long, device=self.device)
        queries = [RowQueries.none(self.device) for _ in self.trees]
        queries[b] = self.expansion_queries(b, leaves)
        logits = self.run(queries)[b]
        self.counters.forwards += 1
        self.counters.expansions += 1
        self.ran_leaves(b, leaves, 0)
        logprobs = torch.log_softmax(logits[:, : self.vocab_limit].float(), dim=-1)
        row_of = {n: j for j, n in enumerate(run)}
        for node in added:  # parents first: a grafted chain's scores add up
            parent, token = int(tree.parents[node]), int(tree.tokens[node])
            if parent in row_of:
                tree.scores[node] = tree.scores[parent] + logprobs[row_of[parent], token]
                logprobs[row_of[parent], token] = float("-inf")  # the draft's own children leave this token out
        add_children(tree, leaves, *logprobs.topk(self.width, dim=-1))
        return 1

    def run(self, queries: list[RowQueries], logits: bool = True) -> list[torch.Tensor]:
        """One draft forward over every row's queries: each row's logits (n_b, V) (none if not `logits`)."""
        return run_step(self.model, self.cache, queries, self.attention, self.architecture, self.attention_fallbacks,
                        logits=logits, runner=self.runner)

    def children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `width` best children of each expanded leaf from its logits (w, V): (log-probs, token ids), (w, width) each."""
        return top_children(logits, self.width, self.vocab_limit)

    def ran_leaves(self, b: int, leaves: torch.Tensor, after: int) -> None:
        """Row b's `leaves` ran in the last forward, after `after` pending tokens (a hook for drafters that
        keep something per node)."""

    def chain_queries(self, b: int) -> RowQueries:
        """Row b's pending tokens as one causal chain after its prefix."""
        return RowQueries.chain(self.pending[b], self.cache.prefix_lens[b], self.device)

    def expansion_queries(self, b: int, leaves: torch.Tensor) -> RowQueries:
        """Row b's queries for expanding `leaves`: its pending tokens and the root as one chain when
        its tree is fresh, else the leaves under the tree mask."""
        tree, prefix = self.trees[b], self.cache.prefix_lens[b]
        if self.pending[b]:
            expansion_inputs(tree, leaves, prefix + len(self.pending[b]))  # the root takes tree slot 0
            return RowQueries.chain(self.pending[b] + [tree.root_token], prefix, self.device)
        input_ids, positions, mask = expansion_inputs(tree, leaves, prefix)
        slot_positions = prefix + tree.depths[tree.slot_nodes[: tree.num_slots]] if self.architecture.windowed else None
        return RowQueries(input_ids[0], positions[0], mask, slot_positions)

    def depth_room(self, b: int = 0) -> int | None:
        """How deep below row b's root a node may sit before its position passes the models' context
        (None: no limit). Learned position embeddings have no row past it: the tree stops short of
        it, as target.generate's own last step does."""
        if self.stopped[b]:
            return 0
        return depth_room(self.max_positions, len(self.committed[b]) - 1)

    def catch_up(self) -> None:
        """Run every row's committed tokens the draft has not seen yet (the prompt, tokens verified in
        plain rounds) into its prefix, as one causal chain per row, so that the next expansion is an
        ordinary one."""
        if not any(self.pending):
            return
        cache = self.cache
        rows = [self.chain_queries(b) if pending else RowQueries.none(self.device) for b, pending in enumerate(self.pending)]
        self.run(rows, logits=False)
        self.states.save(cache.length)
        for b, pending in enumerate(self.pending):
            cache.prefix_lens[b] += len(pending)
        self.pending = [[] for _ in self.pending]
        self.counters.forwards += 1

    def propose(self, b: int, max_nodes: int, max_depth: int | None, policy: GoodputPolicy) -> Proposal:
        """Row b's best `max_nodes` nodes (a connected subtree with the root), with their draft scores and the
        policy's calibrated P(accepted) of each, none deeper than max_depth (the target's room: the draft's own,
        `depth_room`, bounds the tree already, and is the target's unless the draft reads a window). The first row
        asked after an expansion reads every row's new children (one host sync for the batch); the others, and
        rounds with no expansion, read nothing."""
        read_views(self.trees)
        subtree, scores = select_subtree(self.trees[b], max_nodes, self.new_roots[b])
        if self.window is not None and max_depth is not None:
            subtree, scores = within_depth(subtree, scores, max_depth)
        return Proposal(subtree, policy.draft_probs(scores), scores, [-1] * len(scores), 0, ([], [], []))

    def top_up(self, budget: int) -> int:
        """Expand until every row's tree holds at least `budget` nodes (or cannot grow). Returns the
        expansions run."""
        done = 0
        while min(tree.size for tree in self.trees) < budget and self.expand(rows=[t.size < budget for t in self.trees]):
            done += 1
        return done

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None], defer: bool = False) -> int:
        """Per row, follow the verified tokens, commit their KV, keep the subtree under the new root
        (rows with None are left as they are). Returns how many rows' new roots were already in
        their trees.

        A row's accepted path starts with the nodes the draft has run on (its KV is committed) and may
        end with nodes it has not: draft leaves, or nodes another drafter proposed (node id -1).
        Their tokens become pending.

        defer: where every row's new root is in its tree and has run (a fresh tree needs an expansion first,
            which needs the commit), leave the re-roots and the commit to settle():
            the next subtree is chosen below the new roots where they stand (`new_roots`) and sent first
            (the asynchronous draft's critical path). Nothing else may touch the trees or the cache before.
        """
        paths: list[list[int] | torch.Tensor | None] = []
        roots: list[int | None] = []
        hits = 0
        for b, (subtree, outcome) in enumerate(zip(subtrees, verified)):
            if outcome is None:
                paths.append(None)
                roots.append(None)
                continue
            self.committed[b] += outcome.tokens
            path, root, hit = self.reroot_row(b, subtree, outcome)
            paths.append(path)
            roots.append(root)
            hits += hit
        self.unsettled = (paths, roots, self.cache.length, verified[0] is not None)
        self.new_roots = [root or 0 for root in roots]
        fresh = any(root is None for root, outcome in zip(roots, verified) if outcome is not None)
        if not defer or fresh or self.states.active:
            self.settle()  # a fresh tree: the next subtree needs an expansion first
        return hits

    def follow(self, verified: list[Verified | None]) -> int:
        """accept() for a verdict that names no node of its trees (the device round's host proposals, drafters/
        device_host.py: the target walked a trie of its own tokens): each row's verified tokens as a chain from its
        root along its own tree (`chain`). Rows with None, or no token, are left as they are."""
        read_views(self.trees)  # the last expansion's children, which the chains look the tokens up among
        chains: list[Subtree | None] = [None] * len(verified)
        verdicts: list[Verified | None] = [None] * len(verified)
        for b, outcome in enumerate(verified):
            if outcome is not None and outcome.tokens:
                chains[b], verdicts[b] = self.chain(b, outcome.tokens)
        return self.accept(chains, verdicts)

    def chain(self, b: int, new: list[int]) -> tuple[Subtree, Verified]:
        """Tokens appended to row b as a verdict on its own tree: the chain from its root along them (the tree's
        nodes where it holds them), all accepted, the last one the new root."""
        view = self.trees[b].view
        ids, node = [0], 0
        for token in new[:-1]:
            child = None
            if node >= 0 and view is not None:
                child = next((i for i in range(node + 1, len(view.parents))
                              if view.parents[i] == node and view.tokens[i] == token), None)
            node = child if child is not None else -1
            ids.append(node)
        root = self.committed[b][-1]
        return (Subtree(ids, [root] + new[:-1], list(range(-1, len(new) - 1))),
                Verified(tokens=list(new), path=list(range(len(new)))))

    def settle(self, sent: list[Subtree | None] | None = None) -> list[Subtree | None] | None:
        """What accept(defer=True) left: keep each row's subtree under its new root, commit the verified KV.
        sent: the subtrees chosen meanwhile, returned with their node ids renumbered for the re-rooted trees."""
        if self.unsettled is None:
            return sent
        (paths, roots, ran, followed), self.unsettled = self.unsettled, None
        keeps, out = [], list(sent) if sent is not None else None
        for b, root in enumerate(roots):
            if root is None:  # no verdict, or a fresh tree (reroot_row reset it)
                keeps.append(None)
                continue
            tree, kept = self.trees[b], kept_nodes(self.trees[b], root)
            if out is not None and out[b] is not None:
                renumbered = {old: new for new, old in enumerate(kept.tolist())}
                out[b] = Subtree([renumbered.get(node, -1) for node in out[b].node_ids], out[b].tokens, out[b].parents)
                self.grafted[b] = out[b].node_ids  # the next verdict's path, in this tree
            keeps.append(reroot(tree, root, kept))
            tree.root_token = self.committed[b][-1]
        self.new_roots = [0] * len(self.trees)
        self.cache.commit_rows(paths, keeps)
        if self.states.active and followed:  # one row (recurrent.py)
            self.follow_accepted_path(ran)
        if self.window is not None:
            self.slide_rows(out)
        return out

    def slide_rows(self, sent: list[Subtree | None] | None = None) -> None:
        """Every row whose text (nearly) fills the draft's context forgets its KV and tree and reads its last
        `window` tokens again (they become pending: one catch-up); a recurrent draft stops drafting the row. A
        subtree `sent` meanwhile (asynchronous engines) then names no node of the new tree."""
        for b, committed in enumerate(self.committed):
            if self.stopped[b] or len(committed) <= self.max_positions - slide_margin(self.max_positions):
                continue
            if self.states.active:  # recurrent states cannot be cut to a window: plain rounds from here
                self.stopped[b] = True
                self.pending[b] = []
                self.cache.truncate(self.cache.prefix_lens[b], b)  # the tree region goes with the tree
            else:
                self.committed[b] = kept = committed[-self.window :]
                self.pending[b] = kept[:-1]
                self.cache.truncate(self.cache.starts[b], b)
            self.counters.slides += 1
            reset_tree(self.trees[b], self.committed[b][-1])
            if sent is not None and sent[b] is not None:
                sent[b] = Subtree([0] + [-1] * (len(sent[b]) - 1), sent[b].tokens, sent[b].parents)
                self.grafted[b] = sent[b].node_ids

    def reroot_row(self, b: int, subtree: Subtree, verified: Verified) -> tuple[list[int] | None, int | None, bool]:
        """accept for row b: (its path slots to commit, the node that becomes its root (None: the tree was
        reset), whether it was a hit)."""
        tree = self.trees[b]
        nodes, self.grafted[b] = self.grafted[b] or subtree.node_ids, None  # the sent nodes in this tree (graft)
        if self.stopped[b]:  # past a recurrent draft's context: nothing to follow, its tree region dropped
            reset_tree(tree, verified.tokens[-1])
            return [], None, False
        if tree.num_slots == 0:  # the draft has run nothing of this tree: every verified token is pending
            self.counters.reroot_misses += 1
            self.pending[b] += [subtree.tokens[i] for i in verified.path]
            reset_tree(tree, verified.tokens[-1])
            return None, None, False
        path = [nodes[i] for i in verified.path]  # draft-tree nodes: root + accepted (-1: not in this tree)
        facts = path_facts(tree, path, verified.tokens[-1])
        k = facts.ran  # nodes with draft KV
        path_slots = facts.slots  # host ints: the commit moves them unread
        if facts.child is not None:  # the whole path was run on and the new root is in the tree: a hit
            self.counters.reroot_hits += 1
            if not facts.child_ran:  # a leaf: its subtree is itself, which a reset keeps for less
                reset_tree(tree, verified.tokens[-1])
                return path_slots, None, True
            return path_slots, facts.child, True
        self.counters.reroot_misses += 1
        unrun = [subtree.tokens[i] for i in verified.path[k:]]
        self.pending[b] = (self.pending[b] if k == 0 else []) + unrun  # the root's expansion consumes pending
        reset_tree(tree, verified.tokens[-1])
        return path_slots, None, False

    def follow_accepted_path(self, ran: int) -> None:
        """After a commit (one row): if the draft ran past what its cache now keeps (`ran` slots before),
        put the recurrent states back (recurrent.py). It saves after every forward, so nothing is left to
        replay; if something were, it would run again first, as pending tokens."""
        kept = self.cache.length
        if ran <= kept:  # nothing run was dropped (a chain's re-root keeps every node run below the new root)
            self.states.forget_before(self.cache.prefix_len)  # keeping the snapshots inside the kept chain
            return
        rerun = self.states.rewind(kept, ran)
        if rerun:
            start = self.cache.prefix_len - rerun
            self.cache.truncate(start)
            self.pending[0] = self.committed[0][start : start + rerun] + self.pending[0]  # slots are positions

    def absorb(self, other: "DraftModelDrafter") -> None:
        """Take `other`'s rows (started on their prompts) in after this one's: rows joining a running batch."""
        if self.states.active or other.states.active:
            raise RuntimeError("rows cannot join a recurrent draft's batch (its states roll back for one row)")
        self.cache.absorb(other.cache)
        self.trees += other.trees
        self.pending += other.pending
        self.committed += other.committed
        self.grafted += other.grafted
        self.new_roots += other.new_roots
        self.stopped += other.stopped

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows`: row rows[i] becomes row i (cache.keep_order moves few)."""
        self.cache.keep_rows(rows)
        self.trees = [self.trees[b] for b in rows]
        self.pending = [self.pending[b] for b in rows]
        self.committed = [self.committed[b] for b in rows]
        self.grafted = [self.grafted[b] for b in rows]
        self.new_roots = [self.new_roots[b] for b in rows]
        self.stopped = [self.stopped[b] for b in rows]


def depth_room(max_positions: int | None, root_position: int) -> int | None:
    """How deep below a root at `root_position` a node may sit before its position passes the models'
    context (None: no limit)."""
    if max_positions is None:
        return None
    return max(max_positions - 1 - root_position, 0)


def slide_margin(max_positions: int) -> int:
    """Room a windowed draft keeps free for its trees: a row whose text leaves less slides (an eighth of the
    context, so a slide comes every (1/2 - 1/8) of it and costs one catch-up of half of it)."""
    return max(max_positions // 8, 1)


def window_for(draft_positions: int | None, target_positions: int | None) -> int | None:
    """Tokens a draft keeps when the text fills its context (half of it), where it is shorter than the target's;
    None where the draft follows the target as far as the target goes."""
    if draft_positions is None or (target_positions is not None and draft_positions >= target_positions):
        return None
    return max(draft_positions // 2, 1)


def within_depth(subtree: Subtree, scores: list[float], max_depth: int) -> tuple[Subtree, list[float]]:
    """The nodes of `subtree` (topological) no deeper than `max_depth` below its root, still connected."""
    depths = [0] * len(subtree)
    for i, p in enumerate(subtree.parents[1:], 1):
        depths[i] = depths[p] + 1
    keep = [i for i, d in enumerate(depths) if d <= max_depth]
    if len(keep) == len(subtree):
        return subtree, scores
    local = {old: new for new, old in enumerate(keep)}
    return Subtree([subtree.node_ids[i] for i in keep], [subtree.tokens[i] for i in keep],
                   [local[subtree.parents[i]] if subtree.parents[i] >= 0 else -1 for i in keep]), [scores[i] for i in keep]
