"""A learning rate of 0 is a valid rate: the tables stay bit for bit (no row is updated, and none is rounded
back into storage: the cache admits and evicts nothing), the optimizer state steps as torch's and TorchRec's
do (Adagrad's sums accumulate, Adam's moments move), and schedules that reach 0 (a warm-up from 0, a decay to
0) train through it. Negative and non-finite rates stay refused in one line."""

from __future__ import annotations

import itertools
import logging
import math
import warnings

import pytest
import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError
from slipcache.training.config import make_config

SIZES = [50, 30, 20]
BATCH = 16


def _ids(generator: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randint(0, s, (BATCH,), generator=generator) for s in SIZES], 1)


def _step(collection: CachedEmbeddingBagCollection, ids: torch.Tensor) -> None:
    # a linear loss: the gradient does not depend on the rows, so two collections that differ in their rows
    # take the same gradient
    weights = torch.linspace(-1, 1, BATCH * len(SIZES) * 8).reshape(BATCH, len(SIZES), 8)
    (collection(ids) * weights).sum().backward()


def _table_bytes(collection: CachedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """What the tables hold: the storage's bytes, the cached rows and which rows they are."""
    held = {f"storage.{k}": v.clone() for k, v in collection.storage.state_dict().items()}
    held["cache.weights"] = collection.cache.weights.clone()
    held["cache.slot_rows"] = collection.cache.slot_rows.clone()
    return held


@pytest.mark.parametrize(
    "precision, cache_rows, optimizer",
    list(itertools.product(["fp32", "int8", "int4"], [0, 12, 100], ["sgd", "adagrad", "rowwise_adagrad", "adam"])),
)
def test_a_step_at_lr_0_leaves_every_table_as_it_was(precision: str, cache_rows: int, optimizer: str) -> None:
    """After steps at lr 0.1 (the cached rows off the storage grid), steps at lr 0 change no byte of the tables,
    with no cache, a cache that must evict (12 of 100 rows) and one that holds every row; the rounding stream
    is not drawn from. The optimizer state steps as at any rate."""
    config = EmbeddingConfig(
        SIZES, dim=8, precision=precision, cache_rows=cache_rows, optimizer=optimizer, lr=0.1, seed=1,
        weight_decay=0.01,
    )  # fmt: skip
    still, moving = CachedEmbeddingBagCollection(config), CachedEmbeddingBagCollection(config)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = _ids(generator)
        _step(still, ids)
        _step(moving, ids)
    still.lr = 0.0
    before, tables = _table_bytes(still), still.export_tables()
    rounding = still.writer.generator.get_state()
    state = None if optimizer == "sgd" else still.optimizer_state.clone()
    steps = still.optimizer.steps
    for _ in range(3):
        ids = _ids(generator)
        _step(still, ids)
        _step(moving, ids)
    after = _table_bytes(still)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(torch.equal(a, b) for a, b in zip(tables, still.export_tables(), strict=True))
    assert torch.equal(still.writer.generator.get_state(), rounding)
    assert still.optimizer.steps == steps + 3 and still.skipped_updates == 0
    if state is not None:
        # Adagrad's sums accumulate at lr 0 (as TorchRec's fused tables and torch.optim.Adagrad do), as they
        # do at lr 0.1: the gradient is the same. Adam's moments and step count move as torch.optim.Adam's.
        assert not torch.equal(still.optimizer_state, state)
        if optimizer != "adam":  # weight decay adds the (different) rows to the gradient of Adam
            torch.testing.assert_close(still.optimizer_state, moving.optimizer_state, rtol=1e-2, atol=1e-2)
    changed = [not torch.equal(a, b) for a, b in zip(tables, moving.export_tables(), strict=True)]
    assert any(changed)  # the same steps at lr 0.1 do move the rows


def test_lr_0_from_the_start_keeps_the_drawn_rows_through_evictions() -> None:
    """A warm-up from 0: the first step at lr 0 leaves the rows as drawn, whatever the cache does."""
    for precision in ("int8", "int4"):
        config = EmbeddingConfig(SIZES, dim=8, precision=precision, cache_rows=12, optimizer="sgd", lr=0.0)
        collection = CachedEmbeddingBagCollection(config)
        drawn = collection.export_tables()
        generator = torch.Generator().manual_seed(3)
        for _ in range(4):
            _step(collection, _ids(generator))
        assert all(torch.equal(a, b) for a, b in zip(drawn, collection.export_tables(), strict=True))
        collection.lr = 0.5
        _step(collection, _ids(generator))
        assert not all(torch.equal(a, b) for a, b in zip(drawn, collection.export_tables(), strict=True))


def test_negative_and_non_finite_rates_are_refused_in_one_line() -> None:
    collection = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=4))
    collection.lr = 0
    assert collection.lr == 0.0
    for bad in (-1e-8, -1.0, float("nan"), float("inf"), 1e39, "0.1", True):
        with pytest.raises(SlipcacheError, match=r"^lr must be a number >= 0 within fp32's range, got ") as info:
            collection.lr = bad
        assert "\n" not in str(info.value)
    assert collection.lr == 0.0
    assert EmbeddingConfig(SIZES, lr=0.0).lr == 0.0
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr must be a number >= 0"):
            EmbeddingConfig(SIZES, lr=bad)
    assert make_config({}, {"lr": 0.0, "dense_lr": 0.0}).embeddings.lr == 0.0
    for name in ("lr", "dense_lr"):
        with pytest.raises(SlipcacheError, match=f"--{name.replace('_', '-')} must be >= 0, got -0.1"):
            make_config({}, {name: -0.1})


