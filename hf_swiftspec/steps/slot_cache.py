"""A fixed-shape KV cache and the forwards over it that a round on the device runs (building blocks).

Per row b of B, C slots (the capacity): [0, prefix_lens[b]) the committed prefix, then the round's tree region
(tree node i, or verified node i, at slot prefix_lens[b] + i). A forward attends the first `span` slots only (the
live-length bucket the host sets before each phase: every row's prefix and tree fit it), whose last slot is a
scratch slot where padding queries write; it writes its (B, Q) queries at the slots a (B, Q) device tensor names
and sees them through an additive 4D mask (transformers passes a 4D mask through unchanged), so nothing in it
follows a length and the host reads nothing: prefix lengths are device tensors, and a replayed phase is keyed by
its span.

A cache built with `attention` a kernel backend (steps/attention.py's resolve_attention: "triton", or its torch
reference) attends through the tree kernel instead (its model routed to it: attention.routed_attention): each
query's committed prefix (slots [0, prefix_len) of its row) and the region slots its bits name (its tree ancestors,
or a catch-up's tokens before it), from per-row device lengths over the span, GQA-aware (transformers' sdpa with a
mask repeats K and V for every query head); a layer the kernel cannot serve exactly (attention sinks; keys and
values of different widths: attention.kernel_gap) takes the dense mask through the model's own attention, and the
cache's `fallbacks` say why.

Every layer's keys and values live in one buffer (cache.SlotBuffer, the tree cache's: layers of one shape stacked),
so a commit moves every layer with one fused operator per buffer (swiftspec_kernels.commit_slots, commit_plan's rule).

Windowed layers (a sliding window, a chunk: models/architectures.LayerMask) are a term of the mask: a slot cache
built with its model's Architecture gives each window rule its own mask (the forward takes one per layer type,
Architecture.attention_mask), in which a query at position p sees the committed slots and the ancestors from the
rule's first visible position of p on (committed slot j holds position j: rows are packed without padding; tree
node i sits at position prefix_len + its depth). A layer's KV outside its window is never seen, so the cache keeps
every position (its capacity) for every layer, as for full attention. A model with full attention only builds the
one mask it always did.

A chain's cache (`chained`: engine/device_chains.py, one row whose every node's slot is its position) reads like
transformers' own instead, for models that place tokens by cache slot (ALiBi, forwards without position_ids, rules
banded by key slot) or keep a recurrent state: its host-known `length` is the row's slots so far, `get_seq_length`
returns it, a forward sees the keys up to its last query's slot and no mask (the model masks causally itself), and
transformers' state layers sit at the stateful layers (their states saved after every forward: steps/recurrent.py's
StateLog). engine/device_sides.py runs the device round over two slot caches, the target's and the draft's
(cache.TreeCache's fixed steps hold the same layout with host lengths).
"""

from __future__ import annotations

import torch
from swiftspec_kernels.commit_slots import commit_slots
from swiftspec_kernels.tree_mask import tree_mask

from ..models.architectures import FULL, Architecture, LayerMask
from ..models.compat import Cache, CacheLayerMixin, forward_cache_argument
from .attention import KERNEL_BACKENDS, slot_step_kwargs
from .cache import INDEXER_DIM, KV_DIM, SlotBuffer
from .acceptance import Walk
from .capture import power_of_two
from .device_round import DeviceSubtree
from .recurrent import STATE_LAYER_TYPES, StateLog
from ..models.compat import LinearAttentionLayer

SMALLEST_SPAN = 64  # the shortest live length a forward attends (a power of two: span_bucket)


