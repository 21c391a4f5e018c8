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
the others' tree size. The draft's expansions are not in c(T): by the time the size is chosen they
have run (keep_expanding priced them).
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


def credit_after(credit: float, tokens: int, times: list[float], budget: int) -> float:
    """A row's credit after a round that verified `budget` nodes a row (at `times`' prices) and gave it
    `tokens`: behind plain steps it stays at 0 (plain rounds cannot repay it; the round's own break-even holds)."""
    return max(credit + tokens - times[budget - 1] / times[0], 0.0)
