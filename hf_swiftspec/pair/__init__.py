"""Pair repos: find one, check that its two models can speculate together, and write one.

    locate     where a pair and its members are (folder, bundled pair, Hub id); pinning revisions
    tokenizer  the pair's tokenizer: read as its files declare it, written clean, checked
    checks     compatibility of the two models: architecture, vocabularies, special tokens, context
    cards      the README.md model card: rendering and validation
    repo       the pair's config.json; reading, checking, writing and creating a whole pair repo
    loading    SwiftSpecForCausalLM.from_pretrained's arguments (not imported here: it needs placement)
"""

from .cards import LIBRARY_NAME, PairCard, default_card, read_card_metadata, render_card, validate_card
from .checks import (
    check_architecture,
    check_compatibility,
    check_context_lengths,
    check_special_tokens,
    check_token_mapping,
    check_vocabularies,
    context_length,
    vocab_size,
)
from .errors import PairConfigError
from .locate import (
    DEMO_PAIR_NAME,
    ROLES,
    HubOptions,
    PairMember,
    bundled_pair,
    bundled_pairs_dir,
    current_commit,
    pair_members,
    pinned,
    relocated,
    resolve_pair_folder,
)
from .repo import (
    ResolvedPair,
    check_pair_files,
    create_pair_repo,
    load_pair_config,
    member_description,
    pair_settings,
    pop_pair_settings,
    resolve_pair,
    write_pair_repo,
)
from .tokenizer import load_tokenizer

__all__ = [
    "DEMO_PAIR_NAME",
    "LIBRARY_NAME",
    "ROLES",
    "HubOptions",
    "PairCard",
    "PairConfigError",
    "PairMember",
    "ResolvedPair",
    "bundled_pair",
    "bundled_pairs_dir",
    "check_architecture",
    "check_compatibility",
    "check_context_lengths",
    "check_pair_files",
    "create_pair_repo",
    "check_special_tokens",
    "check_token_mapping",
    "check_vocabularies",
    "context_length",
    "current_commit",
    "default_card",
    "load_pair_config",
    "load_tokenizer",
    "member_description",
    "pair_members",
    "pair_settings",
    "pinned",
    "pop_pair_settings",
    "read_card_metadata",
    "relocated",
    "render_card",
    "resolve_pair",
    "resolve_pair_folder",
    "validate_card",
    "vocab_size",
    "write_pair_repo",
]
