"""The pair's tokenizer: read as its files declare it, written without loader state, checked.

A pair's prompts are encoded by the tokenizer in the pair repo, which must behave exactly as the
target's: same class, same ids for the same text. Two things in transformers get in the way.
AutoTokenizer replaces a generic tokenizers-backend class with the model type's own class for some
model types (qwen2 -> Qwen2Tokenizer), which rebuilds the tokenizer from its vocabulary and can
encode differently from the saved tokenizer.json; and save_pretrained writes some from_pretrained
arguments (is_local, local_files_only) into tokenizer_config.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from transformers import AutoTokenizer, TokenizersBackend

from ..models.compat import get_tokenizer_config
from .errors import PairConfigError, first_line
from .locate import HubOptions

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer_class values that mean "the tokenizer.json as it is", whatever the model type.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# from_pretrained arguments that end up in a loaded tokenizer's init_kwargs and so in what it saves.
LOADER_KEYS = (
    "is_local", "local_files_only", "use_fast", "cache_dir", "force_download", "token", "revision", "subfolder",
    "proxies", "trust_remote_code", "_commit_hash", "_from_auto", "_from_pipeline",
)
# Text a written tokenizer must encode exactly as the one it was written from (plus a sample of its vocabulary).
PROBE_TEXTS = (
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\r\nnewlines  ",
    "naïve café, Straße, 東京, 🙂",
    "",
)


def declared_tokenizer_class(location: str, revision: str | None, hub: HubOptions) -> str | None:
    """tokenizer_class from the tokenizer_config.json of a folder or repo, or None."""
    return get_tokenizer_config(location, revision=revision, **hub.as_kwargs()).get("tokenizer_class")


# What makes two folders' tokenizers the same (tokenizer_config.json holds the chat template, when not in its own file).
FINGERPRINT_FILES = TOKENIZER_FILES + ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja")


def tokenizer_fingerprint(location: str) -> str | None:
    """A hash of a local folder's tokenizer files; None for a Hub id or a folder with none of them."""
    if not os.path.isdir(location):
        return None
    digest, found = hashlib.sha256(), False
    for name in FINGERPRINT_FILES:
        path = Path(location, name)
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest() if found else None


def load_tokenizers(sources: dict[str, tuple[str, str | None, HubOptions]], trust_remote_code: bool = False) -> dict:
    """{name: tokenizer or None} for {name: (location, revision, hub)}, each distinct set of files loaded once:
    a pair of one family ships one tokenizer up to three times (target, draft, pair folder), and a 262k
    vocabulary takes seconds to load. Names that share files share one object, which also tells the
    vocabulary checks there is nothing to compare."""
    loaded, result = {}, {}
    for name, (location, revision, hub) in sources.items():
        key = tokenizer_fingerprint(location) or (location, revision)
        if key not in loaded:
            loaded[key] = load_tokenizer(location, revision, hub, trust_remote_code)
        result[name] = loaded[key]
    return result


def load_tokenizer(location: str, revision: str | None, hub: HubOptions, trust_remote_code: bool = False):
    """The tokenizer of a folder or repo as its files declare it, or None when it ships none (its
    vocabulary is then checked by size)."""
    if os.path.isdir(location) and not any(Path(location, f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        if declared_tokenizer_class(location, revision, hub) in GENERIC_TOKENIZER_CLASSES:
            return TokenizersBackend.from_pretrained(location, revision=revision, **hub.as_kwargs())
        return AutoTokenizer.from_pretrained(
            location, revision=revision, trust_remote_code=trust_remote_code, **hub.as_kwargs()
        )
    except (OSError, ValueError) as err:
        logger.warning("No tokenizer loaded from %s (%s); vocabularies are compared by size only.", location, first_line(err))
        return None


def save_tokenizer(tokenizer, folder: Path) -> None:
    """tokenizer.save_pretrained, with the loader arguments it would write taken out of tokenizer_config.json."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        cleaned = {key: value for key, value in config.items() if key not in LOADER_KEYS}
        if cleaned != config:
            path.write_text(json.dumps(cleaned, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def probe_texts(tokenizer) -> list[str]:
    """PROBE_TEXTS, the special tokens, and 64 tokens spread over the vocabulary decoded into one text."""
    step = max(1, len(tokenizer) // 64)
    return [*PROBE_TEXTS, "".join(tokenizer.all_special_tokens), tokenizer.decode(list(range(0, len(tokenizer), step)))]


def check_written_tokenizer(folder: Path, expected) -> None:
    """The tokenizer files in `folder` must load to `expected`'s class and encode every probe text to its ids."""
    written = load_tokenizer(str(folder), None, HubOptions())
    if written is None or type(written) is not type(expected):
        got = "nothing" if written is None else type(written).__name__
        raise PairConfigError(
            f"The tokenizer written to {folder} loads as {got}, not as the target's {type(expected).__name__}; "
            "the pair would encode prompts differently from the target."
        )
    for text in probe_texts(expected):
        mine, theirs = written(text).input_ids, expected(text).input_ids
        if mine != theirs:
            raise PairConfigError(
                f"The tokenizer written to {folder} does not behave like the target's: {text[:60]!r} encodes to "
                f"{mine[:12]} with the written tokenizer but {theirs[:12]} with the target's."
            )
