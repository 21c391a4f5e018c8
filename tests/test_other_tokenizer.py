"""A draft with another tokenizer than the target's, and a draft with a shorter context (issue 64).

The tokenizers are trained in the test (bpe_tokenizer: byte-level "Ġgolf", SentencePiece-like "▁golf", and one whose
spaces end words, "golf "), so the draft spells the target's text in other tokens with other boundaries. Lossless
is checked against target.generate token for token (greedy: default and fixed trees, the asynchronous engine, a
left-padded batch, EOS, stop strings, text split inside a character) and against the target's exact distribution
(chi-square); that the translation proposes what the target accepts, with a draft that continues the target's text
in its own tokens (tau well above 1, mapped token to token or re-tokenised alike); that the draft's cache follows the
verified text (its next expansion equals a plain forward over the text, also after its tail re-encoded otherwise).
"""

import copy

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_swiftspec import SwiftSpecForCausalLM, custom_generate
from hf_swiftspec.drafters.translated import TranslatedDrafter
from hf_swiftspec.drafters.vocabulary import Vocabularies
from hf_swiftspec.pair import PairConfigError
from hf_swiftspec.policy.goodput import GoodputPolicy
from hf_swiftspec.steps.verify import Verified
from hf_swiftspec.tools.models import bpe_tokenizer, left_padded, text_model, tiny_model
from test_continuous import relay_calls

TEXTS = ["alpha bravo charlie", "golf hotel ind", "zulu alpha", "kilo lima mike november"]


@pytest.fixture(scope="module")
def tokenizers():
    return {style: bpe_tokenizer(size, style) for style, size in (("bytes", 450), ("pieces", 700), ("trailing", 560))}


@pytest.fixture(scope="module")
def random_pair(tokenizers):
    """Random models over two tokenizers: nothing agrees but the text, so every round tests the machinery."""
    target = tiny_model("llama", seed=3, vocab_size=len(tokenizers["bytes"]), sharpness=6.0)
    target.generation_config.eos_token_id = None
    draft = tiny_model("llama", seed=4, vocab_size=len(tokenizers["pieces"]), layers=1, sharpness=6.0)
    return target, draft


@pytest.fixture(scope="module")
def text_pair(tokenizers):
    """A target and a draft that both continue CYCLE_TEXT, in their own tokens: the draft copies the target's behaviour."""
    target = text_model(tokenizers["bytes"], seed=0)
    target.generation_config.eos_token_id = None
    return target, text_model(tokenizers["pieces"], seed=1, layers=1)


def greedy(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs).tolist()


SETTINGS = [dict(), dict(tree_budget=8, draft_depth=3), dict(tree_budget=12, draft_depth=4, ngram_size=0),
            dict(placement={"target": ["cpu"], "draft": ["cpu"]})]


@pytest.mark.parametrize("settings", SETTINGS, ids=["adaptive", "fixed", "fixed-no-ngram", "threads"])
@pytest.mark.parametrize("draft_style", ["pieces", "trailing"])
def test_greedy_equals_target_with_a_draft_of_another_tokenizer(tokenizers, random_pair, text_pair, settings, draft_style):
    tt, dt = tokenizers["bytes"], tokenizers[draft_style]
    for target, draft in (random_pair, text_pair):
        if draft.config.vocab_size != len(dt):
            draft = tiny_model("llama", seed=5, vocab_size=len(dt), layers=1, sharpness=6.0)
        # target_loop=False: the random pair decodes plainly, and round='auto' would then time transformers' own loop
        model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, target_loop=False,
                                                 **settings)
        assert model.vocabularies is not None
        for text in TEXTS[:2]:
            ids = tt(text, return_tensors="pt").input_ids
            assert greedy(model, ids, max_new_tokens=24, swiftspec=True) == greedy(target, ids, max_new_tokens=24)
        assert model.swiftspec_stats.translation is not None


