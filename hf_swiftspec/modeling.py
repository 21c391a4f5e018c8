"""SwiftSpecForCausalLM: a target/draft pair that generates like the target, only faster."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from .config import SwiftSpecConfig
from .generation import split_stop_strings, stop_string_criteria, swiftspec_generate
from .placement import place_models, resolve_placement
from .stats import SwiftSpecStats

# Architectures whose attention takes a 4D tree mask with explicit position ids and whose KV is
# one (B, H, L, D) tensor per layer; each is exercised by tests/test_lossless.py.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
TREE_MASK_ATTENTION = ("sdpa", "eager")
HUB_KWARGS = ("cache_dir", "token", "local_files_only", "force_download", "proxies")


def check_model_supported(model: PreTrainedModel, role: str) -> None:
    """Raise ValueError if `model` cannot run tree steps, naming its model type and the fix."""
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The {role} model type {config.model_type!r} is not supported by hf_swiftspec (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}). It needs attention that takes a 4D tree mask and a plain KV cache."
        )
    attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if attn not in TREE_MASK_ATTENTION:
        raise ValueError(
            f"The {role} ({config.model_type}) uses attn_implementation={attn!r}, which cannot take a tree mask; "
            f"load it with attn_implementation='sdpa' or 'eager'."
        )


def check_vocabularies(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """The draft's token ids must mean the target's: same vocabulary size (same tokenizer)."""
    t_vocab = target.config.get_text_config().vocab_size
    d_vocab = draft.config.get_text_config().vocab_size
    if t_vocab != d_vocab:
        raise ValueError(
            f"Vocabulary mismatch: target vocab_size={t_vocab}, draft vocab_size={d_vocab}. The draft must share "
            "the target's tokenizer; pick a draft from the target's model family."
        )


class SwiftSpecForCausalLM(PreTrainedModel, GenerationMixin):
    """A target and a draft model; `generate(swiftspec=True)` speculates with a token tree, losslessly.

    Everything not about speculation (forward, generation_config, device) is the target's.
    After each speculative `generate()`, `swiftspec_stats` describes the call.
    """

    config_class = SwiftSpecConfig
    base_model_prefix = "swiftspec"
    main_input_name = "input_ids"

    def __init__(self, config: SwiftSpecConfig, target: PreTrainedModel | None = None, draft=None):
        super().__init__(config)
        if target is None or draft is None:
            raise ValueError(
                "SwiftSpecForCausalLM needs both models: use SwiftSpecForCausalLM.from_models(target, draft) or "
                "SwiftSpecForCausalLM.from_pretrained(pair_folder)."
            )
        check_model_supported(target, "target")
        check_model_supported(draft, "draft")
        check_vocabularies(target, draft)
        self.placement = resolve_placement(config.placement, target.config)
        self.target = target
        self.draft = draft
        self.process_groups = place_models(self.placement, target, draft, config.worker_timeout_s)
        if self.placement.device_map is not None:
            self.hf_device_map = self.placement.device_map  # pipeline() then leaves the devices alone
        self.generation_config = target.generation_config  # one object: both paths use the same defaults
        self.swiftspec_stats: SwiftSpecStats | None = None

    @classmethod
    def from_models(cls, target: PreTrainedModel, draft: PreTrainedModel, **settings) -> "SwiftSpecForCausalLM":
        """Wrap two models already in memory; `settings` are SwiftSpecConfig fields (tree_budget, ...)."""
        config = SwiftSpecConfig(target=target.name_or_path or None, draft=draft.name_or_path or None, **settings)
        return cls(config, target, draft)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "SwiftSpecForCausalLM":
        """Load a pair folder: config.json with model_type "swiftspec" naming the target and draft.

        Relative target/draft paths resolve against the pair folder. `revision` arguments in the
        config pin each model; other keyword arguments (dtype, device_map, trust_remote_code, ...)
        go to both models' `from_pretrained`. Weights load as safetensors only.
        """
        kwargs.pop("config", None)
        revision = kwargs.pop("revision", None)  # the pair repo's; each member has its own pinned one
        hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
        settings = {k: kwargs.pop(k) for k in list(kwargs) if k in SwiftSpecConfig().to_dict() and k != "model_type"}
        config = SwiftSpecConfig.from_pretrained(pretrained_model_name_or_path, revision=revision, **hub, **settings)
        for role in ("target", "draft"):
            if not getattr(config, role):
                raise ValueError(f"Pair config at {pretrained_model_name_or_path!r} has no {role!r} entry.")
        kwargs.setdefault("use_safetensors", True)
        kwargs.setdefault("trust_remote_code", False)
        models = {
            role: AutoModelForCausalLM.from_pretrained(
                resolve_member(pretrained_model_name_or_path, getattr(config, role)),
                revision=getattr(config, f"{role}_revision"),
                **kwargs,
            )
            for role in ("target", "draft")
        }
        return cls(config, models["target"], models["draft"])

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """Write the pair config and generation config (no weights: the models load from their own repos)."""
        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        self.generation_config.save_pretrained(save_directory)

    def forward(self, *args, **kwargs):
        """The target's forward."""
        return self.target(*args, **kwargs)

    def get_input_embeddings(self):
        return self.target.get_input_embeddings()

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        swiftspec: bool | None = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ):
        """`target.generate` with the same arguments; with swiftspec=True, by tree speculation.

        generator: RNG for sampling with swiftspec=True (default: seeded from torch's global RNG).
        """
        if swiftspec is None:
            swiftspec = self.config.swiftspec_default
        if not swiftspec:
            return self.target.generate(
                inputs,
                generation_config=generation_config,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                streamer=streamer,
                **kwargs,
            )
        self.config.validate_tree_settings()
        if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens"):
            raise ValueError("swiftspec=True brings its own draft; drop assistant_model / prompt_lookup_num_tokens.")
        tokenizer = kwargs.pop("tokenizer", None)
        generation_config, stop_strings = split_stop_strings(kwargs, generation_config, self.generation_config)
        if stop_strings is not None:
            stopping_criteria = stop_string_criteria(stop_strings, tokenizer, stopping_criteria)
        try:
            output, self.swiftspec_stats = GenerationMixin.generate(
                self.target,
                inputs,
                generation_config=generation_config,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                streamer=streamer,
                custom_generate=swiftspec_generate,
                swiftspec_draft=self.draft,
                swiftspec_config=self.config,
                swiftspec_placement=self.placement,
                swiftspec_groups=self.process_groups,
                swiftspec_streamer=streamer,
                swiftspec_generator=generator,
                **kwargs,
            )
        finally:
            if streamer is not None:  # a consumer iterating a TextIteratorStreamer must never hang
                streamer.end()
        return output


def resolve_member(pair_path: str, member: str) -> str:
    """A target/draft entry: a path relative to a local pair folder, or a repo id / absolute path."""
    if os.path.isdir(pair_path) and not os.path.isabs(member):
        candidate = os.path.join(pair_path, member)
        if os.path.isdir(candidate):
            return candidate
    return member
