"""The threads placement with and without serial_fallback, against the serial round, on the demo pair.

    python examples/engine_choice.py [--prompts 13] [--max-new-tokens 64] [--round host|device] [--pair demo|agreeing:N]

Two threads on the CPU (one torch thread): the asynchronous engine alone, the same placement with
serial_fallback=True (choice.py: it times both engines and keeps the faster), and the serial round, each on the
same HumanEval prompts in turn; the first prompt is untimed. Every output must equal target.generate's.
--round device: the device round's engines (engine/device_async.py and its serial round), with ngram_size=0 (the
asynchronous device engine proposes no suffix nodes). --pair agreeing:N: tools.models.agreeing_pair's 12-layer
target with a draft of its first N layers and the character tokenizer (a draft that costs a share of a round).
"""

import argparse
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts


def load_pair(name: str):
    """(target, draft, tokenizer) for --pair."""
    if name == "demo":
        pair = SwiftSpecForCausalLM.from_pretrained("swiftspec-demo-pystdlib", dtype=torch.float32)
        return pair.target, pair.draft, pair.tokenizer
    from hf_swiftspec.tools.models import agreeing_pair, char_tokenizer, truncated_draft

    layers = name.partition(":")[2]
    if not name.startswith("agreeing:") or not layers.isdigit() or not 1 <= int(layers) <= 11:
        raise SystemExit(f"--pair {name!r}: use demo or agreeing:N with N from 1 to 11")
    target, _ = agreeing_pair()
    return target, truncated_draft(target, keep_layers=int(layers)), char_tokenizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--round", choices=("host", "device"), default="host")
    parser.add_argument("--pair", default="demo", help="demo (the bundled demo pair) or agreeing:N")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft, tokenizer = load_pair(args.pair)
    target.generation_config.eos_token_id = None  # every call makes max_new_tokens
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids[:, -96:] for p in load_prompts("humaneval", args.prompts)]
    threads = {"target": ["cpu"], "draft": ["cpu"]}
    settings = {"round": args.round, **({"ngram_size": 0} if args.round == "device" else {})}
    models = {
        "serial round": SwiftSpecForCausalLM.from_models(target, draft, **settings),
        "threads, asynchronous only": SwiftSpecForCausalLM.from_models(target, draft, placement=threads, **settings),
        "threads, serial_fallback": SwiftSpecForCausalLM.from_models(target, draft, placement=threads,
                                                                     serial_fallback=True, **settings),
    }
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    seconds, engines = dict.fromkeys(models, 0.0), []
    for i, prompt in enumerate(prompts):
        expected = target.generate(prompt, **kwargs).tolist()
        for name, model in models.items():
            start = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            if i:
                seconds[name] += time.perf_counter() - start
            if out.tolist() != expected:
                raise SystemExit(f"{name}: output differs from target.generate: the run is invalid")
        engines.append(models["threads, serial_fallback"].swiftspec_stats.engine)
    tokens = (len(prompts) - 1) * args.max_new_tokens
    for name, s in seconds.items():
        print(f"{name}: {tokens / s:.1f} tok/s ({seconds['serial round'] / s:.2f}x the serial round)")
    print("serial_fallback's engine per call:", engines)
    print("its last choice:", models["threads, serial_fallback"].swiftspec_stats.engine_choice)


if __name__ == "__main__":
    main()
