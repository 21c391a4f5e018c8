"""Tree attention routing: the one place that decides how a model's tree steps attend.

A tree step's query at position p sees the committed positions its layer's rule allows (all of
them; a sliding window of p; p's chunk) plus its own tree ancestors that the same rule allows.
Each model's backend is resolved once per generation (`resolve_attention`), the model is routed
for the length of that generation only (`routed_attention`, which restores the user's
`attn_implementation` afterwards), and every tree forward takes its attention arguments from
`tree_step_kwargs`, built once per step and read by every layer:

    "triton" / "torch-reference"  the model runs with attn_implementation="swiftspec" (or
        "swiftspec_eager" for a model whose own attention is eager): the forward carries a
        `TreeStep` (prefix length, per window rule the tree mask packed to bits and each query's
        first visible prefix position). A layer the kernel cannot serve (attention sinks, keys and
        values of different widths) runs the model's own attention with a dense mask instead, and
        the step records why (`TreeStep.fallbacks`, shown in `swiftspec_stats.attention`). Any
        forward without a TreeStep (prefill, plain `target.generate`) runs the model's own attention.
    "sdpa" / "eager"              the model's own attention with dense additive 4D masks: one
        tensor, or {layer type: mask} when the model's layer types need different windows.
    "sdpa-grouped"                the same, for a model on a CPU whose query heads share key / value
        heads (grouped-query attention): it runs with attn_implementation="swiftspec_grouped", whose
        forwards of several queries with a mask (a tree, a prefill) attend the shared heads in place
        (`sdpa_grouped`) where transformers' sdpa copies each of them once per query head.
    chain-shaped models (architectures.py) get no mask at all: a chain over the cache is causal,
        and the model builds its own causal (and windowed) mask from the cache, by slot.

    SwiftSpecConfig.attention:
    "auto"   steps replayed as CUDA graphs (capture.py): the Triton kernel, whose launches a graph makes
             free; eager steps: the model's own attention + dense mask. On an H200 (Llama-3-8B shape, bf16,
             docs/source/en/gpu_results.md) an eager tree step is bound by the host's launches, and the kernel's
             Python launch per layer cost more (+0.5 to +9.4 ms in 7 of 8 verifications) than its faster
             attention saved
    "kernel" the Triton kernel wherever Triton runs (CUDA, or the CPU interpreter under
             TRITON_INTERPRET=1), else its plain-torch reference
    "model"  the model's own attention (sdpa or eager) with a dense additive 4D mask
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field

import torch
from swiftspec_kernels import pack_tree_mask, tree_attention, tree_attention_reference, triton_available
from transformers import AttentionInterface, AttentionMaskInterface

from ..models.architectures import FULL, Architecture, LayerMask
from ..models.compat import attn_implementation, can_set_attn_implementation, eager_mask, sdpa_attention_forward, sdpa_mask

ATTENTION_CHOICES = ("auto", "kernel", "model")
KERNEL_BACKENDS = ("triton", "torch-reference")
GROUPED = "sdpa-grouped"  # the model's own sdpa, grouped-query heads attended in place (sdpa_grouped)
ROUTED_BACKENDS = (*KERNEL_BACKENDS, GROUPED)  # the backends a model is routed for (routed_attention)
NAMES = {"sdpa": "swiftspec", "eager": "swiftspec_eager", GROUPED: "swiftspec_grouped"}  # routed name by backend
OWN_OF_ROUTED = {"swiftspec": "sdpa", "swiftspec_eager": "eager", "swiftspec_grouped": "sdpa"}  # a routed model's own


@dataclass
class RuleMasks:
    """One window rule's tree mask for a step.

    bits:          (1, Q, ceil(S / 32)) int32, the (Q, S) tree-region mask (rule applied) packed
    prefix_start:  (1, Q) int32, each query's first visible committed position; None: all of them
    """

    bits: torch.Tensor
    prefix_start: torch.Tensor | None


@dataclass
class TreeStep:
    """What every layer's attention needs for one tree forward (built once per step).

    prefix_len:  committed positions (None with `lengths`)
    rules:       {window rule: RuleMasks}
    layer_rules: per decoder layer, its window rule
    dense:       builds the dense additive mask of a rule, for layers the kernel cannot serve
    reference:   use the plain-torch reference instead of the Triton kernel
    fallbacks:   why layers ran their own attention in this step (filled while the step runs)
    lengths:     (B, 2) int32 on the device, each row's prefix and tree region length, for a fixed step
                 (capture.py) whose layers see the whole cache; then prefix_start is in slots
    """

    prefix_len: int | None
    rules: dict[LayerMask, RuleMasks]
    layer_rules: tuple[LayerMask, ...]
    dense: object
    reference: bool = False
    fallbacks: set[str] = field(default_factory=set)
    lengths: torch.Tensor | None = None

    def rule_of(self, module) -> LayerMask:
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None or layer_idx >= len(self.layer_rules):
            (rule,) = set(self.layer_rules) or {FULL}  # a module without layer_idx: one rule for all
            return rule
        return self.layer_rules[layer_idx]


def kernel_gap(module, key, value, kwargs) -> str | None:
    """Why the tree kernel cannot serve this layer, or None."""
    if kwargs.get("s_aux") is not None:
        return "attention sinks"
    if key.shape != value.shape:
        return "keys and values of different widths"
    return None


def swiftspec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, own="sdpa", **kwargs):
    """AttentionInterface function: q (B, H, Q, D), k/v (B, Hkv, KV, D) -> ((B, Q, H, D), None)."""
    step: TreeStep | None = kwargs.pop("swiftspec_tree", None)
    own_attention = own_attention_of(module, own)
    if step is None:
        return own_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    rule = step.rule_of(module)
    gap = kernel_gap(module, key, value, kwargs)
    if gap is not None:
        step.fallbacks.add(gap)
        mask = step.dense(rule)
        return own_attention(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    masks = step.rules[rule]
    attend = tree_attention_reference if step.reference else eager_kernel
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend(
        query, key, value, step.prefix_len, masks.bits, scale,
        prefix_start=masks.prefix_start, softcap=kwargs.get("softcap"), lengths=step.lengths,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def eager_kernel(query, key, value, prefix_len, bits, scale, *, prefix_start=None, softcap=None, lengths=None):
    """tree_attention; a step with device lengths (a fixed step, capture.py) calls it as one opaque operator, so
    compiled decoder layers trace it whole instead of breaking their graph around the launch, and a CUDA graph
    captures its launch like any other."""
    if lengths is None:
        return tree_attention(query, key, value, prefix_len, bits, scale, prefix_start=prefix_start, softcap=softcap)
    return tree_attention_op()(query, key, value, bits, scale, prefix_start, softcap, lengths)


@functools.cache
def tree_attention_op():
    """swiftspec::tree_attention, registered with torch on first use: the kernel with per-row device lengths as
    a custom operator (its fake implementation gives the output's shape to torch.compile)."""

    @torch.library.custom_op("swiftspec::tree_attention", mutates_args=())
    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bits: torch.Tensor, scale: float,
           prefix_start: torch.Tensor | None, softcap: float | None, lengths: torch.Tensor) -> torch.Tensor:
        return tree_attention(query, key, value, None, bits, scale, prefix_start=prefix_start, softcap=softcap,
                              lengths=lengths)

    @op.register_fake
    def _(query, key, value, bits, scale, prefix_start, softcap, lengths):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    return op


def sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, attending grouped-query heads in place where it would copy them. Its sdpa
    takes GQA only without a mask (use_gqa_in_sdpa: CUDA's kernels need none), so a forward of several queries with a
    mask (a tree's, a prefill's) repeats every key and value head once per query head sharing it (repeat_kv); torch's
    CPU kernel takes the mask with enable_gqa, bitwise the same (tests/test_attention_wiring.py): a forward of 3-8 tree
    nodes of a 9-query / 3-key-head 135M model ran 1.02-1.12x faster at 300-800 keys
    (examples/results/cpu-grouped-attention). A single query (transformers packs its heads), a layer with attention
    sinks or a position bias, keys and values of other widths and training run transformers' function unchanged. q (B, H, Q, D), k / v (B, Hkv, KV, D) -> ((B, Q, H, D), None)."""
    plain = (query.shape[2] == 1 or attention_mask is None or key.shape[1] == query.shape[1] or module.training
             or key.shape[-1] != value.shape[-1] or kwargs.get("s_aux") is not None
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                           scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def groups_heads_on_cpu(model) -> bool:
    """Whether `model` runs on a CPU with sdpa and fewer key / value heads than query heads (GROUPED's models)."""
    config = model.config.get_text_config(decoder=True)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return (model.device.type == "cpu" and own_implementation(model) == "sdpa" and isinstance(heads, int)
            and isinstance(kv_heads, int) and 0 < kv_heads < heads)


def own_attention_of(module, own: str):
    """The model's own attention function: sdpa (GROUPED: sdpa_grouped), or the eager function of its modeling file."""
    if own == GROUPED:
        return sdpa_grouped
    if own == "sdpa":
        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward in its modeling file to fall back on; use "
            "SwiftSpecConfig.attention='model' for this model."
        )
    return eager


def register_tree_attention() -> None:
    """Make attn_implementation="swiftspec" / "swiftspec_eager" / "swiftspec_grouped" known to transformers
    (idempotent)."""
    for own, name in NAMES.items():
        AttentionInterface.register(name, functools.partial(swiftspec_attention, own=own))
        AttentionMaskInterface.register(name, eager_mask if own == "eager" else sdpa_mask)


def resolve_attention(choice: str, model, architecture: Architecture | None = None, replayed: bool = False) -> str:
    """The backend a model's tree steps use: "triton", "torch-reference", or its own ("sdpa"/"eager").
    replayed: its steps are CUDA graphs (capture.py), where "auto" takes the kernel: a launch costs nothing
    there, and the steps see the whole cache, which sdpa reads through a dense mask."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"SwiftSpecConfig.attention={choice!r}; use one of {ATTENTION_CHOICES}.")
    own = own_implementation(model)
    kernel_ok = can_set_attn_implementation(model) and (architecture is None or architecture.shape == "tree")
    if kernel_ok and choice == "kernel":
        return "triton" if triton_available(model.device) else "torch-reference"
    if kernel_ok and choice == "auto" and replayed and model.device.type == "cuda" and triton_available(model.device):
        return "triton"
    if choice == "auto" and can_set_attn_implementation(model) and groups_heads_on_cpu(model):
        return GROUPED
    return own


def own_implementation(model) -> str:
    own = attn_implementation(model.config) or "sdpa"
    return OWN_OF_ROUTED.get(own, own)


@contextlib.contextmanager
def routed_attention(model, backend: str):
    """Route `model`'s attention through swiftspec_attention for a kernel backend or GROUPED, for the duration
    of the block only: the user's attn_implementation is restored afterwards, also on failure."""
    if backend not in ROUTED_BACKENDS:
        yield
        return
    own = attn_implementation(model.config) or "sdpa"
    register_tree_attention()
    routed = NAMES[GROUPED] if backend == GROUPED else NAMES.get(own_implementation(model), NAMES["sdpa"])
    model.set_attn_implementation(routed)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


@dataclass
class StepLayout:
    """Where one batched forward's queries sit in a TreeCache and what each may see (built once per step).

    starts:       per row, the cache's left padding (slots before it are never attended)
    prefix_lens:  per row, committed slots before the step; each row's region starts there
    regions:      per row, (n_b, S_b) bool: what each of its n_b real queries sees of its S_b region
                  slots [prefix_len, prefix_len + S_b) (tree slots already cached, then this step's)
    q_positions:  (B, Q) long, each query's position (padding queries: 0)
    region_positions: per row, (S_b,) long positions of its region slots (needed when a layer has a
                  window; None otherwise)
    width:        W, the KV length the step attends
    """

    starts: list[int]
    prefix_lens: list[int]
    regions: list[torch.Tensor]
    q_positions: torch.Tensor
    region_positions: list[torch.Tensor | None]
    width: int

    @property
    def single(self) -> bool:
        """One row without padding, as the kernel's TreeStep describes a step."""
        return len(self.regions) == 1 and self.starts[0] == 0 and self.regions[0].shape[0] == self.q_positions.shape[1]


def dense_tree_mask(layout: StepLayout, dtype: torch.dtype, rule: LayerMask = FULL) -> torch.Tensor:
    """Additive 4D mask (B, 1, Q, W) of a step: each real query sees its row's committed slots its
    layer's rule allows and the region slots its tree mask allows; a padding query sees only its
    row's first slot (so softmax stays finite; its output is discarded).

    Additive (0 / dtype min) rather than bool because eager attention adds whatever it is given.
    """
    q = layout.q_positions
    B, Q = q.shape
    device = q.device
    if B == 1 and Q == 1 and layout.starts[0] == 0 and layout.regions[0].shape == (1, 1) and rule.kind == "full" \
            and layout.width == layout.prefix_lens[0] + 1:  # a plain step: its root sees every slot (and itself)
        return torch.zeros(1, 1, 1, layout.width, dtype=dtype, device=device)
    slots = torch.arange(layout.width, device=device)
    starts = torch.tensor(layout.starts, device=device)[:, None]
    prefixes = torch.tensor(layout.prefix_lens, device=device)[:, None]
    committed = (slots >= starts) & (slots < prefixes)  # (B, W)
    allowed = committed[:, None, :].expand(B, Q, layout.width).clone()  # (B, Q, W)
    kv_positions = slots[None, :] - starts if rule.kind != "full" else None  # committed slots' positions
    for b, region in enumerate(layout.regions):
        n, size = region.shape
        prefix = layout.prefix_lens[b]
        allowed[b, n:] = False
        allowed[b, n:, layout.starts[b]] = True
        allowed[b, :n, prefix : prefix + size] = region
        if kv_positions is not None:
            kv_positions[b, prefix : prefix + size] = layout.region_positions[b]
    if kv_positions is not None:
        real = torch.tensor([r.shape[0] for r in layout.regions], device=device)[:, None] > torch.arange(Q, device=device)
        allowed &= rule.visible(q, kv_positions) | ~real[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def tree_step_kwargs(backend: str, architecture: Architecture, layout: StepLayout, dtype: torch.dtype) -> dict:
    """Forward kwargs that make every layer attend what `layout` says each query sees.

    The kernel serves one unpadded row (its TreeStep has one prefix length); batches take the dense
    masks, through the model's own attention.
    """
    if architecture.shape == "chain":
        return {}
    rules = architecture.rules
    if backend in KERNEL_BACKENDS and layout.single:
        prefix_len, tree_mask = layout.prefix_lens[0], layout.regions[0]
        q_positions, kv_positions = layout.q_positions[0], layout.region_positions[0]
        dense = functools.cache(lambda rule: dense_tree_mask(layout, dtype, rule))
        step = TreeStep(
            prefix_len,
            {rule: rule_masks(rule, tree_mask, q_positions, kv_positions) for rule in rules},
            architecture.layer_masks,
            dense,
            reference=backend == "torch-reference",
        )
        # Any 4D mask passes through transformers' masking unchanged and the kernel reads the TreeStep
        # instead, so a one-element stand-in spares building the dense (Q, prefix + S) mask.
        stand_in = torch.zeros(1, 1, 1, 1, dtype=dtype, device=tree_mask.device)
        return {"attention_mask": stand_in, "swiftspec_tree": step}
    return {"attention_mask": architecture.attention_mask(lambda rule: dense_tree_mask(layout, dtype, rule))}


def slot_step_kwargs(backend: str, architecture: Architecture | None, prefix_lens: torch.Tensor, region: torch.Tensor,
                     positions: torch.Tensor, region_positions: torch.Tensor, span: int, dense, dtype: torch.dtype,
                     fallbacks: set[str]) -> dict:
    """Forward kwargs that make every layer of a slot cache's forward (steps/slot_cache.py, the device round's) attend
    through the tree kernel, from device tensors alone (no host read: a replayed phase's forwards): each row's keys
    are its committed slots [0, prefix_len) (slot j holds position j), then its region [prefix_len, prefix_len + S),
    cut at the `span` keys the forward is given.

    prefix_lens:      (B,) long         each row's committed slots
    region:           (B, Q, S) bool    the region slots each query sees (tree ancestors, or a catch-up's causal rows)
    positions:        (B, Q) or (B, 1) long   each query's position; region_positions (B, S) long each region slot's
                                        (a window's term: a rule's first visible position, LayerMask.first_visible)
    dense(rule):      that rule's dense additive mask (B, 1, Q, span), built only for layers the kernel cannot serve
                      (kernel_gap), whose reasons go to `fallbacks`
    """
    B, Q, S = region.shape
    lengths = torch.stack([prefix_lens, (span - prefix_lens).clamp(0, S)], dim=1).to(torch.int32)  # (B, 2)
    rules = {}
    for rule in architecture.rules if architecture is not None else (FULL,):
        if rule.kind == "full":
            rules[rule] = RuleMasks(pack_tree_mask(region), None)
            continue
        first = rule.first_visible(positions).expand(B, Q)
        seen = region & (region_positions[:, None, :] >= first[:, :, None])
        rules[rule] = RuleMasks(pack_tree_mask(seen), first.to(torch.int32))
    step = TreeStep(None, rules, architecture.layer_masks if architecture is not None else (), functools.cache(dense),
                    reference=backend == "torch-reference", fallbacks=fallbacks, lengths=lengths)
    stand_in = torch.zeros(1, 1, 1, 1, dtype=dtype, device=region.device)  # the kernel reads the step instead
    return {"attention_mask": stand_in, "swiftspec_tree": step}


def rule_masks(rule: LayerMask, tree_mask: torch.Tensor, q_positions, kv_positions) -> RuleMasks:
    """The kernel's view of one rule: the tree mask with the rule applied, packed, and prefix bounds."""
    if rule.kind == "full":
        return RuleMasks(pack_tree_mask(tree_mask[None]), None)
    allowed = tree_mask & rule.visible(q_positions, kv_positions)
    return RuleMasks(pack_tree_mask(allowed[None]), rule.first_visible(q_positions).to(torch.int32)[None])


def fixed_step_inputs(backend: str, architecture: Architecture, layout: StepLayout, dtype: torch.dtype,
                      fallbacks: set[str]):
    """A fixed step's attention (capture.py: its layers see all W = layout.width slots) as (tensors, build):
    `tensors` {name: tensor} is what changes from step to step, `build(tensors)` the forward kwargs made of
    them, so a replayed step can read static copies. Kernel backends: per-row device lengths, each rule's
    bits over the W slots after a row's prefix and its first visible slot per query, and the dense masks for
    layers the kernel cannot serve (their reasons go to `fallbacks`); other backends: the dense masks."""
    rules = architecture.rules
    tensors = {f"dense/{i}": dense_tree_mask(layout, dtype, rule) for i, rule in enumerate(rules)}
    if backend not in KERNEL_BACKENDS:
        def build(t: dict) -> dict:
            return {"attention_mask": architecture.attention_mask(lambda rule: t[f"dense/{rules.index(rule)}"])}

        return tensors, build
    device = layout.q_positions.device
    counts = [region.shape[0] for region in layout.regions]
    lengths = [[p, region.shape[1]] for p, region in zip(layout.prefix_lens, layout.regions)]
    tensors["lengths"] = torch.tensor(lengths, dtype=torch.int32, device=device)
    starts = torch.tensor(layout.starts, device=device)[:, None]  # (B, 1) first committed slot
    B, Q = layout.q_positions.shape
    for i, rule in enumerate(rules):
        allowed = torch.zeros(B, Q, layout.width, dtype=torch.bool, device=device)  # tree columns after each prefix
        for b, region in enumerate(layout.regions):
            if rule.kind != "full":
                region = region & rule.visible(layout.q_positions[b, : counts[b]], layout.region_positions[b])
            allowed[b, : counts[b], : region.shape[1]] = region
        tensors[f"bits/{i}"] = pack_tree_mask(allowed)
        # Padding queries see their row's committed slots: finite, and discarded.
        tensors[f"start/{i}"] = (starts + rule.first_visible(layout.q_positions)).to(torch.int32)

    def build(t: dict) -> dict:
        dense = {rule: t[f"dense/{i}"] for i, rule in enumerate(rules)}
        step = TreeStep(
            None, {rule: RuleMasks(t[f"bits/{i}"], t[f"start/{i}"]) for i, rule in enumerate(rules)},
            architecture.layer_masks, dense.__getitem__, reference=backend == "torch-reference", fallbacks=fallbacks,
            lengths=t["lengths"],
        )
        return {"attention_mask": t["dense/0"], "swiftspec_tree": step}  # the kernel reads the step instead

    return tensors, build
