"""The pair under test, the ways of generating with it that the bench times side by side, and
which of them decode a batch of prompts in one call."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from transformers import CompileConfig

from ..models.architectures import context_limit
from ..tools.options import default_device, load_pair
from ..config import SwiftSpecConfig
from ..drafters.eagle3 import DraftHead, Eagle3Head, is_eagle3_folder, load_eagle3_head
from ..modeling import SwiftSpecForCausalLM
from ..pair import DEMO_PAIR_NAME, bundled_pair
from ..pair.locate import HubOptions, member_folder, pair_members, resolve_pair_folder
from ..pair.repo import load_pair_config
from ..tools.models import SHAPE_PREFIX
from .measure import tokens_per_second
from .schema import METHOD_LABELS, BenchConfig, BenchModels, Method, MethodResult, PairInfo

# Why a built-in method has no result at batch sizes above 1 (its MethodResult there says "unsupported").
UNBATCHED = {
    "assisted": "unsupported: transformers runs assisted generation at batch size 1 only",
    "prompt_lookup": "unsupported: transformers runs prompt lookup at batch size 1 only",
    "assisted_static": "unsupported: transformers runs assisted generation at batch size 1 only",
    "swiftspec_async": (
        "unsupported: generate() decodes a batch of prompts on the serial engine only and refuses one with an "
        "asynchronous placement (swiftspec_serial is the batched method)"
    ),
}
UNBATCHED_EXTRA = "unsupported: this method decodes one prompt per call (Method.batched is False)"

SWIFTSPEC_FIELDS = (
    "tree_budget", "draft_width", "draft_depth", "ngram_size", "suffix_cache_tokens", "tree_capacity", "attention",
    "worker_timeout_s",
)


def load_models(config: BenchConfig, notes: list[str]) -> BenchModels:
    """The pair to measure: config.models, else config.pair, else the demo pair, else agreeing_pair()."""
    if config.models is not None:
        return config.models
    if config.model is not None:  # a plain model: draft-free (a pair given here loads as a pair)
        model = load_pair(config.model, config.model, config.device, config.dtype)
        settings = {name: getattr(model.config, name) for name in SWIFTSPEC_FIELDS}
        return BenchModels(model.target, model.draft, model.tokenizer, config.model, settings, model.draft_tokenizer)
    location = config.pair
    if location is not None and location.startswith(SHAPE_PREFIX):
        return shaped_pair(location[len(SHAPE_PREFIX):], config, notes)
    if location is not None and (location == AGREEING or location.startswith(AGREEING + ":")):
        return agreeing_models(location, notes)
    if location is None:
        demo = bundled_pair(DEMO_PAIR_NAME)
        if demo is None:
            return fallback_pair(notes)
        location = str(demo)
    model = load_pair(location, config.pair or DEMO_PAIR_NAME, config.device, config.dtype)
    settings = {name: getattr(model.config, name) for name in SWIFTSPEC_FIELDS}
    return BenchModels(model.target, model.draft, model.tokenizer, config.pair or DEMO_PAIR_NAME, settings,
                       model.draft_tokenizer)


def shaped_pair(shape: str, config: BenchConfig, notes: list[str]) -> BenchModels:
    """`--pair shape:NAME`: a random-weight pair shaped like a real model (hf_swiftspec.tools.models.REAL_SHAPES)."""
    from ..tools.options import load_dtype
    from ..tools.models import char_tokenizer, real_shaped_pair

    device = config.device or default_device()
    target, draft = real_shaped_pair(shape)
    dtype = load_dtype(config.dtype, device)
    target, draft = (m.to(device=device, dtype=dtype if isinstance(dtype, torch.dtype) else None) for m in (target, draft))
    notes.append(
        f"shape:{shape} has random weights in the real model's shape, and a draft of its first 2 layers: text that "
        "neither the draft nor the n-gram chain predicts, so it measures what speculation costs when it cannot pay."
    )
    return BenchModels(target, draft, char_tokenizer(), f"{SHAPE_PREFIX}{shape} (random weights)")


AGREEING = "agreeing"  # --pair agreeing[:LAYERS]: tools.models.agreeing_pair, its draft the target's first LAYERS


def agreeing_models(location: str, notes: list[str]) -> BenchModels:
    """`--pair agreeing[:LAYERS]`: the in-memory agreeing_pair (a 12-layer random Llama whose later layers are damped),
    its draft the target's first LAYERS layers (default 1): a draft that agrees often and costs a share of a round
    that grows with LAYERS."""
    from ..tools.models import agreeing_pair, char_tokenizer, truncated_draft

    layers = location.partition(":")[2] or "1"
    if not layers.isdigit() or not 1 <= int(layers) <= 11:
        raise ValueError(f"--pair {location!r}: agreeing:LAYERS takes 1 to 11 draft layers (of the target's 12)")
    target, draft = agreeing_pair()
    if int(layers) != 1:
        draft = truncated_draft(target, keep_layers=int(layers))
    notes.append(f"{location}: hf_swiftspec.tools.models.agreeing_pair() (random weights, later layers damped, "
                 f"character tokenizer), its draft the target's first {layers} layer(s): the machinery's speed-ups on a "
                 "draft that agrees often, not a real model's.")
    return BenchModels(target, draft, char_tokenizer(), f"{location} (in-memory, random weights)")


def fallback_pair(notes: list[str]) -> BenchModels:
    from ..tools.models import agreeing_pair, char_tokenizer

    notes.append(
        f"The demo pair {DEMO_PAIR_NAME!r} was not found in model_cards/, so this run used the in-memory "
        "hf_swiftspec.tools.models.agreeing_pair() (random weights, character tokenizer): its speed-ups show the "
        "machinery, not a real model's. Pass --pair PATH to measure a real pair."
    )
    target, draft = agreeing_pair()
    return BenchModels(target, draft, char_tokenizer(), "agreeing_pair (in-memory, random weights)")


def tokenizer_for(models: BenchModels, notes: list[str]):
    if models.tokenizer is not None:
        return models.tokenizer
    from ..tools.models import CHAR_SPECIALS, char_tokenizer

    vocab = models.target.config.get_text_config().vocab_size
    if vocab < len(CHAR_SPECIALS) + 95:
        raise ValueError(
            f"The pair has no tokenizer and its vocabulary ({vocab}) is too small for the character tokenizer; "
            "pass BenchModels(tokenizer=...)."
        )
    notes.append("The pair has no tokenizer; prompts were encoded with hf_swiftspec.tools.models.char_tokenizer().")
    return char_tokenizer()


def swiftspec_settings(models: BenchModels, config: BenchConfig) -> dict:
    """The pair's own SwiftSpecConfig fields, overridden by config.swiftspec; checked by SwiftSpecConfig."""
    settings = {**models.settings, **config.swiftspec}
    unknown = sorted(set(settings) - set(SWIFTSPEC_FIELDS))
    if unknown:
        raise ValueError(f"Unknown swiftspec settings {unknown}; use {list(SWIFTSPEC_FIELDS)}.")
    SwiftSpecConfig(**settings)  # raises, naming the bad value
    return settings


