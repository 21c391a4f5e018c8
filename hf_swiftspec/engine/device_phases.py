"""The device round's two phases, each a function of the rows' slots and a few live inputs that reads nothing back
(engine/device_sides.py runs them; with capture each replays as one graph per shape, bucket and live length):

    grow_phase     the drafter's growth of the round's shape below every root, the suffix nodes merged in, the best T
                   selected with their mask
    verify_phase   the target's verification, its choices, the walk (acceptance.py's rules), then after_walk: both
                   caches' commits and the rows' state moved on in place; its `result` is the round's one read

A round whose rows' logits processors read the path verifies by the walk over the read logits instead
(engine/device_walk.py): forward_phase (the verification's forward alone, read), the host's walk, then commit_phase
(the walks copied in, after_walk). The two share after_walk, so a walk commits the same way wherever it ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch
from swiftspec_kernels.advance_rows import advance_rows

from ..drafters.device_drafters import DeviceDrafter, RoundFacts
from ..drafters.device_suffix import chosen_subtree, merge_suffix, root_tree
from ..steps.acceptance import Walk, greedy_choices, gumbel_noise, sampled_choices, walk_subtree
from ..steps.device_round import DeviceSubtree, plain_subtree, select_device
from ..steps.slot_cache import commit_cache, verify_forward
from ..steps.verify import PATH_FREE_PROCESSORS, apply_processors
from .device_pool import Slots


@dataclass(frozen=True)
class Shape:
    """A round's static shape (part of a replayed phase's key): the drafter grows `depth` levels of `width` nodes
    below every root (0: none), and the best `budget` nodes of that tree and the suffix proposals are verified, the
    root included (None: the policy decides after the growth, between levels: policy/sizing.py)."""

    depth: int
    width: int
    budget: int | None

    @property
    def nodes(self) -> int:
        """Nodes the growth makes, the root included (each one's KV slot sits in the tree region)."""
        return 1 + self.depth * self.width


PLAIN = Shape(0, 0, 1)  # the roots alone, verified: one target forward, one token a row


@dataclass(frozen=True)
class RoundModels:
    """What a round's phases run on besides the slots: the target, the drafter, each cache row's processors (() for a
    dead row) and whether the round samples, keeps each token's scores / logits."""

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

    @property
    def walks_on_host(self) -> bool:
        """Whether a row's processors read the path before each node: the round then verifies by the walk over the read
        logits (engine/device_walk.py), every row of it."""
        return any(type(p) not in PATH_FREE_PROCESSORS for row in self.processors for p in row)

    def without_rules(self) -> "RoundModels":
        """These models without the rows' rules (processors, sampling, kept scores): what the walk over the read logits
        hands its two phases, which apply none of them (the host's walk does), so none is baked into their graphs."""
        return dataclasses.replace(self, processors=tuple(() for _ in self.processors), sample=False,
                                   keeps=(False, False))


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


def grow_phase(suffix: torch.Tensor | None = None, chosen: torch.Tensor | None = None, *, models: RoundModels,
               slots: Slots, shape: Shape, span: int, lag: int, sizing=None) -> dict:
    """1. the drafter's growth of `shape` below every root (the plain shape: the roots alone, nothing selected; lag:
    the width of the catch-up a drafter that defers it runs first), the suffix nodes merged in (suffix: (B, 5 + S, S)
    the host's proposals, drafters/device_suffix.py) and the best T nodes with their mask (DeviceSubtree's fields),
    with `drafted` (B, T) float32, each selected node's draft score (-inf where the drafter did not grow it): up to d
    draft forwards and the selection, no host read. chosen: (B, 6 + T, T) a round that grows nothing: the subtrees the
    host chose from its proposals alone (drafters/device_suffix.chosen_nodes), which need no merge or selection.
    sizing: the policy's between levels (policy/sizing.RoundSizing: it reads each level and may stop the growth, then
    picks T where shape.budget is None); None: the shape is the round's."""
    rows, cache = slots.rows, slots.caches[1]
    for c in slots.caches:
        if c is not None:
            c.span = span
    if shape.budget == 1 and suffix is None:  # the plain shape: the roots alone, nothing grown or selected
        plain = plain_subtree(rows.roots)
        return dict(subtree_tensors(plain), drafted=plain.scores)
    if chosen is not None:  # nothing grown: the host's choice from its proposals
        sub = chosen_subtree(chosen, rows.roots)
        return dict(subtree_tensors(sub), drafted=torch.full_like(sub.scores, float("-inf")))
    if shape.depth == 0:  # draft-free: no growth
        tree = root_tree(rows.roots)
    else:
        tree = models.drafter.grow(cache, rows, shape.depth, shape.width, models.vocab_limit, lag,
                                   sizing.after_level if sizing is not None else None)
    grown = tree.scores  # (B, N) before the merge, which keeps the higher of a twin's two scores
    if suffix is not None:
        tree = merge_suffix(tree, suffix)
    sub = select_device(tree, shape.budget if shape.budget is not None else sizing.budget())
    N = grown.shape[1]
    drafted = grown.gather(1, sub.node_ids.clamp(max=N - 1)).masked_fill(sub.node_ids >= N, float("-inf"))
    return dict(subtree_tensors(sub), drafted=drafted)


def verify_phase(*, models: RoundModels, slots: Slots, facts: RoundFacts, span: int, drafted: torch.Tensor,
                 known: torch.Tensor | None = None, **subtree) -> dict:
    """2. the target's verification of the subtree, its choices, the walk, both caches' commits (the drafter's commit
    and catch-up: RoundFacts) and the rows' state moved on in place, no host read. known (B, T, V): the subtree's
    logits where the prefill computed them (round 1 of a plain shape: the roots'), so no forward runs.
    drafted (B, T) float32: each node's draft score (grow_phase's), which the read carries back for the policy.
    Returns: result (B, 2 + 6T) long, the round's one read (counts, finished flags, tokens, then the walked path, the
    subtree's node ids, tokens and parents, and the nodes' draft scores as float64 bits), the walked nodes' scores /
    logits (B, T, V) where the call keeps them, and what the drafter's step returns (a head's path_inputs)."""
    sub = DeviceSubtree(**subtree)
    rows = slots.rows
    logits = target_logits(models, slots, span, sub, known)  # (B, T, V)
    scores = processed(logits, models.processors)
    if models.sample:
        D = min(sub.tokens.shape[1], facts.deepest + 1)  # a node sits at most `deepest` below its root
        positions = rows.positions[:, None] + torch.arange(D, device=logits.device)[None]
        noise = gumbel_noise(rows.seeds, rows.noise_rows, positions, scores.shape[-1])  # (B, D, V)
        choices = sampled_choices(scores, noise * rows.sampled[:, None, None], sub.depths)
    else:
        choices = greedy_choices(scores)
    walk = walk_subtree(choices, sub, rows.budgets, rows.eos)
    out = after_walk(models, slots, facts, sub, walk)
    out["result"] = torch.cat([out.pop("advanced"), drafted.double().view(torch.int64)], dim=1)
    for name, values, keep in (("scores", scores, models.keeps[0]), ("logits", logits, models.keeps[1])):
        if keep:
            out[name] = along_path(values, walk.path)
    return out


def target_logits(models: RoundModels, slots: Slots, span: int, sub: DeviceSubtree,
                  known: torch.Tensor | None) -> torch.Tensor:
    """The target's logits (B, T, V) at the subtree's nodes: its verification forward over the live `span`, or `known`
    (the prefill's, no forward)."""
    for c in slots.caches:
        if c is not None:
            c.span = span
    return verify_forward(models.target, slots.caches[0], slots.rows.prefix_lens, sub) if known is None else known


def after_walk(models: RoundModels, slots: Slots, facts: RoundFacts, sub: DeviceSubtree, walk: Walk) -> dict:
    """What follows a verification's walk, wherever it ran (verify_phase's on the device, or the host's walk over the
    read logits: commit_phase): the target cache's commit of the walked path, the drafter's after_verify (its commit, a
    head's catch-up on the target's states of the verification forward) and the rows moved on in place (roots,
    lengths, budgets; a finished row's EOS ids cleared). Returns the drafter's outputs and `advanced` (B, 2 + 5T) long,
    advance_rows' packed walk (counts, finished flags, tokens, path, the subtree's node ids, tokens and parents)."""
    rows, (target_cache, draft_cache) = slots.rows, slots.caches
    if sub.tokens.shape[1] > 1:  # (the roots alone: each root's KV already sits at its prefix's end, nothing moves)
        commit_cache(target_cache, rows.prefix_lens, walk.path.clamp(min=0), walk.count)  # verified node j at slot j
    out = models.drafter.after_verify(draft_cache, rows, sub, walk, facts)
    out["advanced"] = advance_rows(walk.count, walk.finished, walk.tokens, walk.path, sub.node_ids, sub.tokens,
                                   sub.parents, rows.roots, rows.prefix_lens, rows.budgets, rows.positions, rows.eos)
    return out


def forward_phase(*, models: RoundModels, slots: Slots, span: int, drafted: torch.Tensor,
                  known: torch.Tensor | None = None, **subtree) -> dict:
    """2a. (the walk over the read logits: engine/device_walk.py) the verification's forward alone, no host read.
    Returns logits (B, T, V), each node's; subtree (B, 4T) long, what the host's walk and the policy read of it (the
    node ids, tokens and parents, and the draft scores as float64 bits); and target_states, the target's states of this
    forward where the drafter reads them (a head's tap: they cross to commit_phase as this graph's output, since
    nothing may run the target in between)."""
    sub = DeviceSubtree(**subtree)
    logits = target_logits(models, slots, span, sub, known)
    read = torch.cat([sub.node_ids, sub.tokens, sub.parents, drafted.double().view(torch.int64)], dim=1)
    out = dict(logits=logits, subtree=read)
    if models.drafter.reads_target:
        out["target_states"] = models.drafter.tap.take()
    return out


def commit_phase(walks: torch.Tensor, target_states: torch.Tensor | None = None, *, models: RoundModels,
                 slots: Slots, facts: RoundFacts, span: int, **subtree) -> dict:
    """2b. (the walk over the read logits) the host's walks, copied in: walks (B, 2 + 2T) long per row [count,
    finished, tokens (T), path (T)] (-1 past the count), then after_walk. target_states: forward_phase's, handed
    back to the drafter's tap. No host read (the host walked: it knows what the rows became)."""
    sub = DeviceSubtree(**subtree)
    for c in slots.caches:
        if c is not None:
            c.span = span
    if target_states is not None:
        models.drafter.tap.hand(target_states)
    T = sub.tokens.shape[1]
    walk = Walk(path=walks[:, 2 + T :], tokens=walks[:, 2 : 2 + T], count=walks[:, 0], finished=walks[:, 1] > 0)
    return after_walk(models, slots, facts, sub, walk)


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
    """The round's one read of the device (read_to_host's), as host ints."""
    return read_to_host(result)[0].tolist()


def read_to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors on the host after one wait: on CUDA non-blocking copies into pinned memory and a wait on one
    event (no stream or device synchronisation: the round runs under torch.cuda.set_sync_debug_mode("error")); on a
    CPU the tensors themselves (a replayed phase's static outputs: read them before the next replay)."""
    if tensors[0].device.type != "cuda":
        return list(tensors)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(hosts, tensors):
        host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return hosts
