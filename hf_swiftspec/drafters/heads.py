"""The drafter of a draft head, which reads the target's hidden states: an EAGLE-3 head (eagle3.py) or a
model's own MTP layer (mtp.py), growing the same token tree as a draft model.

It is a DraftModelDrafter whose forward takes, beside each token, a hidden input: for a committed token
and the tree's root, the target's states at the token before it (fused by the head's fc), which the
target's verification forward hands over (`Verified.features`); below the root, the head's own output
at the node's parent. So the head's KV of committed tokens always comes from the target's states: on
the target's verdict the tree is dropped (its KV came from the head's own guesses) except the root,
whose KV did come from the target's, and the newly verified tokens run again, as one chain with the new
root in the first expansion of the next round (EAGLE's own re-drafting; a few tokens of a one-layer
head). Batches work as for a draft model; recurrent targets have no per-token states to hand over.
"""

from __future__ import annotations

import torch

from ..steps.capture import StepRunner
from .eagle3 import DraftHead
from ..steps.step import RowQueries, run_head_step
from ..steps.tree import Subtree, reset_tree, top_children
from ..steps.verify import Verified
from .draft_model import DraftModelDrafter

CHAIN_WITH_ROOT = 16  # pending tokens that run along with the root's expansion rather than as a catch-up


class HeadDrafter(DraftModelDrafter):
    """A draft head's token tree per row (see the module docstring).

    pending_inputs[b]: pieces of (len(pending[b]), H), the fused target states each pending token runs with,
                       joined only when they run (a row that never drafts would copy its whole backlog each round)
    root_input[b]:     (1, H) the same for the root
    node_hidden[b]:    (tree capacity, H) the head's output at every node it ran, read by its children
    """

    reads_features = True

    def __init__(self, model: DraftHead, capacity: int, tree_capacity: int, width: int, vocab_limit: int,
                 max_positions: int | None = None, batch_size: int = 1, runner: StepRunner | None = None):
        super().__init__(model, capacity, tree_capacity, width, vocab_limit, "sdpa", model.architecture, max_positions,
                         batch_size, runner)
        H = model.hidden_size
        self.pending_inputs: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]
        self.root_input = [torch.zeros(1, H, dtype=model.dtype, device=self.device) for _ in range(batch_size)]
        self.node_hidden = [torch.zeros(tree_capacity, H, dtype=model.dtype, device=self.device) for _ in range(batch_size)]
        self.last_hidden: list[torch.Tensor] = []

    def no_inputs(self) -> torch.Tensor:
        return torch.zeros(0, self.model.hidden_size, dtype=self.model.dtype, device=self.device)

    def joined_inputs(self, b: int) -> torch.Tensor:
        """Row b's pending inputs as one (len(pending[b]), H) tensor."""
        pieces = self.pending_inputs[b]
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0] if pieces else self.no_inputs()

    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None = None) -> None:
        """Begin a generation: per row the prompt (L token ids) and the target's states at each of its
        positions (L, 3 * H_t). Token j runs with the states of token j - 1, so the first token has no
        entry of its own (the head's positions are the target's minus one, as it was trained)."""
        if features is None:
            raise ValueError(
                "a draft head starts from the target's states at the prompt, which this engine did not hand over "
                "(every engine should: a bug in hf_swiftspec)"
            )
        with torch.no_grad():
            for b, (ids, states) in enumerate(zip(prompts, features)):
                fused = self.model.fuse(states)
                self.pending[b] = ids[1:-1]
                self.pending_inputs[b] = [fused[: len(ids) - 2]] if len(ids) > 1 else []
                self.root_input[b] = fused[-2:-1] if len(ids) > 1 else torch.zeros_like(self.root_input[b])
                self.committed[b] = list(ids)
                reset_tree(self.trees[b], ids[-1])

    @property
    def catch_up_tokens(self) -> int:
        """Tokens the head runs on their own before its next expansion: only long backlogs (a prompt);
        the few tokens a round verified run with the root's expansion."""
        return sum(len(p) for p in self.pending) if any(len(p) > CHAIN_WITH_ROOT for p in self.pending) else 0

    # ---- forwards ------------------------------------------------------------------------------
    def run(self, queries: list[RowQueries], logits: bool = True) -> list[torch.Tensor]:
        with torch.no_grad():
            out, self.last_hidden = run_head_step(self.model, self.cache, queries, self.architecture, logits, self.runner)
        return out

    def chain_queries(self, b: int) -> RowQueries:
        rows = super().chain_queries(b)
        rows.inputs = self.joined_inputs(b)
        return rows

    def catch_up(self) -> None:
        super().catch_up()
        self.pending_inputs = [[] for _ in self.pending_inputs]

    def expansion_queries(self, b: int, leaves: torch.Tensor) -> RowQueries:
        """The draft model's queries, with each query's hidden input: the pending tokens' and the root's
        target states when the tree is fresh, else each leaf's parent's output (the root's own input for the root)."""
        fresh = bool(self.pending[b])
        rows = super().expansion_queries(b, leaves)
        if fresh:
            rows.inputs = torch.cat([*self.pending_inputs[b], self.root_input[b]])
        else:
            parents = self.trees[b].parents[leaves]
            rows.inputs = torch.where(
                (parents < 0)[:, None], self.root_input[b], self.node_hidden[b][parents.clamp(min=0)]
            )
        return rows

    def ran_leaves(self, b: int, leaves: torch.Tensor, after: int) -> None:
        self.node_hidden[b][leaves] = self.last_hidden[b][after:]
        if after:
            self.pending_inputs[b] = []

    def children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Best children over the head's draft vocabulary, as target ids."""
        logprobs, draft_ids = top_children(logits, self.width, logits.shape[-1])
        return logprobs, self.model.target_ids(draft_ids)

    # ---- the verdict ---------------------------------------------------------------------------
    def reroot_row(self, b: int, subtree: Subtree, verified: Verified) -> tuple[list[int] | torch.Tensor | None, None, bool]:
        """Keep the root's KV (computed from the target's states) if it ran; every verified token becomes
        pending with the target's states of the token before it; the last one is the new root."""
        tree = self.trees[b]
        with torch.no_grad():
            fused = self.model.fuse(verified.features)  # (m, H): states of the root and the accepted nodes
        view = tree.view  # the host's (tree.py): nothing to read
        root_ran = tree.num_slots > 0 and (view.expanded[0] if view is not None else bool(tree.expanded[0]))
        if root_ran:
            path = [view.kv_slot[0]] if view is not None else tree.kv_slot[:1].clone()
            pending, inputs = [], []
        else:
            path, pending = None, self.pending[b] + [tree.root_token]
            inputs = [*self.pending_inputs[b], self.root_input[b]]
        self.pending[b] = pending + verified.tokens[:-1]
        self.pending_inputs[b] = inputs + [fused[:-1]]
        self.root_input[b] = fused[-1:]
        self.counters.reroot_misses += 1
        reset_tree(tree, verified.tokens[-1])
        return path, None, False

    def absorb(self, other: "HeadDrafter") -> None:
        super().absorb(other)
        self.pending_inputs += other.pending_inputs
        self.root_input += other.root_input
        self.node_hidden += other.node_hidden

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.pending_inputs = [self.pending_inputs[b] for b in rows]
        self.root_input = [self.root_input[b] for b in rows]
        self.node_hidden = [self.node_hidden[b] for b in rows]
