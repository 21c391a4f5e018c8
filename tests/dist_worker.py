"""One rank of a multi-process test (launched by tests/test_distributed.py, env:// rendezvous).

Prints one JSON line per check to stdout, prefixed with RESULT.
"""

import argparse
import copy
import dataclasses
import json
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import SwiftSpecWorkerError
from hf_swiftspec.tools.models import tiny_model, truncated_draft

from fixed_costs import CostClock  # (this script's folder is on its path)


def report(**fields):
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **fields}), flush=True)


def prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 98, (1, L), generator=g) for L in [1, 4, 9, 23, 2, 15, 31, 6][:n]]


ROUND = {}  # --round device: every pair on the device round (its asynchronous engine across ranks), ngram_size=0


def pair(placement, draft_kind="agreeing", **settings):
    settings = {**ROUND, **settings}
    target = tiny_model("llama", seed=0)
    reference = copy.deepcopy(target)  # the target gets sharded in place
    draft = truncated_draft(target, 2) if draft_kind == "agreeing" else tiny_model("llama", seed=5, layers=1)
    model = SwiftSpecForCausalLM.from_models(target, draft, placement=placement, **settings)
    return model, reference


def greedy(placement, args):
    for kind in ("agreeing", "random"):
        # the agreeing draft on fixed trees: its first tree of each call is grown before it is sent (a catch-up)
        # whatever this machine's load, so its acceptance (tau) does not hang on the CPU the draft rank gets
        settings = dict(tree_budget=6, draft_depth=2) if kind == "agreeing" else {}
        if args.capture:
            settings = dict(settings, capture=True, draft_depth=2)
        model, reference = pair(placement, kind, worker_timeout_s=60, **settings)
        for p in prompts(args.prompts):
            out = model.generate(p, do_sample=False, max_new_tokens=30, repetition_penalty=1.1)
            expected = reference.generate(p, do_sample=False, max_new_tokens=30, repetition_penalty=1.1)
            s = model.swiftspec_stats
            report(case="greedy", kind=kind, same=out.tolist() == expected.tolist(), tau=s.tau, engine=s.engine,
                   in_flight=s.in_flight_expansions, idle=s.target_idle_fraction, verify_steps=s.verify_steps,
                   overlap=dataclasses.asdict(s.overlap), attention=s.attention, new_tokens=s.new_tokens,
                   rounds=[dataclasses.astuple(r) for r in s.rounds],
                   replays=sum(b.replays for g in model.captures.runners.values() for b in g.buckets.values()))


def fallback(placement, args):
    """serial_fallback=True across processes: the calls alternate engines (two each), then run the faster, here the
    serial round on the target's rank (the engine choice's clock is charged 1 s an asynchronous call and 0.5 s a
    serial one there: given costs, not this machine's); every rank returns the target's own tokens whichever ran."""
    import hf_swiftspec.engine.launch as launch

    clock = CostClock()  # (the engine choice's, on the target's rank)
    launch.run_distributed = clock.charging(launch.run_distributed, 1.0)
    launch.run_serial_distributed = clock.charging(launch.run_serial_distributed, 0.5)
    model, reference = pair(placement, serial_fallback=True, worker_timeout_s=60)
    model.policy().engines.clock = clock
    for p in prompts(args.prompts):
        out = model.generate(p, do_sample=False, max_new_tokens=30)
        expected = reference.generate(p, do_sample=False, max_new_tokens=30)
        s = model.swiftspec_stats
        report(case="fallback", same=out.tolist() == expected.tolist(), engine=s.engine, choice=s.engine_choice,
               tau=s.tau, new_tokens=s.new_tokens, draft_forwards=s.draft_forwards)


