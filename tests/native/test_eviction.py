"""Compiled eviction: evicted rows rounded into storage from their cache slots, with noise drawn by the
compiled loop from the very stream torch.rand draws; stored bytes, counts and generator states as torch's."""

import pytest
import torch

from slipcache import _native
from slipcache._native import quantize
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.quant import RowStorage

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")


@pytest.mark.parametrize("draws", [0, 1, 623, 624, 625, 5000])
def test_compiled_draws_are_torch_rand(draws: int) -> None:
    ours, theirs = torch.Generator().manual_seed(draws), torch.Generator().manual_seed(draws)
    for step in range(3):  # from a fresh seed, then from mid-stream
        shape = (draws + step, 3)
        drawn = quantize.uniform(shape, ours)
        assert drawn is not None and torch.equal(drawn, torch.rand(shape, generator=theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())


def test_a_compiled_draw_into_a_buffer_is_torch_rand() -> None:
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    buffer = torch.full((10, 7), -1.0)
    assert quantize.uniform((4, 7), ours, out=buffer[:4]) is not None  # a view: the buffer's rows, filled
    assert torch.equal(buffer[:4], torch.rand((4, 7), generator=theirs)) and bool((buffer[4:] == -1).all())
    with pytest.raises(ValueError, match="out must be a contiguous CPU float32"):
        quantize.uniform((4, 7), ours, out=buffer[:5])


def test_the_compiled_draw_refuses_a_state_out_of_range() -> None:
    state = torch.Generator().manual_seed(1).get_state()
    state[8:12] = 0  # `left` 0: not a state torch leaves (then the caller draws with torch)
    out = torch.empty(4)
    assert _native.native().torch_uniform(state.data_ptr(), out.data_ptr(), 4) == -1


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16"])
def test_rows_written_from_their_slots_match_torch(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    cache_rows = torch.randn(50, 8, generator=g) * 3
    cache_rows[7, 2] = float("inf")  # fitted and counted, as the torch path fits it
    cache_rows[9] *= 1e5
    slots = torch.randperm(50, generator=g)[:20]
    slots[0] = 7
    slots[1] = 9
    rows = torch.randperm(100, generator=g)[:20]
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(_native, "native", lambda: None)
        storage = RowStorage(100, 8, precision)
        generator = torch.Generator().manual_seed(11)
        fitted = storage.write(rows, cache_rows, "stochastic", generator, source=slots)
        results.append(([b.view(torch.uint8) for b in storage.buffers()], fitted, generator.get_state()))
    (ours, our_fit, our_state), (theirs, their_fit, their_state) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert torch.equal(our_fit.nonfinite, their_fit.nonfinite) and int(our_fit.nonfinite.sum()) == 1
    assert torch.equal(our_fit.saturated, their_fit.saturated)
    assert torch.equal(our_state, their_state)


def test_evictions_in_training_match_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many evictions per step (a small cache), stochastic rounding: every byte and count as torch's."""
    sizes = [300, 40, 1000]
    g = torch.Generator().manual_seed(5)
    inputs = [torch.stack([torch.randint(0, n, (64,), generator=g) for n in sizes], 1) for _ in range(6)]
    grads = [torch.randn(64, 3, 8, generator=g) for _ in inputs]
    ends = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(_native, "native", lambda: None)
        coll = CachedEmbeddingBagCollection(EmbeddingConfig(sizes, dim=8, precision="int8", cache_rows=64, ways=4))
        for ids, grad in zip(inputs, grads, strict=True):
            coll(ids).backward(grad)
        coll.flush()
        ends.append((coll.state_dict(), coll.stats()))
    (ours, our_stats), (theirs, their_stats) = ends
    assert our_stats["evictions"] > 100 and our_stats == their_stats
    for key, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, theirs[key]), key
    assert torch.equal(ours["_extra_state"]["generator"], theirs["_extra_state"]["generator"])
