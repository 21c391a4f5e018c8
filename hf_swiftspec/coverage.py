"""Which causal-LM types of the installed transformers speculate, and how: the architecture sweep.

Every model type in transformers' causal-LM mapping is built tiny (hidden 64, 2 layers, small
vocabulary, windows of 16 so windowed layers are exercised past their window), and decoded
greedily by its own `generate` and by `generate(swiftspec=True)` with a draft that is a copy of
it with perturbed weights. A type's `Outcome` is one of

    tree / chain   decodes token for token like its own generate, with tau > 1
    refused        `from_models` refuses it, for the reason it names
    skipped        its own generate does not run on a tiny config (the reason is kept)
    wrong          anything else: a bug (tests fail on it)

tests/test_architectures.py asserts these per type; `python -m hf_swiftspec.coverage` runs the
same sweep (or reads a saved one) and rewrites the architecture table in README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .architectures import UnsupportedArchitecture, describe

# Set on every config that has the field; the first line is what the sweep means by "tiny".
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
TINY_IF_PRESENT = dict(
    num_key_value_heads=2, head_dim=16, rotary_dim=8, max_position_embeddings=512,
    sliding_window=16, attention_chunk_size=16,  # windows the prompts and the tree reach past
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_group=1, topk_group=1,
    is_decoder=True,  # BERT-style models are causal LMs only as decoders
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
    chunk_size=16, mamba_chunk_size=16,  # Mamba-2 scans pad to a chunk: 256 makes each forward take seconds
)  # fmt: skip
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAX_PARAMETERS = 30_000_000  # larger "tiny" models (multimodal towers, 256-expert MoE) are skipped
PROMPT_LENGTHS = (5, 23, 40)  # the longer two start past the window
NEW_TOKENS = 40
SETTINGS = dict(tree_budget=8, draft_width=4, draft_depth=3)  # a fixed depth, so tau does not depend on timing


@dataclass
class Outcome:
    """What the sweep found for one model type (see the module docstring); tau over the prompts."""

    model_type: str
    status: str
    reason: str = ""
    tau: float = 0.0
    recurrent: bool = False  # refused for a recurrent state: not an attention-only decoder


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, layers: int = 2, full: bool = True, **overrides):
    """A tiny config of `model_type`; full=False sets only TINY (for configs that reject the rest).

    overrides: config fields to set as well (on the text decoder of a multimodal wrapper).
    """
    base = AutoConfig.for_model(model_type)
    sub_configs = getattr(base, "sub_configs", None) or {}
    if "text_config" in sub_configs:  # a multimodal wrapper: shrink the text decoder, and the rest a little
        kwargs = {"text_config": {**tiny_fields(base.text_config, layers, full), **overrides}, **SPECIAL_TOKENS}
        for name in sub_configs:
            if name != "text_config":
                kwargs[name] = {k: v for k, v in TINY.items() if k != "vocab_size"}
        return AutoConfig.for_model(model_type, **kwargs)
    return AutoConfig.for_model(model_type, **{**tiny_fields(base, layers, full), **overrides})


def tiny_fields(config, layers: int, full: bool) -> dict:
    fields = {**TINY, "num_hidden_layers": layers, **SPECIAL_TOKENS}
    if full:
        fields.update({k: v for k, v in TINY_IF_PRESENT.items() if has_field(config, k)})
        if has_field(config, "kv_lora_rank"):  # latent attention expands keys to every query head
            fields["num_key_value_heads"] = fields["num_attention_heads"]
    return fields


def has_field(config, name: str) -> bool:
    try:
        return hasattr(config, name) or name in getattr(config, "attribute_map", {})
    except Exception:  # heterogeneous configs refuse a global read of per-layer fields
        return False


def tiny_model(model_type: str, layers: int = 2, seed: int = 0, **overrides):
    """A tiny randomly initialised model in eval mode (sharpened head: peaked like a real LM)."""
    config = None
    for full in (True, False):
        try:
            config = tiny_config(model_type, layers, full, **overrides)
            with torch.device("meta"):
                meta = AutoModelForCausalLM.from_config(config)
            break
        except Exception:
            if not full:
                raise
    parameters = sum(p.numel() for p in meta.parameters())
    if parameters > MAX_PARAMETERS:
        raise MemoryError(f"{parameters / 1e6:.0f}M parameters even on a tiny config")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(**SPECIAL_TOKENS)
    head = model.get_output_embeddings()
    if head is not None:
        with torch.no_grad():
            head.weight.mul_(4.0)
    return model


def perturbed_copy(model, scale: float = 0.02, seed: int = 1):
    """A draft that agrees with `model` often: its copy with noise of `scale` x each weight's std."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * scale * p.float().std())
    return draft


def own_generate(model, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS, **kwargs) -> torch.Tensor:
    """Greedy, exactly `new_tokens` long (no EOS), as every decode in the sweep is."""
    return model.generate(
        prompt, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
        pad_token_id=0, **kwargs,
    )


