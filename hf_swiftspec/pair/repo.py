"""Pair repos on disk: the pair's config.json, reading and checking a whole pair, writing one.

A pair repo is a model repo with no weights of its own. Its config.json (model_type "swiftspec")
names the target and the draft, each a Hub id with a pinned revision or a folder relative to the
pair; beside it sit the tokenizer, a generation config and a README.md model card. A draft with a
tokenizer of its own (not the target's) has it in the pair's `draft_tokenizer/` folder. Everything here
works on configs and tokenizers, before any weights load, so a bad pair fails in seconds with an
error that names the field to fix, and `swiftspec pair check` can vet a 70B pair on a laptop.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import typing
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import GenerationConfig, PreTrainedConfig

from ..config import SwiftSpecConfig
from ..drafters.eagle3 import check_fits
from .cards import PairCard, default_card, render_card, validate_card
from .checks import check_compatibility, check_token_mapping, vocab_size
from .errors import PairConfigError
from .locate import (
    COMMIT_SHA,
    ROLES,
    HubOptions,
    PairMember,
    check_member_weights,
    load_member_config,
    member_head_config,
    pair_members,
    pinned,
    resolve_pair_folder,
)
from .tokenizer import check_written_tokenizer, load_tokenizers, save_tokenizer

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- a whole pair, read and checked


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
    return read_members(folder, config, hub, trust_remote_code)


def read_members(folder: Path, config: SwiftSpecConfig, hub: HubOptions, trust_remote_code: bool = False, own_tokenizer: bool = True) -> ResolvedPair:
    """Both members' configs and tokenizers (relative entries found from `folder`), checked to fit.

    own_tokenizer: whether the tokenizer in `folder` (if any) is the pair's; else the target's is.
    """
    members = pair_members(config, folder)
    head = member_head_config(members["draft"], hub)  # an EAGLE-3 head: no tokenizer; bind() checks it fits
    configs = {
        role: head.llama_config() if role == "draft" and head is not None else load_member_config(m, hub, trust_remote_code)
        for role, m in members.items()
    }
    for role, m in members.items():
        if not (role == "draft" and head):  # (a head's own loader refuses pickle files, naming them)
            check_member_weights(m)
    sources = {role: (m.location, m.revision, hub) for role, m in members.items() if not (role == "draft" and head)}
    if own_tokenizer:
        sources["pair"] = (str(folder), None, HubOptions())
        if (folder / DRAFT_TOKENIZER).is_dir():  # the draft's own tokenizer, as the pair was written with it
            sources["draft"] = (str(folder / DRAFT_TOKENIZER), None, HubOptions())
    loaded = load_tokenizers(sources, trust_remote_code)
    tokenizers, own = {role: loaded.get(role) for role in members}, loaded.get("pair")
    if head is None:
        check_compatibility(configs["target"], configs["draft"], tokenizers["target"] or own, tokenizers["draft"])
    else:
        try:
            check_fits(head, configs["target"].get_text_config(decoder=True), f"The draft {members['draft'].entry!r}")
        except ValueError as error:
            raise PairConfigError(str(error)) from error
    if own is not None and tokenizers["target"] is not None and own is not tokenizers["target"]:
        check_token_mapping(tokenizers["target"], own, vocab_size(configs["target"]))  # prompts go to the target
    return ResolvedPair(folder, config, members, configs, tokenizers, own or tokenizers["target"])


# ---------------------------------------------------------------- the pair's own files
DRAFT_TOKENIZER = "draft_tokenizer"  # the pair's subfolder holding a draft's own tokenizer (not the target's)



def check_pair_files(folder: Path) -> SwiftSpecConfig:
    """Offline validation of a pair folder's own files (config.json and README.md), members untouched."""
    config = load_pair_config(folder, f"pair config {str(folder)!r}")
    for role in ROLES:
        revision = getattr(config, f"{role}_revision")
        if revision is not None and not COMMIT_SHA.match(revision):
            logger.warning("%s: %s_revision=%r is not a commit sha, so it can move; pin a 40-hex commit.", folder, role, revision)
    validate_card(folder, config)
    return config


