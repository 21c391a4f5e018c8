"""SwiftSpecForCausalLM: a target/draft pair that generates like the target, only faster."""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel

from .steps.capture import Captures
from .drafters.eagle3 import DraftHead, Eagle3Head, load_eagle3_head
from .steps.probes import describe
from .config import SwiftSpecConfig, check_setting_names
from .engine.launch import check_serial_fallback, continuous_engine, falls_back
from .generation import check_inputs, split_stop_strings, stop_string_criteria, swiftspec_generate
from .pair import (
    PairCard,
    PairConfigError,
    check_compatibility,
    pair_members,
    pinned,
    relocated,
    resolve_pair,
    write_pair_repo,
)
from .pair.loading import LoadArguments, load_member_model, split_load_kwargs, with_cpu_dtype
from .pair.locate import HubOptions, member_folder, member_head_config, resolve_pair_folder
from .pair.checks import FROM_MODELS, TokenizerArguments
from .pair.repo import read_pair_config
from .pair.tokenizer import load_tokenizer
from .engine.placement import Placement, place_models, resolve_placement
from .policy.goodput import GoodputPolicy
from .stats import SwiftSpecStats
from .drafters.suffix import OutputHistory
from .drafters.vocabulary import Vocabularies


__all__ = ["SwiftSpecForCausalLM"]

logger = logging.getLogger(__name__)


def check_model_supported(model: PreTrainedModel, role: str) -> None:
    """Raise ValueError if `model` cannot run exact tree (or chain) steps, naming the missing capability."""
    describe(model, role)


def corpus_tokens(corpus, tokenizer) -> list[list[int]]:
    """`ngram_corpus` as token id lists: strings (encoded with the tokenizer), id lists or 1D tensors."""
    if corpus is None:
        return []
    if isinstance(corpus, (str, torch.Tensor)) or not isinstance(corpus, (list, tuple)):
        raise ValueError(f"ngram_corpus must be a list of strings or token id lists, got {type(corpus).__name__}.")
    out = []
    for document in corpus:
        if isinstance(document, str):
            if tokenizer is None:
                raise ValueError("ngram_corpus holds strings but the pair has no tokenizer: pass tokenizer=... or token ids.")
            out.append(tokenizer(document, add_special_tokens=False)["input_ids"])
        elif isinstance(document, torch.Tensor) and document.dim() == 1:
            out.append(document.tolist())
        elif isinstance(document, (list, tuple)) and all(isinstance(t, int) for t in document):
            out.append(list(document))
        else:
            raise ValueError(f"ngram_corpus entries must be strings, lists of ints or 1D tensors; got {document!r:.80}.")
    return out


def check_member_type(model, role: str, required: bool) -> None:
    """A member must be a transformers model; name what was passed instead (a tokenizer, a path...)."""
    if model is None and not required:
        return
    if role == "draft" and isinstance(model, DraftHead):
        return
    if not isinstance(model, PreTrainedModel):
        hint = " Pass it as tokenizer= instead." if hasattr(model, "encode") and hasattr(model, "decode") else ""
        load = " Load it first: AutoModelForCausalLM.from_pretrained(...)." if isinstance(model, (str, os.PathLike)) else ""
        raise TypeError(
            f"SwiftSpecForCausalLM.from_models(target, draft=None, tokenizer=None, ...): the {role} must be a model (a "
            f"transformers PreTrainedModel), got {type(model).__name__}.{hint}{load}"
        )


def own_location(model: PreTrainedModel | None, other: PreTrainedModel | None = None) -> str | None:
    """Where `model` can be loaded from again (its name_or_path), or None when it was built or changed in
    memory: the folder its config names holds another model (its config differs), or the folder is the
    other member's (a draft built from the target's config, say). save_pretrained then refuses or stores
    its weights instead of pointing the pair at a model it is not."""
    if model is None or not model.name_or_path:
        return None
    if isinstance(model, Eagle3Head):  # loaded from its folder as it is (load_eagle3_head)
        return model.name_or_path
    if isinstance(model, DraftHead):  # a model's own MTP layer: no folder of its own
        return None
    name = model.name_or_path
    if other is not None and model is not other and name == other.name_or_path:
        logger.warning(
            "The draft's name_or_path %r is the target's, so that folder does not hold the draft (it was made from the "
            "target in memory, e.g. from its config): the pair names no folder for it, and save_pretrained(save_members=True) "
            "stores its weights.", name,
        )
        return None
    stored = stored_config(name)
    if stored is not None and config_differences(stored, model.config):
        logger.warning(
            "%r holds another model than this one (its config differs: %s): it was built or changed in memory, so the pair "
            "does not name that folder for it (save_pretrained(save_members=True) stores its weights).",
            name, config_differences(stored, model.config),
        )
        return None
    return name


