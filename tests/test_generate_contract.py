"""The generate() contract: every argument that applies to a decoder-only model gives exactly what
`target.generate` gives with it, or the documented error.

One row per argument (or combination), each with values that change the plain output (the test
asserts that too, against `base`, so no row passes vacuously), run alone and on a left-padded
prompt with its attention_mask, on two architectures (llama, gpt2), with the default tree
settings and with fixed ones. Greedy rows compare tokens (and scores / logits within float
tolerance); sampling rows compare the processed distribution the target samples each emitted token
from, teacher-forced through plain generate. `test_every_generation_config_field_is_listed` fails
when a transformers release adds a GenerationConfig field or generate() argument that is neither a
row here nor in NOT_APPLICABLE, so a new argument shows up as a failure, not a silent difference.

docs/source/en/generate.md's list of supported arguments is rendered from this table (`python
tests/test_generate_contract.py` rewrites it; a test checks it is current).
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    WatermarkingConfig,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

from hf_swiftspec import SwiftSpecForCausalLM, custom_generate
from hf_swiftspec.tools import sweep
from hf_swiftspec.models.compat import GENERATE_CACHE_ARGUMENTS, cache_argument, output_cache
from hf_swiftspec.tools.models import char_tokenizer, left_padded, random_prompts, tiny_gpt2, tiny_model, truncated_draft

NEW = 12  # new tokens per greedy row
SAMPLED = 5  # new tokens per sampling row (each is re-derived by one plain generate call)
PADDING = 3
VOCAB = 98  # the character tokenizer's, so stop_strings rows run on both architectures
COMMON = dict(do_sample=False, max_new_tokens=NEW)
CACHE_NAME = cache_argument(GenerationMixin.prepare_inputs_for_generation)  # what this release's generate calls a cache


# ---------------------------------------------------------------- user subclasses of built-ins


class NoRepeat(TemperatureLogitsWarper):
    """A temperature warper that also forbids every token already in the sequence: it reads input_ids."""

    def __call__(self, input_ids, scores):
        scores = super().__call__(input_ids, scores)
        return scores.scatter(1, input_ids, float("-inf"))


class StopOnRepeat(EosTokenCriteria):
    """An EosTokenCriteria subclass with its own rule: stop on a token the sequence already holds."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, :-1] == input_ids[:, -1:]).any(dim=-1)


