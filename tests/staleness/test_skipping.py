"""Stale-input skipping in the training loop (slipcache.staleness.skipping) on a tiny dataset written here."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from slipcache.staleness.detector import StaleInputDetector
from slipcache.training import checkpoint
from slipcache.training import trainer as train
from slipcache.training.backend import build_model
from slipcache.training.config import TrainConfig, make_config
from tests.helpers import SIZES, make_dataset, tiny_config

# A checkpoint event's bytes vary too: the file holds the events before it, their timings included.
TIMING = {"samples_per_s", "train_wall_s", "train_seconds", "compute_s", "skip_overhead_s", "time_saved_s",
          "train_cpu_s", "write_s", "bytes", "disk_read_bytes_per_step", "disk_write_bytes_per_step",
          "train_disk_read_bytes"}
METRICS = ("auc", "logloss", "accuracy", "normalized_entropy", "train_samples")  # a plain run has no skipped_fraction


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), skewed=True)


def tiny(data: Path, out: Path, **overrides: object) -> TrainConfig:
    """Skipping from the start (no warm-up) unless a test asks for one: the runs are a few dozen batches."""
    stale = dict(skip_rule="stale", stale_window=0.1, stale_guard_every=4, stale_target=0.5, stale_warmup="none",
                 stale_warmup_min=0.0, stale_min_updates=2)
    return tiny_config(data, out, **{**stale, **overrides})


def events(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def test_skipped_inputs_never_reach_forward_or_change_parameters(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every input with id 0 in table 0 is declared stale: no training forward sees one, and its row never moves."""

    def count(self: StaleInputDetector, sparse: np.ndarray, control_share: float = 0.0) -> tuple:
        keep = np.asarray(sparse)[:, 0] != 0
        for counters in (self.epoch_counts, self.total):
            counters.inputs += keep.size
            counters.skipped += int((~keep).sum())
        return keep, np.zeros_like(keep)

    monkeypatch.setattr(StaleInputDetector, "count_with_controls", count)
    seen: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():  # training forward passes, not the guard's or evaluation's
            seen.append(args[1][:, 0].clone())

    config = tiny(data_dir, tmp_path / "run", epochs=1)
    torch.manual_seed(config.model.seed)
    before = build_model(config, SIZES, 13).embeddings.bags[0].weight[0].clone()
    monkeypatch.setattr(train.DLRM, "forward", _with_hook(train.DLRM.forward, record))
    summary = train.train(config)
    ids = torch.cat(seen)
    assert ids.numel() == summary["train_samples"] and not (ids == 0).any()
    share = float((np.load(data_dir / "train.sparse.npy")[:, 0] == 0).mean())
    assert summary["skipped_fraction"] == pytest.approx(share, abs=0.05)  # up to the dropped last batch
    state = checkpoint.load_checkpoint(tmp_path / "run" / "checkpoints")
    assert torch.equal(state["embeddings"]["bags.0.weight"][0], before)
    assert not torch.equal(
        state["embeddings"]["bags.0.weight"][1],
        build_model(config, SIZES, 13).embeddings.bags[0].weight[1],
    )


def _with_hook(forward, hook):  # type: ignore[no-untyped-def]
    def wrapped(self, *args):  # type: ignore[no-untyped-def]
        hook(self, args)
        return forward(self, *args)

    return wrapped


