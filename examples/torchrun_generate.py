"""Place a target/draft pair on N processes (GPUs or CPU) and generate asynchronously.

    torchrun --nproc_per_node=3 examples/torchrun_generate.py                 # ranks 0,1 target (TP=2), 2 draft
    torchrun --nproc_per_node=4 examples/torchrun_generate.py --draft-ranks 2,3
    torchrun --nproc_per_node=2 examples/torchrun_generate.py --pair path/to/pair

NCCL when GPUs are present (one per rank), gloo on CPU. Without --pair a small pair is built in
memory (hf_swiftspec.tools.models.agreeing_pair), so it runs offline. Every rank calls generate();
rank 0 prints the completion and the statistics.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import agreeing_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", help="pair folder or Hub id (default: a pair built in memory)")
    parser.add_argument("--draft-ranks", default=None, help="comma-separated ranks of the draft group (default: the last)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=60.0, help="SwiftSpecConfig.worker_timeout_s")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=max(60, 2 * args.timeout)))
    world, rank = dist.get_world_size(), dist.get_rank()
    draft_ranks = [int(r) for r in args.draft_ranks.split(",")] if args.draft_ranks else [world - 1]
    placement = {"target": [r for r in range(world) if r not in draft_ranks], "draft": draft_ranks}

    if args.pair:
        model = SwiftSpecForCausalLM.from_pretrained(args.pair, placement=placement, worker_timeout_s=args.timeout)
    else:
        target, draft = agreeing_pair(layers=8, hidden=512, vocab_size=2048)
        model = SwiftSpecForCausalLM.from_models(target, draft, placement=placement, worker_timeout_s=args.timeout)

    prompt = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    if rank == 0:
        print(f"placement: {placement} ({backend})")
        print("new tokens:", out[0, prompt.shape[1] :].tolist())
        print(model.swiftspec_stats.summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
