"""round="device" with a draft head (drafters/device_heads.py): the bundled demo EAGLE-3 head and a model's own MTP
layer grow their tree on the device every round from the target's states, and the head's cache follows the verified
tokens with the target's states (its catch-up inside the verification graph): greedy output is target.generate's
token for token (float32; one sequence and a left-padded batch, EOS and max_new_tokens, eager and replayed), at most
one host read a round; the tree each round grows scores as plain causal forwards of the head over the sequence so
far (the head's bookkeeping is EAGLE's, not just harmless), also after a stop string cut a walk; children are
target ids below the vocab limit; a seed draws its own draws (tests/gumbel_reference.py); an MTP layer whose
attention takes no 4D mask is refused by name."""

import pytest
import torch
from test_device_sides import reads_per_round
from test_eagle3 import random_head
from test_mtp import with_mtp

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.drafters.device_heads import DeviceHead, grow_head, head_catch_up
from hf_swiftspec.engine.device_sides import DeviceSides
from hf_swiftspec.pair import DEMO_PAIR_NAME, bundled_pair
from hf_swiftspec.steps.slot_cache import SlotCache
from hf_swiftspec.tools.models import left_padded, tiny_model

EAGLE = bundled_pair(DEMO_PAIR_NAME + "-eagle3")
DEVICE = dict(round="device", ngram_size=0)
FIXED = dict(draft_depth=3, draft_width=2, tree_budget=6)  # one shape: the head drafts every round
WHOLE_TREE = dict(draft_depth=2, draft_width=2, tree_budget=5)  # every grown node is verified (and recorded)
PROMPTS = ["def read_config(path):\n", "import os\nimport sys\n\n\ndef main(argv=None):\n",
           "class Stack:\n    def __init__(self):\n", "x = [i for i in range(10)]\n"]
MTP_ROWS = [[5, 17, 33, 8, 5, 17, 40], [40, 9, 12], [7], [7, 7, 7, 7, 30, 2, 61, 9, 44]]

needs_eagle = pytest.mark.skipif(EAGLE is None, reason="model_cards/swiftspec-demo-pystdlib-eagle3 is missing")


@pytest.fixture(scope="module")
def eagle():
    """The demo pair with its bundled EAGLE-3 head (float32), on the host round; tests set round="device"."""
    if EAGLE is None:
        pytest.skip("model_cards/swiftspec-demo-pystdlib-eagle3 is missing")
    pair = SwiftSpecForCausalLM.from_pretrained(EAGLE, dtype=torch.float32)
    pair.target.generation_config.eos_token_id = None  # each test names the EOS it stops at
    return pair


@pytest.fixture(scope="module")
def mtp():
    """A tiny DeepSeek-V3 target and its MTP layer 0, whose attention is sharpened (MtpModel's init leaves it too
    faint for a position or a slot seen wrongly to move the tree's scores past the tests' tolerance)."""
    target, head = with_mtp("deepseek_v3")
    target.generation_config.eos_token_id = None
    attention = head.layer.mtp_block.self_attn
    with torch.no_grad():
        for linear in (attention.q_b_proj, attention.kv_b_proj, attention.o_proj):
            linear.weight.mul_(8.0)
    return target, head


def on_device(target, head, **settings) -> SwiftSpecForCausalLM:
    return SwiftSpecForCausalLM.from_models(target, head, **DEVICE, **settings)


