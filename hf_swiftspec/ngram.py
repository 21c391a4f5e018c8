"""N-gram branches: continuations copied from the context, proposed at no draft cost.

As in prompt lookup decoding: the last n tokens of the sequence (n from `max_n` down to
`min_n`) are looked up among their earlier occurrences in the prompt and the output so far
(and in an optional user corpus); the tokens that followed the most recent occurrence are
proposed as a chain under the tree's root, beside the draft model's branches. How many tokens
matched travels with the chain: a longer match is a much safer bet (on the demo pair's
prompt sets, the first copied token is right ~40% of the time after a 1-token match, ~80%
after 3), so the policy calibrates chains per match length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Continuation:
    """An n-gram proposal: `tokens` followed an earlier occurrence of the last `match` tokens
    (match 0 and no tokens: nothing matched)."""

    tokens: list[int] = field(default_factory=list)
    match: int = 0


@dataclass
class NgramIndex:
    """Where each n-gram last ended, for the growing sequence and an optional fixed corpus.

    tokens:  the sequence so far (prompt + verified tokens), ending with the current root
    seen:    n-gram tuple -> end index (exclusive) of its latest occurrence in `tokens`,
             excluding the one that ends the sequence
    corpus:  the same for the corpus documents: n-gram -> (document, end index)
    """

    max_n: int = 3
    min_n: int = 1
    tokens: list[int] = field(default_factory=list)
    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    corpus: list[list[int]] = field(default_factory=list)
    corpus_seen: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)
    _indexed: int = 0  # tokens[:_indexed] have their n-grams in `seen`

    def add_corpus(self, documents: list[list[int]]) -> None:
        """Index user-given token sequences (e.g. a code base) as extra places to copy from."""
        for doc in documents:
            d = len(self.corpus)
            self.corpus.append(list(doc))
            for end in range(1, len(doc)):  # an n-gram ending at `end` has a continuation doc[end]
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    self.corpus_seen[tuple(doc[end - n : end])] = (d, end)

    def extend(self, new_tokens: list[int]) -> None:
        """Append verified tokens; index every n-gram that now has a continuation."""
        self.tokens += new_tokens
        # An n-gram ending at `end` is indexed once tokens[end] (its continuation) exists.
        for end in range(max(self._indexed, 1), len(self.tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.seen[tuple(self.tokens[end - n : end])] = end
        self._indexed = len(self.tokens)

    def propose(self, max_tokens: int) -> Continuation:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
        suffix of the sequence (the sequence itself first, then the corpus)."""
        if max_tokens <= 0:
            return Continuation()
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            key = tuple(self.tokens[size - n :])
            end = self.seen.get(key)
            if end is not None:
                return Continuation(continuation(self.tokens, end, max_tokens), n)
            where = self.corpus_seen.get(key)
            if where is not None:
                doc, end = where
                return Continuation(self.corpus[doc][end : end + max_tokens], n)
        return Continuation()


def continuation(tokens: list[int], start: int, length: int) -> list[int]:
    """`length` tokens copied from tokens[start:], running on into the copy itself past the end
    (as an LZ77 match may overlap its own output): a repeating cycle is proposed for its whole length."""
    out: list[int] = []
    for i in range(start, start + length):
        out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
    return out
