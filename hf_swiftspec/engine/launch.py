"""Launching a call's decode: building the workers (the target's, the drafters), their capture runners and
cache capacities, choosing and running an engine (serial_fallback's pick among them), and the server's
continuous engine; below transformers' side (generation.py), which hands it a DecodeRequest and gets a
DecodeResult back.
"""

from __future__ import annotations

import contextlib

from ..config import MAX_BUDGET, SwiftSpecConfig
from ..drafters.draft_model import DraftModelDrafter, window_for
from ..drafters.device_host import HostProposals, on_host
from ..drafters.drafting import Drafters
from ..drafters.eagle3 import DraftHead
from ..drafters.heads import HeadDrafter
from ..drafters.suffix import OutputHistory, SuffixDrafter
from ..drafters.translated import TranslatedDrafter
from ..models.architectures import context_limit
from ..policy.choice import SERIAL
from ..policy.goodput import GoodputPolicy
from ..steps.attention import resolve_attention
from ..steps.capture import Captures, StepRunner, capture_backend, capture_gap
from ..steps.probes import describe
from ..steps.verify import batch_dependent
from .adaptive import run_serial, setup_s
from .asynchronous import run_threads
from .continuous import ContinuousEngine
from .continuous_device import DeviceContinuousEngine
from .device_async import async_gaps, run_device_async
from .device_distributed import distributed_gaps, run_device_async_distributed
from .device_sides import choose_round, run_device
from .distributed import Groups, agree_engine, run_distributed, run_serial_distributed
from .placement import Placement
from .request import DecodeRequest, DecodeResult, RowResult
from .workers import TargetWorker, attend_the_tree


def remember_outputs(history: OutputHistory | None, config: SwiftSpecConfig, request: DecodeRequest,
                     result: DecodeResult) -> None:
    """Keep the rows' outputs (and their lead-ins) in the history later requests' suffix proposals copy from."""
    remember_tokens(history, config, [(ids, row.tokens[: result.end]) for ids, row in zip(request.prompt_ids(),
                                                                                          result.rows)])


def remember_tokens(history: OutputHistory | None, config: SwiftSpecConfig,
                    outputs: list[tuple[list[int], list[int]]]) -> None:
    """Keep each (prompt ids, output tokens) pair's output, after its prompt's last ngram_size tokens (its lead-in),
    in the history; an empty output keeps nothing."""
    if history is None:
        return
    lead_in = config.ngram_size if config.ngram_size > 0 else 0
    for ids, tokens in outputs:
        if tokens:
            history.add((ids[-lead_in:] if lead_in else []) + tokens)


def decode_adaptive(target, draft, request: DecodeRequest, config: SwiftSpecConfig, placement, groups,
                    chain_reasons: list[str] = (), architectures=None, captures: Captures | None = None,
                    vocabularies=None, round_: str = "host") -> DecodeResult:
    """The adaptive round (engine/adaptive.py, or an asynchronous engine) over the two workers; chains
    instead of trees where `chain_reasons` say this call needs them. architectures: the models' (probes.describe),
    when the caller has them. captures: the pair's replayed forwards, kept across calls (None: every step eager).
    vocabularies: a draft with another tokenizer's (drafters/vocabulary.py), None for one of the target's.
    round_: "device" runs the device round (device_sides.choose_round chose it, and it cleared the call)."""
    if round_ == "device" and groups is not None:
        return run_device_async_across_ranks(target, draft, request, config, placement, groups, architectures)
    if round_ == "device" and placement is not None and placement.mode == "threads":
        architectures = architectures or (describe(target, "target"), draft_architecture(draft))
        gaps = async_gaps(target, draft, request, config, architectures, vocabularies)
        if gaps and config.round == "device":
            raise ValueError(f"SwiftSpecConfig.round='device' with placement threads runs the device round's "
                             f"asynchronous engine, which cannot decode this call: {'; '.join(gaps)}. Fix that, or "
                             "use round='host' (the host round's asynchronous engine decodes it).")
        if gaps:  # round='auto': the host round's asynchronous engine decodes it
            result = decode_adaptive(target, draft, request, config, placement, groups, chain_reasons, architectures,
                                     captures, vocabularies, "host")
            result.stats.round_choice = ("round='auto', host round: the device round's asynchronous engine cannot "
                                         f"decode this call ({gaps[0]})")
            return result
        result = run_device_async_or_serial(target, draft, request, config, placement, captures, architectures)
        if config.round == "auto":
            result.stats.round_choice = "round='auto': the device round's asynchronous engine (two threads, one device)"
        return result
    if round_ == "device":
        return run_device(target, draft, request, config, captures, host_drafter(target, draft, config, vocabularies),
                          architectures)
    batch = request.batch_size
    length = request.prompt.shape[1] + request.max_new_tokens
    if groups is not None and len(groups.my_ranks) > 1:
        captures = None  # a tensor-parallel forward's collectives stay eager: a capture failing on one rank would hang the rest
    engine = engine_for_call(placement, groups, request, config)
    workers = build_workers(target, draft, config, length, groups, batch, chain_reasons, request.corpus, request.history,
                            architectures, captures, draft_here=engine == SERIAL, vocabularies=vocabularies)
    with contextlib.ExitStack() as routes:  # each model attends the tree its way for this call only
        attend_the_tree(routes, target, draft, *workers)
        setup = setup_s(*workers)
        if request.max_new_tokens:
            result = run_engine(placement, groups, *workers, request, config, engine)
        else:
            result = DecodeResult(rows=[RowResult() for _ in range(batch)])
    result.stats.attention = attention_summary(workers, chain_reasons)
    result.stats.capture_s = setup_s(*workers) - setup
    return result