def test_text_split_inside_a_character_waits_until_it_is_whole(tokenizers, random_pair):
    """Byte-level tokens split "é" and "東" in two: the draft reads such text only once it is whole (held)."""
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = random_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=6, draft_depth=2)
    ids = tt("café 東京 alpha", return_tensors="pt").input_ids
    for cut in (ids.shape[1], ids.shape[1] - 3, 4):  # the prompt itself may end inside a character
        prompt = ids[:, :cut]
        assert greedy(model, prompt, max_new_tokens=20, swiftspec=True) == greedy(target, prompt, max_new_tokens=20)


def test_a_left_padded_batch_decodes_each_row_as_target_generate(tokenizers, random_pair, text_pair):
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    rows = [tt(text).input_ids for text in TEXTS]
    ids, mask = left_padded(rows, pad=tt.pad_token_id)
    for target, draft in (random_pair, text_pair):
        model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=8, draft_depth=3)
        kwargs = dict(attention_mask=mask, max_new_tokens=20)
        assert greedy(model, ids, swiftspec=True, **kwargs) == greedy(target, ids, **kwargs)


def test_eos_and_stop_strings_end_where_target_generate_ends(tokenizers, text_pair):
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = text_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=8, draft_depth=4)
    ids = tt("alpha bravo", return_tensors="pt").input_ids
    eos = tt(" hotel", add_special_tokens=False).input_ids[0]  # a token the target reaches mid-text
    for kwargs in (dict(eos_token_id=eos), dict(stop_strings=["juli"], tokenizer=tt)):
        out = greedy(model, ids, max_new_tokens=40, swiftspec=True, **kwargs)
        assert out == greedy(target, ids, max_new_tokens=40, **kwargs)
        assert len(out[0]) < ids.shape[1] + 40  # it did stop early
    assert model.swiftspec_stats.tau > 1.5  # and tokens were accepted on the way


@pytest.mark.parametrize("direct", [True, False], ids=["mapped", "re-tokenised"])
def test_a_draft_that_continues_the_target_text_is_accepted(tokenizers, text_pair, direct):
    """The same text in other tokens: most proposed target tokens are the target's, whether the overlap of the two
    vocabularies maps them token by token or every branch is re-tokenised from its text."""
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = text_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=8, draft_depth=4)
    if not direct:
        model.vocabularies.direct = {}
    ids = tt("alpha bravo charlie delta", return_tensors="pt").input_ids
    assert greedy(model, ids, max_new_tokens=48, swiftspec=True) == greedy(target, ids, max_new_tokens=48)
    stats = model.swiftspec_stats
    assert stats.tau > 3.0, stats.summary()
    translation = stats.translation
    assert translation.nodes > 0 and translation.survival > 0.5
    assert (translation.mapped > 0) == direct


def exact_pair_probs(target, prompt, temperature):
    """{(t1, t2): P} of the two tokens after `prompt` at `temperature`, from plain causal forwards (pairs of
    probability below 1e-9 left out: their bins pool into the rest)."""
    def probs(ids):
        return torch.softmax(target(ids).logits[0, -1].double() / temperature, dim=-1)

    joint = {}
    with torch.no_grad():
        first = probs(prompt)
        for t1 in torch.nonzero(first > 1e-9).flatten().tolist():
            second = probs(torch.cat([prompt, torch.tensor([[t1]])], 1))
            for t2 in torch.nonzero(second * first[t1] > 1e-9).flatten().tolist():
                joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def test_sampling_follows_the_target_distribution(tokenizers, text_pair):
    """1,500 two-token draws as the rows of one batched call (each row draws noise of its own, as
    test_sampling.py's processor cases do), against the exact joint (chi-square, bins expected below 5 pooled, fails
    at p < 1e-3). The text model puts most of its mass on the text's next word, which the draft proposes."""
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = text_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=6, draft_depth=2)
    prompt = tt("kilo lima", return_tensors="pt").input_ids
    temperature, draws = 2.0, 1500
    joint = exact_pair_probs(target, prompt, temperature)
    out = model.generate(prompt.expand(draws, -1), do_sample=True, temperature=temperature, top_k=0, max_new_tokens=2,
                         swiftspec=True, generator=torch.Generator().manual_seed(0))
    counts = {}
    for pair in map(tuple, out[:, -2:].tolist()):
        counts[pair] = counts.get(pair, 0) + 1
    accepted = sum(r.accepted for r in model.swiftspec_stats.rounds)
    assert accepted > draws // 4  # many second tokens came from an accepted translated node
    assert set(counts) <= set(joint), "tokens drawn that the target gives (almost) no probability"
    keys = sorted(joint, key=joint.get, reverse=True)
    expected = torch.tensor([joint[k] for k in keys]) * draws
    observed = torch.tensor([float(counts.get(k, 0)) for k in keys])
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    pvalue = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert pvalue > 1e-3, f"p={pvalue:.2e}: samples do not follow the target's distribution"