class StopAfter(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Ban(LogitsProcessor):
    """A plain user processor: bans one token."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        return scores.index_fill(1, torch.tensor([self.token]), float("-inf"))


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens: list[int] = []

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.tokens.append(-1)


# ---------------------------------------------------------------- the table


@dataclass
class Case:
    """One prompt as a row sees it: ids (1, L) (left-padded or not), its mask, and the plain free run."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    free: list[int]  # the tokens plain greedy generate gives with COMMON alone
    tokenizer: object

    @property
    def length(self) -> int:
        return self.ids.shape[1]


@dataclass(frozen=True)
class Row:
    """One generate() call. `call` and `base` map a Case to generate kwargs (besides the prompt).

    covers: the GenerationConfig fields and generate() arguments this row exercises.
    base:   the same call without the argument under test: plain generate must give another output.
    inert:  why the argument cannot change plain generate's output (then there is no base).
    error:  the documented refusal (regex) swiftspec=True raises instead.
    warns:  a UserWarning (regex) swiftspec=True gives, with the same output as plain generate.
    sample: a sampling row (the distributions are compared, not the draws).
    prompt: "prompt" (and its left-padded twin), or "none" (generate starts from BOS).
    padded: also run on the left-padded prompt (with its attention_mask).
    """

    name: str
    covers: tuple[str, ...]
    call: Callable[[Case], dict]
    base: Callable[[Case], dict] | None = None
    inert: str = ""
    error: str = ""
    warns: str = ""
    sample: bool = False
    prompt: str = "prompt"
    padded: bool = True


def no_args(case):
    return {}


def scored(**kwargs):
    return dict(return_dict_in_generate=True, output_scores=True, **kwargs)


ROWS = [
    # lengths and stopping
    Row("max_new_tokens", ("max_new_tokens",), lambda c: dict(max_new_tokens=5), no_args),
    Row("max_length", ("max_length",), lambda c: dict(max_new_tokens=None, max_length=c.length + 7), no_args),
    Row("min_length", ("min_length",),
        lambda c: dict(eos_token_id=c.free[1], min_length=c.length + 4), lambda c: dict(eos_token_id=c.free[1])),
    Row("min_new_tokens", ("min_new_tokens",),
        lambda c: dict(eos_token_id=c.free[1], min_new_tokens=1 + 3), lambda c: dict(eos_token_id=c.free[1])),
    Row("min_new_tokens=1 (issue 19, item 1)", ("min_new_tokens",),
        lambda c: dict(eos_token_id=c.free[0], min_new_tokens=1), lambda c: dict(eos_token_id=c.free[0])),
    Row("eos_token_id", ("eos_token_id",), lambda c: dict(eos_token_id=c.free[3]), no_args),
    Row("eos_token_id list", ("eos_token_id",), lambda c: dict(eos_token_id=[c.free[5], c.free[2]]), no_args),
    Row("stop_strings", ("stop_strings", "tokenizer"),
        lambda c: dict(stop_strings=[c.tokenizer.decode(c.free[2:4])], tokenizer=c.tokenizer), no_args),
    Row("stopping_criteria", ("stopping_criteria",),
        lambda c: dict(stopping_criteria=StoppingCriteriaList([StopAfter(c.free[4])])), no_args),
    Row("user MaxLengthCriteria (item 2)", ("stopping_criteria",),
        lambda c: dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(c.length + 5)])), no_args),
    Row("user MaxLengthCriteria beyond max_new_tokens (it replaces generate's own)", ("stopping_criteria",),
        lambda c: dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(c.length + NEW + 4)])), no_args),
    Row("user MaxLengthCriteria, sampling warpers only (item 2)", ("stopping_criteria",),
        lambda c: dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(c.length + 3)]), do_sample=True,
                       top_k=1), lambda c: dict(do_sample=True, top_k=1)),
    Row("EosTokenCriteria subclass (item 3)", ("stopping_criteria",),
        lambda c: dict(stopping_criteria=StoppingCriteriaList([StopOnRepeat(eos_token_id=2)])), no_args),
    Row("forced_eos_token_id", ("forced_eos_token_id",), lambda c: dict(forced_eos_token_id=2, max_new_tokens=8),
        lambda c: dict(max_new_tokens=8)),
    Row("pad_token_id (generate masks the prompt's first token as padding)", ("pad_token_id",),
        lambda c: dict(pad_token_id=int(c.ids[0, 0])), no_args, padded=False),
    # logits processors
    Row("repetition_penalty", ("repetition_penalty",), lambda c: dict(repetition_penalty=3.0), no_args),
    Row("repetition_penalty < 1", ("repetition_penalty",), lambda c: dict(repetition_penalty=0.3), no_args),
    Row("encoder_repetition_penalty", ("encoder_repetition_penalty",),
        lambda c: dict(encoder_repetition_penalty=5.0), no_args),
    Row("no_repeat_ngram_size", ("no_repeat_ngram_size",), lambda c: dict(no_repeat_ngram_size=1), no_args),
    Row("bad_words_ids", ("bad_words_ids",), lambda c: dict(bad_words_ids=[[c.free[1]], [c.free[0], c.free[1]]]),
        no_args),
    Row("sequence_bias", ("sequence_bias",), lambda c: dict(sequence_bias={(c.free[0],): -50.0}), no_args),
    Row("suppress_tokens", ("suppress_tokens",), lambda c: dict(suppress_tokens=[c.free[2]]), no_args),
    Row("begin_suppress_tokens", ("begin_suppress_tokens",), lambda c: dict(begin_suppress_tokens=[c.free[0]]),
        no_args),
    Row("exponential_decay_length_penalty", ("exponential_decay_length_penalty",),
        lambda c: dict(exponential_decay_length_penalty=(2, 3.0)), no_args),
    Row("forced_bos_token_id", ("forced_bos_token_id", "bos_token_id"),
        lambda c: dict(forced_bos_token_id=7, bos_token_id=5), lambda c: dict(bos_token_id=5), prompt="none"),
    Row("bos_token_id (no prompt)", ("bos_token_id", "inputs"), lambda c: dict(bos_token_id=5), no_args,
        prompt="none"),
    Row("renormalize_logits", ("renormalize_logits", "output_scores", "return_dict_in_generate"),
        lambda c: scored(renormalize_logits=True), lambda c: scored()),
    Row("remove_invalid_values", ("remove_invalid_values",),
        lambda c: scored(remove_invalid_values=True, sequence_bias={(5,): float("inf")}),
        lambda c: scored(sequence_bias={(5,): float("inf")})),
    Row("prefix_allowed_tokens_fn", ("prefix_allowed_tokens_fn",),
        lambda c: dict(prefix_allowed_tokens_fn=lambda batch, ids: [int(ids[-1]) % 7 + 3, int(ids.sum()) % 90 + 3]),
        no_args),
    Row("logits_processor", ("logits_processor",), lambda c: dict(logits_processor=LogitsProcessorList([Ban(c.free[1])])),
        no_args),
    Row("TemperatureLogitsWarper subclass reading input_ids (item 4)", ("logits_processor",),
        lambda c: dict(logits_processor=LogitsProcessorList([NoRepeat(0.9)])), no_args),
    Row("guidance_scale", ("guidance_scale",), lambda c: dict(guidance_scale=3.0), no_args),
    Row("guidance_scale with negative_prompt_ids", ("guidance_scale", "negative_prompt_ids", "negative_prompt_attention_mask"),
        lambda c: dict(guidance_scale=3.0, negative_prompt_ids=c.ids[:, -3:],
                       negative_prompt_attention_mask=torch.ones_like(c.ids[:, -3:])),
        lambda c: dict(guidance_scale=3.0)),
    Row("watermarking_config", ("watermarking_config",),
        lambda c: dict(watermarking_config=WatermarkingConfig(bias=20.0, greenlist_ratio=0.25)), no_args),
    # outputs
    Row("output_scores", ("output_scores", "return_dict_in_generate"), lambda c: scored(repetition_penalty=1.3),
        lambda c: scored()),
    Row("output_logits", ("output_logits", "return_dict_in_generate"),
        lambda c: dict(return_dict_in_generate=True, output_logits=True), lambda c: dict(return_dict_in_generate=True)),
    Row("streamer", ("streamer",), lambda c: dict(streamer=Collect(), repetition_penalty=3.0),
        inert="streams what generate returns (the test compares the streamed tokens)"),
    Row("generation_config", ("generation_config",),
        lambda c: dict(generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=c.free[3],
                                                          pad_token_id=0, repetition_penalty=1.2)), no_args),
    Row("attention_mask (left padding)", ("attention_mask",), lambda c: dict(repetition_penalty=3.0),
        inert="the tokens with and without left padding are the same; every row's padded twin checks processors"),
    # sampling: the distribution each emitted token is drawn from
    Row("do_sample", ("do_sample",), lambda c: dict(do_sample=True), lambda c: dict(do_sample=True, top_k=3),
        sample=True),
    Row("temperature", ("temperature",), lambda c: dict(do_sample=True, temperature=0.5),
        lambda c: dict(do_sample=True), sample=True),
    Row("top_k", ("top_k",), lambda c: dict(do_sample=True, top_k=3), lambda c: dict(do_sample=True), sample=True),
    Row("top_p", ("top_p",), lambda c: dict(do_sample=True, top_p=0.5), lambda c: dict(do_sample=True), sample=True),
    Row("min_p", ("min_p",), lambda c: dict(do_sample=True, min_p=0.9), lambda c: dict(do_sample=True), sample=True),
    Row("typical_p", ("typical_p",), lambda c: dict(do_sample=True, typical_p=0.5), lambda c: dict(do_sample=True),
        sample=True),
    Row("epsilon_cutoff", ("epsilon_cutoff",), lambda c: dict(do_sample=True, epsilon_cutoff=0.05),
        lambda c: dict(do_sample=True), sample=True),
    Row("eta_cutoff", ("eta_cutoff",), lambda c: dict(do_sample=True, eta_cutoff=0.9),
        lambda c: dict(do_sample=True), sample=True),
    Row("top_h", ("top_h",), lambda c: dict(do_sample=True, top_h=0.3), lambda c: dict(do_sample=True), sample=True),
    Row("sampling with repetition_penalty", ("do_sample", "repetition_penalty"),
        lambda c: dict(do_sample=True, repetition_penalty=3.0), lambda c: dict(do_sample=True),
        sample=True),
    # the same tokens whatever the value: swiftspec says it does not use it
    Row("use_cache=False", ("use_cache",), lambda c: dict(use_cache=False), inert="the cache never changes tokens",
        warns="use_cache=False has no effect with swiftspec=True"),
    Row("cache_implementation='static'", ("cache_implementation", "max_cache_len"),
        lambda c: dict(cache_implementation="static", max_cache_len=64), inert="a static cache holds the same KV",
        warns="cache_implementation='static' has no effect"),
    Row("cache_implementation='quantized'", ("cache_implementation", "cache_config"),
        lambda c: dict(cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 4}),
        inert="needs optimum-quanto, not installed here", error="cache_implementation='quantized' is not supported"),
    Row("cache_implementation='paged'", ("cache_implementation", "continuous_batching_config"),
        lambda c: dict(cache_implementation="paged"), inert="continuous batching gives the same greedy tokens",
        error="cache_implementation='paged' is not supported"),
    # bad values: named, with the fix, before transformers fails on them (a TypeError comparing str and int)
    Row("max_new_tokens as a string", ("max_new_tokens",), lambda c: dict(max_new_tokens=str(NEW)),
        inert="plain generate fails inside transformers on it",
        error=f"max_new_tokens='{NEW}' must be an int .* Pass max_new_tokens={NEW}"),
    # documented refusals
    Row("num_beams > 1", ("num_beams", "length_penalty", "early_stopping"),
        lambda c: dict(num_beams=3, length_penalty=0.5, early_stopping=True), inert="beam search may find the greedy tokens",
        error="num_beams=3 is not supported"),
    Row("num_return_sequences", ("num_return_sequences",), lambda c: dict(num_return_sequences=3, do_sample=True),
        lambda c: dict(do_sample=True), sample=True),
    Row("output_attentions=True", ("output_attentions",),
        lambda c: dict(output_attentions=True, return_dict_in_generate=True), inert="adds attentions",
        error="output_attentions=True is not supported"),
    Row("output_hidden_states=True", ("output_hidden_states",),
        lambda c: dict(output_hidden_states=True, return_dict_in_generate=True), inert="adds hidden states",
        error="output_hidden_states=True is not supported"),
    Row("penalty_alpha (contrastive search)", ("penalty_alpha", "low_memory"), lambda c: dict(penalty_alpha=0.6, top_k=4, low_memory=True),
        inert="moved to a Hub repo (needs trust_remote_code and the network)", error="contrastive_search"),
    Row("dola_layers (DoLa)", ("dola_layers",), lambda c: dict(dola_layers="high"),
        inert="moved to a Hub repo (needs trust_remote_code and the network)", error="dola_generation"),
    Row("num_beam_groups (group beam search)", ("num_beam_groups", "diversity_penalty"),
        lambda c: dict(num_beams=2, num_beam_groups=2, diversity_penalty=1.0), inert="moved to a Hub repo",
        error="num_beams=2 is not supported"),
    Row("force_words_ids / constraints (constrained beam search)", ("force_words_ids", "constraints"),
        lambda c: dict(num_beams=2, force_words_ids=[[5]]), inert="moved to a Hub repo",
        error="num_beams=2 is not supported"),
    Row("assistant_model (assisted decoding)", ("assistant_model", "assistant_tokenizer"), lambda c: dict(assistant_model="draft"),
        inert="assisted decoding gives the same greedy tokens", error="brings its own draft"),
    Row("prompt_lookup_num_tokens (prompt lookup decoding)", ("prompt_lookup_num_tokens", "max_matching_ngram_size"),
        lambda c: dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=2),
        inert="prompt lookup gives the same greedy tokens", error="brings its own draft"),
    Row("inputs_embeds (item 6)", ("inputs_embeds",), lambda c: dict(inputs_embeds="embeds", input_ids=None),
        inert="the same prompt as embeddings", error="^inputs_embeds is not supported with swiftspec=True"),
    Row("input_ids with inputs_embeds (item 5)", ("inputs_embeds", "input_ids"), lambda c: dict(inputs_embeds="noisy"),
        no_args, error="input_ids together with inputs_embeds is not supported"),
    Row("a cache from an earlier call: cache, past_key_values (item 7)", GENERATE_CACHE_ARGUMENTS,
        lambda c: {CACHE_NAME: "earlier"},
        inert="continues from the cache of an earlier call", error=f"^{CACHE_NAME} \\(a cache from an earlier call\\) is not supported"),
    Row("position_ids", ("position_ids",), lambda c: dict(position_ids=torch.arange(c.length)[None] * 3),
        inert="gpt2's generate reads them, llama's in transformers 5.23 does not",
        error="position_ids is not supported"),
    Row("token_healing=True", ("token_healing",), lambda c: dict(token_healing=True, tokenizer=c.tokenizer),
        inert="the character tokenizer has nothing to heal", error="token_healing=True is not supported"),
    Row("custom_generate", ("custom_generate", "trust_remote_code"),
        lambda c: dict(custom_generate=lambda model, *a, **k: torch.zeros(1, 1)), inert="returns what it likes",
        error="custom_generate cannot be combined"),
    Row("encoder_no_repeat_ngram_size", ("encoder_no_repeat_ngram_size",),
        lambda c: dict(encoder_no_repeat_ngram_size=1, encoder_repetition_penalty=5.0),
        lambda c: dict(encoder_repetition_penalty=5.0)),
]  # fmt: skip

