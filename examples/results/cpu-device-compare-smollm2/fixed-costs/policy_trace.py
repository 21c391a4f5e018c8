"""Per-round tree sizes of the smollm2-135m-shaped pair at B=1 on humaneval prompts, under fixed costs (so the
policy's decisions follow acceptance alone, not this machine's load). Run under two checkouts and compare."""
import sys, json, torch
sys.path.insert(0, sys.argv[1] + "/tests")
torch.set_num_threads(1)
from fixed_costs import given_costs
from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.tools.models import real_shaped_pair, char_tokenizer
from hf_swiftspec.bench.prompts import load_prompts
target, draft = real_shaped_pair("smollm2-135m")
tok = char_tokenizer()
model = SwiftSpecForCausalLM.from_models(target, draft)
given_costs(model, expand_s=0.004, verify_s={1: 0.012, 2: 0.013, 4: 0.014, 8: 0.016, 16: 0.02, 32: 0.028})
out = {}
ps = load_prompts("humaneval", 3)
for i, p in enumerate(ps):
    text = p.text
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids[:200]])
    model.generate(ids, swiftspec=True, max_new_tokens=32, do_sample=False)
    st = model.swiftspec_stats
    out[i] = [(r.budget, r.expansions, r.accepted) for r in st.rounds]
print(json.dumps(out))
