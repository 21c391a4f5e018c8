"""The draft `swiftspec distill` starts from (--draft):

    auto                     the default: early-exit:K for a target of at least AUTO_EARLY_EXIT_PARAMS parameters
                             (K: a twelfth of its layers, at least 1), else small (auto_draft says why)
    small[:HIDDEN[xLAYERS]]  a new model of the target's architecture, one layer (LAYERS), about 0.4 of its width
                             (HIDDEN), its embeddings the target's projected on their main directions
    early-exit[:K]           the target's embeddings, first K layers (1), final norm and head; the embeddings and
                             head stay the target's (frozen), the layers and the norm train
    eagle3                   a new EAGLE-3 head
    ID_OR_FOLDER             a causal LM sharing the target's tokenizer

All are float32 (the optimizer's master weights). What `describe_draft` says of each goes into the card.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch

from .distill_corpus import DistillError
from .eagle3_training import new_head_for
from .models import truncated_draft

DRAFT_KINDS = ("auto (early-exit for a target of 50M parameters or more, else small), small[:HIDDEN[xLAYERS]] (a new "
               "small model of the target's architecture), early-exit:K (the target's first K layers), eagle3 (a new "
               "EAGLE-3 head), or a causal LM's Hub id or folder")
SMALL_WIDTH = 0.4  # of the target's width: the demo pair's hand-made draft is 192 wide beside its target's 448
# A pretrained target this large knows more than a new draft learns in a run's minutes: its own first layers, with
# its embeddings and head, start agreeing at once. Below it (the demo's target) a new small draft catches up and
# costs less per drafted token.
AUTO_EARLY_EXIT_PARAMS = 50_000_000
AUTO_LAYERS_PER_EXIT_LAYER = 12  # early-exit:K keeps a twelfth of the target's layers (2 of a 30-layer target)


def target_parameters(target_config) -> int:
    """The target's parameter count, from its config alone (the model built on the meta device: no weights)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(target_config)
    except (ValueError, TypeError, AttributeError, ImportError):  # a config transformers cannot build alone
        text = target_config.get_text_config(decoder=True)
        return text.vocab_size * text.hidden_size + text.num_hidden_layers * 12 * text.hidden_size ** 2
    return sum(p.numel() for p in model.parameters())


