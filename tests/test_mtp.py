"""A model's own MTP layer drafts a token tree (hf_swiftspec/drafters/mtp.py): lossless on every MTP type of the
installed transformers that builds as a tiny model, its root proposals equal transformers' own MtpModel
layer forward (the layer `generate(use_mtp=True)` runs), sampling follows the target's distribution."""

import pytest
import torch
from transformers import AutoConfig

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.models.compat import MtpModel
from hf_swiftspec.drafters.heads import HeadDrafter
from hf_swiftspec.drafters.mtp import FinalStateTap, mtp_head
from hf_swiftspec.tools import sweep
from hf_swiftspec.tools.models import left_padded, tiny_model
from test_sampling import ALPHA, exact_joint, pooled_chisquare, warpers

# transformers 5.24's types with num_mtp_layers that build as tiny causal LMs with a full-attention MTP layer
# (bailing_hybrid is hybrid recurrent, whose MtpModel does not build without mtp_layer_types; mellum's MTP layer
# slides: refused below; step3p7 and inkling do not build as tiny causal LMs through the Auto classes)
CANDIDATES = ("deepseek_v3", "glm4_moe", "sarvam_mla", "sarvam_moe")


def installed(model_type: str) -> bool:
    try:
        AutoConfig.for_model(model_type)
    except ValueError:  # an older release (the floor has no sarvam types)
        return False
    return True


MTP_TYPES = tuple(t for t in CANDIDATES if installed(t))
PROMPT = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])


def with_mtp(model_type: str, seed: int = 0, **overrides):
    """A tiny target and MTP layer 0 built for it in memory (as MtpModel.from_pretrained builds it, random)."""
    torch.manual_seed(seed)
    target = sweep.tiny_of_type(model_type, seed=seed, **overrides)
    mtp = MtpModel(target, 1)
    with torch.no_grad():  # some types' expert weights come out of MtpModel's own init uninitialised (nan, 1e29)
        for tensor in mtp.layers.parameters():
            if not torch.isfinite(tensor).all() or tensor.abs().max() > 10:
                tensor.normal_(0, 0.02)
    return target, mtp_head(target, mtp)


@pytest.mark.parametrize("model_type", MTP_TYPES)
def test_mtp_drafting_equals_target_generate(model_type):
    target, head = with_mtp(model_type)
    model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=6, draft_depth=3)
    expected = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12, do_sample=False), expected)
    assert model.swiftspec_stats.draft_forwards > 0


def test_mtp_drafting_decodes_a_left_padded_batch():
    target, head = with_mtp("deepseek_v3")
    model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=6, draft_depth=2)
    ids, mask = left_padded([[5, 17, 33, 8, 5, 17], [40, 9, 12], [7, 7, 7, 7, 30]])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)


@torch.no_grad()
def test_root_proposals_are_transformers_own_mtp_layer_forward():
    """The drafter's children of the root: the top-k of transformers' MtpModel.forward_layer(0, ...) over the
    prompt (the main model's final states beside the next tokens), the forward use_mtp runs."""
    target, head = with_mtp("deepseek_v3")
    prompt = PROMPT[0].tolist()
    with FinalStateTap(target) as tap:
        target(PROMPT)
        states = tap.take()[0]
    drafter = HeadDrafter(head, capacity=64, tree_capacity=64, width=3, vocab_limit=target.config.vocab_size)
    drafter.start([prompt], [states])
    drafter.expand()
    ids = PROMPT[:, 1:]
    hidden = head.mtp.forward_layer(0, states[None, :-1], torch.arange(1, PROMPT.shape[1])[None], None, input_ids=ids)
    logprobs, tokens = torch.log_softmax(head.mtp._project_to_logits(hidden[:, -1]).float(), -1)[0].topk(3)
    tree = drafter.tree
    order = tree.scores[1:4].argsort(descending=True) + 1
    assert tree.tokens[order].tolist() == tokens.tolist()
    assert torch.allclose(tree.scores[order], logprobs, atol=1e-4)


def train_to_agree(target, head, steps: int = 150, seed: int = 0) -> None:
    """Fit the MTP layer's own weights (embeddings and head are the target's) to the target's distribution of
    the token after next on random contexts (KL, Adam; ~2 s), so that its proposals are accepted as a trained
    MTP layer's are. A random layer's top 3 of 12 tokens hold about a quarter of the target's mass."""
    mtp = head.mtp
    for p in target.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(mtp.layers.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(3, vocab, (32, 10), generator=generator)
        with torch.no_grad(), FinalStateTap(target) as tap:
            logits = target(ids).logits  # (B, L, V): row i scores token i + 1
            states = tap.take()
        positions = torch.arange(1, ids.shape[1])[None].expand(ids.shape[0], -1)
        # the layer reads state i beside token i + 1 and scores token i + 2, as the target's row i + 1 does
        hidden = mtp.forward_layer(0, states[:, :-1], positions, None, input_ids=ids[:, 1:])
        predicted = mtp._project_to_logits(hidden).float().log_softmax(-1)
        loss = torch.nn.functional.kl_div(predicted, logits[:, 1:].float().softmax(-1), reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_sampling_with_mtp_follows_the_target_distribution():
    """Draws as the rows of one batched call (each row's noise is its own), with an MTP layer trained to agree:
    many first tokens are drafted nodes accepted by sampling, whose second token the target drew at that node."""
    vocab, draws = 12, 1500
    target, head = with_mtp("glm4_moe", seed=3, vocab_size=vocab)
    target.generation_config.eos_token_id = None
    train_to_agree(target, head)
    model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=6, draft_depth=1, draft_width=3)
    prompt = torch.tensor([[3, 7, 5, 9]])
    ids = prompt.repeat(draws, 1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=2,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    expected = exact_joint(target, prompt, warpers(1.0))
    # The root's 3 children are accepted with the probability the target gives them: at best its top 3's mass.
    best = expected.sum(1).topk(3).values.sum().item() * draws
    accepted = sum(r.accepted for r in model.swiftspec_stats.rounds)
    assert model.swiftspec_stats.engine == "device" and accepted > 0.75 * best, (accepted, best)
    counts = torch.bincount(out[:, -2] * vocab + out[:, -1], minlength=vocab * vocab).double()
    assert pooled_chisquare(counts, expected.flatten() * draws) > ALPHA


def test_mtp_refusals_name_the_fix():
    with pytest.raises(ValueError, match="no MTP layers"):
        mtp_head(tiny_model("llama"))
    target, head = with_mtp("deepseek_v3")
    with pytest.raises(ValueError, match="drafts on the target's device, serially"):
        SwiftSpecForCausalLM.from_models(target, head, placement={"target": ["cpu"], "draft": ["cpu"]})
    out = SwiftSpecForCausalLM.from_models(target, head, compile=True).generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert out.tolist() == target.generate(PROMPT, max_new_tokens=4, do_sample=False).tolist()  # compile refuses nothing
    mellum = sweep.tiny_of_type("mellum", seed=0, num_mtp_layers=1)
    with pytest.raises(ValueError, match="sliding_attention layer; MTP drafting takes full-attention layers only"):
        mtp_head(mellum, MtpModel(mellum, 1))
    other, _ = with_mtp("glm4_moe")
    with pytest.raises(ValueError, match="belongs to a DeepseekV3ForCausalLM"):
        SwiftSpecForCausalLM.from_models(other, head)
