"""Train the embedded demo pair: a small Python code-completion target and draft, offline, on CPU.

    python examples/train_demo_pair.py                      # writes model_cards/swiftspec-demo-pystdlib
    python examples/train_demo_pair.py --target-steps 20 --draft-steps 20 --out /tmp/smoke   # a quick smoke run

The corpus is the running interpreter's own standard library source (every machine with Python
has it, no download), test suites excluded. A byte-level BPE tokenizer (the `tokenizers`
library) is trained on it; a Llama-architecture target (~11.6M parameters) is trained next-token
on random 256-token windows, and a one-layer draft (~1.2M) sharing the tokenizer is distilled from
it. Files are split into train and held-out by a hash of their path, so the held-out loss and the
tau measurement see code neither model trained on. About 22 minutes on one CPU thread of a shared
2-core machine (target 16 min, draft 5 min, the rest tokenizer, evaluation and tau).

Everything is seeded and runs on one thread, so the same Python version (the corpus is its
stdlib) and the same torch build reproduce the same weights. The result is a pair repo exactly as
it would be published: config.json, tokenizer, generation_config.json, README.md model card with
the measured held-out losses and tau, and the two members under target/ and draft/ as fp16
safetensors.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.pair import DEMO_PAIR_NAME, PairCard

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "model_cards" / DEMO_PAIR_NAME
SAMPLE_PROMPT = "def read_config(path):\n"
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>"]  # ids 0 and 1: end of file (also BOS), padding
HELDOUT_PERCENT = 5
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class ModelShape:
    """A Llama model's size (heads of 64 dimensions)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int


# ~11.6M and ~1.2M parameters with a 4096-token vocabulary and tied embeddings. On one CPU thread
# the target trains at ~1100 tokens/s, so it sees only ~1.2M tokens; shallow and wide, it learns
# far faster per token than a deep narrow model of the same size (which sat on the unigram
# plateau for the first 200 steps). The draft has a single layer: a forward costs ~0.4 ms against
# the target's ~4 ms on one thread, and it is distilled from the target (its soft labels), which
# is what acceptance needs.
TARGET_SHAPE = ModelShape(hidden=448, layers=4, intermediate=1216, heads=7)
DRAFT_SHAPE = ModelShape(hidden=192, layers=1, intermediate=512, heads=3)


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    lr: float
    batch_size: int = 8
    warmup: int = 50
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    # Wall-time budget: training ends at `steps` or after this many seconds, whichever comes first, the
    # cosine following whichever is further along (for a GPU run of a set length; no longer reproducible).
    seconds: float | None = None


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines the result; printed into the model card."""

    seed: int = 0
    vocab_size: int = 4096
    context: int = 256  # training window = max_position_embeddings: the models never see farther
    target_steps: int = 600
    draft_steps: int = 400
    target_lr: float = 3e-3
    draft_lr: float = 4e-3
    eval_windows: int = 64
    tau_prompts: int = 24
    tau_new_tokens: int = 96
    # What examples/gpu_session.py changes for a larger pair on a GPU (and for its quick smoke run).
    target_shape: ModelShape = TARGET_SHAPE
    draft_shape: ModelShape = DRAFT_SHAPE
    batch_size: int = 8
    target_seconds: float | None = None  # TrainSettings.seconds of each member
    draft_seconds: float | None = None
    corpus_files: int | None = None  # the first N files of each split (training, held-out) only; None: all
    device: str = "cpu"  # a CUDA device trains under bf16 autocast (fp32 weights)
    # Speculation settings written into the pair's config.json (SwiftSpecConfig fields). Width 2
    # grows deeper trees than the default 8: on 10 held-out prompts it measured tau 3.18 against
    # 2.62, and the best CPU speed-up of the budgets (4-16) and widths (2-8) tried.
    tree_budget: int = 8
    draft_width: int = 2
    draft_depth: int | None = None


# ---------------------------------------------------------------- corpus and tokenizer


def stdlib_files() -> list[Path]:
    """The interpreter's standard library .py files in a fixed order, test suites excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(path: Path) -> bool:
    """A stable ~5% of files, chosen by a hash of the path relative to the stdlib root."""
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def read_sources(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str], vocab_size: int, context: int):
    """Byte-level BPE (GPT-2 style pre-tokenisation) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        model_max_length=context,
        clean_up_tokenization_spaces=False,
    )


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream (N,): each file preceded by <|endoftext|>."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.append(eos)
        ids += tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids  # whole files: no length cap
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- models and training


def build_model(shape: ModelShape, tokenizer, context: int, seed: int):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def random_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, length) windows at random offsets of the stream (N,)."""
    starts = torch.randint(0, tokens.numel() - length, (batch,), generator=generator)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


