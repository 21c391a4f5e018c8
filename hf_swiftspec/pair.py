"""Pair repos: find one, check that its two models can speculate together, and write one.

A pair repo is a model repo with no weights of its own. Its config.json (model_type "swiftspec")
names the target and the draft, each a Hub id with a pinned revision or a folder relative to the
pair; beside it sit the tokenizer, a generation config and a README.md model card. Everything here
works on configs and tokenizers, before any weights load, so a bad pair fails in seconds with an
error that names the field to fix, and `swiftspec pair check` can vet a 70B pair on a laptop.
"""

from __future__ import annotations

import json
import logging
import os
import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from huggingface_hub import HfApi, snapshot_download, try_to_load_from_cache
from huggingface_hub.constants import HF_HUB_CACHE
from huggingface_hub.errors import HFValidationError
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig

from .architectures import UnsupportedArchitecture, check_config
from .config import SwiftSpecConfig

logger = logging.getLogger(__name__)

ROLES = ("target", "draft")
DEMO_PAIR_NAME = "swiftspec-demo-pystdlib"
LIBRARY_NAME = "hf_swiftspec"
BASE_TAGS = ("swiftspec", "speculative-decoding")
# Members load as safetensors only, so a pair snapshot never needs another weight format.
FOREIGN_WEIGHTS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


class PairConfigError(ValueError):
    """A pair that cannot be used as given; the message names the field and how to fix it."""


# ---------------------------------------------------------------- where a pair is


@dataclass(frozen=True)
class HubOptions:
    """The Hub arguments of every from_pretrained; they apply to the pair repo and to both members."""

    cache_dir: str | os.PathLike | None = None
    token: str | bool | None = None
    local_files_only: bool = False
    force_download: bool = False

    @classmethod
    def pop_from(cls, kwargs: dict) -> "HubOptions":
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls) if f.name in kwargs})

    def as_kwargs(self) -> dict:
        """Only what was set, so transformers' own defaults (and HF_HUB_OFFLINE) still apply."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


def bundled_pairs_dir() -> Path | None:
    """model_cards/: shipped inside the package as package data, or beside it in a source checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "model_cards", package.parent / "model_cards"):
        if candidate.is_dir():
            return candidate
    return None


def bundled_pair(name: str) -> Path | None:
    """The folder of a pair that ships with hf_swiftspec (e.g. the demo pair), or None."""
    root = bundled_pairs_dir()
    if root is None or not HUB_ID.match(name) or "/" in name:
        return None
    folder = root / name
    return folder if (folder / "config.json").is_file() else None


def looks_like_path(name: str) -> bool:
    """True for strings only a filesystem path can be (./x, ../x, /x, ~/x, a/b/c, C:\\x)."""
    return not HUB_ID.match(name) or name.startswith((".", "~"))


def resolve_pair_folder(name_or_path, revision: str | None = None, hub: HubOptions = HubOptions(), subfolder: str = "") -> Path:
    """A local pair folder as is, or the snapshot of a Hub pair repo (from the cache when offline)."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return Path(name, subfolder)
    if looks_like_path(name):
        raise PairConfigError(f"No pair folder at {name!r}: the path does not exist.")
    try:
        snapshot = snapshot_download(
            repo_id=name,
            revision=revision,
            cache_dir=hub.cache_dir,
            token=hub.token,
            local_files_only=hub.local_files_only,
            force_download=hub.force_download,
            ignore_patterns=FOREIGN_WEIGHTS,
        )
    except HFValidationError as err:
        raise PairConfigError(f"{name!r} is neither a local folder nor a valid Hub repo id ({err}).") from err
    except (OSError, ValueError) as err:
        at = f" at revision {revision!r}" if revision else ""
        raise PairConfigError(
            f"Cannot find the pair repo {name!r}{at}: it is not a local folder, and {first_line(err)}. Check the id; "
            f"offline (HF_HUB_OFFLINE=1 or local_files_only=True) it must already be in the Hugging Face cache "
            f"({hub.cache_dir or HF_HUB_CACHE})."
        ) from err
    return Path(snapshot, subfolder)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0].rstrip(".") if text else type(err).__name__


# ---------------------------------------------------------------- the pair's config.json


def pair_settings() -> dict[str, object]:
    """SwiftSpecConfig's own fields and their types, read from its signature so they never drift."""
    hints = typing.get_type_hints(SwiftSpecConfig.__init__)
    return {name: hint for name, hint in hints.items() if name != "return"}


