"""What `swiftspec distill` measures and writes: the held-out measurement of a draft (teacher-forced
top-1 agreement, tau from the pair's own generate with fixed tree settings), the pair folder with its
model card and distill.json, and the upload to the Hub."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafters.eagle3 import save_eagle3_head
from ..pair import PairCard
from .distill_config import DistillConfig, EvalSettings


@dataclass
class Evaluation:
    """A draft measured on held-out data."""

    agreement: float  # teacher-forced: the draft's argmax is the target's, share of held-out positions
    kl: float  # the training objective on the held-out windows
    tau: float  # tokens per target verification, greedy, EvalSettings' tree
    new_tokens: int
    verify_steps: int
    prompts: int
    identical: bool  # every continuation equalled target.generate's


@dataclass
class DistillResult:
    folder: Path
    steps: int
    train_tokens: int
    heldout_sequences: int
    before: Evaluation
    after: Evaluation
    seconds_per_step: float
    peak_rss_mib: float
    compared: dict[str, Evaluation] = field(default_factory=dict)  # --compare-draft's, by location


# ---------------------------------------------------------------- held-out measurement


@torch.no_grad()
def evaluate(student, tokenizer, windows: torch.Tensor, prompts: list[list[int]], settings: EvalSettings) -> Evaluation:
    """Teacher-forced agreement and KL on `windows` (C, L), and tau on `prompts` from the pair's greedy
    generate with settings' fixed tree, each continuation checked against target.generate."""
    from contextlib import nullcontext

    from ..modeling import SwiftSpecForCausalLM

    target, draft = student.target, student.module
    draft.eval()
    scores = [student.step(windows[i : i + 4].to(target.device), nullcontext()) for i in range(0, len(windows), 4)]
    sizes = [len(windows[i : i + 4]) for i in range(0, len(windows), 4)]
    kl = sum(float(s[0]) * n for s, n in zip(scores, sizes)) / sum(sizes)
    agree = sum(float(s[1]) * n for s, n in zip(scores, sizes)) / sum(sizes)
    pair = SwiftSpecForCausalLM.from_models(
        target, draft, tokenizer=tokenizer, tree_budget=settings.tree_budget, draft_width=settings.draft_width,
        draft_depth=settings.draft_depth, ngram_size=settings.ngram_size,
    )
    new_tokens = verify_steps = 0
    identical = True
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=settings.new_tokens, do_sample=False)
        expected = target.generate(ids, **kwargs)
        out = pair.generate(ids, **kwargs)
        identical &= out.tolist() == expected.tolist()
        new_tokens += pair.swiftspec_stats.new_tokens
        verify_steps += pair.swiftspec_stats.verify_steps
    return Evaluation(agree, kl, new_tokens / max(verify_steps, 1), new_tokens, verify_steps, len(prompts), identical)


def draft_in_target_dtype(student):
    """The draft for measuring: itself in float32 runs, else a copy in the target's dtype (the float32
    master weights stay for training)."""
    if student.target.dtype == torch.float32:
        return student
    twin = copy.copy(student)
    twin.module = copy.deepcopy(student.module).to(student.target.dtype)
    return twin


# ---------------------------------------------------------------- the pair folder


