"""The device round's sides (engine/rounds.py's RoundSides): a drafter (drafters/device_drafters.py: a draft model,
an EAGLE-3 head or an MTP layer, or none) and the target over fixed-shape slot caches (steps/slot_cache.py), every
phase a device op, one host read a round (SwiftSpecConfig round="device").

The sides hold B cache rows (a power of two, engine/device_pool.py): the live rows first, then dead padding rows,
which run every phase with a budget of 0 (they emit and commit nothing, and write their own cache rows only). A lone
generate() call prefills its rows into them at the start (`start`); the server's running batch
(engine/continuous_device.py) copies each joining row in once it is prefilled (`absorb`); rows leave between
rounds (`keep_rows`). Everything a row needs between rounds lives on the device (RowsOnDevice: prefix, root, budget,
EOS ids, sampling seed and position, the drafter's state), so a round copies no host data in but the suffix
proposals (one pinned, non-blocking copy) and reads the device once.

Per round, for all B rows at once:
  1. propose: the goodput policy (policy/goodput.py, through policy/sizing.py) sizes the round: the drafter grows
     levels below every root while one more is expected to pay (none: nothing grown), the suffix proposals join the
     tree (drafters/device_suffix.py) and the best T by path score are selected with their mask
     (device_round.select_device); a draft with another tokenizer or a shorter context grows on the host instead, its
     trie in the suffix proposals' copy, the device side draft-free (drafters/device_host.py);
  2. verify: one target forward over them (slot_cache.verify_forward), the target's choices (argmax, or Gumbel-max
     with noise drawn on the device from each row's seed and positions: verify.gumbel_noise), the walk with each row's
     EOS ids and budget (acceptance.walk_subtree), the target cache's commit, the drafter's commit and catch-up, the
     rows' state moved on (prefix, root, budget, position; EOS ids cleared for rows that finished), then the round's
     ONE read: counts, flags, paths, tokens and the verified subtrees, for streaming, stop strings, the record and
     the stats;
     where a row's logits processors read the path (a repetition penalty), the walk over the read logits instead
     (engine/device_walk.py): the forward, its one read (the logits), every row walked on the host, the walks copied
     back for the same commits;
  3. accept: the suffix index's new tokens (on the host), which a host drafter follows too; a row whose walk a
     host-side criterion (a stop string) cut short and that decodes on has its state corrected (rare: one copy);
  4. observe: the policy learns the round's costs and what each row's tree yielded (a round that captured a graph
     times nothing), as it does every round's.

Each forward attends the live length (`span`: the rows' longest prefix and the tree, rounded up to a power of two)
rather than the slot capacity. With SwiftSpecConfig.capture, the two phases (1; 2 up to the read) are each replayed as
one graph per shape and span (steps/phase_graphs.py). Each model attends, and with compile=True the phases' decoder
layers compile, as engine/device_attention.py says (the tree kernel or dense masks, by the host round's rule; the
prefill stays uncompiled: its shape follows each prompt). Models that place tokens by cache slot or keep recurrent
states run chains (`chain`: engine/device_chains.py), eagerly. Exact where the caches are: attention by position
(full, or a sliding window or chunk as a term of the masks: steps/slot_cache.py) (check_device_round says why a call is
refused).
"""

from __future__ import annotations

import functools
import struct
import time
from collections import Counter
from dataclasses import dataclass, field, fields

import torch

from ..drafters.device_drafters import DeviceDrafter, RoundFacts, device_drafter, model_gaps
from ..drafters.device_host import HostGrowth, HostProposals, on_host
from ..drafters.device_suffix import SuffixProposals
from ..drafters.eagle3 import DraftHead
from ..models.architectures import TREE_MASK_ATTENTION, Architecture, context_limit
from ..policy.goodput import GoodputPolicy
from ..policy.sizing import Offer, RoundSizing
from ..stats import DraftCounters, PhaseClock, SwiftSpecStats, TargetCounters
from ..steps.capture import capacity_bucket, capture_backend, capture_gap, power_of_two
from ..steps.acceptance import StopRule, cut_at_criteria, split_criteria
from ..steps.device_round import DeviceSubtree, to_device
from ..steps.probes import describe
from ..steps.slot_cache import catch_up, span_bucket
from ..steps.tree import Proposal, Subtree
from ..steps.verify import Verified
from .device_attention import SlotAttending
from .device_chains import Chains
from .device_phases import PLAIN, RoundModels, Shape, grow_phase, read_once, subtree_tensors, verify_phase
from .device_pool import SlotPool, Slots, bucket_for, row_values, set_rows
from .device_walk import walk_over_read_logits
from .request import DecodeRequest, DecodeResult, RowResult
from .rounds import Proposed, run_rounds

EOS_WIDTH = 4  # EOS ids a row holds on the device, at least (more: the next power of two)
NO_ROOM = 1 << 30  # a model with no position limit: room for any shape


