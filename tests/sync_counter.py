"""SyncCounter: counts the tensor calls that read device values on the host, for tests that bound a round's reads."""

import collections

import torch
from torch.overrides import TorchFunctionMode

SYNCING = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "equal",
                     "unique", "masked_select"})


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that read device values on the host (boolean-mask indexing included)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        tensor_repeats = name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if name in SYNCING or tensor_repeats or (name == "__getitem__" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _indices(args[1])
        )):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _indices(index):
    return index if isinstance(index, tuple) else (index,)
