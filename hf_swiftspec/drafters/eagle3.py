"""EAGLE-3 heads: one decoder layer that drafts from three of the target's hidden states.

A head reads, for each committed token x_j, the target's hidden states at three of its layers for
the token before it (x_{j-1}: the inputs of layers `layer_ids`, concatenated, (3 * H_t,)), projects them
to its own width (`fc`), and runs them beside x_j's embedding through one decoder layer whose
attention takes both (2 * H); its norm and head score the next token over its own draft vocabulary,
which `d2t` maps to target ids (target id = draft id + d2t[draft id]). Below the tree's root the
head feeds its own output (the layer's output before the norm) where the target's states would be.

Two published formats, told apart by config.json:
    "eagle"        the EAGLE authors' (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a llama config with
                   draft_vocab_size; tensors fc, midlayer.*, norm, lm_head, d2t, t2d, usually no
                   embed_tokens (the target's embeddings are used)
    "speculators"  vLLM's speculators (`speculators_model_type: "eagle3"`, e.g. RedHatAI/*speculator.eagle3):
                   the layer's config under transformer_layer_config; tensors fc, layers.0.*, norm,
                   lm_head, d2t, t2d, embed_tokens; target_hidden_size and
                   eagle_aux_hidden_state_layer_ids where given
The layers read default to (2, L // 2, L - 3) of an L-layer target, as both formats' authors do.

`FeatureTap` is how the target's forwards hand those states over: hooks on its decoder layers for
one generation, removed afterwards.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from ..models.architectures import FULL, Architecture
from ..models.compat import ACT2FN, LlamaRotaryEmbedding, apply_rotary_pos_emb

logger = logging.getLogger(__name__)

FORMATS = ("eagle", "speculators")
LAYER_PREFIX = {"eagle": "midlayer.", "speculators": "layers.0."}
# The layer config fields a head's decoder layer and rotary embedding read.
LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "hidden_act", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size",
    "attention_bias", "mlp_bias",
)


@dataclass(frozen=True)
class Eagle3Config:
    """What a head's config.json says, in either format.

    layer:              the decoder layer's llama fields (hidden_size, heads, rope, vocab_size = the target's)
    draft_vocab_size:   rows of its lm_head
    target_hidden_size: the target's hidden width (fc reads 3 of them); the head's own when not given
    layer_ids:          the target layers whose inputs it reads; None: the default for the target's depth
    norm_before_residual: the speculators option that normalises the hidden input before the residual
    """

    format: str
    layer: dict
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.layer["vocab_size"])

    @classmethod
    def from_dict(cls, data: dict) -> "Eagle3Config":
        fmt = eagle3_format(data)
        if fmt is None:
            raise ValueError(
                "not an EAGLE-3 head config: expected speculators_model_type 'eagle3' (speculators format) or a "
                f"llama config with draft_vocab_size (the EAGLE authors' format); got keys {sorted(data)[:12]}"
            )
        layer = dict(data["transformer_layer_config"]) if fmt == "speculators" else dict(data)
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
        if missing:
            raise ValueError(f"EAGLE-3 head config ({fmt} format) lacks {missing}")
        layer = {k: layer[k] for k in LAYER_FIELDS if layer.get(k) is not None}
        ids = data.get("eagle_aux_hidden_state_layer_ids") or (data.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        return cls(
            format=fmt,
            layer=layer,
            draft_vocab_size=int(data.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=int(data.get("target_hidden_size") or layer["hidden_size"]),
            layer_ids=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(data.get("norm_before_residual", False)),
            raw=data,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(**{k: v for k, v in self.layer.items()})


def eagle3_format(data: dict) -> str | None:
    """"speculators", "eagle", or None when a config.json describes no EAGLE-3 head."""
    if data.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "draft_vocab_size" in data and (
        any("Eagle3" in a for a in data.get("architectures") or []) or data.get("model_type") == "llama"
    ):
        return "eagle"
    return None


def is_eagle3_folder(folder) -> bool:
    """Whether `folder` holds an EAGLE-3 head (its config.json says so)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    try:
        return eagle3_format(json.loads(config.read_text())) is not None
    except (OSError, ValueError):
        return False


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The layers both formats' authors read from an L-layer target: 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Eagle3Attention(nn.Module):
    """Self-attention whose queries, keys and values read 2 * H inputs (embedding and hidden side by side)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        H = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * H, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=bias)

    def forward(self, x: torch.Tensor, cos_sin, cache, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, Q, 2H); the keys and values go into `cache` (its one layer) and every visible one is
        attended; mask (B, 1, Q, S) additive, or None: causal over a cache-free sequence."""
        B, Q, _ = x.shape
        q = self.q_proj(x).view(B, Q, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, Q, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, Q, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        if cache is not None:
            k, v = cache.layers[0].update(k, v)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and cache is None)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [norm(embedding), norm(hidden)], the hidden as residual."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Eagle3Attention(config)
        self.mlp = GatedMLP(config)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, hidden, cos_sin, cache, mask) -> torch.Tensor:
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        hidden = residual + self.self_attn(x, cos_sin, cache, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GatedMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=bias), nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class HeadOutput:
    """logits (B, Q, draft vocabulary) and hidden (B, Q, H): the layer's output before the norm,
    which the next depth of the tree reads as its hidden input."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DraftHead(nn.Module):
    """A draft that reads the target's hidden states (drafters/heads.py drafts with it): an EAGLE-3 head, or a
    model's own MTP layer (mtp.py).

        hidden_size          width of its hidden inputs and outputs; device, dtype: those of its weights
        architecture         its tree steps' needs (one full-attention layer)
        tap(target)          the FeatureTap that hands it the target's states during one call
        fuse(states)         the target's states (..., D) -> its hidden input (..., hidden_size)
        forward(...)         HeadOutput: logits over its draft vocabulary, and its hidden output
        target_ids(ids)      draft-vocabulary ids -> target ids
        bind(target)         check that it fits `target`; returns itself
    """

    shares_embeddings = False  # True once bound to a target whose embeddings it reads

    @property
    def architecture(self) -> Architecture:
        """Its tree steps' needs: one full-attention layer, exact on trees."""
        return Architecture(self.kind, ("full_attention",), (FULL,))


