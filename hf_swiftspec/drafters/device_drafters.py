"""Every drafter of the device round (engine/device_sides.py) behind one interface, `DeviceDrafter`: a draft model
(here), an EAGLE-3 head or an MTP layer (device_heads.DeviceHead), or none (draft-free mode: `RootOnly`, the suffix
proposals alone). The sides hold one and never ask which it is; a new drafter on the device round is one class.

What a drafter does, each a fixed-shape device function (no host read: the round's phases are captured whole):

    prefill(cache, tokens, counts, starts, state)   after the target's forward over the same prompt tokens (a whole
                                                     prompt, or one piece of it): its cache, its row state
    grow(cache, rows, depth, width, limit, lag, after_level)
                                                     up to depth x width nodes below every root (depth >= 1), after
                                                     catching up on the `lag` committed tokens it has not run (a draft
                                                     model's); after_level(tree, level) -> False stops it between
                                                     levels (device_growth.grow)
    after_verify(cache, rows, sub, walk, facts)      its commit (and a head's catch-up) once the target walked the tree
    record(tokens, counts, starts, state)            (a drafter that defers its catch-up) prefill's bookkeeping alone:
                                                     the tokens wait for its first growth
    catch_up_width(T, depth, S)                      the fixed width of a catch-up inside the verification (a head's)

Its per-row state (a head's root input; a draft model's committed length and the tokens it catches up on) lives in
the rows' device state (`RowsOnDevice.drafter`), declared by `state_fields`, moved with the rows; `tapped()` is
entered around the target's forwards it reads. A drafter that `defers` its catch-up runs nothing in a plain round:
the host counts what it lags by (DeviceSides) and the next growth catches up first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch
from swiftspec_kernels.record_walk import record_walk

from ..steps.probes import describe
from ..steps.acceptance import Walk
from ..steps.device_round import DeviceSubtree, DeviceTree
from ..steps.slot_cache import SlotCache, catch_up, commit_cache
from .device_growth import grow
from .eagle3 import DraftHead


@dataclass(frozen=True)
class RoundFacts:
    """What a verification phase's drafter step knows of the round's shape (static: part of the phase's key).

    depth: the grown tree's depth (0: nothing grown); nodes: its N (node ids from N on are the suffix's own);
    lag: the catch-up's width (catch_up_width's); deepest: the deepest node the walk may reach (depth, or S)."""

    depth: int
    nodes: int
    lag: int
    deepest: int


class DeviceDrafter(Protocol):
    """What the device round's sides ask of a drafter (module docstring)."""

    model: object  # what its forwards run (a draft model or head); None: draft-free
    architecture: object  # its slot cache's window rules (models/architectures.Architecture); None: full attention
    context_model: object  # a model whose positions limit the call's (a draft model; a head's rope places any)
    layers: int  # its slot cache's layers (0: it keeps none)
    poolable: bool  # its phases may replay across generate() calls (nothing of one call's baked in)
    defers: bool  # its catch-up waits for its next growth (a plain round runs nothing of it)
    reads_target: bool  # it reads the target's states of each verified node: the roots' too (round 1 verifies them)
    # where it reads_target: `tap`, the target's states of its last forward (take(); hand(states) for the next take)

    def state_fields(self, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype, float]]:
        """Its per-row device state for slots of `capacity`: name -> (shape past the rows, dtype, a dead row's value)."""

    def gaps(self, architecture, masks: tuple[str, ...]) -> list[str]:
        """Why the device round cannot run it exactly (architecture: its probes.describe, None for a head or none)."""

    def describe(self) -> str:
        """How it attends, for the call's stats."""

    def tapped(self) -> contextlib.AbstractContextManager: ...

    def prefill(self, cache: SlotCache | None, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                state: dict[str, torch.Tensor]) -> None: ...

    def grow(self, cache: SlotCache | None, rows, depth: int, width: int, vocab_limit: int, lag: int,
             after_level=None) -> DeviceTree: ...

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int: ...

    def after_verify(self, cache: SlotCache | None, rows, sub: DeviceSubtree, walk: Walk,
                     facts: RoundFacts) -> dict[str, torch.Tensor]: ...

    def cut(self, rows, after: dict, kept: torch.Tensor, cut: torch.Tensor) -> None:
        """Rows whose walk a host-side stop cut (cut (B,) > 0, `kept` tokens kept) move back in its state too."""


def device_drafter(draft, target) -> DeviceDrafter:
    """The device round's drafter for `draft`: none (draft-free), a draft head, or a draft model."""
    if draft is None:
        return RootOnly()
    if isinstance(draft, DraftHead):
        from .device_heads import DeviceHead

        return DeviceHead.of(draft, target)
    return DraftModelOnDevice(draft, describe(draft, "draft"))