def sample(placement, args):
    """Chi-square of the first two sampled tokens against the target's exact joint distribution."""
    from test_sampling import VOCAB, exact_joint, pooled_chisquare, warpers

    target = tiny_model("llama", seed=3, vocab_size=VOCAB)
    target.generation_config.eos_token_id = None
    reference = copy.deepcopy(target)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), placement=placement, tree_budget=6,
                                             draft_width=3)
    prompt = torch.tensor([[3, 7, 5, 9]])
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for seed in range(args.draws):
        out = model.generate(prompt, do_sample=True, max_new_tokens=2, temperature=0.8, top_k=6,
                             generator=torch.Generator().manual_seed(seed))
        t1, t2 = out[0, -2:].tolist()
        counts[t1 * VOCAB + t2] += 1
    expected = exact_joint(reference, prompt, warpers(0.8, 6)).flatten() * args.draws
    report(case="sample", pvalue=float(pooled_chisquare(counts, expected)))


def eagle3(placement, args):
    """An EAGLE-3 head in the draft's process: greedy equals the target's own, and every hidden state the draft
    rank received (the prompt's, and each verdict's accepted path) is the target's at that position, as a plain
    causal forward of the whole sequence gives it (checked on the draft rank, which holds the target too)."""
    from test_eagle3 import VOCAB, random_head

    from hf_swiftspec.drafters.eagle3 import FeatureTap
    from hf_swiftspec.drafters.heads import HeadDrafter

    target = tiny_model("llama", seed=1, vocab_size=VOCAB)
    reference = copy.deepcopy(target)
    model = SwiftSpecForCausalLM.from_models(target, random_head(target), placement=placement, worker_timeout_s=60,
                                             serial_fallback=args.fallback)
    received = []  # (position of the first row, states (m, D)) as the draft rank got them
    start, reroot_row = HeadDrafter.start, HeadDrafter.reroot_row

    def recording_start(self, prompts, features=None):
        received.append((0, features[0].clone()))
        return start(self, prompts, features)

    def recording_reroot(self, b, subtree, verified):
        received.append((len(self.committed[b]) - len(verified.tokens) - 1, verified.features.clone()))
        return reroot_row(self, b, subtree, verified)

    HeadDrafter.start, HeadDrafter.reroot_row = recording_start, recording_reroot
    for p in prompts(args.prompts):
        received.clear()
        out = model.generate(p, do_sample=False, max_new_tokens=30)
        expected = reference.generate(p, do_sample=False, max_new_tokens=30)
        s = model.swiftspec_stats
        error = None
        if received:  # the draft rank: the target's states over the whole output, one plain forward
            with torch.no_grad(), FeatureTap(reference, model.draft.layer_ids) as tap:
                reference(out)
                states = tap.take()[0]
            error = max(float((got - states[first : first + len(got)]).abs().max()) for first, got in received)
        report(case="eagle3", same=out.tolist() == expected.tolist(), tau=s.tau, engine=s.engine, states_error=error,
               received=len(received), message_bytes=s.overlap and s.overlap.message_bytes, draft_forwards=s.draft_forwards)


def device(placement, args):
    """round='device' across two ranks (engine/device_distributed.py): greedy equal to target.generate's for an agreeing
    and a random draft, and sampling equal, draw by draw, to the serial device round's for the same seed (the target's
    tokens come from generate()'s noise by seed and position, whatever tree crossed); every rank returns them."""
    for kind in ("agreeing", "random"):
        # the agreeing draft at a fixed depth: every round a tree (its drafting choice would time rounds on this
        # machine's clock), so its tokens' acceptance does not hang on the load
        depth = dict(draft_depth=2) if kind == "agreeing" else {}
        model, reference = pair(placement, kind, worker_timeout_s=60, tree_budget=6, draft_width=3, **depth)
        for p in prompts(args.prompts):
            out = model.generate(p, do_sample=False, max_new_tokens=30)
            expected = reference.generate(p, do_sample=False, max_new_tokens=30)
            s = model.swiftspec_stats
            report(case="device", kind=kind, same=out.tolist() == expected.tolist(), engine=s.engine, tau=s.tau,
                   verify_steps=s.verify_steps, in_flight=s.in_flight_expansions, new_tokens=s.new_tokens,
                   rounds=len(s.rounds), message_bytes=s.overlap and s.overlap.message_bytes, choice=s.engine_choice)
    model, reference = pair(placement, "agreeing", worker_timeout_s=60, tree_budget=6, draft_width=3)
    serial = SwiftSpecForCausalLM.from_models(reference, truncated_draft(reference, 2), round="device", ngram_size=0,
                                              tree_budget=6, draft_width=3)
    for seed, p in enumerate(prompts(3)):
        kw = dict(do_sample=True, temperature=0.9, top_k=30, max_new_tokens=24)
        out = model.generate(p, generator=torch.Generator().manual_seed(seed), **kw)
        want = serial.generate(p, generator=torch.Generator().manual_seed(seed), **kw)
        report(case="device-sample", same=out.tolist() == want.tolist(), engine=model.swiftspec_stats.engine)


