"""Recurrent and convolution states that end every round on the accepted path.

A layer of transformers' cache type "linear_attention", "conv", "hybrid" or "hybrid_sliding"
(Gated DeltaNet, Mamba-2, short convolutions...) keeps, instead of or beside keys and values per
position, a state that every token advances in place. A speculative forward over k tokens leaves it
k tokens on, whatever the target accepts, and transformers gives out the final state only: there is
no per-token state to pick the accepted one from, and a tree would advance it along every branch at
once. So these models speculate along chains (architectures.py), and one mechanism, here, keeps
their states exact:

    StateLog.save(position)     clone every state tensor (a few MB) when the model has run exactly
                                `position` tokens
    StateLog.rewind(position)   after a round that ran past the accepted tokens: copy back the latest
                                clone at or before `position` and say how many accepted tokens
                                lie after it; the worker runs those again before its next tokens

The draft runs one token per expansion, so it saves after every forward and rewinds exactly, with
nothing to replay. The target verifies a chain in one forward, so it saves before it: after a
partial acceptance the accepted tokens ride along as the first tokens of its next verification
(logits discarded), where they cost a few more rows of a forward it runs anyway rather than a
forward of their own. Measured on a 2-core CPU with a 243M Qwen3.5-shaped model (transformers'
reference Gated DeltaNet kernels): a forward of 1 / 2 / 8 / 16 / 32 tokens took 68 / 186 / 255 /
296 / 401 ms, so carrying R more rows costs ~6.5 ms x R where a forward of its own costs >= 186 ms;
on a GPU rows are nearly free below a few dozen. Tokens replayed in a round that is again only
partly accepted are replayed once more (the snapshot precedes them), so they pile up; past
`MAX_REPLAY`, around the break-even above, they run as a forward of their own.

The tree cache (cache.py) keeps the keys and values of attention layers; `add_state_layers` puts
transformers' own `LinearAttentionLayer` at the stateful layers (with a tree-cache layer beside the
state for hybrid layers), so modeling code finds the state API it calls (`get_recurrent_state`,
`update_conv_state`, ...). One sequence only: a snapshot holds the whole batch's states, and rows
accept different numbers of tokens, so a batch (B > 1) of such a model decodes with transformers'
own loop instead (engine/launch.batch_exactness_gaps).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from ..models.architectures import Architecture, first_line
from .cache import TreeCache, TreeCacheLayer
from ..models.compat import DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer, forward_cache_argument

# Cache layer types whose layers keep a state, and whether they also keep keys and values.
STATE_LAYER_TYPES = {"linear_attention": False, "conv": False, "hybrid": True, "hybrid_sliding": True}
# Accepted tokens carried into the next verification before they run as a forward of their own
# (the module docstring's measurement: ~30 carried rows cost what one more forward does on a CPU).
MAX_REPLAY = 32


class TreeStateLayer(LinearAttentionLayer, TreeCacheLayer):
    """A hybrid layer: a recurrent / convolution state and the tree cache's keys and values."""

    def __init__(self, owner: TreeCache, layer_idx: int, is_sliding: bool, number_of_states: int = 1):
        TreeCacheLayer.__init__(self, owner, layer_idx, is_sliding)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # keys and values, from update()
            TreeCacheLayer.lazy_initialization(self, *args)
        else:  # a state, from update_conv_state / update_recurrent_state
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def get_max_length(self) -> int:
        return TreeCacheLayer.get_max_length(self)

    def get_seq_length(self) -> int:  # the tree cache's (5.25's LinearAttentionLayer counts its state's tokens instead)
        return TreeCacheLayer.get_seq_length(self)


def add_state_layers(cache: TreeCache, layer_types: tuple[str, ...], layer_states: tuple[int, ...]) -> TreeCache:
    """`cache` with a state layer at every layer whose type keeps a state (`layer_states[i]` > 0 states)."""
    for i, (layer_type, states) in enumerate(zip(layer_types, layer_states)):
        if states and STATE_LAYER_TYPES.get(layer_type) is not None:
            old = cache.layers[i]
            if STATE_LAYER_TYPES[layer_type]:
                cache.layers[i] = TreeStateLayer(cache, i, old.is_sliding, number_of_states=states)
            else:
                cache.layers[i] = LinearAttentionLayer(number_of_states=states)
    return cache


