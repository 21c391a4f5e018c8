"""How the device round's forwards attend and compile (engine/device_sides.py holds one `SlotAttending` per sides):
each model's slot cache attends as steps/attention.py's resolve_attention says (the host round's rule:
attention="kernel", or "auto" where the phases replay or compile on CUDA: the tree kernel; else the model's own
attention over dense masks), a kernel-routed model routed to the kernel for as long as the sides run (`routed`),
and with compile=True the phases' decoder layers run through torch.compile (`compiled`, capture.compiled_layers;
the compiled calls are the pool's, kept with its graphs).

A draft head attends with its own sdpa, as in the host round (its own layer takes the additive masks it builds).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..steps.attention import resolve_attention, routed_attention
from ..steps.capture import RECOMPILES, compiled_layers
from .device_pool import SlotPool

HEAD = "sdpa"  # a draft head's (or none's) slot cache: its own attention


@dataclass(frozen=True)
class SlotAttending:
    """The target's and the drafter's attention backends (SlotCache.attention: "triton" / "torch-reference" the tree
    kernel, else dense masks), the models they are routed for, and the pool whose compiled calls the phases use where
    it compiles."""

    target: object
    draft: object  # a draft model (None: a head, or none: HEAD)
    backends: tuple[str, str]
    pool: SlotPool

    @classmethod
    def of(cls, config, target, target_architecture, drafter, pool: SlotPool) -> "SlotAttending":
        replayed = pool.backend is not None  # (the host round's "replayed": fixed steps, replayed or compiled)
        draft = drafter.model if drafter.architecture is not None else None  # (a draft model has one)
        backends = (resolve_attention(config.attention, target, target_architecture, replayed),
                    resolve_attention(config.attention, draft, drafter.architecture, replayed) if draft else HEAD)
        return cls(target, draft, backends, pool)

    @contextlib.contextmanager
    def routed(self):
        """The models routed to the tree kernel where their caches attend through it (attention.routed_attention),
        for the block only: the user's attn_implementation comes back afterwards, also on failure."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(routed_attention(self.target, self.backends[0]))
            if self.draft is not None:
                stack.enter_context(routed_attention(self.draft, self.backends[1]))
            yield

    def compiled(self, models) -> contextlib.AbstractContextManager:
        """With compile=True, `models`' decoder layers through torch.compile inside the block (a phase); else
        nothing."""
        if not self.pool.compile:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for model in models:
            if model is not None:
                stack.enter_context(compiled_layers(model, self.pool.compiled))
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=RECOMPILES))
        return stack

    def describe(self, caches, drafted: str) -> str:
        """How each model attended, for the call's stats: its backend, and the layers that ran their own attention
        where it is the tree kernel (the caches' fallbacks); drafted: the drafter's own words where it is no draft
        model."""
        parts = []
        for role, backend, cache in zip(("target", "draft"), self.backends, caches):
            if role == "draft" and self.draft is None:
                parts.append(drafted)
                continue
            fallbacks = sorted(cache.fallbacks) if cache is not None else []
            parts.append(f"{role}={backend}" + (f" (own attention for {', '.join(fallbacks)})" if fallbacks else ""))
        return ", ".join(parts)