class Eagle3Head(DraftHead):
    """An EAGLE-3 draft head (see the module docstring). `embed_tokens` is None until `bind` gives it
    the target's embeddings, when the checkpoint ships none."""

    kind = "eagle3"

    def __init__(self, config: Eagle3Config, fc_bias: bool = False, own_embeddings: bool = True):
        super().__init__()
        self.config = config
        layer = config.llama_config()
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H) if own_embeddings else None
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=fc_bias)
        self.midlayer = Eagle3Layer(layer, config.norm_before_residual)
        self.norm = RMSNorm(H, layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(layer)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.layer_ids: tuple[int, ...] = config.layer_ids or ()
        self.name_or_path: str | None = None

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def tap(self, target) -> "FeatureTap":
        return FeatureTap(target, self.layer_ids)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated hidden states (..., 3 * H_t) -> the layer's hidden input (..., H)."""
        return self.fc(features.to(device=self.device, dtype=self.dtype))

    def forward(self, input_ids, position_ids, hidden_inputs, attention_mask=None, past_key_values=None,
                logits_to_keep: int = 0, **kwargs) -> HeadOutput:
        """input_ids, position_ids (B, Q); hidden_inputs (B, Q, H): fuse(target states) at the tree's root
        and before it, the head's own `hidden` below it; attention_mask (B, 1, Q, S) additive over the
        cache's slots, or None (a causal sequence without a cache: training)."""
        embeds = self.embed_tokens(input_ids).to(self.dtype)
        cos_sin = self.rotary(embeds, position_ids)
        hidden = self.midlayer(embeds, hidden_inputs.to(self.dtype), cos_sin, past_key_values, attention_mask)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return HeadOutput(self.lm_head(self.norm(kept)), hidden)

    # ---- binding to a target -------------------------------------------------------------------
    def bind(self, target) -> "Eagle3Head":
        """Check that this head fits `target` and fill in what it takes from it (its embeddings when the
        checkpoint has none, the default layers). Raises ValueError naming what does not fit."""
        text = target.config.get_text_config(decoder=True)
        vocab = target.get_input_embeddings().weight.shape[0]
        name = self.name_or_path or "the EAGLE-3 head"
        self.layer_ids = check_fits(self.config, text, name)
        top = int(self.target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device)).max())
        if top >= vocab:
            raise ValueError(f"{name}'s d2t maps draft ids to target id {top}, past the target's {vocab} embeddings.")
        if self.embed_tokens is None:
            embeddings = target.get_input_embeddings()
            if embeddings.weight.shape[1] != self.config.hidden_size:
                raise ValueError(
                    f"{name} ships no embeddings and is {self.config.hidden_size} wide, but the target's embeddings are "
                    f"{embeddings.weight.shape[1]} wide."
                )
            self.embed_tokens, self.shares_embeddings = embeddings, True
        return self


