"""What `swiftspec distill` measures of a draft on held-out data: teacher-forced top-1 agreement and the
training objective on held-out windows; tau from the pair's own greedy generate, with fixed tree settings
(deterministic: it depends on the draft alone) and under the pair's own settings (the goodput policy, as the
pair will run); every continuation checked against target.generate's, token for token."""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from .distill_config import EvalSettings
from .distill_progress import Clock, Progress


@dataclass
class Evaluation:
    """A draft measured on held-out data."""

    agreement: float  # teacher-forced: the draft's argmax is the target's, share of held-out positions
    kl: float  # the training objective on the held-out windows
    tau: float  # tokens per target verification, greedy, EvalSettings' fixed tree
    new_tokens: int
    verify_steps: int
    prompts: int
    identical: bool  # every continuation equalled target.generate's
    policy_tau: float | None = None  # the same under the pair's own settings (the goodput policy), where measured
    # seconds of each part: "windows" (teacher-forced), "references" (target.generate, computed the first time),
    # "fixed_pair", "own_pair"
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class References:
    """What the held-out measurement computes once for the run: target.generate's greedy continuation of each
    held-out prompt and the seconds each took (what the run's ETA sizes a generation by), and the target's
    distribution on the held-out windows (the same before and after training)."""

    outputs: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    taught: dict = field(default_factory=dict)  # student kind -> the teacher's output for each chunk of EVAL_CHUNK windows

    @property
    def generate_s(self) -> float:
        return sum(self.seconds) / max(len(self.seconds), 1)


EVAL_CHUNK = 4  # held-out windows a forward


@torch.no_grad()
def reference(target, prompt: list[int], settings: EvalSettings) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.new_tokens,
                           do_sample=False)[0].tolist()


@torch.no_grad()
def teacher_forced(student, windows: torch.Tensor, references: References) -> tuple[float, float]:
    """(agreement, KL) of the student on `windows` (C, L), EVAL_CHUNK at a time, the target's distribution on
    each chunk computed the first time and kept in `references`."""
    agree = kl = 0.0
    taught = references.taught.setdefault(student.kind, [])  # a head's teacher also gives the target's states
    for n, start in enumerate(range(0, len(windows), EVAL_CHUNK)):
        chunk = windows[start : start + EVAL_CHUNK].to(student.target.device)
        if n == len(taught):
            taught.append(student.teacher(chunk))
        loss, hits = student.learn(chunk, taught[n], nullcontext())
        kl, agree = kl + float(loss) * len(chunk), agree + float(hits) * len(chunk)
    return agree / max(len(windows), 1), kl / max(len(windows), 1)


def fixed_pair(student, tokenizer, settings: EvalSettings):
    from ..modeling import SwiftSpecForCausalLM

    return SwiftSpecForCausalLM.from_models(
        student.target, student.module, tokenizer=tokenizer, tree_budget=settings.tree_budget,
        draft_width=settings.draft_width, draft_depth=settings.draft_depth, ngram_size=settings.ngram_size,
    )


@torch.no_grad()
def evaluate(student, tokenizer, windows: torch.Tensor, prompts: list[list[int]], settings: EvalSettings,
             references: References, progress: Progress, phase: str, own_pair=None,
             clock: Clock = time.monotonic) -> Evaluation:
    """Teacher-forced agreement and KL on `windows` (C, L), and tau on `prompts` from the pair's greedy generate
    with settings' fixed tree (and under `own_pair`'s settings when given: the pair as written), each
    continuation checked against target.generate's (computed here once, kept in `references`)."""
    target = student.target
    student.module.eval()
    progress.start(phase, len(prompts), "held-out prompts")
    timings = dict.fromkeys(("windows", "references", "fixed_pair", "own_pair"), 0.0)
    started = clock()
    agree, kl = teacher_forced(student, windows, references)
    timings["windows"] = clock() - started
    pair = fixed_pair(student, tokenizer, settings)
    new_tokens = verify_steps = policy_tokens = policy_steps = 0
    identical = True
    for i, prompt in enumerate(prompts):
        if i == len(references.outputs):
            started = clock()
            references.outputs.append(reference(target, prompt, settings))
            references.seconds.append(clock() - started)
            timings["references"] += references.seconds[-1]
        expected = references.outputs[i]
        for model in (pair, own_pair) if own_pair is not None else (pair,):
            ids = torch.tensor([prompt], device=target.device)
            started = clock()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.new_tokens, do_sample=False)
            timings["fixed_pair" if model is pair else "own_pair"] += clock() - started
            identical &= out[0].tolist() == expected
            stats = model.swiftspec_stats
            if model is pair:
                new_tokens, verify_steps = new_tokens + stats.new_tokens, verify_steps + stats.verify_steps
            else:
                policy_tokens, policy_steps = policy_tokens + stats.new_tokens, policy_steps + stats.verify_steps
        progress.advance(1, f"agreement {agree:.1%}  tau {new_tokens / max(verify_steps, 1):.2f}")
    progress.finish(f"top-1 agreement {agree:.1%}, tau {new_tokens / max(verify_steps, 1):.2f}")
    policy_tau = policy_tokens / max(policy_steps, 1) if own_pair is not None else None
    return Evaluation(agree, kl, new_tokens / max(verify_steps, 1), new_tokens, verify_steps, len(prompts), identical,
                      policy_tau, {name: round(seconds, 3) for name, seconds in timings.items()})


def draft_in_target_dtype(student):
    """The draft for measuring: itself in float32 runs, else a copy in the target's dtype (the float32
    master weights stay for training)."""
    if student.target.dtype == torch.float32:
        return student
    twin = copy.copy(student)
    twin.module = copy.deepcopy(student.module).to(student.target.dtype)
    return twin
