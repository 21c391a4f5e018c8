"""Speculation for a plain model, through transformers' own extension point for decoding loops:

    from hf_swiftspec import custom_generate
    out = model.generate(ids, custom_generate=custom_generate, swiftspec_draft=draft, max_new_tokens=64)

transformers prepares the inputs, processors and stopping criteria as for any generate() call and hands
them to `custom_generate`, which decodes by tree speculation, losslessly, with the same engine as the
pair's generate(swiftspec=True). Its own arguments (transformers passes them through by name):

    swiftspec_draft     a draft model, an EAGLE-3 head (load_eagle3_head), or None: suffix proposals only
    swiftspec_settings  SwiftSpecConfig fields (tree_budget, draft_width, ngram_size, ...)
    swiftspec_policy    a GoodputPolicy to keep what it measures across calls (default: a fresh one per call)
    swiftspec_captures  a capture.Captures to keep the replayed steps' CUDA graphs across calls (default: each
                        call captures its own)
    swiftspec_streamer  a streamer (transformers does not hand `streamer=` to custom decoding loops)
    swiftspec_generator a torch.Generator for sampling
    swiftspec_on_stats  called with the call's SwiftSpecStats
    swiftspec_tokenizer, swiftspec_draft_tokenizer
                        the target's and the draft's tokenizers, for a draft with a tokenizer of its own (it then
                        proposes through text); transformers hands a callable neither `tokenizer=` nor
                        `assistant_tokenizer=` nor `assistant_model=`

A Hub repo's custom_generate/generate.py runs `hub_generate`, which calls generate() again with this loop
(model_cards/swiftspec-custom-generate; `custom_generate="ORG/REPO", trust_remote_code=True`). transformers
hands a custom loop neither `streamer` nor `tokenizer`: pass swiftspec_streamer=, and stop_strings work
through the repo form (or as a StopStringCriteria in stopping_criteria=). The repo form takes transformers'
own assisted-generation arguments too, as universal assisted generation does:
`generate(ids, custom_generate="ORG/REPO", trust_remote_code=True, assistant_model=draft, tokenizer=tok,
assistant_tokenizer=draft_tok)`.
"""

from __future__ import annotations

from typing import Callable

from .steps.capture import Captures
from .config import SwiftSpecConfig, check_setting_names
from .generation import split_stop_strings, stop_string_criteria, swiftspec_generate
from .modeling import check_member_type, check_members
from .pair.checks import TokenizerArguments
from .policy.goodput import GoodputPolicy
from .stats import SwiftSpecStats

# how this entry point takes the two tokenizers, which its errors name (from_models' are tokenizer= / draft_tokenizer=)
TOKENIZER_ARGUMENTS = TokenizerArguments("swiftspec_tokenizer=", "swiftspec_draft_tokenizer=")


def custom_generate(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    swiftspec_draft=None,
    swiftspec_settings: dict | None = None,
    swiftspec_policy: GoodputPolicy | None = None,
    swiftspec_captures: Captures | None = None,
    swiftspec_streamer=None,
    swiftspec_generator=None,
    swiftspec_on_stats: Callable[[SwiftSpecStats], None] | None = None,
    swiftspec_tokenizer=None,
    swiftspec_draft_tokenizer=None,
    **model_kwargs,
):
    """transformers' custom_generate callable: decode `input_ids` with `model` as the target (see the module
    docstring). Returns what model.generate would return."""
    settings = dict(swiftspec_settings or {})
    check_setting_names(settings, "custom_generate(swiftspec_settings=...)")
    if settings.get("placement") not in (None, "serial"):
        raise ValueError("custom_generate decodes on the serial engine; an asynchronous placement needs SwiftSpecForCausalLM.")
    config = SwiftSpecConfig(**settings)  # checks the tree settings
    check_member_type(swiftspec_draft, "draft", required=False)
    vocabularies = check_members(model, swiftspec_draft, None, swiftspec_tokenizer, swiftspec_draft_tokenizer,
                                 TOKENIZER_ARGUMENTS)
    policy = swiftspec_policy or GoodputPolicy(tree_budget=config.tree_budget, draft_depth=config.draft_depth)
    try:
        output, stats = swiftspec_generate(
            model, input_ids, logits_processor, stopping_criteria, generation_config,
            swiftspec_draft=swiftspec_draft, swiftspec_config=config, swiftspec_policy=policy,
            swiftspec_captures=swiftspec_captures, swiftspec_streamer=swiftspec_streamer, swiftspec_generator=swiftspec_generator,
            swiftspec_vocabularies=vocabularies, **model_kwargs,
        )
    finally:
        if swiftspec_streamer is not None:
            swiftspec_streamer.end()
    if swiftspec_on_stats is not None:
        swiftspec_on_stats(stats)
    return output


def hub_generate(model, **generate_arguments):
    """What a custom_generate repo's generate.py runs (model_cards/swiftspec-custom-generate): transformers
    calls it with the model and every generate() argument; it hands them to generate() again with
    `custom_generate` as the loop. A custom loop receives neither `streamer` nor `tokenizer`, so the streamer
    goes in as swiftspec_streamer and stop_strings become a stopping criterion here, with the tokenizer; transformers'
    assisted-generation arguments (assistant_model, tokenizer, assistant_tokenizer) become the draft and its
    tokenizers."""
    arguments = dict(generate_arguments)
    streamer = arguments.pop("streamer", None)
    if streamer is not None:
        arguments["swiftspec_streamer"] = streamer
    tokenizer = arguments.pop("tokenizer", None)
    assistant = arguments.pop("assistant_model", None)
    if assistant is not None:
        if arguments.get("swiftspec_draft") is not None:
            raise ValueError("Pass the draft once: as assistant_model= or as swiftspec_draft=, not both.")
        arguments["swiftspec_draft"] = assistant
    draft_tokenizer = arguments.pop("assistant_tokenizer", None)
    if draft_tokenizer is not None:
        arguments["swiftspec_tokenizer"], arguments["swiftspec_draft_tokenizer"] = tokenizer, draft_tokenizer
    generation_config, stop_strings = split_stop_strings(arguments, arguments.pop("generation_config", None),
                                                         model.generation_config)
    if stop_strings is not None:
        arguments["stopping_criteria"] = stop_string_criteria(stop_strings, tokenizer, arguments.get("stopping_criteria"))
    return model.generate(custom_generate=custom_generate, generation_config=generation_config, **arguments)
