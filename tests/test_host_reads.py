"""Host reads of the adaptive round (engine/rounds.py over engine/adaptive.py; round="host", while the asynchronous
engine drives it: the device round's are tests/test_device_counts.py's), counted per round as
tests/sync_counter.py counts them: the walk's read is the round's one read; a draft model (or an EAGLE-3
head) adds one per expansion, the candidates the goodput policy prices its next expansion by. Whatever
drafts the round, one row or four, one call's batch or the continuous engine's running batch.

Each round is counted alone (the prefill and generate()'s own argument handling are not a round's), and
every output is checked against target.generate: a read saved must not cost a token.
"""

from __future__ import annotations

import pytest
import torch

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.engine import rounds
from hf_swiftspec.pair import DEMO_PAIR_NAME, bundled_pair
from sync_counter import SyncCounter

DEMO = bundled_pair(DEMO_PAIR_NAME)
EAGLE = bundled_pair(DEMO_PAIR_NAME + "-eagle3")
PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "class Stack:\n    def __init__(self):\n",
    "x = [i for i in range(10)]\n",
]
NEW = 32
FIXED_TREE = dict(tree_budget=8, draft_depth=3)  # the draft model expands every round

pytestmark = pytest.mark.skipif(DEMO is None, reason="model_cards/swiftspec-demo-pystdlib is missing")


class RoundReads:
    """Patches rounds.one_round to count each round's reads alone: (reads, draft expansions, rows) per round,
    on whichever thread runs the round (the continuous engine's own)."""

    def __init__(self, monkeypatch):
        self.rounds: list[tuple[int, int, int]] = []
        self.sites = SyncCounter(sites=True).sites
        counted = rounds.one_round

        def one_round(sides, rows):
            expansions, live = sides.draft.counters.expansions, len(rows.live)
            with SyncCounter(sites=True) as counter:
                keep = counted(sides, rows)
            self.rounds.append((counter.total, sides.draft.counters.expansions - expansions, live))
            self.sites.update(counter.sites)
            return keep

        monkeypatch.setattr(rounds, "one_round", one_round)

    def over(self, ceiling) -> list[tuple[int, int, int]]:
        """The rounds that read more than ceiling(expansions)."""
        return [r for r in self.rounds if r[0] > ceiling(r[1])]

    def summary(self) -> str:
        reads = sum(r[0] for r in self.rounds)
        return f"{reads} reads over {len(self.rounds)} rounds; by site: {self.sites.most_common()}"


def load(folder, **settings) -> SwiftSpecForCausalLM:
    return SwiftSpecForCausalLM.from_pretrained(folder, dtype=torch.float32, round="host", **settings)


def counted_call(monkeypatch, model, ids, **kwargs) -> RoundReads:
    """One warm call's rounds counted (the first call measures the policy's costs); its output checked."""
    kwargs = dict(max_new_tokens=NEW, do_sample=False, **kwargs)
    model.generate(ids, **kwargs)
    model.output_history.clear()
    reads = RoundReads(monkeypatch)
    out = model.generate(ids, **kwargs)
    assert out.tolist() == model.target.generate(ids, **kwargs).tolist()
    assert reads.rounds
    return reads


def one_prompt(model) -> torch.Tensor:
    return model.tokenizer(PROMPTS[0], return_tensors="pt").input_ids


def left_padded(model) -> dict:
    tokenizer = model.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (encoded.attention_mask == 0).any()  # the prompts' lengths differ: some rows are padded
    return dict(ids=encoded.input_ids, attention_mask=encoded.attention_mask)


def walk_only(expansions: int) -> int:
    return 1


def walk_and_expansions(expansions: int) -> int:
    return 1 + expansions


def test_default_settings_read_once_a_round(monkeypatch):
    """The demo pair as shipped (the suffix index drafts most rounds, the draft model some): one read a round,
    the walk's, also in rounds the draft model expanded in before (its candidates come with each expansion's)."""
    model = load(DEMO)
    reads = counted_call(monkeypatch, model, one_prompt(model))
    assert not reads.over(walk_only if not any(r[1] for r in reads.rounds) else walk_and_expansions), reads.summary()
    assert all(r[0] <= 1 for r in reads.rounds if r[1] == 0), reads.summary()


@pytest.mark.parametrize("pair", ["draft model", "eagle3 head"])
def test_a_draft_every_round_reads_once_an_expansion_and_once_for_the_walk(monkeypatch, pair):
    folder = DEMO if pair == "draft model" else EAGLE
    if folder is None:
        pytest.skip("model_cards/swiftspec-demo-pystdlib-eagle3 is missing")
    model = load(folder, **FIXED_TREE)
    reads = counted_call(monkeypatch, model, one_prompt(model))
    assert sum(r[1] for r in reads.rounds) >= len(reads.rounds)  # the draft did expand every round
    assert not reads.over(walk_and_expansions), reads.summary()


