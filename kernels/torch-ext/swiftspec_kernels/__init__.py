"""swiftspec_kernels: Triton kernels for tree speculative decoding (a universal Hub kernel).

Importing this package compiles nothing and needs no GPU; kernels are wrapped on first call.
"""

from .tree_attention import (
    pack_tree_mask,
    tree_attention,
    tree_attention_reference,
    triton_available,
    unpack_tree_mask,
)

__all__ = [
    "pack_tree_mask",
    "tree_attention",
    "tree_attention_reference",
    "triton_available",
    "unpack_tree_mask",
]
