"""Where the target and the draft run, and therefore which engine runs them.

    placement=None or "serial"          both models where they are; serial engine
    placement="auto"                    under torchrun: the last rank drafts, the others verify;
                                        else with >= 2 GPUs: target cuda:0, draft on the last GPU;
                                        else serial
    placement={"target": [0, 1], "draft": [2]}
                                        under torchrun: global ranks (each group tensor-parallel
                                        over its ranks); otherwise CUDA device indices (one each)
    placement={"target": ["cpu"], "draft": ["cpu"]}
                                        two threads on the CPU (they share its cores)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from ..models.compat import apply_tensor_parallelism, tensor_parallel_plan
from .distributed import Groups


@dataclass(frozen=True)
class Placement:
    """A resolved placement.

    mode: "serial" (one device, one thread), "threads" (one process, each model on its own
        device and thread) or "distributed" (torch.distributed process groups).
    target, draft: devices (threads/serial) or global ranks (distributed) of each group.
    """

    mode: str
    target: tuple = ()
    draft: tuple = ()
    auto: bool = False  # resolved from placement="auto": swiftspec chose the devices (and may choose the engine)

    @property
    def device_map(self) -> dict[str, str] | None:
        """Module prefix -> device, as in `hf_device_map`; None when the models move together."""
        if self.mode != "threads":
            return None
        return {"target": str(self.target[0]), "draft": str(self.draft[0])}


def distributed_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def resolve_placement(spec, target_config=None, draft_config=None) -> Placement:
    """Turn a user's placement into a Placement, or raise ValueError naming what is impossible (with the models'
    configs: a group whose size does not divide its model's heads, which its ranks shard)."""
    if spec is None or spec == "serial":
        return Placement("serial")
    if spec == "auto":
        return replace(resolve_placement(auto_spec(), target_config, draft_config), auto=True)
    if not isinstance(spec, dict) or set(spec) != {"target", "draft"}:
        raise ValueError(
            f"placement={spec!r} is not understood: use None, 'serial', 'auto', or "
            "{'target': [...], 'draft': [...]} with device indices (or ranks under torchrun)."
        )
    world = distributed_world()
    groups = {role: list(spec[role]) if isinstance(spec[role], (list, tuple)) else [spec[role]] for role in spec}
    for role, members in groups.items():
        if not members:
            raise ValueError(f"placement[{role!r}] is empty: give it at least one device (or rank).")
    if world >= 2:
        placement = Placement("distributed", tuple(groups["target"]), tuple(groups["draft"]))
        check_ranks(placement, world)
    else:
        placement = Placement("threads", *(tuple(device_of(m, role) for m in groups[role]) for role in ("target", "draft")))
        check_devices(placement)
    for role, config in (("target", target_config), ("draft", draft_config)):
        if config is not None:
            check_tensor_parallel(config, len(getattr(placement, role)), role)
    return placement


def auto_spec():
    """What placement="auto" means here: under torchrun the last rank drafts and the others verify; else with two
    GPUs or more, the target on cuda:0 and the draft on the last; else "serial"."""
    world = distributed_world()
    if world >= 2:
        return {"target": list(range(world - 1)), "draft": [world - 1]}
    if torch.cuda.device_count() >= 2:
        return {"target": [0], "draft": [torch.cuda.device_count() - 1]}
    return "serial"


def device_of(member, role: str) -> torch.device:
    """A group member of an in-process placement as a torch.device, checked to exist."""
    device = torch.device(f"cuda:{member}" if isinstance(member, int) else member)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index or 0
        if index >= count:
            raise ValueError(
                f"placement[{role!r}] names {device}, but this machine has {count} CUDA device(s). "
                "Use existing device indices, or run under torchrun for several machines."
            )
    return device


def check_devices(placement: Placement) -> None:
    for role in ("target", "draft"):
        if len(getattr(placement, role)) != 1:
            raise ValueError(
                f"placement[{role!r}]={list(getattr(placement, role))}: several devices per group need one process "
                "per device; launch with torchrun and give global ranks instead."
            )
    t, d = placement.target[0], placement.draft[0]
    if t == d and t.type != "cpu":
        raise ValueError(
            f"placement puts target and draft both on {t}; give them different devices, or use placement=None "
            "(serial speculation on one device)."
        )


def check_ranks(placement: Placement, world: int) -> None:
    ranks = list(placement.target) + list(placement.draft)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
    if bad:
        raise ValueError(f"placement names ranks {bad}, but the torchrun world has ranks 0..{world - 1}.")
    overlap = sorted(set(placement.target) & set(placement.draft))
    if overlap:
        raise ValueError(f"placement puts rank(s) {overlap} in both the target and the draft group; make them disjoint.")


def check_tensor_parallel(config, degree: int, role: str) -> None:
    """A group of `degree` ranks shards attention heads: both head counts must divide evenly."""
    if degree == 1:  # nothing sharded (and a recurrent model's config may name no heads)
        return
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % degree or kv_heads % degree:
        raise ValueError(
            f"The {role} group has {degree} ranks, which does not divide the {role}'s {heads} attention heads and "
            f"{kv_heads} key/value heads; use a group size that divides both."
        )


def place_models(placement: Placement, target, draft, timeout_s: float, draft_beside_target: bool = False) -> Groups | None:
    """Move each model onto its group's device; under torchrun also build the process groups and
    shard each group's model over its ranks (with `draft_beside_target`, the draft also goes to the one
    target rank's device, for serial_fallback's serial calls). Collective: every rank must call it in step."""
    if placement.mode == "threads":
        target.to(placement.target[0])
        draft.to(placement.draft[0])
    if placement.mode != "distributed":
        return None
    rank, backend = dist.get_rank(), dist.get_backend()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    groups = Groups(rank, list(placement.target), list(placement.draft), device)
    for role, model in (("target", target), ("draft", draft)):
        ranks = list(getattr(placement, role))
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) if len(ranks) > 1 else None
        setattr(groups, f"{role}_group", group)
        if rank in ranks:
            model.to(device)
            if group is not None:
                shard(model, DeviceMesh.from_group(group, device.type), len(ranks))
    if draft_beside_target and groups.role == "target":
        draft.to(device)
    return groups


def shard(model, mesh: DeviceMesh, degree: int) -> None:
    """Apply the model's own tensor-parallel plan over `mesh` (a sub-mesh of the world).

    from_pretrained(tp_plan=...) always shards over the whole world, so a disjoint group's
    model is sharded here, after loading (checked against the unsharded logits in the tests).
    """
    plan = tensor_parallel_plan(model, degree)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan; give its group a single rank.")
    apply_tensor_parallelism(model, mesh, plan)
