"""The skip rules beside Slipstream's: the random control, loss pruning, the paper preset."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slipcache.data.batches import Batch
from slipcache.staleness.config import STALE_PRESETS, StalenessConfig
from slipcache.staleness.detector import StaleInputDetector
from slipcache.staleness.hotset import frequent_rows
from slipcache.staleness.pruning import LossPruner, dequantize, quantize
from slipcache.training import trainer as train
from slipcache.training.config import make_config
from tests.helpers import make_dataset, tiny_config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), skewed=True)


@pytest.mark.parametrize("share", [0.2, 0.6])
def test_random_rule_skips_the_requested_share_of_hot_inputs(share: float) -> None:
    """Every hot input is a candidate; the kept share 1 - D leaves D of them skipped, at random."""
    offsets = np.array([0, 50, 100, 150])
    det = StaleInputDetector(StalenessConfig(rule="random", memory_budget_bytes=60 * 4 * 4), offsets, dim=4)
    rng = np.random.default_rng(0)
    ids = rng.zipf(1.3, (40_000, 3)) % 50
    ids = ids.astype(np.int32)
    det.profile(ids[:4000])
    det.begin_window(None)  # the random rule reads no rows
    det.end_window(None)
    det.fit_threshold(ids[:4000])
    hot = det.hot_input_mask(ids)
    keep = np.concatenate([det.count_with_controls(b, control_share=1.0 - share)[0] for b in np.split(ids, 40)])
    skipped = ~keep
    assert not skipped[~hot].any()  # only hot inputs are ever skipped
    n = int(hot.sum())
    assert n > 5000 and abs(skipped[hot].mean() - share) < 4 * np.sqrt(share * (1 - share) / n)
    assert det.stats()["skipped_fraction"] == pytest.approx(skipped.mean())


def test_random_rule_in_training_counts_every_skipped_input(data_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(data_dir, tmp_path / "run", skip_rule="random", stale_target=0.5, stale_window=0.1,
                         stale_warmup="none", stale_warmup_min=0.0, epochs=2)
    summary = train.train(config)
    block = summary["staleness"]
    assert block["rule"] == "random" and block["inputs_skipped"] > 0 and not block["guard_checks"]
    skipped = block["inputs_skipped"]
    # the trainer counts skips up to its last batch; the filter may have looked at the epoch's tail too
    assert summary["skipped_fraction"] == pytest.approx(skipped / (summary["train_samples"] + skipped), abs=0.01)
    assert abs(block["hot_skipped_fraction"] - 0.5) < 0.1  # the window trains its hot inputs, the rest skip half


def toy_pruner(share: float, position: int, mean: float) -> LossPruner:
    config = SimpleNamespace(skipping=SimpleNamespace(prune_share=share, prune_final=0.0),
                             model=SimpleNamespace(seed=3), schedule=SimpleNamespace(samples=0))
    pruner = LossPruner(config, 1000, None)
    pruner.start_epoch(0, 0)
    pruner.start_epoch(1, 0)
    pruner.mean, pruner.position = mean, position
    return pruner


def test_loss_pruning_without_a_run_directory_leaves_no_files_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    pruner = toy_pruner(0.5, 0, 0.3)
    pruner.files[0][:] = 7  # the unlinked maps still work
    assert int(pruner.files[0][999]) == 7
    assert list(tmp_path.iterdir()) == []


def test_loss_pruning_weighted_gradient_is_unbiased_in_expectation() -> None:
    """Logistic regression on 1000 inputs with known last losses: over many pruning draws, the gradient
    of the kept inputs weighted 1/(1 - r) averages to the full-data gradient; unweighted it does not."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1000, 5))).float()
    y = torch.from_numpy((rng.random(1000) < 0.3).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal(5)).float().requires_grad_(True)

    def grad(rows: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        w.grad = None
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x[rows] @ w, y[rows], weight=weights,
                                                                    reduction="sum")
        loss.backward()
        return w.grad.clone() / 1000

    full = grad(torch.arange(1000), None)
    last = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y, reduction="none").detach().numpy()
    weighted, plain = [], []
    for draw in range(300):
        pruner = toy_pruner(0.5, draw * 1000, float(dequantize(quantize(last)).mean()))
        pruner.files[0][:] = quantize(last)
        keep = pruner.sample_filter(np.zeros((1000, 26), np.int32), np.arange(1000))
        rows = torch.from_numpy(np.flatnonzero(keep))
        weights = pruner.loss_weights(len(rows))
        assert weights is not None and set(np.unique(weights.numpy())) == {1.0, 2.0}
        weighted.append(grad(rows, weights))
        plain.append(grad(rows, None))
    weighted_mean, plain_mean = torch.stack(weighted).mean(0), torch.stack(plain).mean(0)
    stderr = torch.stack(weighted).std(0) / np.sqrt(len(weighted))
    assert torch.all((weighted_mean - full).abs() < 4 * stderr + 1e-6)
    assert (plain_mean - full).abs().max() > 10 * stderr.max()  # without the weights: biased