def pair_info(models: BenchModels, settings: dict, tokenizer) -> PairInfo:
    target, draft = models.target, models.draft
    return PairInfo(
        name=models.name,
        target=target.name_or_path or type(target).__name__,
        draft=(draft.name_or_path or type(draft).__name__) if draft is not None else "none (draft-free)",
        target_params_m=round(sum(p.numel() for p in target.parameters()) / 1e6, 2),
        draft_params_m=round(sum(p.numel() for p in draft.parameters()) / 1e6, 2) if draft is not None else 0.0,
        dtype=str(target.dtype).removeprefix("torch."),
        target_device=str(target.device),
        draft_device=str(draft.device) if draft is not None else "-",
        tokenizer=getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        settings=resolved_settings(settings),
    )


def resolved_settings(settings: dict) -> dict:
    """Every SwiftSpecConfig field the methods use, defaults included, as the report states them."""
    resolved = SwiftSpecConfig(**settings)
    return {name: getattr(resolved, name) for name in SWIFTSPEC_FIELDS}


@contextlib.contextmanager
def assistant_settings(draft, num_assistant_tokens: int):
    """Give the draft a fixed number of tokens per assisted step, then its own generation config
    back: transformers keeps adapted values on it between calls, which would leak across methods."""
    original = draft.generation_config
    tuned = copy.deepcopy(original)
    tuned.num_assistant_tokens = num_assistant_tokens
    tuned.num_assistant_tokens_schedule = "constant"
    draft.generation_config = tuned
    try:
        yield
    finally:
        draft.generation_config = original


