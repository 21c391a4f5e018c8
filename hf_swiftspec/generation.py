"""The transformers side of the decode loop: generate()'s arguments in, generate()'s outputs out.

`GenerationMixin.generate` runs on the target with `custom_generate=swiftspec_generate`, so its
own argument handling (generation config merging, max_length, logits processors, stopping
criteria with EOS) is exactly the one `target.generate` uses. transformers hands a callable
neither the streamer nor the tokenizer, so they travel as `swiftspec_*` arguments (the
wrapper's generate() ends the streamer, also when anything fails).
"""

from __future__ import annotations

import copy
import inspect
import numbers
import time
import warnings

import torch
from transformers import GenerationConfig, StoppingCriteriaList

from .steps.probes import describe
from .steps.attention import own_implementation
from .models.compat import (
    GENERATE_CACHE_ARGUMENTS,
    PREPARED_CACHE_KWARGS,
    GenerateDecoderOnlyOutput,
    GenerationMode,
    MaxLengthCriteria,
    StopStringCriteria,
    pad_token_tensor,
    sample_loop,
)
from .config import SwiftSpecConfig
from .engine import DecodeRequest, DecodeResult
from .engine.distributed import Groups
from .engine.device_sides import check_device_round, choose_round
from .engine.launch import (batch_exactness_gaps, decode_adaptive, draft_architecture, remember_outputs,
                            remember_tokens)
from .steps.capture import Captures
from .engine.placement import Placement
from .config import MAX_BUDGET
from .policy.choice import ROUND, TARGET_LOOP, LoopChoice
from .policy.goodput import GoodputPolicy
from .stats import SwiftSpecStats
from .drafters.suffix import OutputHistory
from .steps.acceptance import split_criteria
from .steps.verify import Sampler

UNSUPPORTED_OPTIONS = {
    "num_beams": 1,
    "output_attentions": False,
    "output_hidden_states": False,
}


# What GenerationMixin.generate itself puts in the model kwargs of a decoder-only call; the tree steps
# rebuild each of them (the mask from the padding, positions from the tree, their own caches).
PREPARED_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "use_cache"}) | PREPARED_CACHE_KWARGS


