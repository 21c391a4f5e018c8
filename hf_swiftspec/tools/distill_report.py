"""What `swiftspec distill` writes: the pair folder (the draft, config.json with the pair's own tree settings,
the tokenizer), its model card with what to expect of the pair, distill.json, and the upload to the Hub."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..drafters.eagle3 import save_eagle3_head
from ..pair import PairCard, pinned, write_pair_repo
from .distill_config import SELF_DISTILL_AUTO_TOKENS, DistillConfig
from .distill_eval import Evaluation

HELDOUT_PROMPTS = "heldout_prompts.jsonl"  # in the pair folder: the held-out prompts, for `swiftspec bench --prompts`
SPEED_FOLDER = "bench"  # in the pair folder: what the speed measurement wrote (results.json, results.md)


# The card credits the draft only where the policy drafted with it (draft forwards a round) and the pair beat its own
# target draft-free by this much: a pair that hardly drafts runs as fast as draft-free, up to the timing's noise.
DRAFT_PAYS = 1.05
DRAFTED = 0.5


@dataclass
class Speed:
    """The written pair timed side by side with target.generate, prompt lookup and its own target draft-free
    (suffix proposals alone) on the held-out prompts (`swiftspec bench`, greedy, every output checked against
    target.generate's), with where the pair's speed-up came from."""

    prompts: int
    new_tokens: int
    speedup: float  # the pair's tokens/s over target.generate's
    prompt_lookup_speedup: float  # prompt lookup's over target.generate's
    tau: float  # the pair's, under its own settings
    threads: int | None
    files: str  # the folder the bench wrote, relative to the pair
    draft_free_speedup: float | None = None  # the pair's target with suffix proposals alone, over target.generate's
    draft_forwards: float | None = None  # the pair's draft forwards a round (the goodput policy's choice)
    ngram_share: float | None = None  # of the pair's accepted proposals, those of the n-gram (suffix) chain

    @property
    def over_prompt_lookup(self) -> float:
        return self.speedup / self.prompt_lookup_speedup

    @property
    def over_draft_free(self) -> float | None:
        """What the draft adds: the pair's speed over its target's draft-free speed."""
        return None if not self.draft_free_speedup else self.speedup / self.draft_free_speedup

    @property
    def draft_pays(self) -> bool | None:
        """Whether the draft earned its keep here: the policy drafted with it and the pair beat draft-free (None: no
        draft-free run to compare with)."""
        if self.over_draft_free is None:
            return None
        return (self.draft_forwards or 0.0) >= DRAFTED and self.over_draft_free >= DRAFT_PAYS


@dataclass
class DistillResult:
    folder: Path
    steps: int
    train_tokens: int  # tokens trained on: steps x batch x window (every rank's windows)
    corpus_tokens: int  # the training stream the windows were drawn from
    heldout_sequences: int
    before: Evaluation
    after: Evaluation
    seconds_per_step: float
    training_seconds: float  # the training loop's own time (steps and checkpoints), not --minutes
    peak_rss_mib: float
    starting_draft: str  # in words (distill_drafts.describe_draft)
    compared: dict[str, Evaluation] = field(default_factory=dict)  # --compare-draft's, by location
    speed: Speed | None = None
    self_distilled: int = 0  # records the target answered
    phases: dict[str, float] = field(default_factory=dict)  # each phase's seconds, as the run measured them
    seconds: float | None = None  # the whole run, from its start to the pair written and timed
    speed_skipped: str | None = None  # why the pair was not timed, where it was meant to be
    batch: int | None = None  # windows a step and their tokens (the draft's recipe where not given)
    window: int | None = None


# ---------------------------------------------------------------- the card


def speed_verdict(speed: Speed, target: str) -> str:
    """Where the speed-up came from, and a plain verdict when the draft does not pay on this machine."""
    share = speed.over_draft_free
    if share is None:
        return ""
    where = (f"The pair's target draft-free (suffix proposals alone) ran {speed.draft_free_speedup:.2f}x `target.generate`; "
             f"the goodput policy ran {speed.draft_forwards:.1f} draft forwards a round and {speed.ngram_share:.0%} of the "
             "accepted proposals were the n-gram chain's.")
    if speed.draft_pays:
        return f"{where} The draft's own share of the speed-up: {share:.2f}x over draft-free."
    why = ("the policy hardly drafted with it" if speed.draft_forwards < DRAFTED else f"{share:.2f}x draft-free")
    return (f"{where} **The draft does not pay on this machine** ({why}): a draft forward costs too "
            "much here beside the target's verification, so the speed-up is the suffix proposals'. Draft-free mode "
            f"(`SwiftSpecForCausalLM.from_pretrained(\"{target}\")`) gives it without a draft; the draft would pay beside "
            "a larger target, or on a GPU, where its forward is cheap next to the target's.")


def expectations(config: DistillConfig, result: DistillResult) -> str:
    a, e = result.after, config.eval
    lines = [
        f"- **Top-1 agreement with the target: {a.agreement:.1%}** (held-out text, teacher-forced).",
        f"- **Tokens per target verification (tau): {a.tau:.2f}** with a fixed tree (tree_budget={e.tree_budget}, "
        f"draft_width={e.draft_width}, draft_depth={e.draft_depth}, no suffix proposals: the draft alone, the same every run)"
        + (f"; **{a.policy_tau:.2f}** under the pair's own settings (the goodput policy sizes each tree)" if a.policy_tau else "")
        + f", greedy, {e.new_tokens} new tokens from each of {a.prompts} held-out prompts.",
    ]
    s = result.speed
    if s is not None:
        lines.append(
            f"- **Speed-up: {s.speedup:.2f}x `target.generate`** and {s.over_prompt_lookup:.2f}x prompt lookup ({s.prompt_lookup_speedup:.2f}x "
            f"`target.generate`), timed side by side by `swiftspec bench` on {s.prompts} held-out prompts x {s.new_tokens} tokens, greedy"
            + (f", {s.threads} CPU thread(s)" if s.threads else "") + f", on the machine that distilled it (`{s.files}/`). "
            + speed_verdict(s, config.target) + " Speed-ups depend on the hardware: `swiftspec bench --pair` measures yours."
        )
    else:
        why = f" ({result.speed_skipped})" if result.speed_skipped else ""
        lines.append(f"- Speed: not measured in this run{why}; `swiftspec bench --pair {config.output} --prompts {config.output}/"
                     f"{HELDOUT_PROMPTS} --methods target,prompt_lookup,swiftspec_serial,swiftspec_suffix` times it on the "
                     "held-out prompts.")
    lines.append(f"- Every continuation equalled `target.generate`'s token for token: {a.identical}.")
    return "\n".join(lines)


def training_text(config: DistillConfig, result: DistillResult) -> str:
    """How it was trained, in the run's own figures: the tokens its steps read, the training's own minutes."""
    t = config.train
    data = ", ".join(f"`{Path(p).name}`" for p in config.data)
    tokens = config.self_distill_tokens or SELF_DISTILL_AUTO_TOKENS
    source = data + (f", the prompts of {result.self_distilled} of its records continued by the target itself (its greedy "
                     f"continuations, {tokens} tokens at most)" if result.self_distilled else "")
    run = ""
    if result.seconds is not None:
        run = f" of a {result.seconds / 60:.1f}-minute run" + (f" (--minutes {t.minutes:g})" if t.minutes is not None else "")
    return (
        f"Distilled with `swiftspec distill` from {result.starting_draft}, on {source} ({result.corpus_tokens:,} tokens "
        f"to draw from; {result.heldout_sequences} held-out records). {result.steps} steps of {t.batch} x {t.window}-token "
        f"windows: **{result.train_tokens:,} tokens trained on**, in **{result.training_seconds / 60:.1f} minutes of "
        f"training**{run}, {result.seconds_per_step:.2f} s a step. AdamW (lr {t.lr}, warm-up {t.warmup}, cosine), KL to "
        f"the target's top-{t.top_k} next-token distribution plus a tail bucket"
        + (f", {config.head_depth} levels of EAGLE-3's training-time test" if config.draft == "eagle3" else "")
        + f", seed {t.seed}." + phases_text(result)
    )


def phases_text(result: DistillResult) -> str:
    if not result.phases:
        return ""
    from .distill_progress import PHASES, minutes

    named = {"prepare": "loading and the trial", **PHASES}
    return " Where the run's time went: " + "; ".join(f"{named.get(k, k)} {minutes(v)}" for k, v in result.phases.items()) + "."


def card_for(config: DistillConfig, result: DistillResult) -> PairCard:
    b, a, e = result.before, result.after, config.eval
    table = (
        "| draft | top-1 agreement | held-out KL | tau (fixed tree) |\n|---|---|---|---|\n"
        f"| starting draft ({config.draft}) | {b.agreement:.1%} | {b.kl:.3f} | {b.tau:.2f} |\n"
        f"| distilled, {result.steps} steps | {a.agreement:.1%} | {a.kl:.3f} | {a.tau:.2f} |"
        + "".join(f"\n| `{name}` | {c.agreement:.1%} | {c.kl:.3f} | {c.tau:.2f} |" for name, c in result.compared.items())
    )
    measured = (
        f"{table}\n\nTop-1 agreement: teacher-forced, the draft's most likely next token is the target's, over "
        f"{e.windows} held-out windows of {config.train.window} tokens. tau: tokens per target verification in greedy "
        f"generation of {e.new_tokens} new tokens from {a.prompts} held-out prompts with a fixed tree (tree_budget={e.tree_budget}, "
        f"draft_width={e.draft_width}, draft_depth={e.draft_depth}, ngram_size={e.ngram_size}), so it depends on the draft alone."
    )
    sections = [("What to expect", expectations(config, result)), ("Measured on held-out data", measured),
                ("Training", training_text(config, result))]
    if config.command:
        sections.append(("Reproduce", f"```bash\n{config.command}\n```"))
    return PairCard(
        title=f"SwiftSpec pair: {config.target} with a distilled draft",
        summary=(f"Lossless tree speculative decoding for `{config.target}` with a draft distilled to agree with it. "
                 "Outputs are exactly the target's own."),
        tags=("distilled",), sections=tuple(sections),
    )


# ---------------------------------------------------------------- the pair folder


def target_entry(target: str) -> str:
    """How config.json names the target: a local folder by its absolute path (the pair then loads wherever it is
    moved or copied to, as long as the target stays), a Hub id as it is (pinned to a commit by write_pair)."""
    path = Path(target)
    return str(path.resolve()) if path.is_dir() else target


def write_draft(config: DistillConfig, student, tokenizer) -> None:
    """draft/: the draft model with the tokenizer, or the head in the speculators layout."""
    folder = Path(config.output) / "draft"
    if config.draft == "eagle3":
        save_eagle3_head(student.module, folder, "speculators")
    else:
        student.module.save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def own_pair(config: DistillConfig, student, tokenizer):
    """The pair as written: the pair's own settings (config.pair_settings over the library's), the draft under draft/."""
    from ..modeling import SwiftSpecForCausalLM

    pair = SwiftSpecForCausalLM.from_models(student.target, student.module, tokenizer=tokenizer, **config.pair_settings)
    pair.config.target, pair.config.draft = target_entry(config.target), "draft"
    return pair


def write_pair(config: DistillConfig, student, tokenizer, result: DistillResult) -> Path:
    """The pair folder: draft/, config.json (the target by absolute path or pinned Hub id, the draft as draft/, the
    tree settings the user gave and the library's for the rest), README.md, tokenizer, distill.json."""
    folder = Path(config.output)
    write_draft(config, student, tokenizer)
    pair = own_pair(config, student, tokenizer)
    settings = pair.config if Path(config.target).is_dir() else pinned(pair.config, folder)
    write_pair_repo(folder, settings, card_for(config, result), tokenizer, pair.generation_config,
                    config.push_to_hub or str(folder))
    write_result(config, result)
    return folder


def write_result(config: DistillConfig, result: DistillResult) -> None:
    folder = Path(config.output)
    (folder / "distill.json").write_text(json.dumps(result_json(config, result), indent=1) + "\n")


def rewrite_card(config: DistillConfig, result: DistillResult) -> None:
    """README.md and distill.json again, with what was measured after the pair was written (its speed)."""
    from ..pair import load_pair_config, render_card

    folder = Path(config.output)
    settings = load_pair_config(folder, str(folder))
    (folder / "README.md").write_text(render_card(settings, card_for(config, result), config.push_to_hub or str(folder), folder))
    write_result(config, result)


def result_json(config: DistillConfig, result: DistillResult) -> dict:
    return {
        "target": config.target, "draft": config.draft, "starting_draft": result.starting_draft, "data": list(config.data),
        "self_distill_tokens": config.self_distill_tokens, "self_distilled_records": result.self_distilled,
        "train": asdict(config.train), "eval": asdict(config.eval), "pair_settings": dict(config.pair_settings),
        "steps": result.steps, "train_tokens": result.train_tokens, "corpus_tokens": result.corpus_tokens,
        "heldout_records": result.heldout_sequences,
        "before": asdict(result.before), "after": asdict(result.after),
        "compared": {name: asdict(e) for name, e in result.compared.items()},
        "speed": asdict(result.speed) if result.speed is not None else None,
        "speed_skipped": result.speed_skipped,
        "training_time": {"seconds": round(result.training_seconds, 1), "seconds_per_step": round(result.seconds_per_step, 3),
                          "peak_rss_mib": round(result.peak_rss_mib, 1)},
        "phases": result.phases, "seconds": None if result.seconds is None else round(result.seconds, 3),
    }


def write_heldout_prompts(folder: Path, prompts: list[list[int]], tokenizer) -> Path:
    """The held-out prompts as text, one {"prompt": ...} a line: what `swiftspec bench --prompts` reads."""
    path = folder / HELDOUT_PROMPTS
    path.write_text("".join(json.dumps({"prompt": tokenizer.decode(p, skip_special_tokens=True)}) + "\n" for p in prompts))
    return path


def push(folder: Path, repo_id: str, private: bool) -> None:
    """Upload the pair folder (not its checkpoints) to the Hub repo `repo_id`."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), ignore_patterns=["checkpoints/*", ".*"],
                      commit_message="Upload a SwiftSpec pair with a distilled draft")
