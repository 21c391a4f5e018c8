import os

import torch

if not torch.cuda.is_available():
    # Triton reads this once, at its first import (transformers imports it through torch._dynamo),
    # so it must be set before anything else: the kernels then run in Triton's CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hf_swiftspec.tools.models import tiny_model, truncated_draft  # noqa: E402

# Tiny models run fastest on one thread; with two, OpenMP spin-waits cost milliseconds per matmul
# whenever the other core is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_pair():
    """(target, agreeing draft, random draft) for llama, built once per session."""
    target = tiny_model("llama", seed=0)
    return target, truncated_draft(target, 2), tiny_model("llama", seed=1, layers=1)