def swiftspec_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    swiftspec_draft=None,
    swiftspec_config: SwiftSpecConfig | None = None,
    swiftspec_placement: Placement | None = None,
    swiftspec_groups: Groups | None = None,
    swiftspec_streamer=None,
    swiftspec_generator: torch.Generator | None = None,
    swiftspec_corpus: list[list[int]] | None = None,
    swiftspec_policy: GoodputPolicy | None = None,
    swiftspec_history: OutputHistory | None = None,
    swiftspec_captures: Captures | None = None,
    swiftspec_engine=None,
    swiftspec_vocabularies=None,
    **model_kwargs,
) -> tuple[torch.LongTensor | GenerateDecoderOnlyOutput, SwiftSpecStats]:
    """`custom_generate` callable; `model` is the target. Returns (generate's output, stats).

    input_ids (B, L): B > 1 for a batch of prompts (left-padded, with their attention_mask) or
    num_return_sequences copies of each; every row decodes as target.generate would decode it in
    that batch.
    swiftspec_engine: (engine, key) to decode this one sequence in a running batch of other calls'
    (engine/continuous.py: the server's), instead of in rounds of its own.
    swiftspec_vocabularies: a draft with another tokenizer's (drafters/vocabulary.py): the draft proposes through
    its branches' text.
    """
    check_supported_options(generation_config, input_ids)
    check_model_kwargs(model_kwargs)
    warn_cache_options(generation_config)
    batch = input_ids.shape[0]
    config = swiftspec_config
    max_new = max(stop_length(stopping_criteria, generation_config) - input_ids.shape[1], 0)
    if batch > 1:
        check_batch_placement(swiftspec_placement, swiftspec_streamer, batch)
    architectures = describe(model, "target"), draft_architecture(swiftspec_draft)
    # Rules the target applies by cache slot: trees stay below them, else chains, else its own loop.
    slots = input_ids.shape[1] + max_new + (config.tree_budget or MAX_BUDGET)
    reached = architectures[0].limits_reached(slots)
    reasons = batch_exactness_gaps(architectures, logits_processor, stopping_criteria) if batch > 1 else []
    reasons += [
        f"the target {limit.reason}, and this call's steps reach {slots} slots (only one-token steps are exact there)"
        for limit in reached if limit.beyond == "plain" or batch > 1
    ]
    if swiftspec_engine is not None and (reasons or reached):
        raise ValueError(
            f"This request cannot join the server's speculating batch: {'; '.join(reasons) or reached[0].reason} "
            f"(it reaches {slots} slots). Ask for fewer new tokens (max_tokens) or send a shorter prompt."
        )
    device_batch = swiftspec_engine is not None and getattr(swiftspec_engine[0], "on_device", False)
    gaps = (model, swiftspec_draft, architectures, logits_processor, swiftspec_placement, swiftspec_groups,
            swiftspec_engine is not None and not device_batch, reasons)
    # (a row's forwards hold at most `slots` slots; a running batch's, its longest row's, each checked so at its join)
    if device_batch:  # the engine's round: exact, or a ValueError saying why (never the target's loop instead)
        check_device_round(config, *gaps, vocabularies=swiftspec_vocabularies, slots=slots)
    round_, why = choose_round(config, *gaps, vocabularies=swiftspec_vocabularies, slots=slots)  # not exact: the same
    if reasons:
        return decode_with_target_loop(
            model, input_ids, logits_processor, stopping_criteria, generation_config, swiftspec_streamer,
            reasons, model_kwargs,
        )
    loop = loop_choice(config, swiftspec_policy, swiftspec_engine, swiftspec_placement, swiftspec_groups,
                       generation_config, batch)
    if loop is not None and loop.pick() == TARGET_LOOP:
        return measured_target_loop(loop, model, input_ids, logits_processor, stopping_criteria, generation_config,
                                    swiftspec_streamer, model_kwargs, swiftspec_history, config)
    chain_reasons = [f"the target {limit.reason}, and this call's steps reach {slots} slots" for limit in reached]
    prompt, attention_mask = split_left_padding(input_ids, model_kwargs.get("attention_mask"))
    check_padding_keeps_positions(model, input_ids.shape[1] - prompt.shape[1])
    sampler = Sampler(logits_processor, bool(generation_config.do_sample), swiftspec_generator)
    if sampler.do_sample and sampler.generator is None:
        sampler.generator = generator_from_global_seed(model.device)
    request = DecodeRequest(
        prompt=prompt,
        attention_mask=attention_mask,
        contexts=list(input_ids.split(1)),
        samplers=sampler.for_rows(batch),
        stopping_criteria=stopping_criteria,
        pads_finished=any(hasattr(c, "eos_token_id") for c in stopping_criteria),  # as generate's own loop
        max_new_tokens=max_new,
        policy=swiftspec_policy if isinstance(swiftspec_policy, GoodputPolicy) else GoodputPolicy(
            tree_budget=config.tree_budget, draft_depth=config.draft_depth
        ),
        corpus=swiftspec_corpus or [],
        history=swiftspec_history,
        on_tokens=(lambda tokens: swiftspec_streamer.put(torch.tensor(tokens))) if swiftspec_streamer else None,
        keeps_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        keeps_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
    )
    copyable = swiftspec_history.tokens if swiftspec_history is not None and config.ngram_size else 0
    if swiftspec_engine is not None:
        engine, key = swiftspec_engine
        result = engine.decode(request, key)  # the engine remembers the output (its thread owns the history)
    else:
        request.policy.start_generation(request.max_new_tokens)
        captures = swiftspec_captures or Captures()
        started = loop.engines.clock() if loop is not None else 0.0
        with captures.claimed() as ours:  # a concurrent call on the same pair captures graphs (and buffers) of its own
            result = decode_adaptive(model, swiftspec_draft, request, config, swiftspec_placement, swiftspec_groups,
                                     chain_reasons, architectures, captures if ours else Captures(),
                                     swiftspec_vocabularies, round_)
        if loop is not None:
            rounds = result.stats.rounds or result.rounds
            loop.observe(ROUND, result.new_tokens, loop.engines.clock() - started, len(rounds),
                         sum(r.budget == 1 for r in rounds))
            if loop.candidate:
                result.stats.engine_choice = loop.describe(ROUND, result.stats.engine)
        remember_outputs(swiftspec_history, config, request, result)
    result.stats.draft_model = swiftspec_draft is not None
    result.stats.round_choice = "the running batch's" if swiftspec_engine is not None else (
        result.stats.round_choice or why)  # (an engine that chose again says so: two threads under round='auto')
    result.stats.history_tokens = copyable
    if batch > 1:
        result.stats.row_tau = [row.tau for row in result.rows]
    return generate_output(input_ids, result, generation_config), result.stats


