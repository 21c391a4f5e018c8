"""Building pair repos for tests: tiny members on disk, and repos written into a Hugging Face cache layout."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from transformers import AutoModelForCausalLM

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import char_tokenizer, tiny_model, truncated_draft


def save_member(model, folder: Path, tokenizer=None) -> Path:
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def word_tokenizer():
    """A word-level tokenizer ("w0".."w93" and 4 specials = 98 ids) of the generic tokenizers-backend class, as
    tokenizers trained from scratch are saved. Its model type's own class (Qwen2Tokenizer for qwen2) would
    rebuild it as byte-level BPE and encode "w3 w7" to nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(94)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_members(root: Path, tokenizer=True, model_type: str = "llama", **draft_overrides) -> tuple[Path, Path]:
    """A tiny target and a draft cut from its first two layers, saved under root/target and root/draft.

    tokenizer: True for char_tokenizer(), False for none, or the tokenizer to save with both.
    """
    tok = char_tokenizer() if tokenizer is True else tokenizer or None
    target = tiny_model(model_type, seed=0)
    draft = truncated_draft(target, 2)
    for name, value in draft_overrides.items():
        setattr(draft.config, name, value)
    return save_member(target, root / "target", tok), save_member(draft, root / "draft", tok)


def local_pair(root: Path, **settings) -> Path:
    """root/pair: a pair folder whose members are root/target and root/draft (named relative to it)."""
    target_dir, draft_dir = tiny_members(root)
    model = SwiftSpecForCausalLM.from_models(
        AutoModelForCausalLM.from_pretrained(target_dir),
        AutoModelForCausalLM.from_pretrained(draft_dir),
        tokenizer=char_tokenizer(),
        **settings,
    )
    model.config.update({role: os.path.join("..", role) for role in ("target", "draft")})  # (absolute ones stay absolute)
    model.save_pretrained(root / "pair")
    return root / "pair"


def write_cached_repo(hub_cache: Path, repo_id: str, source: Path, commit: str, branch: str | None = "main") -> Path:
    """Write the files of `source` as `repo_id` at `commit` in the cache layout huggingface_hub reads:
    models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> blob, refs/<branch>}."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot
