"""Time loading a pair against loading its members and one tokenizer, each in a fresh process.

    python examples/load_time.py [--shape gemma-3-270m] [--vocab-merges 0] [--repeats 3] [--dir DIR]

Writes a random-weight pair shaped like a real model (`--shape`, hf_swiftspec.tools.models.REAL_SHAPES;
the draft is the target's first 2 layers) into DIR: the target and the draft as safetensors folders,
each with the same tokenizer, and a pair repo over them (`swiftspec pair create`). The tokenizer is a
byte-level BPE with the shape's vocabulary size, built from random merges (the shapes' character
tokenizer would load in no time; a real 262k-vocabulary tokenizer takes seconds, and that is what the
pair must not pay three times). Then, each in a fresh Python process (import time excluded), the
median of `--repeats` runs of:

    members:   AutoModelForCausalLM.from_pretrained(target), (draft), AutoTokenizer.from_pretrained(target)
    pair:      SwiftSpecForCausalLM.from_pretrained(pair)
    pipeline:  pipeline("text-generation", model=pair)

and prints each with its ratio to `members` (issue 28's goal: a pair loads in at most 1.2x its members
plus one tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LOADS = {
    "members": (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "AutoModelForCausalLM.from_pretrained(r'{dir}/target'); AutoModelForCausalLM.from_pretrained(r'{dir}/draft')\n"
        "AutoTokenizer.from_pretrained(r'{dir}/target')\n"
    ),
    "pair": "from hf_swiftspec import SwiftSpecForCausalLM\nSwiftSpecForCausalLM.from_pretrained(r'{dir}/pair')\n",
    "pipeline": (
        "import hf_swiftspec\nfrom transformers import pipeline\n"
        "pipeline('text-generation', model=r'{dir}/pair')\n"
    ),
}
IMPORTS = "import time, torch\ntorch.set_num_threads(1)\nimport transformers, hf_swiftspec\n"


def random_bpe(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of `vocab_size` ids: 256 byte symbols, then merges of random pairs of
    existing tokens (each a new string), and the three specials the shapes' generation configs use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = list(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(alphabet))}
    tokens, merges = sorted(alphabet), []
    while len(vocab) < vocab_size:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a) + len(b) > 16 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def write_pair(folder: Path, shape: str) -> None:
    from hf_swiftspec.tools.models import real_shaped_pair

    target, draft = real_shaped_pair(shape)
    tokenizer = random_bpe(target.config.get_text_config().vocab_size)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    subprocess.run(
        ["swiftspec", "pair", "create", str(folder / "pair"), "--target", str(folder / "target"),
         "--draft", str(folder / "draft"), "--offline", "--force"],
        check=True,
    )


def timed_load(code: str) -> float:
    """Seconds the load takes in a fresh process (after its imports)."""
    script = IMPORTS + "start = time.perf_counter()\n" + code + "print(time.perf_counter() - start)\n"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma-3-270m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to write the pair (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="swiftspec-load-"))
    if not (folder / "pair").exists():
        write_pair(folder, args.shape)
    times = {}
    for _ in range(args.repeats):  # interleaved, so a slow moment of the machine is spread over all three
        for name, code in LOADS.items():
            times.setdefault(name, []).append(timed_load(code.format(dir=folder)))
    base = statistics.median(times["members"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:9s} median {median:6.2f} s  ({', '.join(f'{s:.2f}' for s in seconds)})  {median / base:.2f}x members")
    print(json.dumps({name: statistics.median(s) for name, s in times.items()}))


if __name__ == "__main__":
    main()