def stop_length(stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig) -> int:
    """The sequence length generate() stops at: its MaxLengthCriteria's. A user's MaxLengthCriteria
    replaces the one generate() builds from max_length, so it may also lie beyond it."""
    lengths = [c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria]
    return min(lengths) if lengths else generation_config.max_length


def generate_output(input_ids: torch.Tensor, result: DecodeResult, generation_config: GenerationConfig):
    """What target.generate would return: sequences (B, L + n), or a GenerateDecoderOnlyOutput.

    Every row ends at the batch's length n. A row done earlier is padded with pad_token_id, as
    generate pads it; its scores and logits at those steps say "pad, with certainty" (0 at the pad
    id, -inf elsewhere): target.generate fills them with the model's output on the padding, which
    a row that left the batch never computes.
    """
    end = result.end
    pad = pad_token_tensor(generation_config)
    pad = int(pad) if pad is not None else 0
    new = torch.tensor(
        [row.tokens[:end] + [pad] * (end - len(row.tokens[:end])) for row in result.rows],
        dtype=input_ids.dtype, device=input_ids.device,
    ).reshape(len(result.rows), end)
    sequences = torch.cat([input_ids, new], dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=steps(result, "scores", end, pad) if generation_config.output_scores else None,
        logits=steps(result, "logits", end, pad) if generation_config.output_logits else None,
    )


def steps(result: DecodeResult, name: str, end: int, pad: int) -> tuple[torch.Tensor, ...]:
    """Per step, the rows' (B, V) scores or logits; a finished row's are "pad, with certainty"."""
    rows = [getattr(row, name) for row in result.rows]
    if len(rows) == 1:
        return tuple(rows[0][:end])
    filler = None
    out = []
    for t in range(end):
        parts = []
        for row in rows:
            if t < len(row):
                parts.append(row[t])
                continue
            if filler is None:
                template = next(r[0] for r in rows if r)
                filler = torch.full_like(template, float("-inf"))
                filler[0, pad] = 0.0
            parts.append(filler)
        out.append(torch.cat(parts))
    return tuple(out)


def check_batch_placement(placement: Placement | None, streamer, batch: int) -> None:
    """Refuse what a batch cannot do: a streamer (transformers' rule) or an asynchronous placement."""
    if streamer is not None:
        raise ValueError(
            f"A streamer works with one sequence at a time (as in transformers), but this call decodes {batch} "
            "(a batch of prompts, or num_return_sequences > 1). Drop the streamer, or generate one prompt at a time."
        )
    if placement is not None and placement.mode != "serial":
        raise ValueError(
            f"Batches of prompts ({batch} here) decode on the serial engine only; this model's placement runs the "
            f"draft beside the target ({placement.mode}), which speculates for one sequence. Load the pair without "
            "placement (the serial engine batches every row into each forward), or generate one prompt at a time."
        )


def decode_with_target_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                            reasons: list[str], model_kwargs: dict):
    """Decode the batch with transformers' own loop (exactly target.generate), saying why."""
    rows = input_ids.shape[0]
    advice = " Generate one prompt at a time to speculate." if rows > 1 else ""
    warnings.warn(
        f"swiftspec=True decoded this {'batch of ' + str(rows) if rows > 1 else 'call'} with the target's own decoding "
        f"loop (the same output as target.generate, not faster): {'; '.join(reasons)}.{advice}",
        UserWarning,
        stacklevel=3,
    )
    engine = f"target ({'batch: ' if rows > 1 else ''}" + "; ".join(reasons) + ")"
    return target_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                       model_kwargs, engine)


def target_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                model_kwargs: dict, engine: str):
    """(transformers' own loop's output, its stats naming `engine`)."""
    start = time.perf_counter()
    output = sample_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    steps = sequences.shape[1] - input_ids.shape[1]  # one target forward each (the prefill's gives the first token)
    stats = SwiftSpecStats(
        engine=engine,
        new_tokens=int(sequences.shape[0] * steps),
        target_forwards=steps,
        verify_steps=steps,  # each a plain step, as a round's T = 1 verification is counted: tau = rows
        wall_time_s=time.perf_counter() - start,
    )
    return output, stats