def span_bucket(slots: int) -> int:
    """The live length a forward over rows needing `slots` slots (their prefix, tree and the scratch slot) attends:
    the next power of two, at least SMALLEST_SPAN (a replayed phase is captured once per span)."""
    return max(SMALLEST_SPAN, power_of_two(slots))


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values (B, H, C, D) (views of the cache's shared buffers once packed), written at the
    slots its cache's `index` (B, Q) names; a forward reads their first `span` slots."""

    is_compileable = False

    def __init__(self, owner: "SlotCache", is_sliding: bool = False):
        super().__init__()
        self.owner, self.is_sliding = owner, is_sliding  # (transformers' mask helpers ask; the 4D masks decide)
        self.indexer_keys: torch.Tensor | None = None  # (B, C, D) a sparse-attention indexer's keys (the owner's)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, _ = key_states.shape
        C = self.owner.capacity
        self.keys = key_states.new_zeros(B, H, C, key_states.shape[-1])
        self.values = value_states.new_zeros(B, H, C, value_states.shape[-1])
        self.is_initialized = True
        self.owner.pack()  # once the last layer has its tensors: every layer's into shared buffers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter (B, H, Q, D) new states at the planned slots; return the (B, H, span, D) live part of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, Q, _ = key_states.shape
        index = self.owner.index[:, None, :, None]  # (B, 1, Q, 1)
        self.keys.scatter_(2, index.expand(B, H, Q, self.keys.shape[-1]), key_states)
        self.values.scatter_(2, index.expand(B, H, Q, self.values.shape[-1]), value_states)
        end = self.owner.end(Q)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """A sparse-attention indexer's keys (B, Q, D), scattered at the planned slots like keys and values (every
        layer's in one buffer of the cache, made at the first: SlotCache.indexer_buffer); returns the (B, span, D) live
        part."""
        if self.indexer_keys is None:
            self.owner.make_indexer(indexer_key_states.shape[0], indexer_key_states)
        B, Q, D = indexer_key_states.shape
        self.indexer_keys.scatter_(1, self.owner.index[:, :, None].expand(B, Q, D), indexer_key_states)
        return self.indexer_keys[:, : self.owner.end(Q)]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.end(query_length), 0

    def get_seq_length(self) -> int:
        # positions come from position_ids and visibility from the 4D mask: no length is read (a chain's: its length)
        return self.owner.length or 0

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotStateLayer(LinearAttentionLayer, SlotLayer):
    """A hybrid layer of a chain's cache: transformers' recurrent / convolution states beside the slot cache's keys
    and values (recurrent.TreeStateLayer's twin)."""

    def __init__(self, owner: "SlotCache", number_of_states: int = 1):
        SlotLayer.__init__(self, owner)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # keys and values, from update()
            SlotLayer.lazy_initialization(self, *args)
        else:  # a state, from update_conv_state / update_recurrent_state
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def get_max_length(self) -> int:
        return SlotLayer.get_max_length(self)

    def get_seq_length(self) -> int:  # the chain's length (5.25's LinearAttentionLayer counts its state's tokens instead)
        return SlotLayer.get_seq_length(self)


class SlotCache(Cache):
    """A model's fixed-shape KV cache for B rows of C slots each; a forward writes its (B, Q) queries at `index`
    (B, Q) long, set before it, and attends the first `span` slots (slot span - 1: scratch). architecture: its
    model's (steps/probes.describe), whose window rules its forwards' masks apply; None: full attention
    in every layer. attention: how its forwards attend (attention.resolve_attention's backend: a kernel backend
    through the tree kernel, else the model's own attention over dense masks); fallbacks: why layers of a
    kernel-routed forward ran their own attention."""

    def __init__(self, num_layers: int, capacity: int, architecture: Architecture | None = None,
                 attention: str = "sdpa"):
        self.capacity = capacity
        self.span = capacity
        self.index: torch.Tensor | None = None
        self.architecture = architecture
        self.attention = attention
        self.fallbacks: set[str] = set()
        self.kv_buffers: list[SlotBuffer] = []  # every layer's keys and values, stacked by shape (after the first forward)
        self.indexer_buffer: SlotBuffer | None = None  # every layer's indexer keys (a sparse-attention model's), or None
        self.length: int | None = None  # a chain's row: its slots so far, host-known (None: 4D masks over the span)
        self.states: StateLog | None = None  # a chain's recurrent states, saved after every forward (None: none)
        self.replay: torch.Tensor | None = None  # (1, R) tokens a chain's states run again before its next nodes
        sliding = architecture.sliding if architecture is not None else (False,) * num_layers
        super().__init__(layers=[SlotLayer(self, sliding[i]) for i in range(num_layers)])

    def attention_mask(self, build) -> torch.Tensor | dict[str, torch.Tensor]:
        """A forward's attention_mask from build(rule) (LayerMask -> (B, 1, Q, span) mask): one mask per window rule
        its layers apply (Architecture.attention_mask); build(FULL) alone for full attention."""
        return build(FULL) if self.architecture is None else self.architecture.attention_mask(build)

    @property
    def kernel(self) -> bool:
        """Whether its forwards attend through the tree kernel (else through dense masks)."""
        return self.attention in KERNEL_BACKENDS

    def kernel_attention(self, dense, prefix_lens: torch.Tensor, region: torch.Tensor, positions: torch.Tensor,
                         region_positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """A kernel-routed forward's attention arguments (attention.slot_step_kwargs): each row's prefix_lens (B,)
        committed slots, the region slots [prefix_len, prefix_len + S) each query sees (region (B, Q, S) bool), the
        queries' positions (B, Q) or (B, 1) and the region slots' (B, S) (a window's term); dense(rule), the rule's
        additive mask, is built only for layers the kernel cannot serve."""
        return slot_step_kwargs(self.attention, self.architecture, prefix_lens, region, positions, region_positions,
                                self.span, dense, dtype, self.fallbacks)

    @property
    def scratch(self) -> int:
        return self.span - 1

    @property
    def buffers(self) -> list[SlotBuffer]:
        """Every per-slot tensor of every layer, in shared buffers: keys and values by shape, then indexer keys."""
        return self.kv_buffers + ([self.indexer_buffer] if self.indexer_buffer is not None else [])

    def make_indexer(self, rows: int, like: torch.Tensor) -> None:
        """The buffer of every layer's indexer keys, (layers, rows, C, D) in `like`'s width, dtype and device (made at
        the first layer's first update_indexer, or by allocate): each layer's indexer_keys a view of it."""
        part = like.new_zeros(rows, 0, like.shape[-1])
        self.indexer_buffer = SlotBuffer([part] * len(self.kv_layers), INDEXER_DIM, self.capacity,
                                         [(layer, "indexer_keys") for layer in self.kv_layers])

    @property
    def kv_layers(self) -> list[SlotLayer]:
        """The layers that keep keys and values (all but a chain's pure state layers)."""
        return [layer for layer in self.layers if isinstance(layer, SlotLayer)]

    def end(self, queries: int) -> int:
        """The keys a forward of `queries` queries sees: the span, or a chain's slots up to its last query."""
        return self.span if self.length is None else self.length + queries

    def chained(self, layer_types: tuple[str, ...] = (), layer_states: tuple[int, ...] = ()) -> "SlotCache":
        """This cache as a chain's (one row, before its first forward): read by its `length`, no mask, and transformers'
        state layers at the layers `layer_states` says keep states (a hybrid one beside its keys and values), their
        states saved after every forward (StateLog)."""
        self.length = 0
        for i, (layer_type, states) in enumerate(zip(layer_types, layer_states)):
            if states and layer_type in STATE_LAYER_TYPES:
                hybrid = STATE_LAYER_TYPES[layer_type]
                self.layers[i] = SlotStateLayer(self, states) if hybrid else LinearAttentionLayer(number_of_states=states)
        states = StateLog(self, rows=1)
        self.states = states if states.active else None
        if self.states is not None:
            self.states.save(0)  # no state yet: a rollback before any prefill (a one-token prompt) starts afresh
        return self

    def advance(self, queries: int) -> None:
        """A chain's forward of `queries` queries ran: its length moves on, its states are saved there."""
        self.length += queries
        if self.states is not None:
            self.states.save(self.length)

    def pack(self) -> None:
        """Stack every layer's keys and values into shared buffers (once, when the first forward has made the last
        layer's): the layers' tensors become views of the buffers, whose addresses stay (a replayed phase bakes them
        in)."""
        if self.kv_buffers or not all(layer.is_initialized for layer in self.kv_layers):
            return
        groups: dict[tuple, list[tuple[SlotLayer, str]]] = {}
        for layer in self.kv_layers:
            for name in ("keys", "values"):
                part = getattr(layer, name)
                shape = part.shape[:KV_DIM] + part.shape[KV_DIM + 1 :]
                groups.setdefault((shape, part.dtype, part.device), []).append((layer, name))
        for members in groups.values():
            parts = [getattr(layer, name) for layer, name in members]
            self.kv_buffers.append(SlotBuffer(parts, KV_DIM, self.capacity, members))

    def allocate(self, like: "SlotCache", rows: int) -> None:
        """Make this cache's buffers for `rows` rows in `like`'s layout (its layers' heads, widths, dtypes), before any
        forward (a running batch's bucket: its phases are captured over these buffers)."""
        for mine, theirs in zip(self.kv_layers, like.kv_layers):
            for name in ("keys", "values"):  # (no slots yet: pack makes each buffer once, zeroed, the layers its views)
                t = getattr(theirs, name)
                setattr(mine, name, t.new_zeros(rows, t.shape[1], 0, t.shape[3]))
            mine.is_initialized = True
        self.pack()
        if like.indexer_buffer is not None:
            self.make_indexer(rows, like.indexer_buffer.data[0])

    def copy_rows(self, source: "SlotCache", rows: torch.Tensor | slice, at: int = 0, slots: int | None = None) -> None:
        """Copy `source`'s cache rows `rows` (their first `slots` slots, default all both hold) into rows at, at + 1,
        ... of this cache, in place (a device copy: the buffers keep their addresses). One copy per buffer."""
        n = min(source.capacity, self.capacity) if slots is None else min(slots, source.capacity, self.capacity)
        for mine, theirs in zip(self.buffers, source.buffers):  # (the slots first: indexing rows by a tensor copies)
            part = theirs.data.narrow(theirs.dim, 0, n)[:, rows]
            mine.data[:, at : at + part.shape[1]].narrow(mine.dim, 0, n).copy_(part)

    def copy_of_row(self, row: int) -> "SlotCache":
        """A 1-row cache of this one's layers, rules and capacity holding a copy of row `row` (made after a forward)."""
        copy = SlotCache(len(self.layers), self.capacity, self.architecture, self.attention)
        copy.allocate(self, 1)
        copy.copy_rows(self, slice(row, row + 1))
        return copy

    def move_rows(self, source: torch.Tensor, destination: torch.Tensor, slots: int | None = None) -> None:
        """Rows source[i] become rows destination[i] (the first `slots` slots, default all), in place; the
        sources are read before any is written (a row may be both)."""
        n = self.capacity if slots is None else slots
        for buffer in self.buffers:
            live = buffer.data.narrow(buffer.dim, 0, n)  # (a view: its rows written through)
            live[:, destination] = live[:, source]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, Q, S) additive mask (0 / dtype min) from allowed (B, Q, S) bool."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def slot_forward(model, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 attention: dict, logits: bool | int = True) -> torch.Tensor | None:
    """One forward: tokens (B, Q) at positions (B, Q), their KV written at slots (B, Q), each query seeing the slots
    `attention` says (the forward's attention arguments: dense masks, or SlotCache.kernel_attention's); returns float32
    logits (B, Q, V) (logits=n, an int: the last n columns' alone, (B, n, V)), or None with logits=False (a forward for
    its KV alone: no row of the vocabulary's head is computed). A chain's cache (`length` set) ignores `attention`: its
    queries sit at slots length .. length + Q - 1, the model masks them causally, and the length moves on (its states
    saved there)."""
    cache.index = slots
    if logits is False:  # an empty index skips the head where the forward takes one (Architecture.headless), else one row
        headless = cache.architecture is not None and cache.architecture.headless
        keep = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=tokens.device) if headless else 1}
    else:
        keep = {} if logits is True else {"logits_to_keep": int(logits)}
    if cache.length is not None:  # a chain's row: the model masks causally by the length its cache reports
        attention = {}
    out = model(input_ids=tokens, position_ids=positions, use_cache=True,
                **{forward_cache_argument(type(model)): cache}, **attention, **keep)
    if cache.length is not None:
        cache.advance(tokens.shape[1])
    if logits is False:
        return None
    # (a model that takes no logits_to_keep returns every row: the last n are the ones asked for)
    return out.logits.float() if logits is True else out.logits[:, -int(logits):].float()



