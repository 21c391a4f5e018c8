"""What attending grouped-query heads in place saves a tree forward on a CPU (steps/attention.py's sdpa-grouped).

    python examples/grouped_attention.py --model DIR [--keys 300,800] [--nodes 1,3,8] [--repeats 12]

transformers' sdpa attends a model whose query heads share key / value heads (grouped-query attention) with
enable_gqa only without a mask; a forward of several queries with a mask (a tree's verification, a prefill) repeats
every shared head once per query head first. For each (keys, nodes) this times one forward of `nodes` tree queries
(a chain: each sees the committed keys and the nodes before it) over `keys` committed keys, through transformers' own
sdpa and through sdpa-grouped, interleaved on one torch thread, and checks that their logits are bitwise equal.
Prints the median of the repeats (the first two dropped) for each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_swiftspec.steps.attention import GROUPED, routed_attention


def tree_forward(model, keys: list[tuple[torch.Tensor, torch.Tensor]], tokens: torch.Tensor) -> torch.Tensor:
    """The forward of tokens (1, T) after the committed `keys` (per layer (1, Hkv, L, D) keys and values), node j
    seeing the committed keys and nodes 0..j (an additive 4D mask, as a tree's verification passes one)."""
    L, T = keys[0][0].shape[2], tokens.shape[1]
    mask = torch.full((1, 1, T, L + T), torch.finfo(torch.float32).min)
    mask[..., :L] = 0
    mask[..., L:] = torch.where(torch.tril(torch.ones(T, T, dtype=torch.bool)), 0.0, torch.finfo(torch.float32).min)
    cache = DynamicCache()
    for i, (k, v) in enumerate(keys):
        cache.update(k, v, i)
    return model(tokens, position_ids=torch.arange(L, L + T)[None], attention_mask=mask, cache=cache,
                 use_cache=True).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a causal LM folder whose query heads share key / value heads")
    parser.add_argument("--keys", default="300,800")
    parser.add_argument("--nodes", default="1,3,8")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # One model for both (routed for the grouped forwards): a copy of its weights at other addresses can round a
    # one-query forward's matrix-vector products differently, which would hide what the attention does.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = model.config
    print(f"{args.model}: {config.num_attention_heads} query heads, {config.num_key_value_heads} key / value heads, "
          f"{config.num_hidden_layers} layers, torch {torch.__version__}")
    generator = torch.Generator().manual_seed(0)
    for L in (int(k) for k in args.keys.split(",")):
        with torch.no_grad():
            out = model(torch.randint(10, 1000, (1, L), generator=generator), use_cache=True)
        keys = [(layer.keys.clone(), layer.values.clone()) for layer in out.cache.layers]
        for T in (int(n) for n in args.nodes.split(",")):
            tokens = torch.randint(10, 1000, (1, T), generator=generator)
            times, logits = {"sdpa": [], GROUPED: []}, {}
            with torch.no_grad():
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    logits["sdpa"] = tree_forward(model, keys, tokens)
                    times["sdpa"].append(time.perf_counter() - start)
                    with routed_attention(model, GROUPED):
                        start = time.perf_counter()
                        logits[GROUPED] = tree_forward(model, keys, tokens)
                        times[GROUPED].append(time.perf_counter() - start)
            own, mine = (1000 * statistics.median(times[k][2:]) for k in ("sdpa", GROUPED))
            print(f"{L} keys, {T} nodes: sdpa {own:.2f} ms, {GROUPED} {mine:.2f} ms ({own / mine:.3f}x); logits "
                  f"{'bitwise equal' if torch.equal(logits['sdpa'], logits[GROUPED]) else 'DIFFER'}")


if __name__ == "__main__":
    main()