def expansion_matches_plain_forward(drafter, model):
    """The draft's root children, after one expansion, against a plain causal forward over its committed tokens."""
    drafter.expand()
    tree, ids = drafter.trees[0], drafter.committed[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    children = [i for i in range(tree.size) if int(tree.parents[i]) == 0]
    best = logprobs.topk(len(children))
    assert sorted(int(tree.tokens[i]) for i in children) == sorted(best.indices.tolist())
    for i in children:
        torch.testing.assert_close(tree.scores[i], logprobs[tree.tokens[i]], atol=1e-4, rtol=0)


@pytest.mark.parametrize("draft_style", ["pieces", "trailing"])
def test_the_drafts_cache_follows_the_verified_text(tokenizers, draft_style):
    """After each verdict the draft's tokens spell the target's text and its KV is theirs: with the trailing-space
    tokenizer the draft's last word ("delt", "a") re-encodes as "delta " once the target's next word arrives, so its
    tail is taken back and run again."""
    tt, dt = tokenizers["bytes"], tokenizers[draft_style]
    draft = tiny_model("llama", seed=7, vocab_size=len(dt), layers=2, sharpness=6.0)
    drafter = TranslatedDrafter(draft, Vocabularies.between(tt, dt), capacity=128, tree_capacity=64, width=3,
                                vocab_limit=len(dt), max_positions=512)
    text = tt("alpha bravo charlie delta").input_ids
    drafter.start([text])
    policy = GoodputPolicy(tree_budget=8, draft_depth=2)
    for words in (" echo", " foxtrot golf", " h", "otel india"):
        drafter.expand()
        drafter.expand()
        drafter.propose(0, 8, None, policy)
        new = tt(words, add_special_tokens=False).input_ids
        drafter.accept([None], [Verified(tokens=new, path=list(range(len(new))))])
        text += new
        assert dt.decode(drafter.committed[0], skip_special_tokens=True) == tt.decode(text, skip_special_tokens=True)
        expansion_matches_plain_forward(drafter, draft)
    if draft_style == "trailing":
        assert drafter.counters.taken_back > 0


# ---------------------------------------------------------------- a draft with a shorter context


@pytest.fixture(scope="module")
def short_context_pair():
    """A gpt2 target of 256 positions and a draft of its first layer with 32 (learned positions: a row past them
    would fail in the embedding)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", vocab_size=98, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
        for block in target.transformer.h[1:]:
            block.attn.c_proj.weight.mul_(0.2)
            block.mlp.c_proj.weight.mul_(0.2)
    target.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=None, pad_token_id=0)
    draft = copy.deepcopy(target)
    draft.transformer.h = draft.transformer.h[:1]
    draft.config.n_layer = 1
    draft.transformer.wpe.weight = torch.nn.Parameter(draft.transformer.wpe.weight[:32].clone())
    draft.config.n_positions = draft.config.max_position_embeddings = 32
    return target, draft


@pytest.mark.parametrize("settings", [dict(), dict(tree_budget=8, draft_depth=3),
                                      dict(placement={"target": ["cpu"], "draft": ["cpu"]})],
                         ids=["adaptive", "fixed", "threads"])
@pytest.mark.parametrize("prompt_len", [10, 40])
def test_a_draft_with_a_shorter_context_drafts_past_it(short_context_pair, settings, prompt_len):
    """Its context (32) ends long before the call's (up to 140 positions): it reads the last part of a prompt that does
    not fit, and re-reads a window of the text each time its own fills, drafting to the end."""
    target, draft = short_context_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, **settings)
    ids = torch.randint(3, 98, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    assert greedy(model, ids, max_new_tokens=100, swiftspec=True) == greedy(target, ids, max_new_tokens=100)
    stats = model.swiftspec_stats
    assert stats.draft_slides >= 2 and stats.tau > 1.2, stats.summary()


def test_a_batch_with_a_shorter_draft_context(short_context_pair):
    target, draft = short_context_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tree_budget=6, draft_depth=2)
    ids, mask = left_padded([list(range(5, 25)), list(range(30, 70)), [7, 8, 9]])
    kwargs = dict(attention_mask=mask, max_new_tokens=60)
    assert greedy(model, ids, swiftspec=True, **kwargs) == greedy(target, ids, **kwargs)


def test_requests_joining_a_running_batch_equal_target_generate(tokenizers, random_pair, text_pair):
    """The server's running batch (continuous_engine) with a draft of another tokenizer: each request joins while the
    others are rounds in, and each answer is the target's own, token for token."""
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    for target, draft in (random_pair, text_pair):
        model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt, tree_budget=8, draft_depth=4)
        engine = model.continuous_engine(latency_guard=False)  # trees every round: the translation runs in each
        assert engine.on_device  # round="auto": the device round's running batch, the drafter on the host side
        try:
            prompts = [tt(text, return_tensors="pt").input_ids for text in TEXTS[:3]]
            news = (20, 12, 16)
            calls = [dict(input_ids=ids, max_new_tokens=n, do_sample=False) for ids, n in zip(prompts, news)]
            out = relay_calls(model, engine, calls, at=(2, 1, 1))
        finally:
            engine.close()
        for i, (ids, n) in enumerate(zip(prompts, news)):
            assert out[i].tolist() == greedy(target, ids, max_new_tokens=n), f"request {i}"
        assert max(engine.rounds_by_batch) >= 2, engine.rounds_by_batch  # rows did decode together
    assert engine.usage.accepted > engine.usage.verifications  # the text pair's translated branches were accepted