# GenerationConfig fields and generate() arguments no row exercises, and why.
NOT_APPLICABLE = {
    "decoder_start_token_id": "encoder-decoder models only",
    "max_time": "stops on wall-clock time: nothing deterministic to compare; its MaxTimeCriteria is called like any",
    "synced_gpus": "DeepSpeed ZeRO-3 / FSDP lockstep; swiftspec places its models itself",
    "num_assistant_tokens": "assisted decoding only (assistant_model is refused)",
    "num_assistant_tokens_schedule": "assisted decoding only (assistant_model is refused)",
    "assistant_confidence_threshold": "assisted decoding only (assistant_model is refused)",
    "assistant_lookbehind": "universal assisted decoding only (assistant_model is refused)",
    "target_lookbehind": "universal assisted decoding only (assistant_model is refused)",
    "assistant_early_exit": "self-speculative early exit is assisted decoding (refused: swiftspec brings its draft)",
    "assistant_ensemble_weight": "assisted decoding only (assistant_model is refused)",
    "is_assistant": "marks a model as someone's assistant; unused by its own generate",
    "use_mtp": "multi-token-prediction drafting is assisted decoding (refused: swiftspec brings its draft)",
    "speculation_type": "selects transformers' own speculative mode (assisted decoding), which swiftspec replaces",
    "compile_config": "how transformers compiles its own decode step; the tokens are the same",
    "disable_compile": "how transformers compiles its own decode step; the tokens are the same",
    "prefill_chunk_size": "schedules the prompt's prefill in chunks; the tokens are the same",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}

