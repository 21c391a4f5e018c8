"""The target's worker: prefill, one tree forward per verification, commit.

TargetWorker owns the target model and its TreeCache; the draft model's drafter (drafters/draft_model.py)
owns the draft's. Both caches hold, per row, the same committed tokens: every verified token except the
current root, which is tree node 0 on both sides (the draft's cache may lag behind by its `pending`
tokens). Rows are independent sequences sharing each forward: `keep_rows` drops the rows that finished,
on both alike.

Recurrent and hybrid models (one row only: a batch of them decodes with transformers' own loop)
keep states that every token advances; each worker's `StateLog` (recurrent.py) saves them and
puts them back on the accepted path after every commit (`follow_accepted_path`).
"""
from __future__ import annotations

import contextlib
import time

import torch
from transformers import PreTrainedModel, StoppingCriteriaList

from ..drafters.eagle3 import DraftHead
from ..models.architectures import Architecture
from ..steps.attention import routed_attention
from ..steps.capture import StepRunner
from ..steps.probes import describe
from ..steps.recurrent import MAX_REPLAY, StateLog, new_cache
from ..stats import PhaseClock, TargetCounters
from ..steps.step import NO_LOGITS, RowQueries, model_step, run_step
from ..steps.tree import Subtree, subtree_mask
from ..steps.verify import Sampler, Verified, verify_rows, verify_tree


class TargetWorker:
    """Runs the target: prefill, then one tree forward + verification walks + commit per step.

    It owns, per row, the committed sequence (1, P + L) as processors see it: the row's left
    padding, then every verified token, ending with the current root.
    """

    def __init__(
        self, model: PreTrainedModel, capacity: int, attention: str = "sdpa", architecture: Architecture | None = None,
        batch_size: int = 1, runner: StepRunner | None = None,
    ):
        self.model = model
        self.attention = attention
        self.architecture = architecture or describe(model, "target")
        self.device = model.device
        self.runner = runner  # replayed forwards (capture.py), or None: every step eager
        self.cache = new_cache(self.architecture, capacity, batch_size, runner and runner.pool)
        self.states = StateLog(self.cache)  # recurrent states: saved before each verification (recurrent.py)
        self.replay: list[int] = []  # accepted tokens whose states were rolled back: run before the next nodes
        self.emitted: list[int] = []  # row 0's tokens since the prefill, host ints (what a replay re-runs, unread)
        self.attention_fallbacks: set[str] = set()  # why kernel-routed layers ran their own attention
        self.sequences: list[torch.Tensor] = []
        self.root_logits: list[torch.Tensor] | None = None  # per row (1, V): the prefill's, until the first verification
        self.counters = TargetCounters()
        self.clock = PhaseClock()  # times verify/walk/commit inside the serial round's (AdaptiveSides gives its own)
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
        self.emitted = []
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
        self.emitted = []
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
        with self.clock.phase("verify"):
            logits = self.forward_subtrees(subtrees)  # per row (T_b, V)
        ran = self.cache.length
        if walk is verify_tree:  # every row's choices in one read
            with self.clock.phase("walk"):
                verified = verify_rows(logits, subtrees, self.sequences, samplers, stopping_criteria, max_tokens)
        else:
            walk = self.clock.timed("walk", walk)
            verified = [None if subtree is None else walk(logits[b], subtree, self.sequences[b], samplers[b],
                                                          stopping_criteria[b], max_tokens[b])
                        for b, subtree in enumerate(subtrees)]
        for b, outcome in enumerate(verified):
            if outcome is None:
                continue
            if self.tap is not None:
                outcome.features = self.step_features[b][outcome.path]
            new = torch.tensor([outcome.tokens], dtype=self.sequences[b].dtype, device=self.device)
            self.sequences[b] = torch.cat([self.sequences[b], new], dim=1)
            if b == 0 and self.states.active:
                self.emitted += outcome.tokens
        if walked is not None:
            walked(verified)
        paths = [v.path if v else None for v in verified]
        if replayed and paths[0] is not None:
            paths[0] = list(range(replayed)) + [i + replayed for i in paths[0]]
        with self.clock.phase("commit"):  # with the wait for the device, which ends the target's side of the round
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
                              runner=self.runner, tap=self.tap)
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
        # the sequence ends with the new root; its tokens since the prefill are on the host (a replay reaching
        # into the prompt reads them)
        tail = self.emitted[-rerun - 1 : -1] if rerun < len(self.emitted) else self.sequence[0, -rerun - 1 : -1].tolist()
        self.replay = tail
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


def attend_the_tree(routes: contextlib.ExitStack, target, draft, target_worker: TargetWorker | None, drafters):
    """Until `routes` closes: each model attends the tree its way (steps/attention.py), and a draft head reads
    the target's hidden states (its tap, handed to the target's worker). target_worker / drafters: None where
    this rank holds none. Returns the tap (None without a draft head)."""
    for worker in (target_worker, drafters and drafters.model):
        if worker is not None and not isinstance(worker.model, DraftHead):
            routes.enter_context(routed_attention(worker.model, worker.attention))
    if not isinstance(draft, DraftHead) or target_worker is None:
        return None
    target_worker.tap = routes.enter_context(draft.tap(target))
    return target_worker.tap


def joined(mine: list | None, theirs: list | None, n_mine: int, n_theirs: int) -> list | None:
    """Per-row values of two batches, one after the other (None: no row has one)."""
    if mine is None and theirs is None:
        return None
    return (mine if mine is not None else [None] * n_mine) + (theirs if theirs is not None else [None] * n_theirs)


def device_sync(device: torch.device) -> None:
    """Wait for queued kernels so phase timings are real (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