def target_method(target) -> Method:
    return Method(
        "target", METHOD_LABELS["target"], lambda ids, **kwargs: target.generate(ids, **kwargs), batched=True,
        models=(target,),
    )


def static_cache_settings(target) -> dict:
    """generate() arguments for transformers' own fast decoding: a static cache sized for the target's context (at
    most 4096 tokens, so calls of other lengths compile nothing new), its forward compiled (CUDA graphs on CUDA; on a
    CPU transformers compiles only when asked, as here)."""
    settings = {"cache_implementation": "static", "max_cache_len": min(context_limit(target) or 4096, 4096)}
    if target.device.type == "cpu":  # elsewhere generate() compiles by itself, with its default settings
        settings["compile_config"] = CompileConfig()
        settings["compile_config"]._compile_all_devices = True  # transformers' own switch for compiling on a CPU
    return settings


def target_static_method(target) -> Method:
    """transformers' own fast decoding: generate() with a static cache, which compiles the forward."""
    static = static_cache_settings(target)

    def generate(ids, **kwargs):
        return target.generate(ids, **static, **kwargs)

    return Method("target_static", METHOD_LABELS["target_static"], generate,
                  settings={"max_cache_len": static["max_cache_len"]}, batched=True, models=(target,))


def assisted_static_method(target, draft, num_assistant_tokens: int) -> Method:
    """transformers' assisted generation with a static cache (since 5.24 it compiles the target after prefill; the
    draft runs eagerly): the peer a GPU user of transformers' own speculation compares against. A fixed
    num_assistant_tokens (the largest of --assistant-tokens): tuning it would compile once per candidate."""
    static = static_cache_settings(target)
    settings = {"num_assistant_tokens": num_assistant_tokens, "num_assistant_tokens_schedule": "constant",
                "max_cache_len": static["max_cache_len"]}

    def generate(ids, **kwargs):
        with assistant_settings(draft, num_assistant_tokens):
            return target.generate(ids, assistant_model=draft, **static, **kwargs)

    return Method("assisted_static", METHOD_LABELS["assisted_static"], generate, settings=settings,
                  models=(target, draft))


def assisted_method(target, draft, candidates: tuple[int, ...], tokenizers: dict | None = None) -> Method:
    """transformers assisted generation; tune() keeps the fastest num_assistant_tokens on the warm-up prompt.
    tokenizers: the target's and the draft's (tokenizer=, assistant_tokenizer=) of a draft with its own: transformers'
    universal assisted generation (AssistedCandidateGeneratorDifferentTokenizers)."""
    settings = {"num_assistant_tokens": max(candidates), "num_assistant_tokens_schedule": "constant"}
    if tokenizers:
        settings["universal"] = "assistant_tokenizer: the draft's own tokenizer (universal assisted generation)"
    tuning: dict[str, float] = {}

    def generate(ids, **kwargs):
        with assistant_settings(draft, settings["num_assistant_tokens"]):
            return target.generate(ids, assistant_model=draft, **(tokenizers or {}), **kwargs)

    def tune(ids, **kwargs):
        tuning.clear()
        for n in candidates:
            settings["num_assistant_tokens"] = n
            tuning[str(n)] = round(tokens_per_second(generate, ids, kwargs), 3)
        settings["num_assistant_tokens"] = int(max(tuning, key=lambda n: (tuning[n], -int(n))))

    return Method(
        "assisted", METHOD_LABELS["assisted"], generate, settings=settings, tune=tune, tuning=tuning, models=(target, draft)
    )


