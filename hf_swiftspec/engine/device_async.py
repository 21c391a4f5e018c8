"""SwiftSpec's asynchronous round on the device pieces (Algorithm 1), for one sequence in two threads: the draft grows
its tree while the target verifies the subtree it was sent, then re-roots on the verdict, on the device.

    draft:  top the tree up -> select the best T nodes and send them -> move the last re-root's KV -> run the sent
            nodes it has not run, then expand (best leaves first) while the verdict is due -> re-root the tree below
            the target's next token (the kept subtree compacted on the device, drafters/device_expansion.reroot_tree;
            a new tree where the token was never drafted; its KV moves once the next subtree has gone) -> ...
    target: receive a subtree -> verify it (one forward over its slot cache), walk, commit -> one read -> send the
            verdict -> emit the tokens

The tree lives across rounds (drafters/device_expansion.DraftTree), so what the draft grew while the target verified
is kept below the new root. Each side owns its slot cache (steps/slot_cache.py); a message is one type each way:
the DeviceSubtree (draft to target) and a Verdict (target to draft), through engine/links.ThreadLink (a failed or
stuck worker surfaces in generate() as SwiftSpecWorkerError within worker_timeout_s). The target's tokens are its
own (greedy: its argmax; sampling: the Gumbel-max noise of the other rounds, by seed and position), whatever tree the
draft sent, so the output is exactly target.generate's.

Suffix proposals (ngram_size > 0) are the draft side's: it keeps the row's suffix index (host data: the prompt, a
corpus, earlier outputs, and every verdict's tokens) and merges each round's proposal into its tree before the
selection (drafters/device_suffix.merge_suffix, the serial device round's fused merge), so the T nodes sent are the
best of both; in a plain round the proposal alone goes out with the root (or the root alone, where nothing matches).
A suffix node the draft never grew has an id past the tree's size when it was sent: a verified path through one
leaves the draft's tree, which then starts afresh at the next root, the committed tokens it has not run caught up in
one forward before its next expansion.

What it decodes (`async_gaps` names the rest, which the host round's asynchronous engine, engine/asynchronous.py,
decodes): one sequence, a draft model on the target's device, trees in both models (windowed layers a term of their
masks; no chains, no rules by cache slot), logits processors that ignore the path. With
serial_fallback its calls and the serial device round's are timed against each other, and the faster runs
(engine/launch.run_device_async_or_serial, policy/choice.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..drafters.device_expansion import DraftTree, best_leaves, expand, reroot_kv, reroot_tree, unexpanded, unrun
from ..drafters.device_host import on_host
from ..drafters.device_suffix import SuffixProposals, chosen_subtree, merge_suffix
from ..drafters.eagle3 import DraftHead
from ..policy.choice import PLAIN, TREE, DraftingChoice
from ..policy.sizing import Offer
from ..models.architectures import context_limit
from ..stats import DraftCounters, RoundRecord, SwiftSpecStats, TargetCounters
from ..steps.acceptance import cut_at_criteria, greedy_choices, gumbel_noise, sampled_choices, walk_subtree
from ..steps.device_round import DeviceSubtree, plain_subtree, select_device, to_device
from ..steps.slot_cache import SlotCache, catch_up, commit_cache, verify_forward
from ..steps.verify import Verified
from .device_phases import processed
from .links import ThreadLink, run_two_threads
from .request import BatchRows, DecodeRequest, DecodeResult

ENGINE = "async-threads-device"


@dataclass(frozen=True)
class AsyncShape:
    """The asynchronous round's sizes: `budget` nodes verified a round (the root included), `width` leaves an
    expansion runs and `children` each one gets, `nodes` the draft tree's capacity, at most `expansions` expansions
    while a verification is in flight (the first runs the sent subtree's nodes the draft has not run)."""

    budget: int
    width: int
    children: int
    nodes: int
    expansions: int

    @classmethod
    def of(cls, config) -> "AsyncShape":
        budget = config.tree_budget or 8
        width = max(1, min(config.draft_width, budget))
        expansions = config.draft_depth or 4
        return cls(budget, width, width, budget + max(budget, width) * width * (expansions + 1), expansions)


@dataclass(frozen=True)
class Sent:
    """What the draft sends a round (draft to target): the subtree to verify, and how many steps the target runs from it
    on its own (1 for a tree; a run of plain rounds: the root alone, then a plain step from each token the target
    emits, `steps` in all, with no message between them)."""

    subtree: DeviceSubtree
    steps: int = 1


@dataclass(frozen=True)
class Verdict:
    """The target's answer to one subtree (target to draft): the verified path as the draft tree's node ids (1, T)
    on the device (the root first, `count` of them; the rest padding), the target's next token (the next root) and
    whether the sequence is done. Its tensors are the verification's own, gathered on the device: no copy in. After a
    run of plain steps: `count` is the run's committed tokens (the root, then each step's token but the last)."""

    path: torch.Tensor
    count: int
    token: torch.Tensor  # (1,) long, on the device
    finished: bool
    verify_s: float = 0.0  # the verification's time on the target's side (what the draft paces its expansions by)
    wait_s: float = 0.0  # the target's wait for this round's subtree (with verify_s: the round, as the target saw it)
    tokens: tuple[int, ...] = ()  # the tokens the round emitted (host-known: what a draft rank returns, torchrun)


def async_gaps(target, draft, request: DecodeRequest, config, architectures, vocabularies=None,
               distributed: bool = False) -> list[str]:
    """Why this call cannot run the device round's asynchronous engine (empty: it can). vocabularies: a draft with
    another tokenizer's (drafters/vocabulary.py), None for one of the target's. distributed: each model on its own
    torchrun rank (engine/device_distributed.py), not two threads of one device."""
    gaps = []
    if draft is None or isinstance(draft, DraftHead):
        gaps.append("it grows a draft model's tree (draft-free and draft heads run the host round's engine)")
        return gaps
    if not distributed and draft.device != target.device:
        gaps.append("its two threads run on one device (the draft on another device runs the host round's engine)")
    hosted = on_host(draft, target, vocabularies)
    if hosted is not None:
        gaps.append(f"its draft grows on the device (a draft proposing from the host, {hosted}, runs the host "
                    "round's engine)")
    if request.batch_size != 1 or request.attention_mask is not None and not bool(request.attention_mask.all()):
        gaps.append("it decodes one sequence without padding")
    if not all(s.path_free for s in request.samplers):
        gaps.append("its logits processors read the path")
    for role, architecture in zip(("target", "draft"), architectures):
        if architecture is not None and (architecture.shape == "chain" or architecture.slot_limits):
            gaps.append(f"the {role}'s steps are trees (no chains, no rules by cache slot)")
    for role, model in (("target", target), ("draft", draft)):
        if model is not None and model.config._attn_implementation not in ("sdpa", "eager"):
            gaps.append(f"the {role} attends with sdpa or eager (it takes the trees' additive masks)")
    return gaps


@dataclass
class DraftSuffix:
    """The draft side's suffix proposals: the row's suffix index (on the host, extended by every verdict's tokens),
    how a proposal is built and copied in (SuffixProposals: S = the budget less the root), and the policy whose
    calibration prices its nodes (the pair's, read by the draft's thread alone)."""

    proposals: SuffixProposals
    index: object  # drafters/suffix.SuffixIndex
    policy: object  # policy/goodput.GoodputPolicy

    @classmethod
    def of(cls, request: DecodeRequest, config, budget: int, limit: int | None) -> "DraftSuffix | None":
        """The call's (None: ngram_size 0, or a budget with no room beside the root)."""
        if not config.ngram_size or budget < 2:
            return None
        proposals = SuffixProposals(config.ngram_size, budget - 1, limit, request.prompt.device)
        return cls(proposals, proposals.index_for(request, request.prompt[0].tolist()), request.policy)

    def offer(self) -> Offer | None:
        """This round's proposal below the root (the index's last token), priced; None where nothing matches."""
        tree = self.proposals.propose(self.index)
        return Offer.of(tree, self.policy) if tree.tokens else None


class DraftSide:
    """The draft's thread: its slot cache, its tree across rounds, its suffix proposals and its counters."""

    def __init__(self, model, prompt: torch.Tensor, shape: AsyncShape, capacity: int, vocab_limit: int,
                 architecture=None, limit: int | None = None, new_tokens: int | None = None,
                 suffix: DraftSuffix | None = None):
        self.model, self.shape, self.capacity, self.vocab_limit = model, shape, capacity, vocab_limit
        self.suffix = suffix
        self.sent_size: torch.Tensor | None = None  # (1,) the tree's size when a subtree with suffix nodes went out
        self.sent_chosen = False  # the plain round's subtree was the suffix proposal's alone (chosen_subtree)
        self.left_tree = False  # the last verdict's path went through a suffix node the draft never grew
        self.suffix_by_round: list[int] = []  # tokens each verification accepted from suffix nodes alone
        self.limit = limit  # the most positions both models place a token at (None: no limit)
        self.new_tokens = new_tokens  # the call's max_new_tokens (its last rounds' trees are cut short)
        self.cache = SlotCache(model.config.get_text_config().num_hidden_layers, capacity, architecture)
        L = prompt.shape[1]
        prefix = torch.full((1,), L - 1, dtype=torch.long, device=prompt.device)
        self.tree = DraftTree.rooted(prompt[:, -1], prefix, shape.nodes)
        self.prefix = L - 1  # host-known: the prefix moves by the verdict's count
        self.counters = DraftCounters()
        self.pending = None  # a re-root whose KV has not moved yet (device_expansion.Rerooted), or None
        self.in_flight_by_round: list[int] = []  # expansions run while each round's subtree was verified
        # (1, k) committed tokens the draft has not run (the last slots), in order: the prompt first (a call whose
        # rounds are all plain never prefills the draft)
        self.behind: list[torch.Tensor] = [prompt[:, :-1]] if L > 1 else []
        self.plain_root: torch.Tensor | None = None  # (1,) in plain rounds, the root (the tree is not kept meanwhile)
        self.root_ran = False  # whether the draft ran plain_root (the tree's root when the plain rounds began)
        self.expand_s: float | None = None  # an expansion's time, a moving average
        self.verify_s: float | None = None  # the target's verification time, from its verdicts

    def in_flight(self) -> int:
        """Expansions to run while a subtree is verified: as many as end before its verdict is due (SwiftSpec's
        d = t_target / t_draft, measured), at most the shape's; every one allowed until both were timed. An
        expansion still running when the verdict comes delays the next subtree; one not run costs nothing. At least
        one: the sent subtree's nodes, without whose children every re-root would start a new tree."""
        if self.expand_s is None or self.verify_s is None:
            return self.shape.expansions
        return max(1, min(self.shape.expansions, int(self.verify_s / self.expand_s)))

    def set_span(self) -> None:
        self.cache.span = min(self.prefix + self.shape.nodes + 1, self.capacity)

    def expand(self, sent: DeviceSubtree | None = None) -> None:
        """One expansion: the best leaves, or the nodes of the subtree just sent that the draft has not run."""
        self.settle()
        self.run_behind()
        start = time.perf_counter()
        self.set_span()
        # no node past the models' context: a leaf grows only where its children's positions fit
        room = None if self.limit is None else self.limit - 1 - self.tree.prefix_lens
        if sent is None:
            leaves = best_leaves(self.tree, self.shape.width, room)
        else:  # (its suffix nodes the draft never grew, ids past the size it had, are not the tree's)
            ids, valid = self.own_nodes(sent)
            leaves = unexpanded(self.tree, ids, valid, room)
        self.tree = expand(self.model, self.cache, self.tree, self.shape.width, self.shape.children, self.vocab_limit,
                           leaves)
        self.counters.forwards += 1
        self.counters.expansions += 1
        took = time.perf_counter() - start
        self.expand_s = took if self.expand_s is None else 0.8 * self.expand_s + 0.2 * took

    def top_up(self, offer: Offer | None = None) -> None:
        """Before a subtree goes out, a tree of fewer than a budget's nodes (a fresh one, or a small kept subtree) is
        expanded once (SwiftSpec tops the tree up to the budget): the target waits for that expansion, and verifies a
        tree instead of a few nodes (on agreeing_pair with a 3-layer draft, fewer rounds by more than the wait). The
        round's suffix proposal counts towards the budget: a fresh tree after a path through suffix nodes (restart)
        goes out with the proposal rather than keeping the target waiting for a catch-up and an expansion."""
        offered = len(offer.tree.tokens) if offer is not None else 0
        if int(self.tree.tree.size[0]) + offered < self.shape.budget:
            self.expand()

    def offer(self) -> Offer | None:
        """This round's suffix proposal below the root (None: no suffix proposals, or nothing matches)."""
        return self.suffix.offer() if self.suffix is not None else None

    def subtree(self, mode: str = TREE, offer: Offer | None = None) -> DeviceSubtree:
        """The best budget nodes of the tree and this round's suffix proposal `offer` merged (a tree round), or the
        root with the proposal's best nodes alone (a plain round: the root alone, the target's plain step, where
        none)."""
        self.sent_size, self.sent_chosen = None, False
        if mode == PLAIN:
            if offer is None:
                return plain_subtree(self.plain_root)
            self.sent_chosen = True
            budget = min(self.shape.budget, 1 + len(offer.tree.tokens))
            return chosen_subtree(self.suffix.proposals.pack_chosen([offer], budget), self.plain_root)
        if offer is None:
            return select_device(self.tree.tree, self.shape.budget)
        self.sent_size = self.tree.tree.size.clone()
        merged = merge_suffix(self.tree.tree, self.suffix.proposals.pack([offer]))
        return select_device(merged, self.shape.budget)

    def own_nodes(self, sent: DeviceSubtree) -> tuple[torch.Tensor, torch.Tensor]:
        """(node ids, valid) of the sent subtree's nodes that are the draft tree's: a suffix node it never grew has an
        id past the tree's size at the send (made valid False, its id a real node's)."""
        if self.sent_size is None:
            return sent.node_ids, sent.valid
        own = sent.node_ids < self.sent_size[:, None]
        return torch.where(own, sent.node_ids, 0), sent.valid & own

    def learn(self, verdict: Verdict, steps: int = 1) -> None:
        """The suffix index takes the round's tokens (the committed path and the next root); the round's tokens from
        suffix nodes alone are counted (a tree round's: its path's nodes past the tree's size at the send, one read;
        a plain round's: its path past the root), and whether its path left the draft's tree (follow restarts it)."""
        if self.suffix is not None:
            self.suffix.index.extend(list(verdict.tokens))
        suffix_only = 0
        if self.sent_size is not None:
            suffix_only = int((verdict.path[:, 1 : verdict.count] >= self.sent_size[:, None]).sum())
        elif self.sent_chosen:
            suffix_only = verdict.count - 1
        self.left_tree = self.sent_size is not None and suffix_only > 0
        self.suffix_by_round += [suffix_only] + [0] * (steps - 1)  # (one a verification)

    def go_plain(self) -> None:
        """Plain rounds begin: the tree's root is their first root, and the tree is not kept while they last (their
        verdicts move host counts alone: follow_plain)."""
        self.settle()
        self.plain_root = self.tree.tree.tokens[:, 0]
        self.root_ran = bool(self.tree.expanded[0, 0])

    def follow_plain(self, verdict: Verdict) -> None:
        """A plain round's verdict (its path: the root, and the suffix nodes it sent that were accepted): the path is
        committed (run later, with the others behind), the target's next token the next root."""
        if not self.root_ran:
            self.behind.append(self.plain_root[:, None])
        if verdict.count > 1:  # a path past the root, or a run of steps: each one's token but the last
            self.behind.append(to_device([verdict.tokens[: verdict.count - 1]], self.plain_root.device))
        self.root_ran = False
        self.plain_root = verdict.token
        self.prefix += verdict.count

    def leave_plain(self) -> None:
        """Tree rounds again: a fresh tree at the plain rounds' root (their tokens run before its first expansion)."""
        if self.plain_root is None:
            return
        prefix = torch.full((1,), self.prefix, dtype=torch.long, device=self.plain_root.device)
        self.tree = DraftTree.rooted(self.plain_root, prefix, self.shape.nodes)
        self.plain_root = None

    def follow(self, verdict: Verdict) -> None:
        """Re-root the tree on the verdict (its KV moves in settle, after the next subtree went out); a path through a
        suffix node the draft never grew starts a fresh tree (restart)."""
        if self.left_tree:
            self.restart(verdict)
            return
        count = torch.full((1,), verdict.count, dtype=torch.long, device=verdict.path.device)  # (made there)
        token = verdict.token
        missing = bool(unrun(self.tree, verdict.path, count)[0])
        last = self.tree.tree.tokens.gather(1, verdict.path[:, verdict.count - 1 : verdict.count])  # (1, 1)
        self.pending = reroot_tree(self.tree, verdict.path, count, token)
        self.tree = self.pending.draft
        if missing:  # (run before the next expansion: plain rounds run none, so their roots wait for it together)
            self.behind.append(last)
        self.prefix += verdict.count
        hit = bool(self.pending.found[0])
        self.counters.reroot_hits += hit
        self.counters.reroot_misses += not hit

    def restart(self, verdict: Verdict) -> None:
        """The verified path left the draft's tree (a suffix node it never grew): followed as a plain round's (its root,
        unless the draft ran it, and the path past it, whose draft nodes' KV sits in the tree region, run before the
        next expansion), then a fresh tree at the target's next token."""
        self.go_plain()
        self.follow_plain(verdict)
        self.leave_plain()
        self.counters.reroot_misses += 1

    def settle(self) -> None:
        """The last re-root's KV moves (off the target's path: the subtree has gone)."""
        if self.pending is None:
            return
        self.cache.span = min(self.prefix - int(self.pending.count[0]) + self.shape.nodes + 1, self.capacity)
        self.tree = reroot_kv(self.cache, self.pending)
        self.pending = None

    def run_behind(self) -> None:
        """Where verified paths ended at nodes the draft never ran (a leaf of a tree round, every plain round's root),
        those tokens, the last committed ones, run at their slots in one forward, before anything below them runs."""
        if not self.behind:
            return
        tokens = torch.cat(self.behind, dim=1)  # (1, k)
        k = tokens.shape[1]
        self.cache.span = min(self.prefix + 2, self.capacity)
        catch_up(self.model, self.cache, tokens, torch.full((1,), k, dtype=torch.long, device=tokens.device),
                 starts=self.tree.prefix_lens - k)
        self.counters.forwards += 1
        self.behind = []


class TargetSide:
    """The target's side (the calling thread): its slot cache, the row's state and its counters."""

    def __init__(self, model, request: DecodeRequest, capacity: int, architecture=None):
        self.model, self.request, self.capacity = model, request, capacity
        prompt = request.prompt
        L = prompt.shape[1]
        self.cache = SlotCache(model.config.get_text_config().num_hidden_layers, capacity, architecture)
        self.cache.span = min(L + 1, capacity)
        self.prefix = torch.full((1,), L - 1, dtype=torch.long, device=prompt.device)
        catch_up(model, self.cache, prompt[:, :-1], self.prefix)
        self.length = L - 1  # host-known committed slots
        self.sampler = request.samplers[0]
        self.sequence = (request.contexts[0] if request.contexts else prompt).tolist()[0]
        self.counters = TargetCounters(forwards=1)
        self.records: list[RoundRecord] = []  # one a round (its expansions: the draft's, filled in at the end)

    def verify(self, sub: DeviceSubtree, rows: BatchRows) -> tuple[Verified, Verdict]:
        """One verification: the forward, the target's choices, the walk, the commit, one read."""
        T = sub.tokens.shape[1]
        rule = rows.criteria()[0]
        budget = rule.budget(rows.budgets()[0], len(self.sequence))
        self.cache.span = min(self.length + T + 1, self.capacity)
        logits = verify_forward(self.model, self.cache, self.prefix, sub)  # (1, T, V)
        scores = processed(logits, (tuple(self.sampler.logits_processor),))
        # the round's one copy in: [budget, seed, row, position, EOS ids...]
        seed = self.sampler.draw_seed() if self.sampler.do_sample else 0
        live = to_device([budget, seed, self.sampler.row, len(self.sequence), *sorted(rule.eos)], logits.device)
        if self.sampler.do_sample:
            # (the noise of generate()'s position for each depth: the sequence's length, contexts' padding included)
            positions = live[3] + torch.arange(T, device=logits.device)[None]
            noise = gumbel_noise(live[1:2], live[2:3], positions, scores.shape[-1])
            choices = sampled_choices(scores, noise, sub.depths)
        else:
            choices = greedy_choices(scores)
        walk = walk_subtree(choices, sub, live[0:1], live[None, 4:] if rule.eos else None)
        commit_cache(self.cache, self.prefix, walk.path.clamp(min=0), walk.count)
        read = torch.cat([walk.count[:, None], walk.finished.long()[:, None], walk.tokens, walk.path,
                          sub.valid.long().sum(1, keepdim=True)], dim=1)[0].tolist()  # the round's one read
        count, finished = read[0], bool(read[1])
        tokens, path = read[2 : 2 + count], read[2 + T : 2 + T + count]
        self.records.append(RoundRecord(budget=read[-1], expansions=0, accepted=max(count - 1, 0), ngram_accepted=0))
        self.prefix += count
        self.length += count
        outcome = Verified(tokens, path, finished=finished)
        if rows.keeps_scores or rule.others:
            outcome.scores = [scores[0, j : j + 1].clone() for j in path]  # (a view would keep all T rows)
        if rows.keeps_logits:
            outcome.logits = [logits[0, j : j + 1].clone() for j in path]
        cut = cut_at_criteria(outcome.tokens, self.sequence, rule, outcome.scores or None)
        if cut:
            keep = len(tokens) - cut
            del outcome.tokens[keep:], outcome.path[keep:], outcome.scores[keep:], outcome.logits[keep:]
        if cut is not None:
            outcome.finished = True
        if not rows.keeps_scores:
            outcome.scores = []
        self.sequence += outcome.tokens
        ids = sub.node_ids.gather(1, walk.path.clamp(min=0))  # (1, T) the path's draft tree ids, on the device
        token = walk.tokens.gather(1, (walk.count - 1).clamp(min=0)[:, None])[:, 0]
        self.counters.forwards += 1
        self.counters.verify_steps += 1
        return outcome, Verdict(ids, count, token, outcome.finished, tokens=tuple(outcome.tokens))


def drafting_choice(request: DecodeRequest, config) -> DraftingChoice | None:
    """The pair's DraftingChoice (kept on its policy across calls), or None where every round drafts: a draft_depth the
    user set (their choice, as the host round's engine takes it)."""
    return None if config.draft_depth is not None else request.policy.drafting


def run_draft(side: DraftSide, link: ThreadLink, choice: DraftingChoice | None = None) -> None:
    """The draft's loop (module docstring); returns when a verdict says the sequence is done. choice: the pair's
    DraftingChoice (policy/choice.py), which decides each round whether the draft's tree goes out or the root alone
    (a plain round: no top-up, no growth while it is verified, no re-root: the draft keeps the tokens to run when trees
    come back), by the tokens per second each mode's rounds made on the target's side (None: every round a tree)."""
    counters = side.counters
    next_mode = choice.next_mode if choice is not None else lambda: TREE
    mode, previous, emitted = next_mode(), None, 0
    if mode == PLAIN:
        side.go_plain()
    start = time.perf_counter()
    while True:
        selecting = time.perf_counter()
        offer = side.offer()
        if mode == TREE:
            side.leave_plain()
            side.top_up(offer)
            took = time.perf_counter() - selecting
            if previous is None:
                counters.start_s += took  # the prompt and the first tree, while the target prefills
            else:
                counters.reroot_s += took
            selecting = time.perf_counter()
        sub = side.subtree(mode, offer)
        # (a run of plain steps sends no message between them: with suffix proposals each plain round sends its own)
        run = choice is not None and mode == PLAIN and side.suffix is None
        steps = choice.plain_steps(link.timeout_s) if run else 1
        link.send_subtree(Sent(sub, steps))
        counters.rounds += 1
        counters.select_s += time.perf_counter() - selecting
        settling = time.perf_counter()
        side.settle()
        counters.reroot_s += time.perf_counter() - settling
        growing = time.perf_counter()
        ran = 0
        allowed = side.in_flight() if mode == TREE else 0
        while ran < allowed and not link.verdict_ready():
            side.expand(sub if ran == 0 else None)
            ran += 1
        counters.in_flight_expansions += ran
        side.in_flight_by_round += [ran] + [0] * (steps - 1)  # (one a verification)
        counters.grown_rounds += ran > 0
        counters.grow_s += time.perf_counter() - growing
        waiting = time.perf_counter()
        verdict = link.receive_verdict()
        counters.wait_s += time.perf_counter() - waiting
        side.learn(verdict, steps)
        if verdict.finished:
            return
        rerooting = time.perf_counter()
        if mode == TREE:
            side.verify_s = verdict.verify_s if side.verify_s is None else 0.8 * side.verify_s + 0.2 * verdict.verify_s
        # the round as the target saw it: its wait for the subtree and its verification; the first of a call (the
        # target's prefill) and the first after a switch (the catch-up it pays for) are not timed
        if choice is not None:  # (nor one whose tree the call's last tokens cut short: it says nothing of the text)
            cut = side.new_tokens is not None and side.new_tokens - emitted < side.shape.budget
            choice.observe(mode, len(verdict.tokens), verdict.wait_s + verdict.verify_s,
                           switched=previous is None or previous != mode or cut, rounds=steps)
        emitted += len(verdict.tokens)
        previous, mode = mode, next_mode()
        if previous == PLAIN:
            side.follow_plain(verdict)
        else:
            side.follow(verdict)
            if mode == PLAIN:
                side.go_plain()
        now = time.perf_counter()
        counters.reroot_s += now - rerooting
        counters.busy_s = now - start - counters.wait_s


def run_target(side: TargetSide, link: ThreadLink, rows: BatchRows, on_tokens) -> None:
    """The target's loop: receive what the draft sent, verify it (a run of plain steps: each from the last one's token,
    no message between), send the verdict, emit the tokens; returns when the row is done."""
    while rows.live:
        waiting = time.perf_counter()
        sent = link.receive_subtree()
        waited = time.perf_counter() - waiting
        side.counters.idle_s += waited
        if side.counters.verify_steps == 0:
            side.counters.first_wait_s = time.perf_counter() - waiting
        busy = time.perf_counter()
        sub, count, tokens = sent.subtree, 0, []
        for step in range(sent.steps):
            outcome, verdict = side.verify(sub, rows)
            keep = rows.record([outcome], on_tokens)
            done = not keep or verdict.finished
            count, tokens = count + verdict.count, tokens + list(verdict.tokens)
            if done:
                break
            rows.keep(keep)
            if step + 1 < sent.steps:
                sub = plain_subtree(verdict.token)
        took = time.perf_counter() - busy
        link.send_verdict(dataclasses.replace(verdict, count=count, tokens=tuple(tokens), finished=done,
                                              verify_s=took, wait_s=waited))
        side.counters.busy_s += took
        if done:
            return


def call_sides(target, draft, request: DecodeRequest, config, architectures, role: str | None = None):
    """This call's shape and sides: (shape, the draft's DraftSide or None, the target's TargetSide or None); role: the
    one side a torchrun rank holds (None: both, two threads build theirs in their own threads: see run_device_async)."""
    shape = AsyncShape.of(config)
    capacity = request.prompt.shape[1] + request.max_new_tokens + shape.nodes + 2
    limit = context_limit(target, draft)
    draft_side = None if role == "target" else lambda: DraftSide(
        draft, request.prompt, shape, capacity, target.config.get_text_config().vocab_size, architectures[1],
        limit, request.max_new_tokens, DraftSuffix.of(request, config, shape.budget, limit))
    target_side = None if role == "draft" else lambda: TargetSide(target, request, capacity, architectures[0])
    return shape, draft_side, target_side


def call_stats(engine: str, result: DecodeResult, seconds: float, target: TargetSide | None, draft: DraftCounters,
               ran: list[int], message_bytes: int, choice: DraftingChoice | None,
               suffix: list[int] = ()) -> SwiftSpecStats:
    """The call's stats: both sides' counters, a record a verification with the draft's expansions in flight then
    and the tokens it accepted from suffix nodes alone (ran, suffix: one a verification), and the drafting choice's
    rates (what its engine_choice says)."""
    stats = SwiftSpecStats.collect(engine, result.new_tokens, seconds, target.counters if target else TargetCounters(),
                                   draft, message_bytes=message_bytes)
    stats.engine_choice = f"{engine}: {choice.describe()}" if choice is not None else None
    if target is not None:
        stats.add_rounds([dataclasses.replace(r, expansions=ran[i] if i < len(ran) else 0,
                                              ngram_accepted=suffix[i] if i < len(suffix) else 0)
                          for i, r in enumerate(target.records)])
    return stats


def run_device_async(target, draft, request: DecodeRequest, config, architectures=(None, None)) -> DecodeResult:
    """One sequence through the asynchronous round: the target in the calling thread, the draft in a worker thread.
    architectures: the models' (probes.describe): their window rules, terms of their caches' masks."""
    _, draft_side, target_side = call_sides(target, draft, request, config, architectures)
    rows = BatchRows.start(request)
    timeout_s = config.worker_timeout_s
    link = ThreadLink(timeout_s)
    choice = drafting_choice(request, config)
    start = time.perf_counter()
    sides: dict = {}  # each side as its thread built it

    def draft_work() -> None:
        sides["draft"] = draft_side()
        run_draft(sides["draft"], link, choice)

    def target_work() -> None:
        sides["target"] = target_side()
        if request.max_new_tokens:
            run_target(sides["target"], link, rows, request.on_tokens)

    run_two_threads(link, draft_work, target_work, timeout_s)
    result = rows.result
    drafted = sides.get("draft")
    result.stats = call_stats(ENGINE, result, time.perf_counter() - start, sides["target"],
                              drafted.counters if drafted else DraftCounters(),
                              drafted.in_flight_by_round if drafted else [], 0, choice,
                              drafted.suffix_by_round if drafted else [])
    return result