def check_fits(config: Eagle3Config, text, name: str = "the EAGLE-3 head") -> tuple[int, ...]:
    """The target layers a head of `config` reads from a target of (text) config `text`; ValueError naming
    what does not fit (width, layers, vocabulary): a head trained for another target."""
    layers, width = int(text.num_hidden_layers), int(text.hidden_size)
    if config.target_hidden_size != width:
        raise ValueError(
            f"{name} reads hidden states of width {config.target_hidden_size} (its fc takes "
            f"{3 * config.target_hidden_size}), but the target's are {width} wide: it was trained for another target."
        )
    ids = config.layer_ids or default_layer_ids(layers)
    if len(ids) != 3 or not all(0 <= i < layers for i in ids):
        raise ValueError(
            f"{name} reads the target's layers {list(ids)}, but the target has {layers} decoder layers (0..{layers - 1}) "
            "and a head reads three: it was trained for another target."
        )
    if config.vocab_size != text.vocab_size:
        raise ValueError(
            f"{name} embeds a vocabulary of {config.vocab_size} tokens, the target {text.vocab_size}: "
            "it was trained for another target."
        )
    return tuple(ids)


class FeatureTap:
    """The inputs of a target's decoder layers `layer_ids` in each forward, concatenated (B, Q, 3 * H).

    Used as a context manager around one generation: hooks go onto the layers on entry and come off on
    exit, so the user's model keeps nothing.
    """

    def __init__(self, model, layer_ids: tuple[int, ...]):
        self.layers = decoder_layers(model)
        self.layer_ids = tuple(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> "FeatureTap":
        for i in sorted(set(self.layer_ids)):
            self.handles.append(self.layers[i].register_forward_pre_hook(self.hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.captured = [], {}

    def hook(self, i: int):
        def capture(module, args, kwargs):
            self.captured[i] = args[0] if args else kwargs["hidden_states"]
        return capture

    @property
    def key(self) -> tuple:
        """What a replayed step's bucket must have captured for this tap (capture.py)."""
        return type(self).__name__, self.layer_ids

    def hand(self, states: torch.Tensor) -> None:
        """The last forward's states, from a replay (whose hooks never run): the next take() returns them."""
        self.captured = {"replayed": states}

    def take(self) -> torch.Tensor:
        """The last forward's states (B, Q, 3 * H)."""
        if "replayed" in self.captured:
            out, self.captured = self.captured["replayed"], {}
            return out
        missing = [i for i in self.layer_ids if i not in self.captured]
        if missing:
            raise RuntimeError(f"the target's forward did not run its decoder layers {missing} through their modules")
        out = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured = {}
        return out


def decoder_layers(model) -> nn.ModuleList:
    """The target's decoder layers: the ModuleList with one entry per config.num_hidden_layers."""
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    named = [m for name, m in lists if name.endswith("layers")]
    if not (named or lists):
        raise ValueError(f"cannot find the target's {count} decoder layers, which an EAGLE-3 head reads")
    return (named or [m for _, m in lists])[0]


# ---- files ---------------------------------------------------------------------------------------
def load_eagle3_head(folder, device=None, dtype: torch.dtype | None = None) -> Eagle3Head:
    """An EAGLE-3 head from a folder (config.json + model.safetensors, either format)."""
    folder = Path(folder)
    config = Eagle3Config.from_dict(json.loads((folder / "config.json").read_text()))
    weights = read_safetensors(folder)
    prefix = LAYER_PREFIX[config.format]
    state = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in weights.items()}
    head = Eagle3Head(config, fc_bias="fc.bias" in state, own_embeddings="embed_tokens.weight" in state)
    t2d = state.pop("t2d", None)  # the target ids some draft id maps to: d2t says the same, so it is only checked
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"{folder}: a draft vocabulary of {config.draft_vocab_size} (< {config.vocab_size}) needs a d2t tensor")
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    if t2d is not None:
        check_t2d(folder, t2d, state["d2t"], config.vocab_size)
    expected = set(head.state_dict()) - {k for k in head.state_dict() if k.startswith("rotary.")}
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{folder}: the EAGLE-3 head ({config.format} format) lacks tensors {missing[:8]}")
    extra = sorted(set(state) - expected)
    if extra:
        logger.warning("%s: tensors an EAGLE-3 head does not use were not loaded: %s", folder, extra[:8])
    head.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    head.name_or_path = str(folder)
    return head.to(device=device, dtype=dtype) if dtype is not None else head.to(device=device)


def check_t2d(folder: Path, t2d: torch.Tensor, d2t: torch.Tensor, vocab_size: int) -> None:
    """Refuse a head whose t2d ((V,) bool: which target ids have a draft id) disagrees with its d2t ((V_d,) offsets):
    one of them was written for another head or vocabulary, or d2t holds target ids rather than offsets, and the
    head would propose other tokens than it was trained to."""
    if t2d.shape != (vocab_size,):
        raise ValueError(f"{folder}: t2d has shape {tuple(t2d.shape)}, but the head's target vocabulary has {vocab_size} "
                         "ids; re-export the head for this target (save_eagle3_head writes t2d from d2t).")  # fmt: skip
    marked = set(t2d.bool().nonzero().flatten().tolist())
    mapped = set((torch.arange(len(d2t)) + d2t).tolist())
    if marked != mapped:
        raise ValueError(
            f"{folder}: the head's t2d and d2t disagree: t2d marks {len(marked)} target ids, d2t maps its {len(d2t)} draft "
            f"ids to {len(mapped)} (marked only by t2d: {sorted(marked - mapped)[:5]}, only by d2t: "
            f"{sorted(mapped - marked)[:5]}). Re-export the head from its training checkpoint (save_eagle3_head writes "
            "t2d from d2t)."
        )


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (it has {pickles}: convert them to safetensors; pickle files can run code)" if pickles else ""
        raise ValueError(f"{folder} holds no .safetensors weights for the EAGLE-3 head{hint}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    return weights


def save_eagle3_head(head: Eagle3Head, folder, fmt: str = "speculators") -> None:
    """Write `head` in a published format (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    layer = dict(cfg.layer, model_type="llama", num_hidden_layers=1)
    if fmt == "speculators":
        data = {
            "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual, "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(head.layer_ids) or None,
        }
    else:
        data = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                    target_hidden_size=cfg.target_hidden_size)
        if head.layer_ids:
            data["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.layer_ids)}
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    prefix = LAYER_PREFIX[fmt]
    state = {}
    for k, v in head.state_dict().items():
        if k.startswith("rotary.") or (k.startswith("embed_tokens.") and head.shares_embeddings):
            continue
        state[prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k] = v.contiguous()
    targets = head.target_ids(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[targets.cpu()] = True
    state["t2d"] = t2d
    save_file(state, str(folder / "model.safetensors"))
