"""The plan of a `swiftspec distill` run: what a trial measured before any phase, how much of --minutes the
measurements (the held-out evaluations and the in-run bench) and self-distillation may take together (a bounded
share, `DistillConfig.measure_share`), sized to it from the trial, each phase's estimate, and the training's
deadline: what the run has left after the phases that follow training, as the starting measurement measured them.

Every estimate is a count (prompts, tokens, windows, answers) times a time this run measured; the constants below
are ratios between such times, not figures of a machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from .distill_corpus import DistillError

SPEED_PROMPTS = 8  # held-out prompts the in-run bench times at most
SPEED_METHODS = 4  # the bench's methods: target.generate, prompt lookup, the pair, its target draft-free
BENCH_OVERHEAD = 1.25  # the bench's warm-up call and bookkeeping beside its timed calls
OWN_PAIR = 1.0  # the pair under its own settings: the goodput policy drafts only where that beats target.generate
BATCH_ANSWERS = 8  # prompts the target answers in one generate() call (distill_data.self_distilled)
BATCHED_ROWS = 1.5  # a step of BATCH_ANSWERS rows costs about this many steps of one row
MARGIN_SHARE = 0.02  # of --minutes, kept after the last phase (writing the pair and the last checkpoint)
WARN_BELOW = 0.5  # the plan warns when training gets less than this share of --minutes
PROMPT_FLOOR, TOKEN_FLOOR, WINDOW_FLOOR = 2, 16, 4  # the fewest held-out prompts, new tokens and windows measured
DRAFT_FORWARD = 1 / 3  # of the draft's forward and backward: its forward alone


@dataclass
class Trial:
    """One training step's teacher forward and the draft's forward and backward (no update), one target.generate
    and one generate of the fixed-tree pair with the starting draft (the same prompt and new tokens), and the
    tokenizer on the first records: timed before any phase starts."""

    teacher_s: float
    learn_s: float
    window_tokens: int  # tokens of the step's windows (this rank's share)
    generate_s: float
    pair_s: float
    tokens: int  # new tokens of each generation
    tokenise_s: float  # all the records', from the first of them

    @property
    def step_s(self) -> float:
        return self.teacher_s + self.learn_s

    @property
    def token_s(self) -> float:
        """target.generate's seconds a new token."""
        return self.generate_s / self.tokens

    @property
    def pair_token_s(self) -> float:
        """The fixed-tree pair's seconds a new token with the starting draft (one that agrees with little yet)."""
        return self.pair_s / self.tokens

    def window_token_s(self, taught: bool = False) -> float:
        """Seconds a held-out window's token costs: the draft's forward, and the target's unless `taught` (kept)."""
        draft = self.learn_s * DRAFT_FORWARD / self.window_tokens
        return draft if taught else draft + self.teacher_s / self.window_tokens


@dataclass(frozen=True)
class Sizing:
    """What the measurements and self-distillation do: what was asked, or less where the share of --minutes does
    not allow it."""

    prompts: int
    new_tokens: int
    windows: int
    speed_prompts: int
    answers: int  # records the target answers (self-distillation)
    asked_answers: int

    def reduced_from(self, asked) -> bool:
        """Whether the measurement is smaller than `asked` (EvalSettings)."""
        return (self.prompts, self.new_tokens, self.windows) != (asked.prompts, asked.new_tokens, asked.windows)


def measurement_seconds(trial: Trial, prompts: int, new_tokens: int, windows: int, window: int, speed_prompts: int,
                        compared: int, timed: bool) -> dict[str, float]:
    """The measurements' seconds: before training, target.generate's references and the fixed-tree pair on every
    prompt and the held-out windows (teacher and draft); after, the pair again (fixed and under its own settings),
    the windows (the teacher's kept), each --compare-draft; the bench, when timed."""
    generated = prompts * new_tokens
    found = {
        "evaluate-start": generated * (trial.token_s + trial.pair_token_s) + windows * window * trial.window_token_s(),
        "evaluate-end": (1 + compared) * (generated * trial.pair_token_s + windows * window * trial.window_token_s(True))
                        + generated * trial.token_s * OWN_PAIR,
    }
    if timed:
        found["speed"] = SPEED_METHODS * (speed_prompts + 1) * new_tokens * trial.token_s * BENCH_OVERHEAD
    return found