def test_loss_pruning_prunes_only_below_mean_and_at_the_requested_share() -> None:
    pruner = toy_pruner(0.5, 0, 1.0)
    last = np.where(np.arange(1000) % 2 == 0, 0.2, 3.0)  # even inputs below the mean, odd above
    pruner.files[0][:] = quantize(last)
    keep = pruner.sample_filter(np.zeros((1000, 26), np.int32), np.arange(1000))
    assert keep[1::2].all()  # above the mean: always trained
    assert abs((~keep[0::2]).mean() - 0.5) < 0.1
    assert pruner.skipped_inputs == int((~keep).sum())
    assert (pruner.files[1][np.flatnonzero(~keep)] == quantize(np.array([0.2]))[0]).all()  # carried forward


@pytest.mark.slow
def test_loss_rule_trains_end_to_end_and_resumes_exactly(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is pruned in the first epoch (no losses yet); pruned inputs count; a run killed in its
    second epoch and resumed ends exactly where the uninterrupted one ends (the epoch's byte file is read
    only, the other written)."""
    knobs = dict(skip_rule="loss", prune_share=0.5, prune_final=0.2, epochs=3)
    full = train.train(tiny_config(data_dir, tmp_path / "full", **knobs))
    block = full["staleness"]
    assert block["rule"] == "loss" and 0.05 < full["skipped_fraction"] < 0.5 and block["state_bytes"] > 0
    events = [json.loads(e) for e in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    first = [e for e in events if e.get("epoch") == 0 and "inputs_skipped" in e]
    assert first and all(e["inputs_skipped"] == 0 for e in first)
    real_step = torch.optim.SGD.step
    calls = {"n": 0}

    def crash_midway(self: torch.optim.SGD, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2 * 45:  # dense and embedding optimizers: in epoch 1, after a checkpoint
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny_config(data_dir, tmp_path / "part", **knobs))
    monkeypatch.undo()
    resumed = train.train(make_config({}, {"resume": str(tmp_path / "part"), "progress": False}))
    for key in ("auc", "logloss", "train_samples", "skipped_fraction"):
        assert resumed[key] == full[key], key


def test_frequency_hot_set_finds_every_row_read_often_enough() -> None:
    """The count-min sketch never misses a row at or above the count, even with collisions forced."""
    rng = np.random.default_rng(1)
    rows = rng.zipf(1.2, 200_000) % 100_000
    exact_rows, exact_counts = np.unique(rows, return_counts=True)
    truth = set(exact_rows[exact_counts >= 20].tolist())
    tiny = frequent_rows(np.array_split(rows, 7), 20, 10**6, np.array([0, 100_000]), width_bits=12)
    assert truth <= set(tiny.rows.tolist())  # 49 lookups per counter: many false positives, no miss
    hot = frequent_rows(np.array_split(rows, 7), 20, 10**6, np.array([0, 100_000]), width_bits=16)
    assert truth <= set(hot.rows.tolist()) and len(hot) < 1.5 * len(truth)
    capped = frequent_rows(np.array_split(rows, 7), 20, 100, np.array([0, 100_000]), width_bits=16)
    assert len(capped) == 100 and set(capped.rows.tolist()) <= truth  # the budget keeps the most read


def test_paper_preset_fills_what_the_user_did_not_set() -> None:
    config = make_config(flag_values={"skip_rule": "stale", "stale_preset": "paper", "stale_target": 0.4})
    for key, value in STALE_PRESETS["paper"].items():
        assert config.get(key) == value
    assert config.skipping.stale_target == 0.4 and config.skipping.skip_rule == "stale"
    mine = make_config(flag_values={"skip_rule": "stale", "stale_preset": "paper", "stale_guard": True})
    assert mine.skipping.stale_guard and mine.skipping.skip_rule == "stale"


def test_batch_iterator_passes_positions_to_filters_that_want_them(data_dir: Path) -> None:
    from slipcache.data.batches import BatchIterator
    from slipcache.data.dataset import CriteoDataset

    split = CriteoDataset(data_dir).split("train")
    seen: list[np.ndarray] = []

    def keep_all(sparse: np.ndarray, positions: np.ndarray) -> np.ndarray:
        seen.append(positions)
        return np.ones(len(sparse), dtype=bool)

    keep_all.wants_positions = True  # type: ignore[attr-defined]
    batches = list(BatchIterator(split, 64, shuffle=True, seed=1, sample_filter=keep_all))
    order = np.concatenate(seen)
    assert sorted(order.tolist()) == list(range(len(split)))
    first = next(iter(BatchIterator(split, 64, shuffle=True, seed=1)))
    assert torch.equal(batches[0].sparse, first.sparse)
    assert torch.equal(batches[0].sparse, torch.from_numpy(np.asarray(split.sparse)[order[:64]].astype(np.int64)))
    assert isinstance(batches[0], Batch)


@pytest.mark.parametrize("order, expected", [("first", [True, False, False]), ("every", [True, True, True])])
@pytest.mark.slow
def test_time_ordered_data_goes_through_time_in_the_first_epoch_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str, expected: list[bool]
) -> None:
    """From the second epoch on, time-ordered data is shuffled across days, so validation AUC does not saw
    at epoch boundaries; `time_order="every"` keeps every epoch in time order."""
    from slipcache.data.synthetic import generate_synthetic
    from slipcache.training import datasets as dataset_module

    data = tmp_path / "data"
    generate_synthetic(data, num_samples=4000, scale=0.001, seed=0, progress=False)
    seen: list[bool] = []
    real = dataset_module.BatchIterator

    def recording(*args: object, **kwargs: object) -> object:
        if kwargs.get("drop_last"):  # training batches, not evaluation
            seen.append(bool(kwargs["in_order"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(dataset_module, "BatchIterator", recording)
    train.train(tiny_config(data, tmp_path / "run", epochs=3, time_order=order))
    assert seen == expected


def test_paper_preset_trains_on_the_authors_schedule(data_dir: Path, tmp_path: Path) -> None:
    """The paper preset end to end: FAE's budget hot set, cold inputs first, the window on the hot batches,
    one threshold per window, no controls."""
    config = tiny_config(data_dir, tmp_path / "run", skip_rule="stale", stale_preset="paper", stale_target=0.5,
                         stale_window=0.1, stale_hot_share=0.65)
    summary = train.train(config)
    block = summary["staleness"]
    skipping = config.skipping
    assert skipping.stale_hot_set == "budget" and not skipping.stale_guard and skipping.stale_keep == 0.0
    assert block["rule"] == "paper" and block["control_inputs"] == 0 and not block["guard_checks"]
    assert block["order"] == "cold_first" and block["hot_rows"] > 0
    assert block["warm_at"]["batch"] == block["window_start_batch"]  # the window opened where the plan says
    assert block["rechecks"] == 0 and block["threshold_refits"] == 0  # one decision per window
