"""Tree-attention dispatch: the fused Triton kernel, its torch reference, or the model's own.

With the kernel, a model runs with attn_implementation="swiftspec": tree steps pass a
`TreeStep` (prefix length + the tree mask packed to bits, built once per step) as a forward
kwarg, which transformers hands to every layer's attention; any other forward (prefill, or
plain `target.generate`) falls through to sdpa with the mask transformers builds.

    "auto"   the Triton kernel on CUDA devices, else the model's own attention + dense mask
    "kernel" the Triton kernel wherever Triton runs (CUDA, or the CPU interpreter under
             TRITON_INTERPRET=1), else its plain-torch reference
    "model"  the model's own attention (sdpa or eager) with a dense additive 4D mask
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from swiftspec_kernels import pack_tree_mask, tree_attention, tree_attention_reference, triton_available
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_CHOICES = ("auto", "kernel", "model")
KERNEL_BACKENDS = ("triton", "torch-reference")
NAME = "swiftspec"


@dataclass(frozen=True)
class TreeStep:
    """What every layer's attention needs for one tree forward.

    prefix_len: committed positions every query attends
    bits:       (1, Q, ceil(S / 32)) int32, the (Q, S) tree-region mask packed by pack_tree_mask
    reference:  use the plain-torch reference instead of the Triton kernel
    """

    prefix_len: int
    bits: torch.Tensor
    reference: bool = False


def tree_step(prefix_len: int, tree_mask: torch.Tensor, reference: bool) -> TreeStep:
    """Pack a (Q, S) bool tree-region mask once for all layers."""
    return TreeStep(prefix_len, pack_tree_mask(tree_mask[None]), reference)


def swiftspec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: q (B, H, Q, D), k/v (B, Hkv, KV, D) -> ((B, Q, H, D), None)."""
    step: TreeStep | None = kwargs.pop("swiftspec_tree", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    attend = tree_attention_reference if step.reference else tree_attention
    out = attend(query, key, value, step.prefix_len, step.bits, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


def register_tree_attention() -> None:
    """Make attn_implementation="swiftspec" known to transformers (idempotent)."""
    AttentionInterface.register(NAME, swiftspec_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def resolve_attention(choice: str, model) -> str:
    """The backend a model's tree steps use: "triton", "torch-reference", or its own ("sdpa"/"eager")."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"SwiftSpecConfig.attention={choice!r}; use one of {ATTENTION_CHOICES}.")
    device = model.device
    if choice == "kernel" or (choice == "auto" and device.type == "cuda"):
        return "triton" if triton_available(device) else "torch-reference"
    own = model.config._attn_implementation or "sdpa"
    return "sdpa" if own == NAME else own  # swiftspec_attention without a TreeStep is sdpa


def use_tree_attention(model, backend: str) -> None:
    """Route the model's attention through swiftspec_attention when a kernel backend is chosen."""
    if backend in KERNEL_BACKENDS:
        register_tree_attention()
        model.set_attn_implementation(NAME)
