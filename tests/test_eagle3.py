"""EAGLE-3 heads: the published formats load, the head's tree matches plain causal forwards of the head,
and decoding with a head is lossless (greedy token for token against target.generate, batches,
sampling)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sampling import ALPHA, exact_joint, pooled_chisquare, warpers

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import BenchConfig, run_bench
from hf_swiftspec.bench.methods import BenchModels
from hf_swiftspec.drafters.eagle3 import Eagle3Config, Eagle3Head, FeatureTap, load_eagle3_head, save_eagle3_head
from hf_swiftspec.drafters.heads import HeadDrafter
from hf_swiftspec.pair import PairConfigError, create_pair_repo
from hf_swiftspec.tools.eagle3_training import new_head_for, token_windows, train_head
from hf_swiftspec.tools.models import left_padded, tiny_model, truncated_draft
from hf_swiftspec.steps.tree import select_subtree
from hf_swiftspec.steps.verify import Verified

VOCAB = 98
SAMPLING_VOCAB = 12


def llama_layer(hidden=64, vocab=VOCAB, **extra):
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0, max_position_embeddings=512,
                vocab_size=vocab, **extra)


def random_head(target, seed=0, draft_vocab=None, layer_ids=(0, 1, 2), hidden=None, scale=3.0) -> Eagle3Head:
    """A head for `target` with random weights (its own embeddings, a d2t onto the first ids when smaller)."""
    torch.manual_seed(seed)
    width = target.config.hidden_size
    config = Eagle3Config.from_dict({
        "speculators_model_type": "eagle3", "transformer_layer_config": llama_layer(hidden or width),
        "draft_vocab_size": draft_vocab or VOCAB, "target_hidden_size": width,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
    })
    head = Eagle3Head(config).eval()
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
        if draft_vocab:  # draft id i is target id 2i
            head.d2t.copy_(torch.arange(draft_vocab))
    return head


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1, vocab_size=VOCAB)


# ---------------------------------------------------------------- the published formats


def published_tensors(H, I, heads, kv, Ht, V, Vd, prefix, embeddings, fc_bias):
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    d = H // heads
    tensors = {
        "fc.weight": r(H, 3 * Ht), "norm.weight": torch.ones(H), "lm_head.weight": r(Vd, H),
        "d2t": torch.arange(Vd), "t2d": torch.isin(torch.arange(V), 2 * torch.arange(Vd)),  # draft id i: target id 2i
        f"{prefix}input_layernorm.weight": torch.ones(H), f"{prefix}hidden_norm.weight": torch.ones(H),
        f"{prefix}post_attention_layernorm.weight": torch.ones(H),
        f"{prefix}self_attn.q_proj.weight": r(heads * d, 2 * H), f"{prefix}self_attn.k_proj.weight": r(kv * d, 2 * H),
        f"{prefix}self_attn.v_proj.weight": r(kv * d, 2 * H), f"{prefix}self_attn.o_proj.weight": r(H, heads * d),
        f"{prefix}mlp.gate_proj.weight": r(I, H), f"{prefix}mlp.up_proj.weight": r(I, H), f"{prefix}mlp.down_proj.weight": r(H, I),
    }
    if embeddings:
        tensors["embed_tokens.weight"] = r(V, H)
    if fc_bias:
        tensors["fc.bias"] = r(H)
    return tensors


def write_eagle_authors_head(folder, target, draft_vocab=48):
    """The EAGLE authors' layout (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a llama config with draft_vocab_size,
    tensors midlayer.*, no embeddings (the target's are used), fc without bias."""
    H, L = target.config.hidden_size, target.config.num_hidden_layers
    config = dict(llama_layer(H), architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  torch_dtype="float16", rope_scaling=None, pretraining_tp=1, use_cache=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(published_tensors(H, 2 * H, 4, 2, H, VOCAB, draft_vocab, "midlayer.", False, False),
              str(folder / "model.safetensors"))


def write_speculators_head(folder, target, draft_vocab=48, layer_ids=(0, 1, 2)):
    """vLLM speculators' layout (RedHatAI/*speculator.eagle3): transformer_layer_config, layers.0.*,
    embed_tokens, fc with bias, eagle_aux_hidden_state_layer_ids."""
    H = target.config.hidden_size
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
        "draft_vocab_size": draft_vocab, "norm_before_residual": False, "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "transformer_layer_config": dict(llama_layer(H), model_type="llama", num_hidden_layers=1),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(published_tensors(H, 2 * H, 4, 2, H, VOCAB, draft_vocab, "layers.0.", True, True),
              str(folder / "model.safetensors"))


@pytest.mark.floor  # the head's layer comes from transformers' llama internals (compat): also on the floor release
@pytest.mark.parametrize("writer, fmt", [(write_eagle_authors_head, "eagle"), (write_speculators_head, "speculators")])
def test_published_formats_load_and_decode_losslessly(tmp_path, target, writer, fmt):
    writer(tmp_path / "head", target)
    head = load_eagle3_head(tmp_path / "head")
    assert head.config.format == fmt
    assert (head.embed_tokens is None) == (fmt == "eagle")  # the authors' heads read the target's embeddings
    model = SwiftSpecForCausalLM.from_models(target, head)
    if fmt == "eagle":
        assert head.layer_ids == (2, 1, 0)  # the default for a 3-layer target: 2, L // 2, L - 3
        assert head.embed_tokens is target.get_input_embeddings()
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False, swiftspec=True), expected)
    assert model.swiftspec_stats.draft_forwards > 0  # the head drafted
    # written back in the same format, it loads as the same head
    save_eagle3_head(head, tmp_path / "again", fmt)
    again = load_eagle3_head(tmp_path / "again")
    for name, tensor in head.state_dict().items():
        if not name.startswith("embed_tokens") or fmt == "speculators":
            assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("writer", [write_eagle_authors_head, write_speculators_head])
