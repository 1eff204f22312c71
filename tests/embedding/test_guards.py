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
    assert coll.writer.generator is None
    coll = small("int8", cache_size=0.1)
    state = coll.writer.generator.get_state()
    coll.to("cpu")  # same device: the generator is kept as it is
    assert torch.equal(coll.writer.generator.get_state(), state)


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16", "fp32"])
def test_storage_never_holds_inf_or_nan_and_counts_what_it_changed(precision: str) -> None:
    from slipcache.embedding.quant import RowStorage

    storage = RowStorage(4, 8, precision)
    x = torch.linspace(-0.5, 0.5, 32).view(4, 8).clone()
    x[0, 3] = -1e5  # below the fp16 bias range: used to make the bias (and the whole row) -inf
    x[1, 0] = float("inf")
    x[1, 1] = float("nan")
    x[2, 5] = 3.3e38  # near the fp32 maximum
    fitted = storage.write(torch.arange(4), x, "nearest", None)
    y = storage.read(torch.arange(4), torch.device("cpu"))
    assert bool(torch.isfinite(y).all())
    assert fitted.nonfinite is not None and fitted.nonfinite.tolist() == [0, 2, 0, 0]
    expected_saturated = [0, 0, 0, 0] if precision in ("fp32", "bf16") else [1, 0, 1, 0]
    assert fitted.saturated.tolist() == expected_saturated
    # an untouched row keeps its precision; a saturated row keeps its other values within the coarser step
    assert torch.allclose(y[3], x[3], atol=0.01 if precision != "int4" else 0.05)
    step = {"int8": 240.0, "int4": 240.0}.get(precision, 1e-2)
    others = torch.ones(8, dtype=torch.bool)
    others[3] = False
    assert float((y[0, others] - x[0, others]).abs().max()) <= step


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16"])
def test_a_huge_update_saturates_one_value_not_the_row(precision: str) -> None:
    """One finite update of -1e6 used to turn the whole int8 row into -inf."""
    coll = small(precision, cache_size=0.0, policy="none", lr=1.0)
    row_ids = torch.tensor([[1, 1, 1, 1]])
    before = coll.read_rows(torch.tensor([1]))
    out = coll(row_ids)
    grad = torch.zeros_like(out)
    grad[0, 0, 2] = 1e6
    out.backward(grad)
    values = coll.read_rows(torch.tensor([1]))
    assert bool(torch.isfinite(values).all())
    assert float(values[0, 2]) < -1000  # pushed as far down as the storage goes
    kept = [0, 1, 3]
    tolerance = 240.0 if precision.startswith("int") else 1e-3  # the saturated int row's step
    assert float((values[0, kept] - before[0, kept]).abs().max()) <= tolerance
    stats = coll.stats()
    assert stats["saturated_values"] >= 1 and stats["per_table"][0]["saturated_values"] >= 1
    assert stats["per_table"][1]["saturated_values"] == 0


def test_a_non_finite_gradient_skips_the_update_and_is_counted() -> None:
    coll = small("int8", cache_size=0.1)
    before = torch.cat(coll.export_tables())
    out = coll(ids())
    grad = torch.ones_like(out)
    grad[3, 2, 1] = float("nan")
    out.backward(grad)
    assert torch.allclose(torch.cat(coll.export_tables()), before, atol=1e-6, rtol=0)
    assert coll.stats()["skipped_updates"] == 1
    coll(ids()).sum().backward()  # the next finite step trains again
    assert not torch.allclose(torch.cat(coll.export_tables()), before, atol=1e-3, rtol=0)


def test_load_tables_counts_saturated_values_per_table() -> None:
    coll = small("fp16", cache_size=0.0, policy="none")
    tables = [torch.zeros(n, 4) for n in SIZES]
    tables[2][5, 1] = 1e6
    tables[2][6, 0] = float("-inf")
    coll.load_tables(tables)
    per_table = coll.stats()["per_table"]
    assert [t["saturated_values"] for t in per_table] == [0, 0, 1, 0]
    assert [t["nonfinite_values"] for t in per_table] == [0, 0, 1, 0]
    assert bool(torch.isfinite(torch.cat(coll.export_tables())).all())


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16"])
def test_one_seed_starts_every_precision_from_the_rounding_of_the_same_rows(precision: str) -> None:
    from slipcache.embedding.quant import RowStorage

    fp32 = torch.cat(small("fp32", seed=3).export_tables())
    low = torch.cat(small(precision, seed=3).export_tables())
    rounded = RowStorage(fp32.shape[0], 4, precision)
    rounded.write_range(0, fp32, "nearest", None)
    assert torch.equal(low, rounded.read(torch.arange(fp32.shape[0]), torch.device("cpu")))
    assert not torch.equal(low, torch.cat(small(precision, seed=4).export_tables()))  # the seed matters
    # the draw is DLRM's uniform(-1/sqrt(n), 1/sqrt(n)) per table
    assert float(fp32[:40].abs().max()) <= 40**-0.5 and float(fp32[47:347].abs().max()) <= 300**-0.5


def test_initialization_chunks_are_bounded() -> None:
    from slipcache.embedding.collection import _init_chunk_rows

    # The draw is one generator stream, so chunking does not change it (native/test_quantize checks the
    # created tables against one whole draw); chunks only bound the fp32 held at once.
    for dim in (1, 16, 128, 4096):
        assert _init_chunk_rows(dim) * dim * 4 <= max(1 << 20, dim * 4)


