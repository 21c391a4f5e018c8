"""A draft of one architecture for a target of another: only the tokenizer must be shared."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.sweep import call_chain_reason, own_generate, perturbed_copy, tiny_of_type


def llama_from_qwen2(qwen2):
    """A Llama-architecture model holding a Qwen2's weights (Qwen2 = Llama with q/k/v biases)."""
    c = qwen2.config
    config = AutoConfig.for_model(
        "llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, max_position_embeddings=c.max_position_embeddings,
        attention_bias=True, tie_word_embeddings=c.tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    llama = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = llama.load_state_dict(qwen2.state_dict(), strict=False)
    assert not unexpected and all(name.endswith("o_proj.bias") for name in missing)
    with torch.no_grad():
        for layer in llama.model.layers:
            layer.self_attn.o_proj.bias.zero_()  # Qwen2 has none
    return llama


def decode_like_target(target, draft, **settings):
    model = SwiftSpecForCausalLM.from_models(target, draft, draft_depth=3, draft_width=4, **settings)
    for length in (4, 30):
        prompt = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))
        expected = own_generate(target, prompt)
        assert own_generate(model, prompt, swiftspec=True).tolist() == expected.tolist()
    return model.swiftspec_stats


def test_llama_draft_for_a_qwen2_target():
    target = tiny_of_type("qwen2")
    stats = decode_like_target(target, perturbed_copy(llama_from_qwen2(target)), tree_budget=8)  # fixed trees: tau
    assert stats.tau > 1.5  # the draft really is another architecture that agrees with the target


@pytest.mark.parametrize(
    "target_type, draft_type",
    [
        ("llama", "gpt2"),  # rotary target, learned-position draft
        ("gemma3_text", "qwen3"),  # sliding-window target, full-attention draft
        ("llama", "bloom"),  # an ALiBi draft: the pair speculates along chains
        ("mpt", "llama"),  # an ALiBi target
        ("deepseek_v3", "mistral"),  # latent-attention target, sliding-window draft
    ],
)
def test_mixed_architectures_decode_like_the_target(target_type, draft_type):
    stats = decode_like_target(tiny_of_type(target_type), tiny_of_type(draft_type, seed=5))
    if "bloom" in (target_type, draft_type) or "mpt" in (target_type, draft_type):
        assert call_chain_reason(stats.attention) is not None, stats.attention  # the call ran chains