def card_for(config: DistillConfig, result: DistillResult) -> PairCard:
    b, a, e = result.before, result.after, config.eval
    table = (
        "| draft | top-1 agreement | held-out KL | tau |\n|---|---|---|---|\n"
        f"| starting draft ({config.draft}) | {b.agreement:.1%} | {b.kl:.3f} | {b.tau:.2f} |\n"
        f"| distilled, {result.steps} steps | {a.agreement:.1%} | {a.kl:.3f} | {a.tau:.2f} |"
        + "".join(f"\n| `{name}` | {c.agreement:.1%} | {c.kl:.3f} | {c.tau:.2f} |" for name, c in result.compared.items())
    )
    measured = (
        f"{table}\n\nTop-1 agreement: teacher-forced, the draft's most likely next token is the target's, over "
        f"{e.windows} held-out windows of {config.train.window} tokens. tau: tokens per target verification in greedy "
        f"generation of {e.new_tokens} new tokens from {a.prompts} held-out prompts (tree_budget={e.tree_budget}, "
        f"draft_width={e.draft_width}, draft_depth={e.draft_depth}, ngram_size={e.ngram_size}: fixed, so deterministic); "
        f"output identical to target.generate: {a.identical}."
    )
    t = config.train
    data = ", ".join(f"`{Path(p).name}`" for p in config.data)
    source = (f"the target's own greedy continuations ({config.self_distill_tokens} tokens) of the prompts in {data}"
              if config.self_distill_tokens else data)
    training = (
        f"Distilled with `swiftspec distill` from {source}: {result.train_tokens:,} training tokens, "
        f"{result.heldout_sequences} held-out records ({config.heldout_percent}% by a hash of their content). "
        f"{result.steps} steps of {t.batch} x {t.window}-token windows, AdamW (lr {t.lr}, warm-up {t.warmup}, cosine), "
        f"KL to the target's top-{t.top_k} next-token distribution plus a tail bucket"
        + (f", {config.head_depth} levels of EAGLE-3's training-time test" if config.draft == "eagle3" else "")
        + f", seed {t.seed}."
    )
    sections = [("Measured on held-out data", measured), ("Training", training)]
    if config.command:
        sections.append(("Reproduce", f"```bash\n{config.command}\n```"))
    return PairCard(
        title=f"SwiftSpec pair: {config.target} with a distilled draft",
        summary=(f"Lossless tree speculative decoding for `{config.target}` with a draft distilled to agree with it "
                 f"({'an EAGLE-3 head' if config.draft == 'eagle3' else config.draft}). Outputs are exactly the target's own."),
        tags=("distilled",), sections=tuple(sections),
    )


def write_pair(config: DistillConfig, student, tokenizer, result: DistillResult) -> Path:
    """The pair folder: draft/ (the draft model with the tokenizer, or the head in the speculators layout),
    config.json naming the target (a folder relative to the pair, or a pinned Hub id), README.md, tokenizer."""
    from ..modeling import SwiftSpecForCausalLM

    folder = Path(config.output)
    draft = student.module
    if config.draft == "eagle3":
        save_eagle3_head(draft, folder / "draft", "speculators")
    else:
        draft.save_pretrained(folder / "draft")
        tokenizer.save_pretrained(folder / "draft")
    pair = SwiftSpecForCausalLM.from_models(student.target, draft, tokenizer=tokenizer, tree_budget=config.eval.tree_budget,
                                            draft_width=config.eval.draft_width)
    local = Path(config.target).is_dir()
    pair.config.target = os.path.relpath(Path(config.target).resolve(), folder.resolve()) if local else config.target
    pair.config.draft = "draft"
    pair.pair_folder = folder
    pair.save_pretrained(folder, card=card_for(config, result), pin_revisions=not local,
                         load_id=config.push_to_hub or str(folder))
    (folder / "distill.json").write_text(json.dumps(result_json(config, result), indent=1) + "\n")
    return folder


def result_json(config: DistillConfig, result: DistillResult) -> dict:
    return {
        "target": config.target, "draft": config.draft, "data": list(config.data),
        "self_distill_tokens": config.self_distill_tokens, "train": asdict(config.train), "eval": asdict(config.eval),
        "steps": result.steps, "train_tokens": result.train_tokens, "heldout_records": result.heldout_sequences,
        "before": asdict(result.before), "after": asdict(result.after),
        "compared": {name: asdict(e) for name, e in result.compared.items()},
        "measured_on_a_shared_loaded_machine": {"seconds_per_step": round(result.seconds_per_step, 3),
                                                "peak_rss_mib": round(result.peak_rss_mib, 1)},
    }


def push(folder: Path, repo_id: str, private: bool) -> None:
    """Upload the pair folder (not its checkpoints) to the Hub repo `repo_id`."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), ignore_patterns=["checkpoints/*", ".*"],
                      commit_message="Upload a SwiftSpec pair with a distilled draft")
