"""How far from its limits a run is: the memory-bandwidth floor of one verification step
(`LimitReport`), and swiftspec's memory over target.generate alone (`MemoryBudget`, with the
check that no cache buffer grows during a generation: the device round's SlotCache, the host round's TreeCache)."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, fields

import torch

from ..steps.cache import TreeCache
from ..steps.capture import capacity_bucket, largest_capacity
from ..steps.slot_cache import SlotCache
from ..engine.device_sides import tree_region_slots
from ..models.compat import CACHE_ARGUMENTS
from ..modeling import SwiftSpecForCausalLM
from ..models.architectures import context_limit
from ..config import MAX_BUDGET
from ..steps.tree import new_tree
from .measure import MIB, generation_kwargs, synchronize
from .schema import BenchConfig, BenchModels, CacheTrace, LimitReport, MemoryBudget, SetResult



def parameter_bytes(model) -> int:
    """Bytes of a model's parameters (tied weights counted once, as parameters() yields them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_bandwidth_gbps(device: torch.device, mib: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth of `device` in GB/s (bytes read + written), best of `repeats` copies of `mib` MiB.

    A rough peak: on CPU it is what torch's copy reaches with the current thread count."""
    src = torch.ones(mib * MIB, dtype=torch.uint8, device=device)  # ones, not empty: pages must be touched
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def peak_bandwidth(config: BenchConfig, device: torch.device) -> tuple[float, str]:
    """(GB/s, where the figure comes from): config.peak_gbps, else a tensor-copy measurement."""
    if config.peak_gbps is not None:
        return config.peak_gbps, "given"
    mib = 1024 if device.type == "cuda" else 256
    gbps = measure_bandwidth_gbps(device, mib)
    return gbps, f"measured: best of 5 copies of a {mib} MiB tensor on {device}, {torch.get_num_threads()} thread(s)"