def loop_choice(config: SwiftSpecConfig, policy, engine, placement: Placement | None, groups: Groups | None,
                generation_config: GenerationConfig, batch: int) -> LoopChoice | None:
    """The pair's LoopChoice for this batch size (policy/choice.py: the round, or transformers' own loop where the
    round decoded plainly and the loop measured faster), for a greedy call of its own on one device with round='auto';
    None elsewhere: a round named (round='device' or 'host'), target_loop=False, a running batch's request, two
    devices or ranks (their engines choose by serial_fallback), sampling (a seed's draws are the round's, by
    position; the loop's come from torch's generator, so one seed would give other text by the engine that ran)."""
    if config.round != "auto" or not config.target_loop or engine is not None or groups is not None:
        return None
    if not isinstance(policy, GoodputPolicy) or generation_config.do_sample:
        return None
    if placement is not None and placement.mode != "serial":
        return None
    return policy.loops.setdefault(batch, LoopChoice())


def measured_target_loop(loop: LoopChoice, model, input_ids, logits_processor, stopping_criteria, generation_config,
                         streamer, model_kwargs: dict, history: OutputHistory | None, config: SwiftSpecConfig):
    """This call on transformers' own loop (its tokens are target.generate's), timed for the loop choice's next pick;
    its output joins the history later suffix proposals copy from, as a round's does (remember_outputs)."""
    started = loop.engines.clock()
    output, stats = target_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                                model_kwargs, "target loop")
    loop.observe(TARGET_LOOP, stats.new_tokens, loop.engines.clock() - started)
    stats.engine_choice = loop.describe(TARGET_LOOP, stats.engine)
    stats.round_choice = ("round='auto': transformers' own loop, the same tokens (this pair's round decoded its calls "
                          "plainly, and the loop measured faster)")
    stats.draft_model = False
    if history is not None:
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        mask = model_kwargs.get("attention_mask")
        masks = mask.tolist() if mask is not None else [[1] * input_ids.shape[1]] * input_ids.shape[0]
        eos = split_criteria(stopping_criteria).eos  # (the rows' EOS ids: after one, padding)
        outputs = []
        for prompt, kept, new in zip(input_ids.tolist(), masks, sequences[:, input_ids.shape[1]:].tolist()):
            end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            outputs.append(([t for t, m in zip(prompt, kept) if m], new[:end]))
        remember_tokens(history, config, outputs)
    return output, stats


def check_inputs(inputs, kwargs: dict, generation_config: GenerationConfig | None, default: GenerationConfig) -> None:
    """Refuse, before transformers acts on them, the generate() arguments swiftspec=True cannot honour.

    Each error names the argument and what to pass instead.
    """
    check_prompt_shape(inputs if inputs is not None else kwargs.get("input_ids"))
    check_length_arguments(kwargs, generation_config, default)
    if kwargs.get("inputs_embeds") is not None:
        with_ids = inputs is not None or kwargs.get("input_ids") is not None
        given = "input_ids together with inputs_embeds" if with_ids else "inputs_embeds"
        raise ValueError(
            f"{given} is not supported with swiftspec=True: the draft cannot read the target's embeddings and every "
            "tree step feeds token ids. Pass input_ids only (the tokens the embeddings came from), or pass "
            "swiftspec=False to prefill from inputs_embeds."
        )
    if kwargs.get("position_ids") is not None:
        raise ValueError(
            "position_ids is not supported with swiftspec=True: each tree node's position is its depth after the "
            "prompt. Pass a left-padded prompt with its attention_mask instead, or swiftspec=False."
        )
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "custom_generate cannot be combined with swiftspec=True, which is itself a decoding loop; pass "
            "swiftspec=False to run your custom_generate on the target."
        )
    if requested("token_healing", kwargs, generation_config, default):
        raise ValueError(
            "token_healing=True is not supported with swiftspec=True (transformers gives a custom decoding loop no "
            "tokenizer to heal with). Heal the prompt first (model.target.heal_tokens(input_ids, tokenizer)), or "
            "pass swiftspec=False."
        )
    given = [name for name in GENERATE_CACHE_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"{given[0]} (a cache from an earlier call) is not supported with swiftspec=True: target and draft each "
            "keep their own tree cache, built from the prompt. To continue a conversation, pass the whole sequence so "
            "far (prompt and earlier output) as input_ids; or pass swiftspec=False to continue from the cache."
        )
    cache = requested("cache_implementation", kwargs, generation_config, default)
    if cache in ("paged", "quantized"):
        raise ValueError(
            f"cache_implementation={cache!r} is not supported with swiftspec=True: target and draft keep their own "
            "full-precision tree caches (a quantized cache changes the tokens; a paged one turns generate() into "
            "continuous batching). Drop the argument, or pass swiftspec=False."
        )


