"""Time a speculative round outside the two models' forwards, on the bundled demo pair, phase by phase.

    python examples/round_overhead.py [--pair ID] [--max-new-tokens 128] [--repeats 3] [--keep-history]

Two kinds of round, each on its own copy of the pair: the default rounds (the goodput policy chooses; on the
demo pair the suffix index drafts most of them) and draft-model rounds (tree_budget=8, draft_depth=3: the
draft model grows its tree every round). Forward time is measured by hooks on both models (one torch thread);
everything else in the decode loop (tree bookkeeping, the walk, commits, the policy) is the round's overhead,
printed per round and as a fraction of the mean target verification forward. Then the call's own breakdown
(`SwiftSpecStats.phases`: expand, catch-up, select, verify, walk, commit, policy, bookkeeping and other, ms per
round) and, by phase, what is left of it outside the forwards: verify less the target's verification forwards,
expand + catch-up less the draft's forwards (the draft runs nowhere else). The round runs its steps eagerly here
(capture=False): a replayed step runs no module hooks.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_swiftspec import SwiftSpecForCausalLM

ROUNDS = {  # the kinds of round timed: each one's SwiftSpecConfig settings
    "default rounds": {},
    "draft-model rounds (tree_budget=8, draft_depth=3)": {"tree_budget": 8, "draft_depth": 3},
}


def timed_forwards(model, times: dict, key: str):
    """Append the wall time of every forward of `model` to times[key] (seconds, in call order)."""
    state = {}

    def before(*args):
        state["t"] = time.perf_counter()

    def after(*args):
        times.setdefault(key, []).append(time.perf_counter() - state["t"])

    return [model.register_forward_pre_hook(before), model.register_forward_hook(after)]


def load_pair(pair: str, settings: dict) -> SwiftSpecForCausalLM:
    if pair.startswith("shape:"):  # a random-weight pair in a real model's shape (hf_swiftspec.tools.models)
        from hf_swiftspec.tools.models import char_tokenizer, real_shaped_pair

        model = SwiftSpecForCausalLM.from_models(*real_shaped_pair(pair.removeprefix("shape:")),
                                                 tokenizer=char_tokenizer(), **settings)
        model.generation_config.eos_token_id = None  # random text: run to max_new_tokens
    else:
        model = SwiftSpecForCausalLM.from_pretrained(pair, dtype=torch.float32, **settings)
    model.config.capture = False  # hooks time the forwards: eager steps
    return model


def timed_call(model, ids, max_new_tokens: int, keep_history: bool) -> dict:
    """One greedy call with both models' forwards timed: {"target": [...], "draft": [...]} seconds each."""
    times: dict = {}
    if not keep_history:
        model.output_history.clear()
    hooks = timed_forwards(model.target, times, "target")
    if model.draft is not None:
        hooks += timed_forwards(model.draft, times, "draft")
    try:
        model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    return times


def report(stats, times: dict) -> None:
    """The overhead line, then the call's breakdown, then each phase less the forwards it ran (ms per round)."""
    target, draft = times["target"], times.get("draft", [])
    rounds = max(stats.verify_steps, 1)
    verify_forward = sum(target) / len(target)  # prefill included: a slight overestimate
    overhead = (stats.wall_time_s - sum(target) - sum(draft)) / rounds
    print(
        f"  {stats.new_tokens} tokens, {rounds} rounds, tau {stats.tau:.2f}: target forward {1000 * verify_forward:.2f} ms, "
        f"draft {len(draft) / rounds:.1f} forwards/round, overhead {1000 * overhead:.2f} ms/round "
        f"= {100 * overhead / verify_forward:.0f}% of a verification forward"
    )
    phases = stats.phases
    print(f"  {phases.line()}")
    ms = phases.ms_per_round()
    per_round = lambda seconds: 1000 * seconds / max(phases.rounds, 1)  # noqa: E731
    verify_host = ms["verify"] - per_round(sum(target[1:]))  # the first target forward is the prefill, before the rounds
    draft_host = ms["expand"] + ms["catch_up"] - per_round(sum(draft))
    rest = " + ".join(f"{p.replace('_', '-')} {ms[p]:.2f}" for p in ("select", "walk", "commit", "policy", "bookkeeping", "other"))
    print(f"  outside the forwards (ms per round): verify {verify_host:.2f} + expand and catch-up {draft_host:.2f} + {rest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="def read_config(path):\n")
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib", help="pair id or folder, or shape:NAME")
    parser.add_argument("--keep-history", action="store_true",
                        help="let each call copy the earlier calls' outputs (by default each call starts without them: "
                        "every call decodes the same prompt, so the suffix proposals would copy the whole answer and "
                        "a call would be a handful of rounds, its fixed costs counted per round)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, settings in ROUNDS.items():
        model = load_pair(args.pair, settings)
        ids = model.tokenizer(args.prompt, return_tensors="pt").input_ids
        model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)  # warm-up
        print(f"{name}:")
        for _ in range(args.repeats):
            times = timed_call(model, ids, args.max_new_tokens, args.keep_history)
            report(model.swiftspec_stats, times)


if __name__ == "__main__":
    main()
