"""Async vs serial tree speculation vs target alone, side by side, one CPU core per group.

    torchrun --nproc_per_node=2 examples/bench_async.py [--pair ID] [--prompts 6] [--max-new-tokens 128] [--round device]

Rank 0 holds the target group, rank 1 the draft group (torchrun gives each process one
thread). Per prompt, interleaved: target.generate on rank 0 with one thread and with two (rank 1
idle meanwhile); serial tree speculation on rank 0 (the draft on the target's core); asynchronous
tree speculation with the draft on rank 1; the same with serial_fallback=True (each call runs whichever of the
two measured faster, the serial one on rank 0). Greedy outputs must be identical or the run fails.
The pair is the bundled demo pair (prompts: the bundled HumanEval excerpt), or with
--pair agreeing, hf_swiftspec.tools.models.agreeing_pair on random prompts, or with --pair shape:NAME a
random-weight pair shaped like a real model (tools.models.REAL_SHAPES; its draft never agrees) on random prompts;
--pair agreeing:N takes the agreeing target with a draft of its first N layers (a draft that costs a share of a round).
--round device: the device round's engines (serial, and asynchronous across the two ranks:
engine/device_distributed.py), all with ngram_size=0; serial_fallback is the host round's, so its row is left out.
"""

import argparse
import dataclasses
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.bench import load_prompts
from hf_swiftspec.stats import OverlapBreakdown
from hf_swiftspec.tools.models import agreeing_pair, real_shaped_pair, truncated_draft


def pair_and_prompts(name: str, count: int, prompt_len: int):
    """(target, draft, prompts (1, L) each): the demo pair on HumanEval prompts, or the random agreeing pair."""
    if name == "agreeing" or name.startswith("agreeing:"):
        target, draft = agreeing_pair()
        if name != "agreeing":
            draft = truncated_draft(target, keep_layers=int(name.partition(":")[2]))
        gen = torch.Generator().manual_seed(0)
        return target, draft, [torch.randint(3, 4096, (1, prompt_len), generator=gen) for _ in range(count)]
    if name.startswith("shape:"):  # a random-weight pair in a real model's shape: its draft never agrees
        target, draft = real_shaped_pair(name.removeprefix("shape:"))
        gen, vocab = torch.Generator().manual_seed(0), target.config.vocab_size
        return target, draft, [torch.randint(3, vocab, (1, prompt_len), generator=gen) for _ in range(count)]
    pair = SwiftSpecForCausalLM.from_pretrained(name, dtype=torch.float32)
    texts = [prompt.text for prompt in load_prompts("humaneval", count)]
    return pair.target, pair.draft, [pair.tokenizer(t, return_tensors="pt").input_ids[:, -prompt_len:] for t in texts]