def run_device_async_across_ranks(target, draft, request: DecodeRequest, config: SwiftSpecConfig, placement: Placement,
                                  groups: Groups, architectures) -> DecodeResult:
    """round='device' under torchrun: the device round's asynchronous engine, one target rank and one draft rank
    (engine/device_distributed.py), or a ValueError (on every rank alike) naming what it cannot decode."""
    architectures = architectures or (describe(target, "target"), draft_architecture(draft))
    gaps = distributed_gaps(groups) + async_gaps(target, draft, request, config, architectures, distributed=True)
    if config.serial_fallback:
        gaps.append("it times no serial round across ranks (serial_fallback=True: use round='host')")
    if gaps:
        raise ValueError(f"SwiftSpecConfig.round='device' under torchrun runs the device round's asynchronous engine, "
                         f"which cannot decode this call: {'; '.join(gaps)}. Fix that, or use round='host' (the host "
                         "round's engine across ranks decodes it).")
    result = run_device_async_distributed(groups, target, draft, request, config, architectures)
    if placement.auto:
        result.stats.engine_choice = (f"{result.stats.engine}: round='device' under torchrun runs the asynchronous "
                                      "engine on every call (serial_fallback's choice is the host round's)")
    return result


def run_device_async_or_serial(target, draft, request: DecodeRequest, config: SwiftSpecConfig, placement: Placement,
                               captures: Captures | None, architectures) -> DecodeResult:
    """The device round's asynchronous engine (two threads on one device), or, with serial_fallback, the engine this
    call's pick names (choice.py): the device round's serial engine on the same device where the serial round measured
    more tokens per second on this pair; the call is timed for the next pick and its stats say why."""
    engine = engine_for_call(placement, None, request, config)
    if engine == SERIAL:
        return run_timed(request, engine, None, lambda: run_device(target, draft, request, config, captures, None,
                                                                   architectures))
    return run_timed(request, engine, None, lambda: run_device_async(target, draft, request, config, architectures))


def continuous_engine(target, draft, config: SwiftSpecConfig, placement: Placement | None, groups: Groups | None,
                      policy: GoodputPolicy, history: OutputHistory | None, latency_guard: bool = True,
                      vocabularies=None) -> ContinuousEngine:
    """An engine decoding concurrent one-sequence generate() calls in one running batch (engine/continuous.py;
    calls pass it as swiftspec_engine=(engine, key)). ValueError where the pair cannot share a batch."""
    if (placement is not None and placement.mode != "serial") or groups is not None:
        raise ValueError(
            f"a running batch decodes serially on one device; this pair runs {placement.mode if placement else 'distributed'} "
            "(load it with placement='serial')"
        )
    architectures = describe(target, "target"), draft_architecture(draft)
    reasons = batch_exactness_gaps(architectures, [], [])
    if reasons:
        raise ValueError(f"this pair cannot decode rows in one batch: {'; '.join(reasons)}")
    # (its forwards hold at most the longest row's slots, and generation.py refuses a request whose own slots reach a
    # rule by slot at its join: within the rule, so are the batch's)
    round_, _ = choose_round(config, target, draft, architectures, [], placement, groups, False, [],
                             vocabularies=vocabularies, slots=0)
    if round_ == "device":  # the running batch on the device round, its rows in buckets (continuous_device.py)
        return DeviceContinuousEngine(target, draft, policy, config,
                                      lambda request, result: remember_outputs(history, config, request, result),
                                      latency_guard, host_drafter(target, draft, config, vocabularies))

    def build(request: DecodeRequest):
        length = request.prompt.shape[1] + request.max_new_tokens
        return build_workers(target, draft, config, length, None, 1, (), request.corpus, request.history, architectures,
                             vocabularies=vocabularies)

    def finish(request: DecodeRequest, result: DecodeResult) -> None:
        remember_outputs(history, config, request, result)

    return ContinuousEngine(target, draft, policy, build, finish, latency_guard)


def build_workers(target, draft, config: SwiftSpecConfig, length: int, groups: Groups | None, batch_size: int = 1,
                  chain_reasons=(), corpus: list[list[int]] | None = None, history: OutputHistory | None = None,
                  architectures=None, captures: Captures | None = None, draft_here: bool = False, vocabularies=None):
    """(TargetWorker, Drafters) with caches for `length` tokens per row; under torchrun only this rank's (and the
    Drafters on a target rank too with `draft_here`: a serial call's, serial_fallback).

    The drafters: the draft model's (none in draft-free mode) and the suffix proposals (none with
    ngram_size 0; copying from `corpus` and `history` as well). Trees shrink to chains (draft width 1,
    no suffix branch beside the draft's chain) when either model places tokens by cache slot, or when
    `chain_reasons` say this call reaches a slot limit. captures: where each model's replayed forwards
    are kept (config.capture decides whether it has any; None: every forward eager). vocabularies: a draft with
    another tokenizer's (drafters/vocabulary.py): its drafter translates its branches into the target's tokens.

    A draft model whose context is shorter than the target's (or whose tokens are not the target's) reads the
    text in a window of its own positions (draft_model.py); the proposals stay within the target's context.
    """
    role = groups.role if groups is not None else None
    target_arch, draft_arch = architectures or (describe(target, "target"), draft_architecture(draft))
    chain = "chain" in (target_arch.shape, draft_arch and draft_arch.shape) or bool(chain_reasons)
    target_worker = draft_worker = None
    if role in (None, "target"):
        budget = config.tree_budget or MAX_BUDGET
        runner = step_runner(captures, "target", target, target_arch, config)
        attention = resolve_attention(config.attention, target, target_arch, replayed=runner is not None)
        capacity = length + budget if runner is None else replayed_capacity(runner, length + budget, context_limit(target), budget)
        target_worker = TargetWorker(target, capacity, attention, target_arch, batch_size, runner)
    if role in (None, "draft") or draft_here:
        max_positions = context_limit(target)  # no proposal's node is placed past the target's context
        tree = tree_settings(target, config, length, batch_size, chain)
        if isinstance(draft, DraftHead):  # an EAGLE-3 head or an MTP layer: attends with its own sdpa
            runner = step_runner(captures, "draft", draft, draft_arch, config)
            if runner is not None:
                tree["capacity"] = replayed_capacity(runner, tree["capacity"], max_positions, config.tree_capacity)
            model = HeadDrafter(draft, runner=runner, **tree)
        elif draft is not None:
            runner = None if vocabularies is not None else step_runner(captures, "draft", draft, draft_arch, config)
            model = draft_model_drafter(draft, draft_arch, tree, config, runner, vocabularies)
        else:
            model = None
        ngram_size = 0 if chain and draft is not None else config.ngram_size
        suffix = None if ngram_size == 0 else SuffixDrafter(
            ngram_size, batch_size, branching=not chain, corpus=corpus, history=history
        )
        draft_worker = Drafters(model, suffix, batch_size, max_positions, target.device)
    return target_worker, draft_worker


def tree_settings(target, config: SwiftSpecConfig, length: int, batch_size: int, chain: bool) -> dict:
    """A drafter's tree and cache sizes for `length` tokens a row (the prompt and the new tokens), no node placed
    past the target's context; chains (width 1) where `chain`."""
    return dict(
        capacity=length + config.tree_capacity,
        tree_capacity=config.tree_capacity,
        width=1 if chain else config.draft_width,
        vocab_limit=target.config.get_text_config().vocab_size,
        max_positions=context_limit(target),
        batch_size=batch_size,
    )


