"""TorchRec's optimizer conventions on our tables: the sharder's `fused_params` and
`apply_optimizer_in_backward` on the collection's parameters set the tables' optimizer, or are refused in
one line; never silently ignored."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")

from slipcache.errors import SlipcacheError  # noqa: E402
from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection  # noqa: E402
from tests.interop import torchrec_shards as shards  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

OPTIONS = {**shards.OPTIONS, "precision": "int8", "cache_size": 0.5}


def _apply(optimizer_class: type, params: object, kwargs: dict) -> None:
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        apply_optimizer_in_backward(optimizer_class, params, kwargs)


def _train(module: torch.nn.Module, steps: int = 3) -> None:
    weights = torch.randn(shards.BATCH, 36, generator=torch.Generator().manual_seed(3))
    for step in range(steps):
        (module(shards.batch(step, 0)).values() * weights).sum().backward()


def _rows(module: KeyedCachedEmbeddingBagCollection) -> list[torch.Tensor]:
    return module.export_tables()


def test_apply_optimizer_in_backward_sets_the_tables_optimizer() -> None:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    for optimizer_class, kwargs, expected in (
        (RowWiseAdagrad, {"lr": 0.02, "eps": 1e-6, "weight_decay": 1e-3}, {"optimizer": "rowwise_adagrad"}),
        (torch.optim.SGD, {"lr": 0.3}, {"optimizer": "sgd"}),
        (torch.optim.Adagrad, {"lr": 0.05}, {"optimizer": "adagrad"}),
        (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}, {"optimizer": "adam", "beta1": 0.8, "beta2": 0.99}),
    ):
        applied = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
        assert len(list(applied.parameters())) == 4  # one empty slot per table, as EBC has one weight per table
        _apply(optimizer_class, applied.parameters(), kwargs)
        settings = {**expected, **{k: v for k, v in kwargs.items() if k != "betas"}}
        built = KeyedCachedEmbeddingBagCollection(shards.tables(), **{**OPTIONS, **settings})
        _train(applied)
        _train(built)
        for collection in applied.collections:
            assert collection.config.optimizer == expected["optimizer"]
            assert collection.lr == kwargs["lr"]
        for mine, theirs in zip(_rows(applied), _rows(built), strict=True):
            assert torch.equal(mine, theirs), optimizer_class
        assert not any(p.grad is not None for p in applied.parameters())


def test_what_apply_optimizer_in_backward_cannot_set_is_refused_in_one_line() -> None:
    for optimizer_class, kwargs, message in (
        (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop is not offered for slipcache's tables"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, r"SGD\) with momentum=0.9 is not offered"),
    ):
        module = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
        _apply(optimizer_class, module.parameters(), kwargs)
        with pytest.raises(SlipcacheError, match=message) as info:
            _train(module, 1)
        assert "\n" not in str(info.value)
    module = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
    first, *rest = module.parameters()
    _apply(torch.optim.SGD, [first], {"lr": 0.1})
    _apply(torch.optim.Adagrad, rest, {"lr": 0.1})
    with pytest.raises(SlipcacheError, match="the same optimizer .* t0: sgd, t1: adagrad"):
        _train(module, 1)
    trained = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
    _train(trained, 1)
    _apply(torch.optim.Adagrad, trained.parameters(), {"lr": 0.1})
    with pytest.raises(SlipcacheError, match=r"trained with sgd \(1 updates\); choose the optimizer \(adagrad\)"):
        _train(trained, 1)


def test_the_slots_change_neither_the_state_dict_nor_a_dense_optimizer() -> None:
    module = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
    assert not any("optimizer_slots" in key for key in module.state_dict())
    other = KeyedCachedEmbeddingBagCollection(shards.tables(), **{**OPTIONS, "seed": 9})
    other.load_state_dict(module.state_dict())  # strict
    dense = torch.optim.Adam(module.parameters(), lr=0.1)
    _train(module, 1)
    dense.step()
    assert not dense.state  # no gradient reached them: nothing to step


def test_fused_params_keys_we_lack_are_refused_in_one_line() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder

    with pytest.raises(SlipcacheError, match=r"fused_params 'max_gradient', 'output_dtype' not offered") as info:
        KeyedCachedEmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1, "max_gradient": 1.0,
                                                               "output_dtype": "fp16"})  # fmt: skip
    assert "\n" not in str(info.value)
    with pytest.raises(SlipcacheError, match="optimizer 'lamb' is not offered"):
        KeyedCachedEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.LAMB})
    with pytest.raises(SlipcacheError, match="weight_decay_mode DECOUPLED is not offered"):
        KeyedCachedEmbeddingBagCollectionSharder(fused_params={"weight_decay_mode": "DECOUPLED"})
    sharder = KeyedCachedEmbeddingBagCollectionSharder({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    assert sharder.fused_params == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


def test_the_planner_prices_the_optimizer_fused_params_choose() -> None:
    from slipcache.interop.torchrec_planner import shard_bytes

    module = KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS)
    plain = shard_bytes(module, "t0", 40, 8, None)
    fused = shard_bytes(module, "t0", 40, 8, None, {"optimizer": "exact_adagrad"})
    assert plain["optimizer_state"] == 0 and fused["optimizer_state"] == 40 * 8 * 4


def _fused_params_reach_the_shards(rank: int, world_size: int) -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollectionSharder

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.03, "eps": 1e-5,
             "weight_decay": 1e-3, "stochastic_rounding": False, "cache_load_factor": 0.2}  # fmt: skip
    expected = {"optimizer": "rowwise_adagrad", "lr": 0.03, "eps": 1e-5, "weight_decay": 1e-3,
                "rounding": "nearest", "cache_size": 0.2}  # fmt: skip
    for in_backward in (False, True):
        model = shards.TablesModel(KeyedCachedEmbeddingBagCollection(shards.tables(), **OPTIONS))
        if in_backward:  # it wins over the sharder's fused_params, as in TorchRec
            _apply(RowWiseAdagrad, model.tables.parameters(), {"lr": 0.07})
        sharder = KeyedCachedEmbeddingBagCollectionSharder(fused_params=fused)
        plan = shards.plan(model.tables, sharder, "one_rank")
        sharded = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
        want = {**expected, "lr": 0.07} if in_backward else expected
        collections = sharded.module.tables.local_collections()
        assert collections
        for collection in collections:
            config = collection.config
            got = {k: getattr(config, k) for k in want if k != "cache_size"}
            assert got == {k: v for k, v in want.items() if k != "cache_size"}, got
            assert config.cache_size == [0.2] * len(config.table_sizes) or config.cache_size == 0.2
        assert sharded.fused_optimizer.param_groups[0]["lr"] == want["lr"]
        (sharded(shards.batch(0, rank)).sum()).backward()
        assert all(c.optimizer.steps == 1 and c.optimizer_state.abs().sum() > 0 for c in collections)


@pytest.mark.slow
def test_the_sharders_fused_params_and_apply_optimizer_in_backward_reach_the_shards() -> None:
    run_ranks(_fused_params_reach_the_shards, world_size=1)
