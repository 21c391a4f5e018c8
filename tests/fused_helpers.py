"""What the fused kernels' tests share (tests/test_fused_*.py): where they run and when the Triton path can.

conftest.py sets TRITON_INTERPRET=1 before Triton's first import on a machine without CUDA: the kernels then run in
Triton's CPU interpreter; on a GPU they run compiled, on tensors on DEVICE."""

import os

import pytest
import torch
from swiftspec_kernels.fused import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(triton is None or (not torch.cuda.is_available()
                                                       and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton's import")
