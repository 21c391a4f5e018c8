"""A draft head's part of the device round (an EAGLE-3 head, eagle3.py, or an MTP layer, mtp.py): its growth, its
prefill and its catch-up on the verified chain as fixed-shape device ops (engine/device_sides.py calls DeviceHead).

A head reads, beside each token, a hidden input (heads.py's HeadDrafter, the host round's twin): for a committed
token and the round's root, the target's states at the token before it, fused by the head (`head.fuse`); below
the root, the head's own output at the node's parent. Its positions are the target's minus one (token j of a row
runs at position j - 1; token 0 never runs), as it was trained. Its SlotCache holds token j at slot j, the target's
layout, so a round's tree region starts at the same prefix length as the target's: slot 0 stays unwritten and
unseen (every mask here leaves it out), and the committed slots a query sees are [1, prefix_len).

Per round, for B rows:
  grow:          depth d x width k below each root, d head forwards (the root with the target's fused state before
                 it, `root_inputs`; each frontier node with its parent's output, kept in a (B, N, H) tensor);
                 children over the head's draft vocabulary, mapped to target ids;
  after_verify:  the target's states at the walked path (its tap's, taken after the verification forward), and the
                 head's catch-up over the accepted chain (the root and the walked tokens, each with the target's fused
                 state at the token before it) written over the tree's slots, which are dropped: the head's committed
                 KV always comes from the target's states (EAGLE's re-drafting). The next root's input is the fused
                 state at the last walked node.
No host read anywhere: the growth is captured as one graph and the catch-up rides in the verification's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..steps.acceptance import Walk
from ..steps.device_round import DeviceSubtree
from ..steps.slot_cache import SlotCache, additive_mask, tree_visible
from .device_growth import AfterLevel, Growth, add_level, cut_tree, seed_tree
from .eagle3 import DraftHead


def head_gaps(head: DraftHead, masks: tuple[str, ...]) -> list[str]:
    """Why the device round cannot run `head` exactly (empty: it can). masks: the attention implementations that take
    its additive 4D masks as given. An EAGLE-3 head attends with its own SDPA over them; an MTP layer with its
    model's attention implementation."""
    mtp = getattr(head, "mtp", None)
    attention = getattr(getattr(mtp, "config", None), "_attn_implementation", None)
    if attention is not None and attention not in masks:
        return [f"the draft's MTP layer attends with {attention!r}, which does not take an additive 4D mask; "
                "call mtp.set_attn_implementation('sdpa') on its MtpModel"]
    return []