LENGTH_ARGUMENTS = ("max_new_tokens", "min_new_tokens", "max_length", "min_length")


def check_prompt_shape(ids) -> None:
    """input_ids must be a (batch, length) tensor of token ids: a 1-D one failed deep inside transformers
    (IndexError), a list with a TypeError that did not say which argument."""
    if ids is None:
        return
    if not isinstance(ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor of token ids, shape (batch, length); got a {type(ids).__name__}. "
            "Pass tokenizer(text, return_tensors='pt').input_ids, or torch.tensor([ids]) for one list of ids."
        )
    if ids.dim() != 2:
        fix = "input_ids[None] (or input_ids.unsqueeze(0)) for one prompt" if ids.dim() == 1 else "a (batch, length) tensor"
        raise ValueError(
            f"input_ids must have shape (batch, length); got a {ids.dim()}-D tensor of shape {tuple(ids.shape)}. "
            f"Pass {fix}."
        )


def check_length_arguments(kwargs: dict, generation_config: GenerationConfig | None, default: GenerationConfig) -> None:
    """max_new_tokens and the other lengths must be whole numbers: "5" failed inside transformers with a TypeError
    comparing str and int that named none of them."""
    for name in LENGTH_ARGUMENTS:
        value = requested(name, kwargs, generation_config, default)
        if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
            continue
        try:
            hint = f" Pass {name}={int(value)}." if isinstance(value, (str, float)) and int(value) == float(value) else ""
        except ValueError:
            hint = ""
        raise TypeError(f"{name}={value!r} must be an int (a number of tokens), not a {type(value).__name__}.{hint}")


def requested(name: str, kwargs: dict, generation_config: GenerationConfig | None, default: GenerationConfig):
    """The value of generation option `name` that generate() will use (argument > config > model default)."""
    if name in kwargs:
        return kwargs[name]
    return getattr(generation_config if generation_config is not None else default, name, None)


def warn_cache_options(generation_config: GenerationConfig) -> None:
    """The cache options that change no token: say that swiftspec=True does not use them."""
    if generation_config.use_cache is False:
        warnings.warn(
            "use_cache=False has no effect with swiftspec=True: tree speculation needs KV caches and keeps its own; "
            "the tokens are target.generate's all the same. Pass swiftspec=False to decode without a cache.",
            UserWarning,
            stacklevel=2,
        )
    if generation_config.cache_implementation is not None:
        warnings.warn(
            f"cache_implementation={generation_config.cache_implementation!r} has no effect with swiftspec=True: "
            "target and draft each use swiftspec's own preallocated tree cache; the tokens are target.generate's "
            "all the same. Drop the argument, or pass swiftspec=False to decode with that cache.",
            UserWarning,
            stacklevel=2,
        )


def check_supported_options(generation_config: GenerationConfig, input_ids: torch.Tensor) -> None:
    """Raise ValueError for what speculative decoding does not do yet, naming the value and the way out."""
    for name, allowed in UNSUPPORTED_OPTIONS.items():
        value = getattr(generation_config, name, allowed)
        if value not in (allowed, None):
            raise ValueError(
                f"{name}={value!r} is not supported with swiftspec=True (only {allowed!r}); pass swiftspec=False."
            )
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"swiftspec=True decodes greedily or by sampling; these generation options ask for {mode.value}: "
            f"{mode_options(generation_config)}. Drop them, or pass swiftspec=False."
        )
    if input_ids.shape[1] == 0:
        raise ValueError(
            f"swiftspec=True needs at least one prompt token; got an empty input (shape {tuple(input_ids.shape)}). Pass a prompt, "
            "e.g. the tokenizer's BOS token, or call generate() without inputs to start from the model's BOS."
        )


