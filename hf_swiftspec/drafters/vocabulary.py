"""Two vocabularies, one text: what a draft with another tokenizer than the target's needs to propose the
target's tokens (drafters/translated.py grows the tree; this module turns its branches into target tokens).

Text moves between the two token sequences as transformers' universal assisted generation moves it
(`AssistedCandidateGeneratorDifferentTokenizers`): never by decoding and encoding a whole sequence again,
but from the last stable point, a short window of the tokens already on the other side:

    the draft's branch, as text:   decode(window + branch) minus decode(window), on the draft's side
    that text as target tokens:    encode(decode(target window) + text), minus the window's own tokens

A window's text that changes once more tokens follow (a UTF-8 character split over tokens, "\\ufffd") is
no stable point: such tokens wait (`held`) until the text they spell is whole. Where the target's last token
and the branch's first characters merge into one token of the target's ("hel" + "lo" is " hello"), the
target cannot emit that token any more (its "hel" is committed): the text is then encoded on its own,
after an anchor that no tokenizer merges with what follows (a newline), which gives the tokens the target
emits after "hel".

Where a draft token is spelt exactly as a target token (the two vocabularies overlap, as
`AssistantToTargetTranslator` maps them: the same string, the space sign made the same), a branch that
only adds such tokens maps them one to one with no tokenizer call (`direct`); special tokens map by role
(the draft's EOS is the target's EOS), and other special tokens end a branch.

Verification never trusts any of this: the target decides every token, so a wrong translation costs
acceptance, never a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # what decode() gives for bytes that do not (yet) make a character
ANCHOR = "\n"  # text no tokenizer merges with the text after it: encode(ANCHOR + text) = encode(ANCHOR) + ...
WINDOW = 8  # tokens of stable text re-encoded together with new text (enough for a word to re-merge)


@dataclass
class Vocabularies:
    """The target's and the draft's tokenizers, and what maps between them without text.

    direct:    draft id -> target id of the same token (string equal up to the space sign; EOS by role)
    ends:      draft special ids that end a branch (every draft special that maps to no target token)
    signs:     (the target's, the draft's) space sign, where their vocabularies write one (stable_tail)
    """

    target: object
    draft: object
    direct: dict[int, int] = field(default_factory=dict)
    ends: frozenset[int] = frozenset()
    signs: tuple[str | None, str | None] = (None, None)
    spaces: dict[int, bool] = field(default_factory=dict)  # target id -> whether it spells whitespace alone
    target_specials: frozenset[int] = frozenset()
    draft_specials: frozenset[int] = frozenset()

    @classmethod
    def between(cls, target_tokenizer, draft_tokenizer) -> "Vocabularies":
        """The maps between two tokenizers (read once a pair: a 262k vocabulary takes a fraction of a second)."""
        signs = space_sign(target_tokenizer), space_sign(draft_tokenizer)
        direct = same_tokens(target_tokenizer, draft_tokenizer, signs)
        d_eos, t_eos = draft_tokenizer.eos_token_id, target_tokenizer.eos_token_id
        if isinstance(d_eos, int) and isinstance(t_eos, int):  # the end of the text, however each spells it
            direct[d_eos] = t_eos
        draft_specials = frozenset(draft_tokenizer.all_special_ids)
        return cls(target_tokenizer, draft_tokenizer, direct, draft_specials - set(direct), signs,
                   target_specials=frozenset(target_tokenizer.all_special_ids), draft_specials=draft_specials)

    def target_window(self, ids: list[int]) -> list[int]:
        """The stable tail of target tokens `ids` (stable_tail)."""
        return stable_tail(self.target, ids, self.target_specials, self.signs[0])

    def draft_window(self, ids: list[int]) -> list[int]:
        """The stable tail of draft tokens `ids` (stable_tail)."""
        return stable_tail(self.draft, ids, self.draft_specials, self.signs[1])

    # ---- text ------------------------------------------------------------------------------------
    def draft_prompt(self, target_ids: list[int]) -> tuple[list[int], int]:
        """(the draft's tokens for a target prompt's text, how many of them lead as special tokens (its BOS),
        which the windows never re-encode). A prompt of special tokens alone gives the draft its BOS (or EOS)."""
        text = decode(self.target, target_ids)
        ids = list(self.draft(text, add_special_tokens=True)["input_ids"])
        if not ids:
            start = self.draft.bos_token_id if self.draft.bos_token_id is not None else self.draft.eos_token_id
            ids = [start if start is not None else 0]
        lead = next((i for i, t in enumerate(ids) if t not in self.draft_specials), len(ids))
        return ids, min(lead, len(ids) - 1)

    def target_text_after(self, window: list[int], new: list[int]) -> str | None:
        """The text target tokens `new` add after `window` (None: not whole yet, see `text_after`)."""
        return text_after(self.target, window, new)

    def branch_texts(self, window: list[int], branches: list[list[int]]) -> list[str | None]:
        """Per branch (draft tokens after `window`, the draft's stable tail), the text it adds, in one
        batched decode; None where it ends inside a character or holds a special token that ends branches."""
        base = decode(self.draft, window)
        texts = decode_many(self.draft, [window + branch for branch in branches])
        out: list[str | None] = []
        for branch, text in zip(branches, texts):
            clean = text.startswith(base) and not text.endswith(REPLACEMENT) and not self.ends.intersection(branch)
            out.append(text[len(base) :] if clean else None)
        return out

    def target_tokens(self, window: list[int], texts: list[str]) -> list[list[int] | None]:
        """Per text, the target tokens that spell it after the target tokens `window` (its stable tail), by
        re-encoding window and text together; where the window's last token would merge with the text, the
        text after ANCHOR instead (the module docstring). Two batched encodes at most; None where neither fits."""
        base = decode(self.target, window)
        together = encode_many(self.target, [base + text for text in texts])
        out: list[list[int] | None] = []
        alone: list[int] = []  # texts whose first tokens merged into the window's
        for i, ids in enumerate(together):
            if ids[: len(window)] == window:
                out.append(list(ids[len(window) :]))
            else:
                out.append(None)
                alone.append(i)
        if alone:
            anchor = encode_many(self.target, [ANCHOR])[0]
            anchored = encode_many(self.target, [ANCHOR + texts[i] for i in alone])
            for i, ids in zip(alone, anchored):
                if ids[: len(anchor)] == anchor:
                    out[i] = list(ids[len(anchor) :])
        return out

    def without_trailing_space(self, ids: list[int]) -> list[int]:
        """`ids` less the target tokens at its end that spell whitespace alone: a branch's text that ends in a space
        ends in a token the target's tokenizer joins to the next word (" golf" + " " is "Ġgolf", "Ġ"; the target
        writes "Ġgolf", "Ġhotel"), so it is a guess the target all but never makes; the branch's children spell it
        as the target does."""
        end = len(ids)
        while end and self.is_space(ids[end - 1]):
            end -= 1
        return ids[:end]

    def is_space(self, token: int) -> bool:
        """Whether a target token spells whitespace alone (read once per token)."""
        known = self.spaces.get(token)
        if known is None:
            known = self.spaces[token] = decode(self.target, [token]).isspace()
        return known

    def draft_tokens(self, window: list[int], text: str) -> list[int]:
        """The draft's tokens for its stable tail `window` followed by `text` (the caller compares them with
        `window`: where the two part, the draft's tail changed)."""
        return encode_many(self.draft, [decode(self.draft, window) + text])[0]