def head_forward(head: DraftHead, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor,
                 inputs: torch.Tensor, slots: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One head forward: tokens (B, Q) at positions (B, Q) with hidden inputs (B, Q, H), their KV written at slots
    (B, Q), each query seeing the slots allowed (B, Q, C) says. Returns float32 logits (B, Q, V_draft) and the hidden
    outputs (B, Q, H) its children read."""
    cache.index = slots
    out = head(input_ids=tokens, position_ids=positions, hidden_inputs=inputs,
               attention_mask=additive_mask(allowed, head.dtype), past_key_values=cache)
    return out.logits.float(), out.hidden


def without_slot_zero(allowed: torch.Tensor, prefix_lens: torch.Tensor) -> torch.Tensor:
    """allowed (B, Q, C) less slot 0 where it is a committed slot (prefix_len > 0): token 0 never runs through the
    head, so its slot holds nothing. (A one-token prompt's first root sits there, a tree node, and is seen.)"""
    return torch.cat([allowed[:, :, :1] & (prefix_lens == 0)[:, None, None], allowed[:, :, 1:]], dim=2)


def head_catch_up(head: DraftHead, cache: SlotCache, tokens: torch.Tensor, inputs: torch.Tensor,
                  counts: torch.Tensor, starts: torch.Tensor, first: torch.Tensor | None = None) -> None:
    """Write each row's tokens' head KV behind its committed slots, one fixed-shape forward.

    tokens (B, L) long, inputs (B, L, H) their hidden inputs (the target's fused states at the token before each),
    counts (B,) long tokens per row, starts (B,) long the slot of each row's token 0: token j goes at slot
    starts + j, position starts + j - 1 (the head's shift), seeing the committed slots [1, starts) and the tokens
    before it; first (B,) long: a row's tokens before it do not run (a prompt's token 0 never runs through the head).
    Padding queries write the scratch slot and see slot 0 alone (their output is never read)."""
    B, L = tokens.shape
    j = torch.arange(L, device=tokens.device)
    real = j[None] < counts[:, None]  # (B, L)
    if first is not None:
        real = real & (j[None] >= first[:, None])
    at = starts[:, None] + j[None]  # (B, L)
    c = torch.arange(cache.span, device=tokens.device)[None, None]
    seen = (c <= at[:, :, None]) & ((c >= 1) | (c == at[:, :, None]))  # (B, L, span): from slot 1, and itself
    allowed = (seen & real[:, :, None]) | (~real[:, :, None] & (c == 0))
    head_forward(head, cache, tokens, (at - 1).clamp(min=0), inputs, torch.where(real, at, cache.scratch), allowed)


def grow_head(head: DraftHead, cache: SlotCache, prefix_lens: torch.Tensor, roots: torch.Tensor,
              root_inputs: torch.Tensor, depth: int, width: int, vocab_limit: int | None = None,
              after_level: AfterLevel | None = None) -> Growth:
    """Grow every row's tree up to `depth` levels of `width` nodes below its root, one head forward a level
    (device_growth.grow's tree, node for node: the root 0, depth l's nodes 1 + (l - 1) * width ... l * width;
    after_level as there).

    cache: the head's SlotCache, slots [1, prefix_lens[b]) holding row b's committed tokens (head_catch_up)
    prefix_lens: (B,) long tokens the target committed per row; the root sits at slot prefix_lens[b]
    roots: (B,) long each row's root token
    root_inputs: (B, H) the target's fused state at the token before each root (zeros for a prompt's only token)
    vocab_limit: children are target ids below it (those the target can embed)
    """
    tree = seed_tree(cache, roots, depth, width, "grow_head")
    if after_level is not None:
        after_level(tree, 0)
    B, N = tree.tokens.shape
    device = roots.device
    hidden = root_inputs.new_zeros(B, N, root_inputs.shape[-1])  # (B, N, H) each node's input, then its children's
    hidden[:, 0] = root_inputs
    outputs = torch.zeros_like(hidden)  # (B, N, H) the head's output at each node it ran
    node_slots = prefix_lens[:, None] + torch.arange(N, device=device)[None]  # (B, N)
    token_map = ruled_out = None
    frontier = torch.zeros(B, 1, dtype=torch.long, device=device)  # node ids (B, F), the root first
    for level in range(1, depth + 1):
        F = frontier.shape[1]
        seen = tree.ancestors.gather(1, frontier[:, :, None].expand(B, F, N))  # (B, F, N)
        allowed = without_slot_zero(tree_visible(cache.span, prefix_lens, seen), prefix_lens)
        inputs = hidden.gather(1, frontier[:, :, None].expand(B, F, hidden.shape[-1]))
        positions = (prefix_lens[:, None] + level - 2).clamp(min=0)  # depth level - 1, at the head's shift
        logits, out = head_forward(head, cache, tree.tokens.gather(1, frontier), positions, inputs,
                                   node_slots.gather(1, frontier), allowed)
        outputs.scatter_(1, frontier[:, :, None].expand_as(out), out)
        logprobs = torch.log_softmax(logits, dim=-1)  # (B, F, V_draft): the host's top_children over the draft vocab
        if token_map is None:  # (V_draft,) each draft id's target id, once a growth
            token_map = target_ids(head, logprobs.shape[-1], device)
            ruled_out = token_map >= (vocab_limit if vocab_limit is not None else 1 << 62)
        cumulative = (tree.scores.gather(1, frontier)[:, :, None] + logprobs).masked_fill(ruled_out, float("-inf"))
        new, parent = add_level(tree, frontier, cumulative, level, width, token_map)
        hidden.scatter_(1, new[:, :, None].expand(B, width, hidden.shape[-1]),
                        outputs.gather(1, parent[:, :, None].expand(B, width, hidden.shape[-1])))  # its parent's output
        frontier = new
        if after_level is not None and not after_level(tree, level) and level < depth:
            return Growth(cut_tree(tree, level, width), prefix_lens)
    return Growth(tree, prefix_lens)


def target_ids(head: DraftHead, draft_vocab: int, device) -> torch.Tensor:
    """(V_draft,) the target id of every draft id."""
    return head.target_ids(torch.arange(draft_vocab, device=device))


@dataclass(frozen=True)
class DeviceHead:
    """A draft head on the device round (drafters/device_drafters.py's DeviceDrafter), fixed for a call: the head and
    the tap that hands it the target's states (entered around the target's forwards: `tapped`). Its per-row state is
    `root_inputs` (B, H), the fused target state before each row's root, in the rows' device state."""

    head: DraftHead
    tap: object  # eagle3.FeatureTap or mtp.FinalStateTap
    layers = 1
    architecture = None  # its own full-attention layer, whatever the target's windows (mtp.py refuses others)
    poolable = False  # its phases read the target's states through this call's tap
    context_model = None  # its rope places any position: the target's limit alone
    defers = False  # its catch-up reads the verification's target states: it runs inside the verification
    reads_target = True  # round 1 verifies the roots, whose target states it reads (the prefill leaves them out)

    @classmethod
    def of(cls, head: DraftHead, target) -> "DeviceHead":
        return cls(head, head.tap(target))

    @property
    def model(self) -> DraftHead:
        return self.head

    def state_fields(self, capacity: int) -> dict:
        return {"root_inputs": ((self.head.hidden_size,), self.head.dtype, 0)}

    def gaps(self, architecture, masks: tuple[str, ...]) -> list[str]:
        return head_gaps(self.head, masks)

    def describe(self) -> str:
        return "draft=sdpa (a draft head)"

    def tapped(self):
        """The tap's hooks on the target, for the target's forwards of one phase (the user's model keeps none between
        them)."""
        return self.tap

    def fused_states(self) -> torch.Tensor:
        """The target's last forward's states, fused: (B, Q, H)."""
        return self.head.fuse(self.tap.take())

    def prefill(self, cache: SlotCache, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                state: dict[str, torch.Tensor]) -> None:
        """After the target's forward over tokens (B, L) long (counts (B,) per row, token j of a row at slot starts + j:
        a whole prompt but its root, or one piece of it): the head's KV for them, each token with the target's fused
        state before it (the state carried in root_inputs for a piece's first token; a prompt's token 0 never runs),
        and root_inputs (B, H) set to the fused state at each row's last token (kept where a row had none)."""
        with torch.no_grad():
            fused = self.fused_states()  # (B, L, H)
            B, L, H = fused.shape
            root_inputs = state["root_inputs"]
            inputs = torch.cat([root_inputs[:, None].to(fused.dtype), fused[:, :-1]], dim=1)
            head_catch_up(self.head, cache, tokens, inputs, counts, starts, first=(starts == 0).long())
            last = (counts - 1).clamp(min=0)[:, None, None].expand(B, 1, H)
            root_inputs.copy_(torch.where((counts > 0)[:, None], fused.gather(1, last).squeeze(1), root_inputs))

    def grow(self, cache: SlotCache, rows, depth: int, width: int, vocab_limit: int, lag: int, after_level=None):
        return grow_head(self.head, cache, rows.prefix_lens, rows.roots, rows.drafter["root_inputs"], depth, width,
                         vocab_limit, after_level).tree

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int:
        """The head re-runs the walked chain every round: the root and at most `deepest` walked nodes."""
        return min(budget, max(depth, suffix_nodes) + 1)

    def after_verify(self, cache: SlotCache, rows, subtree: DeviceSubtree, walk: Walk,
                     facts) -> dict[str, torch.Tensor]:
        """The head's commit after the target verified `subtree` and walked it (its states still in the tap): the
        tree's KV dropped, the walked chain (the root and every accepted node, facts.lag of them at most) run as one
        catch-up with the target's fused states before each; root_inputs moves to the fused state at the last walked
        node (in place). Returns path_inputs (B, L, H), the fused state at each walked node (a host-side stop that
        cuts the walk takes its root input there: root_input_at)."""
        fused = self.fused_states()  # (B, T, H) at every verified node
        B, T, H = fused.shape
        L = facts.lag
        prefix_lens, root_inputs = rows.prefix_lens, rows.drafter["root_inputs"]
        path = walk.path[:, :L].clamp(min=0)  # (B, L)
        path_inputs = fused.gather(1, path[:, :, None].expand(B, L, H))  # (B, L, H)
        chain = subtree.tokens.gather(1, path)  # (B, L): the root, then the walked nodes
        inputs = torch.cat([root_inputs[:, None], path_inputs[:, :-1]], dim=1)  # each token: the state before it
        head_catch_up(self.head, cache, chain, inputs, walk.count, prefix_lens)
        root_inputs.copy_(root_input_at(path_inputs, walk.count, root_inputs))
        return dict(path_inputs=path_inputs)

    def cut(self, rows, after: dict[str, torch.Tensor], kept: torch.Tensor, cut: torch.Tensor) -> None:
        """Rows whose walk a host-side stop cut (cut (B,) long > 0) keep `kept` (B,) tokens: their root input is the
        fused state at the last node they kept."""
        root_inputs = rows.drafter["root_inputs"]
        root_inputs.copy_(torch.where((cut > 0)[:, None], root_input_at(after["path_inputs"], kept, root_inputs),
                                      root_inputs))


def root_input_at(path_inputs: torch.Tensor, count: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """(B, H) the fused state at walked node count - 1 (the token before the next root); a row that emitted nothing
    keeps its old one."""
    B, L, H = path_inputs.shape
    at = (count - 1).clamp(0, L - 1)[:, None, None].expand(B, 1, H)
    return torch.where((count > 0)[:, None], path_inputs.gather(1, at).squeeze(1), old)
