"""Which causal-LM types of the installed transformers speculate, and how: the architecture sweep.

Every model type in transformers' causal-LM mapping is built tiny (hidden 64, 2 layers, small
vocabulary, windows of 16 so windowed layers are exercised past their window), and decoded
greedily by its own `generate` and by `generate(swiftspec=True)` with a draft that is a copy of
it with perturbed weights. A type's `Outcome` is one of

    tree / chain   decodes token for token like its own generate, with tau > 1
    refused        `from_models` refuses it, for the reason it names
    skipped        its own generate does not run on a tiny config (the reason is kept)
    wrong          anything else: a bug (tests fail on it)

tests/test_architectures.py asserts these per type; `python -m hf_swiftspec.tools.sweep` runs the
same sweep (or reads a saved one) and rewrites the architecture table in docs/source/en/architectures.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..models.architectures import UnsupportedArchitecture
from ..steps.probes import describe
from ..models.compat import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from .models import left_padded, random_prompts

# Set on every config that has the field; the first line is what the sweep means by "tiny".
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
TINY_IF_PRESENT = dict(
    num_key_value_heads=2, head_dim=16, rotary_dim=8, max_position_embeddings=512,
    sliding_window=16, attention_chunk_size=16,  # windows the prompts and the tree reach past
    window_size=16, keep_window_size=16, floor_scale=16, index_topk=8,  # rules by cache slot (architectures.SLOT_RULES)
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_group=1, topk_group=1,
    is_decoder=True,  # BERT-style models are causal LMs only as decoders
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
    chunk_size=16, mamba_chunk_size=16,  # Mamba-2 scans pad to a chunk: 256 makes each forward take seconds
)  # fmt: skip
# Fields named like these count layers (None: the sweep's layer count), heads or widths; shrunk wherever present.
SHRINK_BY_NAME = [
    (re.compile(r"^num_kv_shared_layers$"), 0),  # layers reusing earlier ones' KV: none in 2 layers
    (re.compile(r"^(num_(\w+_)?layers|n_layers?|(encoder|decoder)_layers)$"), None),
    (re.compile(r"^(num_(\w+_)?attention_heads|n_heads?|(encoder|decoder)_attention_heads)$"), 4),
    (re.compile(r"^((encoder|decoder)_ffn_dim|ffn_dim|d_ff|n_inner)$"), 128),
    (re.compile(r"^(d_model|n_embd|embed_dim|hidden_size_global)$"), 64),
    (re.compile(r"^d_head$"), 16),
    (re.compile(r"^\w*vocab\w*$"), 128),  # e.g. per-layer input embeddings' own vocabulary, hashed byte groups
]
# What a type's tiny config needs beyond the shrink above, and why (only where its own generate needs it).
TINY_OVERRIDES: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1]),  # by default its first attention layer is past 8 layers
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # missing from its defaults
                 ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
    "dots1": dict(n_shared_experts=1),  # None by default, which its MoE cannot multiply
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # per-layer types, in its own run-length form
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # the default has no attention
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its default is full attention only; LFM2 checkpoints mix both
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # None by default
    "mamba2": dict(num_heads=8, n_groups=1),
    "musicgen": dict(decoder=dict(num_codebooks=1)),  # its decoder reads input_ids as (batch x codebooks, length)
    "musicgen_melody": dict(decoder=dict(num_codebooks=1)),  # num_heads x head_dim must equal hidden_size x expand
    # sliding layers are off by default (use_sliding_window=False); as Qwen2 checkpoints that use them, past max_window_layers
    "qwen2": dict(use_sliding_window=True, max_window_layers=1, layer_types=["full_attention", "sliding_attention"]),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 32]),  # sums / products must match
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0),  # its step kernels want query and value heads alike here
    "trocr": dict(use_learned_position_embeddings=False),  # sinusoidal positions, as its released checkpoints
    "xmod": dict(default_language="en_XX"),  # its forward needs a language adapter
    "zamba": dict(layers_block_type=["linear_attention", "hybrid", "hybrid"], num_hidden_layers=3),  # its shared block needs 2
}
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAX_PARAMETERS = 30_000_000  # larger "tiny" models (multimodal towers, 256-expert MoE) are skipped
NEW_TOKENS = 40


@dataclass(frozen=True)
class Shape:
    """One decode of the sweep: a config variant, the tree settings, a prompt length.

    heads: "gqa" (2 key/value heads; under latent attention values as wide as keys, as in GLM-4.7-Flash)
        or "mha" (as many key/value heads as query heads); types without the field have one variant.
    settings: SwiftSpecConfig fields; {} is the adaptive default (which may rightly decode plainly).
    """

    name: str
    heads: str
    settings: dict
    prompt_length: int
    batch: tuple[int, ...] = ()  # a left-padded batch of prompts of these lengths instead of one prompt

    @property
    def fixed(self) -> bool:
        """Tree size and depth are fixed, so every round speculates (tau > 1 expected)."""
        return bool(self.settings)


SHAPES = (
    Shape("deep tree", "gqa", dict(tree_budget=8, draft_depth=4), 40),  # the prompt starts past the window
    Shape("wide tree", "mha", dict(tree_budget=8, draft_width=4, draft_depth=3), 23),
    Shape("default settings", "gqa", {}, 5),
    Shape("padded batch", "gqa", {}, 5, batch=(5, 23, 9)),  # rows reach the windows at different steps
)
PROMPT_LENGTHS = tuple(shape.prompt_length for shape in SHAPES[:3])


@dataclass
class Outcome:
    """What the sweep found for one model type (see the module docstring); tau over its fixed-tree shapes.

    notes: what other shapes found where they differ (e.g. a refusal with 2 key/value heads only)
    """

    model_type: str
    status: str
    reason: str = ""
    tau: float = 0.0
    recurrent: bool = False  # refused for a recurrent state: not an attention-only decoder
    notes: str = ""


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, layers: int = 2, full: bool = True, settable_only: bool = False, **overrides):
    """A tiny config of `model_type`; full=False sets only TINY (for configs that reject the rest).

    overrides: config fields to set as well (on the text decoder of a multimodal wrapper; a dict under
        a sub-config's name goes to that sub-config). Every other sub-config (vision tower, audio
        encoder, patcher...) is shrunk too.
    settable_only: leave out fields the config class computes (properties), which some refuse to set.
    """
    base = AutoConfig.for_model(model_type)
    overrides = {**TINY_OVERRIDES.get(model_type, {}), **overrides} if full else overrides
    sub_configs = getattr(base, "sub_configs", None) or {}
    sub_overrides = {name: overrides.pop(name) for name in list(overrides) if name in sub_configs and isinstance(overrides[name], dict)}
    text = "text_config" in sub_configs  # a multimodal wrapper: the text decoder is the causal LM
    kwargs = {**SPECIAL_TOKENS} if text else {**tiny_fields(base, layers, full, settable_only=settable_only), **overrides}
    for name in sub_configs:
        sub = getattr(base, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        fields = tiny_fields(sub, layers, full, vocab=name == "text_config", settable_only=settable_only)
        kwargs[name] = {**fields, **(overrides if name == "text_config" else {}), **sub_overrides.get(name, {})}
    return AutoConfig.for_model(model_type, **kwargs)


def causal_lm_config(config):
    """`config`, or its sub-config of the class its causal-LM model takes (a composite config whose
    causal LM is one part of it, e.g. a music decoder)."""
    wanted = getattr(MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None), "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for name in getattr(config, "sub_configs", None) or {}:
        if isinstance(getattr(config, name, None), wanted):
            return getattr(config, name)
    return config


def tiny_fields(config, layers: int, full: bool, vocab: bool = True, settable_only: bool = False) -> dict:
    """The fields that shrink `config`: TINY, and with full=True every field it has that counts layers,
    heads or widths by transformers' naming (encoder/decoder halves included), with per-layer lists cut
    to `layers` entries that keep one of each kind of layer."""
    fields = {**TINY, "num_hidden_layers": layers, **SPECIAL_TOKENS}
    if not vocab:
        fields = {k: v for k, v in TINY.items() if k != "vocab_size"}
    if not full:
        return fields
    try:
        present = config.to_dict()
    except Exception:  # noqa: BLE001 - heterogeneous configs refuse a global read of per-layer fields
        present = {}
    fields.update({k: v for k, v in TINY_IF_PRESENT.items() if k in present or has_field(config, k)})
    default_layers = present.get("num_hidden_layers")
    for name, value in present.items():
        if not isinstance(value, int) or isinstance(value, bool) or name in fields:
            if isinstance(value, list) and default_layers and len(value) == default_layers > layers and name not in fields:
                fields[name] = per_layer(value, layers)
            continue
        for pattern, tiny in SHRINK_BY_NAME:
            if pattern.match(name) and (vocab or "vocab" not in name):
                fields[name] = layers if tiny is None else tiny
                break
    if has_field(config, "kv_lora_rank"):  # latent attention expands keys to every query head
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if settable_only:
        fields = {k: v for k, v in fields.items() if not isinstance(getattr(type(config), k, None), property)}
    return fields


def per_layer(values: list, layers: int) -> list:
    """The first `layers` entries of a per-layer list, the last ones swapped for kinds it would lose."""
    kinds = list(dict.fromkeys(map(repr, values)))
    first = {k: next(v for v in values if repr(v) == k) for k in kinds}
    out = list(values[:layers])
    missing = [first[k] for k in kinds if k not in {repr(v) for v in out}]
    if missing:
        out = out[: max(layers - len(missing), 1)] + missing
    return out


def has_field(config, name: str) -> bool:
    try:
        return hasattr(config, name) or name in getattr(config, "attribute_map", {})
    except Exception:  # heterogeneous configs refuse a global read of per-layer fields
        return False


def tiny_of_type(model_type: str, layers: int = 2, seed: int = 0, **overrides):
    """A tiny randomly initialised model in eval mode (sharpened head: peaked like a real LM).

    Tries the full shrink, then without fields its config computes itself, then with as many key/value
    heads as query heads (configs that require it), then TINY alone; raises the first attempt's error.
    """
    attempts = [dict(), dict(settable_only=True)]
    if "num_key_value_heads" not in overrides:
        attempts.append(dict(num_key_value_heads=TINY["num_attention_heads"]))
    attempts.append(dict(full=False))
    first_error = None
    for attempt in attempts:
        try:
            top = tiny_config(model_type, layers, **{**overrides, **attempt})
            config, model_class = causal_lm_config(top), MODEL_FOR_CAUSAL_LM_MAPPING[type(top)]
            with torch.device("meta"):
                meta = model_class(config)
            break
        except Exception as error:  # noqa: BLE001 - the next attempt, or the first error
            first_error = first_error or error
    else:
        raise first_error
    parameters = sum(p.numel() for p in meta.parameters())
    if parameters > MAX_PARAMETERS:
        raise MemoryError(f"{parameters / 1e6:.0f}M parameters even on a tiny config")
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # (a decoder start token only for generate()s that build their own start, e.g. a music decoder's delay pattern)
    model.generation_config = GenerationConfig(
        **SPECIAL_TOKENS, decoder_start_token_id=SPECIAL_TOKENS["bos_token_id"], num_return_sequences=1
    )
    head = model.get_output_embeddings()
    if head is not None:
        with torch.no_grad():
            for part in head.modules():  # one head, or one per codebook
                if isinstance(getattr(part, "weight", None), torch.Tensor):
                    part.weight.mul_(4.0)
    return model


def perturbed_copy(model, scale: float = 0.02, seed: int = 1):
    """A draft that agrees with `model` often: its copy with noise of `scale` x each weight's std."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=generator).to(p.device, p.dtype) * scale * p.float().std())
    return draft


