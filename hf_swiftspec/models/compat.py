"""Every contact with transformers' internals that changes between releases, in one place.

hf_swiftspec runs transformers' own models on its own caches and masks, so it touches more than the
public API: cache layers, mask builders, the decoding loop it falls back on, generation-config
fields, hub helpers. Each minor release (about monthly) renames some of it. The rest of the package
imports these names from here, never from transformers' submodules, so a release that moves one
breaks this file alone, with a message that names the installed and the tested releases.

Each entry is decided by capability (a signature, an attribute) where one exists, not by version
strings, and says which releases it serves. Tested: transformers FLOOR to NEWEST (both run in CI).

What changed from 5.23 to 5.24 and where it is handled here:
- forwards, `prepare_inputs_for_generation` and `generate` take the cache as `cache=` (5.23:
  `past_key_values=`, Mamba-style models `cache_params=`; the old names warn until 5.40):
  `cache_argument`, `prepare_inputs`, `GENERATE_CACHE_ARGUMENTS`, `PREPARED_CACHE_KWARGS`.
- model outputs carry `.cache` (5.23: `.past_key_values`): `output_cache`.
- `check_model_kwargs` refuses a model kwarg named `cache` unless it is known as the cache:
  `PREPARED_CACHE_KWARGS` (generation.check_model_kwargs).
- cache layers no longer keep `self.dtype`; `Cache.update` passes `kwargs=` to layers (both
  accepted by the tree cache's layers, which read dtypes off their tensors).
- `masking_utils` builders take `cache` (hf_swiftspec only registers `sdpa_mask` / `eager_mask`,
  whose signatures did not change).

What 5.25 changes (not supported yet: pyproject caps below it; CI's canary runs the floor smoke set on it):
- model classes no longer set `_is_stateful`: `outside_state` also knows a model by its own cache
  (`_supports_default_dynamic_cache`), so rwkv / xlstm are refused for the same reason on both.
- `LinearAttentionLayer.get_seq_length` counts the tokens its state has seen: the hybrid layers of the tree and slot
  caches (recurrent.TreeStateLayer, slot_cache.SlotStateLayer) answer with their keys' length instead.
- `AutoModelForCausalLM.from_pretrained` passes `_from_auto` in its hub kwargs as well: pair/loading.py does not
  forward it to the members (it raised "multiple values for keyword argument").
- what blocks it: `transformers serve` runs each model in a process of its own (EngineClient, ModelLoader) and
  `Serve` lost `non_blocking`; `swiftspec serve` (serving/server.py) builds on 5.24's in-process ModelManager.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import warnings

import transformers
from packaging.version import Version

FLOOR = "5.23"  # oldest release tested (CI's floor smoke set); 5.17 failed the sliding-window wiring tests
NEWEST = "5.24"  # newest release tested (CI's full suite); pyproject caps below the next minor
UNTESTED_ENV = "HF_SWIFTSPEC_UNTESTED_TRANSFORMERS"  # "1": run on a release outside FLOOR..NEWEST anyway


class UnsupportedTransformersError(ImportError):
    """The installed transformers is outside the tested releases, or lacks an internal hf_swiftspec uses."""


def installed() -> str:
    return transformers.__version__


def tested_range() -> str:
    return f"{FLOOR} to {NEWEST}" if FLOOR != NEWEST else FLOOR


def next_minor() -> str:
    major, minor = Version(NEWEST).release[:2]
    return f"{major}.{minor + 1}"


def install_hint() -> str:
    return f"pip install 'transformers>={FLOOR},<{next_minor()}'"


def unsupported(what: str) -> UnsupportedTransformersError:
    """The error for an internal this module cannot find: it names the release and the fix."""
    return UnsupportedTransformersError(
        f"hf_swiftspec cannot find {what} in the installed transformers {installed()}; it is tested with transformers "
        f"{tested_range()}. Install a tested release ({install_hint()}), or an hf_swiftspec release that supports "
        f"{installed()}."
    )


def release_problem(version: str) -> str | None:
    """Why `version` is outside the tested releases (compared by major.minor: patches are in), or None."""
    release = Version(Version(version).base_version).release[:2]
    if release < Version(FLOOR).release[:2]:
        return f"transformers {version} is older than the oldest release hf_swiftspec is tested with ({FLOOR})"
    if release > Version(NEWEST).release[:2]:
        return (
            f"transformers {version} is newer than the newest release hf_swiftspec is tested with ({NEWEST}); each minor "
            "release renames internals hf_swiftspec runs on, which can break calls or change tokens"
        )
    return None


def check_release(version: str | None = None) -> None:
    """Refuse a transformers outside the tested range at import, naming both; with UNTESTED_ENV=1, warn instead."""
    problem = release_problem(version or installed())
    if problem is None:
        return
    if os.environ.get(UNTESTED_ENV) == "1":
        warnings.warn(f"{problem}. Running anyway ({UNTESTED_ENV}=1).", UserWarning, stacklevel=3)
        return
    raise UnsupportedTransformersError(
        f"{problem}. Tested: transformers {tested_range()}. Install a tested release ({install_hint()}), or set "
        f"{UNTESTED_ENV}=1 to try this one anyway."
    )


def internal(module: str, name: str):
    """transformers.<module>.<name>, or UnsupportedTransformersError naming the releases."""
    try:
        return getattr(importlib.import_module(f"transformers.{module}"), name)
    except (ImportError, AttributeError) as error:
        raise unsupported(f"transformers.{module}.{name}") from error


# ---------------------------------------------------------------- internals imported by name (5.23-5.24)

Cache = internal("cache_utils", "Cache")
CacheLayerMixin = internal("cache_utils", "CacheLayerMixin")
DynamicCache = internal("cache_utils", "DynamicCache")
LinearAttentionCacheLayerMixin = internal("cache_utils", "LinearAttentionCacheLayerMixin")
LinearAttentionLayer = internal("cache_utils", "LinearAttentionLayer")
get_layer_types_and_kwargs = internal("cache_utils", "get_layer_types_and_kwargs")
sdpa_mask = internal("masking_utils", "sdpa_mask")
eager_mask = internal("masking_utils", "eager_mask")
sdpa_attention_forward = internal("integrations.sdpa_attention", "sdpa_attention_forward")
GenerationMode = internal("generation.configuration_utils", "GenerationMode")
logits_process = internal("generation", "logits_process")
EosTokenCriteria = internal("generation.stopping_criteria", "EosTokenCriteria")
MaxLengthCriteria = internal("generation.stopping_criteria", "MaxLengthCriteria")
MaxTimeCriteria = internal("generation.stopping_criteria", "MaxTimeCriteria")
StopStringCriteria = internal("generation.stopping_criteria", "StopStringCriteria")
GenerateDecoderOnlyOutput = internal("generation", "GenerateDecoderOnlyOutput")
MODEL_FOR_CAUSAL_LM_MAPPING = internal("models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING")
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = internal("models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
get_tokenizer_config = internal("models.auto.tokenization_auto", "get_tokenizer_config")
ACT2FN = internal("activations", "ACT2FN")  # an EAGLE-3 head's layer (eagle3.py) is a llama layer
LlamaRotaryEmbedding = internal("models.llama.modeling_llama", "LlamaRotaryEmbedding")
apply_rotary_pos_emb = internal("models.llama.modeling_llama", "apply_rotary_pos_emb")
MtpModel = internal("modeling_layers", "MtpModel")  # a model's own MTP layers, as generate(use_mtp=True) builds them


def tensor_parallel_plan(model, degree: int) -> dict:
    """The model's own tensor-parallel plan for `degree` ranks (`_resolve_parallel_plans`, 5.23-5.24)."""
    DistributedConfig = internal("distributed", "DistributedConfig")
    resolve = getattr(model, "_resolve_parallel_plans", None)
    if resolve is None:
        raise unsupported("PreTrainedModel._resolve_parallel_plans")
    plan, _, _ = resolve(DistributedConfig(tp_size=degree))
    return plan