def mode_options(generation_config: GenerationConfig) -> str:
    """The set options that pick a decoding mode other than greedy search and sampling."""
    names = ("penalty_alpha", "low_memory", "dola_layers", "num_beam_groups", "diversity_penalty", "constraints",
             "force_words_ids")  # fmt: skip
    defaults = GenerationConfig()
    return ", ".join(
        f"{name}={getattr(generation_config, name)!r}" for name in names
        if getattr(generation_config, name, None) != getattr(defaults, name, None)
    ) or "(see GenerationConfig.get_generation_mode)"


def check_model_kwargs(model_kwargs: dict) -> None:
    """Refuse model inputs the tree steps would drop (they feed the models token ids and positions only)."""
    unused = sorted(
        name for name, value in model_kwargs.items()
        if name not in PREPARED_MODEL_KWARGS and value is not None and not (isinstance(value, dict) and not value)
    )  # multimodal models get an empty mm_encoder_outputs dict when there is nothing to encode
    if unused:
        raise ValueError(
            f"swiftspec=True feeds the models token ids only and would ignore {unused}: pass only input_ids and "
            "attention_mask, or pass swiftspec=False to give the target these inputs."
        )


def split_left_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prompt (B, L'), its attention_mask (B, L') or None): the columns that are padding in every row
    dropped, so a single prompt runs alone; a batch keeps each row's remaining left padding, masked.
    Any masked position after a row's first prompt token is an error.

    The models run on this prompt (for left-padded rows with their mask, transformers' positions and
    attention make that the same computation); processors and stopping criteria get input_ids whole,
    as target.generate gives them.
    """
    if attention_mask is None:
        return input_ids, None
    keep = attention_mask.bool()
    starts = [int(row.long().argmax()) if row.any() else input_ids.shape[1] for row in keep]
    for row, start in zip(keep, starts):
        if start == input_ids.shape[1] or not bool(row[start:].all()):
            raise ValueError(
                "swiftspec=True accepts an attention_mask that only masks left padding; got "
                f"{row.long().tolist()}. Remove the padding or use swiftspec=False."
            )
    first = min(starts)
    prompt, mask = input_ids[:, first:], attention_mask[:, first:]
    return prompt, (mask if not bool(mask.bool().all()) else None)


def check_padding_keeps_positions(model, padding: int) -> None:
    """Refuse left padding for a target that takes no position_ids: target.generate runs the padding
    through it and its positions follow cache slots, so the prompt alone would sit at other positions."""
    if padding and "position_ids" not in inspect.signature(type(model).forward).parameters:
        raise ValueError(
            f"The target ({model.config.model_type}) takes no position_ids, so {padding} left padding token(s) shift "
            "the positions target.generate gives the prompt, which swiftspec=True cannot reproduce. Pass the prompt "
            "without its padding, or swiftspec=False."
        )


def generator_from_global_seed(device: torch.device) -> torch.Generator:
    """A generator seeded from torch's global RNG, so torch.manual_seed makes sampling reproducible."""
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator(device=device).manual_seed(seed)


def split_stop_strings(kwargs: dict, generation_config: GenerationConfig | None, default: GenerationConfig):
    """Take stop_strings out of the arguments (transformers drops the tokenizer for a custom loop).

    Returns (the generation_config to pass, stop_strings or None). A generation_config is only
    built when the user passed one: passing one beside generation arguments makes transformers
    warn that the combination is deprecated, which plain generate() would not.
    """
    stop_strings = kwargs.pop("stop_strings", None)
    for source in (generation_config, default):
        if stop_strings is None and source is not None and source.stop_strings is not None:
            stop_strings = source.stop_strings
    if stop_strings is not None:
        if generation_config is not None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.stop_strings = None
        else:
            kwargs["stop_strings"] = None  # masks the model's default, which transformers would also read
    return generation_config, stop_strings


def stop_string_criteria(stop_strings, tokenizer, stopping_criteria) -> StoppingCriteriaList:
    """The user's stopping criteria plus a StopStringCriteria, as generate() would build it."""
    if tokenizer is None:
        raise ValueError(
            f"stop_strings={stop_strings!r} needs the tokenizer: pass tokenizer=... to generate(), as with transformers."
        )
    criteria = StoppingCriteriaList(stopping_criteria or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return criteria
