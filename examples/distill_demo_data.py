"""Write the data `swiftspec distill` trains the demo target's draft on (examples/results/cpu-distill-demo/).

    python examples/distill_demo_data.py /tmp/demo-data

Three .jsonl files of {"text": ...} records, from the running interpreter's standard library as
examples/train_demo_pair.py split it (the same held-out files by a hash of their path):
train.jsonl (every training file), heldout.jsonl (every held-out file) and prompts.jsonl (the
beginning of a function from each of the first 24 held-out files: the prompts the demo pair's card
measured tau on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import heldout_prompts, is_heldout, read_sources, stdlib_files  # noqa: E402

PROMPTS = 24


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts if t.strip()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args(argv).folder
    folder.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    train = read_sources([p for p in files if not is_heldout(p)])
    heldout = read_sources([p for p in files if is_heldout(p)])
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "heldout.jsonl", heldout)
    write_jsonl(folder / "prompts.jsonl", heldout_prompts(heldout, PROMPTS))
    print(f"{len(train)} training files, {len(heldout)} held-out files, {PROMPTS} prompts in {folder}")


if __name__ == "__main__":
    main()
