"""Capturable steps: one model forward over fixed-capacity buffers, with no host sync inside.

The adaptive round (engine/serial.py) sizes every forward by the prefix and the tree it grew, and
reads back what it needs as it goes. A CUDA graph, or `torch.compile(fullgraph=True,
dynamic=False)`, needs the opposite: the same shapes every call and no value read by the host.
Here a model's KV lives in a `SlotCache` of C slots per layer (C bucketed, so it does not follow
the prompt's length); a step writes its Q queries at the slots a (Q,) tensor names and attends all
C slots through an additive mask (1, 1, Q, C) that says which slot each query sees. Slot order is
free: positions come from `position_ids`, so committing a path is a copy of slots, and where a
step's padding queries write does not matter as long as no mask lets anyone see them.

Shapes of a step depend on Q and C only, so one compiled graph serves every call of a given Q
(the draft's chain and expansion widths, the target's tree size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .architectures import context_limit
from .compat import Cache, CacheLayerMixin, forward_cache_argument
from .step import NO_LOGITS

MIN_CAPACITY = 512
PREFILL_CHUNK = 1024  # prompt tokens per prefill forward


def bucket_capacity(needed: int) -> int:
    """Slots per layer for `needed` positions: the next power of two from 512, so prompts of similar
    lengths share compiled graphs (the graph's shapes include C)."""
    return max(MIN_CAPACITY, 1 << (needed - 1).bit_length())


class SlotLayer(CacheLayerMixin):
    """One layer's keys (1, H, C, Dk) and values (1, H, C, Dv), allocated by the first forward, then
    written in place at the owner's `slots` and returned whole."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        C = self.owner.capacity
        self.keys = key_states.new_zeros(B, H, C, D)
        self.values = value_states.new_zeros(B, H, C, value_states.shape[-1])
        self.device = key_states.device
        if not torch.compiler.is_compiling():  # fixed addresses: a CUDA graph replays its writes in place
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (1, H, Q, D) new states at the planned slots; return the whole (1, H, C, D) buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.owner.slots, key_states)
        self.values.index_copy_(2, self.owner.slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0

    def get_seq_length(self) -> int:
        return 0  # never read: every step passes its positions and its mask

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """KV of one model for one sequence in C slots per layer. `slots` (Q,) long: where the forward
    in flight writes its queries (set by `run_step` before each forward)."""

    def __init__(self, num_layers: int, capacity: int, argument: str):
        self.capacity = capacity
        self.argument = argument  # the name the model's forward takes its cache under (compat.forward_cache_argument)
        self.slots: torch.Tensor | None = None
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @classmethod
    def for_model(cls, model: PreTrainedModel, capacity: int) -> "SlotCache":
        """A cache of `capacity` slots for each of the model's layers, passed under its forward's cache argument."""
        return cls(model.config.get_text_config().num_hidden_layers, capacity, forward_cache_argument(type(model)))

    @property
    def allocated(self) -> bool:
        """Whether every layer's buffers exist (a first forward allocates them)."""
        return all(layer.is_initialized for layer in self.layers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every layer's keys and values (1, H, C, D)."""
        return [buffer for layer in self.layers for buffer in (layer.keys, layer.values)]


def move_slots(buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move slots src (K,) to dst (K,) in every buffer (1, H, C, D); sources are read before anything is
    written, so a slot may be both (a padding entry that copies a slot onto itself)."""
    for buffer in buffers:
        buffer.index_copy_(2, dst, buffer.index_select(2, src))


def forward_slots(model: PreTrainedModel, cache: SlotCache, input_ids, position_ids, slots, mask, keep: int = 0) -> torch.Tensor:
    """The capturable step: one forward of (1, Q) queries at `position_ids` (1, Q), writing their KV at
    `slots` (Q,), each seeing what `mask` (1, 1, Q, C) additive allows; returns float32 logits (Q, V)
    (only the last `keep` queries' if keep > 0; none with keep=NO_LOGITS, for a model that takes indices).

    Nothing in it reads a value on the host, and its shapes depend on Q and C only. It calls
    `model.forward`, not the module: hooks on the model itself would be traced into the graph (a
    counting hook made every call recompile); the engine counts its forwards itself."""
    cache.slots = slots
    if keep == NO_LOGITS:
        keep = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    out = model.forward(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True, logits_to_keep=keep,
        **{cache.argument: cache},  # (resolved outside: a compiled step traces no signature lookups)
    )
    return out.logits[0].float()


@dataclass
class StaticModel:
    """A model with its SlotCache and its step, eager or compiled (`compiled`)."""

    model: PreTrainedModel
    cache: SlotCache
    compiled: bool = False
    last_position: int | None = None  # the model's last position (learned embeddings end there); None: no end
    headless: bool = False  # a forward run for its KV alone skips the vocabulary head (Architecture.headless)
    step: object = field(init=False, repr=False)
    move: object = field(init=False, repr=False)
    device: torch.device = field(init=False)
    warmed: set = field(default_factory=set)  # step sizes compiled at this capacity (warm_steps)

    def __post_init__(self):
        self.device = self.model.device  # (the model's property walks its parameters: 50 us a call)
        self.step = compiled_step(self.device) if self.compiled else forward_slots
        self.move = compiled_move() if self.compiled else move_slots

    @classmethod
    def build(cls, model: PreTrainedModel, needed: int, compiled: bool = False, headless: bool = False) -> "StaticModel":
        limit = context_limit(model)
        cache = SlotCache.for_model(model, bucket_capacity(needed))
        return cls(model, cache, compiled, None if limit is None else limit - 1, headless)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor):
        """Logits (Q, V) of one step (shapes as forward_slots). Positions past the model's last are
        clamped to it: a node placed there (a padding query, a tree node deeper than the tokens left to
        emit) can never have its logits used, since every token it could lead to lies past the end."""
        if self.last_position is not None:
            position_ids = position_ids.clamp(max=self.last_position)
        with torch.no_grad():
            if self.compiled and not self.cache.allocated:  # buffers allocated inside a CUDA graph would be its
                forward_slots(self.model, self.cache, input_ids, position_ids, slots, mask)  # outputs: overwritten
            if not (self.compiled and self.device.type == "cuda"):
                return self.step(self.model, self.cache, input_ids, position_ids, slots, mask)
            torch.compiler.cudagraph_mark_step_begin()  # no output of an earlier replay is alive: each is cloned
            return self.step(self.model, self.cache, input_ids, position_ids, slots, mask).clone()

    def prefill(self, tokens: list[int]) -> None:
        """Run a prompt's tokens as one causal chain into slots [0, n) (eager: its shape is the prompt's)."""
        self.extend(tokens, 0)

    def extend(self, tokens: list[int], first: int) -> None:
        """Run tokens at positions and slots [first, first + n) as one causal chain after the committed
        slots [0, first), eagerly, PREFILL_CHUNK tokens a forward (each forward's mask is (chunk, C): one
        (n, C) mask for an 8k-token prompt would take 0.5 GB). Run for the KV alone: no logits (one row
        where the model's head takes only a count: a 262k-token head costs as much for one row as for none)."""
        device = self.device
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            slots = torch.arange(first + start, first + start + len(chunk), device=device)
            with torch.no_grad():
                forward_slots(
                    self.model, self.cache, torch.tensor([chunk], device=device), slots[None], slots,
                    chain_mask(slots, self.capacity, self.model.dtype), keep=NO_LOGITS if self.headless else 1,
                )


_COMPILED: dict[str, object] = {}


def compiled_step(device: torch.device):
    """forward_slots compiled whole (fullgraph: a graph break is an error), one graph per step shape;
    on CUDA each graph is also captured as a CUDA graph (mode="reduce-overhead")."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(forward_slots, fullgraph=True, dynamic=False, mode=mode)
    return _COMPILED[mode]


def warm_steps(model: "StaticModel", sizes, first: int, moves: bool = False) -> None:
    """Compile now the steps of `sizes` queries this model has not run yet (with `moves`, also the commit
    of a round of that many nodes), by running each once on slots [first, first + Q) (past its committed
    ones: what they write is never seen), so that no round stalls on a compile later; a no-op for eager
    steps and for shapes already run."""
    if not model.compiled:
        return
    for Q in sorted(set(sizes) - model.warmed):
        slots = torch.arange(first, first + Q, device=model.device)
        causal = torch.ones(Q, Q, dtype=torch.bool, device=model.device).tril_()
        model.run(torch.zeros(1, Q, dtype=torch.long, device=model.device), slots[None], slots,
                  step_mask(first, causal, first, model.capacity, model.model.dtype))
        if moves and Q > 1:  # (distinct tensors: a graph traced with src is dst would serve only that case)
            model.move(model.cache.buffers, slots.clone(), slots)
        model.warmed.add(Q)


GRAPHS_PER_STEP = 128  # graphs of forward_slots / move_slots torch.compile may build (torch's default: 8)


def graph_limit():
    """While a static round runs: room for every (model, query count, capacity) graph of forward_slots,
    a few per capacity bucket and model (dynamo's default of 8 per function failed a second bucket). Set
    for the round only, so the user's own torch.compile settings stay as they are."""
    return torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_STEP)


_MOVE = None


def compiled_move():
    """move_slots compiled: one fused kernel for every layer (2 x layers small ops eagerly)."""
    global _MOVE
    if _MOVE is None:
        _MOVE = torch.compile(move_slots, fullgraph=True, dynamic=False)
    return _MOVE


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, Q, C) from allowed (1, Q, C) bool: 0 where seen, dtype's min elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def chain_mask(slots: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, n, C) of a causal chain written at consecutive `slots` (n,) after the
    committed slots: query j sees every slot up to its own."""
    return additive((slots[:, None] >= torch.arange(capacity, device=slots.device)[None])[None], dtype)


def step_mask(prefix: int, region: torch.Tensor, region_start: int, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, Q, C): every query sees the committed slots [0, prefix) and, of the region
    slots [region_start, region_start + S), those `region` (Q, S) bool marks."""
    Q, S = region.shape
    slots = torch.arange(capacity, device=region.device)
    allowed = (slots < prefix)[None].expand(Q, capacity).clone()
    allowed[:, region_start : region_start + S] = region
    return additive(allowed[None], dtype)
