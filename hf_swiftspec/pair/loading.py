"""What SwiftSpecForCausalLM.from_pretrained does with its keyword arguments.

They split four ways: Hub options (for the pair repo and both members), the pair repo's own
revision and subfolder, SwiftSpecConfig fields (overriding the pair's config.json), and the rest,
which goes to both members' from_pretrained with hf_swiftspec's defaults filled in.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..engine.placement import resolve_placement
from .locate import HubOptions, PairMember, not_safetensors
from .repo import pair_settings, pop_pair_settings

# Arguments the Auto classes and pipeline() add that mean something for the pair repo itself, or nothing here
# (`_from_auto`: the members load through AutoModelForCausalLM, which sets its own; 5.25 passes it twice if forwarded).
PAIR_ONLY_KWARGS = ("config", "proxies", "adapter_kwargs", "_commit_hash", "code_revision", "_from_auto")
# device_map strings that let accelerate choose: they land on the CPU only when there is no accelerator.
AUTOMATIC_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class LoadArguments:
    """from_pretrained's kwargs, sorted. member_kwargs: for both members' from_pretrained."""

    hub: HubOptions
    revision: str | None
    subfolder: str
    overrides: dict
    member_kwargs: dict


def split_load_kwargs(kwargs: dict) -> LoadArguments:
    kwargs = dict(kwargs)
    for name in PAIR_ONLY_KWARGS:
        kwargs.pop(name, None)
    hub = HubOptions.pop_from(kwargs)
    revision = kwargs.pop("revision", None)
    subfolder = kwargs.pop("subfolder", "") or ""
    overrides = pop_pair_settings(kwargs)
    reject_misspelt_settings(kwargs)
    if kwargs.setdefault("use_safetensors", True) is not True:
        raise ValueError("Pair members load as safetensors only (pickle files can run code); drop use_safetensors.")
    kwargs.setdefault("trust_remote_code", False)
    return LoadArguments(hub, revision, subfolder, overrides, kwargs)


def load_member_model(member: PairMember, hub: HubOptions, member_kwargs: dict) -> PreTrainedModel:
    """A member's weights, as AutoModelForCausalLM loads them; weights missing as safetensors are said to be (a Hub
    member that ships pytorch_model.bin only fails here: a local one was refused before any weights loaded)."""
    try:
        return AutoModelForCausalLM.from_pretrained(member.location, revision=member.revision, **hub.as_kwargs(), **member_kwargs)
    except OSError as err:
        if member_kwargs.get("use_safetensors") and ".safetensors" in str(err):
            raise not_safetensors(member, "has no safetensors weights (no model.safetensors, nor its index)") from err
        raise


def reject_misspelt_settings(member_kwargs: dict) -> None:
    """Raise TypeError for an argument that reads like a SwiftSpecConfig field but is none.

    Members' from_pretrained would set it on their configs and nothing would read it, so
    `tree_budgt=4` would silently speculate with the default budget. Only names within one or two
    typos of a field count (a 0.8 similarity ratio: no from_pretrained argument or common config
    attribute comes that close); every other argument goes to the members as before.
    """
    fields = list(pair_settings())
    loading_arguments = set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    for name in member_kwargs:
        close = [] if name in loading_arguments else difflib.get_close_matches(name, fields, n=1, cutoff=0.8)
        if close:
            raise TypeError(
                f"SwiftSpecForCausalLM.from_pretrained got {name!r}, which is no SwiftSpecConfig field; did you mean "
                f"{close[0]!r}? (SwiftSpecConfig fields: {', '.join(fields)}.)"
            )


def accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def device_map_on_cpu(device_map) -> bool:
    """Whether from_pretrained(device_map=...) leaves every weight on the CPU (or offloaded to disk)."""
    if device_map is None:
        return True
    if isinstance(device_map, dict):
        return all(device_map_on_cpu(device) for device in device_map.values())
    if isinstance(device_map, str) and device_map in AUTOMATIC_DEVICE_MAPS:
        return not accelerator_available()
    if device_map == "disk":
        return True
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return False  # an accelerator index
    return torch.device(device_map).type == "cpu"


def placement_on_cpu(placement) -> bool:
    """Whether the pair's placement keeps both models on the CPU (it moves them after loading)."""
    resolved = resolve_placement(placement)
    if resolved.mode == "threads":
        return all(torch.device(device).type == "cpu" for device in resolved.target + resolved.draft)
    if resolved.mode == "distributed":
        return dist.get_backend() != "nccl"
    return True


def with_cpu_dtype(member_kwargs: dict, placement) -> dict:
    """float32 when the members will run on the CPU and no dtype was asked for.

    Checkpoints are often float16 or bfloat16 (transformers' default loads them as stored), which on
    a CPU is slow and, for float16, inexact; the CLI has always loaded float32 there. An explicit
    dtype (or torch_dtype), "auto" included, is honoured.
    """
    if "dtype" in member_kwargs or "torch_dtype" in member_kwargs:
        return member_kwargs
    if not (device_map_on_cpu(member_kwargs.get("device_map")) and placement_on_cpu(placement)):
        return member_kwargs
    return {**member_kwargs, "dtype": torch.float32}