def stored_config(name: str):
    """The config at a local folder or a Hub id already in the cache (None when neither can be read)."""
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None


IGNORED_CONFIG_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset",
                       "architectures", "use_cache")  # fmt: skip


def config_differences(stored, live) -> str:
    """What differs between two model configs, as 'key: stored vs live' (empty when they describe one model)."""
    a, b = stored.to_dict(), live.to_dict()
    keys = sorted(k for k in set(a) | set(b) if k not in IGNORED_CONFIG_KEYS and a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:4]) + (" ..." if len(keys) > 4 else "")


def draft_own_tokenizer(target: PreTrainedModel, draft: PreTrainedModel, location: str | None):
    """The draft's own tokenizer when only the target's was given and the two vocabularies differ in size,
    from the folder (or cached Hub repo) the draft came from, so that its token -> id mapping is checked
    as pair repos check it (a Gemma-3 draft under a SmolLM2 target was accepted on the target's tokenizer
    alone); None when the sizes agree, or when the draft has no folder of its own (built in memory: it is
    taken to share the target's tokenizer, with padded embeddings of another size, and a warning says so)."""
    sizes = target.config.get_text_config().vocab_size, draft.config.get_text_config().vocab_size
    if sizes[0] == sizes[1]:
        return None
    own = load_tokenizer(location, None, HubOptions(local_files_only=True), False) if location is not None else None
    if own is None:
        logger.warning(
            "The draft's vocab_size (%d) differs from the target's (%d) and its own tokenizer is unknown, so it is taken "
            "to use the target's tokenizer (padded embeddings); pass draft_tokenizer= to have its mapping checked.",
            sizes[1], sizes[0],
        )
    return own


def check_head_fits(head: DraftHead, target: PreTrainedModel, placement: Placement | None) -> None:
    """A draft head (an EAGLE-3 head, a model's own MTP layer) drafts from the target's per-token hidden states:
    serially beside the target; an EAGLE-3 head also on a device of its own, in a thread or in a process of its
    own (the states then cross process groups with each verdict). Refuse a target or placement where it cannot,
    and a head made for another target (bind)."""
    mode = placement.mode if placement is not None else "serial"
    what = "An EAGLE-3 head" if isinstance(head, Eagle3Head) else "A model's own MTP layer"
    if mode != "serial" and not isinstance(head, Eagle3Head):
        raise ValueError(
            f"{what} shares the target's embeddings and head, so it drafts on the target's device, serially: drop placement."
        )
    architecture = describe(target, "target")
    if architecture.recurrent:
        raise ValueError(
            f"The target ({architecture.model_type}) keeps recurrent states; a draft head drafts for attention "
            "targets only. Use a draft model or draft-free mode."
        )
    head.bind(target)
    device = torch.device(placement.draft[0]) if mode == "threads" else target.device
    if head.shares_embeddings and (mode == "distributed" or device != target.device):
        # moving (or sharding) one must not move the other's: the draft's process moves the head, the target's the target
        head.embed_tokens, head.shares_embeddings = copy.deepcopy(head.embed_tokens), False
    if mode == "serial" and head.device != target.device:
        raise ValueError(f"The draft head is on {head.device}, the target on {target.device}: move the head to the target's device.")


def check_members(target, draft, placement: Placement | None, tokenizer=None, draft_tokenizer=None,
                  arguments: TokenizerArguments = FROM_MODELS) -> Vocabularies | None:
    """Raise ValueError if the target, or the draft beside it (a model or a draft head), cannot speculate. Returns
    the two vocabularies of a draft with a tokenizer of its own (it proposes through text), else None. arguments:
    how the caller takes the two tokenizers (its errors name them)."""
    check_model_supported(target, "target")
    if isinstance(draft, DraftHead):
        check_head_fits(draft, target, placement)
    elif draft is not None:
        check_model_supported(draft, "draft")
        if check_compatibility(target.config, draft.config, tokenizer, draft_tokenizer, architectures=False,
                               arguments=arguments):
            return Vocabularies.between(tokenizer, draft_tokenizer)
    return None


