"""Suffix proposals: every recent continuation of the context's longest repeated suffix, as a tree.

As in SuffixDecoding (arXiv 2411.04975): the last n tokens of the sequence (n from `max_n` down
to 1) are looked up among their earlier occurrences, in the prompt and the output so far, in an
optional user corpus, and in the outputs of earlier requests to the same model object
(`OutputHistory`). Each occurrence's match is then measured further back (up to MAX_MATCH tokens),
and only those that match longest are kept, as the deepest node of a suffix tree would: an earlier
output that the context repeats word for word outweighs the many places that share its last few
tokens. The tokens that followed the most recent `max_occurrences` of them are merged into a trie
with counts: a node's count is how many of the occurrences continue with the path to
it, so where the text repeated itself in several ways the proposal branches, each branch carrying
its empirical frequency. A longer match is a much safer bet (on the demo pair's prompt sets, the
first copied token is right ~40% of the time after a 1-token match, ~80% after 3); the goodput
policy calibrates each node by match length, frequency and depth.

The tables are plain dicts from n-gram tuples to occurrences, filled as tokens arrive (max_n
entries per token): looking a suffix up costs max_n dict reads, building the trie one step per
copied token.

`SuffixDrafter` is the drafter (drafting.py) that proposes them, one index per row.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..policy.goodput import GoodputPolicy
from ..steps.tree import Proposal, Subtree, SuffixTree, merge_suffix
from ..steps.verify import Verified

MAX_OCCURRENCES = 16  # most recent occurrences merged into one proposal
SCAN_OCCURRENCES = 64  # most recent occurrences of the looked-up n-gram whose match is measured further back
MAX_MATCH = 32  # how far back a match is measured


def chain(tokens: list[int], match: int) -> SuffixTree:
    """One copied continuation (a single occurrence) as a SuffixTree."""
    return SuffixTree(list(tokens), list(range(-1, len(tokens) - 1)), [1] * len(tokens), 1 if tokens else 0,
                      match if tokens else 0)


class NgramTable:
    """n-gram (n = 1..max_n) -> its occurrences (document id, end index) that have a continuation,
    oldest first. An n-gram ending at `end` is indexed once document[end] (its continuation) exists."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.where: dict[tuple[int, ...], deque[tuple[int, int]]] = {}

    def _grams(self, tokens: list[int], start: int, stop: int):
        for end in range(max(start, 1), stop):
            for n in range(1, min(self.max_n, end) + 1):
                yield end, tuple(tokens[end - n : end])

    def index(self, doc: int, tokens: list[int], start: int = 1, stop: int | None = None) -> None:
        """Index the n-grams of `tokens` ending at start..stop - 1 (default: all that have a continuation)."""
        stop = len(tokens) if stop is None else stop
        where = self.where
        for end, key in self._grams(tokens, start, stop):
            entries = where.get(key)
            if entries is None:
                where[key] = entries = deque()
            entries.append((doc, end))

    def forget(self, doc: int, tokens: list[int]) -> None:
        """Drop document `doc`, which must be the oldest indexed (its entries lead every deque)."""
        for _, key in self._grams(tokens, 1, len(tokens)):
            entries = self.where.get(key)
            if entries is None:
                continue
            while entries and entries[0][0] == doc:
                entries.popleft()
            if not entries:
                del self.where[key]

    @property
    def entries(self) -> int:
        return sum(len(e) for e in self.where.values())


class OutputHistory:
    """Earlier outputs of one model object, for later requests to copy from: first in, first out by
    request, at most `max_tokens` tokens in all (0: keep nothing). `clear()` forgets everything."""

    def __init__(self, max_tokens: int = 32768, max_n: int = 3):
        self.max_tokens = max_tokens
        self.max_n = max(max_n, 1)
        self.docs: OrderedDict[int, list[int]] = OrderedDict()
        self.table = NgramTable(self.max_n)
        self.tokens = 0  # held in docs
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        """Keep one request's tokens (its last `max_tokens` if longer), evicting the oldest requests."""
        tokens = list(tokens)[-self.max_tokens :] if self.max_tokens else []
        if len(tokens) < 2:
            return
        while self.docs and self.tokens + len(tokens) > self.max_tokens:
            doc, old = self.docs.popitem(last=False)
            self.table.forget(doc, old)
            self.tokens -= len(old)
        doc, self._next = self._next, self._next + 1
        self.docs[doc] = tokens
        self.table.index(doc, tokens)
        self.tokens += len(tokens)

    def clear(self) -> None:
        self.docs.clear()
        self.table = NgramTable(self.max_n)
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.docs)