@pytest.mark.parametrize("settings", [{}, FIXED_TREE], ids=["default", "draft every round"])
def test_a_left_padded_batch_of_four_reads_once_a_round_not_once_a_row(monkeypatch, settings):
    model = load(DEMO, **settings)
    batch = left_padded(model)
    reads = counted_call(monkeypatch, model, batch["ids"], attention_mask=batch["attention_mask"])
    assert max(r[2] for r in reads.rounds) == 4
    assert not reads.over(walk_and_expansions), reads.summary()
    assert all(r[0] <= 1 for r in reads.rounds if r[1] == 0), reads.summary()


def test_the_running_batch_reads_once_a_round(monkeypatch):
    """The continuous engine's rounds (rows joining between them, test_continuous.py's relay) read as a
    generate() call's do: the walk's read for every row at once, and one per expansion."""
    from test_continuous import assert_greedy_answers, run_relay

    model = load(DEMO)
    prompts = [model.tokenizer(p).input_ids for p in PROMPTS[:3]]
    news = (30, 16, 20)
    engine = model.continuous_engine()
    try:
        run_relay(model, engine, prompts, news, at=(2, 2, 1), do_sample=False)  # warm: the policy's costs
        reads = RoundReads(monkeypatch)
        out = run_relay(model, engine, prompts, news, at=(2, 2, 1), do_sample=False)
    finally:
        engine.close()
    assert_greedy_answers(model, out, prompts, news)
    assert max(r[2] for r in reads.rounds) >= 2  # rows did decode together
    assert not reads.over(walk_and_expansions), reads.summary()
    assert all(r[0] <= 1 for r in reads.rounds if r[1] == 0), reads.summary()


@pytest.mark.parametrize("seed", range(4))
def test_the_hosts_view_decides_as_the_device_does(seed):
    """On random trees (scores with ties, re-rooted again and again), every choice the host makes from its
    view (leaves, the verified subtree below any root, the re-root's facts, kept nodes and slots, the tree a
    re-root leaves) equals the device's own answer, read from the tensors of a twin with no view."""
    import copy

    from hf_swiftspec.steps import tree as T

    g = torch.Generator().manual_seed(seed)
    tree = T.new_tree(5, 96, "cpu")
    for step in range(14):
        T.read_views([tree])
        twin = copy.deepcopy(tree)
        twin.view = None
        for width, within, depth in ((2, 8, None), (3, None, 3), (4, 16, 2)):
            assert T.select_leaves(tree, width, within, depth).tolist() == T.select_leaves(twin, width, within, depth).tolist()
        for budget, root in ((8, 0), (5, 0), (6, min(3, tree.size - 1))):
            assert T.select_subtree(tree, budget, root) == T.select_subtree(twin, budget, root)
        nodes = list(range(tree.size))
        path = [0] + [n for n in nodes[1:3] if tree.view.parents[n] == 0][:1]
        token = int(torch.randint(0, 6, (1,), generator=g))
        assert T.path_facts(tree, path, token) == T.path_facts(twin, path, token)
        leaves = T.select_leaves(tree, 3, 12)
        if step % 4 == 3 and tree.size > 1:  # a re-root under a node that has run (or the root's child)
            root = int(torch.randint(1, tree.size, (1,), generator=g))
            assert T.kept_nodes(tree, root).tolist() == T.kept_nodes(twin, root).tolist()
            assert T.reroot(tree, root) == T.reroot(twin, root).tolist()
            T.read_views([twin])
            assert tree.view == twin.view
            continue
        if not leaves.shape[0] or not T.room_for_expansion(tree, leaves.shape[0], 3):
            break
        T.expansion_inputs(tree, leaves, 10)
        logprobs = -torch.randint(1, 4, (leaves.shape[0], 3), generator=g).float() / 2  # ties, often
        T.add_children(tree, leaves, logprobs, torch.randint(0, 6, (leaves.shape[0], 3), generator=g))
        assert tree.view is None


def test_a_recurrent_target_reads_no_more_for_its_replayed_tokens(monkeypatch):
    """A hybrid target (Gated DeltaNet beside attention) rolls its states back after a partial acceptance and
    replays the accepted tokens: which tokens those are is known on the host, not read back."""
    from hf_swiftspec.tools import sweep
    from test_recurrent import qwen35_shaped

    target = qwen35_shaped(seed=1)
    model = SwiftSpecForCausalLM.from_models(target, sweep.perturbed_copy(target, 0.05), tree_budget=5, draft_depth=4,
                                             round="host")
    prompt = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    reads = RoundReads(monkeypatch)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert out.tolist() == sweep.own_generate(target, prompt, 16).tolist()
    assert model.swiftspec_stats.replayed_tokens > 0
    assert not reads.over(walk_and_expansions), reads.summary()
