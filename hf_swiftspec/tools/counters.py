"""Counting what a round costs a GPU, on a CPU: host reads, host data made into tensors, operators dispatched
(each one a kernel on a GPU, graph or not) and the keys each attention call reads.

    with RoundCounter(models=(target, draft)) as counter:
        ...                                           # one round
    counter.reads, counter.host_tensors, counter.operators, counter.forward_operators, counter.keys_read

The tests bound a round's counts with these (tests/sync_counter.py, tests/test_device_counts.py) and
examples/device_round_counts.py prints them per round.
"""

from __future__ import annotations

import collections
import sys

import torch
from swiftspec_kernels.fused import as_operators
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor calls that read device values on the host.
SYNCING = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "equal",
                     "unique", "masked_select"})
# Calls that make a tensor of host data (a Python list or number): on CUDA `torch.tensor(list, device="cuda")` copies
# from pageable memory and waits for the stream, as a read does; only a pinned, non-blocking copy does not.
HOST_DATA = frozenset({"tensor", "as_tensor"})
# Operators that launch no device kernel: views (metadata only), and scalar_tensor (a Python number wrapped as a CPU
# scalar, the operand of an elementwise kernel that is counted itself).
NO_KERNEL = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.expand.default",
                       "aten.permute.default", "aten.transpose.int", "aten.unsqueeze.default", "aten.squeeze.dim",
                       "aten.squeeze.default", "aten.slice.Tensor", "aten.select.int", "aten.alias.default",
                       "aten.detach.default", "aten.as_strided.default", "aten.diagonal.default", "aten.split.Tensor",
                       "aten.split_with_sizes.default", "aten.unbind.int", "aten.lift_fresh.default", "aten.movedim.int",
                       "aten.squeeze.dims", "aten.reshape.default", "aten.unfold.default", "aten.narrow.default",
                       "aten.split.sizes", "aten.chunk.default", "aten.scalar_tensor.default"})


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that read device values on the host (boolean-mask indexing included), and the tensors
    made of host data (`host_tensors`: torch.tensor / torch.as_tensor of a Python list or number). Inside it the fused
    bookkeeping (swiftspec_kernels) runs as on a GPU (its operators, no loop over host values on a CPU)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.calls = collections.Counter()
        self.host_tensors = 0
        self.sites = collections.Counter() if sites else None  # (call, the library's line that made it): counts

    def __enter__(self):
        self.fused = as_operators()
        self.fused.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.fused.__exit__(*exc)
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        tensor_repeats = name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if name in HOST_DATA and args and not isinstance(args[0], torch.Tensor):
            self.host_tensors += 1
            if self.sites is not None:
                self.sites[(name, library_line())] += 1
        elif name in SYNCING or tensor_repeats or (name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args[1])
        )):
            self.calls[name] += 1
            if self.sites is not None:
                self.sites[(name, library_line())] += 1
        return func(*args, **(kwargs or {}))


def _indices(index):
    return index if isinstance(index, tuple) else (index,)


def library_line() -> str:
    """The innermost hf_swiftspec frame's "module.py:line function" (where a call comes from)."""
    frame = sys._getframe(2)
    while frame is not None and ("hf_swiftspec" not in frame.f_code.co_filename
                                 or frame.f_code.co_filename.endswith("counters.py")):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.split("hf_swiftspec/")[-1]
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched (those that launch a kernel: views and reshapes are left out), and among them
    those dispatched inside the forwards of `models` (forward hooks mark them), by operator name. Inside it the fused
    bookkeeping (swiftspec_kernels) goes through its custom operators on any device, as on a GPU: one each."""

    def __init__(self, models=(), sites: bool = False):
        super().__init__()
        self.models = [m for m in models if m is not None]
        self.operators = collections.Counter()
        self.in_forwards = collections.Counter()
        self.sites = collections.Counter() if sites else None
        self.depth = 0
        self.hooks = []

    def __enter__(self):
        self.fused = as_operators()
        self.fused.__enter__()
        for model in self.models:
            self.hooks += [model.register_forward_pre_hook(self._enter_forward),
                           model.register_forward_hook(self._leave_forward)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.fused.__exit__(*exc)
        return super().__exit__(*exc)

    def _enter_forward(self, *args):
        self.depth += 1

    def _leave_forward(self, *args):
        self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name not in NO_KERNEL:
            (self.in_forwards if self.depth else self.operators)[name] += 1
            if self.sites is not None and not self.depth:
                self.sites[library_line()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every operator, the forwards' included."""
        return sum(self.operators.values()) + sum(self.in_forwards.values())

    @property
    def forwards(self) -> int:
        return sum(self.in_forwards.values())

    @property
    def outside(self) -> int:
        """The round's own operators (everything but the models' forwards)."""
        return sum(self.operators.values())


class KeysRead(TorchFunctionMode):
    """The keys each scaled_dot_product_attention call reads: (queries, keys) per call, in call order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            query, key = args[0], args[1]
            self.calls.append((query.shape[-2], key.shape[-2]))
        return func(*args, **(kwargs or {}))
