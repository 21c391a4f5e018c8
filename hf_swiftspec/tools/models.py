"""Tiny models and a character tokenizer for tests, examples and benchmarks; no download needed.

Random weights with a sharpened output head behave like small real LMs for speculation: peaked
next-token distributions, and a draft cut from the target's own layers agrees with it often.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

ARCH_KWARGS = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
}


def tiny_config(model_type: str = "llama", vocab_size: int = 98, layers: int = 3, hidden: int = 64, **overrides):
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(ARCH_KWARGS[model_type])
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", seed: int = 0, attn: str = "sdpa", sharpness: float = 4.0, **overrides):
    """A randomly initialised causal LM in eval mode, float32, with a plain generation config."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    sharpen(model, sharpness)
    return model


def sharpen(model, scale: float = 4.0) -> None:
    """Scale the output head so random models have peaked next-token distributions (like real LMs)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)


def truncated_draft(target, keep_layers: int = 1):
    """A draft made of the target's own embedding, first layers, final norm and head (an early exit): agrees often.

    It is no longer the model in the target's folder, so it names no folder (a pair saves its weights with
    save_pretrained(save_members=True)); it shares the target's tokenizer."""
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:keep_layers]
    draft.config.num_hidden_layers = keep_layers
    draft.name_or_path = draft.config._name_or_path = ""  # not the target folder's model: it names none
    if getattr(draft.config, "layer_types", None) is not None:
        draft.config.layer_types = draft.config.layer_types[:keep_layers]
    return draft


CHAR_SPECIALS = ["<pad>", "<s>", "</s>"]


def char_tokenizer():
    """A character-level fast tokenizer over printable ASCII: 3 specials + 95 characters = 98 ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, L), attention_mask (B, L)) of token lists, left-padded with `pad`, as a
    decoder-only batch is given to generate()."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    return ids, mask


def random_prompts(lengths, seed: int = 0, vocab_size: int = 98, low: int = 3) -> list[list[int]]:
    """Random token lists of the given lengths (ids from `low`, clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]


def tiny_gpt2(vocab_size: int = 98, n_positions: int = 512, seed: int = 1, sharpness: float = 10.0):
    """A 3-layer GPT-2 (learned absolute positions, no rotary, a fused QKV projection: a family apart from
    llama's), random weights with a sharpened head, eval mode, float32."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "gpt2", vocab_size=vocab_size, n_embd=64, n_layer=3, n_head=4, n_positions=n_positions, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    sharpen(model, sharpness)
    return model


def damp_late_layers(model, keep: int = 1, scale: float = 0.2) -> None:
    """Shrink what layers after the first `keep` add to the residual stream.

    A draft cut from the first `keep` layers then agrees with the target often but not always,
    as a small model of the same family does with a large one.
    """
    with torch.no_grad():
        for layer in model.model.layers[keep:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def agreeing_pair(layers: int = 12, hidden: int = 768, vocab_size: int = 4096, damp: float = 0.02,
                  sharpness: float = 20.0, seed: int = 0):
    """(target, draft) for benchmarks: a random Llama whose layers after the first are damped, and
    a draft of its first layer and head. With the defaults (70M + 12M parameters) the draft picks
    the target's greedy token about 78% of the time and the target's top token carries ~0.7 of
    the probability, roughly like a small and a large model of one family.
    """
    target = tiny_model(
        "llama", seed=seed, layers=layers, hidden=hidden, vocab_size=vocab_size, sharpness=sharpness,
        max_position_embeddings=4096,
    )
    damp_late_layers(target, keep=1, scale=damp)
    return target, truncated_draft(target, keep_layers=1)


# Configs shaped like real small models (layers, widths, heads, vocabulary, windows), for measuring
# speed where a real model is out of reach: built with random weights, no download. The larger
# initialisation makes greedy text wander instead of repeating one token, so neither the n-gram
# chain nor a draft cut from the first layers predicts it: the case where speculation must cost nothing.
REAL_SHAPES = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=8192,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=32768, sliding_window=None,
    ),
    "gemma-3-270m": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
        rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        # Untied (the real one ties): with random weights a tied head echoes the input token, so greedy
        # text repeats; an untied head costs the same per token.
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    ),
}
SHAPE_PREFIX = "shape:"


def shaped_model(shape: dict, seed: int = 0, initializer_range: float = 0.05, device=None, dtype=None):
    """A random-weight causal LM from a shape in REAL_SHAPES' format (model_type plus config fields),
    sdpa attention, eval mode; built on `device` (default: torch's, the CPU) in `dtype` (default float32),
    so a large shape never passes through CPU memory on its way to a GPU."""
    kwargs = dict(shape)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=initializer_range, **kwargs
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device or torch.get_default_device()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model


def real_shaped_pair(name: str, draft_layers: int = 2, seed: int = 0, initializer_range: float = 0.05):
    """(target, draft) shaped like the real model `name` (a REAL_SHAPES key), random weights, float32,
    eval mode; the draft is the target's embedding, first `draft_layers` layers and head."""
    if name not in REAL_SHAPES:
        raise ValueError(f"Unknown model shape {name!r}; choose from {sorted(REAL_SHAPES)}.")
    target = shaped_model(REAL_SHAPES[name], seed, initializer_range)
    return target, truncated_draft(target, keep_layers=draft_layers)


# A text whose words never repeat within a cycle: each word has one successor, so a model of it is predictable
# whichever tokenizer spells it (two_tokenizer_pair).
CYCLE_TEXT = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
              "quebec romeo sierra tango uniform victor whiskey xray yankee zulu ")


