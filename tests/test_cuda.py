"""On a GPU: the decode path on CUDA, tree steps through the model's own attention (the default) and through
the Triton kernel (`attention="kernel"`). Skipped without CUDA; a GPU session runs it with
`python examples/gpu_session.py --phase tests` (or `bash examples/gpu_lease.sh`).

Every check is the sweep's (tools/sweep.py): greedy output token for token against the model's own
`generate` on the same device, float32, over its shapes (a deep and a wide tree, the default settings, a
left-padded batch), with windows and slot limits shrunk below the prompts."""

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.steps.attention import resolve_attention
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import left_padded, random_prompts, tiny_model, truncated_draft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (examples/gpu_session.py --phase tests)")

# One of each attention family docs/source/en/architectures.md claims (tests/test_architectures.py's REPRESENTATIVE, less the refused).
CUDA_TYPES = [
    "llama", "gpt2", "gemma3_text", "mistral", "qwen2", "llama4_text", "gpt_oss", "deepseek_v3", "deepseek_v32",
    "gpt_neo", "doge", "bloom", "mamba2", "qwen3_next", "lfm2",
]  # fmt: skip


@pytest.mark.parametrize("attention", ["auto", "kernel"])
@pytest.mark.parametrize("model_type", CUDA_TYPES)
def test_sweep_shapes_equal_own_generate_on_cuda(model_type, attention):
    outcome = sweep.check_type(model_type, device="cuda", attention=attention)
    assert outcome.status in ("tree", "chain", "plain"), f"{model_type}: {outcome.status}: {outcome.reason}"


@pytest.mark.parametrize("attention, backend", [("kernel", "triton"), ("auto", "sdpa")])
def test_attention_choice_on_cuda(attention, backend):
    """"kernel" runs the Triton tree kernel on CUDA; "auto" the model's own attention (faster in eager steps)."""
    target = tiny_model("llama").cuda()
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), attention=attention)
    prompt = torch.tensor(random_prompts([17], seed=3), device="cuda")
    expected = target.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=32, do_sample=False, swiftspec=True), expected)
    assert resolve_attention(attention, target) == backend
    assert backend in model.swiftspec_stats.attention, model.swiftspec_stats.attention


@pytest.mark.parametrize("attention", ["model", "kernel"])
def test_left_padded_batch_on_cuda(attention):
    target = tiny_model("qwen3").cuda()
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), attention=attention)
    ids, mask = (t.cuda() for t in left_padded(random_prompts([3, 29, 11, 1], seed=5), pad=0))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    actual = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, swiftspec=True)
    assert actual.tolist() == expected.tolist()


def test_async_placement_on_one_gpu_is_refused_by_name():
    """The asynchronous engine needs the draft on a device of its own: both on one GPU is refused, naming it."""
    target = tiny_model("llama", seed=2).cuda()
    placement = {"target": ["cuda:0"], "draft": ["cuda:0"]}
    with pytest.raises(ValueError, match=r"both on cuda:0.*placement=None"):
        SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), placement=placement)


@pytest.mark.parametrize("rows", [1, 4])
def test_device_round_on_cuda_replays_and_never_synchronises_a_round(rows, monkeypatch):
    """round="auto" on CUDA takes the device round (its stats say so); its phases replay from CUDA graphs (no eager
    fallback); every round runs under torch.cuda.set_sync_debug_mode("error") (its one read is a pinned copy and an
    event, its one host copy pinned and non-blocking: a pageable copy or a stream sync raises); greedy output is
    target.generate's, a second call replays the first one's graphs, and EOS lists of other widths replay exactly; both
    models attend through the tree kernel inside the graphs (attention="auto", replayed on CUDA)."""
    from hf_swiftspec.engine import rounds

    body = rounds.one_round

    def strict(sides, live):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return body(sides, live)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(rounds, "one_round", strict)
    target = tiny_model("llama", seed=0).cuda()
    target.generation_config.eos_token_id = None
    pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), draft_depth=3, draft_width=2,
                                            tree_budget=6)
    prompts = random_prompts([9, 17, 5, 12][:rows], seed=3)
    ids, mask = left_padded(prompts) if rows > 1 else (torch.tensor(prompts), None)
    ids, mask = ids.cuda(), None if mask is None else mask.cuda()
    for eos in (None, [7], [7, 11, 90]):
        kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=eos)
        assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist(), eos
        stats = pair.swiftspec_stats
        assert stats.engine == "device" and "the device round" in stats.round_choice
        assert "replayed phases, cuda" in stats.attention and "eager:" not in stats.attention, stats.attention
        assert "target=triton, draft=triton" in stats.attention  # "auto", replayed on CUDA: the tree kernel
