"""How the round's fused bookkeeping kernels (tree_walk.py, tree_mask.py, ...) are dispatched.

Each is a torch custom operator (`swiftspec::<name>`, defined with torch.library when its module is imported, with a
fake for shapes alone, so torch.compile traces through it): one operator a profiler or a TorchDispatchMode sees, one
Triton kernel on a GPU (replayed in a CUDA graph like any other), and its plain-torch reference elsewhere (the
reference is what a CPU runs, operator by operator; it is also what the kernel is tested against, under
TRITON_INTERPRET=1).

    use_triton(tensor)                  whether a call on `tensor` runs the Triton kernel: on CUDA with Triton
                                        installed, or anywhere inside `forced("triton")` (tests, in the interpreter)
    forced(backend)                     a context that makes every fused operator run "triton" or "reference"
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
except ImportError:  # pragma: no cover - CPU-only hosts run the references
    triton = None

_FORCED: list[str] = []


@contextlib.contextmanager
def forced(backend: str):
    """Every fused operator called inside runs `backend` ("triton": the kernel, in Triton's interpreter on a CPU
    with TRITON_INTERPRET=1; "reference": the torch reference, on any device)."""
    if backend not in ("triton", "reference"):
        raise ValueError(f"forced(backend={backend!r}): use 'triton' or 'reference'")
    if backend == "triton" and triton is None:
        raise RuntimeError("forced('triton') needs Triton installed (pip install triton)")
    _FORCED.append(backend)
    try:
        yield
    finally:
        _FORCED.pop()


def use_triton(tensor: torch.Tensor) -> bool:
    if _FORCED:
        return _FORCED[-1] == "triton"
    return triton is not None and tensor.is_cuda
