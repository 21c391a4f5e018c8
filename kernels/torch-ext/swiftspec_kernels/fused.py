"""How the round's fused bookkeeping kernels (tree_walk.py, tree_mask.py, ...) are dispatched.

Each is a torch custom operator (`swiftspec::<name>`, defined with torch.library when its module is imported, with a
fake for shapes alone, so torch.compile traces through it): one operator a profiler or a TorchDispatchMode sees, one
Triton kernel on a GPU (replayed in a CUDA graph like any other), and its plain-torch reference elsewhere (the
reference is what a CPU runs, operator by operator; it is also what the kernel is tested against, under
TRITON_INTERPRET=1).

    dispatch(operator, reference, tensor, *args, on_cpu=None)   the call: the custom operator where it is one kernel
                                        (on CUDA, or when forced or counted), else the reference called directly (a
                                        CPU skips the custom operator's ~35 us of dispatch: same operators, same
                                        results), or a loop over host values on a CPU where one is faster
    use_triton(tensor)                  whether the operator runs the Triton kernel: on CUDA with Triton installed, or
                                        anywhere inside `forced("triton")` (tests, in the interpreter)
    forced(backend)                     a context that makes every fused operator run "triton" or "reference"
    as_operators()                      a context in which every call goes through its custom operator (what a GPU
                                        dispatches: hf_swiftspec.tools.counters' counters count inside it)
    on_host_values(tensor)              whether a caller may work on `tensor`'s host values instead (a CPU tensor,
                                        neither forced nor counted)
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
except ImportError:  # pragma: no cover - CPU-only hosts run the references
    triton = None

_FORCED: list[str] = []
_AS_OPERATORS: list[bool] = []


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


@contextlib.contextmanager
def as_operators():
    """Every fused call inside goes through its custom operator, on any device (one operator each, as a GPU
    dispatches them; on a CPU the operator runs the reference)."""
    _AS_OPERATORS.append(True)
    try:
        yield
    finally:
        _AS_OPERATORS.pop()


def dispatch(operator, reference, tensor: torch.Tensor, *args, on_cpu=None):
    """operator(*args) where it is one kernel or is counted as one (CUDA, forced(...), as_operators()), else
    reference(*args) (on a CPU the operator would run the same reference behind ~35 us of dispatch), or on_cpu(*args)
    where one is given and the tensors are on the CPU (a loop over host values where that beats the reference's
    tensor operations; it reads them, which a CPU does for free)."""
    if tensor.is_cuda or _FORCED or _AS_OPERATORS:
        return operator(*args)
    if on_cpu is not None and tensor.device.type == "cpu":
        return on_cpu(*args)
    return reference(*args)


def on_host_values(tensor: torch.Tensor) -> bool:
    """Whether a caller may walk `tensor`'s values on the host: a CPU tensor outside forced(...) and the counters
    (where a GPU's dispatch is what is counted)."""
    return tensor.device.type == "cpu" and not _FORCED and not _AS_OPERATORS