def draft_model_drafter(draft, architecture, tree: dict, config: SwiftSpecConfig, runner: StepRunner | None = None,
                        vocabularies=None) -> DraftModelDrafter:
    """A draft model's drafter (draft_model.py; translated.py for a draft with another tokenizer, whose `vocabularies`
    these are) of `tree`'s sizes (tree_settings), in its own positions (draft_positions); runner: its replayed
    forwards, or None (every forward eager)."""
    attention = resolve_attention(config.attention, draft, architecture, replayed=runner is not None)
    tree = dict(tree, **draft_positions(draft, tree["max_positions"], vocabularies))
    if runner is not None:
        tree["capacity"] = replayed_capacity(runner, tree["capacity"], tree["max_positions"], config.tree_capacity)
    if vocabularies is not None:
        tree["vocab_limit"] = min(len(vocabularies.draft), draft.config.get_text_config().vocab_size)
        return TranslatedDrafter(draft, vocabularies, attention=attention, architecture=architecture, **tree)
    return DraftModelDrafter(draft, attention=attention, architecture=architecture, runner=runner, **tree)


def host_drafter(target, draft, config: SwiftSpecConfig, vocabularies=None):
    """Where the device round's draft proposes from the host (drafters/device_host.on_host): a request -> its rows'
    drafter (the host round's, eager: a draft with another tokenizer always is), and why; else None."""
    why = on_host(draft, target, vocabularies)
    if why is None:
        return None
    architecture = describe(draft, "draft")

    def build(request: DecodeRequest) -> DraftModelDrafter:
        length = request.prompt.shape[1] + request.max_new_tokens
        tree = tree_settings(target, config, length, request.batch_size, architecture.shape == "chain")
        return draft_model_drafter(draft, architecture, tree, config, None, vocabularies)

    return HostProposals(build, why)


def draft_positions(draft, target_positions: int | None, vocabularies) -> dict:
    """A draft model's own positions (`max_positions`) and the window it keeps when the text fills them
    (`window`, draft_model.py): the target's positions where the draft follows the target as far as the target goes;
    else its own context, read in windows. A draft with another tokenizer sizes both from its prompts' spelling
    (TranslatedDrafter.size_cache); here its own context."""
    own = context_limit(draft)
    if vocabularies is not None:
        return {"max_positions": own}
    limit = min(n for n in (own, target_positions) if n is not None) if (own or target_positions) else None
    return {"max_positions": limit, "window": window_for(own, target_positions)}


def replayed_capacity(runner: StepRunner, needed: int, context: int | None, room: int) -> int:
    """A replayed cache's positions per row (StepRunner.capacity_for): `needed`, or the model's whole `context`
    plus the tree's `room`."""
    return runner.capacity_for(needed, context and context + room)


def step_runner(captures: Captures | None, role: str, model, architecture, config: SwiftSpecConfig) -> StepRunner | None:
    """The model's replayed forwards for this call (capture.py), or None where its steps run eagerly: no
    capture asked for or possible on its device, or a forward a replay cannot reproduce (below)."""
    backend = capture_backend(config.capture, model.device, config.compile)
    if captures is None or backend is None or capture_gap(architecture) is not None:
        return None
    return captures.for_model(role, backend, config.compile)


def draft_architecture(draft):
    """The draft's tree-step needs (probes.describe; an EAGLE-3 head's are its own), or None without one."""
    if draft is None:
        return None
    return draft.architecture if isinstance(draft, DraftHead) else describe(draft, "draft")


def attention_summary(workers, chain_reasons=()) -> str:
    """How each model attended: its backend, the layers that fell back, and chains where trees could not be."""
    parts = [f"chains for this call ({'; '.join(chain_reasons)})"] if chain_reasons else []
    for role, worker in zip(("target", "draft"), (workers[0], workers[1] and workers[1].model)):
        if worker is None:
            continue
        part = f"{role}={worker.attention}"
        if worker.attention_fallbacks:
            part += f" (own attention for {', '.join(sorted(worker.attention_fallbacks))})"
        if worker.architecture.shape == "chain":
            part += f" (chain: {worker.architecture.chain_reason})"
        runner = getattr(worker, "runner", None)
        if runner is not None:
            how = "compiled layers" if runner.compile_layers else "eager layers"
            part += f" (fixed steps, {how}" if runner.backend == "compiled" else (
                f" (replayed, {runner.backend}: {len(runner.buckets)} graphs, {how}")
            part += f"; eager: {', '.join(sorted(runner.fallbacks))})" if runner.fallbacks else ")"
        parts.append(part)
    return ", ".join(parts)