def test_a_state_dict_from_before_the_saturation_counters_loads() -> None:
    """Older checkpoints: 7 counter columns, `pin_since` in the extra state, no `cache_rows` in its config."""
    coll = small("int8", cache_size=0.1)
    coll(ids()).sum().backward()
    state = coll.state_dict()
    state["counters"] = state["counters"][:, :7].clone()
    extra = dict(state["_extra_state"])
    extra.pop("skipped_updates")
    extra["pin_since"] = extra["step"] + 1
    extra["config"] = {k: v for k, v in extra["config"].items() if k != "cache_rows"}
    state["_extra_state"] = extra
    fresh = small("int8", cache_size=0.1, seed=4)
    fresh.load_state_dict(state)
    assert torch.equal(torch.cat(fresh.export_tables()), torch.cat(coll.export_tables()))
    assert fresh.stats()["lookups"] == coll.stats()["lookups"] and fresh.stats()["saturated_values"] == 0


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_an_update_that_overflows_is_fitted_in_the_cache_as_in_storage(
    compiled: bool, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finite gradient times lr beyond fp32's range: cached rows end like stored ones (±largest float, counted)."""
    if compiled and _native.native() is None:
        pytest.skip("no C compiler: only the torch path exists")
    if not compiled:
        monkeypatch.setattr(_native, "native", lambda: None)
    largest = torch.finfo(torch.float32).max
    ends = []
    for cache_rows in (0, 8):  # every row in storage, every row in the cache
        config = EmbeddingConfig([4, 4], dim=4, precision="fp32", cache_rows=cache_rows, optimizer=optimizer, lr=1e38)
        coll = CachedEmbeddingBagCollection(config)
        coll.load_tables([torch.full((4, 4), 3e38), torch.full((4, 4), -3e38)])
        out = coll(torch.tensor([[0, 1], [2, 1]]))
        grad = torch.ones(out.shape)
        grad[:, 0] = -1.0  # table 0 grows past +max, table 1 past -max
        out.backward(grad)
        rows = coll.read_rows(torch.arange(8))
        assert torch.isfinite(rows).all()
        assert torch.equal(rows[[0, 2]], torch.full((2, 4), largest))
        assert torch.equal(rows[5], torch.full((4,), -largest))
        assert torch.equal(rows[[1, 3, 4, 6, 7]], torch.tensor([3e38, 3e38, -3e38, -3e38, -3e38])[:, None].expand(5, 4))
        ends.append((rows, coll.stats()["nonfinite_values"]))
    assert torch.equal(ends[0][0], ends[1][0]) and ends[0][1] == ends[1][1] == 12


def test_optimizer_and_cache_settings_are_checked_at_the_boundary() -> None:
    for bad in (0.0, -1e-8, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            EmbeddingConfig(SIZES, optimizer="adagrad", eps=bad)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="lfu_halving_interval"):
            EmbeddingConfig(SIZES, policy="lfu", lfu_halving_interval=bad)
    with pytest.raises(ValueError, match="lr must be"):
        EmbeddingConfig(SIZES, lr=1e308)  # inf once in fp32, where the update computes
    coll = small()
    for bad in (-1e-8, float("inf"), 1e39, "0.1"):  # 0 is a rate (tests/embedding/test_lr_zero.py)
        with pytest.raises(SlipcacheError, match="lr must be"):
            coll.lr = bad
    assert coll.lr == 0.1


def test_requires_grad_false_freezes_the_tables() -> None:
    coll = small(cache_rows=40, ways=4)
    before = coll.export_tables()
    coll.requires_grad_(False)
    out = coll(ids())
    assert not out.requires_grad and coll.step == 0 and coll.stats()["lookups"] == 0
    (out.sum() * torch.ones(1, requires_grad=True)).backward()  # a loss downstream still trains the rest
    assert all(torch.equal(a, b) for a, b in zip(before, coll.export_tables(), strict=True))
    coll.requires_grad_(True)
    out = coll(ids())
    out.sum().backward()
    assert coll.step == 1 and not all(torch.equal(a, b) for a, b in zip(before, coll.export_tables(), strict=True))


def test_a_loaded_state_keeps_the_collections_own_lr() -> None:
    a = small(lr=0.5)
    a.lr = 0.25
    b = small(lr=0.01)
    b.load_state_dict(a.state_dict())
    assert b.lr == 0.01 and a.state_dict()["_extra_state"]["lr"] == 0.25


def test_the_collection_is_composed_not_inherited() -> None:
    """Its parts are attributes with one owner each; its class hierarchy holds no other slipcache class than
    the interface every collection shares (`EmbeddingTables`, which holds no part)."""
    from slipcache.embedding.tables import EmbeddingTables

    ours = [c for c in CachedEmbeddingBagCollection.__mro__ if c.__module__.startswith("slipcache")]
    assert ours == [CachedEmbeddingBagCollection, EmbeddingTables]
    assert not any(isinstance(v, torch.nn.Module) for v in vars(EmbeddingTables).values())
    coll = small(cache_rows=40, ways=4)
    assert {"storage", "cache"} <= set(dict(coll.named_children()))
    assert all(hasattr(coll, part) for part in ("inputs", "planner", "optimizer", "prefetcher", "traffic", "writer"))
