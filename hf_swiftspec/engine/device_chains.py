"""The device round's chain strategy (engine/device_sides.py holds one as `DeviceSides.chain`; None: trees).

A model that places tokens by cache slot (an ALiBi bias, a forward without position_ids, a rule its attention bands by
key slot once a call's slots pass it: architectures.SLOT_RULES' beyond="chain") or that keeps a recurrent state
(models/architectures.py's `shape` "chain") is exact only along a chain: there each node's slot is its position, and
its states follow one path. So a chain call's rounds are chains: draft width 1 (DeviceSides.width), the suffix
proposals a single path and none beside a draft's chain (DeviceSides.size_trees), the tree one path whose node j sits
at slot and position prefix + j, cut to its live nodes (`first`). Its slot caches read like transformers' own (steps/slot_cache.SlotCache.chained: the row's true length,
keys up to the last query's slot, no mask), which holds for one row only: a batch of such models decodes with
transformers' own loop (engine/launch.batch_exactness_gaps). Its phases run eagerly, on slots of the call's own
(capture.capture_gap: a graph bakes in a span, and these models read the length).

Recurrent and hybrid models keep their states exact with steps/recurrent.py's mechanism, on the chained caches'
StateLog (every forward's states saved after it):
  - the target: a verification that ran past the accepted path (a rejected node, or padding past a short chain) has
    its states put back after the round's read to the snapshot before it, and the accepted tokens after that
    snapshot ride at the head of the next verification (`SlotCache.replay`, at the slots before the prefix, their
    logits not computed); past MAX_REPLAY of them they run first as a forward of their own;
  - a recurrent draft: back to the snapshot after the level where the walk left its chain (it saves after each
    level's one-token forward: nothing to replay).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..steps.device_round import DeviceSubtree
from ..steps.recurrent import MAX_REPLAY
from ..steps.slot_cache import catch_up


@dataclass
class Chains:
    """One chain call's strategy state (module docstring).

    reason:    why the call runs chains (the call's stats say it)
    layouts:   per slot cache (target's, draft's): its model's (layer_types, layer_states), for the state layers
    pending:   (1, R) long the accepted tokens the target's states must run again before its next nodes (None: none)
    in_flight: (1, R) long those handed to the verification in flight (None: none)
    start:     the target's committed slots before the verification in flight
    """

    reason: str
    layouts: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
    pending: torch.Tensor | None = None
    in_flight: torch.Tensor | None = None
    start: int = 0

    @classmethod
    def of(cls, architectures, reason: str | None = None) -> "Chains | None":
        """The strategy where the models' steps must be chains (`architectures`: the target's and the draft model's
        probes.describe, None without one) or `reason` says the call needs them; None where trees are exact."""
        reasons = [f"the {role}'s steps must be chains ({a.chain_reason})"
                   for role, a in zip(("target", "draft"), architectures) if a is not None and a.shape == "chain"]
        reasons += [reason] if reason else []
        if not reasons:
            return None
        layouts = tuple((a.layer_types, a.layer_states) if a is not None else ((), ()) for a in architectures)
        return cls("; ".join(reasons), layouts)

    @staticmethod
    def reaching(architecture, slots: int) -> str | None:
        """Why a call whose forwards attend up to `slots` slots a row must run chains: a rule the target applies by
        cache slot (beyond="chain") that they reach, where a tree node's slot is past its position; else None."""
        reached = [limit for limit in architecture.limits_reached(slots) if limit.beyond == "chain"]
        return "; ".join(f"the target {limit.reason}, and this call's forwards reach {slots} slots"
                         for limit in reached) or None

    # ---- the shapes
    @staticmethod
    def first(subtree: DeviceSubtree, nodes: int) -> DeviceSubtree:
        """The first `nodes` of a chain's selected nodes (the live ones, in path order): no padding node is verified,
        which a recurrent state would run too."""
        def cut(t: torch.Tensor) -> torch.Tensor:  # (B, T) fields, and the (B, T, T) mask
            return t[:, :nodes, :nodes] if t.dim() == 3 else t[:, :nodes]

        return DeviceSubtree(**{f.name: cut(getattr(subtree, f.name)) for f in fields(subtree)})

    # ---- the caches and the round's forwards
    def adopt(self, slots) -> None:
        """The slots' caches as chains' (once, before their first forward: DeviceSides.slots_for)."""
        for cache, layout in zip(slots.caches, self.layouts):
            if cache is not None and cache.length is None:
                cache.chained(*layout)

    def before_grow(self, slots, drafted: int) -> None:
        """The draft's cache at its `drafted` committed slots: its catch-up, then its growth, runs from there."""
        if slots.caches[1] is not None:
            slots.caches[1].length = drafted

    def before_verify(self, target_model, slots, prefix: int, counters) -> None:
        """The target's cache at the slot its verification starts from (`prefix` committed, less the tokens its
        states run again first), those tokens handed to it (`replay`); too many to carry run first on their own
        (counted in `counters`, the target's)."""
        cache, rows = slots.caches[0], slots.rows
        self.start = prefix
        pending, self.pending = self.pending, None
        if pending is not None and pending.shape[1] > MAX_REPLAY:  # a forward of their own (recurrent.py)
            R = pending.shape[1]
            cache.length = prefix - R
            catch_up(target_model, cache, pending, torch.full_like(rows.prefix_lens, R), rows.prefix_lens - R)
            counters.forwards += 1
            pending = None
        cache.length = prefix - (pending.shape[1] if pending is not None else 0)
        cache.replay = self.in_flight = pending

    def after_read(self, slots, subtree_tokens: torch.Tensor, prefix: int, drafted: int, ran: bool,
                   grew: bool, counters) -> None:
        """After the round's read (the row at `prefix` committed slots, the draft at `drafted`): states that ran past
        the accepted path put back, and the target's accepted tokens after its snapshot kept to run again.
        subtree_tokens: (1, T) the verified chain's tokens (its first prefix - start: the accepted path's); ran: the
        target ran a forward this round; grew: the draft did; counters: the target's (its replayed tokens)."""
        target, draft = slots.caches
        if ran and target.states is not None:
            rerun = target.states.rewind(prefix, target.length)
            if rerun:
                self.pending = self.carried(subtree_tokens[:, : prefix - self.start], rerun)
                counters.replayed_tokens += rerun
        self.in_flight = None
        if grew and draft is not None and draft.states is not None:
            if draft.states.rewind(drafted, draft.length):
                raise RuntimeError(f"the draft's states have no snapshot at its {drafted} committed slots: a chain's "
                                   "growth saves after every level")
            draft.length = drafted

    def carried(self, accepted: torch.Tensor, rerun: int) -> torch.Tensor:
        """(1, rerun) the tokens the target's states run again: the last `rerun` of what the verification in flight
        replayed and then accepted."""
        tokens = accepted if self.in_flight is None else torch.cat([self.in_flight, accepted], 1)
        if rerun > tokens.shape[1]:
            raise RuntimeError(f"the target's states were put back {rerun} tokens, past the {tokens.shape[1]} the "
                               "verification replayed and accepted")
        return tokens[:, tokens.shape[1] - rerun :]