@dataclass
class SuffixIndex:
    """The occurrences one request may copy from: its own sequence (prompt + verified tokens, ending
    with the current root), a fixed corpus, and the model object's earlier outputs.

    branching: False proposes only the most frequent path (for models whose steps must be chains).
    """

    max_n: int = 3
    history: OutputHistory | None = None
    max_occurrences: int = MAX_OCCURRENCES
    scan_occurrences: int = SCAN_OCCURRENCES
    branching: bool = True
    tokens: list[int] = field(default_factory=list)
    live: NgramTable = field(init=False)
    corpus: list[list[int]] = field(default_factory=list)
    corpus_table: NgramTable = field(init=False)
    _indexed: int = 0  # tokens[:_indexed] have their n-grams in `live`
    _last: SuffixTree | None = None  # the last proposal, made when the sequence had _last_size tokens
    _last_size: int = 0
    _last_limits: tuple[int, int] = (0, 0)  # its (max_nodes, max_depth)

    def __post_init__(self):
        self.max_n = max(self.max_n, 1)
        self.live = NgramTable(self.max_n)
        self.corpus_table = NgramTable(self.max_n)

    def add_corpus(self, documents: list[list[int]]) -> None:
        """Index user-given token sequences (e.g. a code base) as extra places to copy from."""
        for doc in documents:
            self.corpus.append(list(doc))
            self.corpus_table.index(len(self.corpus) - 1, self.corpus[-1])

    def extend(self, new_tokens: list[int]) -> None:
        """Append verified tokens; index every n-gram that now has a continuation."""
        self.tokens += new_tokens
        self.live.index(0, self.tokens, max(self._indexed, 1))
        self._indexed = len(self.tokens)

    def occurrences(self, key: tuple[int, ...], limit: int) -> list[tuple[list[int], int, bool]]:
        """(document, end, is the live sequence) of `key`'s occurrences, the most recent first: the
        sequence itself, then earlier outputs, then the corpus; at most `limit`."""
        found: list[tuple[list[int], int, bool]] = []
        for end in _latest(self.live.where.get(key), limit):
            found.append((self.tokens, end[1], True))
        if self.history is not None and len(key) <= self.history.max_n:
            for doc, end in _latest(self.history.table.where.get(key), limit - len(found)):
                found.append((self.history.docs[doc], end, False))
        for doc, end in _latest(self.corpus_table.where.get(key), limit - len(found)):
            found.append((self.corpus[doc], end, False))
        return found

    def match_length(self, doc: list[int], end: int, n: int) -> int:
        """How many tokens before doc[end] equal the sequence's last ones (at least n, at most MAX_MATCH)."""
        tokens, size = self.tokens, len(self.tokens)
        while n < MAX_MATCH and n < end and n < size and doc[end - n - 1] == tokens[size - n - 1]:
            n += 1
        return n

    def propose(self, max_nodes: int, max_depth: int | None = None) -> SuffixTree:
        """The `max_nodes` most frequent nodes (ties: shallower first) of the trie of continuations, up
        to `max_depth` tokens deep (never deeper than max_nodes), of the longest suffix that occurred before.

        Where the tokens appended since the last proposal are a path of its trie, the occurrences that
        continued that way are the longest matches now (theirs grew by those tokens, no other's could
        catch up), so the proposal is the last one's subtree under that path, and nothing is looked up
        (as a suffix tree's deepest node moves down the tree); it is built anew when the text left the
        trie or the subtree holds fewer than half of max_nodes."""
        if max_nodes <= 0:
            return SuffixTree()
        # No kept node lies deeper than max_nodes (its ancestors rank before it), so nothing is copied past
        # that: max_depth is the room left in the context (32k on a Gemma-3), and 16 copies of it cost a
        # round 55 ms, a tenth of a 4-row call on the gemma-3-270m shape.
        depth = max_nodes if max_depth is None else min(max_depth, max_nodes)
        kept = self.follow_last(max_nodes, depth)
        if kept is not None:
            return self.remember(kept, max_nodes, depth)
        return self.remember(self.look_up(max_nodes, depth), max_nodes, depth)

    def remember(self, tree: SuffixTree, max_nodes: int, depth: int) -> SuffixTree:
        self._last, self._last_size, self._last_limits = tree, len(self.tokens), (max_nodes, depth)
        return tree

    def follow_last(self, max_nodes: int, depth: int) -> SuffixTree | None:
        """The last proposal's subtree under the tokens appended since it was made, or None."""
        last, appended = self._last, self.tokens[self._last_size :]
        if last is None or not last.tokens or not appended or self._last_limits != (max_nodes, depth):
            return None
        node = -1
        for token in appended:
            node = next((i for i, (p, t) in enumerate(zip(last.parents, last.tokens)) if p == node and t == token), None)
            if node is None:
                return None
        return subtree_below(last, node, min(last.match + len(appended), MAX_MATCH), max_nodes // 2)

    def look_up(self, max_nodes: int, depth: int) -> SuffixTree:
        """The proposal from the index: the longest suffix's occurrences, their continuations as a trie."""
        size = len(self.tokens)
        for n in range(min(self.max_n, size), 0, -1):
            found = self.occurrences(tuple(self.tokens[size - n :]), self.scan_occurrences)
            if found:
                lengths = [self.match_length(doc, end, n) for doc, end, _ in found]
                longest = max(lengths)
                found = [f for f, length in zip(found, lengths) if length == longest][: self.max_occurrences]
                copies = [continuation(doc, end, depth) if live else doc[end : end + depth] for doc, end, live in found]
                return build_trie(copies, longest, max_nodes, self.branching)
        return SuffixTree()


def subtree_below(tree: SuffixTree, node: int, match: int, min_nodes: int) -> SuffixTree | None:
    """The nodes under `node` of `tree` as a proposal of their own (match: its match length), or None
    when they are fewer than min_nodes."""
    local = {node: -1}
    tokens, parents, counts = [], [], []
    for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)):
        if p in local and i != node:
            local[i] = len(tokens)
            tokens.append(t)
            parents.append(local[p])
            counts.append(tree.counts[i])
    if len(tokens) < max(min_nodes, 1):
        return None
    return SuffixTree(tokens, parents, counts, occurrences=tree.counts[node], match=match)


