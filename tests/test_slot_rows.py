"""A slot cache's rows copied and made: SlotCache.allocate and copy_rows, which every running-batch join and bucket move
runs, against plain indexing of the source's buffers."""

import torch

from hf_swiftspec.steps.slot_cache import SlotCache, catch_up
from hf_swiftspec.tools.models import tiny_model


def prefilled(model, rows: int, capacity: int = 64) -> SlotCache:
    """A slot cache of `rows` rows, row b holding a prompt of 5 + 3b random tokens (every slot past it zero)."""
    torch.manual_seed(1)
    layers = model.config.num_hidden_layers
    cache = SlotCache(layers, capacity)
    lengths = torch.tensor([5 + 3 * b for b in range(rows)])
    tokens = torch.randint(3, model.config.vocab_size, (rows, int(lengths.max())))
    with torch.no_grad():
        catch_up(model, cache, tokens, lengths)
    return cache


def test_allocated_rows_are_zero_views_of_one_buffer_each():
    model = tiny_model("llama")
    source = prefilled(model, 2)
    made = SlotCache(len(source.layers), 32)
    made.allocate(source, 3)
    assert len(made.kv_buffers) == len(source.kv_buffers)
    for buffer in made.kv_buffers:
        assert buffer.data.shape[1] == 3 and buffer.data.shape[buffer.dim] == 32
        assert not buffer.data.any()
    storages = {b.data.untyped_storage().data_ptr() for b in made.kv_buffers}
    for layer in made.kv_layers:  # each layer's keys and values are views into the buffers (a commit moves them all)
        for part in (layer.keys, layer.values):
            assert part.shape[2] == 32 and part.untyped_storage().data_ptr() in storages


def test_rows_copied_by_a_tensor_index_are_the_source_rows_first_slots():
    model = tiny_model("llama")
    source = prefilled(model, 4)
    for rows, slots in ((torch.tensor([3, 1]), 20), (slice(1, 3), 12), (torch.tensor([2]), None)):
        made = SlotCache(len(source.layers), source.capacity)
        made.allocate(source, 3)
        made.copy_rows(source, rows, at=1, slots=slots)
        n = source.capacity if slots is None else slots
        index = torch.arange(4)[rows]
        for mine, theirs in zip(made.buffers, source.buffers):
            copied = mine.data[:, 1 : 1 + len(index)]
            want = theirs.data[:, index].narrow(theirs.dim, 0, n)
            assert torch.equal(copied.narrow(mine.dim, 0, n), want)
            assert not copied.narrow(mine.dim, n, mine.data.shape[mine.dim] - n).any()  # nothing past `slots`
            assert not mine.data[:, 0].any()  # rows before `at` untouched