def inputs(which, eagle, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids, attention_mask): one prompt, or a left-padded batch of four (a prompt of one token among the MTP's)."""
    if which == "mtp":
        return (torch.tensor(MTP_ROWS[:1]), None) if rows == 1 else left_padded(MTP_ROWS)
    encoded = [eagle.tokenizer(p).input_ids for p in PROMPTS[:rows]]
    return (torch.tensor(encoded), None) if rows == 1 else left_padded(encoded, pad=eagle.tokenizer.pad_token_id or 0)


def pair_of(which, eagle, mtp):
    return (eagle.target, eagle.draft) if which == "eagle3" else mtp


@pytest.mark.parametrize("which", ["eagle3", "mtp"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
def test_greedy_equals_target_generate_with_the_head_drafting_every_round_reading_once(
        request, which, rows, capture, monkeypatch):
    """Token for token target.generate's output (EOS and max_new_tokens as generate applies them, left padding), the
    head growing depth x width every round, at most one host read a round. Replayed (capture=True, the emulating
    stand-in): a root, prefix or root input the growth or the catch-up took from the first round instead of its
    inputs decodes other tokens, or (the head's own inputs) drafts other trees: each round accepts what the eager
    phases' round accepts."""
    eagle = request.getfixturevalue("eagle") if which == "eagle3" else None
    target, head = pair_of(which, eagle, request.getfixturevalue("mtp") if which == "mtp" else None)
    ids, mask = inputs(which, eagle, rows)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=28)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=28, eos_token_id=int(free[0, ids.shape[1] + 13]))
    expected = target.generate(ids, **kwargs)
    pair = on_device(target, head, capture=capture, **FIXED)
    reads = reads_per_round(monkeypatch)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1 and len(reads) == len(stats.rounds)
    assert stats.draft_forwards == len(stats.rounds) * (FIXED["draft_depth"] + 1) + 1  # growth, catch-up; prefill
    if capture:  # the same rounds as the eager phases', each accepting as many tokens
        assert "replayed phases, emulate" in stats.attention and "eager:" not in stats.attention
        eager = on_device(target, head, **FIXED)
        eager.generate(ids, **kwargs)
        rounds = [(r.rows, r.accepted) for r in stats.rounds]
        assert rounds == [(r.rows, r.accepted) for r in eager.swiftspec_stats.rounds]
    if which == "eagle3":  # a trained head: most rounds accept drafted nodes
        assert stats.new_tokens > 2 * sum(r.rows for r in stats.rounds), (stats.new_tokens, len(stats.rounds))


@torch.no_grad()
def sequence_states(target, head, tokens: list[int]) -> torch.Tensor:
    """The head's fused target states at every token of `tokens` (L, H), from a plain forward of the target."""
    with head.tap(target) as tap:
        target(torch.tensor([tokens]))
        return head.fuse(tap.take()[0])


@torch.no_grad()
def causal_head(head, tokens: list[int], inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain causal forward of the head: tokens[j] at position j with hidden input inputs[j] (no cache, no tree).
    Returns the last query's log-probs over the draft vocabulary (V_draft,) and its hidden output (H,)."""
    L = len(tokens)
    causal = torch.full((L, L), torch.finfo(head.dtype).min).triu(1)[None, None]
    out = head(input_ids=torch.tensor([tokens]), position_ids=torch.arange(L)[None], hidden_inputs=inputs[None],
               attention_mask=causal)
    return torch.log_softmax(out.logits[0, -1].float(), -1), out.hidden[0, -1]


@torch.no_grad()
def reference_tree(target, head, sequence: list[int], width: int) -> list[tuple[int, int, float]]:
    """Depth 2 of `width` below the last token of `sequence` (the root), as EAGLE grows it from plain causal
    forwards: (parent depth-1 token or -1, token, score) of each node, depth 1 first, each depth by score."""
    fused = sequence_states(target, head, sequence)
    tokens, inputs = sequence[1:], fused[:-1]  # token j runs with the state of token j - 1 (the head's shift)
    logprobs, hidden = causal_head(head, tokens, inputs)
    best, ids = logprobs.topk(width)
    first = [(-1, int(head.target_ids(i)), float(s)) for s, i in zip(best, ids)]
    below = []
    for _, child, score in first:
        child_logprobs, _ = causal_head(head, tokens + [child], torch.cat([inputs, hidden[None]]))
        ids = head.target_ids(torch.arange(child_logprobs.shape[0])).tolist()
        below += [(child, ids[i], score + float(v)) for i, v in enumerate(child_logprobs)]
    return first + sorted(below, key=lambda n: -n[2])[:width]


@pytest.mark.parametrize("which", ["eagle3", "mtp"])
def test_every_rounds_tree_scores_as_plain_causal_forwards_of_the_head(request, which, monkeypatch):
    """Each round's grown tree (depth 2, width 2, all of it verified) for every row of a left-padded batch, against
    the head run as a plain causal sequence over the row's tokens so far (each with the target's states at the token
    before it) and its own output below the root: the head's prefill, its catch-up on each round's verified chain
    (the tree's KV dropped), its positions (the target's minus one), slot 0 left out and the root input all as
    EAGLE's, not merely harmless to the output."""
    eagle = request.getfixturevalue("eagle") if which == "eagle3" else None
    target, head = pair_of(which, eagle, request.getfixturevalue("mtp") if which == "mtp" else None)
    ids, mask = inputs(which, eagle, 4)
    grown, propose = [], DeviceSides.propose

    def recording(self, rows):
        proposed = propose(self, rows)
        sub = proposed.subtree
        for b, seq in enumerate(h.sequence for h in self.host[: self.live]):
            length = int(self.slots.rows.prefix_lens[b]) + 1  # the row's tokens without its padding: prefix and root
            nodes = [(int(sub.tokens[b, p]) if p > 0 else -1, int(sub.tokens[b, i]), float(sub.scores[b, i]))
                     for i, p in enumerate(sub.parents[b].tolist()) if p >= 0]
            grown.append((seq[-length:], nodes))
        return proposed

    monkeypatch.setattr(DeviceSides, "propose", recording)
    pair = on_device(target, head, **WHOLE_TREE)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    checked = 0
    for sequence, nodes in grown:
        if len(sequence) < 2:  # a prompt of one token: its first root has no state before it (zeros), nothing to match
            continue
        want = reference_tree(target, head, sequence, WHOLE_TREE["draft_width"])
        got = sorted(nodes[:2], key=lambda n: -n[2]) + sorted(nodes[2:], key=lambda n: -n[2])
        assert [n[:2] for n in got] == [n[:2] for n in want], (sequence, got, want)
        torch.testing.assert_close(torch.tensor([n[2] for n in got]), torch.tensor([n[2] for n in want]),
                                   atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 4 * 4  # every row's tree in several rounds


@needs_eagle
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "replayed"])
def test_sampling_draws_what_the_seed_draws(eagle, capture):
    """Under one seed, each row's sampled tokens are the seed's draws (tests/gumbel_reference.py: the target's own loop
    with the Gumbel-max rule, noise keyed by seed, row and position: the target's distribution, test_sampling.py),
    and not greedy's."""
    from gumbel_reference import seeded_draws

    ids, mask = inputs("eagle3", eagle, 4)
    kwargs = dict(attention_mask=mask, max_new_tokens=20)
    device = on_device(eagle.target, eagle.draft, capture=capture, **FIXED)
    drawn = device.generate(ids, do_sample=True, generator=torch.Generator().manual_seed(7), temperature=0.9,
                            top_k=20, **kwargs)
    expected = seeded_draws(eagle.target, ids, torch.Generator().manual_seed(7), temperature=0.9, top_k=20, **kwargs)
    assert drawn.tolist() == expected.tolist()
    assert device.swiftspec_stats.engine == "device"
    assert drawn.tolist() != device.generate(ids, do_sample=False, **kwargs).tolist()


@needs_eagle
def test_a_stop_string_cut_moves_the_heads_root_input_back(eagle, monkeypatch):
    """Stop strings cut rows' walks on the host after the round's read and the rows decode on from the cut (no EOS
    id, until every row's has appeared): each next round's root input must be the target's fused state at the token
    before the new root, the last one kept, not the walk's last (what the verification phase computed)."""
    target, head = eagle.target, eagle.draft
    ids, mask = inputs("eagle3", eagle, 4)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40)[:, ids.shape[1]:]
    stops = [eagle.tokenizer.decode(free[b, at: at + 2]) for b, at in enumerate((3, 17, 6, 9))]
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, stop_strings=stops,
                  tokenizer=eagle.tokenizer)
    grown, cuts, propose, accept = [], [], DeviceSides.propose, DeviceSides.accept

    def recording(self, rows):
        roots = self.slots.rows.drafter["root_inputs"].clone()
        for b, seq in enumerate(h.sequence for h in self.host[: self.live]):
            grown.append((seq[-(int(self.slots.rows.prefix_lens[b]) + 1):], roots[b]))
        return propose(self, rows)

    def counting(self, proposed, verified, keep):
        cuts.append(sum(c > 0 for c in proposed.cut))
        return accept(self, proposed, verified, keep)

    monkeypatch.setattr(DeviceSides, "propose", recording)
    monkeypatch.setattr(DeviceSides, "accept", counting)
    pair = on_device(target, head, **FIXED)
    assert pair.generate(ids, **kwargs).tolist() == target.generate(ids, **kwargs).tolist()
    cut_at = [i for i, c in enumerate(cuts) if c]
    assert cut_at and cut_at[0] < len(cuts) - 1  # a walk was cut and rounds came after it
    for sequence, root_input in grown:
        want = sequence_states(target, head, sequence)[-2]  # a plain forward: rounding apart from the tree's (1e-4)
        torch.testing.assert_close(root_input, want, atol=1e-3, rtol=1e-3)


