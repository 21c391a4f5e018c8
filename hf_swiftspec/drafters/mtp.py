"""A model's own multi-token-prediction (MTP) layer as a draft head: no second model.

Models such as DeepSeek-V3 and GLM-4.5 ship MTP layers, which transformers builds as `MtpModel`
(`generate(use_mtp=True)` drafts a chain with them). MTP layer 0 reads the main model's final hidden
state at a token (after its norm) beside the next token's embedding (enorm / hnorm / eh_proj), runs the
model's own decoder layer and a post norm, and scores the token after through the main model's head: the
shape of an EAGLE-3 head (eagle3.py), so the same drafter grows a tree with it (drafters/heads.py), layer 0
at every depth, feeding its own output below the root (as vLLM reuses it for several tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.compat import MtpModel, cache_argument
from .eagle3 import DraftHead, HeadOutput


class FinalStateTap:
    """The main model's final hidden state (its decoder's last norm's output, (B, Q, H)) in each forward,
    hooked for one generation (a context manager, like eagle3.FeatureTap)."""

    def __init__(self, model):
        self.norm = model.get_decoder().norm
        self.captured: torch.Tensor | None = None
        self.handle = None

    def __enter__(self) -> "FinalStateTap":
        self.handle = self.norm.register_forward_hook(self.capture)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        self.handle, self.captured = None, None

    def capture(self, module, args, output) -> None:
        self.captured = output

    key = ("FinalStateTap",)  # what a replayed step's bucket must have captured for this tap (capture.py)

    def hand(self, states: torch.Tensor) -> None:
        """The last forward's states, from a replay (whose hooks never run): the next take() returns them."""
        self.captured = states

    def take(self) -> torch.Tensor:
        if self.captured is None:
            raise RuntimeError("the target's forward did not run its final norm")
        out, self.captured = self.captured, None
        return out


class MtpHead(DraftHead):
    """MTP layer 0 of `mtp` (an MtpModel built for `target`) as a DraftHead."""

    kind = "mtp"

    def __init__(self, target, mtp):
        super().__init__()
        self.mtp = mtp
        self.layer = mtp.layers[0]
        self.cache_name = cache_argument(type(self.layer).forward) or "cache"
        self.name_or_path = f"{getattr(target, 'name_or_path', '') or type(target).__name__} (its MTP layer 0)"
        self.target_type = type(target)

    @property
    def hidden_size(self) -> int:
        return self.mtp.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.layer.eh_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.eh_proj.weight.dtype

    def tap(self, target) -> FinalStateTap:
        return FinalStateTap(target)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features.to(device=self.device, dtype=self.dtype)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def bind(self, target) -> "MtpHead":
        if not isinstance(target, self.target_type):
            raise ValueError(f"{self.name_or_path} belongs to a {self.target_type.__name__}, not to this {type(target).__name__}.")
        return self

    def forward(self, input_ids, position_ids, hidden_inputs, attention_mask=None, past_key_values=None,
                logits_to_keep: int = 0, **kwargs) -> HeadOutput:
        embeds = self.mtp.embed_tokens(input_ids).to(self.dtype)
        rope = {"layer_type": self.mtp.config.layer_types[0]} if getattr(self.mtp, "has_per_layer_rope", False) else {}
        rotary = self.mtp.rotary_emb(embeds, position_ids=position_ids, **rope) if self.mtp.rotary_emb is not None else None
        hidden = self.layer(embeds, hidden_inputs.to(self.dtype), position_embeddings=rotary, position_ids=position_ids,
                            attention_mask=attention_mask, **{self.cache_name: past_key_values})
        if self.mtp.use_shared_post_norm:
            hidden = self.mtp.shared_post_norm(hidden)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return HeadOutput(self.mtp._project_to_logits(kept), hidden)


def mtp_head(target, mtp: nn.Module | None = None) -> MtpHead:
    """The target's own MTP layer 0 as a draft: loaded from its checkpoint as transformers' use_mtp loads it, or
    the MtpModel `mtp` given. Raises ValueError when the target has no MTP layers."""
    layers = getattr(target.config.get_text_config(), "num_mtp_layers", None)
    if not layers:
        raise ValueError(
            f"{type(target).__name__} has no MTP layers (config num_mtp_layers={layers!r}); draft with a draft model, an "
            "EAGLE-3 head, or draft-free."
        )
    if mtp is None:
        mtp = MtpModel.from_pretrained(target, device_map={"": target.device})
    kind = (getattr(mtp.config, "layer_types", None) or ["full_attention"])[0]
    if kind != "full_attention":
        raise ValueError(
            f"{type(target).__name__}'s MTP layer 0 is a {kind} layer; MTP drafting takes full-attention layers only "
            "(its tree mask would not be the layer's). Draft with a draft model, an EAGLE-3 head, or draft-free."
        )
    return MtpHead(target, mtp.eval())