def write_pair_repo(
    folder,
    config: SwiftSpecConfig,
    card: PairCard | None = None,
    tokenizer=None,
    generation_config=None,
    load_id: str | None = None,
    members_base: Path | None = None,
    draft_tokenizer=None,
) -> Path:
    """Write a pair repo: config.json, README.md, and the tokenizer / generation config when given.

    members_base: the folder relative member entries are found from, for the card (default: `folder`).
    draft_tokenizer: a draft's own tokenizer (not the target's), written to draft_tokenizer/.
    """
    folder = Path(folder)
    if members_base is None:  # save_pretrained: its members are found from where the pair is written
        refuse_member_folders(folder, {role: os.path.join(folder, getattr(config, role)) for role in ROLES})
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    if draft_tokenizer is not None:
        save_tokenizer(draft_tokenizer, folder / DRAFT_TOKENIZER)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    text = render_card(config, card or default_card(config), load_id or str(folder), members_base or folder)
    (folder / "README.md").write_text(text)
    return folder


# ---------------------------------------------------------------- creating a pair for two models


def member_description(entry: str, revision: str | None) -> str:
    """entry@revision, or the entry alone when nothing is pinned (local folders, unpinned Hub ids)."""
    return f"{entry}@{revision}" if revision else entry


def member_entry(value: str, folder: Path) -> str:
    """A local member folder is stored relative to the pair folder, so the two can move together."""
    return os.path.relpath(Path(value).resolve(), folder.resolve()) if Path(value).is_dir() else value


# Files a pair repo's tokenizer and generation config may be saved as. Replacing a previous pair
# removes those the new one does not write: a stale tokenizer.json beside a new tokenizer.model
# would be loaded instead of it.
PAIR_FILE_PATTERNS = (
    "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "*.model", "chat_template*",
)


def move_into_place(staging: Path, folder: Path) -> None:
    """Move a complete pair from `staging` to `folder`; into an existing folder (one that
    check_destination let through) file by file, so the members' folders inside it stay."""
    if not folder.exists():
        os.replace(staging, folder)
        return
    written = {item.name for item in staging.iterdir()}
    for old in folder.iterdir():
        if old.is_file() and old.name not in written and any(old.match(pattern) for pattern in PAIR_FILE_PATTERNS):
            old.unlink()  # the previous pair's, which --force replaces
        elif old.is_dir() and old.name == DRAFT_TOKENIZER:
            shutil.rmtree(old)  # the previous pair's draft tokenizer (the new one, if any, moves in below)
    for item in sorted(staging.iterdir()):
        os.replace(item, folder / item.name)


def is_pair_folder(folder: Path) -> bool:
    """Whether `folder` holds a pair repo: a config.json with model_type "swiftspec"."""
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == SwiftSpecConfig.model_type
    except (OSError, ValueError, AttributeError):
        return False


def refuse_member_folders(folder: Path, members: dict[str, str]) -> dict[str, Path]:
    """Refuse to write a pair into a member's own folder or a folder inside one (its config.json
    would replace the member's, which then no longer loads). Returns the local members' folders."""
    where = folder.resolve()
    resolved = {role: Path(value).resolve() for role, value in members.items()}  # "pair/sub/.." before sub exists
    local = {role: path for role, path in resolved.items() if path.is_dir()}
    for role, member in local.items():
        if where == member or member in where.parents:
            raise PairConfigError(
                f"Cannot write the pair repo to {folder}: it is {'' if where == member else 'inside '}the {role}'s own "
                f"folder ({member}), and the pair's config.json would replace the {role}'s. Write the pair to a "
                f"new folder, e.g. {member.parent / 'pair'}."
            )
    return local


def check_destination(folder: Path, members: dict[str, str], force: bool) -> None:
    """Refuse a destination that holds anything the user owns: a member's own folder (or a folder
    inside one, where config.json would replace the member's), or a non-empty folder. Folders of the
    members themselves may sit inside it (the demo pair's layout), and with force=True a previous
    pair repo may be replaced; nothing else is ever overwritten.

    members: role -> the member as given (a local folder or a Hub id).
    """
    where = folder.resolve()
    local = refuse_member_folders(folder, members)
    if not folder.is_dir():
        return
    keep = {where / member.relative_to(where).parts[0] for member in local.values() if where in member.parents}
    others = sorted(p.name for p in folder.iterdir() if p.resolve() not in keep)
    if not others:
        return
    if not is_pair_folder(folder):
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise PairConfigError(
            f"Cannot write the pair repo to {folder}: the folder is not empty ({listed}) and holds no pair repo. "
            "Pick a new or empty folder."
        )
    if not force:
        raise PairConfigError(
            f"Cannot write the pair repo to {folder}: it holds a pair repo already. Pass --force (force=True) to "
            "replace that pair's files, or pick a new folder."
        )