def prompt_lookup_method(target, num_tokens: int) -> Method:
    def generate(ids, **kwargs):
        return target.generate(ids, prompt_lookup_num_tokens=num_tokens, **kwargs)

    return Method(
        "prompt_lookup", METHOD_LABELS["prompt_lookup"], generate, settings={"prompt_lookup_num_tokens": num_tokens},
        models=(target,),
    )


def swiftspec_method(name: str, model: SwiftSpecForCausalLM, seed: int) -> Method:
    def generate(ids, **kwargs):
        model.swiftspec_stats = None  # a failed call must not leave the previous call's stats behind
        generator = torch.Generator(device=model.target.device).manual_seed(seed)
        return model.generate(ids, swiftspec=True, generator=generator, **kwargs)

    def checkpoint():
        saved = [list(doc) for doc in model.output_history.docs.values()]  # oldest first

        def restore():
            history = model.output_history
            history.clear()
            for doc in saved:  # re-indexed in their order, so "latest occurrence" means what it meant
                history.add(doc)

        return restore

    placement = model.placement
    serial = placement.mode == "serial"
    where = str(model.target.device) if serial else (
        f"{placement.mode}: target {placement.target[0]}, draft {placement.draft[0]}"
    )
    return Method(
        name, METHOD_LABELS[name], generate, stats=lambda: model.swiftspec_stats, settings={"placement": where},
        batched=serial, checkpoint=checkpoint,
        models=tuple(m for m in (model.target, model.draft) if m is not None),
    )


def async_placement(target) -> tuple[dict | None, str]:
    """Where the asynchronous engine can put the draft beside the target in this process, or why it cannot."""
    device = target.device
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None, (
            "skipped: under torchrun every rank would run the whole bench; time the asynchronous engine across ranks "
            "with examples/torchrun_generate.py"
        )
    if device.type == "cpu":
        return {"target": ["cpu"], "draft": ["cpu"]}, "the draft runs in a second CPU thread"
    spare = [i for i in range(torch.cuda.device_count()) if i != (device.index or 0)] if device.type == "cuda" else []
    if spare:
        return {"target": [device.index or 0], "draft": [spare[-1]]}, f"the draft runs on cuda:{spare[-1]}"
    return None, (
        f"skipped: the target is on {device} and there is no second GPU for the draft (the asynchronous engine "
        "needs the draft on its own device, or its own rank under torchrun)"
    )


def skipped_result(name: str, note: str, status: str = "skipped") -> MethodResult:
    """A method with no measurements: "skipped" (the pair or placement does not allow it) or
    "unsupported" (it cannot decode a batch); the note says why."""
    return MethodResult(
        name, METHOD_LABELS.get(name, name), status, note, {}, {}, *([None] * 10), [], {}, {}, []
    )


def methods_at(batch_size: int, methods: list[Method], skipped: list[MethodResult]):
    """(methods to run, results with no measurements) at one batch size: above 1, only the batched
    methods run and the others are "unsupported", with why."""
    if batch_size == 1:
        return methods, skipped
    unsupported = [
        skipped_result(m.name, UNBATCHED.get(m.name, UNBATCHED_EXTRA), "unsupported") for m in methods if not m.batched
    ]
    unsupported += [
        skipped_result(r.name, UNBATCHED[r.name], "unsupported") if r.name in UNBATCHED else r for r in skipped
    ]
    return [m for m in methods if m.batched], unsupported


