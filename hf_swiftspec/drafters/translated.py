"""A draft model with another tokenizer than the target's: its token tree grows in its own vocabulary, and
each round's branches are translated into the target's tokens through their text (drafters/vocabulary.py).

    grow     the draft's tree, as a DraftModelDrafter grows it: best-first, in draft tokens, its KV kept
    propose  its best nodes, each branch's text (from the draft's stable tail) encoded as target tokens (or
             mapped token by token where the vocabularies overlap); branches that spell the same target
             tokens merge into one trie, each target node scored by the best draft node that reaches it
    accept   the verified target tokens' text, appended to the draft's text: its tail re-encoded from the
             last stable point; where the draft's tokens stay, the tree re-roots along them (KV kept, as a
             draft of the target's own vocabulary does), where the tail re-encodes differently (a word that
             grew) the changed tokens are dropped from the draft's cache and run again

The target verifies the trie exactly as any proposal: the translation decides what is proposed, never what
is emitted. The draft reads the text in a window of its own context (draft_model.py), so a draft with a
shorter context than the target's, or whose tokens run longer than the target's, drafts all the same.
"""

from __future__ import annotations

import time

from transformers import PreTrainedModel

from ..policy.goodput import GoodputPolicy
from ..steps.tree import Proposal, Subtree, read_views, reset_tree, select_subtree
from ..steps.verify import Verified
from .draft_model import DraftModelDrafter
from .vocabulary import WINDOW, Vocabularies, common_prefix

TAIL = 2 * WINDOW  # target tokens kept per row: the windows are read from them