def mean_overlap(overlaps: list[OverlapBreakdown]) -> OverlapBreakdown:
    """The prompts' breakdowns averaged field by field (rounds summed)."""
    fields = {f.name: statistics.mean(getattr(o, f.name) for o in overlaps) for f in dataclasses.fields(OverlapBreakdown)}
    fields["rounds"], fields["message_bytes"] = sum(o.rounds for o in overlaps), overlaps[0].message_bytes
    return OverlapBreakdown(**fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib", help="pair id or folder, 'agreeing', or shape:NAME")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=96, help="prompt tokens kept (the last ones)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--round", choices=("host", "device"), default="host")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc_per_node=2")

    target, draft, prompts = pair_and_prompts(args.pair, args.prompts + 1, args.prompt_len)
    target.generation_config.eos_token_id = None  # every run generates exactly max_new_tokens
    settings = {"round": "device", "ngram_size": 0} if args.round == "device" else {}
    serial = SwiftSpecForCausalLM.from_models(target, draft, **settings)
    asynchronous = SwiftSpecForCausalLM.from_models(target, draft, placement={"target": [0], "draft": [1]}, **settings)
    fallback = SwiftSpecForCausalLM.from_models(target, draft, placement={"target": [0], "draft": [1]}, serial_fallback=True)
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens)

    def two_threads(p):
        torch.set_num_threads(2)
        try:
            return target.generate(p, **kwargs)
        finally:
            torch.set_num_threads(1)

    methods = {
        "target.generate": (lambda p: target.generate(p, **kwargs), False),
        "target.generate (2 threads)": (two_threads, False),
        "swiftspec serial (1 core)": (lambda p: serial.generate(p, **kwargs), False),
        "swiftspec async (2 processes)": (lambda p: asynchronous.generate(p, **kwargs), True),
        "swiftspec serial_fallback (2 processes)": (lambda p: fallback.generate(p, **kwargs), True),
    }
    host_async = None
    if args.round == "device":  # the host round's engine beside it, on the same settings
        del methods["swiftspec serial_fallback (2 processes)"]
        host_async = SwiftSpecForCausalLM.from_models(target, draft, placement={"target": [0], "draft": [1]},
                                                      ngram_size=0, round="host")
        methods["swiftspec async, host round (2 processes)"] = (lambda p: host_async.generate(p, **kwargs), True)
    engines = []  # the engine of each of serial_fallback's timed calls
    times = {name: [] for name in methods}
    taus = {name: [] for name in methods}
    verify_ms = {name: [] for name in methods}
    idle, overlaps = {name: [] for name in methods}, []
    for i, p in enumerate(prompts):
        outputs = {}
        for name, (fn, both_ranks) in methods.items():
            dist.barrier()
            if rank == 0 or both_ranks:
                start = time.perf_counter()
                outputs[name] = fn(p)
                if i and rank == 0:  # prompt 0 is the warm-up
                    times[name].append(time.perf_counter() - start)
                    model = {"swiftspec serial (1 core)": serial, "swiftspec async (2 processes)": asynchronous,
                             "swiftspec serial_fallback (2 processes)": fallback,
                             "swiftspec async, host round (2 processes)": host_async}.get(name)
                    if model is not None:
                        stats = model.swiftspec_stats
                        taus[name].append(stats.tau)
                        verify_ms[name].append(1e3 * stats.target_time_s / max(stats.verify_steps, 1))
                        if model is fallback:
                            engines.append(stats.engine)
                        if model is asynchronous or model is host_async:
                            idle[name].append(stats.target_idle_fraction)
                        if model is asynchronous:
                            overlaps.append(stats.overlap)
        if rank == 0 and any(o.tolist() != outputs["target.generate"].tolist() for o in outputs.values()):
            raise SystemExit("outputs differ from target.generate: the run is invalid")
    if rank == 0:
        base = statistics.mean(times["target.generate"])
        print(f"{args.prompts} prompts x {args.max_new_tokens} new tokens, greedy, one thread per process; outputs identical")
        print("| method | s/prompt (mean ± sd) | tok/s | speed-up vs target | tau | verify ms/round | target idle |")
        print("|---|---|---|---|---|---|---|")
        for name, ts in times.items():
            mean, sd = statistics.mean(ts), statistics.stdev(ts) if len(ts) > 1 else 0.0
            tau = f"{statistics.mean(taus[name]):.2f}" if taus[name] else "-"
            verify = f"{statistics.mean(verify_ms[name]):.1f}" if verify_ms[name] else "-"
            idle_s = f"{100 * statistics.mean(idle[name]):.0f}%" if idle[name] else "-"
            print(f"| {name} | {mean:.3f} ± {sd:.3f} | {args.max_new_tokens / mean:.1f} | {base / mean:.2f}x | {tau} | {verify} | {idle_s} |")
        serial_mean = statistics.mean(times["swiftspec serial (1 core)"])
        print(f"async / serial speed-up: {serial_mean / statistics.mean(times['swiftspec async (2 processes)']):.2f}x")
        if args.round == "host":
            print(f"serial_fallback / serial speed-up: "
                  f"{serial_mean / statistics.mean(times['swiftspec serial_fallback (2 processes)']):.2f}x"
                  f" (engines, in order: {', '.join(engines)})")
        print("async round, mean over prompts:", mean_overlap(overlaps).line())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
