"""The training loop of `swiftspec distill`: the objective (KL to the target's top-k next-token
distribution), students (a draft model, an EAGLE-3 head), the plan of a run (fixed steps, or as many as
--minutes allow), checkpoints that resume exactly (a Ctrl-C inside a step included), and rank 0 alone
writing under torchrun.

The objective: at each position the target's distribution is kept as its k most likely tokens plus one
tail bucket holding the rest of its mass, and the student's distribution is folded the same way (its
probability of those k tokens, and of everything else); the loss is the KL divergence between the two
(k + 1)-way distributions. What the teacher contributes per position is k values and k ids instead of
a vocabulary-sized row, and with k = V it is the full KL.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from ..drafters.eagle3 import FeatureTap
from .distill_corpus import DistillError
from .distill_data import random_windows
from .distill_progress import Clock, Progress
from .eagle3_training import ttt_levels


# ---------------------------------------------------------------- the objective


@dataclass
class TopK:
    """The target's next-token distribution, kept as its k likeliest tokens."""

    logprobs: torch.Tensor  # (B, T, k) float32, descending
    ids: torch.Tensor  # (B, T, k)

    def __getitem__(self, index) -> "TopK":
        return TopK(self.logprobs[index], self.ids[index])


def teacher_topk(logits: torch.Tensor, k: int) -> TopK:
    """logits (B, T, V) -> the top-k of their log-softmax, in float32 (the top-k of the logits themselves, less
    their logsumexp: no vocabulary-sized log-softmax is written)."""
    logits = logits.float()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return TopK(values - logits.logsumexp(-1, keepdim=True), ids)


class TopKKL(torch.autograd.Function):
    """topk_kl's value and gradient, written out: autograd through log_softmax, a mask of the top-k, a masked copy
    and the tail's logsumexp kept several vocabulary-sized tensors a step and took as long as the head's matmul;
    this keeps one (the exponentials) beside the logits.

    With q the student's softmax, p_tail the teacher's tail and q_tail the student's, the gradient of one position's
    KL is q_j - p_j on the teacher's top-k and q_j (1 - p_tail - p_tail (1 - q_tail) / q_tail) on the rest."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        z = logits.float()  # (B, T, V)
        top = z.amax(-1, keepdim=True)
        e = (z - top).exp_()  # (B, T, V): exp(z - max), the top-k zeroed below
        total = e.sum(-1)  # (B, T)
        e_k = e.gather(-1, ids)  # (B, T, k)
        tail = e.scatter_(-1, ids, 0.0).sum(-1)  # (B, T): the rest, summed on its own (no cancellation)
        logq_k = z.gather(-1, ids) - top - total.log()[..., None]
        logq_tail = tail.log() - total.log()  # -inf where the top-k is the whole vocabulary
        p_k = logprobs.exp()
        p_tail = (-torch.expm1(logprobs.logsumexp(-1))).clamp_min(0)  # 1 - sum(p_k), without cancellation
        head = (p_k * (logprobs - logq_k)).sum(-1)
        # k = V leaves no tail: the student's is log(0), the teacher's rounding noise, and their term is 0
        tail_term = torch.xlogy(p_tail, p_tail) - p_tail * logq_tail.nan_to_num(neginf=0.0)
        ctx.save_for_backward(e, total, tail, e_k, p_k, p_tail, ids)
        ctx.dtype = logits.dtype
        return (head + tail_term).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        e, total, tail, e_k, p_k, p_tail, ids = ctx.saved_tensors
        scale = torch.where(tail > 0, (1 - p_tail) - p_tail * e_k.sum(-1) / tail.clamp_min(torch.finfo(tail.dtype).tiny), 0.0)
        g = e.mul_((scale / total)[..., None])  # (B, T, V): the rest (e is not needed again)
        g.scatter_(-1, ids, e_k / total[..., None] - p_k)
        return (g * (grad / total.numel())).to(ctx.dtype), None, None


def topk_kl(logits: torch.Tensor, teacher: TopK) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) over the teacher's top-k tokens and one tail bucket.

    logits (B, T, V): the student's; teacher: (B, T, k)."""
    return TopKKL.apply(logits, teacher.logprobs, teacher.ids)