def test_an_mtp_layer_that_does_not_take_4d_masks_is_refused_by_name():
    """An MTP layer attends with its model's attention implementation: one that does not take the slot caches'
    additive 4D mask is a ValueError naming it and the fix, never the host round instead."""
    target, head = with_mtp("deepseek_v3")
    head.mtp.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="round='device'") as raised:
        on_device(target, head).generate(torch.tensor(MTP_ROWS[:1]), max_new_tokens=4, do_sample=False)
    assert "'flex_attention'" in str(raised.value) and "set_attn_implementation('sdpa')" in str(raised.value)


@torch.no_grad()
def test_children_are_target_ids_below_the_vocab_limit():
    """A head's children are its draft ids mapped to target ids (d2t), only those below vocab_limit (ids the target
    embeds): with a limit of 20 and draft id i being target id 2i, every grown node is below 20; without one, the
    same growth reaches past it."""
    target = tiny_model("llama", seed=1, vocab_size=98)
    head = random_head(target, draft_vocab=48)
    H, B, L = head.hidden_size, 2, 5
    grown = {}
    for limit in (20, None):
        g = torch.Generator().manual_seed(0)  # the same prefix, root and root input both times
        cache = SlotCache(1, 32)
        head_catch_up(head, cache, torch.randint(0, 98, (B, L), generator=g), torch.randn(B, L, H, generator=g),
                      torch.tensor([L, 3]), torch.ones(B, dtype=torch.long))
        growth = grow_head(head, cache, torch.tensor([L + 1, 4]), torch.tensor([7, 9]), torch.randn(B, H, generator=g),
                           depth=3, width=3, vocab_limit=limit)
        grown[limit] = growth.tree.tokens[:, 1:]
    assert (grown[20] < 20).all() and (grown[20] % 2 == 0).all()
    assert (grown[None] >= 20).any()



