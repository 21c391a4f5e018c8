"""Can these two models speculate together? Checks on their configs and tokenizers, no weights.

Each check raises PairConfigError naming the value that is wrong and what to pick instead. A draft with
another tokenizer than the target's, or a shorter context, is no error: it proposes through text
(drafters/translated.py) and reads long texts in windows (drafters/draft_model.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedConfig

from ..models.architectures import UnsupportedArchitecture, check_config
from .errors import PairConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerArguments:
    """How the entry point being checked takes the two tokenizers, so that its errors name its own arguments
    (from_models': tokenizer= and draft_tokenizer=; custom_generate's: swiftspec_tokenizer= and
    swiftspec_draft_tokenizer=)."""

    target: str = "tokenizer="
    draft: str = "draft_tokenizer="


FROM_MODELS = TokenizerArguments()


def check_architecture(config: PreTrainedConfig, role: str) -> None:
    """Refuse an architecture whose tree steps could not be exact, by capability (architectures.py)."""
    try:
        check_config(config, role)
    except UnsupportedArchitecture as error:
        raise PairConfigError(str(error)) from error


def context_length(config: PreTrainedConfig) -> int | None:
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def check_context_lengths(target: PreTrainedConfig, draft: PreTrainedConfig) -> None:
    """A draft whose context is shorter than the target's is fine: it reads the text in windows of its own
    (drafters/draft_model.py). Say so, once, where it happens: past its context it drafts from the last part."""
    t_len, d_len = context_length(target), context_length(draft)
    if t_len is not None and d_len is not None and d_len < t_len:
        logger.info(
            "The draft's context (max_position_embeddings=%d) is shorter than the target's (%d): it drafts from the "
            "last %d tokens of longer texts.", d_len, t_len, d_len // 2,
        )


def vocab_size(config: PreTrainedConfig) -> int:
    return config.get_text_config().vocab_size


def special_tokens(tokenizer) -> dict[str, int]:
    """bos/eos/pad/unk and additional special tokens: token -> id."""
    return dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))


def check_special_tokens(target_tokenizer, draft_tokenizer) -> None:
    """Every special token either side uses must have the same id on both sides (roles may differ:
    an instruct target may stop on a token a base draft never emits, and that is fine)."""
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    clashes = sorted(
        {
            (token, t_vocab[token], d_vocab[token])
            for tokenizer in (target_tokenizer, draft_tokenizer)
            for token in special_tokens(tokenizer)
            if token in t_vocab and token in d_vocab and t_vocab[token] != d_vocab[token]
        }
    )
    if clashes:
        listed = "; ".join(f"{tok!r} is id {t} in the target, {d} in the draft" for tok, t, d in clashes[:5])
        raise PairConfigError(
            f"The target and draft tokenizers disagree on special tokens: {listed}. The draft must share the target's "
            "special tokens (same token, same id): pick a draft from the target's model family."
        )


def mapping_differences(target_tokenizer, draft_tokenizer, limit: int) -> list[int]:
    """Draft token ids below `limit` that the target's tokenizer maps to another token (sorted)."""
    t_vocab = target_tokenizer.get_vocab()
    return sorted(i for token, i in draft_tokenizer.get_vocab().items() if i < limit and t_vocab.get(token) != i)


def describe_ids(ids: list[int], target_tokenizer, draft_tokenizer, shown: int = 5) -> str:
    t_tokens = target_tokenizer.convert_ids_to_tokens(ids[:shown])
    d_tokens = draft_tokenizer.convert_ids_to_tokens(ids[:shown])
    listed = ", ".join(f"id {i}: draft {d!r} / target {t!r}" for i, d, t in zip(ids, d_tokens, t_tokens))
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return listed + more


def check_token_mapping(target_tokenizer, draft_tokenizer, target_vocab_size: int) -> None:
    """The draft's token -> id mapping must equal the target's over the ids the target can embed.

    Differences among added tokens that neither side uses as a special token (renamed reserved
    tokens, say) only warn: verification is lossless whatever the draft proposes, they merely
    lower acceptance where those ids occur. Any other difference is an error listing the ids.
    """
    differ = mapping_differences(target_tokenizer, draft_tokenizer, target_vocab_size)
    if not differ:
        return
    special = set(target_tokenizer.all_special_ids) | set(draft_tokenizer.all_special_ids)
    added = set(target_tokenizer.added_tokens_decoder) | set(draft_tokenizer.added_tokens_decoder)
    hard = [i for i in differ if i in special or i not in added]
    if hard:
        raise PairConfigError(
            f"The draft's vocabulary does not map onto the target's: {len(hard)} token ids differ "
            f"({describe_ids(hard, target_tokenizer, draft_tokenizer)}). The draft must use the target's tokenizer "
            "(the same token -> id mapping; extra padding rows in either embedding are fine)."
        )
    logger.warning(
        "The draft and target name %d added tokens differently (%s); lossless anyway, but drafts of those ids will be rejected.",
        len(differ),
        describe_ids(differ, target_tokenizer, draft_tokenizer),
    )