def new_cache(architecture: Architecture, capacity: int, batch_size: int = 1, pool=None) -> TreeCache:
    """The tree cache a model's steps write into: `capacity` positions per row, plus the scratch slot
    padding queries write into, and transformers' state layers at the layers that keep a recurrent state.
    pool: a cache.BufferPool to pack into (buffers that keep their addresses for replayed steps)."""
    cache = TreeCache(len(architecture.layer_types), capacity + 1, architecture.sliding, batch_size, pool)
    return add_state_layers(cache, architecture.layer_types, architecture.layer_states)


@dataclass
class Snapshot:
    """Every state of a cache when the model had run `position` tokens, per (state layer, state index).

    flags:   has_previous_state of each
    tensors: conv and recurrent state of each, in that order (None where the layer has none)
    """

    position: int
    flags: list[bool]
    tensors: list[torch.Tensor | None]


class StateLog:
    """Snapshots of one cache's states by position, and the rollback to one of them.

    Holds no state when the model has none (`active` False): every call is then a no-op. Dropped
    snapshots' tensors are copied into by later saves (allocating a fresh clone of a 13 MB state
    took 19 ms on a CPU, copying into an old one 0.7 ms).
    """

    SPARES = 8  # dropped snapshots kept to copy into

    def __init__(self, cache: TreeCache | None, rows: int | None = None):
        """rows: the cache's rows where it cannot say before its first forward (a slot cache's); default its own."""
        layers = cache.layers if cache is not None else []  # None: a draft-free worker, no model to run
        self.layers = [layer for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        rows = rows if rows is not None or cache is None else cache.batch_size
        if self.layers and rows > 1:
            raise RuntimeError(
                f"recurrent states roll back per sequence, but this cache holds {rows} rows: a batch of a "
                "recurrent model decodes with transformers' own loop (launch.batch_exactness_gaps)"
            )
        self.snapshots: list[Snapshot] = []  # increasing positions
        self.spares: list[list[torch.Tensor | None]] = []

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def states(self):
        """(layer, state index) of every state, in snapshot order."""
        return [(layer, i) for layer in self.layers for i in range(layer.number_of_states)]

    def save(self, position: int) -> None:
        """Remember the states as they are, the model having run `position` tokens."""
        if not self.active:
            return
        while self.snapshots and self.snapshots[-1].position >= position:
            self.drop([self.snapshots.pop()])
        flags, live = [], []
        for layer, i in self.states():
            flags.append(layer.has_previous_state[i])
            live.append(layer.conv_states[i] if layer.is_conv_states_initialized[i] else None)
            live.append(layer.recurrent_states[i] if layer.is_recurrent_states_initialized[i] else None)
        spare = self.spares.pop() if self.spares else [None] * len(live)
        self.snapshots.append(Snapshot(position, flags, [copy_into(b, t) for b, t in zip(spare, live)]))

    def rewind(self, position: int, ran: int) -> int:
        """Put the states back where they were after `position` tokens, the model having run `ran`.

        Returns how many tokens before `position` must be run again (0 when a snapshot was taken at
        `position` itself, or nothing ran past it). Snapshots from before the one restored are dropped.
        """
        if not self.active or ran <= position:
            self.forget_before(position)
            return 0
        usable = [s for s in self.snapshots if s.position <= position]
        if not usable:
            raise RuntimeError(
                f"no recurrent-state snapshot at or before position {position} (have "
                f"{[s.position for s in self.snapshots]}): a worker ran tokens past the accepted path without saving first"
            )
        snapshot = usable[-1]
        for (layer, i), has_previous, conv, recurrent in zip(
            self.states(), snapshot.flags, snapshot.tensors[0::2], snapshot.tensors[1::2]
        ):
            # In place: modeling code and fused kernels may hold the tensors (static addresses).
            if conv is not None:
                if layer.conv_states[i].shape == conv.shape:
                    layer.conv_states[i].copy_(conv)
                else:  # a layer recording its past grows the tensor; give it the saved one back
                    layer.conv_states[i] = conv.clone()
            if recurrent is not None:
                layer.recurrent_states[i].copy_(recurrent)
            layer.has_previous_state[i] = has_previous
        self.drop([s for s in self.snapshots if s is not snapshot])
        self.snapshots = [snapshot]
        return position - snapshot.position

    def forget_before(self, position: int) -> None:
        """Drop the snapshots no rollback can need: all but the latest at or before `position`."""
        keep = [i for i, s in enumerate(self.snapshots) if s.position <= position]
        if len(keep) > 1:
            self.drop(self.snapshots[: keep[-1]])
            del self.snapshots[: keep[-1]]

    def drop(self, snapshots: list[Snapshot]) -> None:
        for snapshot in snapshots:
            if len(self.spares) < self.SPARES:
                self.spares.append(snapshot.tensors)


def copy_into(buffer: torch.Tensor | None, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor`'s values in `buffer` when it has its shape, dtype and device, else in a clone."""
    if tensor is None:
        return None
    if buffer is not None and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype and buffer.device == tensor.device:
        return buffer.copy_(tensor)
    return tensor.clone()


# ---------------------------------------------------------------- can a model continue its state?

_continues: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> None or the reason it cannot


def state_continuation_gap(model, vocab_size: int | None = None) -> str | None:
    """Why `model`'s states cannot be rolled back by this module, or None.

    Verifying k draft tokens in one forward needs (1) the states in the cache, where a snapshot
    finds them (not on the modules), and (2) the model's multi-token path to start from the state
    its cache holds. Some do not (Mamba-1's selective scan takes no initial state: a step of several
    tokens restarts from zero). Checked once per model object, on its own weights and transformers'
    own cache: after the same 2-token prefill, a 2-token step must leave every state where two
    1-token steps do, as closely as a 4-token prefill does (float noise between the chunked and the
    recurrent kernels), unless that gap is tiny next to what the prefill changes in the state.
    Nine forwards of at most 4 tokens.
    """
    if model in _continues:
        return _continues[model]
    vocab = vocab_size or model.config.get_text_config(decoder=True).vocab_size
    ids = ((torch.arange(4) * 7 + 3) % vocab)[None].to(model.device)  # any 4 distinct tokens
    takes_positions = "position_ids" in inspect.signature(type(model).forward).parameters

    def run(*chunks) -> list[torch.Tensor | None]:
        """Every state layer's first recurrent state (else its conv state) after running `chunks`."""
        cache, start = DynamicCache(config=model.config), 0
        for chunk in chunks:
            n = chunk.shape[1]
            positions = {"position_ids": torch.arange(start, start + n, device=model.device)[None]} if takes_positions else {}
            model(input_ids=chunk, use_cache=True, **{forward_cache_argument(type(model)): cache}, **positions)
            start += n
        states = []
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                recurrent = [layer.recurrent_states[i] for i in range(layer.number_of_states)
                             if layer.is_recurrent_states_initialized[i]]  # fmt: skip
                conv = [layer.conv_states[i][..., -1:] for i in range(layer.number_of_states)
                        if layer.is_conv_states_initialized[i]]  # fmt: skip
                states.append(torch.cat([t.float().flatten() for t in recurrent or conv]) if recurrent or conv else None)
        return states

    try:
        with torch.no_grad():
            stepped = run(ids[:, :2], ids[:, 2:3], ids[:, 3:])
            at_once = run(ids[:, :2], ids[:, 2:])
            prefill = run(ids)
            fresh = run(ids[:, 2:])
    except Exception as error:  # noqa: BLE001 - named in the refusal
        gap = (
            "its forward fails on transformers' own cache (a 2-token prefill, then steps of 1 and 2 tokens) "
            f"({type(error).__name__}: {first_line(error)})"
        )
    else:
        gap = None
        if any(s is None for s in stepped):
            gap = (
                "some of its state layers leave their cache layer empty after a forward (the state is kept elsewhere, "
                "e.g. on the modules), where no snapshot can reach it"
            )
        for layer, (s, a, p, f) in enumerate(zip(stepped, at_once, prefill, fresh)):
            if gap is not None:
                break
            off, noise, prefix = (a - s).norm().item(), (p - s).norm().item(), (f - s).norm().item()
            if off > 10 * noise + 1e-5 * s.norm().item() and off > 1e-3 * prefix:
                gap = (
                    "a forward of several tokens does not continue its recurrent state, so a chain of draft tokens "
                    f"cannot be verified in one forward (state layer {layer}: a 2-token step after a 2-token prefill "
                    f"lands {off:.2g} from two 1-token steps, a 4-token prefill {noise:.2g}: its multi-token path "
                    "starts from zero)"
                )
    _continues[model] = gap
    return gap
