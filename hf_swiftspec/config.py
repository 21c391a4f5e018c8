"""SwiftSpecConfig: what a pair repo's config.json holds."""

from __future__ import annotations

import difflib
import inspect

from transformers import PreTrainedConfig

# Defaults, in one place (the engines and the policy import them from here).
MAX_BUDGET = 32  # largest tree the goodput policy verifies when tree_budget is None
MAX_DRAFT_WIDTH = 64  # leaves per expansion and children per leaf: more only adds nodes no budget can verify
FIRST_TREE = 8  # nodes the asynchronous draft grows before its first proposal
ROUNDS = ("auto", "host", "device")  # SwiftSpecConfig.round


class SwiftSpecConfig(PreTrainedConfig):
    """A target/draft pair and how to speculate with it.

    Args:
        target, draft: repo ids or local folders of the two causal LMs.
        target_revision, draft_revision: pinned revisions (commit shas or tags) of those repos.
        tree_budget: nodes the target verifies per step, root included; None (default): the goodput
            policy picks it each round, from 1 (plain decoding) to 32, from calibrated acceptance
            and step times measured on this device. SwiftSpec fixes it at 8 (the smallest tensor-core M).
        draft_width: unexpanded leaves the draft expands per forward (w in the paper).
        draft_depth: draft expansions per round; None: the policy expands while one more
            expansion is expected to raise tokens per second.
        ngram_size: longest suffix of the context matched for suffix proposals: the continuations
            of its recent earlier occurrences (in the prompt, the output, earlier outputs), merged
            into a tree beside the draft's branches; 0 turns them off.
        suffix_cache_tokens: how many tokens of earlier generate() calls' outputs the model keeps
            for later calls to copy from (first in, first out by call); 0 keeps none.
        tree_capacity: node capacity of the draft's token tree and of its KV tree region.
        placement: device placement of the two models; filled by the placement issue.
        swiftspec_default: whether `generate()` speculates when `swiftspec=` is not passed.
        attention: tree-step attention: "auto" (today the model's own attention with a dense mask:
            measured faster than the kernel's launches in eager steps on an H200), "kernel" (the
            Triton tree kernel wherever it runs, else its torch reference) or "model".
        capture: how the round runs its forwards (capture.py): "auto" (default) replays them as CUDA
            graphs on CUDA and runs them eagerly elsewhere; False always eagerly; True replays on CUDA
            and, on a CPU, runs a stand-in with a graph's semantics that checks the replayed path
            (slower than eager: for tests). A lone call captures every bucket its models may replay before its
            first round (about two forwards each: steps/capture.py's step_menu), once per rows and capacity.
        compile: run the models' decoder layers through torch.compile in the round's fixed steps (with
            capture: inside the graphs; on a CPU without capture: each step compiled, no graph). Each step
            shape compiles (seconds to a minute) once per process; a lone call compiles them before its first round.
        worker_timeout_s: longest wait for the other worker of the asynchronous engine before
            generate() raises (a dead or stuck worker never hangs a call).
        serial_fallback: with the draft on a device (and thread) of its own in this process, or in its own
            torchrun processes beside a target group of one rank, time the serial round too (on the same
            workers; under torchrun on the target's rank, which then holds the draft model as well) and run
            whichever decodes faster (choice.py): overlap pays only where the draft is a sizeable share of a
            round. None (default): on for placement="auto", off for a placement you named (the asynchronous
            engine, as asked); True / False: on / off.
            `swiftspec_stats.engine_choice` says which engine a call ran and why.
        round: where a serial round's selection, walk and commit run: "auto" (default: the device round on every
            device where it decodes the call exactly, else the host round; `swiftspec_stats.round_choice` says which
            and why), "host" (the adaptive round: every drafter, architecture and processor) or "device"
            (engine/device_sides.py: the drafter grows levels a round as the goodput policy sizes them, the host
            reads the device once a round where the phases replay and copies one pinned buffer in, the
            suffix proposals (ngram_size > 0) merged into its tree, or alone in draft-free mode; only where that is
            exact: attention by position (full, sliding-window or chunked layers), path-free processors;
            elsewhere generate() raises a ValueError saying why).
        target_loop: with round="auto", let a greedy call on one device run transformers' own loop (exactly
            target.generate's tokens) once one of this pair's calls decoded nearly all its rounds plainly (nothing
            worth verifying) and the loop measured faster than the round (policy/choice.py's LoopChoice; a call that
            speculates again brings the round back). True (default) or False: the round on every call (to measure or
            test the round itself). `swiftspec_stats.engine_choice` says which ran and why.
    """

    model_type = "swiftspec"

    def __init__(
        self,
        target: str | None = None,
        draft: str | None = None,
        target_revision: str | None = None,
        draft_revision: str | None = None,
        tree_budget: int | None = None,
        draft_width: int = 8,
        draft_depth: int | None = None,
        tree_capacity: int = 1024,
        ngram_size: int = 3,
        suffix_cache_tokens: int = 32768,
        placement: str | dict | None = None,
        swiftspec_default: bool = True,
        worker_timeout_s: float = 60.0,
        attention: str = "auto",
        compile: bool = False,
        capture: str | bool = "auto",
        serial_fallback: bool | None = None,
        round: str = "auto",
        target_loop: bool = True,
        **kwargs,
    ):
        self.target = target
        self.draft = draft
        self.target_revision = target_revision
        self.draft_revision = draft_revision
        self.tree_budget = tree_budget
        self.draft_width = draft_width
        self.draft_depth = draft_depth
        self.tree_capacity = tree_capacity
        self.ngram_size = ngram_size
        self.suffix_cache_tokens = suffix_cache_tokens
        self.placement = placement
        self.swiftspec_default = swiftspec_default
        self.worker_timeout_s = worker_timeout_s
        self.attention = attention
        self.compile = compile
        self.capture = capture
        self.serial_fallback = serial_fallback
        self.round = round
        self.target_loop = target_loop
        super().__init__(**kwargs)
        self.validate_tree_settings()

    def validate_tree_settings(self) -> None:
        """Raise ValueError naming the first bad tree setting and what would be valid."""
        for name in ("draft_width", "tree_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SwiftSpecConfig.{name} must be a positive int, got {value!r}.")
        if self.draft_width > MAX_DRAFT_WIDTH:
            raise ValueError(
                f"SwiftSpecConfig.draft_width={self.draft_width}: the draft expands at most {MAX_DRAFT_WIDTH} leaves per "
                f"forward, {MAX_DRAFT_WIDTH} children each; use draft_width <= {MAX_DRAFT_WIDTH} (the paper's is 8)."
            )
        budget = self.tree_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 2):
            raise ValueError(
                f"SwiftSpecConfig.tree_budget={budget!r}: use None (the default: the goodput policy chooses each round, "
                "plain decoding included) or an int >= 2, the root and at least one draft node (8 is the paper's)."
            )
        if isinstance(self.ngram_size, bool) or not isinstance(self.ngram_size, int) or self.ngram_size < 0:
            raise ValueError(f"SwiftSpecConfig.ngram_size must be an int >= 0 (0: no n-gram chain), got {self.ngram_size!r}.")
        cache = self.suffix_cache_tokens
        if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
            raise ValueError(f"SwiftSpecConfig.suffix_cache_tokens must be an int >= 0 (0: keep no outputs), got {cache!r}.")
        if self.draft_depth is not None and (
            isinstance(self.draft_depth, bool) or not isinstance(self.draft_depth, int) or self.draft_depth < 1
        ):
            raise ValueError(
                f"SwiftSpecConfig.draft_depth must be None (chosen from measured step times) or a positive "
                f"int, got {self.draft_depth!r}."
            )
        if isinstance(self.worker_timeout_s, bool) or not isinstance(self.worker_timeout_s, (int, float)) or not (
            self.worker_timeout_s > 0
        ):
            raise ValueError(f"SwiftSpecConfig.worker_timeout_s must be a positive number of seconds, got {self.worker_timeout_s!r}.")
        if self.serial_fallback not in (None, True, False):
            raise ValueError(
                f"SwiftSpecConfig.serial_fallback={self.serial_fallback!r}; use None (on for placement='auto'), True or False."
            )
        if self.round not in ROUNDS:
            raise ValueError(
                f"SwiftSpecConfig.round={self.round!r}; use 'auto' (the default: the device round where it "
                "applies), 'host' (every pair and call) or 'device' (one host read a round, pairs attending by position)."
            )
        if not isinstance(self.target_loop, bool):
            raise ValueError(f"SwiftSpecConfig.target_loop must be True or False, got {self.target_loop!r}.")
        if not isinstance(self.compile, bool):
            raise ValueError(f"SwiftSpecConfig.compile must be True or False, got {self.compile!r}.")
        if self.capture not in ("auto", True, False):
            raise ValueError(f"SwiftSpecConfig.capture={self.capture!r}; use 'auto' (CUDA graphs on CUDA), True or False.")
        if self.attention not in ("auto", "kernel", "model"):
            raise ValueError(f"SwiftSpecConfig.attention={self.attention!r}; use 'auto', 'kernel' or 'model'.")
        # One round adds draft_width * draft_width children; the tree must also hold the subtree it sends.
        growth = 2 * self.draft_width * self.draft_width
        if budget is not None and budget + growth > self.tree_capacity:
            raise ValueError(
                f"SwiftSpecConfig.tree_budget={budget} is more nodes than the draft's tree holds beside a round's growth "
                f"(tree_capacity={self.tree_capacity}, draft_width={self.draft_width}): use tree_budget <= "
                f"{max(self.tree_capacity - growth, 2)} (8 is the paper's), or raise tree_capacity."
            )
        if (budget or MAX_BUDGET) + growth > self.tree_capacity:
            raise ValueError(
                f"SwiftSpecConfig.tree_capacity={self.tree_capacity} is too small for draft_width={self.draft_width}: "
                f"use tree_capacity >= {(budget or MAX_BUDGET) + growth}, or a smaller draft_width."
            )


def setting_names() -> tuple[str, ...]:
    """The SwiftSpecConfig fields a user sets (tree_budget, draft_width, ...)."""
    parameters = inspect.signature(SwiftSpecConfig.__init__).parameters
    return tuple(name for name, p in parameters.items() if name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)


def check_setting_names(names, where: str) -> None:
    """Raise ValueError naming any of `names` that is not a SwiftSpecConfig field, with the closest one."""
    known = setting_names()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where} got an unknown setting {name!r}; {hint}SwiftSpecConfig's settings are: {', '.join(known)}.")