def async_method(models: BenchModels, settings: dict, seed: int, notes: list[str],
                 name: str = "swiftspec_async") -> Method | MethodResult:
    """swiftspec_async (or swiftspec_async_device / swiftspec_async_host: the same placement with round="device" /
    "host"), or a skipped result saying why the placement or the device round's asynchronous engine does not allow it."""
    if models.draft is None:
        note = "skipped: no draft (draft-free mode runs on the serial engine)"
        notes.append(f"{name} {note}.")
        return skipped_result(name, note)
    spec, note = async_placement(models.target)
    if spec is None:
        notes.append(f"{name} {note}.")
        return skipped_result(name, note)
    if name in ("swiftspec_async_device", "swiftspec_async_host"):
        settings = {**settings, "round": "device" if name == "swiftspec_async_device" else "host"}
    draft = models.draft
    if torch.device(spec["draft"][0]) != draft.device:
        draft = copy.deepcopy(draft)  # the other methods keep the draft beside the target
    try:
        model = SwiftSpecForCausalLM.from_models(models.target, draft, placement=spec, **own_tokenizers(models), **settings)
    except ValueError as error:
        notes.append(f"{name} skipped: {error}")
        return skipped_result(name, f"skipped: {error}")
    if models.target.device.type == "cpu":
        notes.append(
            f"{name}: {note}, so it uses a second core while every other method computes on "
            f"{torch.get_num_threads()} torch thread(s)."
        )
    method = swiftspec_method(name, model, seed)
    method.settings["note"] = note
    return method


def build_methods(models: BenchModels, config: BenchConfig, settings: dict, notes: list[str]):
    """(methods to run, results of methods skipped) in config.methods order, then config.extra_methods."""
    target, draft = models.target, models.draft
    tokenizers = own_tokenizers(models)  # a draft with a tokenizer of its own: swiftspec translates its branches
    universal = {"tokenizer": models.tokenizer, "assistant_tokenizer": models.draft_tokenizer} if tokenizers else None
    builders = {
        "target": lambda: target_method(target),
        "assisted": lambda: assisted_method(target, draft, config.assistant_tokens, universal) if draft is not None
        else no_draft("assisted", notes),
        "prompt_lookup": lambda: prompt_lookup_method(target, config.prompt_lookup_tokens),
        "swiftspec_serial": lambda: swiftspec_method(  # the round the call takes (round="auto": the device round)
            "swiftspec_serial", SwiftSpecForCausalLM.from_models(target, draft, **tokenizers, **settings), config.seed,
        ),
        "swiftspec_host": lambda: swiftspec_method(  # the host round, while the asynchronous engine still drives it
            "swiftspec_host", SwiftSpecForCausalLM.from_models(target, draft, **tokenizers,
                                                               **{**settings, "round": "host"}),
            config.seed,
        ),
        "swiftspec_async": lambda: async_method(models, settings, config.seed, notes),
        "swiftspec_async_device": lambda: async_method(models, settings, config.seed, notes, "swiftspec_async_device"),
        "swiftspec_async_host": lambda: async_method(models, settings, config.seed, notes, "swiftspec_async_host"),
        "target_static": lambda: target_static_method(target),
        "assisted_static": lambda: assisted_static_method(target, draft, max(config.assistant_tokens))
        if draft is not None else no_draft("assisted_static", notes),
        "swiftspec_eager": lambda: swiftspec_method(
            "swiftspec_eager", SwiftSpecForCausalLM.from_models(target, draft, **tokenizers, **settings, capture=False),
            config.seed,
        ),
        "swiftspec_device": lambda: device_method(models, settings, config.seed, notes),
        "swiftspec_compiled": lambda: swiftspec_method(
            "swiftspec_compiled", SwiftSpecForCausalLM.from_models(target, draft, **tokenizers, **settings, compile=True),
            config.seed,
        ),
        "swiftspec_suffix": lambda: swiftspec_method(
            "swiftspec_suffix", SwiftSpecForCausalLM.from_models(target, **settings), config.seed
        ),
        "swiftspec_eagle3": lambda: swiftspec_method(
            "swiftspec_eagle3", SwiftSpecForCausalLM.from_models(target, eagle3_head(config.eagle3, target), **settings),
            config.seed,
        ),
    }
    if isinstance(draft, DraftHead):
        builders["assisted"] = lambda: head_skipped("assisted", notes)
        builders["assisted_static"] = lambda: head_skipped("assisted_static", notes)
    if tokenizers:
        builders["assisted_static"] = lambda: universal_skipped("assisted_static", notes)
    built = [builders[name]() for name in config.methods] + list(config.extra_methods)
    return [m for m in built if isinstance(m, Method)], [m for m in built if isinstance(m, MethodResult)]