def run_device(target, draft, request: DecodeRequest, config, captures=None, host: HostProposals | None = None,
               architectures=None) -> DecodeResult:
    """The round (engine/rounds.py) on the device sides, its phases replayed where SwiftSpecConfig.capture says
    (CUDA graphs on CUDA, the emulating stand-in on a CPU with capture=True) and the models allow; check_device_round
    cleared the call. captures: the pair's Captures (steps/capture.py), whose device pool keeps the slots and graphs for
    the next call; None: this call's own. host: the draft's proposals from the host side (drafters/device_host.py),
    where it makes them there: the device side is then draft-free. architectures: the target's and the draft's
    (probes.describe), where the caller has them."""
    if not request.max_new_tokens:
        return DecodeResult(rows=[RowResult() for _ in range(request.batch_size)])
    drafter = device_drafter(None if host is not None else draft, target)
    architectures = models_described(target, drafter) if architectures is None or host is not None else architectures
    eager = next((f"{role}: {gap}" for role, a in zip(("target", "draft"), architectures)
                  if a is not None and (gap := capture_gap(a))), None)  # steps/capture.py's rule: they run eagerly
    backend = None if eager else capture_backend(config.capture, target.device, config.compile)
    # slots of the call's own where a model reads its cache's length (chains) or rules by slot: nothing pooled
    pool = (device_pool(captures, backend, config.compile) if drafter.poolable and not eager
            else SlotPool(backend, config.compile))
    runner = pool.runner
    captured_before, setup_before = (runner.captured, runner.setup_s) if runner is not None else (0, 0.0)
    sides = DeviceSides(target, drafter, config, pool, request.policy, host=host, architectures=architectures)
    with sides.attending.routed():
        result = run_rounds(sides, request)
    pool.drop_unkept_graphs()
    if runner is None or backend == "compiled":
        how = f"eager phases ({eager})" if eager else "eager phases"
    else:
        how = (f"replayed phases, {backend}: {len(runner.graphs)} graphs, {runner.captured - captured_before} "
               f"captured by this call")
    how += ", compiled layers" if config.compile else ""
    if runner is not None and runner.fallbacks:
        how += f"; eager: {', '.join(sorted(runner.fallbacks))}"
    masks = (f"chains for this call ({sides.chain.reason}), the slot caches read by the row's length"
             if sides.chain else "slot caches over the live length")
    attended = sides.attending.describe(sides.slots.caches, drafter.describe() if host is None else host.describe())
    result.stats.attention = f"device round ({masks}: {attended}; {how})"
    result.stats.capture_s = runner.setup_s - setup_before if runner is not None else 0.0
    return result


SUBTREE_FIELDS = tuple(f.name for f in fields(DeviceSubtree))


def models_described(target, drafter: DeviceDrafter) -> tuple:
    """The target's and the draft model's probes.describe (None without a draft model: a head's or none)."""
    model = drafter.model
    return describe(target, "target"), (describe(model, "draft") if model is not None and not isinstance(
        model, DraftHead) else None)


def unpack_scores(bits: list[int]) -> list[float]:
    """float64 values the round's read carries as their int64 bits (verify_phase's `result`)."""
    return list(struct.unpack(f"<{len(bits)}d", struct.pack(f"<{len(bits)}q", *bits)))


def device_pool(captures, backend: str | None, compile_layers: bool = False) -> SlotPool:
    """The pair's device pool (Captures.device), made for `backend` (and compiled layers or not) on first use; a
    call's own without captures."""
    if captures is None:
        return SlotPool(backend, compile_layers)
    if captures.device is None or (captures.device.backend, captures.device.compile) != (backend, compile_layers):
        captures.device = SlotPool(backend, compile_layers)
    return captures.device


def device_round_gaps(config, target, draft, architectures, logits_processor, placement, groups,
                      joins_running_batch: bool, reasons: list[str], vocabularies=None,
                      slots: int | None = None) -> list[str]:
    """Why round="device" cannot decode this call exactly (empty: it can). reasons: the call's batch and slot-limit
    reasons (generation.py's), which the device round would otherwise have to escape by the target's own loop.
    vocabularies: a draft with another tokenizer's (it proposes from the host: drafters/device_host.py). slots: the
    most slots a row's forwards hold (its prompt, new tokens and largest tree: model_gaps); None: not bounded."""
    gaps = list(reasons)
    gaps += model_gaps("target", target, architectures[0], TREE_MASK_ATTENTION, slots)
    if on_host(draft, target, vocabularies) is None:  # (a host drafter is the host round's: any draft it runs)
        drafter = device_drafter(draft, target)
        gaps += drafter.gaps(architectures[1], TREE_MASK_ATTENTION)
        chained = [a for a in architectures if a is not None and a.shape == "chain"]
        if chained and drafter.reads_target:
            gaps.append(f"the target's steps must be chains ({chained[0].chain_reason}), which the device round runs "
                        "with a draft model or the suffix proposals, not a draft head (it reads the target's states of "
                        "a tree); use round='host'")
    threads = placement is not None and placement.mode == "threads" and groups is None and (
        draft is not None and draft.device == target.device)
    if threads or (groups is not None and config.round == "device"):
        pass  # the device round's asynchronous engine (engine/device_async.py, device_distributed.py: its own gaps)
    elif (placement is not None and placement.mode != "serial") or groups is not None or (
        draft is not None and draft.device != target.device
    ):
        gaps.append("it runs both models on one device, serially; load the pair with placement='serial' (or, with "
                    "both threads on one device, round='device')")
    if joins_running_batch:
        gaps.append("this running batch runs the host round; a pair with round='device' makes a device one "
                    "(continuous_engine(): engine/continuous_device.py)")
    return gaps


def tree_region_slots(deepest: int, width: int, suffix_nodes: int) -> int:
    """Slots past the context a row's slot cache holds for a round's tree: the root, the drafter's `deepest` levels of
    `width` nodes, the `suffix_nodes` offered nodes and two spare slots (one the scratch slot)."""
    return 1 + deepest * width + suffix_nodes + 2


def choose_round(config, target, *args, **kwargs) -> tuple[str, str]:
    """The round this call runs, "host" or "device", and why (SwiftSpecStats.round_choice). round="device": the device
    round, or a ValueError naming why it cannot be exact (check_device_round); "host": the host round; "auto": the
    device round wherever it decodes the call exactly, on every device (its phases replay whole on CUDA and are sized
    between levels on a CPU), else the host round, saying why. args: device_round_gaps'."""
    if config.round == "device":
        check_device_round(config, target, *args, **kwargs)
        return "device", "asked for (round='device')"
    if config.round == "host":
        return "host", "asked for (round='host')"
    gaps = device_round_gaps(config, target, *args, **kwargs)
    if gaps:
        return "host", f"round='auto', host round: the device round cannot decode this call exactly ({gaps[0]})"
    return "device", "round='auto': the device round"  # (two threads on one device: its asynchronous engine)


