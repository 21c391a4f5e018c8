"""What `swiftspec distill` is asked to do: DistillConfig (with TrainSettings, EvalSettings and DataOptions),
which the command's options fill and a checkpoint's settings are compared with on --resume."""

from __future__ import annotations

from dataclasses import dataclass, field

from .distill_corpus import DataOptions
from .distill_drafts import DRAFT_KINDS
from .distill_train import TrainSettings

__all__ = ["DRAFT_KINDS", "DataOptions", "DistillConfig", "EvalSettings", "TrainSettings"]

SELF_DISTILL_AUTO_TOKENS = 256  # the target's answer to a conversation, at most (and at most its context)


@dataclass(frozen=True)
class EvalSettings:
    """The held-out measurement; fixed tree settings (draft_depth too) so that tau is deterministic."""

    prompts: int = 16  # held-out prompts whose greedy continuation gives tau (at most: under --minutes, measure_share)
    new_tokens: int = 64  # (at most, likewise)
    prompt_tokens: int = 32  # a plain held-out text's prompt: its first tokens (at most half of it)
    windows: int = 16  # held-out windows for teacher-forced agreement
    tree_budget: int = 8
    draft_width: int = 2
    draft_depth: int = 4
    ngram_size: int = 0  # 0: the draft's proposals alone, so tau measures the draft


@dataclass(frozen=True)
class DistillConfig:
    """Everything `swiftspec distill` does; the command's defaults come from here."""

    target: str
    output: str
    data: tuple[str, ...] = ()  # text files, folders, .jsonl files, saved datasets, hf:ID (distill_corpus.py)
    data_options: DataOptions = DataOptions()
    draft: str = "auto"  # DRAFT_KINDS (auto: distill_drafts.auto_draft, by the target's size)
    train: TrainSettings = TrainSettings()
    eval: EvalSettings = EvalSettings()
    # Under --minutes: the share of them the measurements (held-out evaluations, the in-run bench) and
    # self-distillation may take together; fewer prompts, tokens and answers where the target is too slow for
    # eval's (distill_budget.py). Training gets the rest.
    measure_share: float = 0.15
    # None (auto): the target answers the conversations (their assistant turns become its own, up to
    # SELF_DISTILL_AUTO_TOKENS tokens), plain text trains as it is; 0: off; N: every record's prompt, N new tokens
    self_distill_tokens: int | None = None
    heldout_percent: int = 10
    heldout_data: tuple[str, ...] = ()  # held-out records in files of their own (then `data` is all training)
    compare_drafts: tuple[str, ...] = ()  # other draft models measured beside, on the same held-out data
    eval_prompts_file: str | None = None  # held-out prompts for tau (text lines or jsonl); default: from the data
    # The written pair's SwiftSpecConfig tree settings (tree_budget, draft_width, draft_depth); those not given stay
    # the library's (tree_budget None: the goodput policy sizes each tree), as `swiftspec pair create` leaves them.
    pair_settings: dict = field(default_factory=dict)
    head_hidden: int | None = None  # EAGLE-3 head width (default: the target's)
    head_depth: int = 3  # levels of training-time test
    save_every: int = 100
    resume: bool = False
    force: bool = False  # write into a non-empty folder
    device: str | None = None  # default: cuda (this rank's) when present, else cpu
    dtype: str | None = None  # default: float32 on CPU, bfloat16 on GPU
    push_to_hub: str | None = None  # a Hub repo id to upload the pair to
    private: bool = False
    verbose: bool = True
    command: str | None = None  # how the run was started, for the model card
