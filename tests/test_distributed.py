"""The asynchronous engine across processes: gloo on CPU, tensor-parallel groups, faults."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *args: str, timeout: float = 240):
    """Start `world` ranks of dist_worker.py; returns (results by rank, return codes, seconds)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), *args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    start = time.monotonic()
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {procs.index(p)} hung past {timeout}s: {p.communicate()[0][-3000:]}")
        outputs.append(out)
        codes.append(p.returncode)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    return results, codes, outputs


@pytest.mark.parametrize("target, draft", [("0,1", "2"), ("0,1", "2,3")], ids=["tp2+1", "tp2+tp2"])
def test_greedy_across_processes_equals_target(target, draft):
    world = len(target.split(",")) + len(draft.split(","))
    results, codes, outputs = launch(world, "--case", "greedy", "--target", target, "--draft", draft, "--prompts", "5")
    assert codes == [0] * world, outputs
    mine = [r for r in results if r["rank"] == 0]
    assert len(mine) == 10 and all(r["same"] for r in mine), mine
    assert all(r["engine"] == "async-distributed" for r in mine)
    # The agreeing draft's tokens are accepted across processes. How many depends on how much CPU the draft rank
    # gets while the target verifies (its tree grows then), so the check is only that some were: on fixed trees, each
    # call's first tree is grown before it is sent, whatever the load.
    agreeing = [r["tau"] for r in mine if r["kind"] == "agreeing"]
    assert sum(agreeing) / len(agreeing) > 1.0, agreeing
    # every rank, draft ranks included, returned the same tokens as the target leader
    assert all(r["same"] for r in results), [r for r in results if not r["same"]]
    # the round's breakdown came back from the draft's process: its rounds are the target's verifications,
    # its draft phases were timed over there, and one round sends a subtree and a verdict of 2 + 2 * T int32 each
    # (T: the largest tree, 32, or the agreeing draft's fixed 6)
    for r in mine:
        overlap, budget = r["overlap"], 6 if r["kind"] == "agreeing" else 32
        assert overlap["rounds"] == r["verify_steps"] and overlap["message_bytes"] == 2 * (2 + 2 * budget) * 4, r
        assert overlap["verify"] > 0 and overlap["select"] > 0 and overlap["grow"] + overlap["wait"] > 0, overlap
        # and the draft's per-round records: one a verification, each with what it accepted (fields as RoundRecord)
        rounds = r["rounds"]
        assert len(rounds) == r["verify_steps"] and sum(a for _, _, a, _, _ in rounds) + len(rounds) == r["new_tokens"], r


def test_replayed_steps_in_each_process_equal_target():
    """capture=True across processes: each rank replays its own steps (this CPU's stand-in for CUDA graphs; draft_depth=2,
    so the draft expands every round whether it pays or not)."""
    results, codes, outputs = launch(2, "--case", "greedy", "--target", "0", "--draft", "1", "--prompts", "3",
                                     "--capture")
    assert codes == [0, 0], outputs
    assert len(results) == 12 and all(r["same"] for r in results), results
    mine = {r["rank"]: r for r in results}
    assert "target=sdpa-grouped (replayed, emulate" in mine[0]["attention"] and mine[0]["replays"] > 5, mine[0]
    assert "draft=sdpa-grouped (replayed, emulate" in mine[1]["attention"] and mine[1]["replays"] > 5, mine[1]


def test_an_eagle3_head_drafts_in_its_own_process():
    """The target's hidden states cross process groups with each verdict: greedy equals the target's own, and
    every state the draft rank received is the target's at its position (within float32 rounding)."""
    results, codes, outputs = launch(2, "--case", "eagle3", "--target", "0", "--draft", "1", "--prompts", "4")
    assert codes == [0, 0], outputs
    target_side = [r for r in results if r["rank"] == 0]
    draft_side = [r for r in results if r["rank"] == 1]
    assert len(target_side) == len(draft_side) == 4 and all(r["same"] for r in results), results
    assert all(r["engine"] == "async-distributed" for r in results)
    assert all(r["received"] > 1 and r["states_error"] < 1e-4 for r in draft_side), draft_side
    # a round sends its two 528-byte messages and the accepted path's states (at least the root's: 3 x 64 floats)
    assert all(r["message_bytes"] >= 528 + 3 * 64 * 4 for r in target_side), target_side