# ---------------------------------------------------------------- entry points and refusals


def test_custom_generate_takes_both_tokenizers(tokenizers, text_pair):
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = text_pair
    ids = tt("alpha bravo", return_tensors="pt").input_ids
    seen = []
    out = target.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=custom_generate, swiftspec_draft=draft,
                          swiftspec_tokenizer=tt, swiftspec_draft_tokenizer=dt, swiftspec_on_stats=seen.append,
                          swiftspec_settings=dict(tree_budget=8, draft_depth=3))
    assert out.tolist() == greedy(target, ids, max_new_tokens=24)
    assert seen[0].translation is not None and seen[0].tau > 2


def test_the_pair_writes_and_reads_the_drafts_own_tokenizer(tmp_path, tokenizers, text_pair):
    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = text_pair
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=dt)
    model.save_pretrained(tmp_path / "pair", save_members=True)
    assert (tmp_path / "pair" / "draft_tokenizer" / "tokenizer.json").is_file()
    loaded = SwiftSpecForCausalLM.from_pretrained(tmp_path / "pair")
    assert loaded.vocabularies is not None and len(loaded.draft_tokenizer) == len(dt)
    ids = tt("alpha bravo", return_tensors="pt").input_ids
    assert greedy(loaded, ids, max_new_tokens=16, swiftspec=True) == greedy(target, ids, max_new_tokens=16)


def test_refusals_name_the_reason_and_the_fix(tokenizers, random_pair):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tt, dt = tokenizers["bytes"], tokenizers["pieces"]
    target, draft = random_pair
    mute = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(len(dt))},
                                                                               unk_token="w0")))
    with pytest.raises(PairConfigError, match=r"cannot spell the target's text: .* decodes to 'w0'.*draft_tokenizer="):
        SwiftSpecForCausalLM.from_models(target, draft, tokenizer=tt, draft_tokenizer=mute)
    with pytest.raises(PairConfigError, match=r"Vocabulary mismatch.*Pass the target's tokenizer as tokenizer="):
        SwiftSpecForCausalLM.from_models(target, draft)
    # (round="device" decodes both drafts, another tokenizer and a shorter context: tests/test_device_translated.py)