def bpe_tokenizer(vocab_size: int, style: str = "bytes", corpus: tuple[str, ...] = (CYCLE_TEXT,)):
    """A BPE tokenizer trained on `corpus` (a few ms), as a transformers fast tokenizer with <pad> <s> </s> first.

    Three ways to spell one text: "bytes", byte-level as GPT-2's (a space starts the word after it: "Ġgolf");
    "pieces", SentencePiece-like ("▁" before every word; printable ASCII, and bytes for anything else);
    "trailing", a space ends the word before it ("golf "), so its word boundaries fall one character off the
    others' (bytes for anything else too).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(CHAR_SPECIALS)
    if style == "bytes":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend = Tokenizer(models.BPE(byte_fallback=True))
        if style == "pieces":
            backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
            backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                                 decoders.Strip(" ", 1, 0)])  # as Llama's tokenizer.json decodes
            alphabet = [chr(c) for c in range(33, 127)] + ["▁"]
        else:
            backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^ ]+ ?| "), behavior="isolated")
            backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
            alphabet = [chr(c) for c in range(32, 127)]
        specials += [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    backend.train_from_iterator(list(corpus) * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


def text_model(tokenizer, text: str = CYCLE_TEXT, seed: int = 0, layers: int = 2, hidden: int = 128,
               scale: float = 12.0, damp: float = 0.3):
    """A tiny Llama over `tokenizer`'s vocabulary that continues `text` (cyclically) from its last token: its head
    maps each token's embedding to the token that follows it in `text` as this tokenizer spells it; its layers, damped,
    still attend (so trees and caches must be right for its tokens to come out right). Two of them over two tokenizers
    of one text predict one another's text: a draft that is a copy of the target's behaviour in other tokens."""
    ids = tokenizer(text * 3, add_special_tokens=False)["input_ids"]
    successor: dict[int, dict[int, int]] = {}
    for a, b in zip(ids, ids[1:]):
        successor.setdefault(a, {}).setdefault(b, 0)
        successor[a][b] += 1
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), layers=layers, hidden=hidden, sharpness=1.0)
    with torch.no_grad():
        embed = torch.nn.functional.normalize(torch.randn(len(tokenizer), hidden), dim=-1)
        head = torch.zeros(len(tokenizer), hidden)
        for a, following in successor.items():
            head[max(following, key=following.get)] += embed[a]
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(head * scale / hidden**0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