def test_a_dense_lr_of_0_is_not_replaced_by_lr() -> None:
    from slipcache.training.backend import dense_optimizer

    model = torch.nn.Linear(2, 1)
    model.dense_parameters = model.parameters  # type: ignore[attr-defined]
    optimizer = dense_optimizer(make_config({}, {"lr": 0.3, "dense_lr": 0.0}), model)  # type: ignore[arg-type]
    assert optimizer.param_groups[0]["lr"] == 0.0


# ------------------------------------------------------------------- TorchRec's schedulers, under DMP


def _schedules_reaching_0_train(rank: int, world_size: int) -> None:
    """One process, DMP over our tables: torch's schedulers on `model.fused_optimizer` (as TorchRec's users
    drive its fused tables) warm up from 0 and decay to 0; the steps at 0 leave the rows as they were."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, PolynomialLR
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection, KeyedCachedEmbeddingBagCollectionSharder
    from tests.interop import torchrec_shards as shards

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    for optimizer, precision in (("sgd", "int8"), ("rowwise_adagrad", "int4")):
        options = {**shards.OPTIONS, "precision": precision, "cache_size": 0.3, "optimizer": optimizer}
        model = shards.TablesModel(KeyedCachedEmbeddingBagCollection(shards.tables(), **options))
        sharder = KeyedCachedEmbeddingBagCollectionSharder()
        plan = shards.plan(model.tables, sharder, "one_rank")
        sharded = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
        fused = sharded.fused_optimizer
        for make in (
            lambda o: LambdaLR(o, lambda n: min(1.0, n / 3)),  # a linear warm-up from 0
            lambda o: CosineAnnealingLR(o, T_max=3, eta_min=0.0),
            lambda o: PolynomialLR(o, total_iters=3, power=2.0),
            lambda o: LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=3),
        ):
            for group in fused.param_groups:
                group["lr"] = group.setdefault("initial_lr", 0.5)
            scheduler = make(fused)
            rates = []
            for step in range(5):
                lr = fused.param_groups[0]["lr"]
                rates.append(lr)
                before = _rows(sharded)
                weights = torch.randn(shards.BATCH, 36, generator=torch.Generator().manual_seed(step))
                (sharded(shards.batch(step, rank)) * weights).sum().backward()
                fused.step()
                scheduler.step()
                after = _rows(sharded)
                same = all(torch.equal(before[name], after[name]) for name in before)
                assert same == (lr == 0), (optimizer, type(scheduler).__name__, step, lr)
            assert 0.0 in rates and any(r > 0 for r in rates), rates
            assert all(r >= 0 and math.isfinite(r) for r in rates), rates


def _rows(sharded: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: rows
        for lookup in sharded.module.tables.lookups
        for c in lookup.collections
        for name, rows in zip(c.table_names, c.export_tables(), strict=True)
    }


@pytest.mark.slow
def test_torch_schedulers_that_reach_0_train_the_sharded_tables_through_it() -> None:
    pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")
    from tests.ranks import run_ranks

    run_ranks(_schedules_reaching_0_train, world_size=1)