def check_tokenizer_fits(tokenizer, config: PreTrainedConfig, role: str) -> None:
    """Every id the tokenizer can produce needs a row in the model's embedding."""
    if len(tokenizer) > vocab_size(config):
        raise PairConfigError(
            f"The {role}'s vocab_size={vocab_size(config)} is smaller than its tokenizer ({len(tokenizer)} tokens): "
            "prompt ids past the embedding would fail. The tokenizer does not belong to this model."
        )


def check_vocabularies(target: PreTrainedConfig, draft: PreTrainedConfig, target_tokenizer=None, draft_tokenizer=None,
                       arguments: TokenizerArguments = FROM_MODELS) -> bool:
    """Whether the draft's token ids mean the target's (False), or the draft has a tokenizer of its own (True: it
    proposes through its branches' text, drafters/translated.py).

    With the target's tokenizer: the same token -> id mapping over the draft's vocabulary and the same special
    tokens mean a shared vocabulary; the embeddings may differ in size (padding rows, e.g. Qwen2.5 0.5B 151936 vs
    72B 152064). A missing draft tokenizer means the draft uses the target's. Another mapping means another
    vocabulary, which needs both tokenizers and a draft tokenizer that spells text (check_translatable). Without
    the target's tokenizer nothing says what its ids mean (the draft's tokenizer alone does not), so the sizes
    must be equal, the only evidence there is.
    """
    t_size, d_size = vocab_size(target), vocab_size(draft)
    if target_tokenizer is None:
        if t_size != d_size:
            known = "no tokenizer" if draft_tokenizer is None else "only the draft's tokenizer"
            raise PairConfigError(
                f"Vocabulary mismatch: target vocab_size={t_size}, draft vocab_size={d_size}, and with {known} the "
                f"token -> id mapping cannot be checked nor translated. Pass the target's tokenizer as {arguments.target} "
                f"(and a draft with another tokenizer its own as {arguments.draft}): a draft of the same tokenizer with "
                "padded embeddings is then checked token by token, a draft of another one proposes through text."
            )
        if draft_tokenizer is None:
            return False
    target_tokenizer = target_tokenizer or draft_tokenizer
    draft_tokenizer = draft_tokenizer or target_tokenizer
    check_tokenizer_fits(target_tokenizer, target, "target")
    check_tokenizer_fits(draft_tokenizer, draft, "draft")
    if draft_tokenizer is target_tokenizer or shares_vocabulary(target_tokenizer, draft_tokenizer, t_size):
        return False
    check_translatable(target_tokenizer, draft_tokenizer, arguments)
    logger.info("The draft's tokenizer is not the target's: it proposes through its branches' text.")
    return True


def shares_vocabulary(target_tokenizer, draft_tokenizer, target_vocab_size: int) -> bool:
    """Whether the draft's tokenizer is the target's in all that matters: the same special tokens with the same
    ids, the same token -> id mapping (added tokens named differently only warn, check_token_mapping)."""
    try:
        check_special_tokens(target_tokenizer, draft_tokenizer)
        check_token_mapping(target_tokenizer, draft_tokenizer, target_vocab_size)
    except PairConfigError:
        return False
    return True


PROBE_TEXT = "Hello, world! The 3 quick foxes."  # plain text every tokenizer of a language model spells


def check_translatable(target_tokenizer, draft_tokenizer, arguments: TokenizerArguments = FROM_MODELS) -> None:
    """A draft of another tokenizer proposes through text: its tokenizer must spell the target's text and read it
    back (encode, then decode, to the same text). PairConfigError naming what it made of it, and the fix."""
    text = target_tokenizer.decode(target_tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"],
                                   skip_special_tokens=True, clean_up_tokenization_spaces=False)
    try:
        ids = draft_tokenizer(text, add_special_tokens=False)["input_ids"]
        back = draft_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except Exception as error:  # a tokenizer that cannot decode at all names itself here
        back = f"an error: {error}"
    if back != text:
        raise PairConfigError(
            f"The draft's tokenizer is not the target's, and it cannot spell the target's text: {text!r} encodes and "
            f"decodes to {back!r} with the draft's tokenizer. A draft of another tokenizer proposes through text, so "
            "its tokenizer must read text back exactly (byte-level or byte-fallback tokenizers do). Pass the draft's "
            f"own tokenizer as {arguments.draft}, or pick a draft that shares the target's tokenizer."
        )


def check_compatibility(target: PreTrainedConfig, draft: PreTrainedConfig, target_tokenizer=None, draft_tokenizer=None,
                        architectures: bool = True, arguments: TokenizerArguments = FROM_MODELS) -> bool:
    """All load-time checks on the two configs (and tokenizers, when known); no weights needed. Returns whether
    the draft has a tokenizer of its own (check_vocabularies).

    architectures=False: the models are loaded and describe() has judged them already (by what they do,
    which also accepts decoders whose attention claims is_causal=False yet masks causally). arguments: how the
    caller takes the tokenizers, for its errors.
    """
    if architectures:
        check_architecture(target, "target")
        check_architecture(draft, "draft")
    check_context_lengths(target, draft)
    return check_vocabularies(target, draft, target_tokenizer, draft_tokenizer, arguments)
