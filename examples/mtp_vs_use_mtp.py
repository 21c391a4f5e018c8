"""A model's own MTP layer: swiftspec's tree against transformers' own `generate(use_mtp=True)` chain, same
weights, side by side, on a tiny MTP model built in memory (random weights, so the layer is rarely right:
this measures what each way of drafting costs when it cannot pay, the case where never-slower matters).

    python examples/mtp_vs_use_mtp.py [--type deepseek_v3] [--new-tokens 32] [--repeats 5]

transformers loads MTP weights from the main model's checkpoint (MtpModel.from_pretrained); here both sides
get the same in-memory MtpModel (its from_pretrained is patched for the call). Every output is checked equal
to target.generate's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.models.compat import MtpModel
from hf_swiftspec.drafters.mtp import mtp_head
from hf_swiftspec.tools import sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="deepseek_v3")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = sweep.tiny_of_type(args.type, seed=0)
    mtp = MtpModel(target, 1).eval()
    with torch.no_grad():
        for tensor in mtp.layers.parameters():  # some types' experts come out of MtpModel's init uninitialised
            if not torch.isfinite(tensor).all() or tensor.abs().max() > 10:
                tensor.normal_(0, 0.02)
    head = mtp_head(target, mtp)
    models = {  # the same prompt every call: each call forgets earlier calls' outputs, which it could copy
        "swiftspec MTP tree": SwiftSpecForCausalLM.from_models(target, head, ngram_size=0),
        "swiftspec MTP + suffix": SwiftSpecForCausalLM.from_models(target, head),
    }
    prompt = torch.randint(3, target.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    times: dict[str, list[float]] = {"target.generate": [], "use_mtp (transformers)": [], **{name: [] for name in models}}
    with mock.patch.object(type(mtp), "from_pretrained", classmethod(lambda cls, main_model, **kw: mtp)):
        for _ in range(args.repeats + 1):  # the first call of each warms up
            start = time.perf_counter()
            expected = target.generate(prompt, **kwargs)
            times["target.generate"].append(time.perf_counter() - start)
            start = time.perf_counter()
            chained = target.generate(prompt, use_mtp=True, **kwargs)
            times["use_mtp (transformers)"].append(time.perf_counter() - start)
            assert torch.equal(chained, expected)
            for name, model in models.items():
                model.output_history.clear()
                start = time.perf_counter()
                tree = model.generate(prompt, swiftspec=True, **kwargs)
                times[name].append(time.perf_counter() - start)
                assert torch.equal(tree, expected)
    base = statistics.median(times["target.generate"][1:])
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"{name:24s} {args.new_tokens / median:7.1f} tokens/s  {base / median:.2f}x")
    for name, model in models.items():
        print(f"{name}: {model.swiftspec_stats.summary()}")


if __name__ == "__main__":
    main()
