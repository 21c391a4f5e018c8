"""Fixed step prices for a pair's goodput policy, so a test's trees do not follow this machine's load."""

from hf_swiftspec.policy.costs import CostModel
from hf_swiftspec.policy.goodput import BatchSize


def given_costs(model, expand_s: float, verify_s: dict[int, float], batches=(1,)):
    """Price the pair's policy at each of `batches` (rows decoding together): `expand_s` seconds an expansion,
    `verify_s` {tree size: seconds} a verification; rounds' measurements leave these alone (CostModel.given)."""
    policy = model.policy()
    for batch in batches:
        costs = CostModel(batch=batch, expand_s=expand_s, verify_s=dict(verify_s), given=True)
        policy.batches[batch] = BatchSize(costs, probe_interval=policy.probe_every)
    return policy