def test_t2d_is_checked_against_d2t(tmp_path, target, writer):
    """Both formats ship t2d (which target ids have a draft id) beside d2t; the loader holds one to the other, so
    a d2t of target ids read as offsets (or tensors of another head) is refused instead of drafting other tokens."""
    writer(tmp_path / "head", target)
    head = load_eagle3_head(tmp_path / "head")  # its t2d marks exactly d2t's targets, the even ids below 96
    assert head.target_ids(torch.arange(48)).tolist() == list(range(0, 96, 2))
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert torch.equal(tensors["t2d"].nonzero().flatten(), torch.arange(0, 96, 2))
    save_file({**tensors, "t2d": torch.arange(VOCAB) < 48}, str(tmp_path / "head" / "model.safetensors"))  # absolute ids
    with pytest.raises(ValueError, match=r"t2d and d2t disagree: t2d marks 48 target ids, d2t maps its 48 draft ids to "
                                         r"48 \(marked only by t2d: \[1, 3, 5, 7, 9\], only by d2t: \[48, 50, 52, 54, 56\]\)"
                                         r"\. Re-export the head"):
        load_eagle3_head(tmp_path / "head")
    save_file({**tensors, "t2d": torch.ones(VOCAB + 30, dtype=torch.bool)}, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"t2d has shape \(128,\), but the head's target vocabulary has 98 ids"):
        load_eagle3_head(tmp_path / "head")


def test_a_head_for_another_target_is_refused_by_name(tmp_path, target):
    with pytest.raises(ValueError, match=r"layers \[0, 1, 7\].*3 decoder layers"):
        SwiftSpecForCausalLM.from_models(target, random_head(target, layer_ids=(0, 1, 7)))
    wide = tiny_model("llama", seed=2, vocab_size=VOCAB, hidden=96)
    with pytest.raises(ValueError, match="width 64.*96 wide"):
        SwiftSpecForCausalLM.from_models(wide, random_head(target))
    # compile=True refuses nothing the round serves: a tapped target runs its layers compiled, the tap's hooks with them
    prompt = torch.tensor([[5, 6, 7]])
    out = SwiftSpecForCausalLM.from_models(target, random_head(target), compile=True).generate(
        prompt, max_new_tokens=6, swiftspec=True, do_sample=False)
    assert out.tolist() == target.generate(prompt, max_new_tokens=6, do_sample=False).tolist()
    (tmp_path / "bin").mkdir()
    write_speculators_head(tmp_path / "bin", target)
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no .safetensors.*pytorch_model.bin"):
        load_eagle3_head(tmp_path / "bin")


