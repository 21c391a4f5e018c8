"""Pair model cards: what a README.md says about a pair, rendered from its config, and validated.

The card's YAML header is what the Hub indexes (library, pipeline tag, licence, base models);
its body shows how to load the pair and which members and tree settings it uses.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import SwiftSpecConfig
from .errors import PairConfigError
from .locate import pair_members

LIBRARY_NAME = "hf_swiftspec"
BASE_TAGS = ("swiftspec", "speculative-decoding")


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
    settings = ", ".join(f"`{name}={getattr(config, name)!r}`" for name in ("tree_budget", "draft_width", "draft_depth", "ngram_size", "tree_capacity"))
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
