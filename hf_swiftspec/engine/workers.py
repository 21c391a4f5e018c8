"""The two workers of tree speculation. Engines differ only in how they schedule these calls.

DraftWorker owns the draft model, its TreeCache and the TokenTree; TargetWorker owns the
target model and its TreeCache. Both caches hold the same committed prefix: every verified
token except the current root, which is tree node 0 on both sides.
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, StoppingCriteriaList

from ..architectures import Architecture, cache_argument, describe
from ..attention import tree_step_kwargs
from ..cache import TreeCache
from ..recurrent import MAX_REPLAY, StateLog, add_state_layers
from ..stats import DraftCounters, TargetCounters
from ..tree import (
    Proposal,
    Subtree,
    best_subtree,
    merge_suffix,
    ranked,
    TokenTree,
    add_children,
    expansion_inputs,
    locate_child,
    new_tree,
    reroot,
    reset_tree,
    room_for_expansion,
    select_leaves,
    select_subtree,
    subtree_mask,
)
from ..suffix import OutputHistory, SuffixIndex, SuffixTree
from ..policy import GoodputPolicy
from ..verify import Sampler, Verified, verify_tree


def model_step(model: PreTrainedModel, cache: TreeCache, input_ids, position_ids, attention_mask=None, keep: int = 0,
               **kwargs):
    """One forward writing into `cache`; returns float32 logits (Q, V) (only the last `keep` if keep > 0)."""
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        **{cache_argument(type(model)): cache},
        logits_to_keep=keep,
        **kwargs,
    )
    cache.advance(input_ids.shape[1])
    # Some models (trocr) take no logits_to_keep and return every row: keep the last `keep` here.
    return out.logits[0, -keep:].float() if keep else out.logits[0].float()


def tree_step_forward(
    model, cache: TreeCache, input_ids, position_ids, tree_mask: torch.Tensor, attention: str,
    architecture: Architecture | None = None, kv_positions: torch.Tensor | None = None,
    fallbacks: set[str] | None = None,
):
    """A forward over tree nodes (1, Q): each sees the prefix and the tree slots `tree_mask` (Q, S) allows.

    kv_positions: (S,) positions of the tree slots, needed when a layer has a window (default:
        the queries' own, as when the step's nodes are the whole tree region).
    fallbacks: collects why kernel-routed layers ran the model's own attention instead.
    """
    q_positions = position_ids[0]
    kwargs = tree_step_kwargs(
        attention, architecture or describe(model), cache.prefix_len, tree_mask, model.dtype, q_positions,
        q_positions if kv_positions is None else kv_positions,
    )
    logits = model_step(model, cache, input_ids, position_ids, **kwargs)
    if fallbacks is not None and "swiftspec_tree" in kwargs:
        fallbacks |= kwargs["swiftspec_tree"].fallbacks
    return logits


def new_cache(architecture: Architecture, capacity: int) -> TreeCache:
    cache = TreeCache(len(architecture.layer_types), capacity, architecture.sliding)
    return add_state_layers(cache, architecture.layer_types, architecture.layer_states)  # recurrent layers, if any


class TargetWorker:
    """Runs the target: prefill, then one tree forward + verification walk + commit per step.

    It owns the committed sequence (1, P + L) as processors see it: the left padding, then every
    verified token, ending with the current root.
    """

    def __init__(
        self, model: PreTrainedModel, capacity: int, attention: str = "sdpa", architecture: Architecture | None = None
    ):
        self.model = model
        self.attention = attention
        self.architecture = architecture or describe(model, "target")
        self.device = model.device
        self.cache = new_cache(self.architecture, capacity)
        self.states = StateLog(self.cache)  # recurrent states: saved before each verification (recurrent.py)
        self.replay: list[int] = []  # accepted tokens whose states were rolled back: run before the next nodes
        self.attention_fallbacks: set[str] = set()  # why kernel-routed layers ran their own attention
        self.sequence: torch.Tensor | None = None
        self.root_logits: torch.Tensor | None = None  # (1, V) the prefill's last row, until the first verification
        self.counters = TargetCounters()

    def prefill(self, prompt: torch.Tensor, padding: torch.Tensor | None = None) -> None:
        """Run the whole prompt (1, L), L >= 1, as transformers' generate does: the KV of all but its
        last token is committed; the last one (the first root) stays in tree slot 0, its logits kept
        for the first verification, which then runs only the nodes below the root (none when the
        first round is plain), so speculation costs no forward more than target.generate.

        padding: (1, P) left padding that processors and criteria see before the prompt (never run).
        """
        prompt = prompt.to(self.device)
        self.sequence = prompt if padding is None else torch.cat([padding.to(self.device), prompt], dim=1)
        positions = torch.arange(prompt.shape[1], device=self.device)[None]
        self.root_logits = model_step(self.model, self.cache, prompt, positions, keep=1)  # (1, V)
        self.cache.seal_prefix()
        self.cache.prefix_len -= 1
        self.counters.forwards += 1

    def verify(
        self,
        subtree: Subtree,
        sampler: Sampler,
        stopping_criteria: StoppingCriteriaList,
        max_tokens: int,
        walk=verify_tree,
    ) -> Verified:
        """Forward the subtree (T nodes) over the prefix, walk it, commit the accepted path.

        walk: verify_tree, or (on a tensor-parallel rank that is not the leader) a function
            with its signature that returns the leader's walk.
        """
        start = time.perf_counter()
        replayed = len(self.replay)  # run in front of the subtree's nodes, in tree slots [0, replayed)
        logits = self.forward_subtree(subtree)  # (T, V)
        verified = walk(logits, subtree, self.sequence, sampler, stopping_criteria, max_tokens)
        ran = self.cache.length
        path = torch.tensor(verified.path, device=self.device)
        self.cache.commit(torch.cat([torch.arange(replayed, device=self.device), path + replayed]) if replayed else path)
        new = torch.tensor([verified.tokens], dtype=self.sequence.dtype, device=self.device)
        self.sequence = torch.cat([self.sequence, new], dim=1)
        self.follow_accepted_path(ran)
        device_sync(self.device)
        self.counters.verify_steps += 1
        self.counters.busy_s += time.perf_counter() - start
        return verified

    def forward_subtree(self, subtree: Subtree) -> torch.Tensor:
        """Logits (T, V) of every subtree node: one forward over the nodes the cache lacks (after the
        tokens to replay, if any: only chain-shaped models have them)."""
        mask, depths = subtree_mask(subtree.parents, self.device)
        first, root_logits = 0, self.root_logits
        if root_logits is not None:  # the prefill ran the root: forward only the nodes below it
            first, self.root_logits = 1, None
            if len(subtree) == 1:
                return root_logits
        if len(subtree) > 1:  # the root alone is always accepted: nothing to roll back
            self.states.save(self.cache.length)  # rolled back to after a partial acceptance
        replay = self.replay  # (only chain-shaped models replay, and never in the first round: first = 0)
        node_positions = self.cache.prefix_len + len(replay) + depths  # (T,)
        positions = node_positions[None, first:]
        if replay:
            before = torch.arange(self.cache.prefix_len, self.cache.prefix_len + len(replay), device=self.device)
            positions = torch.cat([before[None], positions], dim=1)
        input_ids = torch.tensor([replay + subtree.tokens[first:]], device=self.device)
        logits = tree_step_forward(
            self.model, self.cache, input_ids, positions, mask[first:], self.attention, self.architecture,
            node_positions, self.attention_fallbacks,
        )[len(replay) :]  # (T - first, V)
        self.counters.forwards += 1
        return logits if root_logits is None else torch.cat([root_logits, logits])

    def follow_accepted_path(self, ran: int) -> None:
        """After a commit: if the forward (`ran` positions in the cache) ran past the accepted tokens, put
        the recurrent states back (recurrent.py) and keep the accepted tokens after the snapshot to replay;
        too many piled up run at once, as a forward of their own. No-op for attention-only models."""
        committed = self.cache.prefix_len
        rerun = self.states.rewind(committed, ran)
        self.replay = []
        if not rerun:
            return
        self.cache.truncate(committed - rerun)
        self.replay = self.sequence[0, -rerun - 1 : -1].tolist()  # the sequence ends with the new root
        self.counters.replayed_tokens += rerun
        if rerun > MAX_REPLAY:
            ids = torch.tensor([self.replay], device=self.device)
            model_step(self.model, self.cache, ids, torch.arange(committed - rerun, committed, device=self.device)[None],
                       keep=1)  # fmt: skip
            self.cache.seal_prefix()
            self.states.save(self.cache.length)
            self.replay = []
            self.counters.forwards += 1


class DraftWorker:
    """Grows the token tree best-first and re-roots it on verified tokens, reusing its KV.

    pending: committed tokens whose draft KV is not computed yet (the prompt at the start, tokens of
    rounds that did not expand, the last accepted node when it was an unexpanded leaf). One rides
    along in the next root expansion; more are run first by `catch_up`, so an expansion's time is
    an expansion's.

    model None: draft-free mode. The tree stays a lone root that never expands, so every proposal
    comes from the n-gram index; the policy sees no expansion to run and prices trees alone.
    """

    def __init__(
        self, model: PreTrainedModel | None, capacity: int, tree_capacity: int, width: int, vocab_limit: int,
        attention: str = "sdpa", ngram_size: int = 3, architecture: Architecture | None = None,
        max_positions: int | None = None, device: torch.device | str | None = None, branching: bool = True,
    ):
        self.model = model
        self.max_positions = max_positions  # both models' context: no node is ever placed past it
        self.attention = attention
        self.architecture = architecture or (describe(model, "draft") if model is not None else None)
        self.device = model.device if model is not None else torch.device(device or "cpu")
        self.cache = new_cache(self.architecture, capacity) if model is not None else None
        self.states = StateLog(self.cache)  # recurrent states: saved after every forward (recurrent.py)
        self.attention_fallbacks: set[str] = set()  # why kernel-routed layers ran their own attention
        self.width = width
        self.vocab_limit = vocab_limit  # the draft never proposes ids the target cannot embed
        self.tree: TokenTree = new_tree(0, tree_capacity, self.device)
        self.pending: list[int] = []
        self.ngram_size = ngram_size  # longest suffix matched for suffix proposals; 0: none
        self.use_ngrams = ngram_size > 0
        self.branching = branching  # False: suffix proposals are chains (the models' steps must be)
        self.suffixes = SuffixIndex(max_n=max(ngram_size, 1), branching=branching)
        self.counters = DraftCounters()

    def start(self, prompt: torch.Tensor, corpus: list[list[int]] | None = None,
              history: OutputHistory | None = None) -> None:
        """Begin a generation: the prompt (1, L) minus its last token is pending, the last is the root.

        corpus: token sequences the suffix proposals may also copy from; history: earlier outputs.
        """
        ids = prompt[0].tolist()
        self.pending = ids[:-1] if self.model is not None else []
        reset_tree(self.tree, ids[-1])
        self.suffixes = SuffixIndex(max_n=max(self.ngram_size, 1), history=history, branching=self.branching)
        self.suffixes.add_corpus(corpus or [])
        self.suffixes.extend(ids)

    def expand(self, within: int | None = None) -> int:
        """One draft forward over the best `width` unexpanded leaves (among the best `within`
        nodes if given); returns how many were expanded (0: none left, or the tree is full)."""
        if self.model is None:
            return 0
        tree, cache = self.tree, self.cache
        leaves = select_leaves(tree, self.width, within, self.depth_room())
        if not leaves.shape[0] or not room_for_expansion(tree, leaves.shape[0], self.width):
            return 0
        prefix = cache.prefix_len
        input_ids, positions, mask = expansion_inputs(tree, leaves, prefix)
        if self.pending:
            # Only a fresh tree has pending tokens: run them and the root as one causal chain.
            chain = torch.tensor([self.pending], device=self.device)
            input_ids = torch.cat([chain, input_ids], dim=1)
            positions = torch.arange(prefix, prefix + input_ids.shape[1], device=self.device)[None]
            logits = model_step(self.model, cache, input_ids, positions, keep=1)
            cache.prefix_len += len(self.pending)
            self.pending = []
        else:
            slot_positions = prefix + tree.depths[tree.slot_nodes[: tree.num_slots]] if self.architecture.windowed else None
            logits = tree_step_forward(
                self.model, cache, input_ids, positions, mask, self.attention, self.architecture, slot_positions,
                self.attention_fallbacks,
            )
        self.states.save(cache.length)
        self.counters.forwards += 1
        self.counters.expansions += 1
        logprobs = torch.log_softmax(logits[:, : self.vocab_limit], dim=-1)  # (w, V)
        child_logprobs, child_tokens = logprobs.topk(self.width, dim=-1)
        add_children(tree, leaves, child_logprobs, child_tokens)
        return leaves.shape[0]

    def depth_room(self) -> int | None:
        """How deep below the root a node may sit before its position passes the models' context (None:
        no limit). Learned position embeddings have no row past it: the tree stops short of it, as
        target.generate's own last step does."""
        if self.max_positions is None:
            return None
        root_position = len(self.suffixes.tokens) - 1  # every committed token before the root
        return max(self.max_positions - 1 - root_position, 0)

    def catch_up(self) -> None:
        """Run the committed tokens the draft has not seen yet (the prompt, tokens verified in plain
        rounds) into its prefix, as one causal chain, so that the next expansion is an ordinary one."""
        if not self.pending:
            return
        cache, ids = self.cache, torch.tensor([self.pending], device=self.device)
        positions = torch.arange(cache.prefix_len, cache.prefix_len + ids.shape[1], device=self.device)[None]
        model_step(self.model, cache, ids, positions, keep=1)
        cache.prefix_len += ids.shape[1]
        self.states.save(cache.length)
        self.pending = []
        self.counters.forwards += 1

    def grow(self, max_expansions: int, within: int | None = None, stop=None) -> int:
        """Expand up to `max_expansions` times (only leaves among the best `within` nodes if given),
        until nothing is left to expand or `stop()` says so. Returns the expansions run."""
        done = 0
        while done < max_expansions and not (stop is not None and stop()) and self.expand(within):
            done += 1
        return done

    def top_up(self, budget: int) -> int:
        """Expand until the tree holds at least `budget` nodes (or cannot grow). Returns the expansions run."""
        done = 0
        while self.tree.size < budget and self.expand():
            done += 1
        return done

    def propose(self, budget: int) -> Subtree:
        """The best `budget`-node subtree of the draft's own tree, by score."""
        self.counters.rounds += 1
        return select_subtree(self.tree, budget)[0]

    def reroot(self, subtree: Subtree, verified: Verified) -> bool:
        """Follow the verified tokens, commit their KV, keep the subtree under the new root.

        The accepted path starts with the nodes the draft has run on (its KV is committed) and may
        end with nodes it has not: draft leaves, or n-gram nodes outside its tree (node id -1).
        Their tokens become pending. Returns True when the new root was already in the tree.
        """
        tree = self.tree
        self.suffixes.extend(verified.tokens)
        if self.model is None:  # no draft KV to keep: the next tree is the new root alone
            reset_tree(tree, verified.tokens[-1])
            return False
        path = [subtree.node_ids[i] for i in verified.path]  # draft-tree nodes: root + accepted
        in_tree = path[: next((j for j, node in enumerate(path) if node < 0), len(path))]
        ids = torch.tensor(in_tree, dtype=torch.long, device=self.device)
        expanded = tree.expanded[ids].tolist()
        k = next((j for j, e in enumerate(expanded) if not e), len(expanded))  # nodes with draft KV
        path_slots = tree.kv_slot[ids[:k]]
        ran = self.cache.length
        if k == len(path):  # the whole path was run on: the new root may already be in the tree
            child, _ = locate_child(tree, path[-1], verified.tokens[-1])
            if child is not None:
                self.cache.commit(path_slots, reroot(tree, child))
                tree.root_token = verified.tokens[-1]
                self.counters.reroot_hits += 1
                self.follow_accepted_path(ran)
                return True
        self.counters.reroot_misses += 1
        self.cache.commit(path_slots)
        unrun = [subtree.tokens[i] for i in verified.path[k:]]
        self.pending = (self.pending if k == 0 else []) + unrun  # the root's expansion consumes pending
        reset_tree(tree, verified.tokens[-1])
        self.follow_accepted_path(ran)
        return False

    def follow_accepted_path(self, ran: int) -> None:
        """After a commit: if the draft ran past what its cache now keeps (`ran` positions before), put the
        recurrent states back (recurrent.py). It saves after every forward, so nothing is left to replay;
        if something were, it would run again first, as pending tokens. No-op for attention-only models."""
        kept = self.cache.length
        if ran <= kept:  # nothing run was dropped (a chain's re-root keeps every node run below the new root)
            self.states.forget_before(self.cache.prefix_len)  # keeping the snapshots inside the kept chain
            return
        rerun = self.states.rewind(kept, ran)
        if rerun:
            start = self.cache.prefix_len - rerun
            self.cache.truncate(start)
            self.pending = self.suffixes.tokens[start : start + rerun] + self.pending

    # ---- the adaptive round: candidates for the policy, the proposal it picks -------------------
    def candidates(self, policy: GoodputPolicy, suffix: SuffixTree) -> Proposal:
        """The draft's best nodes merged with the suffix proposal, each with its calibrated P(accepted)
        (one host sync)."""
        draft, scores = select_subtree(self.tree, policy.max_budget)
        probs = policy.draft_probs(scores)
        suffix_probs, buckets = policy.suffix_probs(suffix)
        return merge_suffix(draft, scores, probs, suffix.tokens, suffix.parents, suffix_probs, buckets, suffix.match)

    def proposal(self, policy: GoodputPolicy, candidates: Proposal, spent_s: float, agree=int) -> Proposal:
        """The best T candidates for the T the policy expects the most tokens per second from.

        agree: makes every draft rank use the same tree size (identity on a lone draft worker).
        """
        order = ranked(candidates)
        budget, _ = policy.best_budget([candidates.probs[i] for i in order], spent_s)
        return best_subtree(candidates, order, agree(budget))

    def suffix_tree(self, max_nodes: int) -> SuffixTree:
        """The suffix proposal for the committed sequence and root (empty when n-grams are off), no
        deeper than the models' context allows."""
        return self.suffixes.propose(max_nodes, self.depth_room()) if self.use_ngrams else SuffixTree()


def device_sync(device: torch.device) -> None:
    """Wait for queued kernels so phase timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