def catch_up(model, cache: SlotCache, tokens: torch.Tensor, counts: torch.Tensor,
             starts: torch.Tensor | None = None, lead: torch.Tensor | None = None,
             last_logits: bool = False) -> torch.Tensor | None:
    """Write each row's tokens' KV behind its committed slots: a prefill (starts 0), or the accepted tokens
    whose KV a round did not make (padded to a fixed width L). tokens (B, L) long, counts (B,) long
    real tokens per row, starts (B,) long each row's committed slots (token j goes at slot and position
    starts + j, seeing the committed slots and the tokens before it). lead (B,) long: padding columns before a row's
    tokens (right-aligned rows, each ending in the last column; default none). Padding queries write the scratch
    slot and see slot 0 alone (their output is never read). last_logits: return the last column's float32 logits
    (B, V) (right-aligned rows: each row's last token's, as generate's prefill keeps one row), else None. No tokens
    (L = 0: a chain's one-token prompt): no forward."""
    B, L = tokens.shape
    if L == 0:
        return None
    starts = torch.zeros(B, dtype=torch.long, device=tokens.device) if starts is None else starts
    k = torch.arange(L, device=tokens.device)[None]  # (1, L), then (B, L): each column's token index in its row
    k = k if lead is None else k - lead[:, None]
    real = k < counts[:, None] if lead is None else (k >= 0) & (k < counts[:, None])  # (B, L)
    at = starts[:, None] + k  # (B, L): each token's slot and position
    slots = torch.where(real, at, cache.scratch)
    c = torch.arange(cache.span, device=tokens.device)
    causal = (c[None, None] <= at[:, :, None]) & real[:, :, None]  # the committed slots, then causal
    padding = ~real[:, :, None] & (c == 0)

    def build(rule: LayerMask) -> torch.Tensor:
        seen = causal if rule.kind == "full" else causal & (c[None, None] >= rule.first_visible(at)[:, :, None])
        return additive_mask(seen | padding, model.dtype)

    positions = torch.where(real, at, 0)  # padding queries at position 0 (never read; no position past a model's rows)
    if cache.length is not None:  # a chain's: no mask (slot_forward)
        attention = {}
    elif not cache.kernel:
        attention = {"attention_mask": cache.attention_mask(build)}
    else:  # the kernel's region: the row's L tokens from `starts` on, each seeing itself and those before it
        j = torch.arange(L, device=tokens.device)
        region = (j[None, None] <= k[:, :, None]) & real[:, :, None]  # (B, L, L)
        attention = cache.kernel_attention(build, starts, region, positions, starts[:, None] + j[None], model.dtype)
    out = slot_forward(model, cache, tokens, positions, slots, attention, logits=1 if last_logits else False)
    return out[:, -1] if last_logits else None