def agreement(logits: torch.Tensor, teacher: TopK) -> torch.Tensor:
    """Share of positions where the student's argmax is the target's (its top-1)."""
    return (logits.argmax(-1) == teacher.ids[..., 0]).float().mean()


# ---------------------------------------------------------------- students


class ModelStudent:
    """A draft causal LM learning the target's distribution position by position."""

    kind = "model"

    def __init__(self, draft, target, top_k: int):
        self.module, self.target, self.top_k = draft, target, top_k
        self.vocab = min(target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0])

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def teacher(self, ids: torch.Tensor) -> TopK:
        return teacher_topk(self.target(ids).logits[..., : self.vocab], self.top_k)

    def step(self, ids: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, top-1 agreement) on windows ids (B, N)."""
        return self.learn(ids, self.teacher(ids), autocast)

    def learn(self, ids: torch.Tensor, teacher: TopK, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, top-1 agreement) on windows ids (B, N) whose teacher is given (computed once, kept)."""
        with autocast:
            logits = self.module(ids).logits[..., : self.vocab]
        return topk_kl(logits, teacher), agreement(logits.detach(), teacher)


class HeadStudent:
    """An EAGLE-3 head learning the target's distribution through `depth` levels of training-time test
    (eagle3_training.ttt_levels); agreement is depth 1's."""

    kind = "eagle3"

    def __init__(self, head, target, top_k: int, depth: int = 3, decay: float = 0.8):
        if head.config.draft_vocab_size != head.config.vocab_size:
            raise DistillError("distill trains EAGLE-3 heads over the target's full vocabulary (draft_vocab_size = vocab_size).")
        self.module, self.target, self.top_k, self.depth, self.decay = head, target, top_k, depth, decay

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        shared = getattr(self.module, "shares_embeddings", False)
        return [(n, p) for n, p in self.module.named_parameters() if not (shared and n.startswith("embed_tokens"))]

    @torch.no_grad()
    def teacher(self, ids: torch.Tensor) -> tuple[torch.Tensor, TopK]:
        """(the target's states at the head's layers (B, N, 3H), its top-k (B, N, k))."""
        with FeatureTap(self.target, self.module.layer_ids) as tap:
            logits = self.target(ids).logits
            return tap.take(), teacher_topk(logits, self.top_k)

    def step(self, ids: torch.Tensor, autocast) -> tuple[torch.Tensor, torch.Tensor]:
        return self.learn(ids, self.teacher(ids), autocast)

    def learn(self, ids: torch.Tensor, taught: tuple[torch.Tensor, TopK], autocast) -> tuple[torch.Tensor, torch.Tensor]:
        states, teacher = taught
        M = ids.shape[1] - self.depth
        total, first = 0.0, None
        with autocast:
            for s, logits in enumerate(ttt_levels(self.module, ids, states, self.depth), start=1):
                level = teacher[:, s : s + M]
                total = total + self.decay ** (s - 1) * topk_kl(logits, level)
                if first is None:
                    first = agreement(logits.detach(), level)
        return total, first


# ---------------------------------------------------------------- settings, world, progress