def apply_tensor_parallelism(model, mesh, plan) -> None:
    """Shard `model` over `mesh` by `plan` (transformers.distributed.tensor_parallel, 5.23-5.24)."""
    internal("distributed.tensor_parallel", "apply_tensor_parallelism")(model, mesh, plan)


# ---------------------------------------------------------------- the cache argument

# What a forward calls its Cache, newest name first: "cache" (5.24+), "past_key_values" (5.23 and
# earlier), "cache_params" (Mamba-style forwards up to 5.23).
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def outside_state(model_class, parameters) -> str | None:
    """Why transformers takes `model_class` to keep a recurrent state outside its cache's layers, or None. Up to 5.24
    its class sets `_is_stateful` (mamba, rwkv, xlstm, ...; those whose state sits in transformers' state layers are
    told apart by their layer types); 5.25 dropped the flag: a model whose generate starts from a cache of its own
    (`_supports_default_dynamic_cache`, rwkv / xlstm) and whose forward takes a state or a cache."""
    if hasattr(model_class, "_is_stateful"):
        return "its model class sets _is_stateful" if model_class._is_stateful else None
    own_cache = getattr(model_class, "_supports_default_dynamic_cache", None)
    takes = parameters is not None and any(name in parameters for name in ("state", *CACHE_ARGUMENTS))
    return "its generate starts from a cache of its own" if own_cache is not None and not own_cache() and takes else None