def target_generation_config(member: PairMember, config: PreTrainedConfig, hub: HubOptions) -> GenerationConfig:
    """The target's generation_config.json, or (older repos have none) the one transformers derives
    from its config.json, as from_pretrained gives the loaded model."""
    try:
        return GenerationConfig.from_pretrained(member.location, revision=member.revision, **hub.as_kwargs())
    except OSError:
        logger.info("%s has no generation_config.json; the pair gets the one derived from its config.json.", member.entry)
        return GenerationConfig.from_model_config(config)


def create_pair_repo(
    folder,
    target: str,
    draft: str,
    target_revision: str | None = None,
    draft_revision: str | None = None,
    hub: HubOptions = HubOptions(),
    title: str | None = None,
    license: str = "unknown",
    license_name: str | None = None,
    license_link: str | None = None,
    force: bool = False,
    **settings,
) -> ResolvedPair:
    """Write a checked pair repo for two models (Hub ids or folders) and return it as read back.

    Hub members without a revision are pinned to their current commit; folders are named relative
    to the pair. The pair gets the target's tokenizer, checked to reload as the same class and to
    encode the same ids, and the target's generation config; a draft with a tokenizer of its own gets it in
    draft_tokenizer/, checked alike. settings: SwiftSpecConfig fields.
    The destination must be new or empty (the members' own folders may sit inside it), or with
    force=True hold a previous pair repo; it is never a member's folder.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise PairConfigError(f"Cannot write a pair repo to {folder}: it exists and is not a folder.")
    check_destination(folder, {"target": target, "draft": draft}, force)
    if license == "other" and not license_name:
        raise PairConfigError(
            "license 'other' needs a licence name for the model card (--license-name NAME, preferably with "
            "--license-link URL); the Hub rejects a card that says 'other' without one."
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the destination and moved into place when complete: a failure leaves no half
    # pair behind, and relative member entries ("../target") mean the same from either folder.
    staging = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()  # not mkdtemp: its 0700 mode would stay with the published folder
    members_base = folder if folder.is_dir() else staging  # members may sit inside an existing pair folder
    try:
        config = SwiftSpecConfig(
            target=member_entry(target, folder),
            draft=member_entry(draft, folder),
            target_revision=target_revision,
            draft_revision=draft_revision,
            **settings,
        )
        config = pinned(config, members_base, hub)
        config.save_pretrained(staging)
        config = load_pair_config(staging, f"pair config {str(folder)!r}")  # read back, exactly as a user will
        pair = read_members(members_base, config, hub, own_tokenizer=False)
        member = pair.members["target"]
        generation_config = target_generation_config(member, pair.member_configs["target"], hub)
        card = replace(default_card(pair.config), license=license, license_name=license_name, license_link=license_link)
        if title:
            card = replace(card, title=title)
        draft_tokenizer = own_draft_tokenizer(pair)
        write_pair_repo(staging, pair.config, card, pair.tokenizer, generation_config, str(folder), members_base,
                        draft_tokenizer)
        if pair.tokenizer is not None:
            check_written_tokenizer(staging, pair.tokenizer)
        if draft_tokenizer is not None:
            check_written_tokenizer(staging / DRAFT_TOKENIZER, draft_tokenizer)
        move_into_place(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return replace(pair, folder=folder, members=pair_members(pair.config, folder))


def own_draft_tokenizer(pair: ResolvedPair):
    """The draft's tokenizer where it is not the target's (the pair writes it beside the target's), else None."""
    draft, target = pair.member_tokenizers.get("draft"), pair.tokenizer
    if draft is None or target is None or draft is target:
        return None
    configs = pair.member_configs
    return draft if check_compatibility(configs["target"], configs["draft"], target, draft, architectures=False) else None
