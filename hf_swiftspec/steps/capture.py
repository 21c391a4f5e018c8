"""Replayed forwards: a runner around the one round's steps (step.py) that captures each step's forward
once per bucket and replays it, so a step costs one launch instead of one per kernel.

On a GPU an eager transformers forward is bound by the host's launches (an 8B-shaped verification
22.5 ms eager against 7.8 ms replayed on an H200); a CUDA graph replays every kernel of a forward
in one launch. A graph replays fixed addresses and fixed shapes, so a replayed step:

- is padded to a bucket: B rows of Q queries, Q the next power of two of the step's largest row
  (padding queries write to the cache's scratch slot and are never seen);
- is planned `fixed` by the TreeCache (cache.py): every query writes at the slot a (B, Q) device tensor
  names and every layer attends all `capacity` slots, so nothing in it follows the prefix's length;
- reads its inputs (ids, positions, write slots, the dense tree masks) from static buffers the runner
  owns, copied in before each replay, and its KV from buffers taken from the runner's `BufferPool`,
  whose addresses outlive one generate() call (graphs captured in one call serve the next).

The round itself does not change: `run_step` hands a step to `StepRunner.run`, which replays it when
it can and says why not when it cannot (`StepRunner.fallbacks`, shown in `swiftspec_stats.attention`);
such a step runs eagerly as before. A model whose forward cannot be captured (recurrent states, a
mask built by the model from cache lengths) never gets a runner. A target tapped by a draft head (an
EAGLE-3 head's or an MTP layer's hooks) replays too: its hooks run at capture only, so the captured
step takes the tap's states as a second output, and each replay hands the tap a copy. A draft head's
own steps replay the same way, its hidden output (what the tree's next depth reads) the second output.

StepRunner is replay.py's runner (what the device round's PhaseRunner is too: static inputs, one memory pool,
the capture after a warm-up on a side stream, the "emulate" stand-in, a refused bucket run eagerly with its
reason); what is a step's own is here: buckets of queries, the TreeCache's slots and host bookkeeping, taps, and
compiled layers.

Backends (`StepRunner.backend`):
  "cuda"     torch.cuda.CUDAGraph, one per bucket, captured the first time the bucket runs (after one
             eager warm-up run on a side stream), sharing one memory pool per model.
  "compiled" no graph (a CPU has none): each fixed step runs with its decoder layers compiled.
  "emulate"  CPU: a stand-in with a graph's semantics, for tests: "capturing" runs the step once and
             keeps it; a "replay" runs it again with the cache's host bookkeeping put back as it was
             at capture, so any input the runner failed to make static, or any host value the forward
             reads, gives wrong tokens instead of passing unnoticed. Slower than eager; never a default.

With `compile_layers` (SwiftSpecConfig.compile) the forward a graph captures runs the model's decoder layers
through torch.compile (the tree kernel, if any, as one custom operator in their graph): the elementwise kernels between the matrix products fuse, which a graph of
eager kernels cannot do (one small kernel costs a few microseconds even replayed, and an 8B forward has about
a thousand). Every decoder layer runs the same compiled code (the layers are alike), so compiling costs about
one layer's per step shape (bucket) and model; the layers are compiled for the forward only and left as they
were.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from .cache import BufferPool, TreeCache
from .replay import Replay, ReplayRunner
from ..models.compat import forward_cache_argument

MAX_QUERIES = 64  # queries per row replayed at most; a larger step (a long catch-up) runs eagerly
CAPTURE_CHOICES = ("auto", True, False)


SMALLEST_CAPACITY = 256  # the smallest capacity a replayed cache (or the device round's slots) holds, in positions


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): every bucket a replayed shape is padded to."""
    return 1 << max(n - 1, 0).bit_length()


def query_bucket(queries: int) -> int | None:
    """The bucket (a power of two) a step of `queries` queries per row is padded to; None past MAX_QUERIES."""
    bucket = power_of_two(queries)
    return bucket if bucket <= MAX_QUERIES else None


