"""Where a pair and its two members are: local folder, bundled pair or Hub repo; pinning revisions.

A pair name is tried, in order, as a local folder (a path, or a folder of that name in the working
directory), as a pair bundled with hf_swiftspec (model_cards/, e.g. the demo pair), and as a Hub
repo id (from the cache when offline). Bundled names are hf_swiftspec's loaders' own: transformers'
Auto classes and pipeline() take the bundled folder (`bundled_pair(name)`), as they take any local
folder; nothing here changes how transformers or huggingface_hub resolve names for the rest of
the process. Members are named by the pair's config relative to the pair
folder first, then as local folders or Hub ids.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.constants import HF_HUB_CACHE
from huggingface_hub.errors import HFValidationError
from transformers import AutoConfig, PreTrainedConfig

from ..config import SwiftSpecConfig
from .errors import PairConfigError, first_line

logger = logging.getLogger(__name__)

ROLES = ("target", "draft")
DEMO_PAIR_NAME = "swiftspec-demo-pystdlib"
# Members load as safetensors only, so a pair snapshot never needs another weight format.
FOREIGN_WEIGHTS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"]
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")


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


# ---------------------------------------------------------------- the pair folder


def bundled_pairs_dir() -> Path | None:
    """model_cards/: shipped inside the package as package data, or beside it in a source checkout."""
    package = Path(__file__).resolve().parent.parent
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


def bundled_names() -> list[str]:
    """The names of the pairs that ship with hf_swiftspec."""
    root = bundled_pairs_dir()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root is not None else []


def misspelt_bundled_pair(name: str) -> PairConfigError | None:
    """The error for a name without an owner that is close to a bundled pair's (a typo, most likely), said before any
    Hub request (a pair repo on the Hub is named owner/name); None when no bundled name is close."""
    if "/" in name:
        return None
    names = bundled_names()
    close = [n for n in difflib.get_close_matches(name.lower(), [n.lower() for n in names], n=2, cutoff=0.75)]
    if not close:
        return None
    guesses = " or ".join(repr(next(n for n in names if n.lower() == c)) for c in close)
    return PairConfigError(
        f"{name!r} is neither a local folder nor a pair bundled with hf_swiftspec: did you mean {guesses}? "
        "(a pair repo on the Hub is named owner/name)"
    )


def looks_like_path(name: str) -> bool:
    """True for strings only a filesystem path can be (./x, ../x, /x, ~/x, a/b/c, C:\\x)."""
    return not HUB_ID.match(name) or name.startswith((".", "~"))


def resolve_pair_folder(name_or_path, revision: str | None = None, hub: HubOptions = HubOptions(), subfolder: str = "") -> Path:
    """A local pair folder as is, a bundled pair by name, or the snapshot of a Hub pair repo (from the cache when offline)."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return Path(name, subfolder)
    bundled = bundled_pair(name)
    if bundled is not None:
        return Path(bundled, subfolder)
    if looks_like_path(name):
        raise PairConfigError(f"No pair folder at {name!r}: the path does not exist.")
    misspelt = misspelt_bundled_pair(name)
    if misspelt is not None:
        raise misspelt
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
            f"Cannot find the pair repo {name!r}{at}: it is neither a local folder nor a bundled pair, and the Hub did not "
            f"give it ({first_line(err)}). Check the id; "
            f"offline (HF_HUB_OFFLINE=1 or local_files_only=True) it must already be in the Hugging Face cache "
            f"({hub.cache_dir or HF_HUB_CACHE})."
        ) from err
    return Path(snapshot, subfolder)


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
    pair_folder: Path | None = None  # where a relative entry was looked for first (errors say so)


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
            is_local = os.path.isdir(entry) or looks_like_path(entry)
            members[role] = PairMember(role, entry, revision, is_local, entry, folder if inside is not None else None)
    return members


def relocated(config: SwiftSpecConfig, source: Path, destination: Path) -> SwiftSpecConfig:
    """A copy of `config` for a pair written to `destination`, its local members (found from `source`) named
    so that the written pair still finds them (relocated_entry)."""
    config = SwiftSpecConfig.from_dict(config.to_dict())
    for role, member in pair_members(config, source).items():
        if member.is_local and os.path.isdir(member.location):
            setattr(config, role, relocated_entry(member, source, destination))
    return config