# ---------------------------------------------------------------- the head's tree against plain forwards


@torch.no_grad()
def test_tree_nodes_score_as_plain_causal_forwards_of_the_head(target):
    """Every child the drafter adds is the top-k of a cache-free causal forward of the head over the node's
    branch: committed tokens with the target's states of the token before, then the head's own outputs."""
    head = random_head(target, draft_vocab=48).bind(target)
    prompt = [5, 17, 33, 8, 5, 17, 40, 9]
    tap = FeatureTap(target, head.layer_ids)
    with tap:
        target(torch.tensor([prompt]))
        states = tap.take()[0]  # (L, 3H)
    drafter = HeadDrafter(head, capacity=64, tree_capacity=64, width=2, vocab_limit=VOCAB)
    drafter.start([prompt], [states])
    for _ in range(3):
        drafter.expand()
    tree = drafter.tree
    fused = head.fuse(states)
    checked = 0
    for node in range(tree.size):
        if not bool(tree.expanded[node]):
            continue
        branch = [node]
        while tree.parents[branch[0]] >= 0:
            branch.insert(0, int(tree.parents[branch[0]]))
        tokens = prompt[1:] + [int(tree.tokens[n]) for n in branch[1:]]
        inputs = [fused[: len(prompt) - 1]]
        out = None
        for depth in range(len(branch)):  # each depth's hidden input is the previous depth's output
            ids = torch.tensor([tokens[: len(prompt) - 1 + depth]])
            hidden = torch.cat(inputs)[None]
            out = head(ids, torch.arange(ids.shape[1])[None], hidden)
            inputs.append(out.hidden[0, -1:])
        logprobs, draft_ids = torch.log_softmax(out.logits[0, -1], -1).topk(2)
        children = (tree.parents[: tree.size] == node).nonzero().flatten()
        assert sorted(tree.tokens[children].tolist()) == sorted(head.target_ids(draft_ids).tolist())
        assert torch.allclose(tree.scores[children].sort().values,
                              (tree.scores[node] + logprobs).sort().values, atol=1e-4)
        checked += 1
    assert checked >= 3


# ---------------------------------------------------------------- lossless decoding


def test_greedy_batches_with_a_head_equal_target_generate(target):
    model = SwiftSpecForCausalLM.from_models(target, random_head(target, draft_vocab=48), tree_budget=8, draft_depth=3)
    rows = [[5, 17, 33, 8, 5, 17], [40, 9, 12], [7, 7, 7, 7, 7, 7, 7, 7, 30]]
    ids, mask = left_padded(rows)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, swiftspec=True)
    assert torch.equal(out, expected)
    assert model.swiftspec_stats.draft_forwards > 0