def test_off_is_the_plain_loop(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With skipping off, the stale knobs change nothing and no skipper is ever built."""
    import slipcache.staleness.skipping

    plain = train.train(tiny(data_dir, tmp_path / "a", skip_rule=None))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("StaleSkipper built with skipping off")

    monkeypatch.setattr(slipcache.staleness.skipping.StaleSkipper, "__init__", refuse)
    knobs = train.train(
        tiny(
            data_dir,
            tmp_path / "b",
            skip_rule=None,
            stale_target=0.9,
            stale_alpha=0.5,
            stale_guard=False,
            stale_rule="paper",
            stale_warmup="epoch",
            stale_decision="epoch",
            stale_keep=0.5,
        )
    )
    for key in METRICS:
        assert plain[key] == knobs[key], key
    assert "skipped_fraction" not in plain and "staleness" not in plain
    assert events(tmp_path / "a") == events(tmp_path / "b")


@pytest.mark.slow
def test_skipping_is_deterministic_and_reported(data_dir: Path, tmp_path: Path) -> None:
    a = train.train(tiny(data_dir, tmp_path / "a"))
    b = train.train(tiny(data_dir, tmp_path / "b"))
    for key in (*METRICS, "skipped_fraction"):
        assert a[key] == b[key], key
    assert events(tmp_path / "a") == events(tmp_path / "b")
    assert a["skipped_fraction"] > 0.05
    assert a["train_samples"] < 2 * 1984 * (1 - 0.5 * a["skipped_fraction"])
    block = a["staleness"]
    assert block["inputs_seen"] == 2 * 2000  # 2 epochs of 2000: each classifies every training input exactly once
    assert block["inputs_skipped"] > 0 and block["hot_rows"] > 0 and block["control_inputs"] > 0
    assert 0 <= block["nonstale_hot_rows"] == block["hot_rows"] - block["stale_rows"]
    labels = np.load(data_dir / "train.labels.npy")
    assert 0.0 < block["skipped_label_rate"] < 1.0 and 0.0 < block["kept_label_rate"] < 1.0
    # every classified input is in one of the two groups, and their positives add up to the epochs' labels
    rates = block["skipped_label_rate"] * block["inputs_skipped"] + block["kept_label_rate"] * (
        block["inputs_seen"] - block["inputs_skipped"])
    assert rates == pytest.approx(2 * labels.sum())
    calibration = block["calibration"]
    test_rows = len(np.load(data_dir / "test.labels.npy"))
    assert calibration["skipped_kind"]["inputs"] + calibration["rest"]["inputs"] == test_rows
    for group in calibration.values():
        assert group["inputs"] == 0 or 0.0 < group["mean_pred"] < 1.0
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    last = [e for e in map(json.loads, lines) if e["event"] == "train"][-1]
    for key in (
        "skipped_fraction",
        "hot_rows",
        "stale_rows",
        "threshold",
        "hot_skipped_fraction",
        "time_saved_s",
    ):
        assert key in last, key
    assert (tmp_path / "a" / "staleness.png").is_file()
    c = train.train(tiny(data_dir, tmp_path / "c", seed=1))
    assert c["auc"] != a["auc"]


def test_guard_lowers_the_target_when_the_controls_loss_ratio_rises(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first check sets the controls' reference ratio; 2 checks 50 % above it halve D, reported."""
    import slipcache.staleness.skipping as skipping

    checks: list[float] = []

    def account(self: skipping.StaleSkipper, batch: object, logits: object, control: object, loss: object) -> None:
        ratio = 1.0 if not checks else 1.5
        self.control_sums = [ratio * skipping.CONTROL_MIN, skipping.CONTROL_MIN, 1.0, 1]
        checks.append(ratio)

    monkeypatch.setattr(skipping.StaleSkipper, "_account_controls", account)
    summary = train.train(tiny(data_dir, tmp_path / "run", epochs=1))
    block = summary["staleness"]
    first = block["guard_actions"][0]
    assert first["source"] == "control loss" and first["action"] == "lower"
    assert first["target"] == pytest.approx(0.25) and first["drift"] == pytest.approx(0.5)
    logged = [a for e in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              for a in e.get("guard_actions", [])]
    assert logged == block["guard_actions"]  # every action also in metrics.jsonl, once


def test_guard_lowers_the_target_when_validation_auc_falls(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aucs = iter([0.80, 0.79, 0.78, 0.77, 0.76, 0.75, 0.74, 0.73, 0.72, 0.71])

    def evaluate(*args: object, **kwargs: object) -> dict:
        return {"auc": next(aucs, 0.7), "logloss": 0.5, "accuracy": 0.5, "normalized_entropy": 1.0, "samples": 1}

    monkeypatch.setattr(train, "evaluate", evaluate)
    summary = train.train(tiny(data_dir, tmp_path / "run", epochs=2, eval_every=320, stale_guard_every=10_000))
    actions = summary["staleness"]["guard_actions"]
    assert actions and all(a["source"] == "validation" for a in actions)
    assert actions[0]["action"] == "lower" and actions[0]["drift"] == pytest.approx(-0.01)
    assert actions[-1]["action"] == "stop" and not summary["staleness"]["guard_active"]


def test_no_input_is_skipped_before_warm_up_ends(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up on the validation loss (default) with a 40 % floor: everything before it is trained."""
    import slipcache.staleness.skipping as skipping

    calls: list[tuple[int, int]] = []
    real = skipping.StaleSkipper.sample_filter

    def record(self: skipping.StaleSkipper, sparse: np.ndarray, positions: np.ndarray) -> np.ndarray:
        keep = real(self, sparse, positions)
        calls.append((self.trained, int((~keep).sum())))
        return keep

    record.wants_positions = True  # type: ignore[attr-defined]

    monkeypatch.setattr(skipping.StaleSkipper, "sample_filter", record)
    summary = train.train(tiny(data_dir, tmp_path / "run", epochs=3, stale_warmup="val", stale_warmup_min=0.4))
    warm = summary["staleness"]["warm_at"]
    assert warm is not None and warm["samples"] >= 0.4 * 3 * 1984
    assert all(skipped == 0 for trained, skipped in calls if trained < warm["samples"])
    assert sum(skipped for _, skipped in calls) == summary["staleness"]["inputs_skipped"] > 0
    assert summary["staleness"]["warmup"] == "val"


def test_val_warm_up_ends_by_half_of_a_single_epoch_run_at_the_latest(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = iter([0.7 - 0.05 * i for i in range(100)])  # the validation loss never flattens

    def evaluate(*args: object, **kwargs: object) -> dict:
        return {"auc": 0.7, "logloss": next(losses), "accuracy": 0.5, "normalized_entropy": 1.0, "samples": 1}

    monkeypatch.setattr(train, "evaluate", evaluate)
    summary = train.train(tiny(data_dir, tmp_path / "run", epochs=1, stale_warmup="val", eval_every=192))
    warm = summary["staleness"]["warm_at"]
    assert warm["reason"] == "50% of the run" and 0.5 * 1984 <= warm["samples"] < 0.5 * 1984 + 64


def test_epoch_warm_up_never_skips_in_a_single_epoch_run(data_dir: Path, tmp_path: Path) -> None:
    summary = train.train(tiny(data_dir, tmp_path / "run", epochs=1, stale_warmup="epoch"))
    assert summary["skipped_fraction"] == 0.0 and summary["staleness"]["warm_at"] is None


@pytest.mark.parametrize("rule, warmup, crash_step, keep", [("convergence", "val", 45, 0.05),
                                                           ("paper", "none", 35, 0.05),
                                                           ("convergence", "none", 35, 0.25)])
@pytest.mark.slow
def test_resumed_skip_run_ends_where_the_uninterrupted_one_ends(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str, warmup: str, crash_step: int,
    keep: float,
) -> None:
    knobs = dict(stale_rule=rule, stale_warmup=warmup, stale_keep=keep)
    full = train.train(tiny(data_dir, tmp_path / "full", **knobs))
    assert full["skipped_fraction"] > 0
    real_step = torch.optim.SGD.step
    calls = {"n": 0}

    def crash_midway(self: torch.optim.SGD, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2 * crash_step:  # dense and embedding optimizers: in epoch 1, after a checkpoint
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(data_dir, tmp_path / "part", **knobs))
    monkeypatch.undo()
    state = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints")
    assert state["progress"]["epoch"] == 1 and state["progress"]["batch_in_epoch"] > 0
    resumed = train.train(make_config({}, {"resume": str(tmp_path / "part"), "progress": False}))
    for key in METRICS:
        assert resumed[key] == full[key], key
    assert events(tmp_path / "part") == events(tmp_path / "full")


def _skipper_with_stale(data_dir: Path, tmp_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    """A StaleSkipper on the tiny model whose detector calls row 0 of every table stale and row 1 of table 0
    hot but moving: an input of zeros is stale, one with id 1 in table 0 is not."""
    from slipcache.staleness.skipping import StaleSkipper

    config = tiny(data_dir, tmp_path / "run", **overrides)
    labels = SimpleNamespace(labels=np.zeros(64, dtype=np.float32))  # read for the skipped group's label rate
    skipper = StaleSkipper(config, build_model(config, SIZES, 13), labels, batches_per_epoch=10)  # type: ignore[arg-type]
    det = skipper.detector
    det._row_flags[det.table_offsets[:-1]] = 3
    det._row_flags[1] = 1
    det._threshold = 0.0  # a fitted threshold: skipping is on
    skipper.window_start = 0
    return skipper


def test_kept_inputs_lack_the_skipped_share_of_the_loss(data_dir: Path, tmp_path: Path) -> None:
    """On a constructed batch, the kept inputs' loss sum lacks the skipped inputs' share (Slipstream's bias):
    over many draws of the control hash it is the moving inputs' sum plus p of the stale ones'."""
    rng = np.random.default_rng(0)
    n, p = 64, 0.25
    stale = rng.random(n) < 0.6
    losses = rng.uniform(0.1, 2.0, n) * np.where(stale, 0.3, 1.0)  # stale inputs have lower loss
    skipper = _skipper_with_stale(data_dir, tmp_path, stale_keep=p)
    sparse = np.zeros((n, 26), dtype=np.int32)
    sparse[~stale, 0] = 1
    sums = []
    for _ in range(3000):  # each call classifies the next n positions of the run: a fresh control draw
        keep = skipper.sample_filter(sparse, np.arange(n))
        assert skipper.loss_weights(int(keep.sum())) is None
        sums.append(float(losses[keep].sum()))
        skipper.pending_controls = skipper.pending_controls[int(keep.sum()):]
    biased = float(losses[~stale].sum() + p * losses[stale].sum())
    assert np.mean(sums) == pytest.approx(biased, rel=0.01) and biased < 0.9 * float(losses.sum())
    assert np.std(sums) > 0  # the control draw differs from batch to batch


def test_guard_sums_from_the_step_loss_match_per_input_losses(data_dir: Path, tmp_path: Path) -> None:
    """The guard's cheap path (controls' losses only, the batch's sum from the step's mean) sums the same."""
    from types import SimpleNamespace

    skipper = _skipper_with_stale(data_dir, tmp_path, stale_keep=0.25)
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(512, generator=gen), (torch.rand(512, generator=gen) < 0.3).float()
    control = (torch.rand(512, generator=gen) < 0.1).numpy()
    batch = SimpleNamespace(labels=labels)
    skipper._account_controls(batch, logits, control)
    exact = list(skipper.control_sums)
    skipper.control_sums = [0.0, 0, 0.0, 0]
    mean = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    skipper._account_controls(batch, logits, control, mean)
    assert skipper.control_sums[1::2] == exact[1::2] and exact[1] > 0
    assert skipper.control_sums[0::2] == pytest.approx(exact[0::2], rel=1e-5)


@pytest.mark.slow
def test_full_keep_share_trains_exactly_as_without_skipping(data_dir: Path, tmp_path: Path) -> None:
    """p = 1 keeps every would-be-skipped input: the run is the plain one, bit for bit."""
    plain = train.train(tiny(data_dir, tmp_path / "a", skip_rule=None))
    kept = train.train(tiny(data_dir, tmp_path / "b", stale_keep=1.0))
    assert kept["staleness"]["control_inputs"] > 0  # inputs were would-be-skipped, and all kept
    for key in METRICS:
        assert plain[key] == kept[key], key
    assert kept["skipped_fraction"] == 0.0
    a = checkpoint.load_checkpoint(tmp_path / "a" / "checkpoints")
    b = checkpoint.load_checkpoint(tmp_path / "b" / "checkpoints")
    for part in ("dense", "embeddings"):
        for name, tensor in a[part].items():
            assert torch.equal(tensor, b[part][name]), name


@pytest.mark.slow
def test_quick_cli_skips_a_visible_share_at_the_same_auc(tmp_path: Path, quick_run: tuple[Path, str]) -> None:
    """`slipcache train --quick --skip-rule stale` against `slipcache train --quick` (the shared run)."""
    from slipcache.cli import main

    assert main(["train", "--quick", "--no-progress", "--skip-rule", "stale", "--out", str(tmp_path / "skip")]) == 0
    plain = json.loads((quick_run[0] / "summary.json").read_text())
    skip = json.loads((tmp_path / "skip" / "summary.json").read_text())
    block = skip["staleness"]
    assert block["warm_at"]["samples"] >= 0.1 * skip["config"]["samples"]  # skips in the later part only
    assert skip["skipped_fraction"] >= 0.02
    assert abs(skip["auc"] - plain["auc"]) <= 0.01


def test_a_threshold_fit_that_fails_is_said_and_skips_nothing(
    data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A share no threshold reaches (every hot input stale at once, say) must not look like "nothing stale"."""
    from slipcache.staleness import detector

    def unreachable(keys, target, tolerance, low, high, max_steps, relative):
        return detector.ThresholdResult(None, 0.07, max_steps, False, target, int(keys.size), "no T in [0, 0.1]")

    with pytest.MonkeyPatch.context() as patch, caplog.at_level("WARNING", logger="slipcache.staleness.skipping"):
        patch.setattr(detector, "fit_threshold", unreachable)
        summary = train.train(tiny(data_dir, tmp_path / "run"))
    fits = summary["staleness"]["threshold_fits"]
    assert fits and not any(fit["converged"] for fit in fits)
    assert summary["staleness"]["inputs_skipped"] == 0
    assert any("no threshold makes 50 % of the sampled hot inputs stale (no T in [0, 0.1])" in r.getMessage()
               for r in caplog.records)