def run_engine(placement, groups, target, draft, request: DecodeRequest, config, engine: str | None = None) -> DecodeResult:
    """Serial on one device; asynchronous when the draft has its own device, thread or process. With serial_fallback
    (`engine`: engine_for_call's), the engine chosen for this call, timed for the next choice (choice.py)."""
    if placement is None or placement.mode == "serial":
        return run_serial(target, draft, request)
    timeout_s = config.worker_timeout_s

    def run() -> DecodeResult:
        if engine == SERIAL:
            return run_serial(target, draft, request) if groups is None else run_serial_distributed(
                groups, target, draft, request, timeout_s)
        if placement.mode == "threads":
            return run_threads(target, draft, request, timeout_s=timeout_s)
        return run_distributed(groups, target, draft, request, timeout_s=timeout_s)

    return run_timed(request, engine, groups, run)


def run_timed(request: DecodeRequest, engine: str | None, groups: Groups | None, run) -> DecodeResult:
    """run() for this call, timed on the engine choice's clock for its next pick where serial_fallback picked
    `engine` (None: nothing to time), its stats saying why it ran that engine."""
    clock = request.policy.engines.clock
    start = clock()
    result = run()
    if engine is not None:
        note_engine(request.policy.engines, engine, result, clock() - start, groups)
    return result


def falls_back(config, placement: Placement) -> bool:
    """Whether this call may run the serial round instead of the asynchronous engine (SwiftSpecConfig.serial_fallback):
    on for placement="auto" unless set; under torchrun only with a target group of one rank (check_serial_fallback)."""
    if placement.mode == "distributed" and len(placement.target) > 1:
        return False
    return placement.auto if config.serial_fallback is None else config.serial_fallback


def check_serial_fallback(config, placement: Placement) -> None:
    """serial_fallback=True where it cannot be: ValueError naming the fix."""
    if config.serial_fallback and placement.mode == "distributed" and len(placement.target) > 1:
        raise ValueError(
            f"serial_fallback=True runs the serial round on the target's rank, but placement={config.placement!r} "
            f"shards the target over ranks {list(placement.target)}, whose trees would have to agree step by step. "
            "Give the target group one rank, or leave serial_fallback unset (off for this placement)."
        )


def engine_for_call(placement: Placement | None, groups: Groups | None, request: DecodeRequest, config) -> str | None:
    """With serial_fallback, the engine this call runs (choice.ASYNC or SERIAL, the pair's EngineChoice pick; under
    torchrun the target rank's, told to every rank); None where the placement's own engine runs."""
    if placement is None or placement.mode == "serial" or not falls_back(config, placement):
        return None
    pick = request.policy.engines.pick() if groups is None or groups.role == "target" else None
    return pick if groups is None else agree_engine(groups, pick, request, config.worker_timeout_s)


def note_engine(choice, engine: str, result: DecodeResult, seconds: float, groups: Groups | None) -> None:
    """Time the call for the next pick (where the pick is made: the target's rank) and say why it ran this engine."""
    if groups is not None and groups.role == "draft":
        result.stats.engine_choice = f"{result.stats.engine}: the target's rank chose it (its engine_choice says why)"
        return
    choice.observe(engine, result.new_tokens, seconds)
    result.stats.engine_choice = choice.describe(engine, result.stats.engine)


def batch_exactness_gaps(architectures, logits_processor, stopping_criteria) -> list[str]:
    """Why this batch cannot be decoded row by row exactly as target.generate decodes it in one batch
    (empty: it can): processors or criteria that may read other rows, models whose steps are chains,
    models whose recurrent states recurrent.py rolls back for one sequence only.

    architectures: (target's, draft's or None), as probes.describe gives them."""
    reasons = []
    names = batch_dependent(logits_processor, stopping_criteria)
    if names:
        reasons.append(f"{', '.join(sorted(set(names)))} may read other rows of the batch")
    for role, architecture in zip(("target", "draft"), architectures):
        if architecture is None:
            continue
        if architecture.recurrent:
            reasons.append(f"the {role}'s recurrent state rolls back per sequence ({architecture.chain_reason})")
        elif architecture.shape == "chain":
            reasons.append(f"the {role}'s steps must be chains ({architecture.chain_reason})")
    return reasons