def test_an_eagle3_head_drafts_serial_calls_on_the_target_rank():
    """serial_fallback=True with a head: its serial calls run the head on the target's rank, fed by the target's own
    states there (whether it then drafts is the policy's call); every call, of either engine, equals the target's own
    on both ranks."""
    results, codes, outputs = launch(2, "--case", "eagle3", "--target", "0", "--draft", "1", "--prompts", "4",
                                     "--fallback")
    assert codes == [0, 0], outputs
    target_side = [r for r in results if r["rank"] == 0]
    assert len(results) == 8 and all(r["same"] for r in results), results
    assert [r["engine"] for r in target_side] == ["async-distributed", "serial"] * 2, target_side
    # the head started on the target's rank, from the target's own states there (checked as on the draft rank)
    serial = [r for r in target_side if r["engine"] == "serial"]
    assert all(r["received"] >= 1 and r["states_error"] < 1e-4 for r in serial), serial


@pytest.mark.parametrize("case", ["fault-draft", "fault-target", "kill-draft"])
def test_worker_failures_surface_on_every_live_rank(case):
    results, codes, outputs = launch(3, "--case", case, "--target", "0,1", "--draft", "2", "--timeout", "5")
    live = [0, 1] if case == "kill-draft" else [0, 1, 2]
    first = {r["rank"]: r for r in results if r["case"] == case}
    again = {r["rank"]: r for r in results if r["case"] == case + "-again"}
    for rank in live:
        assert first[rank]["raised"] and first[rank]["engines"] == ["run_distributed"], (rank, outputs[rank][-2000:])
        # (that it raised at all is the bound: a rank that hung would have failed launch()'s guard)
        assert "restart the torchrun job" in (again[rank]["raised"] or "").lower(), again
    role = "draft" if case.endswith("draft") else "target"
    assert role in first[0]["raised"]


def test_serial_fallback_across_processes_runs_the_faster_engine_exactly():
    """serial_fallback=True under torchrun: two calls of each engine alternately, then the faster (the serial round on
    the target's rank: its engine choice's clock is charged twice as much for an asynchronous call); the draft rank follows the serial calls'
    tokens, so both ranks return target.generate's tokens on every call, and both say which engine ran."""
    results, codes, outputs = launch(2, "--case", "fallback", "--target", "0", "--draft", "1", "--prompts", "6")
    assert codes == [0, 0], outputs
    by_rank = {rank: [r for r in results if r["rank"] == rank] for rank in (0, 1)}
    assert all(len(rows) == 6 for rows in by_rank.values()) and all(r["same"] for r in results), results
    engines = [r["engine"] for r in by_rank[0]]
    assert engines == ["async-distributed", "serial"] * 2 + ["serial"] * 2, engines
    assert [r["engine"] for r in by_rank[1]] == engines  # the draft rank ran what the target's rank chose
    assert "measured" in by_rank[0][-1]["choice"] and "target's rank chose" in by_rank[1][-1]["choice"]
    assert [r["new_tokens"] for r in by_rank[1]] == [r["new_tokens"] for r in by_rank[0]]
    serial = [r for r in by_rank[0] if r["engine"] == "serial"]
    assert sum(r["draft_forwards"] for r in serial) > 0, serial  # the draft model ran there (while the policy let it)


def test_a_target_failure_in_a_serial_call_surfaces_on_the_draft_rank():
    """A serial call (serial_fallback) that fails on the target's rank raises on the draft rank too, which was only
    following its tokens, and both refuse the next call."""
    results, codes, outputs = launch(2, "--case", "fault-target-serial", "--target", "0", "--draft", "1", "--timeout", "5")
    first = {r["rank"]: r for r in results if r["case"] == "fault-target"}
    again = {r["rank"]: r for r in results if r["case"] == "fault-target-again"}
    for rank in (0, 1):
        assert first[rank]["raised"], (rank, outputs[rank][-2000:])
        assert "restart the torchrun job" in (again[rank]["raised"] or "").lower(), again
    assert "injected failure in the target" in first[1]["raised"], first[1]
    assert first[0]["engines"] == first[1]["engines"] == ["run_serial_distributed"], first


