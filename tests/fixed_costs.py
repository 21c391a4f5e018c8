"""Fixed prices for a test, so what it checks does not follow this machine's load: step prices for a pair's goodput
policy (given_costs), and a clock that calls are charged on (CostClock, for the engine and loop choices)."""

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


class CostClock:
    """A clock that moves only by the costs a test charges it: calls timed by it last what the test says they do."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charging(self, run, seconds: float):
        """`run`, each call of which first moves this clock by `seconds`."""
        def run_and_charge(*args, **kwargs):
            self.now += seconds
            return run(*args, **kwargs)
        return run_and_charge
