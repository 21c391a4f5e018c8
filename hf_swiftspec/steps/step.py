"""One forward of a model over its TreeCache, for B rows at once: each row's queries padded to a rectangle.

Every forward a worker runs after the prefill is a step: the target's verification of a subtree,
the draft's expansion of its leaves, the draft's catch-up over tokens it has not run. Each row
brings a `RowQueries` (its tokens, their positions, and what each sees of the row's region);
`run_step` plans where the cache writes them, builds the attention arguments once for every
layer, runs the model and hands each row its logits. A row with no queries (a row that is not
expanding this time) rides along as padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..models.architectures import Architecture
from .attention import StepLayout, fixed_step_inputs, tree_step_kwargs
from .cache import TreeCache
from .capture import MAX_QUERIES, StepRunner, query_bucket
from ..models.compat import forward_cache_argument

NO_LOGITS = -1  # model_step's keep for a forward run for its KV alone (Architecture.headless)


@dataclass
class RowQueries:
    """One row's queries in a step (n of them).

    tokens:    (n,) long
    positions: (n,) long, each token's position in its sequence
    region:    (n, S) bool, which of the row's S region slots each query sees: the tree slots the
               row's cache already holds after its prefix, then this step's n new ones (the last n)
    region_positions: (S,) long positions of those slots; needed only when a layer has a window
    inputs:    (n, H) hidden inputs beside the tokens, for drafters that read them (an EAGLE-3 head)
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    region: torch.Tensor
    region_positions: torch.Tensor | None = None
    inputs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def none(cls, device) -> "RowQueries":
        """A row that sits this step out."""
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(empty, empty, torch.zeros(0, 0, dtype=torch.bool, device=device), empty)

    @classmethod
    def chain(cls, tokens: list[int], first_position: int, device) -> "RowQueries":
        """Tokens appended after the row's prefix as one causal chain (the row's region must be empty)."""
        n = len(tokens)
        positions = torch.arange(first_position, first_position + n, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        return cls(torch.tensor(tokens, dtype=torch.long, device=device), positions, causal, positions)


def run_step(
    model: PreTrainedModel,
    cache: TreeCache,
    rows: list[RowQueries],
    attention: str,
    architecture: Architecture,
    fallbacks: set[str] | None = None,
    logits: bool = True,
    runner: StepRunner | None = None,
    tap=None,
) -> list[torch.Tensor]:
    """One forward over every row's queries; returns each row's float32 logits (n_b, V), or nothing
    with `logits=False` (a catch-up: the head then runs on one query per row, not on every token of a
    prompt: 16 prompts of 256 tokens with a 49k-row head would be 0.8 GB of logits thrown away).

    fallbacks: collects why kernel-routed layers ran the model's own attention instead.
    runner: the model's replayed forwards (capture.py): the step is padded to its bucket and replayed,
        unless it is larger than any bucket (then it runs eagerly, as without).
    tap: the target's hidden-state tap for a draft head, which a replayed step hands its states (StepRunner.run).
    """
    keep = step_keep(logits, architecture)
    bucket = replay_bucket(runner, cache, rows)
    if bucket is not None:
        return replayed_step(model, cache, rows, attention, architecture, fallbacks, keep, runner, bucket, tap)
    counts, input_ids, positions, layout, kwargs = step_arguments(model, cache, rows, attention, architecture)
    out = model_step(model, cache, input_ids, positions, keep=keep, **kwargs)  # (B, Q, V)
    if fallbacks is not None:
        if "swiftspec_tree" in kwargs:
            fallbacks |= kwargs["swiftspec_tree"].fallbacks
        elif attention in ("triton", "torch-reference") and not layout.single:
            fallbacks.add("batches of several rows")
    return [out[b, : counts[b]] for b in range(len(rows))] if logits else []


def step_keep(logits: bool, architecture: Architecture) -> int:
    """run_step's `keep` (model_step's): every query's logits, or (a catch-up) none, or the last query's where a
    headless model cannot skip its head."""
    return 0 if logits else NO_LOGITS if architecture.headless else 1


def prepare_steps(model, cache: TreeCache, runner: StepRunner, attention: str, architecture: Architecture,
                  menu: tuple[tuple[int, int], ...], tap=None, head: bool = False) -> int:
    """Capture (or compile) every step of `menu` ((keep, queries a row) pairs: capture.step_menu) over `cache`, so that
    no step of the rounds that follow captures one: each a replayed step of padding queries alone, which write the
    cache's scratch slot and leave its rows as they were. Once per cache layout (the runner's buffers and rows);
    returns the steps run (0: none, or a cache that has not run a forward: pack_buffers). A tap's states from these
    steps are dropped; a draft head's (`head`) steps take zero hidden inputs."""
    layout = (runner.layout_key(cache, tap), menu)
    if not cache.buffers or layout in runner.prepared:
        return 0
    rows = padding_rows(model, cache.batch_size, head)
    for keep, queries in menu:
        replayed_step(model, cache, rows, attention, architecture, None, keep, runner, queries, tap, head=head)
        if tap is not None:
            tap.take()  # the states a padding step handed the tap: no forward of the call's
    runner.prepared.add(layout)
    return len(menu)


def pack_buffers(model, cache: TreeCache, architecture: Architecture, head: bool = False) -> None:
    """Give a cache that has not run a forward its buffers (cache.py packs them after the first forward) with a
    forward of padding queries alone, so its steps can be prepared before the rounds (prepare_steps). The forward's
    one query writes slot 0 and takes no position: the rows stay empty, and their first forward writes it over."""
    rows = padding_rows(model, cache.batch_size, head)
    if head:
        run_head_step(model, cache, rows, architecture, logits=False)
    else:
        run_step(model, cache, rows, "sdpa", architecture, logits=False)


def padding_rows(model, batch_size: int, head: bool) -> list[RowQueries]:
    """Rows that sit a step out (a draft head's with its (0, H) hidden inputs)."""
    rows = [RowQueries.none(model.device) for _ in range(batch_size)]
    if head:
        for row in rows:
            row.inputs = torch.zeros(0, model.hidden_size, dtype=model.dtype, device=model.device)
    return rows


def replay_bucket(runner: StepRunner | None, cache: TreeCache, rows: list[RowQueries]) -> int | None:
    """The queries a row of this step is padded to for a replay, or None: no runner (or a cache without
    buffers), or more queries than any bucket holds (the step then runs eagerly, and `runner` says so)."""
    if runner is None or not cache.buffers:
        return None
    bucket = query_bucket(max(max(len(r) for r in rows), 1))
    if bucket is None:
        runner.fallbacks.add(f"steps of more than {MAX_QUERIES} queries a row ran eagerly")
    return bucket


def replayed_step(model, cache: TreeCache, rows: list[RowQueries], attention: str, architecture: Architecture,
                  fallbacks: set[str] | None, keep: int, runner: StepRunner, bucket: int, tap=None,
                  head: bool = False) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
    """run_step as a fixed step of `bucket` queries a row, handed to `runner` to replay: every layer sees the
    whole cache (the kernel through per-row device lengths, sdpa through a dense mask). head: a draft head's
    step (run_head_step): its hidden inputs go in as well, and it returns (logits (B, Q, V), per row hidden)."""
    counts, input_ids, positions, layout = step_layout(model, cache, rows, bucket)
    tensors, build = fixed_step_inputs(attention, architecture, layout, model.dtype,
                                       fallbacks if fallbacks is not None else set())
    tensors |= {"input_ids": input_ids, "position_ids": positions}
    if head:
        tensors["hidden_inputs"] = head_inputs(model, rows, counts, bucket)

    def forward_kwargs(t: dict) -> dict:
        extra = {"hidden_inputs": t["hidden_inputs"]} if head else {}
        return {"input_ids": t["input_ids"], "position_ids": t["position_ids"], **extra, **build(t)}

    out, hidden = runner.run(model, cache, tensors, forward_kwargs, head_rows(keep, input_ids.device), tap, hidden=head)
    cache.advance(bucket)
    if head:
        return out, [hidden[b, : counts[b]] for b in range(len(rows))]
    return [out[b, : counts[b]] for b in range(len(rows))] if keep == 0 else []


def run_head_step(model, cache: TreeCache, rows: list[RowQueries], architecture: Architecture,
                  logits: bool = True, runner: StepRunner | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """run_step for a draft head that reads hidden inputs beside the tokens (`RowQueries.inputs`) and
    gives its hidden outputs back: per row (float32 logits (n_b, V) or nothing, hidden (n_b, H)).
    runner: the head's replayed forwards (as run_step's), or None."""
    counts = [len(r) for r in rows]
    bucket = replay_bucket(runner, cache, rows)
    if bucket is not None:  # every query's logits: a padded step's last query is not a row's last
        out_logits, hidden = replayed_step(model, cache, rows, "sdpa", architecture, None, 0, runner, bucket, head=True)
    else:
        counts, input_ids, positions, _, kwargs = step_arguments(model, cache, rows, "sdpa", architecture)
        out = model(input_ids=input_ids, position_ids=positions, past_key_values=cache, logits_to_keep=0 if logits else 1,
                    hidden_inputs=head_inputs(model, rows, counts, input_ids.shape[1]), **kwargs)
        cache.advance(input_ids.shape[1])
        out_logits, hidden = out.logits, [out.hidden[b, : counts[b]] for b in range(len(rows))]
    return ([out_logits[b, : counts[b]].float() for b in range(len(rows))] if logits else []), hidden


def head_inputs(model, rows: list[RowQueries], counts: list[int], Q: int) -> torch.Tensor:
    """The rows' hidden inputs as one (B, Q, H) tensor, zeros past each row's own."""
    H = next(r.inputs for r in rows if r.inputs is not None).shape[-1]
    inputs = torch.zeros(len(rows), Q, H, dtype=model.dtype, device=model.device)
    for b, row in enumerate(rows):
        if counts[b]:
            inputs[b, : counts[b]] = row.inputs
    return inputs


def step_arguments(model, cache: TreeCache, rows: list[RowQueries], attention: str, architecture: Architecture):
    """Plan the cache's writes for one step and build its inputs: (counts, input_ids (B, Q), positions (B, Q),
    the StepLayout, attention kwargs)."""
    counts, input_ids, positions, layout = step_layout(model, cache, rows)
    return counts, input_ids, positions, layout, tree_step_kwargs(attention, architecture, layout, model.dtype)


def step_layout(model, cache: TreeCache, rows: list[RowQueries], bucket: int | None = None):
    """Plan the cache's writes for one step: (counts, input_ids (B, Q), positions (B, Q), the StepLayout).
    bucket: Q for a fixed step (capture.py), planned over the whole cache."""
    device = model.device
    counts = [len(r) for r in rows]
    Q = bucket or max(max(counts), 1)
    if len(rows) == 1 and counts[0] == Q:
        input_ids, positions = rows[0].tokens[None], rows[0].positions[None]
    else:
        input_ids = torch.zeros(len(rows), Q, dtype=torch.long, device=device)
        positions = torch.zeros(len(rows), Q, dtype=torch.long, device=device)
        for b, row in enumerate(rows):
            input_ids[b, : counts[b]] = row.tokens
            positions[b, : counts[b]] = row.positions
    cache.plan_step(counts, Q, device, fixed=bucket is not None)
    layout = StepLayout(
        starts=cache.starts,
        prefix_lens=cache.prefix_lens,
        regions=[r.region for r in rows],
        q_positions=positions,
        region_positions=[r.region_positions for r in rows],
        width=cache.step_end(Q),
    )
    return counts, input_ids, positions, layout


def head_rows(keep: int, device) -> int | torch.Tensor:
    """The forward's logits_to_keep for model_step's `keep`: an empty index for NO_LOGITS."""
    return torch.zeros(0, dtype=torch.long, device=device) if keep == NO_LOGITS else keep


def model_step(model: PreTrainedModel, cache: TreeCache, input_ids, position_ids, attention_mask=None, keep: int = 0,
               **kwargs) -> torch.Tensor:
    """One forward writing into `cache` (as planned, or at every row's next slots); returns float32
    logits (B, Q, V) (only the last `keep` queries of each row if keep > 0; none with keep=NO_LOGITS,
    for a model whose Architecture is `headless`: its head reads the whole (V, H) matrix for one row too,
    55 ms of a 2-layer draft's 130 ms catch-up of 256 tokens on the gemma-3-270m shape)."""
    headless = keep == NO_LOGITS
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        **{forward_cache_argument(type(model)): cache},
        logits_to_keep=head_rows(keep, input_ids.device),
        **kwargs,
    )
    cache.advance(input_ids.shape[1])
    if headless:
        return out.logits[:, :0].float()
    # Some models (trocr) take no logits_to_keep and return every row: keep the last `keep` here.
    return out.logits[:, -keep:].float() if keep else out.logits.float()