@needs_eagle
def test_the_head_with_suffix_proposals_merged_in_equals_target_generate_and_grows_eagles_trees(eagle, monkeypatch):
    """A draft head and the suffix index together (ngram_size 3, a prompt that repeats itself): suffix chains walk
    deeper than the head's growth of depth 2, and the head's catch-up must re-run every walked token with the
    target's states. Greedy output is target.generate's, at most one host read a round, suffix nodes were accepted
    past the growth's depth, and every round's grown tree (before the suffix nodes join it) scores as plain causal
    forwards of the head over the sequence so far: a catch-up cut at the growth's depth leaves the head's cache
    without the deeper walked tokens, and its trees differ."""
    text = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
    ids = eagle.tokenizer(text, return_tensors="pt").input_ids
    kwargs = dict(do_sample=False, max_new_tokens=40)
    expected = eagle.target.generate(ids, **kwargs)
    sequences, grown = [], []
    propose, grow = DeviceSides.propose, DeviceHead.grow

    def recording_propose(self, rows):  # copies only: the rounds' reads are counted
        sequences.append((list(self.host[0].sequence), self.slots.rows.prefix_lens[0].clone()))
        return propose(self, rows)

    def recording_grow(self, *args, **kwargs):
        tree = grow(self, *args, **kwargs)
        grown.append(tuple(t[0].clone() for t in (tree.tokens, tree.parents, tree.scores)))
        return tree

    monkeypatch.setattr(DeviceSides, "propose", recording_propose)
    monkeypatch.setattr(DeviceHead, "grow", recording_grow)
    pair = SwiftSpecForCausalLM.from_models(eagle.target, eagle.draft, round="device", ngram_size=3,
                                            draft_depth=2, draft_width=2, tree_budget=8)
    reads = reads_per_round(monkeypatch)
    assert pair.generate(ids, **kwargs).tolist() == expected.tolist()
    stats = pair.swiftspec_stats
    assert stats.engine == "device" and max(reads) <= 1
    assert sum(r.ngram_accepted for r in stats.rounds) > 0, [(r.accepted, r.ngram_accepted) for r in stats.rounds]
    assert max(r.accepted for r in stats.rounds) > 2  # a walk deeper than the growth's two levels: the suffix's
    assert len(sequences) == len(grown) == len(stats.rounds)
    for (sequence, prefix), (tokens, parents, scores) in zip(sequences, grown):
        nodes = [(int(tokens[p]) if p > 0 else -1, int(tokens[i]), float(scores[i]))
                 for i, p in enumerate(parents.tolist()) if p >= 0]
        want = reference_tree(eagle.target, eagle.draft, sequence[-(int(prefix) + 1):], 2)
        got = sorted(nodes[:2], key=lambda n: -n[2]) + sorted(nodes[2:], key=lambda n: -n[2])
        assert [n[:2] for n in got] == [n[:2] for n in want], (sequence, got, want)
        torch.testing.assert_close(torch.tensor([n[2] for n in got]), torch.tensor([n[2] for n in want]),
                                   atol=1e-4, rtol=1e-4)
