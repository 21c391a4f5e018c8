"""`swiftspec distill`: train a draft that agrees with the user's own target, and write a pair folder.

    distill(DistillConfig(target="my/target", output="my-pair", data=("corpus/",), train=TrainSettings(minutes=30)))

1. check every input (numbers, the draft's vocabulary, the data, the output folder) and read the data
   (distill_corpus.py) before any weights load;
2. load the target and the starting draft (distill_drafts.py: by default a new small model of the target's
   architecture), time a trial step and a trial generation, and print the run's plan with its ETA;
3. tokenise the data (distill_data.py: chat templates applied), and have the target answer the
   conversations' prompts (self-distillation);
4. measure the starting draft on held-out data (distill_eval.py);
5. train (distill_train.py: top-k KL to the target, for --steps or as many as --minutes allow, checkpoints,
   --resume, Ctrl-C);
6. measure the trained draft (with fixed trees, and as the pair will run), write the pair folder
   (distill_report.py: `swiftspec pair create`'s layout and settings, a model card saying what to expect),
   time it against target.generate and prompt lookup when given a `speed` function (the command line's
   runs `swiftspec bench`), and optionally push it to the Hub.

Every phase shows its progress and the whole run's ETA (distill_progress.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..pair import HubOptions, PairConfigError, check_compatibility, load_tokenizer
from ..pair.checks import shares_vocabulary
from .distill_budget import (
    MARGIN_SHARE,
    Sizing,
    Trial,
    after_training,
    budget_warning,
    check_budget,
    estimates,
    size_run,
    speed_prompts_left,
    training_budget,
)
from .distill_config import DRAFT_KINDS, SELF_DISTILL_AUTO_TOKENS, DistillConfig, EvalSettings
from .distill_corpus import DistillError, read_records, split_records
from .distill_data import Dataset, encode, even_windows, render, self_distilled, token_stream, tokenise, tokenise_all
from .distill_drafts import auto_draft, describe_draft, early_exit_layers, small_shape, starting_draft
from .distill_eval import References, draft_in_target_dtype, evaluate, fixed_pair
from .distill_progress import Clock, Progress, minutes
from .distill_report import DistillResult, own_pair, push, rewrite_card, write_heldout_prompts, write_pair
from .distill_train import HeadStudent, ModelStudent, World, autocast_for, train, with_recipe

__all__ = ["DRAFT_KINDS", "DistillConfig", "EvalSettings", "distill"]


# ---------------------------------------------------------------- checks, before any weights load


def check_numbers(config: DistillConfig) -> None:
    t, e = config.train, config.eval
    positive = {"--batch": t.batch, "--top-k": t.top_k, "--save-every": config.save_every, "--eval-prompts": e.prompts,
                "--eval-new-tokens": e.new_tokens, "--eval-windows": e.windows, "--head-depth": config.head_depth,
                "--record-chars": config.data_options.record_chars, "--steps": t.steps}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise DistillError(f"{flag} {value}: must be at least 1.")
    if t.minutes is not None and t.steps is not None:
        raise DistillError(f"--steps {t.steps} and --minutes {t.minutes:g}: give one (a number of steps, or the run's minutes).")
    if t.minutes is not None and t.minutes <= 0:
        raise DistillError(f"--minutes {t.minutes:g}: must be positive.")
    if t.lr <= 0:
        raise DistillError(f"--lr {t.lr}: must be positive.")
    check_window(config)
    if not 0 < config.measure_share < 1:
        raise DistillError(f"--measure-share {config.measure_share:g}: the share of --minutes the measurements may take, "
                           "above 0 and below 1 (0.15 for 15%).")
    if not 1 <= config.heldout_percent <= 50:
        raise DistillError(f"--heldout-percent {config.heldout_percent}: must be between 1 and 50.")
    if config.self_distill_tokens is not None and config.self_distill_tokens < 0:
        raise DistillError(f"--self-distill {config.self_distill_tokens}: a number of new tokens, 0 (off) or more.")


def check_window(config: DistillConfig) -> None:
    """An EAGLE-3 head's training-time test needs its levels' tokens in a window (None: the recipe's, checked later)."""
    shortest = config.head_depth + 2 if config.draft == "eagle3" else 2
    if config.train.window is not None and config.train.window < shortest:
        raise DistillError(f"--window {config.train.window}: must be at least {shortest} tokens.")


def check_output(folder: Path, config: DistillConfig) -> None:
    """The output folder must be writable, and new, empty, ours to resume, or replaced with --force."""
    if folder.exists() and not folder.is_dir():
        raise DistillError(f"output {folder} exists and is not a folder; give a new folder for the pair.")
    if folder.is_dir() and any(folder.iterdir()) and not (config.resume or config.force):
        raise DistillError(
            f"output {folder} is not empty; give a new folder, --resume to continue a run there, or --force to write over it."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".distill-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise DistillError(f"output {folder} cannot be written ({err.strerror or err}); give a folder you can write to.") from err


def check_push(config: DistillConfig) -> None:
    """--push-to-hub needs a valid repo id and a target on the Hub (a local target would load nowhere else)."""
    if config.push_to_hub is None:
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(config.push_to_hub)
    except HFValidationError as err:
        raise DistillError(f"--push-to-hub {config.push_to_hub!r} is not a Hub repo id ({err}); e.g. you/my-pair.") from err
    if Path(config.target).exists():
        raise DistillError(
            f"--push-to-hub: the target {config.target!r} is a local folder, which the pushed pair could not load from "
            "anywhere else. Push the target first and distill from its Hub id, or leave out --push-to-hub."
        )


def check_pair_settings(settings: dict) -> None:
    from ..config import SwiftSpecConfig

    try:
        SwiftSpecConfig(**settings)
    except (TypeError, ValueError) as err:
        raise DistillError(f"the pair's tree settings {settings}: {err}") from err


def target_config_and_tokenizer(target: str):
    from transformers import AutoConfig

    try:
        target_config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        raise DistillError(f"--target {target!r}: cannot read its config ({str(err).splitlines()[0]}); give a Hub id or a model folder.") from err
    tokenizer = load_tokenizer(target, None, HubOptions())
    if tokenizer is None:
        raise DistillError(f"--target {target!r} ships no tokenizer; distill needs one to read the data.")
    return target_config, tokenizer


def check_draft_model(spec: str, target_config, tokenizer) -> None:
    """A draft model must share the target's vocabulary (same tokens, same ids): refused from configs and
    tokenizers, before any weights load."""
    from transformers import AutoConfig

    try:
        draft_config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise DistillError(f"--draft {spec!r}: not {DRAFT_KINDS} ({str(err).splitlines()[0]}).") from err
    draft_tokenizer = load_tokenizer(spec, None, HubOptions())
    try:
        check_compatibility(target_config, draft_config, tokenizer, draft_tokenizer)
    except PairConfigError as err:
        raise DistillError(f"--draft {spec!r} cannot draft for the target: {err}") from err
    vocab = target_config.get_text_config().vocab_size
    if draft_tokenizer is not None and not shares_vocabulary(tokenizer, draft_tokenizer, vocab):
        raise DistillError(
            f"--draft {spec!r} has another vocabulary than the target's: distillation teaches it the target's "
            "distribution token for token, over the target's ids. Give a draft of the target's vocabulary (small, "
            "early-exit:N, or a model of its family); a pair takes this draft as it is (it proposes through text)."
        )


def check_inputs(config: DistillConfig, world: World) -> tuple[DistillConfig, str | None, list, list, object]:
    """Every check that needs no weights (DistillError naming the value and the fix); returns the config with
    --draft auto resolved (and why it chose that draft, None when it was given), the training and held-out records
    and the target's tokenizer."""
    check_numbers(config)
    check_pair_settings(config.pair_settings)
    early_exit_layers(config.draft)  # refuses a malformed early-exit:... now
    small_shape(config.draft)  # and a malformed small:...
    check_push(config)
    if world.writes:
        check_output(Path(config.output), config)
    records = read_records(config.data, config.data_options)
    if config.heldout_data:
        train_records, heldout_records = records, read_records(config.heldout_data, config.data_options)
    else:
        train_records, heldout_records = split_records(records, config.heldout_percent)
    target_config, tokenizer = target_config_and_tokenizer(config.target)
    chosen = None
    if config.draft == "auto":
        spec, chosen = auto_draft(target_config)
        config = replace(config, draft=spec)
    config = replace(config, train=with_recipe(config.train, config.draft))
    check_window(config)
    layers = early_exit_layers(config.draft)
    if layers is not None:
        total = target_config.get_text_config(decoder=True).num_hidden_layers
        if layers >= total:
            raise DistillError(f"--draft early-exit:{layers}: the target has {total} layers; keep fewer (early-exit:1 to {total - 1}).")
    elif config.draft != "eagle3" and small_shape(config.draft) is None:
        check_draft_model(config.draft, target_config, tokenizer)
    for other in config.compare_drafts:
        check_draft_model(other, target_config, tokenizer)
    return config, chosen, train_records, heldout_records, tokenizer


# ---------------------------------------------------------------- models and data


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DistillError(f"--dtype {name!r} is not a floating torch dtype; use float32, bfloat16 or float16.")
    return dtype


def resolve_device(name: str | None) -> torch.device:
    if name is not None:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load_target(location: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(location, dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    return target


def to_answer(config: DistillConfig, records: list) -> tuple[list, int]:
    """(the records the target answers, the new tokens of each answer): under auto, the conversations."""
    if config.self_distill_tokens is None:
        return [r for r in records if r.messages is not None], SELF_DISTILL_AUTO_TOKENS
    return (records if config.self_distill_tokens else []), config.self_distill_tokens


def prepare_data(config: DistillConfig, train_records, heldout_records, tokenizer, target, progress: Progress,
                 answers: int) -> tuple[Dataset, int]:
    """The tokenised data, the records the target answers (`answers` of them at most, held-out ones first: the
    measurement needs a few) replaced by its answers; and how many training records it answered. Records left
    unanswered train as they are (a conversation with its own answers)."""
    answered_records, new_tokens = to_answer(config, train_records)
    answered_heldout, _ = to_answer(config, heldout_records)
    answered_heldout = answered_heldout[:answers]
    answered_records = answered_records[: answers - len(answered_heldout)]
    answer_ids = {id(r) for r in answered_records + answered_heldout}
    plain_train = [r for r in train_records if id(r) not in answer_ids]
    plain_heldout = [r for r in heldout_records if id(r) not in answer_ids]
    progress.start("tokenise", len(plain_train) + len(plain_heldout), "records")
    train, heldout = tokenise_all(plain_train, tokenizer, progress), tokenise_all(plain_heldout, tokenizer, progress)
    progress.finish()
    if answered_records or answered_heldout:
        progress.start("self-distill", len(answered_records) + len(answered_heldout), "prompts")
        train += self_distilled(answered_records, tokenizer, target, new_tokens, progress)
        heldout += self_distilled(answered_heldout, tokenizer, target, new_tokens, progress)
        progress.finish()
    return Dataset(train, heldout), len(answered_records)


def eval_prompts(config: DistillConfig, data: Dataset, tokenizer) -> list[list[int]]:
    """Held-out prompts: from --eval-prompts-file, else each held-out record's prompt (a text's first tokens)."""
    if config.eval_prompts_file:
        records = read_records([config.eval_prompts_file], replace(config.data_options, record_chars=1 << 30))
        templated = bool(getattr(tokenizer, "chat_template", None))
        prompts = [encode(tokenizer, render(r, tokenizer, True)[0] or r.text, templated and r.messages is not None) for r in records]
    else:
        prompts = [s.ids[: s.prompt] if s.prompt else s.ids[: max(min(config.eval.prompt_tokens, len(s.ids) // 2), 1)]
                   for s in data.heldout]
    return [p for p in prompts if p][: config.eval.prompts]


# ---------------------------------------------------------------- the plan of the run


def tokenise_seconds(records: list, tokenizer, clock: Clock, sample_chars: int = 200_000) -> float:
    """The records' tokenising time, from the first of them (up to `sample_chars` characters)."""
    sample, chars = [], 0
    for record in records:
        if chars >= sample_chars:
            break
        sample.append(record)
        chars += len(record.text or json.dumps(record.messages))
    started = clock()
    for record in sample:
        tokenise(record, tokenizer)
    total = sum(len(r.text or json.dumps(r.messages)) for r in records)
    return (clock() - started) * total / max(chars, 1)


TRIAL_TOKENS = 16  # new tokens of the trial's two generations


def trial(student, config: DistillConfig, records: list, tokenizer, world: World, dtype: torch.dtype, clock: Clock) -> Trial:
    """Time one training step (the teacher, then the draft's forward and backward; no update), target.generate
    and the fixed-tree pair with the starting draft, and the tokenizer: what the plan sizes the run by."""
    target = student.target
    vocab = target.get_input_embeddings().num_embeddings
    rows = max(config.train.batch // world.size, 1)  # this rank's windows a step; the trial times one of them
    ids = torch.randint(0, vocab, (1, config.train.window), generator=torch.Generator().manual_seed(0)).to(target.device)
    started = clock()
    taught = student.teacher(ids)
    teacher_s = (clock() - started) * rows
    started = clock()
    loss, _ = student.learn(ids, taught, autocast_for(dtype, target.device))
    loss.backward()
    learn_s = (clock() - started) * rows
    for p in student.module.parameters():
        p.grad = None
    prompt = ids[:1, : config.eval.prompt_tokens]
    tokens = min(TRIAL_TOKENS, config.eval.new_tokens)
    seconds = []
    pair = fixed_pair(draft_in_target_dtype(student), tokenizer, config.eval)
    student.module.eval()
    for model in (target, pair):
        started = clock()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False)
        # per `tokens` new tokens, where the random prompt met an end of sequence sooner
        seconds.append((clock() - started) * tokens / max(out.shape[1] - prompt.shape[1], 1))
    student.module.train()
    return Trial(teacher_s, learn_s, ids.numel() * rows, seconds[0], seconds[1], tokens,
                 tokenise_seconds(records, tokenizer, clock))


def plan_line(config: DistillConfig, sizing: Sizing) -> dict[str, str]:
    """How the plan names the phases whose size the budget set."""
    e = config.eval
    measured = f"{sizing.prompts} held-out prompts x {sizing.new_tokens} tokens, {sizing.windows} windows"
    if sizing.reduced_from(e):
        measured += (f" (of --eval-prompts {e.prompts} x --eval-new-tokens {e.new_tokens}, {e.windows} windows: "
                     f"what {config.measure_share:.0%} of the minutes allows)")
    described = {"evaluate-start": f"measure the starting draft on {measured}"}
    if sizing.answers < sizing.asked_answers:
        described["self-distill"] = (f"the target answers {sizing.answers} of the {sizing.asked_answers} records' prompts "
                                     f"(the others train as they are: {config.measure_share:.0%} of the minutes)")
    return described


def train_words(config: DistillConfig, seconds: float) -> str:
    if config.train.minutes is None:
        return f"train {config.train.fixed_steps} steps"
    return f"train until the minutes are spent, {seconds / (config.train.minutes * 60):.0%} of them"


# ---------------------------------------------------------------- the whole run


def fingerprint(config: DistillConfig) -> dict:
    """What a checkpoint must have been trained with for --resume to continue it."""
    return {"target": config.target, "draft": config.draft, "data": list(config.data), "head_depth": config.head_depth,
            "self_distill_tokens": config.self_distill_tokens, "heldout_percent": config.heldout_percent,
            "head_hidden": config.head_hidden, "heldout_data": list(config.heldout_data), "dtype": config.dtype,
            "data_options": asdict(config.data_options), **asdict(config.train)}


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (0.0 where the resource module is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return 0.0
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


# speed(pair, prompts_file, output_folder, config) -> Speed: the written pair timed against target.generate, prompt
# lookup and its target draft-free
SpeedFunction = Callable[..., object]


def distill(config: DistillConfig, on_step=None, speed: SpeedFunction | None = None, clock: Clock = time.monotonic,
            stream=None, started_ago: float = 0.0) -> DistillResult | None:
    """Run `swiftspec distill` (see the module docstring); returns what it measured and where it wrote (None
    on ranks other than 0). on_step(history) runs after each training step (tests interrupt a run from it);
    speed: times the written pair (the command line passes `swiftspec bench`'s); clock and stream: the time
    and where progress goes (tests give their own); started_ago: seconds the run had been going before this call
    (the command line's: since its process started, imports included), which --minutes count."""
    run_started = clock() - started_ago
    world = World.from_env()
    progress = Progress(config.verbose and world.writes, clock, stream)
    progress.started = run_started  # the plan's "in all" counts what the run did before this call too
    progress.note(f"reading the data ({', '.join(map(str, config.data)) or 'none given'}) and checking the inputs")
    config, chosen, train_records, heldout_records, tokenizer = check_inputs(config, world)
    folder = Path(config.output)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    threads = f", {torch.get_num_threads()} torch thread(s)" if device.type == "cpu" else ""
    progress.note(f"{len(train_records):,} records to train on, {len(heldout_records):,} held out; loading the target "
                  f"{config.target} ({str(dtype).removeprefix('torch.')} on {device}{threads})")
    started = clock()
    target = load_target(config.target, device, dtype)
    progress.note(f"target loaded in {minutes(clock() - started)} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M "
                  "parameters); building the starting draft and timing a trial step and generation")
    draft = starting_draft(config.draft, target, config.train.seed, config.head_hidden)
    described = describe_draft(config.draft, draft) + (f"; --draft auto chose {config.draft} for {chosen}" if chosen else "")
    student = (HeadStudent(draft, target, config.train.top_k, config.head_depth) if config.draft == "eagle3"
               else ModelStudent(draft, target, config.train.top_k))
    answers, answer_tokens = to_answer(config, train_records + heldout_records)
    timed = speed is not None and world.writes
    tried = trial(student, config, train_records + heldout_records, tokenizer, world, dtype, clock)
    sizing = size_run(config, tried, len(answers), answer_tokens, timed)
    described_phases = plan_line(config, sizing)
    config = replace(config, eval=replace(config.eval, prompts=sizing.prompts, new_tokens=sizing.new_tokens,
                                          windows=sizing.windows))
    prepared_s = clock() - run_started
    expected = estimates(config, tried, sizing, answer_tokens, timed, prepared_s)
    check_budget(config, expected)
    progress.note(f"starting draft: {described}")
    progress.plan(expected, {**described_phases, "train": train_words(config, expected["train"])})
    warning = budget_warning(config, expected, prepared_s)
    if warning:
        progress.note(warning)

    data, answered = prepare_data(config, train_records, heldout_records, tokenizer, target, progress, sizing.answers)
    stream_ids = token_stream(data.train, tokenizer.eos_token_id)
    if stream_ids.numel() <= config.train.window:
        raise DistillError(
            f"the training data holds {stream_ids.numel()} tokens, fewer than one --window of {config.train.window}: "
            "give more data or a shorter --window."
        )
    heldout = token_stream(data.heldout, tokenizer.eos_token_id)
    windows = even_windows(heldout, config.eval.windows, min(config.train.window, heldout.numel()))
    prompts = eval_prompts(config, data, tokenizer)
    references = References()

    before = None
    after_phases = {name: s for name, s in expected.items() if name in ("evaluate-end", "speed")}
    if world.writes:
        before = evaluate(draft_in_target_dtype(student), tokenizer, windows, prompts, config.eval, references, progress,
                          "evaluate-start", clock=clock)
        after_phases = after_training(before.timings, tried, sizing, len(config.compare_drafts), timed)
        for name, seconds in after_phases.items():
            progress.expect(name, seconds)
    budget_s = training_budget(config, after_phases, clock() - run_started)
    if budget_s is not None:
        progress.expect("train", budget_s)
    history = train(student, stream_ids, config.train, folder / "checkpoints", fingerprint(config), progress,
                    resume=config.resume, save_every=config.save_every, dtype=dtype, world=world, on_step=on_step,
                    clock=clock, step_s=tried.step_s * 1.05, budget_s=budget_s)
    result = None
    if world.writes:
        measured = draft_in_target_dtype(student)
        after = evaluate(measured, tokenizer, windows, prompts, config.eval, references, progress, "evaluate-end",
                         own_pair=own_pair(config, measured, tokenizer), clock=clock)
        compared = {other: evaluate(ModelStudent(load_target(other, device, dtype), target, config.train.top_k), tokenizer,
                                    windows, prompts, config.eval, references, Progress(False), "evaluate-end")
                    for other in config.compare_drafts}
        result = DistillResult(folder, history.step, history.step * config.train.batch * config.train.window,
                               int(stream_ids.numel()), len(data.heldout), before, after, history.seconds_per_step,
                               history.seconds, peak_rss_mib(), described, compared, self_distilled=answered,
                               batch=config.train.batch, window=config.train.window)
        student.module.to(dtype)  # trained in float32 (the optimizer's weights), written in the run's dtype
        write_pair(config, student, tokenizer, result)
        speed_prompts = sizing.speed_prompts
        if config.train.minutes is not None:
            left = config.train.minutes * 60 * (1 - MARGIN_SHARE) - (clock() - run_started)
            speed_prompts = speed_prompts_left(left, before.timings, sizing)
        prompts_file = write_heldout_prompts(folder, prompts[: speed_prompts + 1], tokenizer)
        if timed and speed_prompts:
            progress.start("speed", 1, "bench runs")
            result.speed = speed(own_pair(config, student, tokenizer), prompts_file, folder, config)
            progress.advance()
            progress.finish()
        elif timed:
            result.speed_skipped = "the minutes were spent before the pair could be timed"
            progress.note(f"not timing the pair: {result.speed_skipped}")
        result.phases = {"prepare": round(prepared_s, 3), **{k: round(v, 3) for k, v in progress.took.items()}}
        result.seconds = clock() - run_started
        rewrite_card(config, result)
        if config.push_to_hub:
            push(folder, config.push_to_hub, config.private)
    world.barrier()
    return result
