"""What reaches the compiled loops, what dtype/device conversion of the module means, non-finite values."""

import pytest
import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError

SIZES = [40, 7, 300, 3]
needs_native = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")


def small(precision: str = "int8", **kwargs) -> CachedEmbeddingBagCollection:
    return CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4, precision=precision, **kwargs))


def ids(seed: int = 0, batch: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (batch,), generator=g) for n in SIZES], dim=1)


@needs_native
def test_compiled_sgd_refuses_what_it_would_write_past() -> None:
    slots = torch.tensor([0, 1])
    grad = torch.ones(2, 4)
    with pytest.raises(ValueError, match="weights must be a contiguous CPU tensor of dtype torch.float32"):
        _native.sgd_update(torch.zeros(5, 4, dtype=torch.float16), slots, grad, 0.1)
    with pytest.raises(ValueError, match="not contiguous"):
        _native.sgd_update(torch.zeros(4, 5).t(), slots, torch.ones(2, 5), 0.1)
    with pytest.raises(ValueError, match=r"grad .* shape \(2, 4\)"):
        _native.sgd_update(torch.zeros(5, 4), slots, torch.ones(2, 3), 0.1)
    with pytest.raises(ValueError, match="slots must be .* torch.int64"):
        _native.sgd_update(torch.zeros(5, 4), slots.int(), grad, 0.1)
    weights = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"slot 5 is outside \[0, 5\)"):
        _native.sgd_update(weights, torch.tensor([0, 5]), grad, 0.1)
    with pytest.raises(ValueError, match=r"slot -1 is outside"):
        _native.sgd_update(weights, torch.tensor([-1, 0]), grad, 0.1)
    assert not weights.any()  # a refused call writes nothing


@needs_native
def test_compiled_lookup_refuses_mismatched_bookkeeping() -> None:
    slot_rows = torch.full((8,), -1, dtype=torch.int32)
    rows = torch.tensor([1, 2])
    with pytest.raises(ValueError, match=r"last_used .* shape \(8,\)"):
        _native.lookup(slot_rows, 2, 4, 3, rows, torch.zeros(4, dtype=torch.int32), None, 1)
    with pytest.raises(ValueError, match="rows must be .* torch.int64"):
        _native.lookup(slot_rows, 2, 4, 3, rows.int(), None, None, 1)
    with pytest.raises(ValueError, match=r"slot_rows .* shape \(12,\)"):
        _native.lookup(slot_rows, 3, 4, 3, rows, None, None, 1)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("convert", ["half", "double", "float", "bfloat16"])
def test_dtype_conversion_of_the_module_is_refused(precision: str, convert: str) -> None:
    coll = small(precision, cache_size=0.1)
    coll(ids()).sum().backward()
    before = {name: (b.dtype, b.clone()) for name, b in coll.named_buffers()}
    if convert == "float" and precision == "fp32":
        getattr(coll, convert)()  # nothing would change: allowed
    else:
        with pytest.raises(SlipcacheError, match="keeps its dtypes"):
            getattr(coll, convert)()
    for name, b in coll.named_buffers():  # untouched, and training goes on
        assert b.dtype == before[name][0] and torch.equal(b, before[name][1]), name
    coll(ids(1)).sum().backward()


def test_to_device_moves_every_piece_of_state() -> None:
    """Without a second device here, `meta` stands in: every tensor and device attribute must follow."""
    coll = small("int8", cache_size=0.1, optimizer="adagrad")
    coll(ids()).sum().backward()
    coll.to("meta")
    assert {b.device.type for b in coll.buffers()} == {"meta"}
    assert coll.device.type == coll.storage_device.type == coll._anchor.device.type == "meta"
    assert coll.config.cache_device == coll.config.storage_device == "meta"
    assert coll._generator is None
    coll = small("int8", cache_size=0.1)
    state = coll._generator.get_state()
    coll.to("cpu")  # same device: the generator is kept as it is
    assert torch.equal(coll._generator.get_state(), state)
