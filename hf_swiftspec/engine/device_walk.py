"""The walk over the read logits: the device round's verification strategy for a round whose rows' logits processors
read the path before each node (a repetition penalty, no_repeat_ngram_size, bad words, min_new_tokens, a sequence
bias, a processor of the user's: anything outside verify.PATH_FREE_PROCESSORS). Such a processor's scores at a node
follow the tokens that lead to it, so the walk cannot choose every node at once on the device; the host walks them
instead, over the logits it reads. One read a round still: the walk tells the host what the rows became, so the
phase after it is read by nothing.

    forward_phase   (device_phases) the verification's forward alone: each node's logits (B, T, V) and the subtree's
                    ints, read in one wait (read_to_host)
    walk_rows       every live row walked node by node (verify.walk_nodes, the host round's walk): its processors fed
                    the exact path that leads to each node (its sequence as generate() sees it, then the path), its
                    sampler's Gumbel-max (noise a pure function of seed, row and position: the draws the device's walk
                    would make), its StopRule (EOS ids, max_length, stop strings and the other host criteria) and its
                    budget
    commit_phase    (device_phases) the walks copied in with one pinned copy (walks_tensor), then after_walk: what the
                    fused verification runs after its walk (the target cache's commit, the drafter's, the rows' advance)

Every row of such a round is walked on the host: a row whose processors ignore the path walks as the device would
(walk_nodes applies the same rules), so one strategy serves the round.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..steps.acceptance import StopRule
from ..steps.device_round import to_device
from ..steps.verify import Sampler, Verified, children_of, walk_nodes
from .device_phases import commit_phase, forward_phase, read_to_host, subtree_tensors


def walk_over_read_logits(sides, proposed, rows, facts, known, inputs: dict) -> tuple[list, list[Verified]]:
    """The strategy's verification on the device sides (DeviceSides.verify's, for a round whose rows' processors read
    the path): forward_phase, its read (the logits and the subtrees, one wait), every live row walked on the host,
    then commit_phase with the walks in one pinned copy. Both phases run on the models without the rows' rules
    (RoundModels.without_rules): one graph serves every processor. Returns, per live row, its subtree's read (node
    ids, tokens, parents, draft scores' bits) and its walk, as DeviceSides.walk_on_device does."""
    bare = sides.models.without_rules()
    span = proposed.spans[1]
    with sides.clock.phase("verify"), sides.drafter.tapped():
        if known is None:
            out = sides.run(forward_phase, dict(span=span), inputs, models=bare)
        else:  # round 1's roots, from the prefill: eagerly, as walk_on_device runs them
            with sides.compiled():
                out = forward_phase(models=bare, slots=sides.slots, span=span, known=known, **inputs)
    with sides.clock.phase("walk"):
        logits, read = read_to_host(out["logits"], out["subtree"])
        subtrees = read.tolist()[: sides.live]
        verified = walk_rows(logits, subtrees, sides.host[: sides.live], rows.criteria(), rows.budgets())
        keep(verified, out["logits"], sides.models.keeps, sides.device)
        walks = dict(subtree_tensors(proposed.subtree), walks=walks_tensor(verified, sides.bucket, logits.shape[1],
                                                                              sides.device))
    if "target_states" in out:
        walks["target_states"] = out["target_states"]
    with sides.clock.phase("verify"):
        proposed.after = sides.run(commit_phase, dict(facts=facts, span=span), walks, models=bare)
    return subtrees, verified


def walk_rows(logits: torch.Tensor, subtrees: list[list[int]], rows: list, criteria: list[StopRule],
              budgets: list[int]) -> list[Verified]:
    """Each live row's walk over its read logits.

    logits:   (B, T, V) float32 the read logits (host tensors), node j of row b at [b, j]
    subtrees: per live row, forward_phase's read [node ids (T), tokens (T), parents (T), ...] (padding: parent -1,
              never entered)
    rows:     per live row, its RowOnHost (sampler, sequence as generate() sees it)
    criteria / budgets: per live row, the RoundRows' StopRule and the tokens it may still emit
    """
    T = logits.shape[1]
    out = []
    for b, (ints, row, rule, budget) in enumerate(zip(subtrees, rows, criteria, budgets)):
        children = children_of(ints[2 * T : 3 * T], ints[T : 2 * T])
        context = torch.tensor([row.sequence], dtype=torch.long)
        out.append(walk_nodes(logits[b], children, context, host_sampler(row), rule,
                              rule.budget(budget, len(row.sequence))))
    return out


def walks_tensor(walks: list[Verified], bucket: int, T: int, device) -> torch.Tensor:
    """The walks as commit_phase takes them, (bucket, 2 + 2T) long per row [count, finished, tokens (T), path (T)], -1
    past the count (a dead row's count 0): one pinned, non-blocking copy (to_device)."""
    packed = []
    for b in range(bucket):
        walk = walks[b] if b < len(walks) else Verified()
        pad = [-1] * (T - len(walk.tokens))
        packed.append([len(walk.tokens), int(walk.finished), *walk.tokens, *pad, *walk.path, *pad])
    return to_device(packed, device)


def host_sampler(row) -> Sampler:
    """The row's sampler as the host's walk runs it (kept on the row): its own on a CPU; on another device a copy whose
    processors hold their tensors on the host (generate() builds some with device tensors: an EOS list, a bias), as
    the read logits are there. Its seed is the row's (drawn when the row joined)."""
    if row.on_host is None:
        sampler = row.sampler
        moved = [on_host(p) for p in sampler.logits_processor]
        if any(m is not p for m, p in zip(moved, sampler.logits_processor)):
            sampler = dataclasses.replace(sampler, logits_processor=type(sampler.logits_processor)(moved))
        row.on_host = sampler
    return row.on_host


def on_host(processor):
    """`processor`, or a shallow copy of it with the tensors it holds (its attributes', and in their lists, tuples
    and dicts) on the host where any is elsewhere."""
    state = getattr(processor, "__dict__", {})
    moved = {name: host_value(value) for name, value in state.items()}
    if all(moved[name] is value for name, value in state.items()):
        return processor
    out = copy.copy(processor)
    vars(out).update(moved)
    return out


def host_value(value):
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else value.cpu()
    if isinstance(value, (list, tuple)):
        items = [host_value(v) for v in value]
        return value if all(i is v for i, v in zip(items, value)) else type(value)(items)
    if isinstance(value, dict):
        items = {k: host_value(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if isinstance(value, torch.Generator) and value.device.type != "cpu":
        raise ValueError(f"a logits processor holds a torch.Generator on {value.device}, which the device round's walk "
                         "over the read logits cannot move to the host; use round='host' for this call")
    return value


def keep(walks: list[Verified], logits: torch.Tensor, keeps: tuple[bool, bool], device) -> None:
    """The walks' scores and logits (1, V) each where the call keeps them (else none: they would hold the read's
    views), in place. On a device other than the host's, where generate() returns them: the logits the device's own
    (logits (B, T, V), forward_phase's, at each walked node), the processed scores the host made, in one pinned,
    non-blocking copy."""
    elsewhere = torch.device(device).type != "cpu"
    for b, walk in enumerate(walks):
        walk.scores = walk.scores if keeps[0] else []
        walk.logits = ([logits[b, node : node + 1] for node in walk.path] if elsewhere else walk.logits) if keeps[1] \
            else []
    scores = [s for walk in walks for s in walk.scores]
    if not (elsewhere and scores):
        return
    host = torch.cat(scores)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True).split(1)
    at = 0
    for walk in walks:
        walk.scores, at = list(moved[at : at + len(walk.scores)]), at + len(walk.scores)