ARCHITECTURES = ("llama", "gpt2")
SETTINGS = {"default": {}, "fixed": dict(tree_budget=8, draft_depth=4)}


def build_pair(arch: str, settings: dict) -> SwiftSpecForCausalLM:
    if arch == "llama":
        target = tiny_model("llama", seed=0, vocab_size=VOCAB, sharpness=2.0)  # processors then matter
        draft = truncated_draft(target, 2)
    else:  # learned positions, no rotary, a fused QKV projection: a different family from llama
        target = tiny_gpt2(VOCAB)
        draft = sweep.perturbed_copy(target)
    # target_loop=False: every call runs the round (round='auto' would hand a pair whose calls decode plainly to
    # transformers' own loop once that measured faster, leaving the round's path untested by the clock's say)
    return SwiftSpecForCausalLM.from_models(target, draft, target_loop=False, **settings)


@pytest.fixture(scope="module")
def pairs():
    return {(arch, name): build_pair(arch, settings) for arch in ARCHITECTURES for name, settings in SETTINGS.items()}


def cases(model, padded: bool, prompt: str) -> Case:
    tokenizer = char_tokenizer()
    if prompt == "none":
        ids, mask = None, None
    else:
        ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
        mask = None
        if padded:
            ids = torch.cat([torch.zeros(1, PADDING, dtype=torch.long), ids], dim=1)
            mask = (ids != 0).long()
            mask[:, PADDING:] = 1
    free = model.target.generate(ids, attention_mask=mask, **COMMON)
    start = 0 if ids is None else ids.shape[1]
    return Case(ids if ids is not None else free[:, :0], mask, free[0, start:].tolist(), tokenizer)