class TranslatedDrafter(DraftModelDrafter):
    """A draft model's tree in its own vocabulary, proposed to the target in the target's (module docstring).

    target_tail[b]: the last target tokens whose text the draft holds (its text ends where theirs does)
    held[b]:        target tokens verified since, whose text is not whole yet (a character split over tokens)
    translated[b]:  draft node -> its branch's target tokens below the root (None: it has none), this round's
    """

    def __init__(self, model: PreTrainedModel, vocabularies: Vocabularies, capacity: int, tree_capacity: int,
                 width: int, vocab_limit: int, **kwargs):
        super().__init__(model, capacity, tree_capacity, width, vocab_limit, **kwargs)
        if self.states.active:
            raise ValueError(
                f"A draft with another tokenizer than the target's re-encodes the end of its text as words grow, which "
                f"a recurrent draft ({self.architecture.model_type}) cannot take back. Pick an attention draft, or one "
                "that shares the target's tokenizer."
            )
        self.vocabularies = vocabularies
        self.context = self.max_positions  # the draft's own context (or None): its windows are sized from it in start()
        self.target_length = capacity - tree_capacity  # target tokens a row may reach (prompt and new tokens)
        rows = len(self.trees)
        self.target_tail: list[list[int]] = [[] for _ in range(rows)]
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.translated: list[dict[int, list[int] | None]] = [{} for _ in range(rows)]

    # ---- a generation ----------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], features=None) -> None:
        """Begin a generation on each row's target prompt: the draft reads its text in its own tokens."""
        vocab = self.vocabularies
        drafts = []
        for b, ids in enumerate(prompts):
            whole = len(ids)
            while whole > 1 and vocab.target_text_after([], ids[:whole]) is None:
                whole -= 1  # a prompt ending inside a character: its last tokens wait for the rest
            self.target_tail[b], self.held[b] = list(ids[:whole][-TAIL:]), list(ids[whole:])
            self.translated[b] = {}
            drafts.append(vocab.draft_prompt(ids[:whole])[0])
        self.size_cache(max(len(d) / max(len(t), 1) for d, t in zip(drafts, prompts)))
        super().start(drafts)

    def size_cache(self, ratio: float) -> None:
        """Room for the draft's spelling of the whole text: its tokens per target token on the prompts (`ratio`),
        with a margin, for every target token a row may reach; its windows keep within that and its own context.
        Before the first forward only (the cache's buffers are allocated then)."""
        if self.cache.buffers:
            return
        room = max(self.trees[0].capacity, 1)
        needed = int(max(ratio, 1.0) * 1.5 * self.target_length) + 16
        self.max_positions = min(needed, self.context) if self.context is not None else needed
        self.window = max(self.max_positions // 2, 1)
        self.cache.capacity = self.max_positions + room

    # ---- the round's proposal -------------------------------------------------------------------
    def propose(self, b: int, max_nodes: int, max_depth: int | None, policy: GoodputPolicy) -> Proposal:
        """Row b's best draft nodes as target tokens: a trie below the target's root (module docstring), at most
        `max_nodes` nodes no deeper than `max_depth`, each with the policy's P(accepted) of its best draft score."""
        start = time.perf_counter()
        root = (self.target_tail[b] + self.held[b])[-1]
        read_views(self.trees)
        if self.held[b] or max_nodes <= 1 or max_depth == 0:  # the draft's text does not reach the target's end
            return root_only(root)
        subtree, scores = select_subtree(self.trees[b], max_nodes, 0)
        branches = self.translate(b, subtree)
        tokens, parents, best = [root], [-1], [0.0]
        children: dict[tuple[int, int], int] = {}
        for i in sorted(range(1, len(subtree)), key=lambda i: (-scores[i], i)):  # best first: a node's first score is its best
            node = 0
            for token in (branches[i] or [])[:max_depth]:
                child = children.get((node, token))
                if child is None:
                    if len(tokens) >= max_nodes:
                        break
                    child = children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    best.append(scores[i])
                node = child
        self.counters.translation_s += time.perf_counter() - start
        return Proposal(Subtree([0] + [-1] * (len(tokens) - 1), tokens, parents), policy.draft_probs(best), best,
                        [-1] * len(tokens), 0, ([], [], []))

    def translate(self, b: int, subtree: Subtree) -> list[list[int] | None]:
        """Per node of `subtree` (draft nodes, topological), its branch's target tokens below the root: the parent's
        and the node's own token where it has a target twin, else the branch's text encoded anew; None where the
        branch spells no whole text yet. Kept per draft node until the tree re-roots: a round asks after every
        expansion, and only new nodes cost a tokenizer call."""
        vocab, known = self.vocabularies, self.translated[b]
        out: list[list[int] | None] = [[]]
        paths: list[list[int]] = [[]]
        pending: list[int] = []  # nodes whose branch text is needed
        for i in range(1, len(subtree)):
            node, parent, token = subtree.node_ids[i], subtree.parents[i], subtree.tokens[i]
            paths.append(paths[parent] + [token])
            if node in known:
                out.append(known[node])
                continue
            self.counters.translated_nodes += 1
            up = out[parent]
            if up is not None and token in vocab.direct:  # a target twin: no tokenizer call
                out.append(up + [vocab.direct[token]])
                self.counters.mapped_nodes += 1
            elif token in vocab.direct and token in vocab.draft_specials:  # an EOS after a branch with no text
                out.append(None)
            else:
                out.append(None)
                pending.append(i)
        if pending:
            window = vocab.draft_window(self.committed[b])
            texts = vocab.branch_texts(window, [paths[i] for i in pending])
            wanted = [(i, text) for i, text in zip(pending, texts) if text is not None]
            target_window = vocab.target_window(self.target_tail[b])
            encoded = vocab.target_tokens(target_window, [text for _, text in wanted]) if wanted else []
            for (i, _), ids in zip(wanted, encoded):
                out[i] = vocab.without_trailing_space(ids) if ids is not None else None
        for i in range(1, len(subtree)):
            node = subtree.node_ids[i]
            if node not in known:
                known[node] = out[i]
                self.counters.translated_kept += bool(out[i])
        return out

    # ---- following the verdict ------------------------------------------------------------------
    def accept(self, subtrees: list[Subtree | None], verified: list[Verified | None], defer: bool = False) -> int:
        """Per row, append the verified target tokens' text to the draft's: its tail re-encoded from the last stable
        point, the tree re-rooted along the draft tokens that stay (module docstring). Re-roots never wait
        (defer is for trees the target's subtree names nodes of; this one's it never does). Returns how many rows'
        new draft roots the trees held."""
        start = time.perf_counter()
        chains: list[Subtree | None] = [None] * len(verified)
        verdicts: list[Verified | None] = [None] * len(verified)
        for b, outcome in enumerate(verified):
            if outcome is None:
                continue
            self.translated[b] = {}
            new = self.held[b] + outcome.tokens
            text = self.vocabularies.target_text_after(self.vocabularies.target_window(self.target_tail[b]), new)
            if text is None:  # a character split over tokens: the draft reads it once it is whole
                self.held[b] = new
                continue
            self.held[b] = []
            self.target_tail[b] = (self.target_tail[b] + new)[-TAIL:]
            window = self.vocabularies.draft_window(self.committed[b])
            tokens = self.vocabularies.draft_tokens(window, text)
            kept = common_prefix(window, tokens)
            if kept < len(window):  # the tail re-encodes otherwise (a word grew): those tokens run again
                self.take_back(b, len(window) - kept, tokens[kept:])
            elif len(tokens) > kept:
                chains[b], verdicts[b] = self.chain(b, tokens[kept:])
        hits = super().accept(chains, verdicts)
        self.counters.translation_s += time.perf_counter() - start
        return hits

    def take_back(self, b: int, dropped: int, new: list[int]) -> None:
        """Row b's last `dropped` draft tokens are not the text's any more: forget them (and the KV of those the
        draft ran), append `new`; they and the root run as pending tokens in the next expansion."""
        committed, cache = self.committed[b], self.cache
        keep = len(committed) - dropped
        ran = min(keep, cache.prefix_lens[b] - cache.starts[b])  # kept tokens whose KV the cache holds
        cache.truncate(cache.starts[b] + ran, b)  # the tree region goes too
        self.committed[b] = committed[:keep] + new
        self.pending[b] = self.committed[b][ran:-1]
        self.counters.reroot_misses += 1
        self.counters.taken_back += dropped
        reset_tree(self.trees[b], self.committed[b][-1])

    def follow(self, verified: list[Verified | None]) -> int:
        """accept(): the verdict is in the target's tokens, which name no node of the draft's tree either way."""
        return self.accept([None] * len(verified), verified)

    def graft(self, b: int, subtree: Subtree) -> int:
        """Nothing: the subtree in flight holds target tokens, which name no node of the draft's tree."""
        return 0

    def absorb(self, other: "TranslatedDrafter") -> None:
        super().absorb(other)
        self.target_tail += other.target_tail
        self.held += other.held
        self.translated += other.translated

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.target_tail = [self.target_tail[b] for b in rows]
        self.held = [self.held[b] for b in rows]
        self.translated = [self.translated[b] for b in rows]


def root_only(root: int) -> Proposal:
    return Proposal(Subtree([0], [root], [-1]), [1.0], [0.0], [-1], 0, ([], [], []))