def auto_draft(target_config) -> tuple[str, str]:
    """--draft auto: (the draft it stands for, why), by the target's size."""
    params = target_parameters(target_config)
    layers = target_config.get_text_config(decoder=True).num_hidden_layers
    if params >= AUTO_EARLY_EXIT_PARAMS and layers >= 2:
        keep = min(max(layers // AUTO_LAYERS_PER_EXIT_LAYER, 1), layers - 1)
        return f"early-exit:{keep}", (f"a {params / 1e6:.0f}M-parameter target of {layers} layers: its own first {keep} "
                                      f"layers, embeddings and head start agreeing at once, where a new draft must learn "
                                      "the language first")
    return "small", (f"a {params / 1e6:.1f}M-parameter target: a new small draft learns it within a run and costs less "
                     "per drafted token than its early exit")


def early_exit_layers(spec: str) -> int | None:
    """K of "early-exit:K" ("early-exit" alone: 1), or None for another kind of draft."""
    match = re.fullmatch(r"early-exit(?::(\d+))?", spec)
    if match is None:
        if spec.startswith("early-exit"):
            raise DistillError(f"--draft {spec!r}: write early-exit:K with K the number of the target's layers to keep.")
        return None
    layers = int(match.group(1) or 1)
    if layers < 1:
        raise DistillError(f"--draft {spec!r}: keep at least one layer (early-exit:1).")
    return layers


@dataclass(frozen=True)
class SmallShape:
    """A new draft's size; hidden None: SMALL_WIDTH of the target's, rounded to a multiple of 64."""

    hidden: int | None = None
    layers: int = 1


def small_shape(spec: str) -> SmallShape | None:
    """The shape of "small", "small:HIDDEN" or "small:HIDDENxLAYERS", or None for another kind of draft."""
    match = re.fullmatch(r"small(?::(\d+)(?:x(\d+))?)?", spec)
    if match is None:
        if spec.startswith("small"):
            raise DistillError(f"--draft {spec!r}: write small, small:HIDDEN or small:HIDDENxLAYERS (e.g. small:256x1).")
        return None
    hidden, layers = (int(match.group(1)) if match.group(1) else None), int(match.group(2) or 1)
    if layers < 1 or (hidden is not None and hidden < 1):
        raise DistillError(f"--draft {spec!r}: the width and the layers must be at least 1.")
    return SmallShape(hidden, layers)


def small_config(target_config, shape: SmallShape):
    """The target's text config cut to `shape`: attention heads of the target's head size, as many as the width's
    share of the target's (a config without its own head_dim: the width over the head size), the MLP and
    grouped-query attention in the target's ratios. DistillError when the shape does not fit the architecture."""
    config = copy.deepcopy(target_config.get_text_config(decoder=True))
    width, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    explicit = getattr(config, "head_dim", None)
    head_dim = explicit or width // heads
    hidden = shape.hidden or max(round(width * SMALL_WIDTH / 64), 1) * 64
    new_heads = max(round(heads * hidden / width), 1) if explicit else max(hidden // head_dim, 1)
    if not explicit and hidden % new_heads:
        raise DistillError(f"--draft small:{hidden}: {type(config).__name__} derives its head size from the width; give a "
                           f"multiple of the target's head size, {head_dim}.")
    new_kv = max(new_heads // max(heads // kv, 1), 1)
    while new_heads % new_kv:
        new_kv -= 1
    ratio = getattr(config, "intermediate_size", 4 * width) / width
    config.hidden_size, config.num_attention_heads = hidden, new_heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = new_kv
    if explicit:
        config.head_dim = head_dim
    if hasattr(config, "intermediate_size") and config.intermediate_size is not None:
        config.intermediate_size = max(round(hidden * ratio / 64), 1) * 64
    config.num_hidden_layers = shape.layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = (list(config.layer_types) * shape.layers)[: shape.layers]
    config.name_or_path = ""
    config.dtype = "float32"
    return config


@torch.no_grad()
def projected(weight: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """(V, H) rows on the (H, d) directions: (V, d)."""
    return weight.float() @ directions


@torch.no_grad()
def small_draft(target, shape: SmallShape, seed: int):
    """A new draft of `shape`, its layers at their initialisation (seeded), its input embeddings (and head) the
    target's projected on their top principal directions, so it starts from the target's own token geometry."""
    from transformers import AutoModelForCausalLM

    config = small_config(target.config, shape)
    torch.manual_seed(seed)
    try:
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, TypeError, AttributeError) as err:
        raise DistillError(f"--draft small: cannot build a small {type(target).__name__} ({err}); use --draft early-exit:1.") from err
    embeddings = target.get_input_embeddings().weight
    hidden = config.hidden_size
    width = embeddings.shape[1]
    if hidden < width:  # the top right singular vectors of the embeddings: the directions they vary most along
        _, _, v = torch.svd_lowrank(embeddings.float(), q=min(hidden + 8, width), niter=4)
        directions = v[:, :hidden].to(embeddings.device)  # (H, d)
    else:
        directions = torch.eye(width, hidden, device=embeddings.device)
    draft.get_input_embeddings().weight.copy_(projected(embeddings, directions))
    head, target_head = draft.get_output_embeddings(), target.get_output_embeddings()
    if head is not None and target_head is not None and head.weight is not draft.get_input_embeddings().weight:
        head.weight.copy_(projected(target_head.weight, directions))
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(embeddings.device)


def starting_draft(spec: str, target, seed: int, head_hidden: int | None = None):
    """The draft to train, in float32 (the optimizer's master weights)."""
    layers = early_exit_layers(spec)
    if layers is not None:
        try:
            draft = truncated_draft(target, layers)
            draft.name_or_path = draft.config.name_or_path = ""  # built in memory: the pair stores it under draft/
        except AttributeError as err:
            raise DistillError(f"--draft early-exit: cannot cut {type(target).__name__}'s layers ({err}); use another --draft.") from err
        draft = draft.float().requires_grad_(True)
        # the target's embeddings and head stay as they are (what the layers learn to feed): no gradient for the
        # vocabulary-sized matrices, no optimizer state for them
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
        return draft
    shape = small_shape(spec)
    if shape is not None:
        return small_draft(target, shape, seed).requires_grad_(True)
    if spec == "eagle3":
        return new_head_for(target, hidden=head_hidden, seed=seed).to(device=target.device, dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).to(target.device)


def describe_draft(spec: str, draft) -> str:
    """The starting draft in words, for the card."""
    params = sum(p.numel() for p in draft.parameters()) / 1e6
    if early_exit_layers(spec) is not None:
        trained = sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6
        return (f"an early exit of the target ({spec}: its embeddings, first layers, final norm and head; {params:.2f}M "
                f"parameters, of which the layers and norm train, {trained:.2f}M, and the embeddings and head stay the target's)")
    if small_shape(spec) is not None:
        c = draft.config
        return (f"a new {c.num_hidden_layers}-layer model of the target's architecture, width {c.hidden_size} ({params:.2f}M "
                "parameters), its embeddings the target's projected on their main directions")
    if spec == "eagle3":
        return f"a new EAGLE-3 head ({params:.2f}M parameters)"
    return f"`{spec}` ({params:.2f}M parameters)"
