"""The draft's growth of a round on the device (drafters/device_growth.py) against independent causal
forwards of the draft along every branch, with no host read, and with live values that change between
calls of one shape (a value baked in at the first call would grow the wrong tree)."""

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from hf_swiftspec.drafters.device_growth import grow
from hf_swiftspec.steps.slot_cache import SlotCache, accepted_nodes, catch_up, commit_cache, verify_forward
from hf_swiftspec.steps.acceptance import greedy_choices, round_result, sampled_choices, walk_subtree
from hf_swiftspec.steps.device_round import select_device
from hf_swiftspec.steps.tree import subtree_mask
from hf_swiftspec.steps.verify import Sampler, apply_processors
from hf_swiftspec.tools.models import tiny_model, truncated_draft
from sync_counter import SyncCounter

CAPACITY = 48


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", seed=3)


def reference_growth(model, prompt: list[int], root: int, depth: int, width: int, vocab_limit: int):
    """(tokens, parents, scores) of the tree grown from fresh causal forwards: each node's score is the sum
    of the draft's log-probs along its path; each depth keeps the top `width` children of the frontier."""
    tokens, parents, scores, paths = [root], [-1], [0.0], [[]]
    frontier = [0]
    for _ in range(depth):
        candidates = []
        for node in frontier:
            sequence = torch.tensor([prompt + [root] + paths[node]])
            with torch.no_grad():
                logits = model(input_ids=sequence).logits[0, -1, :vocab_limit].float()
            candidates.append(scores[node] + torch.log_softmax(logits, dim=-1))
        best, flat = torch.stack(candidates).reshape(-1).topk(width)
        kept = []
        for score, index in zip(best.tolist(), flat.tolist()):
            parent, token = frontier[index // vocab_limit], index % vocab_limit
            kept.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
            paths.append(paths[parent] + [token])
        frontier = kept
    return tokens, parents, scores


def prefilled(model, prompts: list[list[int]]) -> SlotCache:
    """A SlotCache holding each row's prompt, padded to one width."""
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    cache = SlotCache(model.config.num_hidden_layers, CAPACITY)
    with torch.no_grad():
        catch_up(model, cache, tokens, torch.tensor([len(p) for p in prompts]))
    return cache


def check_growth(model, growth, prompts, roots, depth, width, vocab_limit):
    for b, (prompt, root) in enumerate(zip(prompts, roots)):
        tokens, parents, scores = reference_growth(model, prompt, root, depth, width, vocab_limit)
        assert growth.tree.tokens[b].tolist() == tokens, b
        assert growth.tree.parents[b].tolist() == parents, b
        torch.testing.assert_close(growth.tree.scores[b], torch.tensor(scores), atol=1e-4, rtol=1e-4)
        mask, depths = subtree_mask(parents, "cpu")
        assert torch.equal(growth.tree.ancestors[b], mask) and torch.equal(growth.tree.depths[b], depths)


@pytest.mark.parametrize("depth,width,vocab_limit", [(3, 2, 98), (2, 3, 60), (1, 4, 98)])
def test_growth_equals_fresh_causal_forwards(draft, depth, width, vocab_limit):
    """Every row's grown tree (tokens, parents, depths, ancestor bits, scores) equals the one grown from fresh
    causal forwards of the draft along each branch, rows of different prefix lengths in one batch."""
    torch.manual_seed(depth)
    prompts = [torch.randint(3, 98, (n,)).tolist() for n in (5, 9, 2)]
    roots = [11, 40, 7]
    cache = prefilled(draft, prompts)
    with torch.no_grad():
        prefix_lens = torch.tensor([len(p) for p in prompts])
        growth = grow(draft, cache, prefix_lens, torch.tensor(roots), depth, width, vocab_limit)
    check_growth(draft, growth, prompts, roots, depth, width, vocab_limit)


def test_growth_reads_nothing_and_replays_with_new_values(draft):
    """grow makes no host read (SyncCounter counts 0 around it, and around the subtree selection after it), and
    it traces as one graph: torch.compile(fullgraph=True) refuses any host read or value-dependent branch, and
    guards on shapes only, so the second call of one shape with other live values (prefix lengths, prompts,
    roots, in the same cache) replays the first call's graph, and must still grow the second call's trees
    (a value baked in at the first call would grow the wrong ones)."""
    depth, width = 3, 2
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    replayed = torch.compile(grow, fullgraph=True, backend=counting, dynamic=False)
    cache = SlotCache(draft.config.num_hidden_layers, CAPACITY)
    calls = [([[5, 6, 7, 8], [9, 10]], [12, 13]), ([[20, 21], [22, 23, 24, 25, 26, 27]], [30, 31])]
    trees = []
    for prompts, roots in calls:
        padded = max(len(p) for p in prompts)
        tokens = torch.tensor([p + [0] * (padded - len(p)) for p in prompts])
        prefix_lens, root_tokens = torch.tensor([len(p) for p in prompts]), torch.tensor(roots)
        with torch.no_grad():
            catch_up(draft, cache, tokens, prefix_lens)
            with SyncCounter() as counter:
                growth = grow(draft, cache, prefix_lens, root_tokens, depth, width)
                sub = select_device(growth.tree, 5)
            assert sum(counter.calls.values()) == 0, counter.calls
            check_growth(draft, growth, prompts, roots, depth, width, 98)
            assert sub.valid.all()
            again = replayed(draft, cache, prefix_lens, root_tokens, depth, width)
        check_growth(draft, again, prompts, roots, depth, width, 98)
        trees.append(again.tree.tokens)
    assert len(graphs) == 1  # the second call replayed the first call's graph
    assert not torch.equal(trees[0], trees[1])


def device_round(target, draft, target_cache, draft_cache, prefix_lens, roots, max_tokens, eos, depth, width, budget,
                 choose):
    """One round made of the device blocks alone: growth, selection, verification, the target's choices
    (choose(logits (B, T, V), subtree) -> (B, T)), walk, both caches' commits and the draft's catch-up on the one
    accepted node it has not run. Returns the round's one small result (device_round.round_result), the new
    prefix lengths and roots, all on the device."""
    growth = grow(draft, draft_cache, prefix_lens, roots, depth, width)
    sub = select_device(growth.tree, budget)
    logits = verify_forward(target, target_cache, prefix_lens, sub)
    walk = walk_subtree(choose(logits, sub), sub, max_tokens, eos)
    commit_cache(target_cache, prefix_lens, walk.path.clamp(min=0), walk.count)  # verified node j sat at slot j
    ran = walk.count.clamp(max=depth)  # a walked node at depth < depth was on a frontier: its draft KV is there
    commit_cache(draft_cache, prefix_lens, accepted_nodes(walk, sub), ran)
    last = sub.tokens.gather(1, walk.path[:, depth:].clamp(min=0))  # (B, 1) a walked node at the last depth
    catch_up(draft, draft_cache, last, walk.count - ran, prefix_lens + ran)
    emitted = walk.tokens.gather(1, (walk.count - 1).clamp(min=0)[:, None]).squeeze(1)
    roots = torch.where(walk.count > 0, emitted, roots)
    return round_result(walk), prefix_lens + walk.count, roots


PROMPTS = [[5, 17, 33, 8, 61], [40, 41], [9, 70, 12, 3, 3, 88, 21, 19]]
MAX_NEW = 14


def decode_in_device_rounds(target, draft, depth, width, budget, choose_for):
    """Decode PROMPTS with rounds made of the device blocks alone, over fixed-shape caches; each round reads
    the device once (asserted). choose_for(lengths): the round's choose, given each row's sequence length
    (prompt and tokens so far: what the host knows from the reads before). Returns (tokens per row, rounds,
    final prefix lengths, the two caches)."""
    B, capacity = len(PROMPTS), 48
    caches = [SlotCache(model.config.num_hidden_layers, capacity) for model in (target, draft)]
    committed = max(len(p) for p in PROMPTS) - 1
    tokens = torch.tensor([p[:-1] + [0] * (committed - len(p) + 1) for p in PROMPTS])
    prefix_lens = torch.tensor([len(p) - 1 for p in PROMPTS])
    roots = torch.tensor([p[-1] for p in PROMPTS])
    eos = torch.tensor([2])
    produced = [[] for _ in PROMPTS]
    done = [False] * B
    rounds = 0
    with torch.no_grad():
        for model, cache in zip((target, draft), caches):
            catch_up(model, cache, tokens, prefix_lens)
        while not all(done):
            max_tokens = torch.tensor([0 if d else MAX_NEW - len(p) for d, p in zip(done, produced)])
            choose = choose_for([len(p) + len(out) for p, out in zip(PROMPTS, produced)])
            with SyncCounter() as counter:
                result, prefix_lens, roots = device_round(target, draft, *caches, prefix_lens, roots, max_tokens, eos,
                                                          depth, width, budget, choose)
                rows = result.tolist()  # the round's one read
            assert sum(counter.calls.values()) == 1, counter.calls
            rounds += 1
            for b, (count, finished, *emitted) in enumerate(rows):
                produced[b] += emitted[:count]
                done[b] = done[b] or bool(finished)
    return produced, rounds, prefix_lens, caches


@pytest.mark.parametrize("depth,width,budget", [(3, 2, 6), (2, 3, 7)])
def test_device_rounds_decode_as_target_generate(depth, width, budget):
    """Rounds made of the device blocks (grow, select_device, verify_forward, walk_device, commit_cache,
    catch_up) decode each of 3 rows of different lengths exactly as target.generate does greedily (EOS and
    max_new_tokens included), reading the device once a round; the draft's proposals were accepted (more
    tokens than rounds); and both caches end holding what a fresh prefill of the committed sequences writes
    (the draft's commit and catch-up decide acceptance only, not the tokens)."""
    target = tiny_model("llama", seed=0)
    draft = truncated_draft(target)
    expected = []
    for prompt in PROMPTS:
        out = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                              pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    produced, rounds, prefix_lens, caches = decode_in_device_rounds(
        target, draft, depth, width, budget, lambda lengths: lambda logits, sub: greedy_choices(logits))
    assert produced == expected
    assert sum(map(len, produced)) > rounds
    sequences = [(p + out)[:-1] for p, out in zip(PROMPTS, produced)]
    assert prefix_lens.tolist() == [len(s) for s in sequences]
    padded = max(map(len, sequences))
    tokens = torch.tensor([s + [0] * (padded - len(s)) for s in sequences])
    for model, cache in zip((target, draft), caches):
        fresh = SlotCache(model.config.num_hidden_layers, cache.capacity)
        with torch.no_grad():
            catch_up(model, fresh, tokens, prefix_lens)
        for b, n in enumerate(prefix_lens.tolist()):
            for layer, again in zip(cache.layers, fresh.layers):
                torch.testing.assert_close(layer.keys[b, :, :n], again.keys[b, :, :n], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[b, :, :n], again.values[b, :, :n], atol=1e-5, rtol=1e-5)


def test_sampled_device_rounds_draw_what_token_by_token_sampling_draws():
    """Sampling by the round's rule (verify.Sampler: the processors, then Gumbel-max with noise keyed by seed,
    row and position) in device rounds emits, row by row, exactly the tokens that sampling one token at a time
    from the target with the same sampler draws (the noise of a position does not depend on the tree), with
    the host drawing each round's noise from what it knows (no read)."""
    target = tiny_model("llama", seed=0)
    draft = truncated_draft(target)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(20)])
    samplers = Sampler(processors, True, torch.Generator().manual_seed(5)).for_rows(len(PROMPTS))
    expected = []
    with torch.no_grad():
        for prompt, sampler in zip(PROMPTS, samplers):
            context = torch.tensor([prompt])
            for _ in range(MAX_NEW):
                token, _ = sampler.choose(context, target(input_ids=context).logits[:, -1].float())
                context = torch.cat([context, token[None]], dim=1)
                if token.item() == 2:
                    break
            expected.append(context[0, len(prompt):].tolist())
    budget = 6

    def choose_for(lengths):
        noise = torch.stack([s.gumbel([n + d for d in range(budget)], target.config.vocab_size, torch.device("cpu"))
                             for s, n in zip(samplers, lengths)])  # (B, T, V): every depth of this round

        def choose(logits, sub):
            scores = torch.stack([apply_processors(s.logits_processor, None, logits[b].clone())
                                  for b, s in enumerate(samplers)])
            return sampled_choices(scores, noise, sub.depths)

        return choose

    produced, rounds, _, _ = decode_in_device_rounds(target, draft, 3, 2, budget, choose_for)
    assert produced == expected
    assert sum(map(len, produced)) > rounds
    greedy, _, _, _ = decode_in_device_rounds(target, draft, 3, 2, budget,
                                              lambda lengths: lambda logits, sub: greedy_choices(logits))
    assert greedy != produced