def resolve(model, case: Case, kwargs: dict) -> dict:
    """Stand-ins the table cannot build without the model: a draft, embeddings, an earlier cache."""
    kwargs = dict(kwargs)
    embed = model.target.get_input_embeddings()
    if kwargs.get("assistant_model") == "draft":
        kwargs["assistant_model"] = model.draft
    if kwargs.get("inputs_embeds") == "embeds":
        kwargs["inputs_embeds"] = embed(case.ids).detach()
    elif kwargs.get("inputs_embeds") == "noisy":  # not the embeddings of input_ids: the target prefills from these
        kwargs["inputs_embeds"] = embed(case.ids).detach() + 0.5 * torch.randn(
            case.ids.shape + (embed.weight.shape[1],), generator=torch.Generator().manual_seed(3)
        )
    if kwargs.get(CACHE_NAME) == "earlier":
        earlier = model.target.generate(case.ids, **COMMON, return_dict_in_generate=True, attention_mask=case.mask)
        kwargs[CACHE_NAME] = output_cache(earlier)
    return kwargs


def plain(model, case: Case, kwargs: dict):
    kwargs = {**COMMON, **resolve(model, case, kwargs)}
    inputs = kwargs.pop("input_ids", case.ids)
    inputs = inputs if inputs is None or inputs.shape[1] else None
    with torch.no_grad():
        return model.target.generate(inputs, attention_mask=case.mask if inputs is not None else None, **kwargs)


def speculative(model, case: Case, kwargs: dict):
    kwargs = {**COMMON, **resolve(model, case, kwargs)}
    inputs = kwargs.pop("input_ids", case.ids)
    inputs = inputs if inputs is None or inputs.shape[1] else None
    return model.generate(inputs, attention_mask=case.mask if inputs is not None else None, swiftspec=True, **kwargs)


def parts(output) -> dict:
    """What a generate output holds: sequences, and the scores / logits / streamed tokens if any."""
    if isinstance(output, torch.Tensor):
        return {"sequences": output}
    return {k: v for k, v in (("sequences", output.sequences), ("scores", output.scores), ("logits", output.logits))
            if v is not None}  # fmt: skip


def finished_steps(sequences: torch.Tensor, length: int, eos) -> list[int]:
    """Per row, how many steps carry its own tokens (up to its EOS; after it, the row is padding)."""
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    return [next((t + 1 for t, tok in enumerate(row[length:]) if tok in eos), len(row) - length)
            for row in sequences.tolist()]