def check_device_round(*args, **kwargs) -> None:
    """round="device" where it cannot be exact: ValueError naming why and the fix (never a silent fallback)."""
    gaps = device_round_gaps(*args, **kwargs)
    if gaps:
        raise ValueError(f"SwiftSpecConfig.round='device' cannot decode this call exactly: {'; '.join(gaps)}. "
                         "Fix that, or use round='host', which decodes it exactly.")


@dataclass
class RowOnHost:
    """What the host keeps of a cache row between rounds (None for a dead row's sampler): its sampler (processors and
    stop rules), its sequence as generate() sees it (stop strings read it), its committed slots (the host's mirror of
    the device's prefix_lens, which sizes each round's span, and its root's position), whether its call keeps scores /
    logits, and its suffix index (None: no suffix proposals, or a dead row)."""

    sampler: object = None
    sequence: list[int] = field(default_factory=list)
    prefix: int = 0
    keeps: tuple[bool, bool] = (False, False)
    suffix: object = None
    drafted: int = 0  # of its committed slots, those the drafter has run (a drafter that defers its catch-up)
    on_host: object = None  # its sampler as the walk over the read logits runs it (device_walk.host_sampler)


@dataclass
class DeviceProposed(Proposed):
    """A device round's hand-off: the shape it ran, its sizing (the policy's choices and each row's suffix proposal),
    the verified subtree (device tensors), the verification phase's outputs, and what the round's one read told the
    host (the cut the host's stop criteria made)."""

    shape: Shape | None = None
    sizing: RoundSizing | None = None  # None: a plain round that built no proposal (quiet, or round 1 from the prefill)
    spans: tuple[int, int] = (0, 0)  # the live lengths the growth and the verification attend
    subtree: DeviceSubtree | None = None
    drafted: torch.Tensor | None = None  # (B, T) float32 each selected node's draft score (-inf: not the draft's)
    after: dict = field(default_factory=dict)  # verify_phase's outputs
    cut: list[int] = field(default_factory=list)  # per live row: tokens the device walked past a host-side stop
    grow_s: float = 0.0  # seconds the growth phase took (its catch-up included)
    catch_up_s: float = 0.0  # of which the drafter's catch-up, where the growth was timed between levels
    caught_up: int = 0  # tokens the catch-up ran (the live rows' largest lag)
    captured: bool = False  # the round captured a graph (its time prices nothing)
    from_prefill: bool = False  # round 1, whose roots' logits the prefill made (it times no verification)


