"""Tree attention routing: the one place that decides how a model's tree steps attend.

A tree step's queries see the committed prefix plus their own ancestors in the tree region.
Each model's backend is resolved once per generation (`resolve_attention`), the model is
routed for the length of that generation only (`routed_attention`, which restores the user's
`attn_implementation` afterwards), and every tree forward takes its attention arguments from
`tree_step_kwargs`:

    "triton" / "torch-reference"  the model runs with attn_implementation="swiftspec": the forward
        carries a `TreeStep` (prefix length + the tree mask packed to bits, built once per step and
        read by every layer); any other forward (prefill, plain `target.generate`) falls through to
        sdpa with the mask transformers builds.
    "sdpa" / "eager"              the model's own attention with a dense additive 4D mask.

    SwiftSpecConfig.attention:
    "auto"   the Triton kernel on CUDA devices, else the model's own attention + dense mask
    "kernel" the Triton kernel wherever Triton runs (CUDA, or the CPU interpreter under
             TRITON_INTERPRET=1), else its plain-torch reference
    "model"  the model's own attention (sdpa or eager) with a dense additive 4D mask
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def routed_attention(model, backend: str):
    """Route `model`'s attention through swiftspec_attention for a kernel backend, for the duration
    of the block only: the user's attn_implementation is restored afterwards, also on failure."""
    if backend not in KERNEL_BACKENDS:
        yield
        return
    own = model.config._attn_implementation
    register_tree_attention()
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(own or "sdpa")


def dense_tree_mask(prefix_len: int, tree_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask (1, 1, Q, prefix_len + S) from a tree-region mask (Q, S) bool.

    Additive (0 / dtype min) rather than bool because eager attention adds whatever it is given.
    """
    Q = tree_mask.shape[0]
    allowed = torch.cat([tree_mask.new_ones(Q, prefix_len), tree_mask], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=tree_mask.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def tree_step_kwargs(backend: str, prefix_len: int, tree_mask: torch.Tensor, dtype: torch.dtype) -> dict:
    """Forward kwargs that make every layer attend the prefix plus the tree slots `tree_mask` (Q, S) allows."""
    if backend in KERNEL_BACKENDS:
        step = TreeStep(prefix_len, pack_tree_mask(tree_mask[None]), reference=backend == "torch-reference")
        # Any 4D mask passes through transformers' masking unchanged and the kernel reads the TreeStep
        # instead, so a one-element stand-in spares building the dense (Q, prefix + S) mask.
        stand_in = torch.zeros(1, 1, 1, 1, dtype=dtype, device=tree_mask.device)
        return {"attention_mask": stand_in, "swiftspec_tree": step}
    return {"attention_mask": dense_tree_mask(prefix_len, tree_mask, dtype)}