def weight_bytes_read(model) -> int:
    """Bytes one forward streams from memory: every parameter once, except an input embedding not
    shared with the output head, of which a step reads only the rows of its T tokens."""
    total = parameter_bytes(model)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    """KV cache bytes per position of context: layers x (K, V) x KV heads x head dim x dtype size."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize


def limit_report(result: SetResult, target, peak_gbps: float, peak_source: str) -> LimitReport | None:
    """The floor of one verification step at the set's mean context, against the measured step of
    the batch-1 calls (None without them: a batch's step reads the weights once for several rows)."""
    methods = {m.name: m for m in result.at(1) if m.status == "ok"}
    spec = next((methods[n] for n in ("swiftspec_serial", "swiftspec_async") if n in methods), None)
    base = methods.get("target")
    if spec is None or spec.verify_step_ms is None or base is None or not base.runs:
        return None
    new_tokens = {run.prompts[0]: run.new_tokens for run in base.runs}
    context = statistics.mean(info.prompt_tokens + new_tokens[info.index] / 2 for info in result.prompts)
    weights, kv = weight_bytes_read(target), kv_bytes_per_token(target) * context
    floor_ms = 1000 * (weights + kv) / (peak_gbps * 1e9)
    target_step_ms = statistics.mean(1000 * run.seconds / run.new_tokens for run in base.runs if run.new_tokens)
    return LimitReport(
        method=spec.name,
        device=str(target.device),
        peak_gbps=round(peak_gbps, 3),
        peak_source=peak_source,
        weight_mb=round(weights / 1e6, 3),
        kv_mb=round(kv / 1e6, 3),
        context_tokens=round(context, 1),
        floor_ms=round(floor_ms, 4),
        verify_step_ms=round(spec.verify_step_ms.mean, 4),
        verify_over_floor=round(spec.verify_step_ms.mean / floor_ms, 3),
        target_step_ms=round(target_step_ms, 4),
        target_step_over_floor=round(target_step_ms / floor_ms, 3),
        tau=round(spec.tau.mean, 3),
        ceiling_tokens_per_s=round(1000 * spec.tau.mean / floor_ms, 2),
        tokens_per_s=round(spec.tokens_per_s.mean, 2),
    )


@dataclass(frozen=True)
class CacheSample:
    """A SlotCache or TreeCache right after one forward."""

    cache_id: int
    data_ptr: int
    shape: tuple[int, ...]
    capacity: int
    length: int
    tree_slots: int | None  # positions in the tree region after a tree step; None after a prefill
    nbytes: int


def tree_cache_sample(cache: TreeCache, kwargs: dict) -> CacheSample | None:
    """The host round's cache after a forward. Tree steps pass a mask; a prefill (or the draft's first chain) does
    not, and its tokens join the prefix only after the forward, so they are not tree slots."""
    if cache.kv is None:
        return None
    tree = cache.length - cache.prefix_len if kwargs.get("attention_mask") is not None else None
    return CacheSample(id(cache), cache.kv.data_ptr(), tuple(cache.kv.shape), cache.capacity, cache.length, tree,
                       cache.kv.numel() * cache.kv.element_size())


def slot_cache_sample(cache: SlotCache, kwargs: dict, first: bool) -> CacheSample | None:
    """The device round's cache after a forward: its first buffer's address and shape, the slots its queries wrote
    (one host read of `index`: a check, not a timed run); `first` (the cache's first forward, its prompt's
    prefill) holds no tree slots."""
    if not cache.buffers:
        return None
    data = cache.buffers[0].data
    queries = cache.index.shape[1] if cache.index is not None else 0
    length = int(cache.index.max()) + 1 if cache.index is not None else cache.span
    return CacheSample(id(cache), data.data_ptr(), tuple(data.shape), cache.capacity, length,
                       None if first else queries, sum(b.data.numel() * b.data.element_size() for b in cache.buffers))


@contextlib.contextmanager
def sampling_caches(model, samples: list[CacheSample]):
    """Record the cache (SlotCache or TreeCache) each forward of `model` wrote into (nothing else is touched)."""
    seen: set[int] = set()

    def record(module, args, kwargs, output):
        cache = next((kwargs[name] for name in CACHE_ARGUMENTS
                      if isinstance(kwargs.get(name), (TreeCache, SlotCache))), None)
        if isinstance(cache, TreeCache):
            sample = tree_cache_sample(cache, kwargs)
        elif isinstance(cache, SlotCache):
            sample = slot_cache_sample(cache, kwargs, first=id(cache) not in seen)
            seen.add(id(cache))
        else:
            sample = None
        if sample is not None:
            samples.append(sample)

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        yield samples
    finally:
        handle.remove()


def cache_trace(role: str, samples: list[CacheSample]) -> CacheTrace:
    if not samples:
        raise RuntimeError(f"The {role} wrote no SlotCache or TreeCache during the memory check; the engine uses another cache?")
    last = samples[-1]
    return CacheTrace(
        role=role,
        forwards=len(samples),
        caches=len({s.cache_id for s in samples}),
        buffers=len({(s.cache_id, s.data_ptr, s.shape) for s in samples}),
        shape=list(last.shape),
        capacity=last.capacity,
        max_length=max(s.length for s in samples),
        max_tree_slots=max((s.tree_slots for s in samples if s.tree_slots is not None), default=0),
        mib=round(last.nbytes / MIB, 3),
    )


def token_tree_bytes(capacity: int) -> int:
    """Bytes of the draft's TokenTree tensors at `capacity` nodes (built on the meta device: no memory)."""
    tree = new_tree(0, capacity, "meta")
    tensors = [getattr(tree, f.name) for f in fields(tree)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def memory_budget(models: BenchModels, settings: dict, ids: torch.Tensor, new_tokens: int) -> MemoryBudget:
    """Generate `new_tokens` from ids (1, L) with the pair's settings (the round round="auto" takes), watching both
    caches.

    The draft expands every round (draft_depth 2 unless set), so its tree region is exercised even
    where the policy would decode plainly."""
    settings = {**settings, "draft_depth": settings.get("draft_depth") or 2}
    tokenizers = {"tokenizer": models.tokenizer, "draft_tokenizer": models.draft_tokenizer} if (
        models.draft_tokenizer is not None and models.draft_tokenizer is not models.tokenizer) else {}
    model = SwiftSpecForCausalLM.from_models(models.target, models.draft, **tokenizers, **settings)
    samples: dict[str, list[CacheSample]] = {"target": [], "draft": []}
    with sampling_caches(models.target, samples["target"]), sampling_caches(models.draft, samples["draft"]):
        model.generate(ids, swiftspec=True, **generation_kwargs(ids, new_tokens))
    target, draft = cache_trace("target", samples["target"]), cache_trace("draft", samples["draft"])
    context = ids.shape[1] + new_tokens
    config = model.config
    target_kv = kv_bytes_per_token(models.target) * context / MIB
    tree = token_tree_bytes(config.tree_capacity) / MIB
    draft_weights = parameter_bytes(models.draft) / MIB
    scratch = 1  # each cache's last slot takes the writes of a batch's padding queries
    target_extra, draft_extra = target.capacity - scratch - context, draft.capacity - scratch - context
    budget = config.tree_budget or MAX_BUDGET  # None: the policy's largest tree
    if model.swiftspec_stats.engine == "device":  # a row's slots: the context and the largest round's tree, bucketed
        region = tree_region_slots(config.draft_depth, config.draft_width, budget - 1)
        room = capacity_bucket(context + region) - scratch - context
    else:  # a replayed host round (capture.py) gives a cache a capacity its graphs serve other calls at
        whole = context_limit(models.target)
        room = largest_capacity(context + budget, whole and whole + budget) - context if model.captures.runners else budget
    return MemoryBudget(
        context_tokens=context,
        target_weights_mib=round(parameter_bytes(models.target) / MIB, 3),
        draft_weights_mib=round(draft_weights, 3),
        target_kv_mib=round(target_kv, 3),
        target_tree_cache_mib=target.mib,
        draft_tree_cache_mib=draft.mib,
        token_tree_mib=round(tree, 3),
        extra_mib=round(draft_weights + draft.mib + tree + target.mib - target_kv, 3),
        target_extra_slots=target_extra,
        tree_budget=budget,
        draft_extra_slots=draft_extra,
        tree_capacity=config.tree_capacity,
        within_tree_region=target_extra <= room and draft.max_tree_slots <= config.tree_capacity,
        no_growth=all(t.caches == 1 and t.buffers == 1 for t in (target, draft)),
        traces=[target, draft],
    )
