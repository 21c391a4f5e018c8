"""`swiftspec distill`: train a draft that agrees with the user's own target, and write a pair folder.

    distill(DistillConfig(target="my/target", output="my-pair", draft="early-exit:2", data=("chat.jsonl",)))

1. check every input (numbers, the draft's vocabulary, the data, the output folder) before any weights load;
2. load the target and the starting draft: an early exit of the target (its embeddings, first k layers,
   final norm and head), a smaller causal LM sharing its tokenizer, or a new EAGLE-3 head;
3. tokenise the data (distill_data.py: chat templates applied), or have the target continue the prompts
   (self-distillation);
4. train (distill_train.py: top-k KL to the target, checkpoints, --resume, Ctrl-C);
5. measure the starting and the trained draft on held-out data (distill_report.py): teacher-forced top-1
   agreement, and tau from the pair's own greedy generate with fixed tree settings (deterministic),
   checked against target.generate token for token;
6. write the pair folder (swiftspec pair create's layout: config.json, tokenizer, generation config, a
   model card with the figures, the draft under draft/) and optionally push it to the Hub.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from ..pair import HubOptions, PairConfigError, check_compatibility, load_tokenizer
from .distill_data import (
    Dataset,
    DistillError,
    encode,
    even_windows,
    read_records,
    render,
    self_distilled,
    split_records,
    token_stream,
    tokenise,
)
from .distill_config import DRAFT_KINDS, DistillConfig, EvalSettings
from .distill_report import DistillResult, draft_in_target_dtype, evaluate, push, write_pair
from .distill_train import HeadStudent, ModelStudent, World, train
from .eagle3_training import new_head_for
from .models import truncated_draft

__all__ = ["DRAFT_KINDS", "DistillConfig", "EvalSettings", "distill"]


# ---------------------------------------------------------------- checks, before any weights load


def check_numbers(config: DistillConfig) -> None:
    t, e = config.train, config.eval
    positive = {"--steps": t.steps, "--batch": t.batch, "--top-k": t.top_k, "--save-every": config.save_every,
                "--eval-prompts": e.prompts, "--eval-new-tokens": e.new_tokens, "--eval-windows": e.windows,
                "--head-depth": config.head_depth}
    for flag, value in positive.items():
        if value < 1:
            raise DistillError(f"{flag} {value}: must be at least 1.")
    if t.lr <= 0:
        raise DistillError(f"--lr {t.lr}: must be positive.")
    shortest = config.head_depth + 2 if config.draft == "eagle3" else 2
    if t.window < shortest:
        raise DistillError(f"--window {t.window}: must be at least {shortest} tokens.")
    if not 1 <= config.heldout_percent <= 50:
        raise DistillError(f"--heldout-percent {config.heldout_percent}: must be between 1 and 50.")
    if config.self_distill_tokens < 0:
        raise DistillError(f"--self-distill {config.self_distill_tokens}: a number of new tokens, 0 (off) or more.")


def early_exit_layers(spec: str) -> int | None:
    """K of "early-exit:K" ("early-exit" alone: 1), or None for another kind of draft."""
    match = re.fullmatch(r"early-exit(?::(\d+))?", spec)
    if match is None:
        if spec.startswith("early-exit"):
            raise DistillError(f"--draft {spec!r}: write early-exit:K with K the number of the target's layers to keep.")
        return None
    layers = int(match.group(1) or 1)
    if layers < 1:
        raise DistillError(f"--draft {spec!r}: keep at least one layer (early-exit:1).")
    return layers


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
    try:
        check_compatibility(target_config, draft_config, tokenizer, load_tokenizer(spec, None, HubOptions()))
    except PairConfigError as err:
        raise DistillError(f"--draft {spec!r} cannot draft for the target: {err}") from err


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


def starting_draft(config: DistillConfig, target, device: torch.device):
    """The draft to train, in float32 (the optimizer's master weights)."""
    layers = early_exit_layers(config.draft)
    if layers is not None:
        try:
            draft = truncated_draft(target, layers)
            draft.name_or_path = draft.config.name_or_path = ""  # built in memory: the pair stores it under draft/, not at the target's path
        except AttributeError as err:
            raise DistillError(f"--draft early-exit: cannot cut {type(target).__name__}'s layers ({err}); use another --draft.") from err
        return draft.float().requires_grad_(True)
    if config.draft == "eagle3":
        return new_head_for(target, hidden=config.head_hidden, seed=config.train.seed).to(device=device, dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config.draft, dtype=torch.float32).to(device)


def split(config: DistillConfig, records) -> tuple[list, list]:
    """(training, held-out) records: --heldout-data's files, else a hash-chosen share of --data."""
    if config.heldout_data:
        return records, read_records(config.heldout_data)
    return split_records(records, config.heldout_percent)


def prepare_data(config: DistillConfig, records, tokenizer, target) -> Dataset:
    train_records, heldout_records = split(config, records)
    if config.self_distill_tokens:
        train = self_distilled(train_records, tokenizer, target, config.self_distill_tokens)
        heldout = self_distilled(heldout_records, tokenizer, target, config.self_distill_tokens)
    else:
        train = [tokenise(r, tokenizer) for r in train_records]
        heldout = [tokenise(r, tokenizer) for r in heldout_records]
    return Dataset(train, heldout, tuple(config.data))


def eval_prompts(config: DistillConfig, data: Dataset, tokenizer) -> list[list[int]]:
    """Held-out prompts: from --eval-prompts-file, else each held-out record's prompt (a text's first tokens)."""
    if config.eval_prompts_file:
        templated = bool(getattr(tokenizer, "chat_template", None))
        records = read_records([config.eval_prompts_file])
        prompts = [encode(tokenizer, render(r, tokenizer, True)[0] or r.text, templated and r.messages is not None) for r in records]
    else:
        prompts = [s.ids[: s.prompt] if s.prompt else s.ids[: max(min(config.eval.prompt_tokens, len(s.ids) // 2), 1)]
                   for s in data.heldout]
    return [p for p in prompts if p][: config.eval.prompts]


# ---------------------------------------------------------------- the whole run


def fingerprint(config: DistillConfig) -> dict:
    """What a checkpoint must have been trained with for --resume to continue it."""
    return {"target": config.target, "draft": config.draft, "data": list(config.data), "head_depth": config.head_depth,
            "self_distill_tokens": config.self_distill_tokens, "heldout_percent": config.heldout_percent,
            "head_hidden": config.head_hidden, "heldout_data": list(config.heldout_data), "dtype": config.dtype, **asdict(config.train)}


def check_inputs(config: DistillConfig, world: World) -> tuple[list, object]:
    """Every check that needs no weights (DistillError naming the value and the fix); returns the data's
    records and the target's tokenizer."""
    check_numbers(config)
    layers = early_exit_layers(config.draft)
    check_push(config)
    if world.writes:
        check_output(Path(config.output), config)
    records = read_records(config.data)
    split(config, records)  # refuses too few records now, not after loading
    target_config, tokenizer = target_config_and_tokenizer(config.target)
    if layers is not None:
        total = target_config.get_text_config(decoder=True).num_hidden_layers
        if layers >= total:
            raise DistillError(f"--draft early-exit:{layers}: the target has {total} layers; keep fewer (early-exit:1 to {total - 1}).")
    elif config.draft != "eagle3":
        check_draft_model(config.draft, target_config, tokenizer)
    for other in config.compare_drafts:
        check_draft_model(other, target_config, tokenizer)
    return records, tokenizer


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (0.0 where the resource module is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return 0.0
    scale = 1024 * 1024 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def distill(config: DistillConfig, on_step=None) -> DistillResult | None:
    """Run `swiftspec distill` (see the module docstring); returns what it measured and where it wrote (None
    on ranks other than 0). on_step(history) runs after each training step (tests interrupt a run from it)."""
    world = World.from_env()
    records, tokenizer = check_inputs(config, world)
    folder = Path(config.output)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    target = load_target(config.target, device, dtype)
    draft = starting_draft(config, target, device)
    student = (HeadStudent(draft, target, config.train.top_k, config.head_depth) if config.draft == "eagle3"
               else ModelStudent(draft, target, config.train.top_k))
    data = prepare_data(config, records, tokenizer, target)
    stream = token_stream(data.train, tokenizer.eos_token_id)
    if stream.numel() <= config.train.window:
        raise DistillError(
            f"the training data holds {stream.numel()} tokens, fewer than one --window of {config.train.window}: "
            "give more data or a shorter --window."
        )
    heldout = token_stream(data.heldout, tokenizer.eos_token_id)
    windows = even_windows(heldout, config.eval.windows, min(config.train.window, heldout.numel()))
    prompts = eval_prompts(config, data, tokenizer)

    before = evaluate(draft_in_target_dtype(student), tokenizer, windows, prompts, config.eval) if world.writes else None
    history = train(student, stream, config.train, folder / "checkpoints", fingerprint(config), resume=config.resume,
                    save_every=config.save_every, dtype=dtype, world=world, on_step=on_step, verbose=config.verbose)
    result = None
    if world.writes:
        after = evaluate(draft_in_target_dtype(student), tokenizer, windows, prompts, config.eval)
        compared = {other: evaluate(ModelStudent(load_target(other, device, dtype), target, config.train.top_k),
                                    tokenizer, windows, prompts, config.eval) for other in config.compare_drafts}
        result = DistillResult(folder, history.step, int(stream.numel()), len(data.heldout), before, after,
                               history.seconds_per_step, peak_rss_mib(), compared)
        student.module.to(dtype)  # trained in float32 (the optimizer's weights), written in the run's dtype
        write_pair(config, student, tokenizer, result)
        if config.push_to_hub:
            push(folder, config.push_to_hub, config.private)
    world.barrier()
    return result