def own_generate(model, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS, **kwargs) -> torch.Tensor:
    """Greedy, exactly `new_tokens` long (no EOS), as every decode in the sweep is."""
    return model.generate(
        prompt, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
        pad_token_id=0, **kwargs,
    )


def prompts(vocab_size: int = 128) -> list[torch.Tensor]:
    return [
        torch.randint(3, vocab_size, (1, n), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS
    ]


def runnable_tiny_model(model_type: str, **overrides):
    """(model, None), or (None, why its own generate does not run on a tiny config)."""
    error = None
    for layers in (2, 4, 8):  # hybrids need enough layers to reach their first attention layer
        try:
            model = tiny_of_type(model_type, layers, **overrides)
            with torch.no_grad():
                own_generate(model, prompts()[0], 2)
            return model, None
        except Exception as e:  # noqa: BLE001 - any failure of its own generate means "skipped"
            error = e
            if "Attention layers" not in str(e):
                break
    return None, f"its own generate fails on a tiny config: {type(error).__name__}: {first_line(error)}"


def head_overrides(model_type: str, heads: str) -> dict:
    """Config fields of a Shape's heads variant ({} where the config has no key/value head count)."""
    base = AutoConfig.for_model(model_type)
    text = base.get_text_config(decoder=True)
    if not has_field(text, "num_key_value_heads"):
        return {}
    if heads == "mha":
        return {"num_key_value_heads": TINY["num_attention_heads"]}
    fields = {"num_key_value_heads": 2}
    if has_field(text, "kv_lora_rank") and has_field(text, "v_head_dim"):
        fields["v_head_dim"] = TINY_IF_PRESENT["qk_nope_head_dim"] + TINY_IF_PRESENT["qk_rope_head_dim"]
    return fields


@dataclass
class ShapeResult:
    status: str
    reason: str = ""
    tau: float = 0.0
    recurrent: bool = False


def check_type(model_type: str, device: str = "cpu", attention: str = "auto") -> Outcome:
    """Sweep one model type over every Shape (see the module docstring), its models on `device`, tree steps
    through `attention` (SwiftSpecConfig's)."""
    built: dict[str, tuple] = {}  # heads variant -> (model or None, why not, its draft)
    results = []
    for shape in SHAPES:
        try:
            overrides = head_overrides(model_type, shape.heads)
        except Exception:  # noqa: BLE001 - a config that will not build at all: runnable_tiny_model says why
            overrides = {}
        key = repr(sorted(overrides.items()))
        if key not in built:
            model, why = runnable_tiny_model(model_type, **overrides)
            if model is not None:
                model = model.to(device)
            built[key] = (model, why, perturbed_copy(model) if model is not None else None)
        results.append(check_shape(shape, *built[key], attention=attention))
    return combine(model_type, results)


def check_shape(shape: Shape, target, why: str | None, draft, attention: str = "auto") -> ShapeResult:
    from ..modeling import SwiftSpecForCausalLM

    if target is None:
        return ShapeResult("skipped", why)
    try:
        architecture = describe(target, "target")
        pair = SwiftSpecForCausalLM.from_models(target, draft, attention=attention, **shape.settings)
    except UnsupportedArchitecture as refusal:
        return ShapeResult("refused", first_line(refusal), recurrent=refusal.recurrent)
    if shape.batch:
        vocab = target.config.get_text_config(decoder=True).vocab_size
        prompt, mask = left_padded(random_prompts(shape.batch, 0, vocab), pad=SPECIAL_TOKENS["pad_token_id"])
    else:
        prompt, mask = prompts()[PROMPT_LENGTHS.index(shape.prompt_length)], None
    prompt, mask = prompt.to(target.device), mask.to(target.device) if mask is not None else None
    try:
        with warnings.catch_warnings():  # a batch decoded by the target's own loop says why: stats.engine keeps it
            warnings.simplefilter("ignore", UserWarning)
            expected = own_generate(target, prompt, attention_mask=mask)
            actual = own_generate(pair, prompt, swiftspec=True, attention_mask=mask)
    except Exception as error:  # noqa: BLE001 - reported, and the test fails on it
        where = traceback.extract_tb(error.__traceback__)[-1]
        return ShapeResult("wrong", f"{shape.name}: {type(error).__name__}: {first_line(error)} "
                           f"({Path(where.filename).name}:{where.lineno})")  # fmt: skip
    for row, (a, e) in enumerate(zip(actual.tolist(), expected.tolist())):
        if a != e:
            at = next(i for i, (x, y) in enumerate(zip(a, e)) if x != y)
            where = f"row {row} of a padded batch" if shape.batch else f"a {prompt.shape[1]}-token prompt"
            return ShapeResult("wrong", f"{shape.name}: differs from its own generate at generated token "
                               f"{at - prompt.shape[1]} of {where}")  # fmt: skip
    stats = pair.swiftspec_stats
    if stats.engine.startswith("target ("):  # past a slot limit only one-token steps are exact: its own loop
        return ShapeResult("plain", stats.engine[len("target (") : -1].split(", and this call")[0])
    tau = stats.tau
    if shape.fixed and tau <= 1.0:
        return ShapeResult("wrong", f"{shape.name}: no speculation happened (tau={tau:.2f})", tau)
    reason = call_chain_reason(stats.attention)
    if reason is not None:  # past a slot limit, or a model without trees: chains (architectures.SlotLimit)
        return ShapeResult("chain", reason, tau if shape.fixed else 0.0)
    return ShapeResult(architecture.shape, architecture.chain_reason or "", tau if shape.fixed else 0.0)


CALL_CHAINS = "chains for this call ("


def call_chain_reason(attention: str) -> str | None:
    """Why a call ran chains, from its stats' attention line (either round's: "chains for this call (REASON)..."), or
    None where it grew trees. REASON may hold parentheses of its own: it ends at the one that closes the first."""
    start = attention.find(CALL_CHAINS)
    if start < 0:
        return None
    depth, begin = 1, start + len(CALL_CHAINS)
    for i in range(begin, len(attention)):
        depth += {"(": 1, ")": -1}.get(attention[i], 0)
        if depth == 0:
            return attention[begin:i].split(", and this call")[0]
    return attention[begin:]


def combine(model_type: str, results: list[ShapeResult]) -> Outcome:
    """One verdict from the shapes: wrong if any is; else how the type speculates where it does (the
    others noted); else refused; else skipped."""
    named = list(zip(SHAPES, results))
    for status in ("wrong", "tree", "chain", "plain", "refused", "skipped"):
        hits = [(shape, r) for shape, r in named if r.status == status]
        if not hits:
            continue
        shape, first = hits[0]
        taus = [r.tau for _, r in hits if r.tau]
        others = {}  # (status, reason) -> where: a reason two shapes share is noted once
        for s, r in named:
            if r.status not in (status, "skipped"):
                others.setdefault((r.status, short_reason(r.reason)), "in a padded batch" if s.batch else f"with {HEAD_NOTES[s.heads]}")
        notes = "; ".join(f"{where}: {st} ({reason})" for (st, reason), where in others.items())
        recurrent = any(r.recurrent for _, r in hits)
        return Outcome(model_type, status, first.reason, sum(taus) / len(taus) if taus else 0.0, recurrent, notes)
    raise ValueError("no shapes")


HEAD_NOTES = {"gqa": "2 key/value heads", "mha": "as many key/value heads as query heads"}


def first_line(error: BaseException, limit: int = 600) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text[:limit]


# ---------------------------------------------------------------- verdicts (what tests/test_architectures.py pins)

# The whole sweep, committed: `python -m hf_swiftspec.tools.sweep --save hf_swiftspec/data/architecture_verdicts.json`
VERDICTS = Path(__file__).resolve().parent.parent / "data" / "architecture_verdicts.json"
# The mechanism a reason names, first match wins (a recurrent refusal may also name a failing forward). Verdicts
# compare status and class, so a reworded reason changes none, and a type that moves to another mechanism does.
REASON_CLASSES = (
    ("recurrent state", r"keeps? a (recurrent|convolution) state"),
    ("no position_ids", r"takes no position_ids"),
    ("slot rule", r"cache slots?\b"),
    ("no cache", r"takes no cache in its forward"),
    ("own generate", r"has a generate\(\) of its own"),
    ("whole sequence each step", r"takes the whole sequence at every step"),
    ("multi-token forward fails", r"fails on a forward of several tokens"),
    ("tree cache prefill fails", r"fails on a prefill into swiftspec's tree cache"),
    ("cache layer beyond keys and values", r"cache layer keeps more than keys and values"),
    ("window without a mask", r"sliding window in its cache but builds no sliding mask"),
    ("own generate fails", r"^its own generate fails"),
)


def reason_class(reason: str) -> str:
    """The REASON_CLASSES name of an Outcome's reason ("" for none, "unclassified" where no class matches); a type
    whose own generate fails is classed with its error's type, e.g. "own generate fails (ImportError)"."""
    if not reason:
        return ""
    for name, pattern in REASON_CLASSES:
        if re.search(pattern, reason):
            error = re.search(r"tiny config: (\w+)", reason) if name == "own generate fails" else None
            return f"{name} ({error[1]})" if error else name
    return "unclassified"


def verdict(outcome: Outcome) -> str:
    """The status with its reason's class: "tree", "chain: no position_ids", "refused: recurrent state"."""
    kind = reason_class(outcome.reason)
    return f"{outcome.status}: {kind}" if kind else outcome.status


# ---------------------------------------------------------------- the architecture table (docs/source/en/architectures.md)

TABLE_START = "<!-- architecture-table:start -->"
TABLE_END = "<!-- architecture-table:end -->"


def coverage_line(outcomes: list[Outcome]) -> str:
    count = lambda status: sum(o.status == status for o in outcomes)  # noqa: E731
    return (
        f"{len(outcomes)} causal-LM types in transformers {transformers_version()}: {count('tree')} tree, "
        f"{count('chain')} chain, {count('plain')} plain, {count('refused')} refused, {count('skipped')} skipped"
        + (f", {count('wrong')} WRONG" if count("wrong") else "")
    )


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def markdown_table(outcomes: list[Outcome]) -> str:
    """The architecture table of docs/source/en/architectures.md: one row per model type."""
    rows = ["| model type | speculation | why / notes |", "|---|---|---|"]
    for o in sorted(outcomes, key=lambda o: o.model_type):
        note = short_reason(o.reason)
        if o.status in ("tree", "chain"):
            note = f"tau {o.tau:.2f} on the tiny sweep" + (f"; {note}" if note else "")
        note = "; ".join(part for part in (note, distinct_notes(o.notes)) if part).replace("|", "\\|")
        rows.append(f"| `{o.model_type}` | {o.status} | {note} |")
    return "\n".join([coverage_line(outcomes) + ".", "", *rows])


def distinct_notes(notes: str) -> str:
    """Notes with each shape's outcome once: a later shape that found what an earlier one did is dropped."""
    seen, kept = set(), []
    for part in filter(None, notes.split("; in a padded batch: ") if notes else []):
        outcome = part.split(": ", 1)[-1] if part.startswith("with ") else part
        if outcome not in seen:
            seen.add(outcome)
            kept.append(part if part.startswith("with ") or not kept else f"in a padded batch: {part}")
    return "; ".join(kept)


def short_reason(reason: str, limit: int = 140) -> str:
    """The reason's first clause without the "The target (type)" it starts with, for the table."""
    if reason.startswith("The target ("):
        reason = reason[reason.index(") ") + 2 :]
    for cut in (": a tree step", ", which a tree step", "; ", ", so ", ". "):
        reason = reason.split(cut)[0]
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def rewrite_page(page: Path, outcomes: list[Outcome]) -> None:
    text = page.read_text()
    block = f"{TABLE_START}\n{markdown_table(outcomes)}\n{TABLE_END}"
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(
            f"{page} has no {TABLE_START} ... {TABLE_END} block to rewrite: the table lives in "
            "docs/source/en/architectures.md (--page docs/source/en/architectures.md)."
        )
    page.write_text(pattern.sub(lambda _: block, text))


def save(outcomes: list[Outcome], path: Path) -> None:
    """The sweep as JSON: the transformers release it ran on, and every Outcome."""
    data = {"transformers": transformers_version(), "outcomes": [asdict(o) for o in outcomes]}
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path) -> list[Outcome]:
    data = json.loads(path.read_text())
    return [Outcome(**o) for o in (data["outcomes"] if isinstance(data, dict) else data)]  # (a list: saved before files named their release)


def swept_release(path: Path) -> str | None:
    """The transformers release a saved sweep ran on (None for a file saved without it)."""
    data = json.loads(path.read_text())
    return data.get("transformers") if isinstance(data, dict) else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="read the sweep from this JSON (the test writes it) instead of running it")
    parser.add_argument("--save", type=Path, help="write the sweep's results to this JSON")
    parser.add_argument("--page", type=Path, help="rewrite the architecture table in this page (docs/source/en/architectures.md)")
    parser.add_argument("types", nargs="*", help="model types to sweep (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.results:
        outcomes = load(args.results)
    else:
        outcomes = []
        for model_type in args.types or causal_lm_types():
            outcomes.append(check_type(model_type))
            print(f"{model_type:28s} {outcomes[-1].status:8s} {outcomes[-1].reason}", file=sys.stderr, flush=True)
    if args.save:
        save(outcomes, args.save)
    if args.page:
        rewrite_page(args.page, outcomes)
    print(coverage_line(outcomes))


if __name__ == "__main__":
    main()