def pop_pair_settings(kwargs: dict) -> dict:
    """Take the SwiftSpecConfig fields (tree_budget=..., draft=...) out of from_pretrained's kwargs."""
    return {name: kwargs.pop(name) for name in pair_settings() if name in kwargs}


def read_pair_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise PairConfigError(f"{folder} has no config.json, so it is not a pair repo (nor a model repo).")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PairConfigError(f"{path} is not valid JSON: {err}.") from err


def check_field_types(values: dict, source: str) -> None:
    """Raise PairConfigError naming the first SwiftSpecConfig field whose value has the wrong type."""
    for name, hint in pair_settings().items():
        if name not in values:
            continue
        value = values[name]
        allowed = typing.get_args(hint) or (hint,)
        if float in allowed:
            allowed += (int,)  # JSON writes 60.0 as 60
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise PairConfigError(f"{source}: field {name!r} must be {names}, got {type(value).__name__} {value!r}.")


def validate_pair_dict(data: dict, source: str) -> None:
    """The checks a pair config.json must pass before anything is loaded; errors name the field."""
    model_type = data.get("model_type")
    if model_type is None:
        raise PairConfigError(f"{source}: field 'model_type' is missing; a pair repo's config.json has model_type 'swiftspec'.")
    if model_type != SwiftSpecConfig.model_type:
        raise PairConfigError(
            f"{source}: model_type={model_type!r}, so this is a model repo, not a pair repo (model_type 'swiftspec'). "
            "Load it with AutoModelForCausalLM, or make a pair: swiftspec pair create --target ... --draft ... DIR."
        )
    for role in ROLES:
        if not data.get(role):
            raise PairConfigError(
                f"{source}: field {role!r} is missing; name the {role} model by Hub id or by a folder relative to the pair."
            )
    check_field_types(data, source)


def load_pair_config(folder: Path, source: str, overrides: dict | None = None) -> SwiftSpecConfig:
    """The validated SwiftSpecConfig of a pair folder, with `overrides` (from_pretrained kwargs) applied."""
    data = read_pair_config(folder)
    overrides = overrides or {}
    check_field_types(overrides, "from_pretrained arguments")
    validate_pair_dict({**data, **overrides}, source)
    try:
        return SwiftSpecConfig.from_dict({**data, **overrides})
    except ValueError as err:
        raise PairConfigError(f"{source}: {err}") from err


# ---------------------------------------------------------------- its two members


@dataclass(frozen=True)
class PairMember:
    """Where one of the two models lives. location: a local folder, or a Hub repo id; entry: what
    the pair config says (errors quote it, since that is what the user can edit)."""

    role: str
    location: str
    revision: str | None
    is_local: bool
    entry: str


def pair_members(config: SwiftSpecConfig, folder: Path | None = None) -> dict[str, PairMember]:
    """target / draft entries resolved: relative to the pair folder first, then as paths or Hub ids."""
    members = {}
    for role in ROLES:
        entry = getattr(config, role)
        revision = getattr(config, f"{role}_revision")
        inside = folder / entry if folder is not None and not os.path.isabs(entry) else None
        if inside is not None and inside.is_dir():
            members[role] = PairMember(role, str(inside), revision, True, entry)
        else:
            members[role] = PairMember(role, entry, revision, os.path.isdir(entry) or looks_like_path(entry), entry)
    return members


def relocated(config: SwiftSpecConfig, source: Path, destination: Path) -> SwiftSpecConfig:
    """A copy of `config` for a pair written to `destination`: local members (found relative to
    `source`) are named relative to the new folder, so the written pair still finds them."""
    config = SwiftSpecConfig.from_dict(config.to_dict())
    for role, member in pair_members(config, source).items():
        if member.is_local and os.path.isdir(member.location):
            setattr(config, role, os.path.relpath(os.path.abspath(member.location), os.path.abspath(destination)))
    return config