def step_menu(most_queries: int, keeps: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Every step a worker whose steps hold up to `most_queries` queries a row may replay: (keep, query bucket) for
    each of its `keeps` (step.step_keep) and each bucket up to query_bucket(most_queries) (at most MAX_QUERIES: a
    larger step runs eagerly). A few per model (the buckets are powers of two), which its runner prepares before the
    rounds (step.prepare_steps)."""
    largest = query_bucket(min(most_queries, MAX_QUERIES))
    return tuple((keep, 1 << i) for keep in keeps for i in range(largest.bit_length()))


def capacity_bucket(needed: int) -> int:
    """Positions per row a replayed cache holds (the host round's, and the device round's slots): the next power of
    two from SMALLEST_CAPACITY, so calls of similar lengths share their buffers and graphs (a graph's shapes include
    the capacity)."""
    return max(SMALLEST_CAPACITY, power_of_two(needed))


REUSE = 4  # a replayed cache takes buffers (and their graphs) captured at up to this many times the positions it needs
WHOLE_CONTEXT = 1024  # a model whose whole context (plus the tree's room) fits this gets one capacity for every call


def largest_capacity(needed: int, whole: int | None = None) -> int:
    """The most positions StepRunner.capacity_for can give a cache that needs `needed` (`whole`: as there)."""
    shared = whole if whole is not None and needed <= whole <= WHOLE_CONTEXT else needed
    return max(REUSE * needed, capacity_bucket(shared))


def capture_backend(choice, device: torch.device, compile_layers: bool = False) -> str | None:
    """The backend SwiftSpecConfig.capture (and .compile) ask for on `device`: "cuda", "compiled", "emulate" or
    None (eager steps, as without capture.py)."""
    if choice not in CAPTURE_CHOICES:
        raise ValueError(f"SwiftSpecConfig.capture={choice!r}; use 'auto' (CUDA graphs on CUDA), True or False.")
    if choice is not False and device.type == "cuda":
        return "cuda"
    if choice is True:
        return "emulate"
    return "compiled" if compile_layers else None


def capture_gap(architecture) -> str | None:
    """Why a model's steps cannot be replayed (they then run eagerly), or None."""
    if architecture.shape == "chain":
        return "its steps are chains, masked by the model from the cache's lengths"
    if architecture.recurrent:
        return "recurrent states are saved and rolled back around each step"
    if architecture.slot_limits:
        return "its attention applies rules by cache slot"
    return None


@dataclass
class Bucket(Replay):
    """One captured forward and the static tensors it reads and writes.

    inputs: {name: tensor} static copies of what changes between steps (ids (B, Q), positions (B, Q), masks or
        the kernel's lengths and bits: attention.fixed_step_inputs); index: (B, Q) long, the slot each query
        writes; outputs: "logits" (B, Q, V) float32 and, for a tapped target or a draft head, "extra"
    """

    index: torch.Tensor | None = None
    snapshot: tuple = ()  # "emulate": the cache's host bookkeeping at capture

    @property
    def logits(self) -> torch.Tensor:
        return self.outputs["logits"]

    @property
    def extra(self) -> torch.Tensor | None:
        """A tapped target's states (B, Q, D) (its tap's take()), or a draft head's hidden (B, Q, H)."""
        return self.outputs.get("extra")


@dataclass
class StepRunner(ReplayRunner):
    """One model's captured forwards, by bucket, and the buffers its TreeCache packs into (replay.py's runner, whose
    `graphs` are its buckets).

    backend: "cuda", "compiled" or "emulate" (module docstring).
    compile_layers: whether the captured forward runs the decoder layers compiled (module docstring).
    pool: the KV buffers; their addresses are part of every graph's key, so a cache that got other
        buffers (another capacity, fewer rows) gets graphs of its own.
    fallbacks: why steps ran eagerly instead (a bucket whose capture failed, a step past MAX_QUERIES).
    setup_s: seconds spent on steps that captured (or, "compiled", first compiled) their bucket: not what a step
        costs, so the goodput policy learns nothing from a round that paid some (engine/adaptive.py).
    """

    compile_layers: bool = False
    pool: BufferPool = field(default_factory=BufferPool)
    compiled: dict = field(default_factory=dict)  # per decoder layer, its torch.compile'd call
    capacities: set = field(default_factory=set)  # positions per row of the caches packed into `pool` so far
    compiled_keys: set = field(default_factory=set)  # "compiled": the step shapes run (and so compiled) so far
    prepared: set = field(default_factory=set)  # (layout_key, menu) of the caches whose steps were prepared
    prepared_sizes: set = field(default_factory=set)  # (rows, capacity) of caches prepared before their first forward

    @property
    def buckets(self) -> dict[tuple, Bucket]:
        return self.graphs

    @property
    def captures(self) -> int:
        return self.captured

    def forward(self, model, cache: TreeCache, kwargs: dict, keep, hidden: bool = False):
        """`forward` below, with the decoder layers compiled when compile_layers."""
        if not self.compile_layers:
            return forward(model, cache, kwargs, keep, hidden)
        with compiled_layers(model, self.compiled), torch._dynamo.config.patch(recompile_limit=RECOMPILES):
            return forward(model, cache, kwargs, keep, hidden)

    def capacity_for(self, needed: int, whole: int | None = None) -> int:
        """Positions per row for a replayed cache that needs `needed`: the smallest capacity this runner already
        has buffers (and graphs) at, if at most REUSE times `needed`, so a call of another length captures nothing
        new; else capacity_bucket(needed), or capacity_bucket(whole) where `whole` (the model's context plus the
        tree's room) is at most WHOLE_CONTEXT: then every call shares one capacity, captured by the first."""
        fits = [c for c in self.capacities if needed <= c <= REUSE * needed]
        if fits:
            return min(fits)
        capacity = capacity_bucket(whole if whole is not None and needed <= whole <= WHOLE_CONTEXT else needed)
        self.capacities.add(capacity)
        return capacity

    def bucket_key(self, cache: TreeCache, tensors: dict, keep, tap=None) -> tuple:
        """What a step's graph bakes in: its inputs' shapes, its logits kept, and its cache's layout."""
        shapes = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(tensors.items()))
        return shapes, str(keep), *self.layout_key(cache, tap)

    @staticmethod
    def layout_key(cache: TreeCache, tap=None) -> tuple:
        """The cache's buffers (addresses, shapes: its rows and capacity) and the tap a step over it hands states to."""
        buffers = tuple((b.data.data_ptr(), tuple(b.data.shape), b.data.stride()) for b in cache.buffers)
        return buffers, tap.key if tap is not None else None

    def run(self, model, cache: TreeCache, tensors: dict, build, keep, tap=None,
            hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits (B, Q, V) float32, hidden or None) of one planned fixed step (cache.plan_step(..., fixed=True)),
        replayed; the caller advances the cache. tensors: {name: tensor} what changes between steps;
        build(tensors): the forward's keyword arguments made of them (attention.fixed_step_inputs).

        tap: a target's hidden-state tap for a draft head (eagle3.FeatureTap, mtp.FinalStateTap), or None. Its
            hooks run at capture only, so the captured step takes its states into the bucket's static `extra`,
            and each replay hands the tap a copy (its next take() returns them).
        hidden: the model is a draft head (eagle3.DraftHead): its hidden output (B, Q, H) comes back too."""
        key = self.bucket_key(cache, tensors, keep, tap)
        if self.backend == "compiled":
            first = key not in self.compiled_keys
            self.compiled_keys.add(key)
            with self.setting_up() if first else contextlib.nullcontext():
                return self.forward(model, cache, build(tensors), keep, hidden)
        bucket = self.buckets.get(key)
        if bucket is None and self.refusal(key) is None:
            with self.setting_up():
                bucket = self.capture(key, model, cache, tensors, build, keep, tap, hidden)
            if bucket is not None:
                return self.outputs(bucket, tap)  # the capture ran the step itself
            self.refusal(key)
        if bucket is None:
            return self.forward(model, cache, build(tensors), keep, hidden)
        load(bucket, cache, tensors)
        self.replay_step(bucket, cache, tap)
        return self.outputs(bucket, tap)

    @staticmethod
    def outputs(bucket: Bucket, tap) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of the bucket's outputs (the next replay of this bucket overwrites them); a tap's states go to
        the tap instead."""
        extra = bucket.extra.clone() if bucket.extra is not None else None
        if tap is not None:
            tap.hand(extra)
            extra = None
        return bucket.logits.clone(), extra

    def capture(self, key, model, cache, tensors: dict, build, keep, tap=None, hidden: bool = False) -> Bucket | None:
        """A new bucket for this step, run once; None (and the reason kept) when its capture fails. On CUDA the
        warm-up writes the step's KV and the replay after the capture writes the same: a step may run twice."""
        bucket = Bucket({name: t.clone() for name, t in tensors.items()}, index=cache.step_slots().clone())
        cache.write_through(bucket.index)  # the forward reads the static index from now on
        kwargs = build(bucket.inputs)

        def step(live: TreeCache = cache, live_tap=tap) -> dict:  # a graph reads the buffers' addresses, whichever cache holds them
            logits, extra = self.forward(model, live, kwargs, keep, hidden)
            extra = live_tap.take() if live_tap is not None else extra  # the tap's states join the outputs
            return {"logits": logits} if extra is None else {"logits": logits, "extra": extra}

        bucket.call = step
        try:
            if self.backend == "cuda":
                self.warm_up(step)
                bucket.graph, bucket.outputs = self.record(step)
                bucket.graph.replay()
            else:
                bucket.outputs, bucket.snapshot = step(), cache.host_state()
        except Exception as error:  # noqa: BLE001  (any failure: this bucket runs eagerly, and says why)
            self.refuse(key, "capture", error)
            return None  # run() adds the reason and runs the step eagerly
        return self.keep(key, bucket)

    def replay_step(self, bucket: Bucket, cache: TreeCache, tap=None) -> None:
        if self.backend == "cuda":
            self.replay(bucket)
            return
        live = cache.host_state()  # "emulate": the forward sees the host values of its capture, as a graph would
        cache.set_host_state(bucket.snapshot)
        try:
            self.replay(bucket, cache, tap)  # (a tap's hooks run, but the step takes their states itself)
        finally:
            cache.set_host_state(live)