@torch.no_grad()
def test_verified_tokens_run_with_the_target_states_of_the_token_before(target, monkeypatch):
    """What the target hands the head after each verification: for every emitted token, the states at the
    token before it, as a plain forward of the final sequence computes them; and the next expansion of the
    new root scores as a plain causal forward of the head over the whole sequence."""
    head = random_head(target, draft_vocab=48).bind(target)
    seen = []
    original = HeadDrafter.reroot_row

    def recording(self, b, subtree, verified):
        seen.append((len(self.committed[b]) - len(verified.tokens), list(verified.tokens), verified.features.clone()))
        return original(self, b, subtree, verified)

    monkeypatch.setattr(HeadDrafter, "reroot_row", recording)  # the host round's head drafter
    model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=6, draft_depth=2, round="host")
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, swiftspec=True)
    with FeatureTap(target, head.layer_ids) as tap:
        target(out)
        states = tap.take()[0]
    assert len(seen) >= 4
    for first, tokens, features in seen:  # tokens[j] sits at position first + j; its input is the state before it
        assert out[0, first : first + len(tokens)].tolist() == tokens
        assert torch.allclose(features, states[first - 1 : first - 1 + len(tokens)], atol=1e-5)

    drafter = HeadDrafter(head, capacity=64, tree_capacity=64, width=2, vocab_limit=VOCAB)
    L = prompt.shape[1]
    drafter.start([prompt[0].tolist()], [states[:L]])
    drafter.expand()
    subtree, _ = select_subtree(drafter.tree, 3)
    child = subtree.parents.index(0)
    tokens = [subtree.tokens[child], 11]
    drafter.committed[0] += tokens
    drafter.accept([subtree], [Verified(tokens=tokens, path=[0, child], features=features_of(target, head, prompt, tokens))])
    drafter.expand()
    sequence = prompt[0].tolist() + tokens
    with FeatureTap(target, head.layer_ids) as tap:
        target(torch.tensor([sequence]))
        fused = head.fuse(tap.take()[0])
    ref = head(torch.tensor([sequence[1:]]), torch.arange(len(sequence) - 1)[None], fused[None, :-1])
    logprobs, ids = torch.log_softmax(ref.logits[0, -1], -1).topk(2)
    order = drafter.tree.scores[1:3].argsort(descending=True) + 1
    assert drafter.tree.tokens[order].tolist() == head.target_ids(ids).tolist()
    assert torch.allclose(drafter.tree.scores[order], logprobs, atol=1e-5)


def features_of(target, head, prompt, tokens):
    """The target's states at the root and each accepted token (all but the last emitted one)."""
    sequence = torch.cat([prompt, torch.tensor([tokens[:-1]])], 1)
    with FeatureTap(target, head.layer_ids) as tap:
        target(sequence)
        return tap.take()[0, prompt.shape[1] - 1 :]


def trained_head(target, vocab, steps=150):
    """A small head trained on the target's own samples (seconds): it agrees with the target often."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        samples = [target.generate(torch.randint(3, vocab, (1, 4), generator=g), do_sample=True, max_new_tokens=60,
                                   pad_token_id=0)[0].tolist() for _ in range(16)]
    torch.manual_seed(0)
    head = new_head_for(target, hidden=32, heads=2, layer_ids=(0, 1, 2))
    train_head(head, target, token_windows(samples, 32, 8), steps=steps, lr=5e-3)
    return head


def test_sampling_with_a_trained_head_follows_the_target_distribution():
    """Chi-square of the first two sampled tokens against the target's exact joint (test_sampling.py's check),
    with a head that agrees often enough that accepted tree nodes are sampled in many draws."""
    target = tiny_model("llama", seed=3, vocab_size=SAMPLING_VOCAB)
    target.generation_config.eos_token_id = None
    model = SwiftSpecForCausalLM.from_models(target, trained_head(target, SAMPLING_VOCAB), tree_budget=6,
                                             draft_depth=1, draft_width=3)
    prompt, draws = torch.tensor([[3, 7, 5, 9]]), 1200
    expected = exact_joint(target, prompt, warpers(0.9))
    counts = torch.zeros(SAMPLING_VOCAB**2, dtype=torch.float64)
    accepted = 0
    for seed in range(draws):
        out = model.generate(prompt, do_sample=True, temperature=0.9, max_new_tokens=2,
                             generator=torch.Generator().manual_seed(seed))
        t1, t2 = out[0, -2:].tolist()
        counts[t1 * SAMPLING_VOCAB + t2] += 1
        accepted += model.swiftspec_stats.verify_steps == 1
    assert accepted > draws // 4
    assert pooled_chisquare(counts, expected.flatten() * draws) > ALPHA


def test_a_trained_head_drafts_what_the_target_accepts(target):
    """Greedy with a trained head: exact, and clearly more tokens per verification than a random head's."""
    prompt = torch.tensor([[5, 17, 33, 8]])
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False)
    taus = []
    for head in (random_head(target), trained_head(target, VOCAB, steps=400)):
        model = SwiftSpecForCausalLM.from_models(target, head, tree_budget=8, draft_depth=3)
        assert torch.equal(model.generate(prompt, max_new_tokens=40, do_sample=False, swiftspec=True), expected)
        taus.append(model.swiftspec_stats.tau)
    assert taus[1] > 1.3 * taus[0], taus  # measured: 1.43 random, 2.22 trained


