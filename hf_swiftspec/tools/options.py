"""Command-line plumbing that `swiftspec generate` (cli/__init__.py) and `swiftspec bench` (bench/) share:
the tree options, where and in which dtype a pair loads, and how many torch threads it runs on.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..config import SwiftSpecConfig
from ..modeling import SwiftSpecForCausalLM
from ..pair import PairConfigError

TREE_OPTIONS = ("tree_budget", "draft_width", "draft_depth")  # the SwiftSpecConfig fields the command line overrides

THREADS_HELP = (
    "torch CPU threads per worker (default on CPU: 1; on GPU: torch's choice). Target and draft each run on their "
    "own worker, so torch's default (every core per worker) oversubscribes the cores: on a 2-core machine it made "
    "'generate --compare' print 0.24x-0.39x speed-ups where --threads 1 gave 0.97x"
)


def progress(message: str, prefix: str = "swiftspec") -> None:
    """A progress or status line on stderr, so stdout keeps only the results."""
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    defaults = SwiftSpecConfig()
    for name in TREE_OPTIONS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"override the pair's {name} (SwiftSpecConfig default: {getattr(defaults, name)})",
        )


def tree_overrides(args) -> dict:
    """The tree options given (not None) in parsed arguments or options, as SwiftSpecConfig keyword arguments."""
    return {name: getattr(args, name) for name in TREE_OPTIONS if getattr(args, name) is not None}


def default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def available_devices() -> list[str]:
    """The devices torch can use on this machine, as --device takes them."""
    devices = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            count = backend.device_count() if hasattr(backend, "device_count") else 1
            devices += [kind] if kind == "mps" else [f"{kind}:{i}" for i in range(count)]
    return devices


def resolve_device(name: str | None) -> str:
    """--device as given, checked to exist here (a one-line error, not torch's traceback), or the default."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"--device {name}: not a device type torch knows; this machine has: {', '.join(available_devices())}.") from err
    here = available_devices()
    kinds = {torch.device(d).type for d in here}
    if device.type != "cpu" and str(device) not in here and not (device.type in kinds and device.index in (None, 0)):
        raise ValueError(f"--device {name}: no such device here (torch {torch.__version__}); this machine has: {', '.join(here)}.")
    return name


def load_dtype(name: str | None, device: str):
    """float32 on CPU unless asked (exact and fast there), the checkpoint's own dtype on GPU."""
    if name is None:
        return torch.float32 if torch.device(device).type == "cpu" else "auto"
    if name == "auto":
        return "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PairConfigError(f"--dtype {name!r} is not a torch dtype; use float32, bfloat16, float16 or auto.")
    return dtype


def load_pair(
    location: str, name: str, device: str | None = None, dtype: str | None = None, model_class=SwiftSpecForCausalLM,
    **settings,
) -> SwiftSpecForCausalLM:
    """A pair repo (id or folder) with its tokenizer; `name` is how errors call it, settings override its config."""
    device = device or default_device()
    model = model_class.from_pretrained(location, dtype=load_dtype(dtype, device), device_map=device, **settings)
    if model.tokenizer is None:
        raise PairConfigError(
            f"The pair {name!r} ships no tokenizer (neither its repo nor its target has one); add one to the pair repo."
        )
    return model


def set_threads(threads: int | None, device: str | torch.device) -> str:
    """Set torch's CPU threads: `threads` if given, else 1 for a pair on CPU (THREADS_HELP says why), else
    torch's own. Returns the line that says what is in force, for stderr and the bench's report."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads} must be at least 1.")
        torch.set_num_threads(threads)
        return f"torch threads: {threads} per worker (--threads {threads})"
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
        return "torch threads: 1 per worker (the CPU default, so target and draft do not fight over cores; --threads N to change)"
    return f"torch threads: {torch.get_num_threads()} (torch's default beside a GPU; --threads N to change)"
