from hf_swiftspec.policy import DepthPolicy


def test_fixed_and_initial_depth():
    assert DepthPolicy(fixed=3).depth() == 3
    assert DepthPolicy(initial=5).depth() == 5


def test_depth_follows_the_step_time_ratio():
    policy = DepthPolicy()
    policy.observe(draft_seconds=0.004, expansions=2, target_seconds=0.011)  # 2 ms per expansion
    assert policy.depth() in (5, 6)  # floor(11 / 2) = 5, or +1 while the offset is explored


def test_keeps_the_offset_with_the_higher_goodput():
    policy = DepthPolicy(explore_every=4)
    policy.observe(0.002, 1, 0.010)  # floor(0.010 / 0.002) = 5
    chosen = []
    for _ in range(12):
        d = policy.depth()
        chosen.append(d)
        policy.observe_round(tokens=6 if d == 6 else 3, seconds=0.012)  # d + 1 verifies more per round
    assert chosen[:2] == [5, 6]  # both tried first
    assert chosen.count(6) == 8  # then the faster one, the other re-tried every 4th round
    assert 5 in chosen[2:]