def device_suffix(placement, args):
    """round='device' across two ranks with suffix proposals (the draft rank's index, extended by the verdicts'
    tokens): the target's own continuation as the corpus makes them right, so a random draft's rounds verify several
    tokens; greedy equal to target.generate's on every rank."""
    for kind in ("agreeing", "random"):
        model, reference = pair(placement, kind, worker_timeout_s=60, tree_budget=6, draft_width=3, draft_depth=2,
                                ngram_size=3)
        for p in prompts(args.prompts):
            expected = reference.generate(p, do_sample=False, max_new_tokens=30)
            out = model.generate(p, do_sample=False, max_new_tokens=30, ngram_corpus=[expected[0].tolist()])
            s = model.swiftspec_stats
            report(case="device-suffix", kind=kind, same=out.tolist() == expected.tolist(), engine=s.engine,
                   tau=s.tau, misses=s.reroot_misses, ngram_share=s.ngram_share)


def fault(placement, args):
    serial = args.case.endswith("-serial")  # the failure in a serial call (serial_fallback), the draft ranks following
    model, _ = pair(placement, worker_timeout_s=args.timeout, serial_fallback=serial or None)
    engines = []  # the engine of each call on this rank
    if serial and dist.get_rank() in model.placement.target:  # as if the serial round had measured faster
        choice = model.policy().engines
        choice.calls, choice.rates = {"async": 2, "serial": 2}, {"async": 1.0, "serial": 2.0}
    import hf_swiftspec.engine.launch as launch

    for name in ("run_distributed", "run_serial_distributed", "run_device_async_distributed"):
        def recorded(*a, _real=getattr(launch, name), _name=name, **k):
            engines.append(_name)
            return _real(*a, **k)
        setattr(launch, name, recorded)
    args.case = args.case.removesuffix("-serial")
    victim = model.draft if args.case.endswith("draft") else model.target
    role = "draft" if args.case.endswith("draft") else "target"
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1
        if calls["n"] == 4:
            if args.case == "kill-draft":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure in the {role}")

    if dist.get_rank() in getattr(model.placement, role):
        victim.register_forward_hook(hook)
    try:
        model.generate(prompts(4)[3], do_sample=False, max_new_tokens=40)
        report(case=args.case, raised=None)
    except SwiftSpecWorkerError as error:
        report(case=args.case, raised=str(error), engines=engines)
    try:
        model.generate(prompts(2)[1], do_sample=False, max_new_tokens=5)
        report(case=args.case + "-again", raised=None)
    except SwiftSpecWorkerError as error:
        report(case=args.case + "-again", raised=str(error))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--target", default="0,1")
    parser.add_argument("--draft", default="2")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=5)
    parser.add_argument("--draws", type=int, default=1500)
    parser.add_argument("--capture", action="store_true", help="capture=True: each rank replays its steps")
    parser.add_argument("--fallback", action="store_true", help="serial_fallback=True (the eagle3 case)")
    parser.add_argument("--round", default=None, help="device: every pair on round='device' with ngram_size=0")
    args = parser.parse_args()
    if args.round:
        ROUND.update(round=args.round, ngram_size=0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    placement = {"target": [int(r) for r in args.target.split(",")], "draft": [int(r) for r in args.draft.split(",")]}
    {"greedy": greedy, "sample": sample, "eagle3": eagle3, "fallback": fallback, "device": device,
     "device-suffix": device_suffix}.get(args.case, fault)(placement, args)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: after a fault a peer may be gone


if __name__ == "__main__":
    main()
