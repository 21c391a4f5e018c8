"""The device round's two phases, each a function of the rows' slots and a few live inputs that reads nothing back
(engine/device_sides.py runs them; with capture each replays as one graph per shape, bucket and live length):

    grow_phase     the drafter's growth of the round's shape below every root, the suffix nodes merged in, the best T
                   selected with their mask
    verify_phase   the target's verification, its choices, the walk (acceptance.py's rules), both caches' commits and
                   the rows' state moved on in place; its `result` is the round's one read
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from swiftspec_kernels.advance_rows import advance_rows

from ..drafters.device_drafters import DeviceDrafter, RoundFacts
from ..drafters.device_suffix import merge_suffix, root_tree
from ..policy.shapes import Shape
from ..steps.acceptance import greedy_choices, gumbel_noise, sampled_choices, walk_subtree
from ..steps.device_round import DeviceSubtree, plain_subtree, select_device
from ..steps.slot_cache import commit_cache, verify_forward
from ..steps.verify import apply_processors
from .device_pool import Slots


@dataclass(frozen=True)
class RoundModels:
    """What a round's phases run on besides the slots: the target, the drafter, each cache row's processors (the
    path-free ones; () for a dead row) and whether the round samples, keeps each token's scores / logits."""

    target: object
    drafter: DeviceDrafter
    processors: tuple
    sample: bool
    keeps: tuple[bool, bool]
    vocab_limit: int

    def key(self) -> tuple:
        """What a replayed phase bakes in of these (the slots' addresses are the sides' part of the key): the rows'
        processors by their settings (a new processor object with the same settings is no new graph)."""
        return tuple(processors_signature(p) for p in self.processors), self.sample, self.keeps


def processors_signature(processors) -> tuple:
    """What a replayed verification bakes in of a row's processors: each one's type and settings where they are
    plain values (two requests with top_k=20 share graphs), else the object itself (captured for it alone)."""
    out = []
    for p in processors or ():
        state = vars(p)
        plain = all(isinstance(v, (int, float, str, bool, type(None))) for v in state.values())
        out.append((type(p).__name__, tuple(sorted(state.items()))) if plain else ("object", id(p)))
    return tuple(out)


def subtree_tensors(sub: DeviceSubtree) -> dict[str, torch.Tensor]:
    return {f.name: getattr(sub, f.name) for f in fields(sub)}


def grow_phase(suffix: torch.Tensor | None = None, *, models: RoundModels, slots: Slots, shape: Shape, span: int,
               lag: int) -> dict:
    """1. the drafter's growth of `shape` below every root (the plain shape: the roots alone, nothing selected; lag:
    the width of the catch-up a drafter that defers it runs first), the suffix nodes merged in (suffix: (B, 5 + S, S)
    the host's proposals, drafters/device_suffix.py) and the best T nodes with their mask (DeviceSubtree's fields): d
    draft forwards and the selection, no host read."""
    rows, cache = slots.rows, slots.caches[1]
    for c in slots.caches:
        if c is not None:
            c.span = span
    if shape.budget == 1 and suffix is None:  # the plain shape: the roots alone, nothing grown or selected
        return subtree_tensors(plain_subtree(rows.roots))
    if shape.depth == 0:  # draft-free: no growth
        tree = root_tree(rows.roots)
    else:
        tree = models.drafter.grow(cache, rows, shape.depth, shape.width, models.vocab_limit, lag)
    if suffix is not None:
        tree = merge_suffix(tree, suffix)
    return subtree_tensors(select_device(tree, shape.budget))


def verify_phase(*, models: RoundModels, slots: Slots, facts: RoundFacts, span: int,
                 known: torch.Tensor | None = None, **subtree) -> dict:
    """2. the target's verification of the subtree, its choices, the walk, both caches' commits (the drafter's commit
    and catch-up: RoundFacts) and the rows' state moved on in place, no host read. known (B, T, V): the subtree's
    logits where the prefill computed them (round 1 of a plain shape: the roots'), so no forward runs.
    Returns: result (B, 2 + 5T) long, the round's one read (counts, finished flags, tokens, then the walked path and
    the subtree's node ids, tokens and parents), the walked nodes' scores / logits (B, T, V) where the call keeps
    them, and what the drafter's step returns (a head's path_inputs)."""
    sub = DeviceSubtree(**subtree)
    rows, (target_cache, draft_cache) = slots.rows, slots.caches
    for c in slots.caches:
        if c is not None:
            c.span = span
    logits = verify_forward(models.target, target_cache, rows.prefix_lens, sub) if known is None else known  # (B, T, V)
    scores = processed(logits, models.processors)
    if models.sample:
        D = min(sub.tokens.shape[1], facts.deepest + 1)  # a node sits at most `deepest` below its root
        positions = rows.positions[:, None] + torch.arange(D, device=logits.device)[None]
        noise = gumbel_noise(rows.seeds, rows.noise_rows, positions, scores.shape[-1])  # (B, D, V)
        choices = sampled_choices(scores, noise * rows.sampled[:, None, None], sub.depths)
    else:
        choices = greedy_choices(scores)
    walk = walk_subtree(choices, sub, rows.budgets, rows.eos)
    if sub.tokens.shape[1] > 1:  # (the roots alone: each root's KV already sits at its prefix's end, nothing moves)
        commit_cache(target_cache, rows.prefix_lens, walk.path.clamp(min=0), walk.count)  # verified node j at slot j
    out = models.drafter.after_verify(draft_cache, rows, sub, walk, facts)
    # the rows moved on in place (roots, lengths, budgets; a finished row's EOS ids cleared) and the read packed
    out["result"] = advance_rows(walk.count, walk.finished, walk.tokens, walk.path, sub.node_ids, sub.tokens,
                                 sub.parents, rows.roots, rows.prefix_lens, rows.budgets, rows.positions, rows.eos)
    for name, values, keep in (("scores", scores, models.keeps[0]), ("logits", logits, models.keeps[1])):
        if keep:
            out[name] = along_path(values, walk.path)
    return out


def processed(logits: torch.Tensor, processors: tuple) -> torch.Tensor:
    """Each row's processed scores (B, T, V): its path-free processors over its T nodes at once."""
    if not any(processors):
        return logits
    return torch.stack([apply_processors(p, None, logits[b].clone()) for b, p in enumerate(processors)])


def along_path(rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """(B, T, V) the rows of `rows` (B, T, V) at each walked node, in walk order (past the count: node 0's)."""
    B, T, V = rows.shape
    return rows.gather(1, path.clamp(min=0)[:, :, None].expand(B, T, V))


def read_once(result: torch.Tensor) -> list[list[int]]:
    """The round's one read of the device: on CUDA a non-blocking copy into pinned memory and a wait on its event (no
    stream or device synchronisation: the round runs under torch.cuda.set_sync_debug_mode("error")), else tolist()."""
    if result.device.type != "cuda":
        return result.tolist()
    host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
    host.copy_(result, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
