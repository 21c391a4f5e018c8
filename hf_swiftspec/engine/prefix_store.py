"""Shared prompt prefixes prefilled once: the target's KV of recently prefilled prompts, kept by their tokens, so a
joining request whose prompt starts with the same tokens (a chat client's system prompt and history, resent every
turn) copies that KV instead of recomputing it.

The running batch on the device round (engine/continuous_device.py) keeps one. When a request's prefill ends, its
row of the target's slot cache (slot j holds position j's keys and values: a prompt's KV does not depend on what
follows it; a 1-row copy where its prompt was prefilled beside others) is kept here under the prompt's tokens before
the batch copies its row in. A request joining later looks up the
longest stored prefix of its prompt, in whole blocks of BLOCK tokens (a handful of shared tokens is not worth a
copy), copies those slots into its own cache and prefills the target from there; its drafter still runs the whole
prompt (a draft's KV and state are its own; a drafter that reads the target's states, an EAGLE-3 head or MTP layers,
is not served from here). The store holds at most `positions` slots, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BLOCK = 16  # prefixes are reused in whole blocks of this many tokens


@dataclass
class StoredPrefix:
    """One prefilled prompt: tokens, its committed prompt tokens; cache, the 1-row target SlotCache whose first
    len(tokens) slots hold their keys and values."""

    tokens: tuple[int, ...]
    cache: object

    @property
    def positions(self) -> int:
        return self.cache.capacity


@dataclass
class PrefixHit:
    """What a joining prompt reuses: the first `length` slots of `stored`'s cache (a whole number of blocks)."""

    stored: StoredPrefix
    length: int


def common_length(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixStore:
    """Target KV of recently prefilled prompts (module docstring), at most `positions` slots in all."""

    def __init__(self, positions: int, block: int = BLOCK):
        if positions < 0:
            raise ValueError(f"prefix cache positions {positions}: give 0 (no prefix reuse) or more.")
        self.positions, self.block = positions, block
        self.stored: OrderedDict[tuple[int, ...], StoredPrefix] = OrderedDict()
        self.hits = 0  # joining prompts that reused a stored prefix
        self.reused_tokens = 0  # prompt tokens whose prefill they skipped

    @property
    def held(self) -> int:
        return sum(s.positions for s in self.stored.values())

    def longest(self, tokens: list[int]) -> PrefixHit | None:
        """The stored prefix sharing the most whole blocks with `tokens` (a prompt's committed tokens), if any; it
        becomes the most recently used."""
        best, length = None, 0
        for stored in self.stored.values():
            shared = common_length(stored.tokens, tokens) // self.block * self.block
            if shared > length:
                best, length = stored, shared
        if best is None:
            return None
        self.stored.move_to_end(best.tokens)
        self.hits += 1
        self.reused_tokens += length
        return PrefixHit(best, length)

    def keep(self, tokens: list[int], cache, row: int | None = None) -> None:
        """Keep a prefilled prompt's target cache (a chain's cache, read by its length with recurrent states, is not
        kept); stored prompts it extends go (it holds their KV too), then the least recently used past `positions`.
        row: the prompt's row where the cache holds several prompts prefilled together (a 1-row copy of it is kept,
        so that what the store holds is what it counts); None: the cache is the prompt's alone."""
        if len(tokens) < self.block or cache.capacity > self.positions or cache.length is not None or not cache.buffers:
            return
        key = tuple(tokens)
        for other in [k for k in self.stored if len(k) <= len(key) and key[: len(k)] == k]:
            del self.stored[other]
        if any(len(k) > len(key) and k[: len(key)] == key for k in self.stored):
            return  # a longer stored prompt holds this one's KV already
        self.stored[key] = StoredPrefix(key, cache if row is None else cache.copy_of_row(row))
        while self.held > self.positions:
            self.stored.popitem(last=False)
