"""What a model does when run: the checks of describe() that need a forward, on the model itself.

architectures.py reads what it can from a config and classes; some capabilities only show when the
model runs: whether a later token changes earlier logits (a decoder flagged bidirectional that masks
causally all the same), whether its generate feeds it only new tokens, whether a forward of several
tokens continues its recurrent state, and whether the very step speculation runs (a 2-token step
after a cached prefix, under the tree mask) runs at all. Each runs once per model object.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..models.architectures import (
    Architecture,
    UnsupportedArchitecture,
    bidirectional_refusal,
    bidirectional_suspects,
    describe_model,
    first_line,
    kv_heads_hint,
)
from .attention import own_implementation
from .cache import TreeCache
from ..models.compat import prepare_inputs
from .recurrent import new_cache, state_continuation_gap
from .step import NO_LOGITS, RowQueries, model_step, run_step


def describe(model, role: str = "model") -> Architecture:
    """The tree-step needs of `model`, or UnsupportedArchitecture naming what is missing."""
    architecture = describe_model(model, role)
    who = f"The {role} ({architecture.model_type})"
    check_causal(model, who)
    check_incremental_inputs(model, who)
    if architecture.recurrent:
        check_state_continues(model, who)
    headless = check_steps_run(model, architecture, who)
    return dataclasses.replace(architecture, headless=headless) if headless else architecture


_step_failures: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (why its steps fail or None, headless)


def check_steps_run(model, architecture: Architecture, who: str) -> bool:
    """Refuse a model whose forward fails on the kind of step speculation runs, before a generation
    fails inside it: after a 2-token prefill into the tree cache, a 2-token chain step with the 4D
    mask a tree step passes (chain-shaped models: no mask). Two forwards of 2 tokens, once per model
    object; a model whose prefill itself fails here is left to fail where it fails. Returns whether
    its forward skips the vocabulary head given an empty logits_to_keep index (Architecture.headless):
    the probe's forwards do (a 262k-row head is half a 2-token forward of the gemma-3-270m shape)."""
    if model not in _step_failures:
        _step_failures[model] = step_failure(model, architecture)
    failure, headless = _step_failures[model]
    if failure is not None:
        raise UnsupportedArchitecture(f"{who} {failure}. Use swiftspec=False for this model.")
    return headless


def step_failure(model, architecture: Architecture) -> tuple[str | None, bool]:
    """check_steps_run's finding: (None, or what fails (completing "The target (type) ..."), headless)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = ((torch.arange(4) * 7 + 3) % vocab)[None].to(model.device)  # any 4 distinct tokens
    positions = torch.arange(4, device=model.device)[None]
    headless = True

    def prefill():
        nonlocal headless
        if headless:
            try:  # a forward for its KV alone, no head: the catch-ups' (an error here may be the cache's: see below)
                cache = new_cache(architecture, 8)
                model_step(model, cache, ids[:, :2], positions[:, :2], keep=NO_LOGITS)
                cache.seal_prefix()
                return cache
            except Exception:  # noqa: BLE001 - it takes no index for logits_to_keep, or fails anyway (next)
                headless = False
        cache = new_cache(architecture, 8)
        model_step(model, cache, ids[:, :2], positions[:, :2], keep=1)
        cache.seal_prefix()
        return cache

    def step(cache, masked: bool) -> None:
        keep_arch = dataclasses.replace(architecture, headless=headless)
        if masked:  # a 2-node chain under the tree mask (a dense one: the model's own attention)
            run_step(model, cache, [RowQueries.chain(ids[0, 2:].tolist(), 2, model.device)], own_implementation(model),
                     keep_arch, logits=not headless)  # fmt: skip
        else:
            model_step(model, cache, ids[:, 2:], positions[:, 2:], keep=NO_LOGITS if headless else 0)

    tree = architecture.shape == "tree"
    with torch.no_grad():
        try:
            cache = prefill()
        except Exception as error:  # noqa: BLE001 - named in the refusal
            return (
                "fails on a prefill into swiftspec's tree cache, whose layers hold keys and values (and transformers' "
                f"own state layers) ({type(error).__name__}: {first_line(error)}){kv_heads_hint(model)}"
            ), False
        try:
            step(cache, masked=tree)
            return None, headless
        except Exception as error:  # noqa: BLE001 - named in the refusal
            failed = error
        try:
            step(prefill(), masked=False) if tree else None
            masks_fail = tree
        except Exception:  # noqa: BLE001
            masks_fail = False
    what = f"({type(failed).__name__}: {first_line(failed)}){kv_heads_hint(model)}"
    if masks_fail:
        return f"fails when its attention is given an explicit 4D mask, which every tree step passes {what}", False
    return f"fails on a forward of several tokens after a cached prefix, which every verification runs {what}", False


def check_causal(model, who: str) -> None:
    """Refuse a decoder whose self-attention is bidirectional (a BERT-style model loaded without
    is_decoder=True): its prompt tokens see the ones after them, which tree steps never show them. A
    suspect (architectures.bidirectional_suspects) is refused only if a later token does change an
    earlier position's logits (some decoders flag their attention so and mask it causally all the same)."""
    suspects = bidirectional_suspects(model)
    if suspects and not later_tokens_unseen(model):
        raise bidirectional_refusal(suspects, who)


def later_tokens_unseen(model) -> bool:
    """Whether changing the last of 4 tokens leaves the logits of the first 3 alone (False when the
    check cannot run). Two forwards of 4 tokens, without a cache."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = ((torch.arange(4) * 7 + 3) % vocab)[None].to(model.device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    try:
        with torch.no_grad():
            a, b = (model(input_ids=x, use_cache=False).logits[0, :3].float() for x in (ids, changed))
    except Exception:  # noqa: BLE001 - nothing this check can tell
        return False
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max()) + 1e-6))


def check_state_continues(model, who: str) -> None:
    """Refuse a model whose forward over several tokens does not continue its recurrent state."""
    gap = state_continuation_gap(model)
    if gap is not None:
        raise UnsupportedArchitecture(
            f"{who} keeps a recurrent state, and {gap}{kv_heads_hint(model)}. Use swiftspec=False for this model.",
            recurrent=True,
        )


def check_incremental_inputs(model, who: str) -> None:
    """A step feeds the model only its new tokens; refuse a model whose own generate feeds it the
    whole sequence every time (its forward slices the cached part off itself)."""
    cache = TreeCache(1, 4)
    cache.lengths = [2]  # as if two tokens were cached: generate would pass only the third
    try:
        inputs = prepare_inputs(model, torch.ones(1, 3, dtype=torch.long), cache, next_sequence_length=1, use_cache=True)
    except Exception:  # noqa: BLE001 - a model needing other inputs here says nothing about this
        return
    fed = inputs.get("input_ids")
    if isinstance(fed, torch.Tensor) and fed.shape[-1] != 1:
        raise UnsupportedArchitecture(
            f"{who} takes the whole sequence at every step (its generate does not feed it only the new tokens, "
            "and its forward slices the cached part off itself), so it cannot run tree steps. Use swiftspec=False "
            "for this model."
        )