def test_sampling_across_processes_follows_the_target_distribution():
    """Same chi-square test as tests/test_sampling.py (fails at p < 1e-3: false alarm rate 0.1%)."""
    results, codes, outputs = launch(2, "--case", "sample", "--target", "0", "--draft", "1", "--draws", "1500")
    assert codes == [0, 0], outputs
    pvalue = next(r["pvalue"] for r in results if r["rank"] == 0)
    assert pvalue > 1e-3, f"p={pvalue:.2e}: samples do not follow the target's distribution"


def test_the_device_round_across_two_ranks_equals_target_and_the_serial_device_round():
    """round='device' under torchrun, one target rank and one draft rank (engine/device_distributed.py: the device
    engine's two loops, one message type each way): greedy equals target.generate's for an agreeing and a random
    draft, sampling equals the serial device round's draw by draw for each seed, and both ranks return the tokens."""
    results, codes, outputs = launch(2, "--case", "device", "--target", "0", "--draft", "1", "--prompts", "4",
                                     "--round", "device")
    assert codes == [0, 0], outputs
    assert len(results) == 2 * (8 + 3) and all(r["same"] for r in results), [r for r in results if not r["same"]]
    assert all(r["engine"] == "async-distributed-device" for r in results)
    mine = [r for r in results if r["rank"] == 0 and r["case"] == "device"]
    # one round crosses a subtree and a verdict of one size: 3 + 6T + T^2 int32, or a run of up to 64 plain steps
    assert all(r["message_bytes"] == 2 * max(3 + 6 * 6 + 36, 6 + 6 + 64) * 4 and r["rounds"] == r["verify_steps"] for r in mine), mine
    agreeing = [r["tau"] for r in mine if r["kind"] == "agreeing"]
    assert sum(agreeing) / len(agreeing) > 1.0, agreeing  # the draft's tokens were accepted across processes
    assert sum(r["in_flight"] for r in mine) > 0  # and it grew its tree while the target verified


def test_suffix_proposals_cross_ranks_on_the_device_round():
    """The draft rank's suffix proposals (its index extended by each verdict's tokens) merged into its tree: with the
    target's continuation as the corpus even a random draft's rounds verify several tokens, and every rank returns
    target.generate's tokens."""
    results, codes, outputs = launch(2, "--case", "device-suffix", "--target", "0", "--draft", "1", "--prompts", "2",
                                     "--round", "device")
    assert codes == [0, 0], outputs
    assert len(results) == 2 * 4 and all(r["same"] for r in results), [r for r in results if not r["same"]]
    assert all(r["engine"] == "async-distributed-device" for r in results)
    mine = [r for r in results if r["rank"] == 0]
    assert all(r["tau"] > 2.0 for r in mine), mine
    assert all(r["ngram_share"] > 0.8 for r in mine if r["kind"] == "random"), mine  # (the draft rank's counts)


@pytest.mark.parametrize("case", ["fault-draft", "fault-target", "kill-draft"])
def test_device_round_worker_failures_surface_on_every_live_rank(case):
    results, codes, outputs = launch(2, "--case", case, "--target", "0", "--draft", "1", "--timeout", "5",
                                     "--round", "device")
    live = [0] if case == "kill-draft" else [0, 1]
    first = {r["rank"]: r for r in results if r["case"] == case}
    again = {r["rank"]: r for r in results if r["case"] == case + "-again"}
    for rank in live:
        assert first[rank]["raised"] and first[rank]["engines"] == ["run_device_async_distributed"], (
            rank, outputs[rank][-2000:])
        assert "restart the torchrun job" in (again[rank]["raised"] or "").lower(), again
    assert ("draft" if case.endswith("draft") else "target") in first[0]["raised"]


def test_the_device_round_across_ranks_refuses_tensor_parallel_groups_by_name():
    """What the torchrun device engine cannot run is named (on every rank alike: the reasons read only the placement
    and the call), with round='host' as the fix."""
    from hf_swiftspec.engine.device_distributed import distributed_gaps
    from hf_swiftspec.engine.distributed import Groups

    cpu = torch.device("cpu")
    assert distributed_gaps(Groups(0, [0], [1], cpu)) == []
    (gap,) = distributed_gaps(Groups(0, [0, 1], [2], cpu))
    assert "one target rank and one draft rank" in gap and "has 2 and 1" in gap and "round='host'" in gap
