"""The transformers side of the decode loop: generate()'s arguments in, generate()'s outputs out.

`GenerationMixin.generate` runs on the target with `custom_generate=swiftspec_generate`, so its
own argument handling (generation config merging, max_length, logits processors, stopping
criteria with EOS) is exactly the one `target.generate` uses. transformers hands a callable
neither the streamer nor the tokenizer, so they travel as `swiftspec_*` arguments (the
wrapper's generate() ends the streamer, also when anything fails).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput, StopStringCriteria

from .architectures import describe
from .attention import resolve_attention, routed_attention
from .config import SwiftSpecConfig
from .engine import DecodeRequest, DecodeResult, DraftWorker, TargetWorker, run_serial, run_threads
from .engine.distributed import Groups, run_distributed
from .placement import Placement
from .policy import MAX_BUDGET, GoodputPolicy
from .stats import SwiftSpecStats
from .suffix import OutputHistory
from .verify import Sampler

UNSUPPORTED_OPTIONS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "output_attentions": False,
    "output_hidden_states": False,
}


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
    **model_kwargs,
) -> tuple[torch.LongTensor | GenerateDecoderOnlyOutput, SwiftSpecStats]:
    """`custom_generate` callable; `model` is the target. Returns (generate's output, stats)."""
    check_supported_options(generation_config, input_ids)
    prompt = strip_left_padding(input_ids, model_kwargs.get("attention_mask"))
    max_new = max(generation_config.max_length - input_ids.shape[1], 0)
    config = swiftspec_config
    sampler = Sampler(logits_processor, bool(generation_config.do_sample), swiftspec_generator)
    if sampler.do_sample and sampler.generator is None:
        sampler.generator = generator_from_global_seed(model.device)
    request = DecodeRequest(
        prompt=prompt,
        sampler=sampler,
        stopping_criteria=stopping_criteria,
        max_new_tokens=max_new,
        policy=swiftspec_policy or GoodputPolicy(tree_budget=config.tree_budget, draft_depth=config.draft_depth),
        corpus=swiftspec_corpus or [],
        history=swiftspec_history,
        on_tokens=(lambda tokens: swiftspec_streamer.put(torch.tensor(tokens))) if swiftspec_streamer else None,
    )
    workers = build_workers(model, swiftspec_draft, config, prompt.shape[1] + max_new, swiftspec_groups)
    with contextlib.ExitStack() as routes:  # each model attends the tree its way for this call only
        for worker in workers:
            if worker is not None and worker.model is not None:
                routes.enter_context(routed_attention(worker.model, worker.attention))
        result = run_engine(swiftspec_placement, swiftspec_groups, *workers, request, config) if max_new else DecodeResult()
    if swiftspec_history is not None and result.tokens:  # later requests may copy this output (and its lead-in)
        swiftspec_history.add(prompt[0, -config.ngram_size :].tolist() * (config.ngram_size > 0) + result.tokens)
    result.stats.attention = attention_summary(workers)
    return generate_output(input_ids, result, generation_config), result.stats


def build_workers(target, draft, config: SwiftSpecConfig, length: int, groups: Groups | None):
    """(TargetWorker, DraftWorker) with caches for `length` tokens; under torchrun only this rank's.

    Trees shrink to chains (draft width 1, no n-gram branch beside the draft's chain) when either
    model places tokens by cache slot. With no draft (draft-free mode) the draft worker holds only
    the n-gram index.
    """
    role = groups.role if groups is not None else None
    target_arch = describe(target, "target")
    draft_arch = describe(draft, "draft") if draft is not None else None
    chain = "chain" in (target_arch.shape, draft_arch and draft_arch.shape)
    target_worker = draft_worker = None
    if role in (None, "target"):
        budget = config.tree_budget or MAX_BUDGET
        attention = resolve_attention(config.attention, target, target_arch)
        target_worker = TargetWorker(target, length + budget, attention, target_arch)
    if role in (None, "draft"):
        draft_worker = DraftWorker(
            draft,
            capacity=length + config.tree_capacity,
            tree_capacity=config.tree_capacity,
            width=1 if chain else config.draft_width,
            vocab_limit=target.config.get_text_config().vocab_size,
            attention=resolve_attention(config.attention, draft, draft_arch) if draft is not None else "none",
            ngram_size=0 if chain and draft is not None else config.ngram_size,
            architecture=draft_arch,
            device=target.device,
            branching=not chain,
        )
    return target_worker, draft_worker


def attention_summary(workers) -> str:
    """How each model attended: its backend, the layers that fell back, and chains where trees could not be."""
    parts = []
    for role, worker in zip(("target", "draft"), workers):
        if worker is None or worker.model is None:
            continue
        part = f"{role}={worker.attention}"
        if worker.attention_fallbacks:
            part += f" (own attention for {', '.join(sorted(worker.attention_fallbacks))})"
        if worker.architecture.shape == "chain":
            part += f" (chain: {worker.architecture.chain_reason})"
        parts.append(part)
    return ", ".join(parts)


def run_engine(placement, groups, target, draft, request: DecodeRequest, config) -> DecodeResult:
    """Serial on one device; asynchronous when the draft has its own device, thread or process."""
    if placement is None or placement.mode == "serial":
        return run_serial(target, draft, request)
    if placement.mode == "threads":
        return run_threads(target, draft, request, timeout_s=config.worker_timeout_s)
    return run_distributed(groups, target, draft, request, timeout_s=config.worker_timeout_s)


def generate_output(input_ids: torch.Tensor, result: DecodeResult, generation_config: GenerationConfig):
    """What target.generate would return: sequences (1, L + n), or a GenerateDecoderOnlyOutput."""
    new = torch.tensor([result.tokens], dtype=input_ids.dtype, device=input_ids.device)
    sequences = torch.cat([input_ids, new], dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(result.scores) if generation_config.output_scores else None,
        logits=tuple(result.logits) if generation_config.output_logits else None,
    )


def check_supported_options(generation_config: GenerationConfig, input_ids: torch.Tensor) -> None:
    """Raise ValueError for what speculative decoding does not do yet, naming the value and the way out."""
    for name, allowed in UNSUPPORTED_OPTIONS.items():
        value = getattr(generation_config, name, allowed)
        if value not in (allowed, None):
            raise ValueError(
                f"{name}={value!r} is not supported with swiftspec=True (only {allowed!r}); pass swiftspec=False."
            )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"swiftspec=True decodes one sequence at a time (batch size 1); got batch size {input_ids.shape[0]}. "
            "Call generate() per prompt, or pass swiftspec=False for batched decoding."
        )
    if input_ids.shape[1] == 0:
        raise ValueError(
            "swiftspec=True needs at least one prompt token; got an empty input (shape (1, 0)). Pass a prompt, "
            "e.g. the tokenizer's BOS token, or call generate() without inputs to start from the model's BOS."
        )