@dataclass(frozen=True)
class TrainSettings:
    """What decides the trained weights (a checkpoint records them; --resume refuses others)."""

    steps: int | None = None  # None: DEFAULT_STEPS, or as many as `minutes` allow
    minutes: float | None = None  # train until this many minutes of training are spent (the schedule sized to it)
    batch: int | None = None  # windows per step, over all ranks (None: the draft's recipe, RECIPES)
    window: int | None = None  # tokens per window (None: the draft's recipe)
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.0
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    top_k: int = 64
    seed: int = 0

    @property
    def fixed_steps(self) -> int | None:
        """The run's steps when they are fixed in advance (None under `minutes`)."""
        if self.minutes is not None:
            return None
        return DEFAULT_STEPS if self.steps is None else self.steps

    def learning_rate(self, step: int, total: int) -> float:
        """Linear warm-up, then a cosine from lr to lr * min_lr_ratio at step `total`."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = min((step - self.warmup) / max(total - self.warmup, 1), 1.0)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


DEFAULT_STEPS = 400
# (batch, window) by the kind of starting draft. A new small draft (tuned on the demo target): 8 x 256. An early exit
# starts from the target's own layers and learns from its first steps: more, smaller steps in the same minutes.
RECIPES = {"early-exit": (4, 192)}
DEFAULT_RECIPE = (8, 256)


def with_recipe(settings: TrainSettings, draft: str) -> TrainSettings:
    """`settings` with the batch and window not given taken from the draft's recipe."""
    batch, window = RECIPES.get(draft.split(":")[0], DEFAULT_RECIPE)
    return replace(settings, batch=batch if settings.batch is None else settings.batch,
                   window=window if settings.window is None else settings.window)


@dataclass(frozen=True)
class World:
    """This process's place among torchrun / accelerate launch ranks (rank 0 of 1 without them)."""

    rank: int = 0
    size: int = 1

    @property
    def writes(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "World":
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def average_gradients(self, params) -> None:
        """Every rank ends the step with the mean gradient, so all ranks hold the same weights."""
        if self.size == 1:
            return
        import torch.distributed as dist

        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.size)

    def rank0s(self, value: int) -> int:
        """Rank 0's `value` on every rank: under --minutes each rank times its own steps, but the plan (the
        learning rate's schedule, when to stop) must be one, or the ranks' weights part and a collective hangs."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        held = torch.tensor([int(value)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(held, 0)
        return int(held.item())

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


@dataclass
class History:
    """Per-step figures, saved in checkpoints so that a resumed run reports (and plans) the whole run."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    agreements: list[float] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)
    seconds: float = 0.0  # wall time of training so far, over all resumed segments
    timed_steps: int = 0
    planned: int = 0  # the steps the run means to take: fixed, or (under --minutes) what the time left allowed when last planned
    budget_s: float | None = None  # --minutes: the training seconds the first segment was given

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.timed_steps, 1)

    def recent(self, n: int = 50) -> tuple[float, float]:
        tail = slice(-n, None)
        losses, agree = self.losses[tail], self.agreements[tail]
        return sum(losses) / max(len(losses), 1), sum(agree) / max(len(agree), 1)