def decode(tokenizer, ids: list[int]) -> str:
    """The text of `ids` as both sides read it: special tokens left out, spaces as they are."""
    return decode_many(tokenizer, [ids])[0]


def decode_many(tokenizer, batch: list[list[int]]) -> list[str]:
    """decode() of every list, in one call of the Rust tokenizer where there is one (transformers' own decode adds a
    few hundred microseconds of Python per call, more than a round's whole translation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode_batch(batch, skip_special_tokens=True)
    return tokenizer.batch_decode(batch, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids, no special tokens added, in one call of the Rust tokenizer where there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def text_after(tokenizer, window: list[int], new: list[int]) -> str | None:
    """The text `new` adds after `window`: decode(window + new) minus decode(window); None where that is no
    stable point (the window's text changes, or the new text ends inside a character)."""
    base, text = decode(tokenizer, window), decode(tokenizer, window + new)
    if not text.startswith(base) or text.endswith(REPLACEMENT):
        return None
    return text[len(base) :]


def stable_tail(tokenizer, ids: list[int], specials: frozenset[int], sign: str | None = None, size: int = WINDOW) -> list[int]:
    """The last tokens of `ids` that re-encode to themselves when text follows: at most `size`, none of them a
    special token (its text is empty), starting with a word where the vocabulary writes spaces with a sign (a
    SentencePiece tokenizer puts one before the first word of any text it encodes, so a window that begins
    inside a word would not encode to itself)."""
    tail = ids[-size:]
    last = max((i for i, t in enumerate(tail) if t in specials), default=-1)
    tail = tail[last + 1 :]
    if sign and len(tail) > 1:
        pieces = tokenizer.convert_ids_to_tokens(tail)
        first = next((i for i, piece in enumerate(pieces) if piece.startswith(sign)), 0)
        tail = tail[first:]
    return tail


def space_sign(tokenizer) -> str | None:
    """The character a tokenizer's vocabulary writes a space as ("Ġ" byte-level, "▁" SentencePiece), or None
    where it writes a space as itself."""
    pieces = [p for p in tokenizer.convert_ids_to_tokens(tokenizer(" ", add_special_tokens=False)["input_ids"]) if p]
    sign = pieces[0][0] if pieces else None
    return None if sign in (None, " ") else sign


def same_tokens(target_tokenizer, draft_tokenizer, signs: tuple[str | None, str | None]) -> dict[int, int]:
    """draft id -> target id of every non-special token both vocabularies spell alike, the draft's space sign
    written as the target's (as AssistantToTargetTranslator maps them)."""
    t_sign, d_sign = signs
    target_vocab = target_tokenizer.get_vocab()
    specials = set(draft_tokenizer.all_special_ids) | set(target_tokenizer.all_special_ids)
    out = {}
    for token, d in draft_tokenizer.get_vocab().items():
        if d_sign and t_sign and d_sign != t_sign and token.startswith(d_sign):
            token = t_sign + token[1:]
        t = target_vocab.get(token)
        if t is not None and d not in specials and t not in specials:
            out[d] = t
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
