"""What a model's tree steps need, read from its config and classes alone: support by capability.

`describe_class(config, model_class, ...)` returns an `Architecture`, or raises
`UnsupportedArchitecture` naming the capability that is missing; nothing here runs a model
(probes.py adds the checks that need a forward: `probes.describe(model)`). Nothing here knows a
model type by name: every decision comes from what transformers itself uses to build the model's
cache and masks (`get_layer_types_and_kwargs`, `config.layer_types`), the forward's signature,
flags the model class declares, and the config fields of SLOT_RULES.

Tree steps pass each layer a 4D mask: a node at position p sees the committed positions its layer
type allows (all of them, a sliding window of p, or p's chunk) and its own ancestors in the tree
that the same rule allows. Models that place tokens by their cache slot instead of their
`position_ids` (ALiBi biases built from the cache length, forwards without `position_ids`) see
the right positions only when every step is a chain: they speculate along a chain (`shape`).
So do models with layers that keep a recurrent or convolution state (recurrent.py keeps it on the
accepted path), provided one forward over several tokens continues that state.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import GenerationMixin

from .compat import (
    CACHE_ARGUMENTS,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    attn_implementation,
    get_layer_types_and_kwargs,
    outside_state,
    prepare_inputs,
)

# Layer types whose cache holds keys and values per position, and how a query's window is bounded.
MASKED_LAYER_TYPES = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "indexed_attention": "full",  # sparse attention picks among the keys the mask allows
}
# Layer types that keep a state other than per-position keys and values (recurrent.py), and what.
RECURRENT_LAYER_TYPES = {
    "linear_attention": "recurrent",
    "conv": "convolution",
    "hybrid": "recurrent",  # beside the layer's attention
    "hybrid_sliding": "recurrent",
}
# The masking_utils builders a modeling file imports when its masks apply each kind of window.
WINDOWED_MASK_BUILDERS = {
    "sliding": ("create_sliding_window_causal_mask", "create_masks_for_generate"),
    "chunked": ("create_chunked_causal_mask", "create_masks_for_generate"),
}
NO_CACHE_LAYER_TYPES = ("dummy",)  # layers without KV of their own (MLP-only, or reusing another layer's)
# implementations that take a 4D mask (the model's own, and steps/attention.py's routed names)
TREE_MASK_ATTENTION = ("sdpa", "eager", "swiftspec", "swiftspec_eager", "swiftspec_grouped")


class UnsupportedArchitecture(ValueError):
    """A model whose tree steps could not be exact; the message names the capability and the fix.

    recurrent: the model keeps a recurrent state (it is not an attention-only decoder).
    """

    def __init__(self, message: str, recurrent: bool = False):
        super().__init__(message)
        self.recurrent = recurrent


@dataclass(frozen=True)
class LayerMask:
    """Which committed positions a query at position p sees in one kind of layer.

    kind: "full" (all of them), "sliding" (p - size < j <= p), "chunked" (j // size == p // size)
    """

    kind: str = "full"
    size: int | None = None

    def first_visible(self, positions: torch.Tensor) -> torch.Tensor:
        """(Q,) the first position each query at `positions` (Q,) sees (all later ones up to p too)."""
        if self.kind == "sliding":
            return (positions - self.size + 1).clamp(min=0)
        if self.kind == "chunked":
            return positions - positions % self.size
        return torch.zeros_like(positions)

    def visible(self, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> torch.Tensor:
        """(..., Q, KV) bool: whether a query at q_positions (..., Q) may see a key at kv_positions (..., KV)."""
        return kv_positions[..., None, :] >= self.first_visible(q_positions)[..., :, None]


FULL = LayerMask()


@dataclass(frozen=True)
class SlotLimit:
    """A rule a model's attention module applies by cache slot, or by how many keys a forward holds, where
    transformers' own decoding has slot = position. A tree node sits at a slot past its position, so tree
    steps reproduce the rule only while every slot a verification fills stays below `length`; a call that
    may reach it decodes as `beyond` says from its start: "chain" (along a chain slot = position again) or
    "plain" (only one-token steps are exact: transformers' own loop).

    reason: completes "The target (type) ..." in warnings and refusals.
    """

    length: int
    beyond: str
    reason: str


@dataclass(frozen=True)
class SlotRule:
    """Where a model type's config declares a SlotLimit: the field that sizes it (under the name that model
    type uses), when it is in force, and how the limit follows from the field's value."""

    field: str
    applies: Callable
    beyond: str
    reason: str  # with {size}: the field's value
    offset: int = 0  # the limit is the field's value plus this


def layer_pattern(config) -> list[str]:
    """GPT-Neo's per-layer attention kinds ("global" / "local"), flattened from its config."""
    return [str(kind) for kind in (getattr(config, "attention_layers", None) or [])]


def has_layer_type(config, layer_type: str) -> bool:
    try:
        return layer_type in get_layer_types_and_kwargs(config)[0]
    except Exception:  # noqa: BLE001 - a config transformers cannot type: describe_class refuses it, naming why
        return False


# Rules that attention modules apply by cache slot, under the config field each model type declares them by
# (a survey of every causal-LM type of transformers 5.23-5.24). Windows, chunks and indexers that transformers'
# mask functions apply by position are not here: architectures take those from get_layer_types_and_kwargs.
SLOT_RULES = (
    # gpt_neo: GPTNeoSelfAttention._attn bands its own causal mask by key slot, self.bias[key_len - q_len : key_len]
    SlotRule("window_size", lambda c: "local" in layer_pattern(c), "chain",
             "applies its local layers' {size}-token window inside its attention, by cache slot"),
    # llama4: Llama4TextAttention scales NoPE layers' queries by log1p(floor((slot + 1) / floor_scale))
    SlotRule("floor_scale", lambda c: bool(getattr(c, "attn_temperature_tuning", False)) and 0 in (getattr(c, "no_rope_layers", None) or [0]),
             "chain", "scales its NoPE layers' queries by a temperature that steps every {size} cache slots", offset=-1),
    # doge: DogeAttention.prepare_dynamic_mask keeps the top keep_window_size keys once a forward holds more slots
    SlotRule("keep_window_size", lambda c: True, "plain",
             "keeps only its {size} best-scored keys once a forward holds more than {size} cache slots"),
    # sparse-attention indexers (deepseek_v32, axk2, glm_moe_dsa, hy_v4...): topk(min(index_topk, slots)) over the
    # query's whole row of slots, masked ones included; torch.topk breaks exact ties (a zero-embedding pad token
    # scores 0 against every key) by the row's length and layout, which only one-token decoding reproduces
    SlotRule("index_topk", lambda c: has_layer_type(c, "indexed_attention"), "plain",
             "keeps the top {size} keys its indexer scores, and which of equally scored keys it keeps depends on how "
             "many cache slots a forward holds"),
)  # fmt: skip


def slot_limits(config) -> tuple[SlotLimit, ...]:
    """The SlotLimits a (text) config declares (SLOT_RULES)."""
    limits = []
    for rule in SLOT_RULES:
        size = getattr(config, rule.field, None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0 and rule.applies(config):
            limits.append(SlotLimit(size + rule.offset, rule.beyond, rule.reason.format(size=size)))
    return tuple(limits)


@dataclass(frozen=True)
class Architecture:
    """What the tree steps of one model need.

    model_type:   the (text) config's model type, for messages
    layer_types:  per decoder layer, transformers' cache layer type ("full_attention", "dummy", ...)
    layer_masks:  per decoder layer, its window rule (FULL for layers without KV)
    mask_by_type: the forward takes {layer type: 4D mask} (config.layer_types) rather than one mask
    chain_reason: why this model's steps must be chains, or None when trees are exact
    layer_states: per decoder layer, how many recurrent / convolution states it keeps (0: none)
    slot_limits:  rules its attention applies by cache slot (SlotLimit): trees are exact below them only
    headless:     its forward takes logits_to_keep as row indices, so a forward run for its KV alone (a
                  catch-up) skips the vocabulary head with an empty index (seen when it runs: probes.py)
    """

    model_type: str
    layer_types: tuple[str, ...]
    layer_masks: tuple[LayerMask, ...]
    mask_by_type: bool = False
    chain_reason: str | None = None
    layer_states: tuple[int, ...] = ()
    slot_limits: tuple[SlotLimit, ...] = ()
    headless: bool = False

    def limits_reached(self, slots: int) -> tuple[SlotLimit, ...]:
        """The slot limits a call whose steps fill up to `slots` slots per row reaches (empty: trees are exact)."""
        return tuple(limit for limit in self.slot_limits if slots > limit.length)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a state that every token advances (recurrent.py rolls it back)."""
        return any(self.layer_states)

    @property
    def shape(self) -> str:
        """"tree", or "chain" where positions follow cache slots."""
        return "tree" if self.chain_reason is None else "chain"

    @functools.cached_property
    def masks(self) -> dict[str, LayerMask]:
        """{layer type: its window rule} over the layers that keep KV, in layer order."""
        return {t: m for t, m in zip(self.layer_types, self.layer_masks) if t in MASKED_LAYER_TYPES}

    @functools.cached_property
    def rules(self) -> tuple[LayerMask, ...]:
        """The distinct window rules a tree step builds masks for (one per step, shared by layers)."""
        return tuple(dict.fromkeys(self.masks.values())) or (FULL,)

    @functools.cached_property
    def windowed(self) -> bool:
        """Whether some layer sees less than every committed position (masks then need positions)."""
        return any(m.kind != "full" for m in self.layer_masks)

    @property
    def sliding(self) -> tuple[bool, ...]:
        """Per layer, whether transformers' own cache would treat it as sliding (its mask helpers ask)."""
        return tuple(m.kind != "full" for m in self.layer_masks)

    def attention_mask(self, build: Callable[[LayerMask], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """A forward's attention_mask from build(rule), one window rule's 4D mask, built once per rule: that mask
        where every layer shares one rule (full attention: build(FULL) alone), else {layer type: its rule's mask}
        (the forward then takes one per layer type: mask_by_type)."""
        masks = {rule: build(rule) for rule in self.rules}
        if len(masks) == 1:
            return next(iter(masks.values()))
        return {layer_type: masks[rule] for layer_type, rule in self.masks.items()}


def kv_heads_hint(model) -> str:
    """The fix, when latent attention's num_key_value_heads makes it repeat keys it already has per head."""
    text = model.config.get_text_config(decoder=True)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and heads != kv_heads and getattr(text, "kv_lora_rank", None)):
        return ""
    return (
        f"; its latent attention gives each of its {heads} query heads its own keys, but num_key_value_heads="
        f"{kv_heads} makes its attention repeat them {heads // kv_heads}x whenever it is given a mask: set "
        f"num_key_value_heads={heads} in its config (no weight depends on it)"
    )


def first_line(error: BaseException, limit: int = 200) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text[:limit]


def context_limit(*models) -> int | None:
    """The most positions every one of `models` can place a token at (max_position_embeddings; a
    learned position embedding has no row past it), or None when none of them says."""
    limits = [getattr(m.config.get_text_config(decoder=True), "max_position_embeddings", None) for m in models]
    limits = [n for n in limits if isinstance(n, int) and n > 0]
    return min(limits) if limits else None


CROSS_ATTENTION_NAMES = ("encoder_attn", "cross_attn", "crossattention")  # transformers' names for attending an encoder


def bidirectional_suspects(model) -> list[str]:
    """Self-attention modules of `model` that declare is_causal=False (cross-attention, which a causal LM
    without an encoder never runs, excepted), plus "config.is_causal=False" when the config says so: a
    suspect decoder, which probes.check_causal confirms with a forward (some flag their attention so and
    mask it causally all the same)."""
    decoder = model.get_decoder() or model
    suspects = [
        name
        for name, module in decoder.named_modules()
        if getattr(module, "is_causal", True) is False and not getattr(module, "is_cross_attention", False)
        and not any(part in name.rsplit(".", 1)[-1].lower() for part in CROSS_ATTENTION_NAMES)
    ]
    if getattr(model.config.get_text_config(decoder=True), "is_causal", True) is False:
        suspects.append("config.is_causal=False")
    return suspects


def bidirectional_refusal(suspects: list[str], who: str) -> UnsupportedArchitecture:
    named = ", ".join(s for s in suspects[:2] if s != "config.is_causal=False") or "config.is_causal=False"
    return UnsupportedArchitecture(
        f"{who} attends bidirectionally ({named} set is_causal=False), so its own generate lets prompt tokens see "
        "later ones. Load it as a decoder (is_decoder=True in its config) or use swiftspec=False."
    )


def check_config(config, role: str) -> None:
    """Load-time check on a config alone (no weights): what describe() would refuse, as far as the
    config and the class transformers maps it to tell. Raises UnsupportedArchitecture."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config.get_text_config(decoder=True)), None)
    model_class = model_class or MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    architecture = describe_class(config, model_class, attn_implementation(config) or "sdpa", role)
    if model_class is not None:
        check_causal_config(config, model_class, f"The {role} ({architecture.model_type})")


def check_causal_config(config, model_class, who: str) -> None:
    """check_causal before any weights load: the class built on the meta device (no memory, ~0.1 s
    for a 70B config) says whether its self-attention is causal, which a config alone does not (a
    BERT config's is_decoder=False makes an encoder; GPT-NeoX's is_decoder=False means nothing)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # BertLMHeadModel warns that it wants is_decoder=True: the refusal below says so
    try:
        with torch.device("meta"):
            model = model_class(copy.deepcopy(config))  # a model's __init__ writes into its config
    except Exception:  # noqa: BLE001 - a class that will not build from its config alone is left to load time
        return
    finally:
        hf_logging.set_verbosity(verbosity)
    suspects = bidirectional_suspects(model)  # meta weights: the attributes alone
    if suspects:
        raise bidirectional_refusal(suspects, who)


def describe_model(model, role: str = "model") -> Architecture:
    """describe_class for a loaded model, from its config and class alone (no forward: probes.describe adds the
    checks that run one)."""
    return describe_class(model.config, type(model), attn_implementation(model.config) or "sdpa", role)


def describe_class(config, model_class, attn: str, role: str) -> Architecture:
    """describe() from a config, its model class (None: unknown, e.g. remote code) and attention."""
    text_config = config.get_text_config(decoder=True)
    who = f"The {role} ({text_config.model_type})"
    if getattr(text_config, "is_encoder_decoder", False):
        raise UnsupportedArchitecture(f"{who} is an encoder-decoder model; tree speculation needs a decoder-only model.")
    if attn not in TREE_MASK_ATTENTION:
        raise UnsupportedArchitecture(
            f"{who} uses attn_implementation={attn!r}, which cannot take a tree mask; load it with "
            "attn_implementation='sdpa' or 'eager'."
        )
    layer_types, layer_kwargs = layer_types_of(text_config, who)
    for layer_type in layer_types:
        if not (layer_type in MASKED_LAYER_TYPES or layer_type in NO_CACHE_LAYER_TYPES or layer_type in RECURRENT_LAYER_TYPES):
            raise UnsupportedArchitecture(
                f"{who} has layers of type {layer_type!r}, whose cache layer keeps more than keys and values per "
                "position; the tree cache cannot hold it. Use swiftspec=False for this model."
            )
    layer_states = tuple(kw.get("number_of_states", 1) if t in RECURRENT_LAYER_TYPES else 0
                         for t, kw in zip(layer_types, layer_kwargs))  # fmt: skip
    parameters = inspect.signature(model_class.forward).parameters if model_class is not None else None
    own_generate = getattr(model_class, "generate", None)
    if own_generate is not None and own_generate is not GenerationMixin.generate:
        raise UnsupportedArchitecture(
            f"{who} has a generate() of its own ({own_generate.__qualname__}), which does more than transformers' "
            "decoding loop that swiftspec=True replaces (e.g. a delay pattern across codebooks). Use "
            "swiftspec=False for this model."
        )
    outside = outside_state(model_class, parameters) if model_class is not None else None
    if outside and not any(layer_states):
        raise UnsupportedArchitecture(
            f"{who} keeps a recurrent state outside its cache's layers ({outside}, and no "
            "layer type is one of transformers' state layers), so it cannot be rolled back to the accepted path. "
            "Use swiftspec=False for this model.",
            recurrent=True,
        )
    if parameters is not None and not any(name in parameters for name in CACHE_ARGUMENTS):
        raise UnsupportedArchitecture(
            f"{who} takes no cache in its forward (no argument named {' / '.join(CACHE_ARGUMENTS)}), so it keeps no "
            "cache swiftspec could give it to build on the committed tokens. Use swiftspec=False for this model."
        )
    layer_masks = tuple(layer_mask(t, kw) for t, kw in zip(layer_types, layer_kwargs))
    mask_by_type = getattr(text_config, "layer_types", None) is not None
    check_one_mask_per_type(layer_types, layer_masks, mask_by_type, who)
    check_windows_are_masked(layer_masks, model_class, who)
    reason = chain_reason(text_config, parameters)
    stateful = [t for t, n in zip(layer_types, layer_states) if n]
    if stateful:  # the reason a reader recognises first, whatever else holds
        kinds = " or ".join(sorted({RECURRENT_LAYER_TYPES[t] for t in stateful}, reverse=True))
        reason = f"its {'/'.join(dict.fromkeys(stateful))} layers keep a {kinds} state, which follows one path"
    return Architecture(
        text_config.model_type, tuple(layer_types), layer_masks, mask_by_type, reason, layer_states,
        slot_limits(text_config),
    )


def layer_types_of(config, who: str) -> tuple[list[str], list[dict]]:
    """transformers' per-layer cache types and their arguments (window sizes), as its own cache reads them."""
    try:
        return get_layer_types_and_kwargs(config)
    except Exception as error:  # a config transformers cannot build a cache from either
        raise UnsupportedArchitecture(f"{who}: cannot tell its layer types ({error}); use swiftspec=False.") from error


def layer_mask(layer_type: str, kwargs: dict) -> LayerMask:
    kind = MASKED_LAYER_TYPES.get(layer_type, "full")
    size = kwargs.get("sliding_window")
    return FULL if kind == "full" or size is None else LayerMask(kind, int(size))


def check_one_mask_per_type(layer_types, layer_masks, mask_by_type: bool, who: str) -> None:
    """The forward takes one mask per layer type (or one for all): layers sharing it need one window."""
    rules: dict[str, set[LayerMask]] = {}
    for layer_type, mask in zip(layer_types, layer_masks):
        if layer_type in MASKED_LAYER_TYPES:
            rules.setdefault(layer_type if mask_by_type else "all", set()).add(mask)
    for layer_type, masks in rules.items():
        if len(masks) > 1:
            raise UnsupportedArchitecture(
                f"{who} has layers of type {layer_type!r} with different windows {sorted(m.size or 0 for m in masks)}, "
                "but its forward takes a single mask for all of them. Use swiftspec=False for this model."
            )


def check_windows_are_masked(layer_masks, model_class, who: str) -> None:
    """A window must come from the model's masks, not only from its cache.

    transformers' cache keeps the last `window` positions of a sliding layer either way; a model
    whose modeling code builds no windowed mask then attends everything in its prefill but only
    the window afterwards, which no single mask rule reproduces.
    """
    if model_class is None:
        return
    module = sys.modules.get(model_class.__module__)
    for mask in set(layer_masks):
        builders = WINDOWED_MASK_BUILDERS.get(mask.kind, ())
        if builders and not any(hasattr(module, name) for name in builders):
            raise UnsupportedArchitecture(
                f"{who} keeps a {mask.size}-token {mask.kind} window in its cache but builds no {mask.kind} mask, so "
                "its prefill sees further back than its decoding; no tree mask reproduces both. Use swiftspec=False "
                "for this model."
            )


def chain_reason(config, parameters) -> str | None:
    """Why the model's steps must be chains (its positions follow cache slots), or None."""
    if parameters is not None and "position_ids" not in parameters:
        return "its forward takes no position_ids, so positions follow cache slots"
    if uses_alibi(config):
        return "its ALiBi bias is built from cache slots"
    return None


def uses_alibi(config) -> bool:
    """Whether attention biases come from ALiBi, which transformers builds from the cache length."""
    attn_config = getattr(config, "attn_config", None)
    flags = (getattr(config, "alibi", False), getattr(attn_config, "alibi", False))
    return any(flag is True for flag in flags) or getattr(config, "position_embedding_type", None) == "alibi"