def same(expected, actual, length: int = 0, eos=None) -> bool:
    """Same sequences; scores / logits equal at every step a row still decodes (given `eos`: after a
    row's EOS, generate computes them on the padding and swiftspec says "pad, with certainty")."""
    e, a = parts(expected), parts(actual)
    if e.keys() != a.keys() or e["sequences"].tolist() != a["sequences"].tolist():
        return False
    steps = finished_steps(e["sequences"], length, eos)
    for key in e.keys() - {"sequences"}:
        if len(e[key]) != len(a[key]):
            return False
        for t, (x, y) in enumerate(zip(e[key], a[key])):
            rows = [b for b, n in enumerate(steps) if t < n]
            if not torch.allclose(x[rows].float(), y[rows].float(), atol=1e-4, rtol=1e-4, equal_nan=True):
                return False
    return True


def describe_difference(expected, actual) -> str:
    e, a = parts(expected)["sequences"][0].tolist(), parts(actual)["sequences"][0].tolist()
    at = next((i for i, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
    return f"plain {e}\nswift {a}\nfirst difference at index {at}"


def sampled_distributions(model, case: Case, kwargs: dict, sequence: torch.Tensor) -> list[torch.Tensor]:
    """The processed scores plain generate samples each token of `sequence` after the prompt from."""
    rows = []
    for t in range(case.length, sequence.shape[1]):
        prefix = sequence[:, :t]
        # always a mask: without one, generate would take a sampled pad token for padding and mask it
        mask = torch.cat([torch.ones(1, case.length, dtype=torch.long) if case.mask is None else case.mask,
                          torch.ones(1, t - case.length, dtype=torch.long)], dim=1)
        out = model.target.generate(
            prefix, attention_mask=mask, **{**kwargs, "max_new_tokens": 1}, return_dict_in_generate=True,
            output_scores=True,
        )
        rows.append(out.scores[0])
    return rows


def check_row(model, case: Case, row: Row):
    """The row on `case`'s prompt (one, or a left-padded batch: then every output row is checked)."""
    kwargs = row.call(case)  # called again for the plain side: a row's objects (a streamer) are not shared
    if row.error:
        with pytest.raises((ValueError, TypeError), match=row.error):
            speculative(model, case, kwargs)
        return
    if row.sample:
        kwargs = {**kwargs, "max_new_tokens": SAMPLED}
        torch.manual_seed(0)
        out = speculative(model, case, scored(**kwargs))
        copies = kwargs.get("num_return_sequences", 1)
        teacher = {k: v for k, v in {**COMMON, **kwargs}.items() if k != "num_return_sequences"}
        steps = finished_steps(out.sequences, case.length, model.generation_config.eos_token_id)
        for r in range(out.sequences.shape[0]):  # each row against plain generate on its own prompt, alone
            b = r // copies
            alone = Case(case.ids[b : b + 1], None if case.mask is None else case.mask[b : b + 1], case.free, case.tokenizer)
            expected = sampled_distributions(model, alone, teacher, out.sequences[r : r + 1])
            assert len(expected) == len(out.scores) >= 1
            for t, e in enumerate(expected[: steps[r]]):  # after a row's EOS it is padding
                torch.testing.assert_close(out.scores[t][r : r + 1], e, atol=1e-4, rtol=1e-4, msg=f"{row.name}: row {r}, step {t}")
                assert torch.isfinite(out.scores[t][r, out.sequences[r, case.length + t]]), "a token outside the target's support"
        if copies > 1:
            assert len({tuple(seq) for seq in out.sequences.tolist()}) > 1, "the rows are copies, not independent draws"
        return
    expected = plain(model, case, row.call(case))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = speculative(model, case, kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if row.warns:
        assert any(re.search(row.warns, m) for m in messages), messages
    assert same(expected, actual, case.length, row_eos(model, kwargs)), f"{row.name}\n" + describe_difference(expected, actual)
    if "streamer" in kwargs:
        streamed = kwargs["streamer"].tokens
        assert streamed[-1] == -1 and streamed[:-1] == parts(actual)["sequences"][0].tolist()
    if case.ids.shape[0] > 1:
        looped = any("with the target's own decoding loop" in m for m in messages)
        assert looped == (row.name in TARGET_LOOP_ROWS), f"{row.name}: took generate's own loop: {looped}"
        assert model.swiftspec_stats.engine.startswith("target") == looped


def check_not_vacuous(model, case: Case, row: Row):
    """The argument changes plain generate's output (scores for a sampling row). Plain generate must run it: a row
    with a base whose plain call raised compared nothing (none does; one that should is an inert row)."""
    if row.base is None:
        assert row.inert, f"{row.name}: a row needs a base (the call without the argument) or an inert reason"
        return
    call, base = row.call(case), row.base(case)
    if row.sample:
        call, base = {**call, "max_new_tokens": 1}, {**base, "max_new_tokens": 1}
        e = plain(model, case, scored(**call)).scores[0]
        b = plain(model, case, scored(**base)).scores[0]
        changed = e.shape != b.shape or not torch.allclose(e, b, equal_nan=True)
        assert changed, f"{row.name}: the argument changes nothing in plain generate"
        return
    with_arg, without = plain(model, case, call), plain(model, case, base)
    assert not same(with_arg, without), f"{row.name}: the argument changes nothing in plain generate"


def variants(row: Row):
    return [False, True] if row.prompt == "prompt" and row.padded else [False]


def floor_smoke(arch: str, setting: str, row: Row) -> tuple:
    """The greedy rows on one architecture also run on the floor transformers release (CI's smoke set)."""
    return (pytest.mark.floor,) if (arch, setting) == ("llama", "default") and not row.sample else ()


PARAMS = [
    pytest.param(arch, setting, row, padded, id=f"{arch}-{setting}-{'padded-' if padded else ''}{row.name}",
                 marks=floor_smoke(arch, setting, row))
    for arch in ARCHITECTURES
    for setting in SETTINGS
    for row in ROWS
    for padded in variants(row)
]


@pytest.mark.parametrize("arch, setting, row, padded", PARAMS)
def test_row(pairs, arch, setting, row, padded):
    model = pairs[(arch, setting)]
    case = cases(model, padded, row.prompt)
    if setting == "default":  # the plain side does not depend on the tree settings: check it once
        check_not_vacuous(model, case, row)
    check_row(model, case, row)


def test_every_generation_config_field_is_listed():
    """A field (or generate() argument) of a new transformers release must become a row or a reasoned exclusion."""
    covered = {name for row in ROWS for name in row.covers}
    names = set(GenerationConfig().to_dict()) | set(inspect.signature(GenerationMixin.generate).parameters)
    names -= {"self", "kwargs"}
    unlisted = sorted(names - covered - set(NOT_APPLICABLE))
    assert not unlisted, f"generate arguments with no contract row and no NOT_APPLICABLE reason: {unlisted}"
    assert not covered & set(NOT_APPLICABLE), covered & set(NOT_APPLICABLE)


def test_stop_strings_raise_no_warning_plain_generate_does_not(pairs, monkeypatch):
    """Item 9: stop_strings made transformers warn that generation_config beside kwargs is deprecated."""
    from transformers.generation import utils

    model = pairs[("llama", "default")]
    messages = []
    monkeypatch.setattr(utils.logger, "warning_once", lambda msg, *a, **k: messages.append(msg))
    case = cases(model, False, "prompt")
    kwargs = dict(stop_strings=[case.tokenizer.decode(case.free[2:4])], tokenizer=case.tokenizer, max_new_tokens=NEW)
    plain(model, case, kwargs)
    expected = list(messages)
    speculative(model, case, kwargs)
    assert messages[len(expected):] == expected


ASYNC_ROWS = ("repetition_penalty", "begin_suppress_tokens", "min_new_tokens", "user MaxLengthCriteria (item 2)")


@pytest.mark.parametrize("row", [r for r in ROWS if r.name in ASYNC_ROWS], ids=lambda r: r.name)
def test_asynchronous_engine_sees_the_padding_too(row):
    """The draft on its own thread: the target worker's context is the same padded sequence."""
    serial = build_pair("llama", {})
    threads = {"target": ["cpu"], "draft": ["cpu"]}
    model = SwiftSpecForCausalLM.from_models(serial.target, serial.draft, placement=threads)
    assert model.placement.mode == "threads"
    case = cases(model, True, "prompt")
    expected, actual = plain(model, case, row.call(case)), speculative(model, case, row.call(case))
    assert same(expected, actual), describe_difference(expected, actual)


def test_unknown_model_inputs_are_refused(pairs):
    """A model input the tree steps would drop (token_type_ids here) is an error, not ignored."""
    model = pairs[("gpt2", "default")]
    ids = torch.tensor([[5, 6, 7]])
    assert not torch.equal(model.target.generate(ids, token_type_ids=torch.full_like(ids, 9), **COMMON),
                           model.target.generate(ids, **COMMON))  # fmt: skip
    with pytest.raises(ValueError, match=r"would ignore \['token_type_ids'\]"):
        model.generate(ids, token_type_ids=torch.full_like(ids, 9), **COMMON)


# ---------------------------------------------------------------- batches: every row of a padded batch

BATCH_LENGTHS = (9, 4, 12)
# Rows whose processors or criteria may read other rows of a batch (user classes and subclasses,
# prefix_allowed_tokens_fn's batch id, processors holding the batch's prompt or an unconditional
# model of the whole batch): swiftspec decodes such a batch with generate's own loop, exactly, and
# says so. Every other row speculates.
TARGET_LOOP_ROWS = {
    "stopping_criteria", "EosTokenCriteria subclass (item 3)", "encoder_repetition_penalty",
    "prefix_allowed_tokens_fn", "logits_processor", "TemperatureLogitsWarper subclass reading input_ids (item 4)",
    "guidance_scale", "guidance_scale with negative_prompt_ids", "encoder_no_repeat_ngram_size",
}  # fmt: skip


def batch_case(model) -> Case:
    """Three prompts of different lengths, left-padded, with their attention_mask; `free` is row 0's."""
    ids, mask = left_padded(random_prompts(BATCH_LENGTHS, seed=11, vocab_size=VOCAB))
    free = model.target.generate(ids, attention_mask=mask, **COMMON)
    return Case(ids, mask, free[0, ids.shape[1] :].tolist(), char_tokenizer())


def row_eos(model, kwargs: dict):
    config = kwargs.get("generation_config")
    return kwargs.get("eos_token_id", config.eos_token_id if config is not None else model.generation_config.eos_token_id)


BATCH_PARAMS = [
    pytest.param(arch, setting, row, id=f"{arch}-{setting}-batch-{row.name}")
    for arch in ARCHITECTURES
    for setting in SETTINGS
    for row in ROWS
    if row.prompt == "prompt" and row.padded and row.name != "streamer" and (setting == "default" or not row.sample)
]


@pytest.mark.parametrize("arch, setting, row", BATCH_PARAMS)
def test_batch_row(pairs, arch, setting, row):
    """Every contract row on a left-padded batch of three prompts of different lengths: each row of the
    output exactly as target.generate gives it for the same batch."""
    model = pairs[(arch, setting)]
    check_row(model, batch_case(model), row)


def test_a_streamer_is_refused_for_a_batch(pairs):
    model = pairs[("llama", "default")]
    case = batch_case(model)
    with pytest.raises(ValueError, match="A streamer works with one sequence at a time"):
        speculative(model, case, dict(streamer=Collect()))


# ---------------------------------------------------------------- the docs' list, rendered from the table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "source" / "en" / "generate.md"
START, END = "<!-- generate-arguments:start -->", "<!-- generate-arguments:end -->"


def page_block() -> str:
    plain_name = lambda row: re.sub(r" \((item|issue) [^)]*\)", "", row.name)  # noqa: E731
    exact = sorted({n for r in ROWS if not r.error and not r.warns for n in r.covers})
    code = lambda names: ", ".join(f"`{n}`" for n in names)  # noqa: E731
    lines = [
        START,
        "<!-- generated from tests/test_generate_contract.py: `python tests/test_generate_contract.py` rewrites it -->",
        "- Exactly `target.generate`'s output (greedy: tokens, scores and logits; sampling: the distribution every "
        f"token is drawn from): {code(exact)}.",
        "- The same tokens, with a warning that swiftspec keeps its own cache: "
        + "; ".join(plain_name(r) for r in ROWS if r.warns) + ".",
        "- Refused, with an error that says what to pass instead: " + "; ".join(plain_name(r) for r in ROWS if r.error)
        + ". With `return_dict_in_generate`, the output's cache (`cache`; `past_key_values` before transformers 5.24) is None.",
        f"- Not applicable: {code(sorted(NOT_APPLICABLE))} (reasons in the test).",
        END,
    ]
    return "\n".join(lines)


def test_the_generate_page_lists_the_contract():
    text = PAGE.read_text()
    assert START in text and END in text, f"{PAGE} needs a {START} ... {END} block"
    current = text[text.index(START) : text.index(END) + len(END)]
    assert current == page_block(), f"{PAGE.name}'s generate arguments are stale: run python tests/test_generate_contract.py"


if __name__ == "__main__":
    text = PAGE.read_text()
    PAGE.write_text(text[: text.index(START)] + page_block() + text[text.index(END) + len(END) :])
    print(f"rewrote the generate arguments in {PAGE}")


# ---------------------------------------------------------------- the same rows through custom_generate

# transformers hands a custom loop neither streamer= nor tokenizer= (stop_strings): the repo form maps both
# (tests/test_custom_generate.py); here every other greedy row
CALLABLE_ROWS = [r for r in ROWS if not (r.error or r.warns or r.sample or {"streamer", "stop_strings"} & set(r.covers))]


@pytest.mark.parametrize(
    "row, padded", [(row, padded) for row in CALLABLE_ROWS for padded in variants(row)],
    ids=lambda v: v.name if isinstance(v, Row) else ("padded" if v else "alone"),
)
def test_row_through_custom_generate(pairs, row, padded):
    """A plain model speculates through transformers' custom_generate (hf_swiftspec.custom_generate): each
    greedy row gives exactly what target.generate gives, on the llama pair with the default settings."""
    model = pairs[("llama", "default")]
    case = cases(model, padded, row.prompt)
    kwargs = {**COMMON, **resolve(model, case, row.call(case))}
    inputs = kwargs.pop("input_ids", case.ids)
    inputs = inputs if inputs is None or inputs.shape[1] else None
    mask = case.mask if inputs is not None else None
    actual = model.target.generate(inputs, attention_mask=mask, custom_generate=custom_generate,
                                   swiftspec_draft=model.draft, **kwargs)
    expected = plain(model, case, row.call(case))
    assert same(expected, actual, case.length, row_eos(model, kwargs)), f"{row.name}\n" + describe_difference(expected, actual)