def forward(model, cache: TreeCache, kwargs: dict, keep, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's forward as it is captured: kwargs (input_ids (B, Q), position_ids (B, Q), the attention's, a
    head's hidden_inputs) writing where the cache's plan says; (float32 logits (B, Q, V) of the last `keep`
    queries (or none, for an index of none), a draft head's hidden output (B, Q, H) if `hidden`, else None)."""
    if hidden:  # a draft head (eagle3.DraftHead): its own forward, which takes the cache as past_key_values
        out = model(logits_to_keep=keep, past_key_values=cache, **kwargs)
        return out.logits.float(), out.hidden
    out = model(use_cache=True, logits_to_keep=keep, **{forward_cache_argument(type(model)): cache}, **kwargs)
    return out.logits.float(), None


RECOMPILES = 256  # compiled layer variants dynamo may keep: a step shape, model and capacity each (a lone call
# prepares about a dozen per model and row count: capture.step_menu; past the limit dynamo runs the layers uncompiled)


@contextlib.contextmanager
def compiled_layers(model, compiled: dict):
    """Run `model`'s decoder layers (its `_no_split_modules` classes) through torch.compile inside the block
    only: each layer's compiled call is made once and kept in `compiled`, and the layers are put back as they
    were afterwards (also a layer the user compiled himself). A model naming no layer classes runs as it is."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    saved = [layer._compiled_call_impl for layer in layers]
    for layer in layers:
        if id(layer) not in compiled:
            # Static shapes: one graph per step shape. Shapes marked dynamic let the target reuse a graph the draft's
            # layer (the same class) had compiled, and with the tree kernel it gave wrong logits (seen on a CPU and
            # an H200, float32: another token at the first verification).
            compiled[id(layer)] = torch.compile(layer._call_impl, dynamic=False)
        layer._compiled_call_impl = compiled[id(layer)]
    try:
        yield
    finally:
        for layer, old in zip(layers, saved):
            layer._compiled_call_impl = old


def load(bucket: Bucket, cache: TreeCache, tensors: dict) -> None:
    """Copy a step's live inputs (and the cache's write slots) into its bucket's static tensors."""
    bucket.load(tensors)
    bucket.index.copy_(cache.step_slots())
    cache.write_through(bucket.index)


@dataclass
class Captures:
    """The runners of a pair's models (by role), kept with the pair so graphs captured by one generate()
    call serve the next. One call uses them at a time: a concurrent call runs eagerly."""

    runners: dict[str, StepRunner] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    device: object = None  # the device round's graphs and their caches (engine/device_pool.DevicePool)

    @contextlib.contextmanager
    def claimed(self):
        """Yields whether this call has the runners (False while another call uses them)."""
        if not self.lock.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            self.lock.release()

    def for_model(self, role: str, backend: str | None, compile_layers: bool = False) -> StepRunner | None:
        if backend is None:
            return None
        kept = self.runners.get(role)
        if kept is None or (kept.backend, kept.compile_layers) != (backend, compile_layers):
            kept = self.runners[role] = StepRunner(backend, compile_layers=compile_layers)
        return kept

    def clear(self) -> None:
        """Drop every graph and buffer (e.g. after moving the models)."""
        self.runners.clear()
        self.device = None