def _latest(entries, limit: int):
    """The last `limit` entries of a deque (or None), newest first."""
    if not entries or limit <= 0:
        return []
    out = []
    for i in range(len(entries) - 1, max(len(entries) - 1 - limit, -1), -1):
        out.append(entries[i])
    return out


def build_trie(copies: list[list[int]], match: int, max_nodes: int, branching: bool = True) -> SuffixTree:
    """Merge continuations into a trie with counts, cut to its max_nodes most frequent nodes (ties:
    shallower, then earlier: counts never rise along a path, so the cut is a connected tree)."""
    tokens: list[int] = []
    parents: list[int] = []
    counts: list[int] = []
    depths: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for copy in copies:
        node = -1
        for token in copy:
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
                depths.append(depths[node] + 1 if node >= 0 else 1)
            counts[child] += 1
            node = child
    if not branching:  # the most frequent path only: at each node the child most occurrences took
        best: dict[int, int] = {}
        for i, p in enumerate(parents):
            if p not in best or counts[i] > counts[best[p]]:
                best[p] = i
        keep, node = [], -1
        while node in best and len(keep) < max_nodes:
            node = best[node]
            keep.append(node)
    else:
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-counts[i], depths[i], i))[:max_nodes])
    local = {old: new for new, old in enumerate(keep)}
    return SuffixTree(
        tokens=[tokens[i] for i in keep],
        parents=[local[parents[i]] if parents[i] >= 0 else -1 for i in keep],
        counts=[counts[i] for i in keep],
        occurrences=len(copies),
        match=match if keep else 0,
    )


def continuation(tokens: list[int], start: int, length: int) -> list[int]:
    """`length` tokens copied from tokens[start:], running on into the copy itself past the end
    (as an LZ77 match may overlap its own output): a repeating cycle is proposed for its whole length."""
    out: list[int] = []
    for i in range(start, start + length):
        out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
    return out


def index_for(tokens: list[int], max_n: int, corpus: list[list[int]] | None = None,
              history: OutputHistory | None = None, branching: bool = True) -> SuffixIndex:
    """A row's index over its sequence so far, `corpus` and the model's earlier outputs."""
    index = SuffixIndex(max_n=max_n, history=history, branching=branching)
    index.add_corpus(corpus or [])
    index.extend(tokens)
    return index


class SuffixDrafter:
    """Suffix proposals for every row: the continuations of its context's longest repeated suffix, in its
    prompt, its output so far, a corpus and earlier calls' outputs. It does not grow within a round: asked
    once a round (its index remembers the last proposal, see SuffixIndex.propose).

    max_n: longest suffix matched; branching: False keeps proposals to chains (the models' steps must be).
    """

    grows = False

    def __init__(self, max_n: int, batch_size: int = 1, branching: bool = True, corpus: list[list[int]] | None = None,
                 history: OutputHistory | None = None):
        self.max_n, self.branching, self.corpus, self.history = max_n, branching, corpus or [], history
        self.indices = [SuffixIndex(max_n=max_n, branching=branching) for _ in range(batch_size)]

    def start(self, prompts: list[list[int]], features=None) -> None:
        self.indices = [index_for(ids, self.max_n, self.corpus, self.history, self.branching) for ids in prompts]

    def propose(self, b: int, max_nodes: int, max_depth: int | None, policy: GoodputPolicy) -> Proposal:
        """Row b's suffix proposal under its root (the last token of its sequence), at most `max_nodes` nodes no
        deeper than `max_depth` (None: any depth), each node with its calibrated P(accepted) and bucket."""
        index = self.indices[b]
        tree = index.propose(max_nodes, max_depth)
        probs, buckets = policy.suffix_probs(tree)
        root = Subtree([0], [index.tokens[-1]], [-1])
        return merge_suffix(root, [0.0], [1.0], tree.tokens, tree.parents, probs, buckets, tree.match)

    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None]) -> None:
        for index, outcome in zip(self.indices, verified):
            if outcome is not None:
                index.extend(outcome.tokens)

    def absorb(self, other: "SuffixDrafter") -> None:
        self.indices += other.indices

    def keep_rows(self, rows: list[int]) -> None:
        self.indices = [self.indices[b] for b in rows]