def learning_rate(step: int, settings: TrainSettings, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio (over the steps, or the seconds if further along)."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    if settings.seconds:
        progress = min(1.0, max(progress, elapsed_s / settings.seconds))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the teacher's next-token distribution; logits (B, T, V)."""
    return -(torch.softmax(teacher_logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def train(model, tokens: torch.Tensor, settings: TrainSettings, context: int, seed: int, name: str, teacher=None) -> int:
    """AdamW on random windows of the token stream: next-token loss, or with a teacher its soft labels.
    Runs on the model's device; returns the steps taken (fewer than settings.steps when time ran out)."""
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    device = model.device
    start = time.perf_counter()
    step = 0
    while step < settings.steps and not (settings.seconds and time.perf_counter() - start >= settings.seconds):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings, time.perf_counter() - start)
        batch = random_windows(tokens, settings.batch_size, context, generator).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if teacher is None:
                loss = model(input_ids=batch, labels=batch).loss
            else:
                with torch.no_grad():
                    teacher_logits = teacher(input_ids=batch).logits
                loss = distillation_loss(model(input_ids=batch).logits, teacher_logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == settings.steps - 1:
            print(f"[{name}] step {step:5d}/{settings.steps}  loss {loss.item():.3f}  "
                  f"{time.perf_counter() - start:6.0f}s", flush=True)
        step += 1
    model.eval()
    return step


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, context: int, windows: int) -> float:
    """Mean next-token cross-entropy (nats) over `windows` evenly spaced held-out windows."""
    starts = torch.linspace(0, tokens.numel() - context - 1, windows).long().tolist()
    windows = [tokens[s : s + context][None].to(model.device) for s in starts]
    losses = [model(input_ids=w, labels=w).loss for w in windows]
    return float(torch.stack(losses).mean())


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- measuring the pair


def heldout_prompts(texts: list[str], count: int) -> list[str]:
    """Beginnings of functions in held-out files: the signature line and the line after it."""
    prompts = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
                prompts.append(line + lines[i + 1])
                break
        if len(prompts) == count:
            break
    return prompts


@dataclass
class TauMeasurement:
    prompts: int
    new_tokens: int
    verify_steps: int
    target_forwards: int
    identical: bool
    swiftspec_s: float
    target_s: float

    @property
    def tau(self) -> float:
        return self.new_tokens / self.verify_steps

    @property
    def speedup(self) -> float:
        return self.target_s / self.swiftspec_s


def measure_tau(model, tokenizer, prompts: list[str], new_tokens: int) -> TauMeasurement:
    """Greedy generate(swiftspec=True) on each prompt, checked against target.generate, timed side by side."""
    m = TauMeasurement(len(prompts), 0, 0, 0, True, 0.0, 0.0)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        start = time.perf_counter()
        expected = model.generate(ids, swiftspec=False, **kwargs)
        m.target_s += time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, swiftspec=True, **kwargs)
        m.swiftspec_s += time.perf_counter() - start
        stats = model.swiftspec_stats
        m.identical &= out.tolist() == expected.tolist()
        m.new_tokens += stats.new_tokens
        m.verify_steps += stats.verify_steps
        m.target_forwards += stats.target_forwards
    return m


# ---------------------------------------------------------------- the pair repo


@dataclass(frozen=True)
class Training:
    """How one member's training went."""

    steps: int
    seconds: float


@dataclass
class PairFacts:
    """What write_pair measured on the members as shipped."""

    sizes: dict  # train_tokens, heldout_tokens, target_params, draft_params
    losses: dict  # held-out loss (nats per token) by role
    tau: TauMeasurement


def demo_card(settings: DemoSettings, facts: PairFacts, training: dict[str, Training], sample: str) -> PairCard:
    """The model card: what the pair is, its measured facts, and how to reproduce them."""
    sizes, losses, tau = facts.sizes, facts.losses, facts.tau
    where = "one CPU thread" if settings.device == "cpu" else settings.device
    acceptance = (
        f"Greedy, {tau.prompts} held-out prompts (the start of a function from each of the first held-out files) x "
        f"{settings.tau_new_tokens} new tokens, float32, {where}, the tree settings above: **tau = {tau.tau:.2f}** "
        f"tokens per target verification ({tau.new_tokens} tokens / {tau.verify_steps} verifications); output "
        f"identical to `target.generate`: {tau.identical}. Wall time {tau.swiftspec_s:.1f}s against {tau.target_s:.1f}s "
        f"for the target alone, a speed-up of {tau.speedup:.2f}x on the training machine (a shared 2-core CPU; CPU "
        "timings vary from run to run, `swiftspec generate --compare` measures yours)."
    )
    training = (
        f"Corpus: the source of the Python {platform.python_version()} standard library (test suites excluded), "
        f"{HELDOUT_PERCENT}% of the files held out by a hash of their path: {sizes['train_tokens']:,} training and "
        f"{sizes['heldout_tokens']:,} held-out tokens. Tokenizer: byte-level BPE with {settings.vocab_size} tokens, "
        f"trained on the training files. Target: Llama, {sizes['target_params'] / 1e6:.1f}M parameters "
        f"({asdict(settings.target_shape)}), {training['target'].steps} steps on the corpus; draft: Llama, "
        f"{sizes['draft_params'] / 1e6:.2f}M parameters ({asdict(settings.draft_shape)}), {training['draft'].steps} steps "
        f"distilled from the target (cross-entropy against the target's next-token distribution on the same corpus). "
        f"Both: batches of {settings.batch_size} x {settings.context}-token windows, AdamW, warm-up then cosine decay, "
        f"tied embeddings, context {settings.context} tokens, seed {settings.seed}, {where} "
        f"({training['target'].seconds / 60:.0f} min target, {training['draft'].seconds / 60:.0f} min "
        f"draft on a shared 2-core machine). Weights ship as fp16 safetensors.\n\n"
        f"**Held-out loss** (nats per token, {settings.eval_windows} windows of {settings.context} tokens, fp16 weights "
        f"as shipped): target {losses['target']:.3f}, draft {losses['draft']:.3f}."
    )
    return PairCard(
        title="SwiftSpec demo pair: Python code completion, trained on the standard library",
        summary=(
            "A tiny target/draft pair that ships inside hf_swiftspec so that `swiftspec generate` shows lossless "
            "tree speculation on any machine, offline and without a GPU. Both models were trained from scratch on "
            "the Python standard library's own source; they complete Python code, roughly. A demonstration of the "
            "mechanism, not a useful code model."
        ),
        license="apache-2.0",
        tags=("code", "python", "demo"),
        sections=(
            ("Bundled", "`swiftspec generate` uses this pair by default; from Python: "
             "`SwiftSpecForCausalLM.from_pretrained(hf_swiftspec.pair.bundled_pair(\"" + DEMO_PAIR_NAME + "\"))`."),
            ("Measured acceptance", acceptance),
            ("Example", f"Greedy completion of `{SAMPLE_PROMPT!r}` (64 new tokens):\n\n```python\n{sample}\n```"),
            ("Training", training),
            ("Recommended placement", "One device for both models (the serial engine): they are far too small to split."),
            ("Reproduce", "```bash\npython examples/train_demo_pair.py --target-steps "
             f"{settings.target_steps} --draft-steps {settings.draft_steps} --seed {settings.seed}\n```\n\n"
             "Same Python version (the corpus is its standard library), same torch build, one thread."),
        ),
    )


def save_member(model, folder: Path, tokenizer) -> None:
    """fp16 safetensors with the tokenizer beside them, so each member also loads on its own."""
    model.to(torch.float16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.to(torch.float32)  # the target goes on to teach the draft


@dataclass
class Corpus:
    tokenizer: object
    train_tokens: torch.Tensor  # (N,)
    heldout_tokens: torch.Tensor  # (M,)
    heldout_texts: list[str]


def prepare_corpus(settings: DemoSettings) -> Corpus:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # polite, and the BPE merges come out the same
    files = stdlib_files()
    train_texts = read_sources([p for p in files if not is_heldout(p)][: settings.corpus_files])
    heldout_texts = read_sources([p for p in files if is_heldout(p)][: settings.corpus_files])
    print(f"corpus: {len(train_texts)} training files, {len(heldout_texts)} held-out files", flush=True)
    tokenizer = train_tokenizer(train_texts, settings.vocab_size, settings.context)
    corpus = Corpus(tokenizer, encode_corpus(tokenizer, train_texts), encode_corpus(tokenizer, heldout_texts), heldout_texts)
    print(f"tokens: {corpus.train_tokens.numel():,} training, {corpus.heldout_tokens.numel():,} held out", flush=True)
    return corpus


def train_members(settings: DemoSettings, corpus: Corpus, out: Path) -> dict[str, Training]:
    """Train (on settings.device) and save target/ and draft/ under `out`; returns how each went."""
    roles = {
        "target": (settings.target_shape, settings.target_steps, settings.target_lr, settings.target_seconds),
        "draft": (settings.draft_shape, settings.draft_steps, settings.draft_lr, settings.draft_seconds),
    }
    training, trained = {}, {}
    for i, (role, (shape, steps, lr, seconds)) in enumerate(roles.items()):
        model = build_model(shape, corpus.tokenizer, settings.context, settings.seed + i).to(settings.device)
        train_settings = TrainSettings(steps, lr, batch_size=settings.batch_size, seconds=seconds)
        start = time.perf_counter()
        teacher = trained.get("target")  # the draft learns the target's distribution, not the corpus
        taken = train(model, corpus.train_tokens, train_settings, settings.context, settings.seed + 10 + i, role, teacher)
        training[role] = Training(taken, time.perf_counter() - start)
        trained[role] = model
        save_member(model, out / role, corpus.tokenizer)
    return training


def write_pair(settings: DemoSettings, corpus: Corpus, out: Path, training: dict[str, Training]) -> PairFacts:
    """Load the members as shipped (onto settings.device), measure them, and write the pair repo around them."""
    from transformers import AutoModelForCausalLM

    members = {
        role: AutoModelForCausalLM.from_pretrained(out / role, dtype=torch.float32).to(settings.device)
        for role in ("target", "draft")
    }
    tree = dict(tree_budget=settings.tree_budget, draft_width=settings.draft_width, draft_depth=settings.draft_depth)
    pair = SwiftSpecForCausalLM.from_models(members["target"], members["draft"], tokenizer=corpus.tokenizer, **tree)
    pair.config.target, pair.config.draft = "target", "draft"  # the folders beside config.json
    losses = {role: heldout_loss(m, corpus.heldout_tokens, settings.context, settings.eval_windows) for role, m in members.items()}
    print(f"held-out loss: target {losses['target']:.3f}, draft {losses['draft']:.3f}", flush=True)
    prompts = heldout_prompts(corpus.heldout_texts, settings.tau_prompts)
    tau = measure_tau(pair, corpus.tokenizer, prompts, settings.tau_new_tokens)
    print(f"tau {tau.tau:.2f}, identical {tau.identical}, speed-up {tau.speedup:.2f}x", flush=True)
    sizes = dict(
        train_tokens=corpus.train_tokens.numel(),
        heldout_tokens=corpus.heldout_tokens.numel(),
        target_params=param_count(members["target"]),
        draft_params=param_count(members["draft"]),
    )
    facts = PairFacts(sizes, losses, tau)
    ids = corpus.tokenizer(SAMPLE_PROMPT, return_tensors="pt").input_ids.to(pair.device)
    sample = corpus.tokenizer.decode(pair.generate(ids, max_new_tokens=64, do_sample=False)[0])
    pair.save_pretrained(out, card=demo_card(settings, facts, training, sample), pin_revisions=False,
                         load_id=f"model_cards/{DEMO_PAIR_NAME}")
    return facts


def parse_args(argv=None) -> tuple[DemoSettings, Path, int]:
    defaults = DemoSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="pair repo folder to write (default: %(default)s)")
    parser.add_argument("--target-steps", type=int, default=defaults.target_steps)
    parser.add_argument("--draft-steps", type=int, default=defaults.draft_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 reproduces the shipped weights)")
    args = parser.parse_args(argv)
    settings = DemoSettings(seed=args.seed, target_steps=args.target_steps, draft_steps=args.draft_steps)
    return settings, args.out, args.threads


def main(argv=None) -> None:
    settings, out, threads = parse_args(argv)
    torch.set_num_threads(threads)
    print(f"training the demo pair into {out} (python {sys.version.split()[0]}, torch {torch.__version__})", flush=True)
    corpus = prepare_corpus(settings)
    facts = write_pair(settings, corpus, out, train_members(settings, corpus, out))
    print(f"wrote {out}")
    if not facts.tau.identical:
        raise SystemExit("speculative output differed from target.generate: the demo pair is not lossless")


if __name__ == "__main__":
    main()