class Interrupts:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt at once, except while `updating()` holds (the optimizer writing
    the weights, and the step's bookkeeping): then as it ends. So a Ctrl-C lands either before a step's update,
    and the step is dropped whole, or after it; the checkpoint it writes never holds half a step. Only the main
    thread can take signals; elsewhere the handler is left as it is."""

    def __init__(self):
        self.holding = self.pending = False
        self.previous = None

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None:
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def handle(self, signum, frame) -> None:
        if self.holding:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def updating(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


@dataclass
class Plan:
    """How many steps a run takes: settings.fixed_steps, or under --minutes as many as the time left allows at the
    median of the last steps' seconds, planned again after every step (so that the cosine ends when the time does,
    however the machine's speed changes)."""

    settings: TrainSettings
    step_s: float | None = None  # the seconds one step is expected to take before any is measured (a trial step)
    budget_s: float | None = None  # under --minutes: the training's seconds
    recent: deque = field(default_factory=lambda: deque(maxlen=9))  # the last steps' seconds

    def start(self, history: History) -> None:
        if self.settings.fixed_steps is not None:
            history.planned = self.settings.fixed_steps
        elif history.budget_s is None:  # (a resumed run keeps the first segment's budget)
            history.budget_s = self.settings.minutes * 60 if self.budget_s is None else self.budget_s
            history.planned = self.steps_left(history, self.step_s) if self.step_s else 0

    def steps_left(self, history: History, step_s: float) -> int:
        return history.step + max(int((history.budget_s - history.seconds) / max(step_s, 1e-9)), 0)

    def took(self, history: History, seconds: float) -> None:
        """A step ended after `seconds`; under --minutes, plan again."""
        self.recent.append(seconds)
        if self.settings.fixed_steps is None:
            history.planned = self.steps_left(history, statistics.median(self.recent))

    def done(self, history: History) -> bool:
        if self.settings.fixed_steps is not None:
            return history.step >= history.planned
        if history.step == 0 and not history.planned:
            return history.budget_s <= 0
        return history.step >= history.planned or history.seconds >= history.budget_s


# ---------------------------------------------------------------- checkpoints


CHECKPOINT_FILES = ("weights.safetensors", "optimizer.safetensors", "trainer_state.json")


def checkpoint_folders(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    found = [p for p in root.glob("step-*") if all((p / f).is_file() for f in CHECKPOINT_FILES)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(root: Path, module, optimizer, data_rng: torch.Generator, history: History, fingerprint: dict,
                    keep: int = 2) -> Path:
    """root/step-N: the weights, the optimizer's tensors and both random states (safetensors), and the step,
    history and settings (json). Written beside and moved into place, so a crash leaves no half checkpoint."""
    folder = root / f"step-{history.step:07d}"
    partial = root / f".{folder.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_model(module, str(partial / "weights.safetensors"))
    state = optimizer.state_dict()
    tensors = {f"optimizer.{i}.{name}": value.detach().cpu().contiguous() for i, slots in state["state"].items()
               for name, value in slots.items()}
    tensors["rng.torch"] = torch.get_rng_state()
    tensors["rng.data"] = data_rng.get_state()
    save_file(tensors, str(partial / "optimizer.safetensors"))
    meta = {"step": history.step, "history": asdict(history), "param_groups": state["param_groups"], "settings": fingerprint}
    (partial / "trainer_state.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    for old in checkpoint_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(folder: Path, module, optimizer, data_rng: torch.Generator, fingerprint: dict) -> History:
    """Restore what save_checkpoint wrote; DistillError if it was written with other settings."""
    meta = json.loads((folder / "trainer_state.json").read_text())
    differ = {k: (meta["settings"].get(k), v) for k, v in fingerprint.items() if meta["settings"].get(k) != v}
    if differ:
        listed = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise DistillError(
            f"--resume: the checkpoint {folder} was written by a run with other settings ({listed}). Resume with the "
            "same settings, or write to a new output folder."
        )
    load_model(module, str(folder / "weights.safetensors"))
    tensors = load_file(str(folder / "optimizer.safetensors"))
    slots: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            slots.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    data_rng.set_state(tensors["rng.data"])
    return History(**meta["history"])


# ---------------------------------------------------------------- the loop


def make_optimizer(student, settings: TrainSettings) -> torch.optim.Optimizer:
    named = student.trainable()
    decay = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95),
    )


def autocast_for(dtype: torch.dtype, device: torch.device):
    """bf16 / fp16 forwards with float32 weights and optimizer (mixed precision); float32: plain."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def train(student, stream: torch.Tensor, settings: TrainSettings, checkpoints: Path, fingerprint: dict,
          progress: Progress, resume: bool = False, save_every: int = 100, dtype: torch.dtype = torch.float32,
          world: World = World(), on_step: Callable[[History], None] | None = None, clock: Clock = time.monotonic,
          step_s: float | None = None, budget_s: float | None = None) -> History:
    """Train `student` on windows of `stream` (N,) for settings' steps (or minutes); returns the run's history.

    Every `save_every` steps, at the end, and on KeyboardInterrupt (Ctrl-C, then re-raised) rank 0 writes
    a checkpoint under `checkpoints`; resume=True starts from the latest one there and, with the same
    settings and seed, ends with exactly the weights of an uninterrupted run (a Ctrl-C inside a step drops
    that step whole: its windows are drawn again on resume). on_step(history) runs after each step (tests
    interrupt a run from it). clock: the time, for --minutes and the progress line (tests give their own);
    step_s: a trial step's seconds, to plan a --minutes run before its first step; budget_s: its training
    seconds (default: all of settings.minutes).
    """
    if settings.batch is None or settings.window is None:
        raise ValueError(f"train() needs the batch and window settled (with_recipe); got {settings}.")
    module = student.module
    device = next(module.parameters()).device
    torch.manual_seed(settings.seed)
    data_rng = torch.Generator().manual_seed(settings.seed)
    optimizer = make_optimizer(student, settings)
    params = [p for _, p in student.trainable()]
    history = History()
    found = checkpoint_folders(checkpoints) if resume else []
    if found:
        history = load_checkpoint(found[-1], module, optimizer, data_rng, fingerprint)
        progress.note(f"resumed from {found[-1]} at step {history.step}")
    plan = Plan(settings, step_s, budget_s)
    plan.start(history)
    autocast = autocast_for(dtype, device)
    module.train()

    def checkpoint() -> None:
        if world.writes:
            where = save_checkpoint(checkpoints, module, optimizer, data_rng, history, fingerprint)
            progress.note(f"checkpoint {where}")

    progress.start("train", history.planned, "steps",
                   left=history.budget_s - history.seconds if history.budget_s is not None else None)
    progress.phase.done = history.step
    with Interrupts() as interrupts:
        try:
            while not world.rank0s(plan.done(history)):
                one_step(student, stream, settings, optimizer, params, data_rng, history, plan, autocast, world,
                         interrupts, clock)
                progress.retotal(history.planned)
                loss, agree = history.recent()
                left = history.budget_s - history.seconds if history.budget_s is not None else None
                progress.advance(1, f"loss {loss:.4f}  top-1 agreement {agree:.1%}  {history.seconds_per_step:.2f} s/step", left)
                if on_step is not None:
                    on_step(history)
                if history.step % save_every == 0 and not plan.done(history):
                    started = clock()
                    checkpoint()
                    history.seconds += clock() - started
        except KeyboardInterrupt:
            progress.note(f"interrupted at step {history.step}; writing a last checkpoint (continue with --resume)")
            checkpoint()
            raise
    checkpoint()
    progress.finish(f"loss {history.recent()[0]:.4f}, top-1 agreement {history.recent()[1]:.1%} over the last 50 steps")
    module.eval()
    return history


def one_step(student, stream, settings: TrainSettings, optimizer, params, data_rng: torch.Generator, history: History,
             plan: Plan, autocast, world: World, interrupts: Interrupts, clock: Clock) -> None:
    """One optimizer step on a batch of windows. A KeyboardInterrupt before its update puts the random states
    back as the step found them, so the checkpoint that follows resumes with this very step."""
    started = clock()
    states = data_rng.get_state(), torch.get_rng_state()
    lr = settings.learning_rate(history.step, history.planned)
    try:
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = random_windows(stream, settings.batch, settings.window, data_rng)[world.rank :: world.size]
        loss, agree = student.step(ids.to(next(student.module.parameters()).device), autocast)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        world.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        loss, agree = loss.item(), agree.item()
    except KeyboardInterrupt:
        data_rng.set_state(states[0])
        torch.set_rng_state(states[1])
        raise
    with interrupts.updating():
        optimizer.step()
        history.step += 1
        history.timed_steps += 1
        history.losses.append(loss)
        history.agreements.append(agree)
        history.learning_rates.append(lr)
        seconds = clock() - started
        history.seconds += seconds
        plan.took(history, seconds)
        history.planned = world.rank0s(history.planned)