def model_gaps(role: str, model, architecture, masks: tuple[str, ...], slots: int | None = None) -> list[str]:
    """Why the device round's slot caches cannot run a model exactly (empty: they can). Windowed layers they can: a
    window is a term of their masks (steps/slot_cache.py). Models whose steps must be chains (positions by cache slot,
    recurrent states rolled back) and rules by slot past which chains are exact run the chain strategy
    (engine/device_chains.py). slots: the most slots any forward of the call holds (a row's prompt, its new tokens and
    the largest tree; such a model's forwards run eagerly, each over its live length, capture.capture_gap; a running
    batch's, its longest row's, each checked at its join), within which a rule that only one-token steps follow past
    its length (a key budget, an indexer's top-k) keeps every key: exact; None (not bounded): such a rule is refused. A
    draft's rules are never refused: what it keeps changes what it proposes, never which tokens the target accepts."""
    gaps = []
    for limit in architecture.slot_limits if role == "target" else ():
        if limit.beyond != "chain" and (slots is None or slots > limit.length):
            gaps.append(f"the {role} ({architecture.model_type}) has slot-limited layers: it {limit.reason}, and a "
                        "slot cache's forward holds a span of slots, not the row's")
    if model.config._attn_implementation not in masks:
        gaps.append(f"the {role} attends with {model.config._attn_implementation!r}, which does not take an additive "
                    f"4D mask; load it with attn_implementation='sdpa'")
    return gaps


class RootOnly:
    """Draft-free mode: no model, no cache, nothing grown (every shape is depth 0: the root and the suffix nodes)."""

    model = None
    architecture = None
    context_model = None
    layers = 0
    poolable = True
    defers = False
    reads_target = False

    def state_fields(self, capacity: int) -> dict:
        return {}

    def gaps(self, architecture, masks) -> list[str]:
        return []

    def describe(self) -> str:
        return "no draft model"

    def tapped(self):
        return contextlib.nullcontext()

    def prefill(self, cache, tokens, counts, starts, state) -> None:
        return None

    def grow(self, cache, rows, depth, width, vocab_limit, lag, after_level=None) -> DeviceTree:
        raise ValueError(f"a shape of depth {depth} needs a draft to grow it; draft-free mode grows nothing")

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int:
        return 0

    def after_verify(self, cache, rows, sub, walk, facts) -> dict:
        return {}

    def cut(self, rows, after, kept, cut) -> None:
        return None


@dataclass
class DraftModelOnDevice:
    """A draft model: grows the tree (device_growth.grow); after the walk its cache commits the walked nodes it ran,
    and the rest of the committed tokens (the walk's last-depth node, suffix nodes, a plain round's root) wait in
    `history` until its next growth catches up on them in one forward (`draft_lens` says how far it has run), so a
    plain round runs the target alone.

    state: draft_lens (B,) long its committed slots (<= the target's prefix_lens); history (B, C) long every committed
    token by slot (what the catch-up reads). architecture: the draft's (its slot cache's window rules)."""

    model: object
    architecture: object
    poolable = True
    defers = True
    reads_target = False

    @property
    def context_model(self):
        return self.model

    @property
    def layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def state_fields(self, capacity: int) -> dict:
        return {"draft_lens": ((), torch.long, 0), "history": ((capacity,), torch.long, 0)}

    def gaps(self, architecture, masks) -> list[str]:
        return model_gaps("draft", self.model, architecture, masks) if architecture is not None else []

    def describe(self) -> str:
        return f"draft={self.model.config._attn_implementation}"

    def tapped(self):
        return contextlib.nullcontext()

    def prefill(self, cache, tokens, counts, starts, state) -> None:
        catch_up(self.model, cache, tokens, counts, starts)
        self.record(tokens, counts, starts, state)
        state["draft_lens"].copy_(starts + counts)

    def record(self, tokens, counts, starts, state) -> None:
        """The tokens recorded for a later catch-up, not run (prefill's record alone: draft_lens stays)."""
        record(state["history"], tokens, counts, starts)

    def grow(self, cache, rows, depth, width, vocab_limit, lag, after_level=None) -> DeviceTree:
        """Catch up on the `lag` (a width: every row's lag fits it) committed tokens not run yet, then grow."""
        draft_lens, history = rows.drafter["draft_lens"], rows.drafter["history"]
        if lag:
            at = (draft_lens[:, None] + torch.arange(lag, device=draft_lens.device)[None]).clamp(
                max=history.shape[1] - 1)
            catch_up(self.model, cache, history.gather(1, at), rows.prefix_lens - draft_lens, draft_lens)
            draft_lens.copy_(rows.prefix_lens)
        return grow(self.model, cache, rows.prefix_lens, rows.roots, depth, width, vocab_limit, after_level).tree

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int:
        return 0

    def after_verify(self, cache, rows, sub, walk, facts: RoundFacts) -> dict:
        """The walked nodes it ran (its own tree's, above the last depth: on the walk they come first) move behind the
        prefix; every walked token is recorded for the next catch-up. A plain round's walk ran none of its nodes."""
        prefix_lens = rows.prefix_lens
        ids, ran = record_walk(rows.drafter["history"], rows.drafter["draft_lens"], prefix_lens, walk.path, walk.count,
                               sub.node_ids, sub.tokens, facts.nodes, facts.depth)  # draft_lens: prefix_lens + ran
        if facts.depth:
            commit_cache(cache, prefix_lens, ids, ran)
        return {}

    def cut(self, rows, after, kept, cut) -> None:
        draft_lens = rows.drafter["draft_lens"]
        draft_lens.copy_(torch.minimum(draft_lens, rows.prefix_lens))  # its KV below the cut is the kept tokens'


def record(history: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor) -> None:
    """history (B, C) in place: each row's tokens (B, L) (counts (B,) of them) at slots starts + j; padding writes the
    last slot (never read: a catch-up reads below the prefix)."""
    j = torch.arange(tokens.shape[1], device=tokens.device)[None]
    slots = torch.where(j < counts[:, None], starts[:, None] + j, history.shape[1] - 1).clamp(max=history.shape[1] - 1)
    history.scatter_(1, slots, tokens)