class DeviceSides:
    """The round's phases over a drafter and the target on B cache rows (see the module docstring), for a lone call
    (`start`) and the running batch (`absorb`) alike. policy: the goodput policy that sizes every round (the pair's,
    kept across calls, or the running batch's)."""

    name = "device"
    roots_known = False  # a prefill leaves each prompt's last token as the root: round 1 verifies it

    def __init__(self, target, drafter: DeviceDrafter, config, pool: SlotPool, policy: GoodputPolicy | None = None,
                 changes: Counter | None = None, guard: bool = False, host: HostProposals | None = None,
                 architectures: tuple | None = None):
        self.target, self.drafter, self.config, self.pool = target, drafter, config, pool
        self.architectures = architectures or models_described(target, drafter)  # (target's, draft model's or None)
        # This call's rounds are chains (device_chains.py: width 1, one suffix path, slot = position), or None: trees.
        # Set from the architectures here; `start` sets it too where the call's forwards reach a rule by slot.
        self.chain: Chains | None = Chains.of(self.architectures)
        self.proposer = host  # the draft's proposals from the host (drafters/device_host.py; the drafter: RootOnly)
        self.policy = policy if policy is not None else GoodputPolicy(tree_budget=config.tree_budget,
                                                                      draft_depth=config.draft_depth)
        self.guard = guard  # the latency guard caps the trees (a running batch of requests: policy/guard.py)
        self.runner = pool.runner
        self.device = target.device
        self.vocab_limit = target.config.get_text_config().vocab_size
        self.architecture = self.architectures[0]  # its windows (a term of its cache's masks), whether it is headless
        self.attending = SlotAttending.of(config, target, self.architecture, drafter, pool)  # kernel or dense masks
        self.limit = context_limit(*(m for m in (target, drafter.context_model) if m is not None))
        self.host: list[RowOnHost] = []  # per cache row
        self.size_trees()
        self.counters = TargetCounters(), host.counters if host is not None else DraftCounters()
        self.clock = PhaseClock.on(self.device)
        self.slots: Slots | None = None
        self.models: RoundModels | None = None
        self.live = 0
        self.capacity = 0
        self.eos_width = EOS_WIDTH
        self.first_plain = False  # round 1 is plain: the prefill ran the roots (root_logits)
        self.root_logits: torch.Tensor | None = None  # (B, 1, V) the roots' logits, where the prefill ran the roots
        # a running batch's first rows, each (1, 1, V) its root's logits from its prefill (absorb), while every row so
        # far brought them; the batch's first round is then plain (propose). None: some row did not, or it has run
        self.joined_roots: list[torch.Tensor] | None = None
        self.changes = Counter() if changes is None else changes  # moves to other slots: bucket, capacity

    @property
    def bucket(self) -> int:
        return len(self.host)

    def layers(self) -> tuple[tuple[int, Architecture | None, str], tuple[int, Architecture | None, str]]:
        """Each slot cache's layers, window rules and attention (SlotCache's arguments): the target's, the drafter's
        (0 layers: none)."""
        backends = self.attending.backends
        return ((self.target.config.get_text_config().num_hidden_layers, self.architecture, backends[0]),
                (self.drafter.layers, self.drafter.architecture, backends[1]))

    def compiled(self):
        """The phases' decoder layers compiled where compile=True (SlotAttending.compiled)."""
        return self.attending.compiled((self.target, self.drafter.model))

    @property
    def width(self) -> int:
        """The nodes a growth level adds a row: draft_width, or 1 where the call runs chains."""
        return 1 if self.chain else self.config.draft_width

    def max_levels(self) -> int:
        """The most levels a round grows: draft_depth where set, else the policy's deepest, within every live row's
        room (no node placed past the models' context: a call reaching it decodes its last tokens plainly, as
        target.generate does); 0 without a draft model."""
        if self.drafter.model is None:
            return 0
        deepest = self.policy.draft_depth if self.policy.draft_depth is not None else self.policy.max_depth
        return max(min([deepest] + [self.room(h) for h in self.host[: self.live]]), 0)

    def size_trees(self) -> None:
        """The tree region and the host proposals for the largest round the policy may size: the drafter's deepest
        growth and S offered nodes a row (the policy's largest tree less the root; none with ngram_size 0 and no host
        drafter), then the tree region's slots and scratch."""
        policy = self.policy
        deepest = 0 if self.drafter.model is None else (
            policy.draft_depth if policy.draft_depth is not None else policy.max_depth)
        # a chain call's suffix proposals are one path, and none beside a draft's chain (the two would branch)
        proposes = (self.config.ngram_size and not (self.chain and self.drafter.model is not None)
                    or self.proposer is not None)
        self.suffix_nodes = policy.max_budget - 1 if proposes else 0
        self.tree_slots = tree_region_slots(deepest, self.width, self.suffix_nodes)
        self.suffix = (SuffixProposals(self.config.ngram_size if proposes else 0, self.suffix_nodes, self.limit,
                                       self.device, branching=not self.chain) if self.suffix_nodes else None)

    @property
    def starts_plain(self) -> bool:
        """Whether a batch's first round is plain, its roots' logits made by the prefill (so it runs no forward and
        the first tokens come out with the prefill): where the policy sizes the trees (with tree_budget alone every
        round verifies a tree) and the drafter does not read the target's states at the roots (a head: round 1
        verifies them)."""
        return self.policy.tree_budget is None and not self.drafter.reads_target

    def room(self, row: RowOnHost) -> int:
        """Positions the models place below a row's root now (its root sits at position `prefix`; NO_ROOM: no limit)."""
        return self.limit - 1 - row.prefix if self.limit else NO_ROOM

    # ---- rows in and out (between rounds)
    def start(self, request: DecodeRequest) -> None:
        """A lone call: every prompt but its last token (each row's root) prefilled into the rows of its bucket, every
        row's state set (one copy)."""
        start = time.perf_counter()
        prompts = request.prompt_ids()
        n, L = len(prompts), request.prompt.shape[1]
        reached = None if self.chain else Chains.reaching(self.architecture, L + request.max_new_tokens +
                                                          self.tree_slots)
        if reached:  # the call's forwards reach a rule the target applies by slot: chains, from its start
            self.chain = self.chains_for(reached, n)
            self.size_trees()
        self.capacity = capacity_bucket(L + request.max_new_tokens + self.tree_slots)
        stops = split_criteria(request.stopping_criteria)
        self.eos_width = max(EOS_WIDTH, power_of_two(len(stops.eos)))
        sequences = [c[0].tolist() for c in request.contexts] if request.contexts else request.prompt.tolist()
        keeps = request.keeps_scores, request.keeps_logits
        # its prompt waits for its first growth (prefill(draft=False)), where the phases run eagerly: a replayed phase
        # bakes in the draft cache's buffers, which its first forward makes
        deferred = self.drafter.defers and self.runner is None
        self.host = [RowOnHost(sampler, sequence, len(ids) - 1, keeps,
                               self.suffix.index_for(request, ids) if self.suffix is not None else None,
                               0 if deferred else len(ids) - 1)
                     for sampler, sequence, ids in zip(request.samplers, sequences, prompts)]
        self.live = n
        if self.proposer is not None:
            self.proposer.start(request)
        self.slots = None
        self.move_rows(None, n, bucket_for(n))
        # Round 1 is plain where the policy sizes trees (as every round's: its tree would be worth the next round's
        # minus that round's root token, so deferring it never loses a token): the target's prefill runs the roots
        # too and keeps their logits (as generate's prefill does), so round 1 runs no forward. A drafter that reads
        # the target's states at the roots needs round 1 to verify them.
        roots = self.first_plain = self.starts_plain
        width = max(len(p) for p in prompts)
        pad = [[0] * (width - len(ids)) for ids in prompts]
        # each prompt left-aligned (its root a padding column), then, where the prefill runs the roots, right-aligned
        values = [[*ids, *gap, *((*gap, *ids) if roots else ()),
                   *row_values(row.sampler, ids[-1], row.prefix, request.max_new_tokens, len(row.sequence), stops.eos,
                               self.eos_width)] for row, ids, gap in zip(self.host, prompts, pad)]
        packed = to_device(values, self.device)  # the prompts and the rows' state, one copy
        taken = width * (2 if roots else 1)
        set_rows(self.slots.rows, packed[:, taken:], 0)
        tokens = torch.cat([packed[:, :taken], packed.new_zeros(self.bucket - n, taken)])  # dead rows: nothing
        # (a chain's one row runs no padding column, the root's: a recurrent state would run it too)
        counts = self.slots.rows.prefix_lens
        prompt = (tokens[:, : width - bool(self.chain)], counts, torch.zeros_like(counts))
        if roots:  # the target runs each whole prompt right-aligned, the drafter the prompt but its root
            self.root_logits = self.prefill(self.slots, tokens[:, width:], counts + 1, end=width,
                                            lead=width - 1 - counts, drafter_piece=prompt, draft=not deferred)
        else:
            self.prefill(self.slots, *prompt, end=width, draft=not deferred)
        self.models = self.round_models()
        self.counters[0].busy_s += time.perf_counter() - start

    def prefill(self, slots: Slots, tokens: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor | None = None,
                end: int | None = None, lead: torch.Tensor | None = None, draft: bool = True,
                target: bool = True, drafter_piece: tuple | None = None, drafter: bool = True) -> torch.Tensor | None:
        """Both models over tokens (B, L) long (counts (B,) per row, token j of a row at slot starts + j: a prompt but
        its root, or a piece of it), each forward attending the live length (`end`: the furthest slot written).
        lead (B,) long: the target's tokens are right-aligned (each row's `counts` after `lead` padding columns), and
        the target's logits at the last column (B, 1, V) float32 are returned: a row whose piece ends in its root, its
        first token's (as generate's prefill keeps them); else None. draft=False: a drafter that defers its
        catch-up only records the tokens (its first growth runs them: the policy grows where the call can repay
        that, GoodputPolicy.repays_catch_up). target=False: the drafter alone (slots whose target KV was copied from
        a stored prefix: engine/prefix_store.py). drafter_piece: (tokens, counts, starts) the drafter runs instead of
        the target's, in the same call (rows whose target KV was partly copied: the drafter's window starts earlier;
        the target's running the roots too). drafter=False: the target alone (a piece holding only roots)."""
        B, L = tokens.shape
        starts = torch.zeros_like(counts) if starts is None else starts
        need = (L if end is None else end) + 1
        for cache in slots.caches:
            if cache is not None:
                cache.span = min(span_bucket(need) if self.runner is not None else need, cache.capacity)
        logits = None
        with self.drafter.tapped():
            if target:
                logits = catch_up(self.target, slots.caches[0], tokens, counts, starts, lead=lead,
                                  last_logits=lead is not None)
            runs = drafter and (draft or not self.drafter.defers)
            piece = drafter_piece if drafter_piece is not None else (tokens, counts, starts)
            if runs:
                self.drafter.prefill(slots.caches[1], *piece, slots.rows.drafter)
            elif drafter:
                self.drafter.record(*piece, slots.rows.drafter)
        self.counters[0].forwards += int(target)
        self.counters[1].forwards += int(self.drafter.model is not None and runs)
        return logits[:, None] if logits is not None else None

    def absorb(self, joining: Slots, row: RowOnHost, capacity: int, eos_width: int, host_rows=None,
               index: int = 0, root_logits: torch.Tensor | None = None) -> None:
        """A prefilled request's row (row `index` of its prefill's slots, its state set; host_rows: its host drafter,
        where the sides have one) joins as cache row `live`; the rows move first to a larger bucket, or to slots of a
        wider capacity or EOS width, where it needs one. root_logits (1, 1, V): its root's logits, where its prefill
        ran the root (its KV then sits at the prefix's end, and is copied too): a batch whose first rows all bring
        them starts with a plain round (`joined_roots`)."""
        n = self.live
        if n == 0:
            self.joined_roots = []
        if self.joined_roots is not None:
            self.joined_roots = self.joined_roots + [root_logits] if root_logits is not None else None
        if self.slots is None or n + 1 > self.bucket or capacity > self.capacity or eos_width > self.eos_width:
            self.changes["capacity"] += 0 < self.capacity < capacity
            self.capacity = max(self.capacity, capacity)
            self.eos_width = max(self.eos_width, eos_width)
            self.move_rows(None, n, bucket_for(n + 1), like=joining)
            self.pool.drop_smaller(self.capacity)
        for mine, theirs in zip(self.slots.caches, joining.caches):
            if mine is not None:
                mine.copy_rows(theirs, slice(index, index + 1), at=n, slots=row.prefix + (root_logits is not None))
        self.slots.rows.copy_rows(joining.rows, slice(index, index + 1), 1, at=n)
        if host_rows is not None:
            self.proposer.absorb(host_rows)
        self.host[n] = row
        self.live = n + 1
        self.models = self.round_models()

    def keep_rows(self, order: list[int]) -> None:
        """Keep cache rows `order` (keep_order's) as rows 0 .. len(order) - 1; the rest are dead from now on (and the
        bucket may shrink)."""
        self.host = [self.host[b] for b in order] + self.host[len(order):]
        if self.proposer is not None:
            self.proposer.keep_rows(order)
        self.move_rows(order, len(order), bucket_for(max(len(order), 1)))
        self.live = len(order)
        self.models = self.round_models()

    def move_rows(self, order: list[int] | None, count: int, bucket: int, like: Slots | None = None) -> None:
        """Rows order[i] (count of them; None: the first count, in place) become rows 0 .. count - 1 of the slots for
        `bucket` rows at the sides' capacity and EOS width (the same slots, moved in place, where they are the ones);
        every row past them is dead. like: slots whose layout new caches take. The caches copy only what the rows
        hold (`held_slots`), and in place only the rows that move (keep_order moves a row into each hole)."""
        old = self.slots
        new = self.slots_for(bucket, like=old if old is not None and old.caches[0].buffers else like)
        if old is None:
            new.rows.kill(slice(0, None))
        else:
            held = self.held_slots(range(count))  # (the host's rows 0 .. count - 1 are already the ones kept)
            holes = [i for i, b in enumerate(order or []) if i != b] if new is old else []  # rows moved into
            m = len(holes)
            rows = slice(0, count)
            if order is not None:  # one copy: the order, then the moves' sources and destinations
                index = to_device(order + [order[i] for i in holes] + holes, self.device)
                rows = index[:count]
            for mine, theirs in zip(new.caches, old.caches):
                if mine is None:
                    continue
                if new is not old:
                    mine.copy_rows(theirs, rows, slots=held)
                elif holes:  # in place: the rows moved into holes, no others
                    mine.move_rows(index[count : count + m], index[count + m :], slots=held)
            new.rows.copy_rows(old.rows, rows, count)
            new.rows.kill(slice(count, None))
            self.changes["bucket"] += bucket != self.bucket and self.bucket > 0
        self.slots = new
        self.host = (self.host[:count] + [RowOnHost() for _ in range(bucket)])[:bucket]

    def held_slots(self, rows) -> int:
        """The slots cache rows `rows` hold anything in (their committed slots and the tree region past them, where a
        drafter keeps its surviving subtree), at most the capacity: what moving them copies."""
        return min(max((self.host[b].prefix for b in rows), default=0) + self.tree_slots, self.capacity)

    def slots_for(self, bucket: int, like: Slots | None = None) -> Slots:
        slots = self.pool.slots(bucket, self.capacity, self.layers(), self.eos_width,
                                self.drafter.state_fields(self.capacity), self.device, like)
        if self.chain:
            self.chain.adopt(slots)
        return slots

    def chains_for(self, reason: str, rows: int) -> Chains:
        """The strategy for a call that `reason` says must run chains, or a ValueError where it cannot."""
        if rows > 1 or self.drafter.reads_target:
            what = f"a batch of {rows} rows" if rows > 1 else "a draft head, which reads the target's states of a tree,"
            raise ValueError(f"round='device' runs {what} where chains are needed ({reason}), and chains are one "
                             "draft model's or the suffix proposals' path for one row; use round='host'")
        return Chains.of(self.architectures, reason)

    def round_models(self) -> RoundModels:
        live = [h.sampler for h in self.host if h.sampler is not None]
        processors = tuple(h.sampler.logits_processor if h.sampler is not None else () for h in self.host)
        keeps = tuple(any(h.keeps[i] for h in self.host) for i in (0, 1))
        return RoundModels(self.target, self.drafter, processors, any(s.do_sample for s in live), keeps, self.vocab_limit)

    # ---- the round's phases
    def run(self, phase, static: dict, inputs: dict, models: RoundModels | None = None) -> dict:
        """A phase over live `inputs`, replayed where the sides have a runner (its outputs are then static tensors).
        models: what it runs on (default: the round's)."""
        models = self.models if models is None else models
        bound = functools.partial(phase, models=models, slots=self.slots, **static)
        with self.compiled():
            if self.runner is None:
                return bound(**inputs)
            key = (self.bucket, phase.__name__, tuple(sorted(static.items())), models.key(), self.slots.addresses())
            return self.runner.run(key, bound, inputs)

    def lag(self) -> int:
        """The committed tokens a drafter that defers its catch-up runs before its first level (0: none): the live
        rows' largest lag (its prompt, after a lone call's prefill; tokens of plain rounds and suffix nodes)."""
        if not self.drafter.defers:
            return 0
        return max((h.prefix - h.drafted for h in self.host[: self.live]), default=0)

    def spans(self, levels: int, budget: int | None) -> tuple[int, int]:
        """The live lengths the growth and the verification attend: every live row's prefix and the nodes written
        (growth: the drafter's deepest tree; verification: the T nodes, or the largest where T is decided later),
        and the scratch slot; rounded up to a power of two where the phases replay (a graph per span), exact where
        they run eagerly."""
        longest = max((h.prefix for h in self.host[: self.live]), default=0)
        if self.runner is not None:
            span = min(span_bucket(longest + self.tree_slots), self.capacity)
            return span, span
        grown = 1 + levels * self.width
        verified = budget if budget is not None else min(grown + self.suffix_nodes, self.policy.max_budget)
        return min(longest + grown + 1, self.capacity), min(longest + verified + 1, self.capacity)

    def offers(self, rows) -> list[Offer | None]:
        """Each live row's suffix proposal this round (None where the policy skips it this round: wants_suffix, or
        where there are no suffix proposals), its nodes priced by the policy's calibration."""
        if self.suffix is None:
            return [None] * self.live
        wanted = self.policy.wants_suffix(list(rows.live))
        return [Offer.of(self.suffix.propose(h.suffix), self.policy) if want and h.suffix is not None else None
                for h, want in zip(self.host[: self.live], wanted)]

    def host_growth(self, offers: list[Offer | None]) -> HostGrowth:
        """A host drafter's growth this round (drafters/device_host.py): each live row's offer, its proposal with the
        row's suffix proposal merged in, no node placed past the models' context."""
        room = [max(self.room(h), 0) for h in self.host[: self.live]]
        with self.clock.phase("expand"):
            return self.proposer.grow(self.policy, offers, room, self.suffix_nodes, self.policy.plan.probing)

    def propose(self, rows) -> DeviceProposed:
        """1. the policy sizes the round (policy/sizing.py); the drafter grows below every root, the suffix proposals
        join the tree and the best T nodes are selected, on the device."""
        policy = self.policy
        roots, self.joined_roots = self.joined_roots, None
        if roots and len(roots) == self.live:  # a running batch's first rows, their roots' logits from the prefill
            self.root_logits = torch.cat([*roots, roots[0].new_zeros(self.bucket - self.live, *roots[0].shape[1:])])
            self.first_plain = True
        plan = policy.plan_round(self.live, list(rows.live), guard=self.guard)
        proposed = DeviceProposed([], rows=list(rows.live))
        if self.first_plain or plan.quiet:  # round 1 (its roots' logits came with the prefill), or a quiet batch
            proposed.from_prefill, self.first_plain = self.first_plain, False
            return self.grow(proposed, PLAIN, {})
        started = time.perf_counter()
        offers = self.offers(rows)
        hosted = self.host_growth(offers) if self.proposer is not None else None
        sizing = RoundSizing(policy, hosted.offers if hosted is not None else offers, self.width, self.lag(),
                             between_levels=self.runner is None, started=started)
        levels = self.max_levels()
        if levels and sizing.between_levels:
            levels = levels if sizing.wants_growth() else 0
        elif levels:
            levels = sizing.levels_ahead(levels)
        if levels and policy.fixed:  # both settings given: every tree has tree_budget nodes (the host round's rule)
            budget = policy.tree_budget
        else:  # the policy's T (at most tree_budget where given), after the levels where it reads them
            budget = None if levels and sizing.reads_levels() else sizing.budget()
        proposed.sizing = sizing
        proposed.caught_up = sizing.lag if levels else 0
        inputs, offers = {}, sizing.offers + [None] * (self.bucket - self.live)
        if any(o is not None and len(o.tree) for o in offers) and (levels or budget > 1):  # the round's one copy in
            inputs = {"suffix": self.suffix.pack(offers)} if levels else {"chosen": self.suffix.pack_chosen(offers, budget)}
        proposed = self.grow(proposed, Shape(levels, self.width if levels else 0, budget), inputs)
        if hosted is not None:  # the draft's time this round: its growth on the host, before the device's phase
            proposed.expansions += hosted.expansions
            proposed.grow_s += hosted.catch_up_s + hosted.expanding_s
            proposed.catch_up_s += hosted.catch_up_s
            proposed.caught_up += hosted.caught_up
        return proposed

    def grow(self, proposed: DeviceProposed, shape: Shape, inputs: dict) -> DeviceProposed:
        """The growth phase of `shape` (a budget of None: sized between levels), then the shape it ran."""
        sizing = proposed.sizing
        if self.chain:  # the draft's chained cache at what it has run: its catch-up, then its growth, from there
            self.chain.before_grow(self.slots, self.host[0].drafted)
        lag = proposed.caught_up  # the catch-up's width: a power of two where the growth replays (a graph per width)
        lag = power_of_two(lag) if lag and self.runner is not None else lag
        if lag:  # the catch-up runs first: by the growth's end every live row's drafter has run its committed tokens
            for h in self.host[: self.live]:
                h.drafted = h.prefix
        proposed.spans = self.spans(shape.depth, shape.budget)
        captured = self.runner.captured if self.runner is not None else 0
        start = time.perf_counter()
        reading = sizing if sizing is not None and shape.depth and sizing.reads_levels() and sizing.between_levels \
            else None
        with self.clock.phase("expand"):
            out = self.run(grow_phase, dict(shape=shape, span=proposed.spans[0], lag=lag, sizing=reading), inputs)
        proposed.grow_s = time.perf_counter() - start
        proposed.drafted = out["drafted"]
        proposed.subtree = DeviceSubtree(**{name: out[name] for name in SUBTREE_FIELDS})
        proposed.captured = self.runner is not None and self.runner.captured > captured
        levels = reading.levels if reading is not None else shape.depth
        if self.chain:  # its live nodes alone: the draft's chain, or the root and its suffix path
            offer = sizing.offers[0] if sizing is not None else None
            live = 1 + levels if levels else 1 + (len(offer.tree) if offer is not None else 0)
            proposed.subtree = Chains.first(proposed.subtree, min(live, proposed.subtree.tokens.shape[1]))
            proposed.drafted = proposed.drafted[:, : proposed.subtree.tokens.shape[1]]
        if reading is not None and reading.caught_up_at is not None:
            proposed.catch_up_s = reading.caught_up_at - start
        proposed.shape = Shape(levels, shape.width if levels else 0, proposed.subtree.tokens.shape[1])
        proposed.expansions = levels
        draft = self.counters[1]
        draft.forwards += levels + (lag > 0)
        draft.expansions += levels
        draft.rounds += 1
        draft.busy_s += time.perf_counter() - proposed.started
        return proposed

    def verify(self, proposed: DeviceProposed, rows) -> list[Verified]:
        """2. the target verifies every row's subtree, walks it and commits the path in both caches, reading the device
        once: the walk on the device (walk_on_device), or, where a row's processors read the path, the host's walk
        over the read logits (device_walk.walk_over_read_logits)."""
        start = time.perf_counter()
        captured = self.runner.captured if self.runner is not None else 0
        sub, shape, S = proposed.subtree, proposed.shape, self.suffix_nodes
        T = sub.tokens.shape[1]
        lag = self.drafter.catch_up_width(T, shape.depth, S)
        facts = RoundFacts(shape.depth, shape.nodes, lag, max(shape.depth, S))
        known, self.root_logits = self.root_logits, None  # round 1's roots, where the prefill ran them: no forward
        inputs = dict(subtree_tensors(sub), drafted=proposed.drafted)
        on_host = self.models.walks_on_host
        walk = functools.partial(walk_over_read_logits, self) if on_host else self.walk_on_device
        if self.chain:
            self.chain.before_verify(self.target, self.slots, self.host[0].prefix, self.counters[0])
        subtrees, verified = walk(proposed, rows, facts, known, inputs)
        proposed.captured = proposed.captured or (self.runner is not None and self.runner.captured > captured)
        with self.clock.phase("walk"):
            criteria = rows.criteria()
            for b, outcome in enumerate(verified):
                ints = subtrees[b]  # the subtree's node ids, tokens and parents, then its draft scores' bits
                subtree = Subtree(ints[:T], ints[T : 2 * T], ints[2 * T : 3 * T])
                proposed.proposals.append(self.proposal(proposed, b, subtree, unpack_scores(ints[3 * T :])))
                cut = 0 if on_host else self.stop_on_host(outcome, b, criteria[b])  # (the host's walk applied them)
                proposed.cut.append(cut)
                row = self.host[b]
                if shape.depth:  # the walked nodes the drafter ran: its own tree's, above the last depth
                    ran = sum(1 for j in outcome.path if subtree.node_ids[j] < shape.nodes)
                    row.drafted = row.prefix + min(ran, shape.depth)
                row.sequence += outcome.tokens
                row.prefix += len(outcome.tokens)
                row.drafted = min(row.drafted, row.prefix)
            if self.chain:  # recurrent states back on the accepted path
                self.chain.after_read(self.slots, sub.tokens, self.host[0].prefix, self.host[0].drafted,
                                      known is None, shape.depth > 0, self.counters[0])
        self.counters[0].forwards += known is None
        self.counters[0].verify_steps += len(verified)
        self.counters[1].forwards += int(lag > 0)  # the catch-up
        self.counters[0].busy_s += time.perf_counter() - start
        return verified

    def walk_on_device(self, proposed: DeviceProposed, rows, facts: RoundFacts, known, inputs: dict):
        """verify_phase (the walk on the device) and the round's one read. Returns, per live row, its subtree's read
        (node ids, tokens, parents, draft scores' bits) and its walk."""
        with self.clock.phase("verify"), self.drafter.tapped():
            if known is None:
                proposed.after = after = self.run(verify_phase, dict(facts=facts, span=proposed.spans[1]), inputs)
            else:  # once a call: eagerly (a graph of its own would be one more capture per span)
                with self.compiled():
                    proposed.after = after = verify_phase(models=self.models, slots=self.slots, facts=facts,
                                                          span=proposed.spans[1], known=known, **inputs)
        with self.clock.phase("walk"):
            read = read_once(after["result"])
            kept = [after[name].clone() if name in after else None for name in ("scores", "logits")]  # replays overwrite
            T = proposed.subtree.tokens.shape[1]
            subtrees, verified = [], []
            for b in range(self.live):
                count, finished, *rest = read[b]
                outcome = Verified(rest[:count], rest[T : T + count], finished=bool(finished))
                outcome.scores = [kept[0][b, j : j + 1] for j in range(count)] if kept[0] is not None else []
                outcome.logits = [kept[1][b, j : j + 1] for j in range(count)] if kept[1] is not None else []
                subtrees.append(rest[2 * T :])
                verified.append(outcome)
        return subtrees, verified

    def proposal(self, proposed: DeviceProposed, b: int, subtree: Subtree, drafted: list[float]) -> Proposal:
        """Row b's verified subtree as the policy judges it (RoundSizing.proposal), or its root alone."""
        if proposed.sizing is None:
            return Proposal(subtree, [1.0], [0.0], [-1])
        return proposed.sizing.proposal(b, subtree.node_ids, subtree.tokens, subtree.parents, drafted,
                                        proposed.shape.nodes)

    def accept(self, proposed: DeviceProposed, verified: list[Verified], keep: list[int]) -> None:
        """3. the suffix indices take the new tokens, a host drafter follows them; rows that a host-side stop cut and
        that decode on are corrected (those that leave need nothing)."""
        for row, outcome in zip(self.host, verified):
            if row.suffix is not None:
                row.suffix.extend(outcome.tokens)
        staying = set(keep)
        if self.proposer is not None:
            with self.clock.phase("commit"):
                self.proposer.accept([v if b in staying else None for b, v in enumerate(verified)])
        cuts = [c if b in staying else 0 for b, c in enumerate(proposed.cut)]
        if any(cuts):
            roots = [v.tokens[-1] if v.tokens else 0 for v in verified]
            self.apply_cuts(proposed.after, cuts, roots)

    def apply_cuts(self, after: dict, cuts: list[int], roots: list[int]) -> None:
        """Rows whose walk a host-side stop cut by cuts[b] tokens, and that decode on: their prefix, root, budget and
        position moved back to the cut (their KV past it is never seen), their EOS ids cleared (they finished), the
        drafter's state at the cut (one copy, only in a round with such a row)."""
        pad = self.bucket - len(cuts)
        packed = to_device([cuts + [0] * pad, roots + [0] * pad], self.device)
        cut, root = packed[0], packed[1]
        rows = self.slots.rows
        stopped = cut > 0
        kept = after["result"][:, 0] - cut
        rows.prefix_lens.sub_(cut)
        rows.budgets.add_(cut)
        rows.positions.sub_(cut)
        rows.roots.copy_(torch.where(stopped, root, rows.roots))
        rows.eos.masked_fill_(stopped[:, None], -1)
        self.drafter.cut(rows, after, kept, cut)

    def observe(self, proposed: DeviceProposed, verified: list[Verified], round_s: float, first: bool) -> None:
        """4. the policy: the round's costs (a round whose roots came with the prefill, or that captured a graph, times
        nothing: its time is the prefill's or the capture's) and what each row's tree yielded."""
        if not verified:
            return
        untimed = proposed.captured or proposed.from_prefill
        draft_s = proposed.grow_s - proposed.catch_up_s
        with self.clock.phase("policy"):
            self.policy.observe_round(
                proposed.expansions, draft_s, proposed.shape.budget,
                None if untimed else round_s - proposed.grow_s, tokens=sum(len(v.tokens) for v in verified),
                catch_up_s=proposed.catch_up_s, catch_up_tokens=proposed.caught_up if proposed.catch_up_s else 0)
            self.policy.observe_outcomes(list(zip(proposed.rows, proposed.proposals, verified)))

    def stats(self, new_tokens: int, wall_s: float) -> SwiftSpecStats:
        return SwiftSpecStats.collect(self.name, new_tokens, wall_s, *self.counters, clock=self.clock)

    def stop_on_host(self, outcome: Verified, b: int, rule: StopRule) -> int:
        """Apply the criteria the device cannot (stop strings, max_time, custom ones) to each prefix of the row's
        walk (acceptance.cut_at_criteria, every round's rule); cut the outcome there. Returns the tokens cut."""
        cut = cut_at_criteria(outcome.tokens, self.host[b].sequence, rule, outcome.scores or None)
        if cut is None:
            return 0
        keep = len(outcome.tokens) - cut
        del outcome.tokens[keep:], outcome.path[keep:], outcome.scores[keep:], outcome.logits[keep:]
        outcome.finished = True
        return cut