def test_the_bench_times_a_head_beside_the_draft_model_and_suffix_proposals(tmp_path, target):
    """`swiftspec bench --eagle3 HEAD`: the head's method is checked against target.generate and timed with
    the others; assisted generation, which cannot run a head, is skipped with a note when the pair's draft is one."""
    head = random_head(target, draft_vocab=48)
    save_eagle3_head(head, tmp_path / "head")
    config = dict(prompts=("spec_bench",), output_dir=None, num_prompts=1, max_new_tokens=8, warmup=0,
                  growth_check_tokens=0, progress=False)
    models = BenchModels(target, truncated_draft(target, 2), settings={"tree_budget": 6})
    report = run_bench(BenchConfig(models=models, methods=("target", "swiftspec_serial", "swiftspec_suffix"),
                                   eagle3=str(tmp_path / "head"), **config))
    results = {m.name: m for m in report.sets[0].at(1)}
    assert list(results) == ["target", "swiftspec_serial", "swiftspec_suffix", "swiftspec_eagle3"]
    assert all(m.status == "ok" for m in results.values())
    report = run_bench(BenchConfig(models=BenchModels(target, load_eagle3_head(tmp_path / "head")),
                                   methods=("target", "assisted", "swiftspec_serial"), **config))
    results = {m.name: m for m in report.sets[0].at(1)}
    assert results["assisted"].status == "skipped" and "EAGLE-3" in results["assisted"].note
    assert results["swiftspec_serial"].status == "ok"


def test_a_pair_repo_names_a_head_as_its_draft(tmp_path, target):
    """`swiftspec pair create` / create_pair_repo with a head folder as the draft: checked against the target
    by config (a head for another target is refused by name), loaded by from_pretrained, lossless."""
    target.save_pretrained(tmp_path / "target")
    save_eagle3_head(random_head(target, draft_vocab=48), tmp_path / "head")
    create_pair_repo(tmp_path / "pair", str(tmp_path / "target"), str(tmp_path / "head"))
    model = SwiftSpecForCausalLM.from_pretrained(tmp_path / "pair")
    assert isinstance(model.draft, Eagle3Head) and model.draft.layer_ids == (0, 1, 2)
    prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
    expected = model.target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), expected)
    save_eagle3_head(random_head(target, layer_ids=(0, 1, 5)), tmp_path / "other")
    with pytest.raises(PairConfigError, match=r"draft .*other.* layers \[0, 1, 5\]"):
        create_pair_repo(tmp_path / "pair2", str(tmp_path / "target"), str(tmp_path / "other"))


def test_a_head_drafts_in_its_own_thread_losslessly(target, tmp_path):
    """The asynchronous engine (a thread per model): the head starts from the prompt's states the target sends
    after its prefill and follows each verdict's states; a head that reads the target's embeddings gets its own
    copy when it is placed elsewhere, so placing it never moves the target's."""
    write_eagle_authors_head(tmp_path / "head", target)
    for head in (random_head(target, draft_vocab=48), load_eagle3_head(tmp_path / "head")):
        model = SwiftSpecForCausalLM.from_models(target, head, placement={"target": ["cpu"], "draft": ["cpu"]},
                                                 tree_budget=6, draft_depth=2)
        prompt = torch.tensor([[5, 17, 33, 8, 5, 17, 40]])
        expected = target.generate(prompt, max_new_tokens=20, do_sample=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False), expected)
        assert model.swiftspec_stats.engine == "async-threads" and model.swiftspec_stats.draft_forwards > 0
    assert head.embed_tokens is target.get_input_embeddings()  # same device: shared, not copied