# The names generate() takes a user's cache under (5.24 renamed past_key_values / cache_params to cache).
GENERATE_CACHE_ARGUMENTS = CACHE_ARGUMENTS
# Model kwargs generate() itself prepares for the loop under a cache name (any release).
PREPARED_CACHE_KWARGS = frozenset(CACHE_ARGUMENTS)


@functools.lru_cache(maxsize=None)
def cache_argument(function) -> str | None:
    """The argument `function` (a forward, or prepare_inputs_for_generation) takes its Cache as, or None.

    Decided by the signature, newest name first, so a 5.24 forward gets `cache=` (its deprecated
    `past_key_values=` would warn) and a 5.23 one `past_key_values=` / `cache_params=`.
    """
    parameters = inspect.signature(function).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def forward_cache_argument(model_class) -> str:
    """The forward argument `model_class` takes its Cache as (architectures.py refuses models with none)."""
    return cache_argument(model_class.forward) or CACHE_ARGUMENTS[0]


def output_cache(outputs):
    """The cache a model output or generate() output carries: `.cache` (5.24+) or `.past_key_values` (5.23)."""
    for name in ("cache", "past_key_values"):
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def prepare_inputs(model, input_ids, cache, **kwargs) -> dict:
    """model.prepare_inputs_for_generation with the cache under the name this release's signature takes."""
    name = cache_argument(type(model).prepare_inputs_for_generation) or CACHE_ARGUMENTS[0]
    return model.prepare_inputs_for_generation(input_ids, **{name: cache}, **kwargs)


# ---------------------------------------------------------------- generation internals

def sample_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs: dict):
    """transformers' own greedy / sampling loop (GenerationMixin._sample; same signature 5.23-5.24)."""
    sample = getattr(transformers.GenerationMixin, "_sample", None)
    if sample is None:
        raise unsupported("GenerationMixin._sample")
    return sample(
        model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        generation_config=generation_config, synced_gpus=False, streamer=streamer, **model_kwargs,
    )  # fmt: skip


def pad_token_tensor(generation_config):
    """The pad token generate() prepared (`_pad_token_tensor`, set by `_prepare_special_tokens`; 5.23-5.24),
    else the config's pad_token_id."""
    if hasattr(generation_config, "_pad_token_tensor"):
        return generation_config._pad_token_tensor
    return generation_config.pad_token_id


# ---------------------------------------------------------------- attention implementation

def attn_implementation(config) -> str | None:
    """The attention implementation a model config runs (`_attn_implementation`, 5.x)."""
    return getattr(config, "_attn_implementation", None)


def can_set_attn_implementation(model) -> bool:
    """Whether `model.set_attn_implementation` may switch it (`_can_set_attn_implementation`, 5.x)."""
    check = getattr(model, "_can_set_attn_implementation", None)
    if check is None:
        raise unsupported("PreTrainedModel._can_set_attn_implementation")
    return bool(check())


# ---------------------------------------------------------------- transformers serve (5.23-5.24), for `swiftspec serve`


def serving_available() -> bool:
    """Whether transformers' server can run here (fastapi, uvicorn, pydantic, openai installed)."""
    return internal("utils.import_utils", "is_serve_available")()


def serving_server():
    """transformers' `Serve` (cli/serve.py): builds the FastAPI app and runs uvicorn."""
    return internal("cli.serve", "Serve")


def serving_model_manager():
    """transformers' `ModelManager` (cli/serving/model_manager.py), which `Serve` builds to load models."""
    return internal("cli.serving.model_manager", "ModelManager")


def cb_request_status():
    """transformers' continuous-batching `RequestStatus` (PENDING .. DECODING, FINISHED, FAILED)."""
    return internal("generation.continuous_batching.requests", "RequestStatus")


def cb_generation_output():
    """transformers' continuous-batching `GenerationOutput`: what a batching manager hands its result handlers."""
    return internal("generation.continuous_batching.requests", "GenerationOutput")


@contextlib.contextmanager
def serving_built_with(manager_class, finish_app):
    """While this block runs, transformers' `Serve` loads models with `manager_class` and passes the FastAPI
    app it builds through `finish_app(app) -> app` before serving it. `Serve` has no argument for either
    (5.23-5.24): it builds `ModelManager` and calls `build_server` by name from their modules when it
    starts, so those two names are swapped for the block and restored afterwards."""
    manager_module = importlib.import_module("transformers.cli.serving.model_manager")
    server_module = importlib.import_module("transformers.cli.serving.server")
    manager, build_server = manager_module.ModelManager, server_module.build_server
    manager_module.ModelManager = manager_class
    server_module.build_server = lambda *args, **kwargs: finish_app(build_server(*args, **kwargs))
    try:
        yield
    finally:
        manager_module.ModelManager, server_module.build_server = manager, build_server