def repo_in_cache(repo_id: str, hub: HubOptions) -> bool:
    return (Path(hub.cache_dir or HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def unreachable_member(member: PairMember, hub: HubOptions, err: BaseException) -> PairConfigError:
    """An error that blames the revision when the repo is cached but that revision is not, else the entry."""
    reason = first_line(err)
    if member.revision and not member.is_local and repo_in_cache(member.location, hub):
        return PairConfigError(
            f"Cannot load the {member.role} {member.location!r} at field '{member.role}_revision'={member.revision!r}: "
            f"{reason}. The repo is in the Hugging Face cache but not at that revision; download it once online, fix "
            f"'{member.role}_revision', or set it to null for the default branch."
        )
    if not member.is_local:
        hint = (
            "it must be a folder relative to the pair, a local folder, or a Hub model id (offline: one in the Hugging "
            f"Face cache, {hub.cache_dir or HF_HUB_CACHE})"
        )
    elif os.path.isdir(member.location):
        hint = f"the folder {member.location} holds no model transformers can load"
    else:
        hint = f"the folder {member.location} does not exist"
    return PairConfigError(f"Cannot load the {member.role} from field {member.role!r}={member.entry!r}: {reason}; {hint}.")


def load_member_config(member: PairMember, hub: HubOptions, trust_remote_code: bool = False) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(
            member.location, revision=member.revision, trust_remote_code=trust_remote_code, **hub.as_kwargs()
        )
    except (OSError, ValueError, KeyError) as err:
        raise unreachable_member(member, hub, err) from err


def load_tokenizer(location: str, revision: str | None, hub: HubOptions, trust_remote_code: bool = False):
    """The tokenizer of a folder or repo, or None when it ships none (its vocabulary is then checked by size)."""
    if os.path.isdir(location) and not any(Path(location, f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(
            location, revision=revision, trust_remote_code=trust_remote_code, **hub.as_kwargs()
        )
    except (OSError, ValueError) as err:
        logger.warning("No tokenizer loaded from %s (%s); vocabularies are compared by size only.", location, first_line(err))
        return None


# ---------------------------------------------------------------- compatibility


def check_architecture(config: PreTrainedConfig, role: str) -> None:
    """Refuse an architecture whose tree steps could not be exact, by capability (architectures.py)."""
    try:
        check_config(config, role)
    except UnsupportedArchitecture as error:
        raise PairConfigError(str(error)) from error


def context_length(config: PreTrainedConfig) -> int | None:
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def check_context_lengths(target: PreTrainedConfig, draft: PreTrainedConfig) -> None:
    """The draft must follow the target as far as the target can go, or speculation dies past its window."""
    t_len, d_len = context_length(target), context_length(draft)
    if t_len is not None and d_len is not None and d_len < t_len:
        raise PairConfigError(
            f"Context length mismatch: the draft's max_position_embeddings={d_len} is shorter than the target's "
            f"{t_len}, so the draft could not follow generations past {d_len} tokens. Pick a draft with at least the "
            "target's context length."
        )


def vocab_size(config: PreTrainedConfig) -> int:
    return config.get_text_config().vocab_size


def special_tokens(tokenizer) -> dict[str, int]:
    """bos/eos/pad/unk and additional special tokens: token -> id."""
    return dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))


def check_special_tokens(target_tokenizer, draft_tokenizer) -> None:
    """Every special token either side uses must have the same id on both sides (roles may differ:
    an instruct target may stop on a token a base draft never emits, and that is fine)."""
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    clashes = sorted(
        {
            (token, t_vocab[token], d_vocab[token])
            for tokenizer in (target_tokenizer, draft_tokenizer)
            for token in special_tokens(tokenizer)
            if token in t_vocab and token in d_vocab and t_vocab[token] != d_vocab[token]
        }
    )
    if clashes:
        listed = "; ".join(f"{tok!r} is id {t} in the target, {d} in the draft" for tok, t, d in clashes[:5])
        raise PairConfigError(
            f"The target and draft tokenizers disagree on special tokens: {listed}. The draft must share the target's "
            "special tokens (same token, same id): pick a draft from the target's model family."
        )


def mapping_differences(target_tokenizer, draft_tokenizer, limit: int) -> list[int]:
    """Draft token ids below `limit` that the target's tokenizer maps to another token (sorted)."""
    t_vocab = target_tokenizer.get_vocab()
    return sorted(i for token, i in draft_tokenizer.get_vocab().items() if i < limit and t_vocab.get(token) != i)


def describe_ids(ids: list[int], target_tokenizer, draft_tokenizer, shown: int = 5) -> str:
    t_tokens = target_tokenizer.convert_ids_to_tokens(ids[:shown])
    d_tokens = draft_tokenizer.convert_ids_to_tokens(ids[:shown])
    listed = ", ".join(f"id {i}: draft {d!r} / target {t!r}" for i, d, t in zip(ids, d_tokens, t_tokens))
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return listed + more


def check_token_mapping(target_tokenizer, draft_tokenizer, target_vocab_size: int) -> None:
    """The draft's token -> id mapping must equal the target's over the ids the target can embed.

    Differences among added tokens that neither side uses as a special token (renamed reserved
    tokens, say) only warn: verification is lossless whatever the draft proposes, they merely
    lower acceptance where those ids occur. Any other difference is an error listing the ids.
    """
    differ = mapping_differences(target_tokenizer, draft_tokenizer, target_vocab_size)
    if not differ:
        return
    special = set(target_tokenizer.all_special_ids) | set(draft_tokenizer.all_special_ids)
    added = set(target_tokenizer.added_tokens_decoder) | set(draft_tokenizer.added_tokens_decoder)
    hard = [i for i in differ if i in special or i not in added]
    if hard:
        raise PairConfigError(
            f"The draft's vocabulary does not map onto the target's: {len(hard)} token ids differ "
            f"({describe_ids(hard, target_tokenizer, draft_tokenizer)}). The draft must use the target's tokenizer "
            "(the same token -> id mapping; extra padding rows in either embedding are fine)."
        )
    logger.warning(
        "The draft and target name %d added tokens differently (%s); lossless anyway, but drafts of those ids will be rejected.",
        len(differ),
        describe_ids(differ, target_tokenizer, draft_tokenizer),
    )


def check_tokenizer_fits(tokenizer, config: PreTrainedConfig, role: str) -> None:
    """Every id the tokenizer can produce needs a row in the model's embedding."""
    if len(tokenizer) > vocab_size(config):
        raise PairConfigError(
            f"The {role}'s vocab_size={vocab_size(config)} is smaller than its tokenizer ({len(tokenizer)} tokens): "
            "prompt ids past the embedding would fail. The tokenizer does not belong to this model."
        )


def check_vocabularies(target: PreTrainedConfig, draft: PreTrainedConfig, target_tokenizer=None, draft_tokenizer=None) -> None:
    """The draft's token ids must mean the target's.

    With tokenizers: the same token -> id mapping over the draft's vocabulary and the same special
    tokens; the embeddings may differ in size (padding rows, e.g. Qwen2.5 0.5B 151936 vs 72B 152064).
    Without any tokenizer the sizes must be equal, the only evidence there is. A missing tokenizer
    on one side means that side uses the other's.
    """
    t_size, d_size = vocab_size(target), vocab_size(draft)
    if target_tokenizer is None and draft_tokenizer is None:
        if t_size != d_size:
            raise PairConfigError(
                f"Vocabulary mismatch: target vocab_size={t_size}, draft vocab_size={d_size}. The draft must share the "
                "target's tokenizer; pick a draft from the target's model family. If they do share one and only the "
                "padding differs, pass tokenizer= so the token -> id mapping can be checked instead of the sizes."
            )
        return
    target_tokenizer = target_tokenizer or draft_tokenizer
    draft_tokenizer = draft_tokenizer or target_tokenizer
    if draft_tokenizer is not target_tokenizer:
        check_special_tokens(target_tokenizer, draft_tokenizer)
        check_token_mapping(target_tokenizer, draft_tokenizer, t_size)
    check_tokenizer_fits(target_tokenizer, target, "target")
    check_tokenizer_fits(draft_tokenizer, draft, "draft")


def check_compatibility(target: PreTrainedConfig, draft: PreTrainedConfig, target_tokenizer=None, draft_tokenizer=None) -> None:
    """All load-time checks on the two configs (and tokenizers, when known); no weights needed."""
    check_architecture(target, "target")
    check_architecture(draft, "draft")
    check_context_lengths(target, draft)
    check_vocabularies(target, draft, target_tokenizer, draft_tokenizer)


# ---------------------------------------------------------------- resolving a whole pair


@dataclass
class ResolvedPair:
    """A pair repo read and checked, weights not loaded yet.

    tokenizer: the one prompts are encoded with: the pair repo's own, else the target's.
    """

    folder: Path
    config: SwiftSpecConfig
    members: dict[str, PairMember]
    member_configs: dict[str, PreTrainedConfig]
    member_tokenizers: dict[str, object | None]
    tokenizer: object | None


def resolve_pair(
    name_or_path,
    revision: str | None = None,
    hub: HubOptions = HubOptions(),
    overrides: dict | None = None,
    trust_remote_code: bool = False,
    subfolder: str = "",
) -> ResolvedPair:
    """Find the pair, read its config, read both members' configs and tokenizers, check they fit."""
    folder = resolve_pair_folder(name_or_path, revision, hub, subfolder)
    config = load_pair_config(folder, f"pair config {os.fspath(name_or_path)!r}", overrides)
    members = pair_members(config, folder)
    configs = {role: load_member_config(m, hub, trust_remote_code) for role, m in members.items()}
    tokenizers = {role: load_tokenizer(m.location, m.revision, hub, trust_remote_code) for role, m in members.items()}
    own = load_tokenizer(str(folder), None, HubOptions(), trust_remote_code)
    check_compatibility(configs["target"], configs["draft"], tokenizers["target"] or own, tokenizers["draft"])
    if own is not None and tokenizers["target"] is not None:
        check_token_mapping(tokenizers["target"], own, vocab_size(configs["target"]))  # prompts go to the target
    return ResolvedPair(folder, config, members, configs, tokenizers, own or tokenizers["target"])


def current_commit(repo_id: str, hub: HubOptions = HubOptions()) -> str | None:
    """The commit a Hub repo's default branch points to: from the cache, else from the Hub; None if unknown."""
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub.cache_dir)
    if isinstance(cached, str):
        return Path(cached).parent.name
    if hub.local_files_only:
        return None
    try:
        return HfApi(token=hub.token).model_info(repo_id).sha
    except (OSError, ValueError):
        return None


def pinned(config: SwiftSpecConfig, folder: Path | None, hub: HubOptions = HubOptions()) -> SwiftSpecConfig:
    """A copy of `config` whose Hub members without a revision are pinned to their current commit."""
    config = SwiftSpecConfig.from_dict(config.to_dict())
    for role, member in pair_members(config, folder).items():
        if not member.is_local and member.revision is None:
            commit = current_commit(member.location, hub)
            if commit is None:
                logger.warning("Could not pin %s %r to a commit (offline and not cached); revision left unset.", role, member.location)
            setattr(config, f"{role}_revision", commit)
    return config


# ---------------------------------------------------------------- model cards


@dataclass(frozen=True)
class PairCard:
    """What a pair's model card says beyond what its config already knows.

    sections: (heading, markdown) pairs in order, after the generated "How to use" and "Settings".
    license: a Hub licence id; "other" with license_name / license_link for custom licences.
    """

    title: str
    summary: str = ""
    license: str = "unknown"
    license_name: str | None = None
    license_link: str | None = None
    tags: tuple[str, ...] = ()
    sections: tuple[tuple[str, str], ...] = ()


def hub_members(config: SwiftSpecConfig, folder: Path | None) -> list[str]:
    """The members that are Hub repos (base_model of the card); embedded or local ones are not."""
    return [m.location for m in pair_members(config, folder).values() if not m.is_local]


def card_metadata(config: SwiftSpecConfig, card: PairCard, folder: Path | None) -> dict:
    meta = {"library_name": LIBRARY_NAME, "pipeline_tag": "text-generation", "license": card.license}
    if card.license_name:
        meta["license_name"] = card.license_name
    if card.license_link:
        meta["license_link"] = card.license_link
    base = hub_members(config, folder)
    if base:
        meta["base_model"] = base
    meta["tags"] = list(dict.fromkeys(BASE_TAGS + tuple(card.tags)))
    return meta


def usage_section(load_id: str) -> str:
    return (
        "```python\n"
        "from hf_swiftspec import SwiftSpecForCausalLM\n"
        "from transformers import AutoTokenizer\n\n"
        f'model = SwiftSpecForCausalLM.from_pretrained("{load_id}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{load_id}")\n'
        'ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids\n'
        "out = model.generate(ids, max_new_tokens=128, do_sample=False)  # exactly the target's own output\n"
        "print(model.swiftspec_stats.summary())\n"
        "```\n\n"
        f"or from the command line: `swiftspec generate --pair {load_id} \"def fibonacci(n):\"`. Check the pair without "
        f"loading weights: `swiftspec pair check {load_id}`."
    )


def settings_section(config: SwiftSpecConfig, folder: Path | None) -> str:
    rows = []
    for role, member in pair_members(config, folder).items():
        entry = getattr(config, role)
        if not member.is_local:
            where, revision = "Hub repo", f"`{member.revision}`" if member.revision else "not pinned (default branch)"
        else:
            inside = not os.path.isabs(entry) and ".." not in Path(entry).parts
            where, revision = ("folder in this repo" if inside else "local folder"), "-"
        rows.append(f"| {role} | `{entry}` ({where}) | {revision} |")
    settings = ", ".join(f"`{name}={getattr(config, name)!r}`" for name in ("tree_budget", "draft_width", "draft_depth", "tree_capacity"))
    return "| role | model | revision |\n|---|---|---|\n" + "\n".join(rows) + f"\n\nTree settings: {settings}."


def render_card(config: SwiftSpecConfig, card: PairCard, load_id: str, folder: Path | None = None) -> str:
    """README.md text: YAML metadata header, then the card body."""
    header = yaml.safe_dump(card_metadata(config, card, folder), sort_keys=False, allow_unicode=True)
    parts = [f"---\n{header}---", f"# {card.title}", card.summary]
    sections = (("How to use", usage_section(load_id)), ("Pair", settings_section(config, folder))) + card.sections
    parts += [f"## {heading}\n\n{body}" for heading, body in sections]
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def default_card(config: SwiftSpecConfig) -> PairCard:
    return PairCard(
        title=f"SwiftSpec pair: {config.target} + {config.draft}",
        summary=(
            f"Lossless tree speculative decoding for `{config.target}`, drafted by `{config.draft}`, with "
            "hf_swiftspec. Outputs are exactly the target's own (greedy) or drawn from exactly "
            "its distribution (sampling); the draft only makes them come faster. This repo holds no weights."
        ),
    )


def read_card_metadata(folder: Path) -> dict:
    """The YAML header of folder/README.md, parsed."""
    path = folder / "README.md"
    if not path.is_file():
        raise PairConfigError(f"{folder} has no README.md model card; write one with save_pretrained or swiftspec pair create.")
    text = path.read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    if match is None:
        raise PairConfigError(f"{path} does not start with a YAML metadata block between '---' lines.")
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        raise PairConfigError(f"{path}: the YAML metadata does not parse: {err}") from err
    if not isinstance(meta, dict):
        raise PairConfigError(f"{path}: the YAML metadata must be a mapping, got {type(meta).__name__}.")
    return meta


def validate_card(folder: Path, config: SwiftSpecConfig) -> dict:
    """The model card's metadata must say what a pair repo is and list both Hub members as base_model."""
    meta = read_card_metadata(folder)
    source = folder / "README.md"
    expected = {"library_name": LIBRARY_NAME, "pipeline_tag": "text-generation"}
    for key, value in expected.items():
        if meta.get(key) != value:
            raise PairConfigError(f"{source}: metadata {key!r} must be {value!r}, got {meta.get(key)!r}.")
    if not meta.get("license"):
        raise PairConfigError(f"{source}: metadata 'license' is missing; give the Hub licence id (or 'other' with license_name).")
    if meta["license"] == "other" and not meta.get("license_name"):
        raise PairConfigError(f"{source}: license 'other' needs 'license_name' (and preferably 'license_link').")
    base = hub_members(config, folder)
    if sorted(meta.get("base_model") or []) != sorted(base):
        raise PairConfigError(f"{source}: metadata 'base_model' must list the Hub members {base}, got {meta.get('base_model')!r}.")
    if "swiftspec" not in (meta.get("tags") or []):
        raise PairConfigError(f"{source}: metadata 'tags' must include 'swiftspec', got {meta.get('tags')!r}.")
    return meta


def check_pair_files(folder: Path) -> SwiftSpecConfig:
    """Offline validation of a pair folder's own files (config.json and README.md), members untouched."""
    config = load_pair_config(folder, f"pair config {str(folder)!r}")
    for role in ROLES:
        revision = getattr(config, f"{role}_revision")
        if revision is not None and not COMMIT_SHA.match(revision):
            logger.warning("%s: %s_revision=%r is not a commit sha, so it can move; pin a 40-hex commit.", folder, role, revision)
    validate_card(folder, config)
    return config


def write_pair_repo(folder, config: SwiftSpecConfig, card: PairCard | None = None, tokenizer=None, generation_config=None, load_id: str | None = None) -> Path:
    """Write a pair repo: config.json, README.md, and the tokenizer / generation config when given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    text = render_card(config, card or default_card(config), load_id or str(folder), folder)
    (folder / "README.md").write_text(text)
    return folder