def strip_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The prompt (1, L') without its left padding; any other masked position is an error."""
    if attention_mask is None:
        return input_ids
    keep = attention_mask[0].bool()
    start = int(keep.long().argmax()) if keep.any() else input_ids.shape[1]
    if start == input_ids.shape[1] or not bool(keep[start:].all()):
        raise ValueError(
            "swiftspec=True accepts an attention_mask that only masks left padding; got "
            f"{attention_mask[0].tolist()}. Remove the padding or use swiftspec=False."
        )
    return input_ids[:, start:]


def generator_from_global_seed(device: torch.device) -> torch.Generator:
    """A generator seeded from torch's global RNG, so torch.manual_seed makes sampling reproducible."""
    seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator(device=device).manual_seed(seed)


def split_stop_strings(kwargs: dict, generation_config: GenerationConfig | None, default: GenerationConfig):
    """Take stop_strings out of the arguments (transformers drops the tokenizer for a custom loop).

    Returns (generation_config without stop_strings or None, stop_strings or None).
    """
    stop_strings = kwargs.pop("stop_strings", None)
    for source in (generation_config, default):
        if stop_strings is None and source is not None and source.stop_strings is not None:
            stop_strings = source.stop_strings
    if stop_strings is not None:
        generation_config = copy.deepcopy(generation_config if generation_config is not None else default)
        generation_config.stop_strings = None
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
