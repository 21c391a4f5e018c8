"""The pair's tokenizer: read from a member or pair folder."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformers import AutoTokenizer

from .errors import first_line
from .locate import HubOptions

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