def answer_seconds(trial: Trial, answers: int, answer_tokens: int) -> float:
    """The target answering `answers` prompts of `answer_tokens` new tokens, BATCH_ANSWERS a call."""
    return -(-answers // BATCH_ANSWERS) * answer_tokens * trial.token_s * BATCHED_ROWS


def ladder(prompts: int, new_tokens: int) -> list[tuple[int, int]]:
    """(prompts, new tokens) from what was asked down to the floors: fewer tokens first (to 32), then fewer prompts
    (to 8, then 4), then fewer tokens (to the floor), then prompts to theirs."""
    steps = [(prompts, new_tokens), (prompts, min(new_tokens, 32)), (min(prompts, 8), min(new_tokens, 32)),
             (min(prompts, 4), min(new_tokens, 32)), (min(prompts, 4), min(new_tokens, TOKEN_FLOOR)),
             (min(prompts, PROMPT_FLOOR), min(new_tokens, TOKEN_FLOOR))]
    return list(dict.fromkeys(steps))


def size_run(config, trial: Trial, answers: int, answer_tokens: int, timed: bool) -> Sizing:
    """Under --minutes: the largest measurement of the ladder whose estimate fits its part of the share (all of it,
    or half when there are prompts to answer), and as many answers as the rest of the share allows; the floors
    when nothing fits (the plan then warns). With fixed --steps: everything as asked."""
    e, window = config.eval, config.train.window
    if config.train.minutes is None:
        return Sizing(e.prompts, e.new_tokens, e.windows, min(SPEED_PROMPTS, e.prompts), answers, answers)
    share = config.measure_share * config.train.minutes * 60
    allowed = share / 2 if answers else share
    compared = len(config.compare_drafts)
    for prompts, new_tokens in ladder(e.prompts, e.new_tokens):
        windows = min(e.windows, max(WINDOW_FLOOR, e.windows * prompts // max(e.prompts, 1)))
        speed_prompts = min(SPEED_PROMPTS, prompts)
        spent = sum(measurement_seconds(trial, prompts, new_tokens, windows, window, speed_prompts, compared,
                                        timed).values())
        if spent <= allowed:
            break
    per_batch = answer_seconds(trial, BATCH_ANSWERS, answer_tokens)
    fitting = int(max(share - spent, 0.0) / per_batch) * BATCH_ANSWERS if per_batch > 0 else answers
    return Sizing(prompts, new_tokens, windows, speed_prompts, min(answers, fitting), answers)


def estimates(config, trial: Trial, sizing: Sizing, answer_tokens: int, timed: bool, spent: float) -> dict[str, float]:
    """Seconds each phase is expected to take, in the run's order. Training: --steps' at the trial's step (and the
    optimizer's update); under --minutes, what is left after the `spent` seconds, the other phases and the margin."""
    measured = measurement_seconds(trial, sizing.prompts, sizing.new_tokens, sizing.windows, config.train.window,
                                   sizing.speed_prompts, len(config.compare_drafts), timed)
    found = {"tokenise": trial.tokenise_s}
    if sizing.answers:
        found["self-distill"] = answer_seconds(trial, sizing.answers, answer_tokens)
    found["evaluate-start"] = measured["evaluate-start"]
    found["train"] = 0.0
    found["evaluate-end"] = measured["evaluate-end"]
    if timed:
        found["speed"] = measured["speed"]
    if config.train.minutes is None:
        found["train"] = config.train.fixed_steps * trial.step_s * 1.05
    else:
        total = config.train.minutes * 60
        found["train"] = total - spent - sum(found.values()) - MARGIN_SHARE * total
    return found


def after_training(timings: dict[str, float], trial: Trial, sizing: Sizing, compared: int, timed: bool) -> dict[str, float]:
    """The phases after training, from what the starting measurement took (`timings`: Evaluation.timings): the
    fixed-tree pair again (a trained draft takes fewer rounds), the pair under its own settings about as long as
    the references, the windows with the teacher kept, each --compare-draft; the bench at its references' pace."""
    taught = trial.window_token_s(True) / trial.window_token_s()
    found = {"evaluate-end": (1 + compared) * (timings["fixed_pair"] + timings["windows"] * taught)
                             + timings["references"] * OWN_PAIR}
    if timed:
        found["speed"] = (SPEED_METHODS * (sizing.speed_prompts + 1) / max(sizing.prompts, 1) * timings["references"]
                          * BENCH_OVERHEAD)
    return found


def speed_prompts_left(left_s: float, timings: dict[str, float], sizing: Sizing) -> int:
    """The bench's prompts that fit the `left_s` seconds the run has left (0: none fit), at most the planned ones."""
    per_prompt = SPEED_METHODS * timings["references"] / max(sizing.prompts, 1) * BENCH_OVERHEAD
    return max(min(int(left_s / max(per_prompt, 1e-9)) - 1, sizing.speed_prompts), 0)


def training_budget(config, after: dict[str, float], elapsed: float) -> float | None:
    """Under --minutes: the training's seconds, what the run has left after the `elapsed` seconds, the phases that
    follow training and the margin."""
    if config.train.minutes is None:
        return None
    total = config.train.minutes * 60
    return total - elapsed - sum(after.values()) - MARGIN_SHARE * total


def check_budget(config, expected: dict[str, float]) -> None:
    """Refuse --minutes that leave (next to) nothing to train."""
    if config.train.minutes is None:
        return
    others = sum(s for name, s in expected.items() if name != "train")
    if others >= config.train.minutes * 60 * 0.9:
        raise DistillError(
            f"--minutes {config.train.minutes:g}: the run's other phases (tokenising, measuring the draft before and after, "
            f"timing the pair) are expected to take about {others / 60:.1f} minutes here even at their smallest, leaving no "
            "time to train; give more minutes, or --no-speed."
        )


def budget_warning(config, expected: dict[str, float], spent: float) -> str | None:
    """A line for the plan when training gets less than WARN_BELOW of --minutes."""
    if config.train.minutes is None:
        return None
    total = config.train.minutes * 60
    if expected["train"] >= WARN_BELOW * total:
        return None
    return (f"warning: training gets {expected['train'] / 60:.1f} of the {config.train.minutes:g} minutes "
            f"({expected['train'] / total:.0%}): loading and the trial took {spent / 60:.1f}, the measurements at their "
            f"smallest the rest. Give more --minutes, --no-speed, or fewer --eval-prompts / --eval-new-tokens.")