def tree_visible(span: int, prefix_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """What queries see of the first `span` slots (B, Q, span) bool: their row's committed prefix, and the
    tree-region slots their rows (B, Q, N) of ancestor bits name (tree node i at slot prefix_len + i)."""
    B, Q, N = rows.shape
    c = torch.arange(span, device=rows.device)
    allowed = (c[None, None] < prefix_lens[:, None, None]).expand(B, Q, span).clone()
    node_slots = prefix_lens[:, None] + torch.arange(N, device=rows.device)[None]  # (B, N)
    return allowed.scatter_(2, node_slots[:, None, :].expand(B, Q, N), rows)


def tree_attention(cache: SlotCache, prefix_lens: torch.Tensor, ancestors: torch.Tensor, positions: torch.Tensor,
                   depths: torch.Tensor, dtype: torch.dtype) -> dict:
    """A tree forward's attention arguments: queries at positions (B, Q) (or (B, 1): one depth) seeing their row's
    committed prefix and the tree nodes their ancestor bits (B, Q, N) name (node i at slot prefix_len + i, position
    prefix_len + depths (B, N)[i]). Dense: tree_visible's rule as one fused operator (swiftspec_kernels.tree_mask) per
    window rule of the cache's layers, a windowed rule's term each query's first visible position
    (LayerMask.first_visible); kernel-routed: the same bits and positions, as the kernel reads them."""

    def build(rule: LayerMask) -> torch.Tensor:
        if rule.kind == "full":
            return tree_mask(prefix_lens, ancestors, None, cache.span, dtype)
        return tree_mask(prefix_lens, ancestors, None, cache.span, dtype, rule.first_visible(positions), depths)

    if not cache.kernel:
        return {"attention_mask": cache.attention_mask(build)}
    return cache.kernel_attention(build, prefix_lens, ancestors, positions, prefix_lens[:, None] + depths, dtype)


def verify_forward(model, cache: SlotCache, prefix_lens: torch.Tensor, subtree: DeviceSubtree) -> torch.Tensor:
    """The target's verification of each row's T selected nodes (device_round.select_device): node j at
    position prefix_len + depth and slot prefix_len + j, seeing the prefix and its ancestors (those its layer's window
    shows it); returns float32 logits (B, T, V) (row j: the target's distribution after node j). Padding nodes see themselves alone.
    A chain's cache may hold `replay` (1, R): committed tokens its recurrent states run again first, at the R slots
    before the prefix (engine/device_chains.py), their logits not computed."""
    T = subtree.tokens.shape[1]
    positions = prefix_lens[:, None] + subtree.depths
    slots = prefix_lens[:, None] + torch.arange(T, device=prefix_lens.device)[None]
    if cache.length is not None:  # a chain's: no mask (slot_forward), the replay first
        replay, cache.replay = cache.replay, None
        tokens = subtree.tokens
        if replay is not None:
            before = prefix_lens[:, None] - replay.shape[1] + torch.arange(replay.shape[1], device=replay.device)[None]
            tokens, positions, slots = (torch.cat(pair, 1) for pair in ((replay, tokens), (before, positions),
                                                                        (before, slots)))
        return slot_forward(model, cache, tokens, positions, slots, {}, logits=T)
    attention = tree_attention(cache, prefix_lens, subtree.mask, positions, subtree.depths, model.dtype)
    return slot_forward(model, cache, subtree.tokens, positions, slots, attention)


def commit_cache(cache: SlotCache, prefix_lens: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """Move each row's first counts[b] tree-region slots `slots` (B, M) (relative to its prefix) behind its
    prefix, in every layer: one fused operator per shared buffer (swiftspec_kernels.commit_slots: the moves planned
    and applied in one kernel on a GPU; device_round.commit_plan's rule)."""
    for buffer in cache.buffers:
        commit_slots(buffer.data, buffer.dim, prefix_lens, slots, counts, cache.scratch)


def reroot_cache(cache: SlotCache, prefix_lens: torch.Tensor, path: torch.Tensor, count: torch.Tensor,
                 moved: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """The draft's cache after a re-root (device_round.reroot_device): each row's verified path (tree node path[j] at
    region slot path[j], j < count) moves behind its prefix, then the kept subtree, new node i (old node moved[i], for
    i < size) at the region slot i of the new prefix; a new tree's root (moved -1) holds no KV and moves nothing. Every
    layer at once: one fused operator per shared buffer (commit_slots), no host read. Returns the new prefix_lens (B,).

    path (B, M) long, count (B,) long, moved (B, N) long, size (B,) long."""
    B, M = path.shape
    N = moved.shape[1]
    kept = torch.where(moved[:, 0] >= 0, size, 0)  # (B,)
    j = torch.arange(M + N, device=path.device)[None]
    m = count[:, None]
    from_path = path.gather(1, j.clamp(max=M - 1).expand(B, -1))
    from_kept = moved.gather(1, (j - m).clamp(0, N - 1).expand(B, -1))
    slots = torch.where(j < m, from_path, from_kept).clamp(min=0)  # (B, M + N) region slots, in their new order
    for buffer in cache.buffers:
        commit_slots(buffer.data, buffer.dim, prefix_lens, slots, count + kept, cache.scratch)
    return prefix_lens + count


def accepted_nodes(walk: Walk, subtree: DeviceSubtree) -> torch.Tensor:
    """The draft tree's node ids (B, T) of each row's walked nodes, in order (past walk.count: 0, never read);
    commit_cache's slots for a cache that holds tree node i at slot i of its region."""
    return subtree.node_ids.gather(1, walk.path.clamp(min=0))