def prompts(vocab_size: int = 128) -> list[torch.Tensor]:
    return [
        torch.randint(3, vocab_size, (1, n), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS
    ]


def runnable_tiny_model(model_type: str):
    """(model, None), or (None, why its own generate does not run on a tiny config)."""
    error = None
    for layers in (2, 4, 8):  # hybrids need enough layers to reach their first attention layer
        try:
            model = tiny_model(model_type, layers)
            with torch.no_grad():
                own_generate(model, prompts()[0], 2)
            return model, None
        except Exception as e:  # noqa: BLE001 - any failure of its own generate means "skipped"
            error = e
            if "Attention layers" not in str(e):
                break
    return None, f"its own generate fails on a tiny config: {type(error).__name__}: {first_line(error)}"


def check_type(model_type: str) -> Outcome:
    """Sweep one model type (see the module docstring)."""
    from .modeling import SwiftSpecForCausalLM

    target, why = runnable_tiny_model(model_type)
    if target is None:
        return Outcome(model_type, "skipped", why)
    try:
        architecture = describe(target, "target")
        pair = SwiftSpecForCausalLM.from_models(target, perturbed_copy(target), **SETTINGS)
    except UnsupportedArchitecture as refusal:
        return Outcome(model_type, "refused", first_line(refusal), recurrent=refusal.recurrent)
    taus = []
    try:
        for prompt in prompts():
            expected = own_generate(target, prompt)
            actual = own_generate(pair, prompt, swiftspec=True)
            if actual.tolist() != expected.tolist():
                at = next(i for i, (a, e) in enumerate(zip(actual[0].tolist(), expected[0].tolist())) if a != e)
                return Outcome(model_type, "wrong", f"differs from its own generate at position {at} of a "
                               f"{prompt.shape[1]}-token prompt")  # fmt: skip
            taus.append(pair.swiftspec_stats.tau)
    except Exception as error:  # noqa: BLE001 - reported, and the test fails on it
        where = traceback.extract_tb(error.__traceback__)[-1]
        return Outcome(model_type, "wrong", f"{type(error).__name__}: {first_line(error)} "
                       f"({Path(where.filename).name}:{where.lineno})")  # fmt: skip
    tau = sum(taus) / len(taus)
    if tau <= 1.0:
        return Outcome(model_type, "wrong", f"no speculation happened (tau={tau:.2f})", tau)
    return Outcome(model_type, architecture.shape, architecture.chain_reason or "", tau)


def first_line(error: BaseException, limit: int = 600) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text[:limit]


# ---------------------------------------------------------------- the README table

TABLE_START = "<!-- architecture-table:start -->"
TABLE_END = "<!-- architecture-table:end -->"


def coverage_line(outcomes: list[Outcome]) -> str:
    count = lambda status: sum(o.status == status for o in outcomes)  # noqa: E731
    return (
        f"{len(outcomes)} causal-LM types in transformers {transformers_version()}: {count('tree')} tree, "
        f"{count('chain')} chain, {count('refused')} refused, {count('skipped')} skipped"
        + (f", {count('wrong')} WRONG" if count("wrong") else "")
    )


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def markdown_table(outcomes: list[Outcome]) -> str:
    """The README's architecture table: one row per model type."""
    rows = ["| model type | speculation | why / notes |", "|---|---|---|"]
    for o in sorted(outcomes, key=lambda o: o.model_type):
        note = short_reason(o.reason).replace("|", "\\|")
        if o.status in ("tree", "chain"):
            note = f"tau {o.tau:.2f} on the tiny sweep" + (f"; {note}" if note else "")
        rows.append(f"| `{o.model_type}` | {o.status} | {note} |")
    return "\n".join([coverage_line(outcomes) + ".", "", *rows])


def short_reason(reason: str, limit: int = 140) -> str:
    """The reason's first clause without the "The target (type)" it starts with, for the table."""
    if reason.startswith("The target ("):
        reason = reason[reason.index(") ") + 2 :]
    for cut in (": a tree step", ", which a tree step", "; ", ", so ", ". "):
        reason = reason.split(cut)[0]
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def rewrite_readme(readme: Path, outcomes: list[Outcome]) -> None:
    text = readme.read_text()
    block = f"{TABLE_START}\n{markdown_table(outcomes)}\n{TABLE_END}"
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {TABLE_START} ... {TABLE_END} block to rewrite; add one where the table goes.")
    readme.write_text(pattern.sub(lambda _: block, text))


def save(outcomes: list[Outcome], path: Path) -> None:
    path.write_text(json.dumps([asdict(o) for o in outcomes], indent=1) + "\n")


def load(path: Path) -> list[Outcome]:
    return [Outcome(**o) for o in json.loads(path.read_text())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="read the sweep from this JSON (the test writes it) instead of running it")
    parser.add_argument("--save", type=Path, help="write the sweep's results to this JSON")
    parser.add_argument("--readme", type=Path, help="rewrite the architecture table in this README")
    parser.add_argument("types", nargs="*", help="model types to sweep (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.results:
        outcomes = load(args.results)
    else:
        outcomes = []
        for model_type in args.types or causal_lm_types():
            outcomes.append(check_type(model_type))
            print(f"{model_type:28s} {outcomes[-1].status:8s} {outcomes[-1].reason}", file=sys.stderr, flush=True)
    if args.save:
        save(outcomes, args.save)
    if args.readme:
        rewrite_readme(args.readme, outcomes)
    print(coverage_line(outcomes))


if __name__ == "__main__":
    main()
