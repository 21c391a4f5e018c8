"""SyncCounter: counts the tensor calls that read device values on the host, for tests that bound a round's reads."""

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode

SYNCING = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "equal",
                     "unique", "masked_select"})


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that read device values on the host (boolean-mask indexing included)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.calls = collections.Counter()
        self.sites = collections.Counter() if sites else None  # (call, the library's line that made it): counts

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        tensor_repeats = name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if name in SYNCING or tensor_repeats or (name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args[1])
        )):
            self.calls[name] += 1
            if self.sites is not None:
                self.sites[(name, library_line())] += 1
        return func(*args, **(kwargs or {}))


def _indices(index):
    return index if isinstance(index, tuple) else (index,)


def library_line() -> str:
    """The innermost hf_swiftspec frame's "module.py:line function" (where a read comes from)."""
    frame = sys._getframe(2)
    while frame is not None and "hf_swiftspec" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.split("hf_swiftspec/")[-1]
    return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
