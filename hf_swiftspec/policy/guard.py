"""The latency guard of a running batch: no row's tree makes it decode slower than the batch decoding plainly.

The goodput policy sizes a batch's trees for the batch's tokens per second (B x the harmonic mean of the
rows' expected tokens over the verification's time). That can leave a row the draft predicts badly
slower than it would be in a plain batch: its tree yields it E_r(T) tokens per verification of
cost c(T), where a plain step yields 1 for c(1). A server's tail latency is those rows': on the demo
pair at 2-4 clients they took 36-55 verifications for 64 tokens.

A row breaks even at tree size T when E_r(T) / c(T) >= 1 / c(1), that is when E_r(T) >= c(T) / c(1).
The guard caps the batch's tree size at the largest T, up to the goodput policy's, at which every row
breaks even (T = 1, a plain step, always does), so no row's expected time per token is worse than the
batch decoding plainly. A row's latency is its whole answer's, not one round's: the tokens it got beyond
what plain steps would have given it in the same time (its credit: the sum over its rounds of tokens
got - c(T) / c(1), never below 0) pay for a round at a hard position, so it breaks even when
credit + E_r(T) >= c(T) / c(1). Without it, some row of a busy batch is at a position its draft is unsure
of in almost every round, and the batch would hardly ever verify a tree. Only the tree size can do it: the verification is one rectangle of rows x T
queries (steps/step.py), so a row verifying its root alone beside others' trees costs the same c(T)
and yields 1 token, worse for it than its own tree; what a row the draft predicts badly pays for is
the others' tree size.

The draft's expansions are part of a row's wait too: a round of draft time D and a T-node verification gives a
row its tokens in D + c(T), where a plain step (no draft) takes c(1). By the time the size is chosen they have
run (a sunk cost that every size shares), so the cap compares sizes on c(T) alone; the guard prices them where
they are decided, in keep_expanding: k more expansions run only if, at the size the cap would then allow, every
row still expects credit + E_r(T) >= (D + c(T)) / c(1) (`expansions_break_even`), and a row's credit is charged the
round's draft time with its verification (`credit_after`).

The plain step c(1) the guard compares with is the batch decoding plainly: a quiet round (no proposal built; the
goodput policy's QUIET_AFTER), once one has run at this batch size (`LatencyGuarding.guard_times`). A round that
builds the rows' proposals and then verifies the roots alone costs more (served on the demo pair at 4 rows, 12.6 ms
against 11.5 ms: examples/results/cpu-serve-trace-4); priced by it, every tree looked that much cheaper next to plain
decoding, and a row whose trees kept missing decoded slower than the plain batch would have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Guarded:
    """The guard's decision for one round.

    budget: the tree size the batch verifies (at most the goodput policy's)
    rows:   the rows (positions in the batch) that would not break even at the goodput policy's size:
            those the cap is for (empty: the guard left the size alone)
    """

    budget: int
    rows: tuple[int, ...] = ()


def break_even(times: list[float]) -> list[float]:
    """Per tree size T = 1..len(times), the expected tokens a row needs from a T-node tree to decode no slower
    than a plain step: c(T) / c(1), from `times`, the batch's verification seconds (index T - 1)."""
    return [t / times[0] for t in times]


def latency_cap(per_row: list[list[float]], times: list[float], budget: int, credit: list[float] | None = None) -> Guarded:
    """The largest tree size T <= budget at which every row breaks even (see the module docstring).

    per_row: each row's expected tokens E_r(T) for T = 1..its candidates (a row verifies at most its own
        nodes: beyond them its E stays at its last value)
    times:   the batch's verification seconds for T = 1..at least `budget`
    budget:  the goodput policy's tree size
    credit:  per row, the tokens it is ahead of plain steps so far (default: none)
    """
    need = break_even(times[:budget])
    credit = credit or [0.0] * len(per_row)

    def short_at(T: int) -> tuple[int, ...]:
        return tuple(b for b, (row, ahead) in enumerate(zip(per_row, credit))
                     if ahead + row[min(T, len(row)) - 1] < need[T - 1])

    short = short_at(budget)
    if not short:
        return Guarded(budget)
    T = budget - 1
    while T > 1 and short_at(T):
        T -= 1
    return Guarded(T, short)


def credit_after(credit: float, tokens: int, times: list[float], budget: int, draft_s: float = 0.0) -> float:
    """A row's credit after a round that drafted for `draft_s` seconds, verified `budget` nodes a row (at `times`'
    prices) and gave it `tokens`: behind plain steps it stays at 0 (plain rounds cannot repay it; the round's own
    break-even holds)."""
    return max(credit + tokens - (draft_s + times[budget - 1]) / times[0], 0.0)


def expansions_break_even(scales: list[float], per_row: list[list[float]], credit: list[float], gained: float, k: int,
                          times: list[float], budget: int, draft_s: float) -> bool:
    """Whether k more expansions leave every row decoding no slower than a plain step (see the module docstring).

    scales, per_row, credit: each row's scale, expected tokens E_r(T) now and credit (latency_cap's)
    gained:  the batch's expected tokens per row from the k expansions (the policy's measured gains); a row
             gains its scale times that at every size past its root, and k more candidates
    times:   the verification's seconds for T = 1..at least `budget`; budget: the size the expansions aim at
    draft_s: the round's draft time once they ran
    """
    grown = [row[:1] + [e + scale * gained for e in row[1:]] + [row[-1] + scale * gained] * k
             for row, scale in zip(per_row, scales)]
    T = latency_cap(grown, times, budget, credit).budget
    if T == 1:  # the guard would verify the roots alone: the expansions would only delay every row
        return False
    need = (draft_s + times[T - 1]) / times[0]
    return all(ahead + row[min(T, len(row)) - 1] >= need for row, ahead in zip(grown, credit))


class LatencyGuarding:
    """The goodput policy's side of the guard (GoodputPolicy inherits it): the rows' view the cap and the
    expansions' check read, and each row's credit after a round. Reads the policy's plan (RoundPlan: guard, row
    scales and ids, draft_s), call (CallState.row_credit), costs, gains and expected_tokens."""

    def guard_inputs(self, rows: list[list[float]]) -> tuple[list[float], list[list[float]], list[float]]:
        """The latency guard's view of the rows (their sorted node probabilities): (scales, each row's E(T), each
        row's credit)."""
        scales = self.plan.row_scales if len(self.plan.row_scales) == len(rows) else [1.0] * len(rows)
        per_row = [self.expected_tokens(probs, scale) for probs, scale in zip(rows, scales)]
        ids = self.plan.row_ids if len(self.plan.row_ids) == len(rows) else [None] * len(rows)
        return scales, per_row, [self.call.row_credit.get(r, 0.0) for r in ids]

    def guard_times(self, max_budget: int) -> list[float]:
        """The guard's prices for T = 1..max_budget: the verification's, but a plain step (T = 1) at what a quiet round
        costs (CostModel.quiet_s, once one ran), the batch decoding plainly: a round that builds its proposals costs
        more even when it verifies the roots alone (see the module docstring)."""
        times = self.costs.verify_times(max_budget)
        quiet = self.costs.quiet_s
        return [min(times[0], quiet)] + times[1:] if quiet else times

    def guard_allows(self, rows: list[list[float]], done: int, k: int, draft_s: float, budget: int) -> bool:
        """Under the latency guard, whether k more expansions (the round's draft time then draft_s) still leave every
        row decoding no slower than a plain step (expansions_break_even); always, without the guard."""
        if not self.plan.guard:
            return True
        times = self.guard_times(self.max_budget)
        return expansions_break_even(*self.guard_inputs(rows), sum(self.gains[done : done + k]), k, times, budget, draft_s)

    def observe_credit(self, outcomes: list[tuple]) -> None:
        """Fold each row's tokens of a round into its credit against plain steps (see the module docstring), at the round's price."""
        budget = max(len(p.subtree) for _, p, _ in outcomes)
        times = self.guard_times(budget)
        for row, _, verified in outcomes:
            self.call.row_credit[row] = credit_after(self.call.row_credit.get(row, 0.0), len(verified.tokens), times, budget,
                                                     self.plan.draft_s)