def device_method(models: BenchModels, settings: dict, seed: int, notes: list[str]) -> Method | MethodResult:
    """swiftspec_device: the pair with its settings on the device round (round="device"), or a skipped result with
    the device round's own refusal, got from one real two-token call (the refusal names what the pair lacks)."""
    model = SwiftSpecForCausalLM.from_models(models.target, models.draft, **own_tokenizers(models), **settings,
                                             round="device")
    probe = torch.zeros(1, 2, dtype=torch.long, device=models.target.device)
    try:
        model.generate(probe, attention_mask=torch.ones_like(probe), swiftspec=True, max_new_tokens=1, do_sample=False)
    except ValueError as error:
        if "round='device'" not in str(error):
            raise
        note = f"skipped: {error}"
        notes.append(f"swiftspec_device {note}")
        return skipped_result("swiftspec_device", note)
    model.output_history.clear()  # the probe's tokens are no earlier call's output
    return swiftspec_method("swiftspec_device", model, seed)


def own_tokenizers(models: BenchModels) -> dict:
    """from_models' tokenizer= and draft_tokenizer= for a draft with a tokenizer of its own; {} otherwise."""
    if models.draft_tokenizer is None or models.draft_tokenizer is models.tokenizer:
        return {}
    return {"tokenizer": models.tokenizer, "draft_tokenizer": models.draft_tokenizer}


def universal_skipped(name: str, notes: list[str]) -> MethodResult:
    note = ("skipped: the draft has a tokenizer of its own; transformers' universal assisted generation runs in the "
            "`assisted` method, with a dynamic cache")
    notes.append(f"{name} {note}.")
    return skipped_result(name, note)


def head_skipped(name: str, notes: list[str]) -> MethodResult:
    note = "skipped: the draft is a draft head (EAGLE-3 or MTP), which only swiftspec's own rounds run"
    notes.append(f"{name} {note}.")
    return skipped_result(name, note)


def eagle3_head(name: str | None, target) -> Eagle3Head:
    """The EAGLE-3 head `name` names (its folder, or a pair whose draft is one), beside the target in its dtype."""
    if name is None:
        raise ValueError("the method swiftspec_eagle3 needs a head: give --eagle3 HEAD (BenchConfig.eagle3).")
    path = Path(name)
    if not is_eagle3_folder(path):
        folder = resolve_pair_folder(name)
        member = pair_members(load_pair_config(folder, f"pair {name!r}"), folder)["draft"]
        path = member_folder(member, HubOptions())
        if not is_eagle3_folder(path):
            raise ValueError(f"--eagle3 {name!r} is neither an EAGLE-3 head folder nor a pair whose draft is one.")
    return load_eagle3_head(path, target.device, target.dtype)


def no_draft(name: str, notes: list[str]) -> MethodResult:
    note = "skipped: the model has no draft (draft-free mode)"
    notes.append(f"{name} {note}.")
    return skipped_result(name, note)


@contextlib.contextmanager
def eos_ignored(model, ignore: bool):
    """With ignore, every call runs to max_new_tokens; the swiftspec wrappers share this generation config."""
    saved = model.generation_config.eos_token_id
    if ignore:
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved
