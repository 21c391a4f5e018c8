"""results.md's table from the JSON files beside it (python examples/results/cpu-device-round-counts/table.py)."""
import json
import pathlib

HERE = pathlib.Path(__file__).parent
VERSIONS = [("before", "76580ea (before issues 60/61)"), ("unfused", "5ac74bf (unfused bookkeeping)"),
            ("now", "now (fused bookkeeping)")]
HEAD = """# What a device round costs a GPU, counted on a CPU

Demo pair, greedy, 48 new tokens, `tree_budget=8, draft_depth=3, draft_width=2`, suffix proposals on (ngram_size 3);
per round, the mean after the first round; keys: what the last round's attention calls read, beside the longest
live row's prefix. A fused operator (swiftspec_kernels: one Triton kernel on a GPU) counts as one. Command: command.txt.

| version | rows | phases | host reads | host-data tensors | operators | in the forwards | outside the forwards | keys read | longest prefix |
|---|---|---|---|---|---|---|---|---|---|
"""


def rows():
    for version, label in VERSIONS:
        for capture in ("", "-capture"):
            for n in (1, 4):
                path = HERE / f"{version}-rows{n}{capture}.json"
                if not path.exists():
                    continue
                d = json.loads(path.read_text())
                m, last = d["mean"], d["rounds"][-1]
                phases = "replayed (emulate)" if capture else "eager"
                yield (f"| {label} | {n} | {phases} | {m['reads']:.1f} | {m['host_tensors']:.1f} | {m['operators']:.1f} "
                       f"| {m['forwards']:.1f} | {m['outside']:.1f} | {max(last['keys'])} | {last['longest']} |")


if __name__ == "__main__":
    (HERE / "results.md").write_text(HEAD + "\n".join(rows()) + "\n")
