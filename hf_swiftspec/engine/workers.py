"""The two models of tree speculation: the target's verifier and the draft model's drafter.

TargetWorker owns the target model and its TreeCache; DraftModelDrafter (one of the drafters of
drafting.py) owns the draft model, its TreeCache and one TokenTree per batch row. Both caches
hold, per row, the same committed tokens: every verified token except the current root, which is
tree node 0 on both sides (the draft's cache may lag behind by its `pending` tokens). Rows are
independent sequences sharing each forward: `keep_rows` drops the rows that finished, on both alike.

Recurrent and hybrid models (one row only: a batch of them decodes with transformers' own loop)
keep states that every token advances; each worker's `StateLog` (recurrent.py) saves them and
puts them back on the accepted path after every commit (`follow_accepted_path`).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, StoppingCriteriaList

from ..models.architectures import Architecture
from ..steps.capture import StepGraphs
from ..policy.goodput import GoodputPolicy
from ..steps.probes import describe
from ..steps.recurrent import MAX_REPLAY, StateLog, new_cache
from ..stats import DraftCounters, TargetCounters
from ..steps.step import NO_LOGITS, RowQueries, model_step, run_step
from ..steps.tree import (
    Subtree,
    TokenTree,
    add_children,
    expansion_inputs,
    graft_node,
    kept_nodes,
    locate_child,
    new_tree,
    path_facts,
    reroot,
    reset_tree,
    room_for_expansion,
    select_leaves,
    select_subtree,
    subtree_mask,
    top_children,
)
from ..steps.verify import Sampler, Verified, verify_tree


class TargetWorker:
    """Runs the target: prefill, then one tree forward + verification walks + commit per step.

    It owns, per row, the committed sequence (1, P + L) as processors see it: the row's left
    padding, then every verified token, ending with the current root.
    """

    def __init__(
        self, model: PreTrainedModel, capacity: int, attention: str = "sdpa", architecture: Architecture | None = None,
        batch_size: int = 1, graphs: StepGraphs | None = None,
    ):
        self.model = model
        self.attention = attention
        self.architecture = architecture or describe(model, "target")
        self.device = model.device
        self.graphs = graphs  # replayed forwards (capture.py), or None: every step eager
        self.cache = new_cache(self.architecture, capacity, batch_size, graphs and graphs.pool)
        self.states = StateLog(self.cache)  # recurrent states: saved before each verification (recurrent.py)
        self.replay: list[int] = []  # accepted tokens whose states were rolled back: run before the next nodes
        self.attention_fallbacks: set[str] = set()  # why kernel-routed layers ran their own attention
        self.sequences: list[torch.Tensor] = []
        self.root_logits: list[torch.Tensor] | None = None  # per row (1, V): the prefill's, until the first verification
        self.counters = TargetCounters()
        self.tap = None  # a FeatureTap (eagle3.py) when a drafter reads the target's hidden states
        self.prompt_features: list[torch.Tensor] | None = None  # per row (L_b, D), with a tap: the prompt's states
        self.root_features: list[torch.Tensor] | None = None  # per row (1, D): the prefill's root, like root_logits
        self.step_features: list[torch.Tensor | None] = []  # per row (T_b, D): the last verification's nodes

    @property
    def sequence(self) -> torch.Tensor:
        """Row 0's committed sequence (the only row of a single sequence)."""
        return self.sequences[0]

    def prefill(self, prompt: torch.Tensor, contexts: list[torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None) -> None:
        """Run the prompts (B, L), left-padded where `attention_mask` (B, L) says so, exactly as
        transformers' generate does: the KV of all but the last token is committed; the last one
        (each row's first root) stays in tree slot 0, its logits kept for the first verification,
        which then runs only the nodes below the root (none when the first round is plain), so
        speculation costs no forward more than target.generate.

        contexts: per row, the sequence (1, P + L) processors and criteria see before any new token
            (default: the prompt row); it may hold padding the models never see.
        """
        prompt = prompt.to(self.device)
        B, L = prompt.shape
        if attention_mask is None:
            positions = torch.arange(L, device=self.device)[None].expand(B, L)
            starts = [0] * B
        else:
            attention_mask = attention_mask.to(self.device)
            positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
            starts = (L - attention_mask.long().sum(-1)).tolist()
        self.sequences = [c.to(self.device) for c in contexts] if contexts is not None else list(prompt.split(1))
        logits = model_step(self.model, self.cache, prompt, positions, attention_mask=attention_mask, keep=1)
        states = self.tap.take() if self.tap is not None else None
        self.prompt_prefilled(logits, [None if states is None else states[b, starts[b] :] for b in range(B)], starts)

    def prefill_pieces(self, prompt: torch.Tensor, piece: int, contexts: list[torch.Tensor] | None = None):
        """prefill() of one row without padding (1, L), `piece` tokens per forward: a generator that yields
        after every forward but the last, so that a running batch decodes a round between them (a long
        prompt joining it does not hold it for its whole prefill). It ends as prefill() ends: the prompt's
        KV committed but its last token's, that token's logits kept, the prompt's states taken."""
        prompt = prompt.to(self.device)
        length = prompt.shape[1]
        self.sequences = [c.to(self.device) for c in contexts] if contexts is not None else [prompt]
        states = []
        for start in range(0, length, piece):
            end = min(start + piece, length)
            positions = torch.arange(start, end, device=self.device)[None]
            keep = 1 if end == length else NO_LOGITS if self.architecture.headless else 1
            logits = model_step(self.model, self.cache, prompt[:, start:end], positions, keep=keep)
            if self.tap is not None:
                states.append(self.tap.take()[0])
            if end == length:
                break
            self.cache.seal_prefix()
            self.counters.forwards += 1
            yield
        self.prompt_prefilled(logits, [torch.cat(states) if states else None], [0])

    def prompt_prefilled(self, logits: torch.Tensor, states: list[torch.Tensor | None], starts: list[int]) -> None:
        """The prefill's end: each row's last prompt token becomes its first root (tree slot 0), its logits
        (B, 1, V) kept for the first verification; states: per row the tap's (L_b, D) at the prompt (None
        without a tap)."""
        self.root_logits = list(logits[:, -1].split(1))  # (1, V) per row
        if self.tap is not None:
            self.prompt_features = states
            self.root_features = [f[-1:] for f in states]
        self.cache.starts = starts
        self.cache.seal_prefix()
        self.cache.prefix_lens = [n - 1 for n in self.cache.prefix_lens]
        self.counters.forwards += 1

    def verify(
        self,
        subtrees: list[Subtree | None],
        samplers: list[Sampler],
        stopping_criteria: list[StoppingCriteriaList],
        max_tokens: list[int],
        walk=verify_tree,
        walked=None,
    ) -> list[Verified | None]:
        """Forward every row's subtree (T_b nodes) over its prefix in one step, walk each, commit the
        accepted paths. A row whose subtree is None sits the step out (and gets None).

        walk: verify_tree, or (on a tensor-parallel rank that is not the leader) a function
            with its signature that returns the leader's walk.
        walked: called with the verdicts once the walks are done, before the commit (the asynchronous
            engine sends them from there: the draft follows them while this worker commits).
        """
        start = time.perf_counter()
        replayed = len(self.replay)  # run in front of row 0's nodes, in its tree slots [0, replayed)
        logits = self.forward_subtrees(subtrees)  # per row (T_b, V)
        ran = self.cache.length
        verified: list[Verified | None] = []
        for b, subtree in enumerate(subtrees):
            if subtree is None:
                verified.append(None)
                continue
            outcome = walk(logits[b], subtree, self.sequences[b], samplers[b], stopping_criteria[b], max_tokens[b])
            if self.tap is not None:
                outcome.features = self.step_features[b][outcome.path]
            new = torch.tensor([outcome.tokens], dtype=self.sequences[b].dtype, device=self.device)
            self.sequences[b] = torch.cat([self.sequences[b], new], dim=1)
            verified.append(outcome)
        if walked is not None:
            walked(verified)
        paths = [v.path if v else None for v in verified]
        if replayed and paths[0] is not None:
            paths[0] = list(range(replayed)) + [i + replayed for i in paths[0]]
        self.cache.commit_rows(paths)
        if self.states.active and verified[0] is not None:  # one row (recurrent.py)
            self.follow_accepted_path(ran)
        device_sync(self.device)
        self.counters.verify_steps += sum(v is not None for v in verified)
        self.counters.busy_s += time.perf_counter() - start
        return verified

    def forward_subtrees(self, subtrees: list[Subtree | None]) -> list[torch.Tensor | None]:
        """Logits (T_b, V) of every row's subtree nodes: one forward over the nodes the cache lacks
        (row 0's after the tokens to replay, if any: only recurrent models have them)."""
        root_logits, self.root_logits = self.root_logits, None  # the prefill ran the roots: forward only below them
        root_features, self.root_features = self.root_features, None
        rows, known = [], []
        for b, subtree in enumerate(subtrees):
            if subtree is None:
                rows.append(RowQueries.none(self.device))
                known.append(None)
                continue
            known.append(root_logits[b] if root_logits is not None else None)  # None: a row that joined earlier
            rows.append(self.subtree_queries(b, subtree, 0 if known[b] is None else 1))
        if self.states.active and subtrees[0] is not None and len(subtrees[0]) > 1:
            # rolled back to after a partial acceptance (the root alone is always accepted: nothing to roll back)
            self.states.save(self.cache.length)
        if any(len(r) for r in rows):
            logits = run_step(self.model, self.cache, rows, self.attention, self.architecture, self.attention_fallbacks,
                              graphs=self.graphs, tap=self.tap)
            self.counters.forwards += 1
            if self.replay:  # the replayed tokens' rows: their logits were known
                logits[0] = logits[0][len(self.replay) :]
        else:
            logits = [None] * len(rows)
        if self.tap is not None:
            self.step_features = self.features_of(rows, subtrees, root_features)
        return [
            None if subtrees[b] is None else logits[b] if known[b] is None
            else known[b] if not len(rows[b]) else torch.cat([known[b], logits[b]])
            for b in range(len(rows))
        ]

    def features_of(self, rows: list[RowQueries], subtrees, root_features) -> list[torch.Tensor | None]:
        """Per row, the tap's states (T_b, D) of its subtree's nodes in the forward just run (the root's from
        the prefill when the forward ran only below it)."""
        states = self.tap.take() if any(len(r) for r in rows) else None
        out = []
        for b, subtree in enumerate(subtrees):
            if subtree is None:
                out.append(None)
                continue
            known = root_features[b] if root_features is not None else None
            ran = states[b, : len(rows[b])] if states is not None else known[:0]
            out.append(torch.cat([known, ran]) if known is not None else ran)
        return out

    def subtree_queries(self, b: int, subtree: Subtree, first: int) -> RowQueries:
        """Row b's queries for its subtree's nodes from `first` on, after the tokens to replay (row 0 of a
        recurrent model only; never in the first round, whose root the prefill ran: first = 0)."""
        mask, depths = subtree_mask(subtree.parents, self.device)
        position = self.cache.prefix_lens[b] - self.cache.starts[b]  # of the first slot after the prefix
        replay = self.replay if b == 0 else []
        positions = position + len(replay) + depths
        tokens = torch.tensor(subtree.tokens[first:], dtype=torch.long, device=self.device)
        if not replay:
            return RowQueries(tokens, positions[first:], mask[first:], positions)
        R, T = len(replay), len(subtree)
        region = torch.zeros(R + T, R + T, dtype=torch.bool, device=self.device)
        region[:R, :R] = torch.ones(R, R, dtype=torch.bool, device=self.device).tril_()  # a chain
        region[R:, :R] = True  # every node sees the replayed tokens before it
        region[R:, R:] = mask
        positions = torch.cat([torch.arange(position, position + R, device=self.device), positions])
        tokens = torch.cat([torch.tensor(replay, dtype=torch.long, device=self.device), tokens])
        return RowQueries(tokens, positions, region, positions)

    def follow_accepted_path(self, ran: int) -> None:
        """After a commit (one row): if the forward (`ran` slots in the cache) ran past the accepted tokens,
        put the recurrent states back (recurrent.py) and keep the accepted tokens after the snapshot to
        replay; too many piled up run at once, as a forward of their own."""
        committed = self.cache.prefix_len
        rerun = self.states.rewind(committed, ran)
        self.replay = []
        if not rerun:
            return
        self.cache.truncate(committed - rerun)
        self.replay = self.sequence[0, -rerun - 1 : -1].tolist()  # the sequence ends with the new root
        self.counters.replayed_tokens += rerun
        if rerun > MAX_REPLAY:
            first = committed - rerun - self.cache.starts[0]
            ids = torch.tensor([self.replay], device=self.device)
            positions = torch.arange(first, first + rerun, device=self.device)[None]
            keep = NO_LOGITS if self.architecture.headless else 1  # run for its states alone: no head rows
            model_step(self.model, self.cache, ids, positions, keep=keep)  # a chain-shaped model: no mask
            self.cache.seal_prefix()
            self.states.save(self.cache.length)
            self.replay = []
            self.counters.forwards += 1

    @property
    def roots_known(self) -> bool:
        """Whether every row's root logits came with its prefill (a round can emit them with no forward)."""
        return self.root_logits is not None and all(logits is not None for logits in self.root_logits)

    def absorb(self, other: "TargetWorker") -> None:
        """Take `other`'s rows (the same model's worker, its prompts prefilled) in after this one's: rows
        joining a running batch. Their roots' logits come along; the rows here have none pending."""
        if self.states.active or other.states.active:
            raise RuntimeError("rows cannot join a recurrent model's batch (its states roll back for one row)")
        self.cache.absorb(other.cache)
        mine, theirs = len(self.sequences), len(other.sequences)
        self.sequences += other.sequences
        self.root_logits = joined(self.root_logits, other.root_logits, mine, theirs)
        self.root_features = joined(self.root_features, other.root_features, mine, theirs)
        self.counters.forwards += other.counters.forwards

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows`: row rows[i] becomes row i (cache.keep_order moves few)."""
        self.cache.keep_rows(rows)
        self.sequences = [self.sequences[b] for b in rows]
        if self.root_logits is not None:
            self.root_logits = [self.root_logits[b] for b in rows]
        if self.root_features is not None:
            self.root_features = [self.root_features[b] for b in rows]


class DraftModelDrafter:
    """A draft model's token tree per row, grown best-first and re-rooted on verified tokens, its KV kept.

    pending[b]: committed tokens of row b whose draft KV is not computed yet (the prompt at the
    start, tokens of rounds that did not expand, the last accepted node when it was an unexpanded
    leaf). A row with pending tokens has a fresh tree; its next expansion runs them and the root as
    one causal chain; `catch_up` runs them alone, so that an expansion's time is an expansion's.
    """

    reads_features = False  # whether it drafts from the target's hidden states (drafters/heads.py)

    def __init__(
        self, model: PreTrainedModel, capacity: int, tree_capacity: int, width: int, vocab_limit: int,
        attention: str = "sdpa", architecture: Architecture | None = None, max_positions: int | None = None,
        batch_size: int = 1, graphs: StepGraphs | None = None,
    ):
        self.model = model
        self.max_positions = max_positions  # both models' context: no node is ever placed past it
        self.attention = attention
        self.architecture = architecture or describe(model, "draft")
        self.device = model.device
        self.graphs = graphs  # replayed forwards (capture.py), or None: every step eager
        self.cache = new_cache(self.architecture, capacity, batch_size, graphs and graphs.pool)
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
        self.counters = DraftCounters()

    @property
    def tree(self) -> TokenTree:
        """Row 0's tree (the only row of a single sequence)."""
        return self.trees[0]

    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Begin a generation: per row, the prompt (token ids, no padding) minus its last token is
        pending, the last is the root. (features: the target's states, for drafters that read them.)"""
        for b, ids in enumerate(prompts):
            self.pending[b] = ids[:-1]
            self.committed[b] = list(ids)
            self.grafted[b] = None
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
                        logits=logits, graphs=self.graphs)

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

    def candidates(self, b: int, max_nodes: int, policy: GoodputPolicy) -> tuple[Subtree, list[float], list[float]]:
        """Row b's best `max_nodes` nodes (a connected subtree with the root), their draft scores and the
        policy's calibrated P(accepted) of each (one host sync)."""
        subtree, scores = select_subtree(self.trees[b], max_nodes, self.new_roots[b])
        return subtree, scores, policy.draft_probs(scores)

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
        paths: list[torch.Tensor | None] = []
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
        return out

    def reroot_row(self, b: int, subtree: Subtree, verified: Verified) -> tuple[torch.Tensor | None, int | None, bool]:
        """accept for row b: (its path slots to commit, the node that becomes its root (None: the tree was
        reset), whether it was a hit)."""
        tree = self.trees[b]
        nodes, self.grafted[b] = self.grafted[b] or subtree.node_ids, None  # the sent nodes in this tree (graft)
        if tree.num_slots == 0:  # the draft has run nothing of this tree: every verified token is pending
            self.counters.reroot_misses += 1
            self.pending[b] += [subtree.tokens[i] for i in verified.path]
            reset_tree(tree, verified.tokens[-1])
            return None, None, False
        path = [nodes[i] for i in verified.path]  # draft-tree nodes: root + accepted (-1: not in this tree)
        facts = path_facts(tree, path, verified.tokens[-1])
        k = facts.ran  # nodes with draft KV
        path_slots = torch.tensor(facts.slots, dtype=torch.long, device=self.device)
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

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows`: row rows[i] becomes row i (cache.keep_order moves few)."""
        self.cache.keep_rows(rows)
        self.trees = [self.trees[b] for b in rows]
        self.pending = [self.pending[b] for b in rows]
        self.committed = [self.committed[b] for b in rows]
        self.grafted = [self.grafted[b] for b in rows]
        self.new_roots = [self.new_roots[b] for b in rows]


def joined(mine: list | None, theirs: list | None, n_mine: int, n_theirs: int) -> list | None:
    """Per-row values of two batches, one after the other (None: no row has one)."""
    if mine is None and theirs is None:
        return None
    return (mine if mine is not None else [None] * n_mine) + (theirs if theirs is not None else [None] * n_theirs)


def depth_room(max_positions: int | None, root_position: int) -> int | None:
    """How deep below a root at `root_position` a node may sit before its position passes the models'
    context (None: no limit)."""
    if max_positions is None:
        return None
    return max(max_positions - 1 - root_position, 0)


def device_sync(device: torch.device) -> None:
    """Wait for queued kernels so phase timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
