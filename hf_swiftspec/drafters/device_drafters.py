"""Every drafter of the device round (engine/device_sides.py) behind one interface, `DeviceDrafter`: a draft model
(here), an EAGLE-3 head or an MTP layer (device_heads.DeviceHead), or none (draft-free mode: `RootOnly`, the suffix
proposals alone). The sides hold one and never ask which it is; a new drafter on the device round is one class.

What a drafter does, each a fixed-shape device function (no host read: the round's phases are captured whole):

    prefill(cache, tokens, counts, starts, state)    after the target's forward over the same prompt tokens (a
                                                      whole prompt, or one piece of it): its cache, its row state
    grow(cache, rows, shape, vocab_limit)            depth x width nodes below every root (shape.depth >= 1)
    after_verify(cache, rows, sub, walk, round)      its commit and catch-up once the target walked the tree
    catch_up_width(T, depth, S)                      the fixed width of that catch-up

Its per-row state (a head's root input) lives in the rows' device state (`RowsOnDevice.drafter`), named by
`state_fields`, moved with the rows; `tapped()` is entered around the target's forwards it reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from ..steps.device_round import DeviceSubtree, DeviceTree, DeviceWalk
from ..steps.slot_cache import SlotCache, catch_up
from .device_growth import grow
from .device_suffix import catch_up_width, follow_walk
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
    context_model: object  # a model whose positions limit the call's (a draft model; a head's rope places any)
    layers: int  # its slot cache's layers (0: it keeps none)
    state_fields: dict[str, tuple[int, torch.dtype]]  # per-row device state: name -> (width, dtype)
    poolable: bool  # its phases may replay across generate() calls (nothing of one call's baked in)

    def gaps(self, architecture, masks: tuple[str, ...]) -> list[str]:
        """Why the device round cannot run it exactly (architecture: its probes.describe, None for a head or none)."""

    def describe(self) -> str:
        """How it attends, for the call's stats."""

    def tapped(self) -> contextlib.AbstractContextManager: ...

    def prefill(self, cache: SlotCache | None, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                state: dict[str, torch.Tensor]) -> None: ...

    def grow(self, cache: SlotCache | None, prefix_lens: torch.Tensor, roots: torch.Tensor,
             state: dict[str, torch.Tensor], depth: int, width: int, vocab_limit: int) -> DeviceTree: ...

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int: ...

    def after_verify(self, cache: SlotCache | None, prefix_lens: torch.Tensor, sub: DeviceSubtree, walk: DeviceWalk,
                     state: dict[str, torch.Tensor], facts: RoundFacts) -> dict[str, torch.Tensor]: ...


def device_drafter(draft, target) -> DeviceDrafter:
    """The device round's drafter for `draft`: none (draft-free), a draft head, or a draft model."""
    if draft is None:
        return RootOnly()
    if isinstance(draft, DraftHead):
        from .device_heads import DeviceHead

        return DeviceHead.of(draft, target)
    return DraftModelOnDevice(draft)


def model_gaps(role: str, model, architecture, masks: tuple[str, ...]) -> list[str]:
    """Why the device round's slot caches cannot run a model exactly (empty: they can)."""
    gaps = []
    if architecture.windowed or architecture.slot_limits:
        gaps.append(f"the {role} ({architecture.model_type}) has sliding-window or slot-limited layers; its slot cache "
                    "attends every committed position")
    if architecture.recurrent or architecture.shape == "chain":
        gaps.append(f"the {role} ({architecture.model_type}) needs chains or recurrent rollback "
                    f"({architecture.chain_reason})")
    if model.config._attn_implementation not in masks:
        gaps.append(f"the {role} attends with {model.config._attn_implementation!r}, which does not take an additive "
                    f"4D mask; load it with attn_implementation='sdpa'")
    return gaps


class RootOnly:
    """Draft-free mode: no model, no cache, nothing grown (every shape is depth 0: the root and the suffix nodes)."""

    model = None
    context_model = None
    layers = 0
    state_fields: dict = {}
    poolable = True

    def gaps(self, architecture, masks) -> list[str]:
        return []

    def describe(self) -> str:
        return "no draft model"

    def tapped(self):
        return contextlib.nullcontext()

    def prefill(self, cache, tokens, counts, starts, state) -> None:
        return None

    def grow(self, cache, prefix_lens, roots, state, depth, width, vocab_limit) -> DeviceTree:
        raise ValueError(f"a shape of depth {depth} needs a draft to grow it; draft-free mode grows nothing")

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int:
        return 0

    def after_verify(self, cache, prefix_lens, sub, walk, state, facts) -> dict:
        return {}


@dataclass
class DraftModelOnDevice:
    """A draft model: grows the tree (device_growth.grow); after the walk its cache commits the walked nodes it ran
    and catches up on the others (device_suffix.follow_walk)."""

    model: object
    state_fields = {}
    poolable = True

    @property
    def context_model(self):
        return self.model

    @property
    def layers(self) -> int:
        return self.model.config.get_text_config().num_hidden_layers

    def gaps(self, architecture, masks) -> list[str]:
        return model_gaps("draft", self.model, architecture, masks) if architecture is not None else []

    def describe(self) -> str:
        return f"draft={self.model.config._attn_implementation}"

    def tapped(self):
        return contextlib.nullcontext()

    def prefill(self, cache, tokens, counts, starts, state) -> None:
        catch_up(self.model, cache, tokens, counts, starts)

    def grow(self, cache, prefix_lens, roots, state, depth, width, vocab_limit) -> DeviceTree:
        return grow(self.model, cache, prefix_lens, roots, depth, width, vocab_limit).tree

    def catch_up_width(self, budget: int, depth: int, suffix_nodes: int) -> int:
        return catch_up_width(budget, depth, suffix_nodes)

    def after_verify(self, cache, prefix_lens, sub, walk, state, facts: RoundFacts) -> dict:
        follow_walk(self.model, cache, walk, sub, prefix_lens, facts.depth, facts.nodes, facts.lag)
        return {}
