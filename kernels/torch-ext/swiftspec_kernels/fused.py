"""How the round's fused bookkeeping kernels (tree_walk.py, tree_mask.py, ...) are dispatched.

Each is a torch custom operator (`swiftspec::<name>`, registered on its first call, not at import): one operator a
profiler or a TorchDispatchMode sees, one Triton kernel on a GPU (replayed in a CUDA graph like any other), and its
plain-torch reference elsewhere (the reference is what a CPU runs, operator by operator; it is also what the kernel
is tested against, under TRITON_INTERPRET=1).

    fused_operator(name, impl, fake, mutates_args=())
                                        the custom operator, made once (mutates_args: the arguments it writes in
                                        place, as torch.library.custom_op names them)
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


_OPERATORS: dict[str, torch._ops.OpOverload] = {}  # name: the operator fused_operator made


def fused_operator(name: str, impl, fake, mutates_args: tuple[str, ...] = ()) -> torch._ops.OpOverload:
    """The custom operator swiftspec::name running `impl` (annotated: its schema), with `fake` for shapes alone;
    `mutates_args` names the arguments `impl` writes in place (a functional operator: none). Made on the first call,
    then looked up in a plain dict: torch.compile traces through functools.cache into torch.library's registration,
    which it refuses, but traces the lookup of an operator made before it (a first call inside torch.compile still
    fails: call it once eagerly first)."""
    op = _OPERATORS.get(name)
    if op is None:
        op = _OPERATORS[name] = _register(name, impl, fake, mutates_args)
    return op


def _register(name: str, impl, fake, mutates_args: tuple[str, ...]) -> torch._ops.OpOverload:
    op = torch.library.custom_op(f"swiftspec::{name}", impl, mutates_args=mutates_args)
    op.register_fake(fake)
    return op._opoverload