def relocated_entry(member: PairMember, source: Path, destination: Path) -> str:
    """How a pair written to `destination` names a local member: relative to it when the member's folder is inside
    it (the two travel together), or when the entry was relative and the member sat outside the old pair folder
    too (pair create's sibling layout, "../target"); else by its absolute path, so that the written pair loads
    wherever it is copied or moved as long as the member stays (an absolute entry stays absolute; a member inside
    the old pair folder travelled with that folder, not with this one)."""
    location, where = Path(member.location).resolve(), Path(destination).resolve()
    inside = where == location or where in location.parents
    sibling = not os.path.isabs(member.entry) and Path(source).resolve() not in location.parents
    return os.path.relpath(location, where) if inside or sibling else str(location)


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
    elif member.pair_folder is not None:
        hint = (f"no such folder relative to the pair folder ({os.path.abspath(member.pair_folder / member.entry)}) nor to "
                f"the working directory ({os.path.abspath(member.entry)}); a pair moved away from a member it names by a "
                f"relative path loses it: set field {member.role!r} to the member's absolute path or Hub id")
    else:
        hint = f"the folder {member.location} does not exist"
    return PairConfigError(f"Cannot load the {member.role} from field {member.role!r}={member.entry!r}: {reason}; {hint}.")


def member_folder(member: PairMember, hub: HubOptions) -> Path:
    """The member's files on this machine: its folder, or its Hub snapshot (safetensors only)."""
    if member.is_local:
        return Path(member.location)
    try:
        return Path(snapshot_download(
            repo_id=member.location, revision=member.revision, cache_dir=hub.cache_dir, token=hub.token,
            local_files_only=hub.local_files_only, force_download=hub.force_download, ignore_patterns=FOREIGN_WEIGHTS,
        ))
    except (OSError, ValueError) as err:
        raise unreachable_member(member, hub, err) from err


def member_head_config(member: PairMember, hub: HubOptions):
    """The member's Eagle3Config when it is an EAGLE-3 head (eagle3.py), else None."""
    from ..drafters.eagle3 import Eagle3Config, eagle3_format

    if member.is_local:
        path = Path(member.location) / "config.json"
    else:  # the config alone: the pair is checked before any weights load
        try:
            path = Path(hf_hub_download(
                member.location, "config.json", revision=member.revision, cache_dir=hub.cache_dir, token=hub.token,
                local_files_only=hub.local_files_only, force_download=hub.force_download,
            ))
        except (OSError, ValueError):  # unreachable: load_member_config says why, naming the entry
            return None
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Eagle3Config.from_dict(data) if eagle3_format(data) else None


def load_member_config(member: PairMember, hub: HubOptions, trust_remote_code: bool = False) -> PreTrainedConfig:
    try:
        return AutoConfig.from_pretrained(
            member.location, revision=member.revision, trust_remote_code=trust_remote_code, **hub.as_kwargs()
        )
    except (OSError, ValueError, KeyError) as err:
        code = None if trust_remote_code else remote_code(member, hub)
        if code:
            raise PairConfigError(
                f"The {member.role} from field {member.role!r}={member.entry!r} is a model of its own code ({code}, in "
                f"{member.location}), which runs only with trust_remote_code=True: pass it to from_pretrained once you have "
                "read that code, or name a model transformers implements."
            ) from err
        raise unreachable_member(member, hub, err) from err


def remote_code(member: PairMember, hub: HubOptions) -> str | None:
    """The class a member's config.json maps AutoConfig (or AutoModelForCausalLM) to in its own code, or None."""
    try:
        data, _ = PreTrainedConfig.get_config_dict(member.location, revision=member.revision, **hub.as_kwargs())
    except (OSError, ValueError):
        return None
    auto_map = data.get("auto_map") or {}
    return auto_map.get("AutoConfig") or auto_map.get("AutoModelForCausalLM")


def check_member_weights(member: PairMember) -> None:
    """Refuse a local member folder whose weights are in other formats only (members load as safetensors only), before
    any weights load. A Hub member's files are not listed here: `not_safetensors` words its load error."""
    folder = Path(member.location)
    if not member.is_local or not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    others = sorted({p.name for pattern in FOREIGN_WEIGHTS for p in folder.glob(pattern)})
    if others:
        raise not_safetensors(member, f"ships its weights only as {', '.join(others[:3])}")


def not_safetensors(member: PairMember, found: str) -> PairConfigError:
    return PairConfigError(
        f"The {member.role} from field {member.role!r}={member.entry!r} {found}: pair members load as safetensors only "
        "(a pickle file can run code as it loads). Convert it once, from a source you trust: "
        f"AutoModelForCausalLM.from_pretrained({member.location!r}).save_pretrained(folder) writes model.safetensors; "
        f"then name that folder (it may be the same one) in field {member.role!r}."
    )


# ---------------------------------------------------------------- pinning revisions


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
