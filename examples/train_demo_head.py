"""Train an EAGLE-3 head for the demo target, offline, on CPU, and bundle it as a pair of its own.

    python examples/train_demo_head.py                          # writes model_cards/swiftspec-demo-pystdlib-eagle3
    python examples/train_demo_head.py --steps 20 --out /tmp/smoke   # a quick smoke run

The head (one decoder layer, 192 wide, its own embeddings, the full 4096-token vocabulary) reads the
demo target's states at the inputs of its layers 1, 2 and 3 and learns the target's next-token
distribution on the same standard-library training files the pair was trained on
(hf_swiftspec/tools/eagle3_training.py: three levels of training-time test). It is written in the
speculators format under head/, and the pair folder names the demo pair's target beside it, so
`SwiftSpecForCausalLM.from_pretrained("swiftspec-demo-pystdlib-eagle3")` loads target + head with no
network. Held-out tau and speed are measured against the demo draft model on the same prompts.
The shipped head: `--threads 2`, 27 minutes on a shared 2-core CPU (600 steps drafted worse than the demo
draft model; 1800 about as well; 4000 better).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.drafters.eagle3 import save_eagle3_head
from hf_swiftspec.pair import DEMO_PAIR_NAME, PairCard
from hf_swiftspec.tools.eagle3_training import new_head_for, train_head

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import encode_corpus, heldout_prompts, is_heldout, measure_tau, read_sources, stdlib_files  # noqa: E402

HEAD_PAIR_NAME = f"{DEMO_PAIR_NAME}-eagle3"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "model_cards" / HEAD_PAIR_NAME
LAYER_IDS = (1, 2, 3)  # inputs of the target's layers 1-3 (of 4): the outputs of layers 0-2


def windows(tokens: torch.Tensor, length: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - length, (batch,), generator=g)
        yield torch.stack([tokens[s : s + length] for s in starts.tolist()])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tau-prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pair = SwiftSpecForCausalLM.from_pretrained(DEMO_PAIR_NAME)
    target, tokenizer = pair.target, pair.tokenizer
    files = stdlib_files()
    train_texts = read_sources([p for p in files if not is_heldout(p)])
    heldout_texts = read_sources([p for p in files if is_heldout(p)])
    tokens = encode_corpus(tokenizer, train_texts)
    print(f"{tokens.numel():,} training tokens; training {args.steps} steps", flush=True)
    head = new_head_for(target, hidden=192, intermediate=512, heads=3, layer_ids=LAYER_IDS)
    start = time.perf_counter()
    train_head(head, target, windows(tokens, args.window, args.batch, seed=0), args.steps, lr=args.lr,
               log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - start
    save_eagle3_head(head.to(torch.float16), args.out / "head", "speculators")
    params = sum(p.numel() for p in head.parameters())

    prompts = heldout_prompts(heldout_texts, args.tau_prompts)
    with_head = SwiftSpecForCausalLM.from_models(target, head.to(torch.float32), tokenizer=tokenizer,
                                                 tree_budget=pair.config.tree_budget, draft_width=pair.config.draft_width)
    tau_head = measure_tau(with_head, tokenizer, prompts, 96)
    tau_draft = measure_tau(pair, tokenizer, prompts, 96)
    lines = [
        f"EAGLE-3 head: {params:,} parameters, {args.steps} steps in {seconds / 60:.1f} min; held-out tau "
        f"{tau_head.tau:.2f} (identical {tau_head.identical}), speed-up {tau_head.speedup:.2f}x",
        f"demo draft model on the same prompts: tau {tau_draft.tau:.2f}, speed-up {tau_draft.speedup:.2f}x",
    ]
    print("\n".join(lines), flush=True)
    with_head.config.target = f"../{DEMO_PAIR_NAME}/target"
    with_head.config.draft = "head"
    with_head.pair_folder = args.out
    card = PairCard(
        title="SwiftSpec demo pair with an EAGLE-3 head (Python standard library)",
        summary=(
            f"The demo target of `{DEMO_PAIR_NAME}` with an EAGLE-3 head trained by examples/train_demo_head.py "
            "instead of a draft model: one decoder layer reading the target's hidden states, in the speculators format."
        ),
        license="apache-2.0",
        sections=(("Measured", "\n".join(f"- {line}" for line in lines) + f"\n- {args.tau_prompts} held-out prompts, 96 new "
                   f"tokens, greedy, one CPU thread (torch {torch.__version__})"),),
    )
    with_head.save_pretrained(args.out, card=card, pin_revisions=False, load_id=f"model_cards/{HEAD_PAIR_NAME}")
    print(f"wrote {args.out}")
    if not tau_head.identical:
        raise SystemExit("speculative output differed from target.generate")


if __name__ == "__main__":
    main()
