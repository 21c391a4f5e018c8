import pytest
import torch

from hf_swiftspec.testing import tiny_model, truncated_draft

# Tiny models run fastest on one thread; with two, OpenMP spin-waits cost milliseconds per matmul
# whenever the other core is busy.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_pair():
    """(target, agreeing draft, random draft) for llama, built once per session."""
    target = tiny_model("llama", seed=0)
    return target, truncated_draft(target, 2), tiny_model("llama", seed=1, layers=1)