class SwiftSpecForCausalLM(PreTrainedModel, GenerationMixin):
    """A target and a draft model; `generate(swiftspec=True)` speculates with a token tree, losslessly.

    Without a draft (`from_models(target)`, or `from_pretrained` of a plain causal-LM folder or id)
    it speculates from the text's own repetition alone: n-gram proposals from the prompt, the output
    and earlier calls' outputs, verified by the target on the serial engine.

    Everything not about speculation (forward, generation_config, device) is the target's.
    After each speculative `generate()`, `swiftspec_stats` describes the call. `tokenizer` is the
    pair's (what save_pretrained writes beside the config), or None when built without one.
    """

    config_class = SwiftSpecConfig
    base_model_prefix = "swiftspec"
    main_input_name = "input_ids"

    def __init__(
        self,
        config: SwiftSpecConfig,
        target: PreTrainedModel | None = None,
        draft: PreTrainedModel | None = None,
        tokenizer=None,
        draft_tokenizer=None,
    ):
        super().__init__(config)
        if target is None:
            raise ValueError(
                "SwiftSpecForCausalLM needs a target model: use SwiftSpecForCausalLM.from_models(target[, draft]) or "
                "SwiftSpecForCausalLM.from_pretrained(pair_or_model_folder)."
            )
        draft_config = draft.config if isinstance(draft, PreTrainedModel) else None  # (a head drafts serially)
        placement = resolve_placement(config.placement, target.config, draft_config)
        # a draft with a tokenizer of its own: both vocabularies, which its proposals are translated between
        self.vocabularies = check_members(target, draft, placement, tokenizer, draft_tokenizer)
        self.target = target
        self.draft = draft  # None: draft-free mode, speculating from the text's own repetition
        self.placement: Placement = placement
        if draft is None and self.placement.mode != "serial":
            raise ValueError(
                f"placement={config.placement!r} runs a draft beside the target ({self.placement.mode}), but this model "
                "has no draft: draft-free mode speculates from the text's own repetition on the serial engine. Drop "
                "placement, or pass a draft model."
            )
        check_serial_fallback(config, self.placement)
        self.process_groups = place_models(self.placement, target, draft, config.worker_timeout_s,
                                           draft_beside_target=falls_back(config, self.placement))
        if self.placement.device_map is not None:
            self.hf_device_map = self.placement.device_map  # pipeline() must not move models placed apart
        self.tokenizer = tokenizer
        self.draft_tokenizer = draft_tokenizer if self.vocabularies is not None else None  # only where it is its own
        self.pair_folder: Path | None = None  # where from_pretrained found the pair; relative members live there
        self.generation_config = target.generation_config  # one object: both paths use the same defaults
        self.swiftspec_stats: SwiftSpecStats | None = None
        self.policies: dict[tuple, GoodputPolicy] = {}  # what the goodput policy measured, per tree setting
        self.captures = Captures()  # the models' replayed forwards and their KV buffers, kept across calls
        self._history: OutputHistory | None = None

    @property
    def output_history(self) -> OutputHistory:
        """Earlier outputs of this model's speculative generate() calls, which later calls' suffix
        proposals copy from (config.suffix_cache_tokens tokens at most, first in, first out);
        `model.output_history.clear()` forgets them."""
        limit, max_n = self.config.suffix_cache_tokens, max(self.config.ngram_size, 1)
        if self._history is None or (self._history.max_tokens, self._history.max_n) != (limit, max_n):
            self._history = OutputHistory(max_tokens=limit, max_n=max_n)
        return self._history

    def policy(self) -> GoodputPolicy:
        """The goodput policy for the current tree settings and way of running steps (captured, compiled:
        their costs differ); it keeps what it measured (step costs, acceptance) across generate() calls, so
        only the first call pays for learning them."""
        key = (self.config.tree_budget, self.config.draft_depth, self.placement.mode, self.config.compile,
               self.config.capture)
        if key not in self.policies:
            self.policies[key] = GoodputPolicy(tree_budget=self.config.tree_budget, draft_depth=self.config.draft_depth)
        return self.policies[key]

    def continuous_engine(self, latency_guard: bool = True):
        """An engine that decodes concurrent generate() calls (one sequence each) in one running batch, each
        speculating with trees the policy sizes for the batch it has: `generate(ids, swiftspec_engine=(engine,
        request_id))` from each caller's thread (what `swiftspec serve --continuous-batching` does); close()
        it when done. ValueError where the pair cannot batch (a recurrent model, a placement on two devices).
        latency_guard=False: trees sized for the batch's goodput alone (policy/guard.py says what the guard does)."""
        return continuous_engine(self.target, self.draft, self.config, self.placement, self.process_groups,
                                 self.policy(), self.output_history, latency_guard, self.vocabularies)

    def reset_policy(self) -> None:
        """Forget what the policy measured (e.g. after moving the models or changing threads)."""
        self.policies.clear()

    @classmethod
    def from_models(
        cls, target: PreTrainedModel, draft: PreTrainedModel | None = None, tokenizer=None, draft_tokenizer=None,
        **settings,
    ) -> "SwiftSpecForCausalLM":
        """Wrap two models already in memory (or only a target: draft-free mode); `settings` are
        SwiftSpecConfig fields (tree_budget, ...).

        tokenizer: the target's (and the draft's, unless draft_tokenizer is given). With tokenizers the
        vocabularies are compared token by token, so padded embeddings of different sizes are fine.
        draft_tokenizer: the draft's own, where it is not the target's: the draft then grows its tree in its own
        vocabulary and its branches are translated into the target's tokens through their text (lossless all
        the same: the target verifies every token). Where only tokenizer= is given and the vocabularies differ in
        size, the draft's own is read from the folder it was loaded from.
        """
        check_setting_names(settings, "SwiftSpecForCausalLM.from_models")
        check_member_type(target, "target", required=True)
        check_member_type(draft, "draft", required=False)
        config = SwiftSpecConfig(target=own_location(target), draft=own_location(draft, target), **settings)
        if draft is not None and not isinstance(draft, DraftHead) and tokenizer is not None and draft_tokenizer is None:
            draft_tokenizer = draft_own_tokenizer(target, draft, config.draft)
        return cls(config, target, draft, tokenizer=tokenizer, draft_tokenizer=draft_tokenizer)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "SwiftSpecForCausalLM":
        """Load a pair: a Hub id (from the cache when offline), a local pair folder, or a bundled pair;
        or a plain causal LM (a folder or id whose config is not model_type "swiftspec"), which then
        speculates draft-free.

        The pair's config.json names the target and draft (Hub ids pinned by target_revision /
        draft_revision, or folders relative to the pair). `revision` and `subfolder` select the pair
        repo; cache_dir, token, local_files_only and force_download apply to the pair and both
        members; SwiftSpecConfig fields (tree_budget=..., draft_revision=...) override the pair's,
        and a near miss of one (tree_budgt=...) raises TypeError; everything else (dtype,
        device_map, attn_implementation, trust_remote_code, ...) goes to both members'
        from_pretrained. Without a dtype, members that run on the CPU load in float32 (else as
        stored). Members load as safetensors only, and run remote code only with
        trust_remote_code=True. Compatibility is checked before any weights load.
        """
        if model_args:
            raise TypeError(f"SwiftSpecForCausalLM.from_pretrained takes no positional model arguments, got {model_args!r}.")
        load = split_load_kwargs(kwargs)
        folder = resolve_pair_folder(pretrained_model_name_or_path, load.revision, load.hub, load.subfolder)
        data = read_pair_config(folder)
        # A model's own config (not a pair's, nor a broken pair's, whose errors below name the field)
        if data.get("model_type") not in (None, SwiftSpecConfig.model_type) and not {"target", "draft"} & data.keys():
            return cls.from_plain_model(folder, os.fspath(pretrained_model_name_or_path), load)
        pair = resolve_pair(
            pretrained_model_name_or_path,
            load.revision,
            load.hub,
            load.overrides,
            load.member_kwargs["trust_remote_code"],
            load.subfolder,
        )
        kwargs = with_cpu_dtype(load.member_kwargs, pair.config.placement)
        models = {
            role: load_member_model(member, load.hub, kwargs)
            for role, member in pair.members.items() if not (role == "draft" and member_head_config(member, load.hub))
        }
        if "draft" not in models:  # an EAGLE-3 head: beside the target, in its dtype
            target = models["target"]
            models["draft"] = load_eagle3_head(member_folder(pair.members["draft"], load.hub), target.device, target.dtype)
        generation_file = pair.folder / "generation_config.json"
        if generation_file.is_file():  # the pair's generation defaults replace the target's, on both paths
            models["target"].generation_config = GenerationConfig.from_pretrained(pair.folder)
        model = cls(
            pair.config, models["target"], models["draft"], pair.tokenizer, pair.member_tokenizers["draft"]
        )
        model.config.name_or_path = os.fspath(pretrained_model_name_or_path)
        model.pair_folder = pair.folder
        return model

    @classmethod
    def from_plain_model(cls, folder: Path, name: str, load: LoadArguments) -> "SwiftSpecForCausalLM":
        """A plain causal-LM folder as the target of a draft-free model, with its own tokenizer."""
        kwargs = with_cpu_dtype(load.member_kwargs, load.overrides.get("placement"))
        target = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = load_tokenizer(str(folder), None, HubOptions(), load.member_kwargs["trust_remote_code"])
        config = SwiftSpecConfig(target=name, target_revision=load.revision, **load.overrides)
        model = cls(config, target, None, tokenizer)
        model.config.name_or_path = name
        return model

    def save_pretrained(
        self,
        save_directory,
        card: PairCard | None = None,
        save_members: bool = False,
        pin_revisions: bool = True,
        load_id: str | None = None,
        **kwargs,
    ) -> None:
        """Write a pair repo: config.json, generation config, tokenizer, README.md model card.

        No weights unless save_members=True, which writes both models under target/ and draft/ and
        points the config at them. pin_revisions fills a missing target/draft revision of a Hub
        member with the commit its default branch points to now. `card` adds the title, licence and
        sections (measured acceptance, placement) to the generated card; load_id is the repo id the
        card's usage example loads (default: the folder). Local members keep absolute entries absolute; one
        inside the written folder, or a sibling the pair named relatively, is named relative to it; any other
        by its absolute path (pair.locate.relocated_entry), so a moved copy still loads. Other kwargs are
        accepted for PreTrainedModel compatibility and ignored.
        """
        folder = Path(save_directory)
        config = SwiftSpecConfig.from_dict(self.config.to_dict())
        if self.draft is None:
            raise PairConfigError(
                "This model has no draft (draft-free mode), so there is no pair repo to write: save model.target "
                "itself, and load it with SwiftSpecForCausalLM.from_pretrained(folder) to speculate draft-free again."
            )
        for role in ("target", "draft"):
            if save_members:
                getattr(self, role).save_pretrained(folder / role)
                setattr(config, role, role)
                setattr(config, f"{role}_revision", None)
            elif not getattr(config, role):
                raise PairConfigError(
                    f"Cannot save the pair: config.{role} is not set (the {role} was built in memory). Set "
                    f"model.config.{role} to its Hub id, or pass save_members=True to store its weights in the pair."
                )
        # members written here (save_members) are found from here, not from the folder the pair came from
        config = relocated(config, folder if save_members else (self.pair_folder or folder), folder)
        if pin_revisions:
            config = pinned(config, folder)
        write_pair_repo(folder, config, card, self.tokenizer, self.generation_config, load_id,
                        draft_tokenizer=self.draft_tokenizer)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        card: PairCard | None = None,
        save_members: bool = False,
        commit_message: str = "Upload SwiftSpec pair",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
    ):
        """Publish the pair repo (as save_pretrained writes it) to the Hub; returns the commit info.

        Members must be Hub repos, or travel inside the pair with save_members=True: a pair naming
        a folder on this machine would load nowhere else.
        """
        if not save_members:
            for member in pair_members(self.config, self.pair_folder).values():
                if member.is_local:
                    raise PairConfigError(
                        f"The {member.role} is the local folder {member.location!r}, which does not exist on the Hub. "
                        f"Push it first and set model.config.{member.role} to its repo id, or pass save_members=True."
                    )
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, card=card, save_members=save_members, load_id=repo_id)
            return api.upload_folder(
                repo_id=repo_id, folder_path=tmp, commit_message=commit_message, revision=revision, create_pr=create_pr
            )

    def forward(self, *args, **kwargs):
        """The target's forward."""
        return self.target(*args, **kwargs)

    def get_input_embeddings(self):
        return self.target.get_input_embeddings()

    def init_continuous_batching(self, *args, **kwargs):
        """Not with speculation: transformers' manager would decode the target alone on its paged cache."""
        raise NotImplementedError(
            "SwiftSpecForCausalLM does not speculate under continuous batching (init_continuous_batching, "
            "generate_batch, transformers serve --continuous-batching). Speculate on a batch with "
            "model.generate(left-padded input_ids, attention_mask=...), or batch the target alone with "
            "model.target.generate_batch(...)."
        )

    def continuous_batching_context_manager(self, *args, **kwargs):
        self.init_continuous_batching()

    def generate_batch(self, *args, **kwargs):
        self.init_continuous_batching()

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
        check_inputs(inputs, kwargs, generation_config, self.generation_config)
        tokenizer = kwargs.pop("tokenizer", None)
        corpus = corpus_tokens(kwargs.pop("ngram_corpus", None), tokenizer or self.tokenizer)
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
                swiftspec_corpus=corpus,
                swiftspec_policy=self.policy(),
                swiftspec_history=self.output_history,
                swiftspec_captures=self.captures,
                swiftspec_vocabularies=self.vocabularies,
                **kwargs,
            )
        finally:
            if streamer is not None:  # a consumer iterating a TextIteratorStreamer must never hang
                streamer.end()
        return output
