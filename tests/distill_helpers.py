"""What the `swiftspec distill` tests share: a tiny target saved as a user's folder, word texts to train on,
and a quick run's settings."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_swiftspec.tools.distill import DistillConfig, EvalSettings
from hf_swiftspec.tools.distill_train import TrainSettings
from hf_swiftspec.tools.models import char_tokenizer, tiny_model

WORDS = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "print", "x", "y", "(", ")", ":"]
EVAL = EvalSettings(prompts=5, new_tokens=24, windows=6)  # fixed tree settings: tau is deterministic
TREE = dict(tree_budget=EVAL.tree_budget, draft_width=EVAL.draft_width, draft_depth=EVAL.draft_depth, ngram_size=0)


def word_texts(count: int, seed: int, words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def save_target(folder: Path) -> Path:
    """A 3-layer random Llama with the character tokenizer, saved as a user's target folder."""
    tiny_model("llama", layers=3, hidden=64, sharpness=4.0).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def config(target_dir, data_file, output, **changes) -> DistillConfig:
    base = DistillConfig(
        target=str(target_dir), output=str(output), data=(str(data_file),), draft="early-exit:1",
        train=TrainSettings(steps=60, batch=4, window=48, lr=3e-3, warmup=5), eval=EVAL, save_every=20, verbose=False,
    )
    return replace(base, **changes)


def load_target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
