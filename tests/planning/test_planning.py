"""`slipcache plan`: the id profiler, hit-rate curves, the per-table choice and its TOML output."""

import tomllib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slipcache import cli
from slipcache.cli import main
from slipcache.data.dataset import SplitArrays
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.errors import SlipcacheError
from slipcache.planning.planner import CostModel, make_plan, uniform_choice
from slipcache.planning.profile import TableProfile, profile_split
from slipcache.training.backend import build_model
from slipcache.training.config import load_config_file, make_config
from tests.helpers import SIZES, cli_fails, make_dataset


def _split(columns: list[np.ndarray]) -> SplitArrays:
    sparse = np.stack(columns, axis=1).astype(np.int32)
    n = sparse.shape[0]
    return SplitArrays(np.zeros(n, np.float32), np.zeros((n, 13), np.float32), sparse)


def _simulated_lru(stream: np.ndarray, capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for x in stream.tolist():
        if x in cache:
            hits += 1
            cache.move_to_end(x)
        else:
            cache[x] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(stream)


def test_lru_curve_follows_a_simulated_lru() -> None:
    rng = np.random.default_rng(0)
    stream = np.minimum(rng.zipf(1.2, 100_000) - 1, 49_999)
    profile = profile_split(_split([stream]), [50_000], sample_rows=100_000)
    table = profile.tables[0]
    for capacity in (64, 1024):
        assert table.hit_rate(capacity, "lru")[0] == pytest.approx(_simulated_lru(stream, capacity), abs=0.03)


def test_lfu_curve_is_the_top_rows_share_and_singletons_are_the_unseen_tail() -> None:
    table = TableProfile(100, 12, np.array([5, 3, 2, 1, 1]), np.zeros(64), 1.0)
    assert table.unseen_mass == pytest.approx(2 / 12)
    np.testing.assert_allclose(table.hit_rate([0, 1, 2, 10], "lfu"), [0, 5 / 12, 8 / 12, 10 / 12])
    assert table.hit_rate(10, "lru")[0] == pytest.approx(10 / 12)  # every re-referenced row fits


def test_profile_counts_every_table_and_samples_without_replacement() -> None:
    split = _split([np.arange(1000) % 10, np.zeros(1000)])
    profile = profile_split(split, [10, 3], sample_rows=500, seed=1)
    assert profile.sampled_rows == 500 and profile.tables[0].lookups == 500
    assert profile.tables[0].distinct == 10 and profile.tables[1].counts.tolist() == [500]
    assert profile.tables[1].histogram[0] == 500 and profile.tables[1].lookups_per_sample == 1.0
    with pytest.raises(SlipcacheError, match="outside"):
        profile_split(split, [5, 3])


def test_memory_model_is_the_collections_per_table_accounting() -> None:
    sizes, precisions, cache_rows = [1000, 50, 3000, 7], ["int8", "fp32", "int4", "fp16"], [100, 0, 40, 16]
    model = CostModel.from_modules(16, total_rows=sum(sizes))
    report = CachedEmbeddingBagCollection.estimate_memory(
        EmbeddingConfig(table_sizes=sizes, dim=16, precision=precisions, cache_rows=cache_rows)
    )
    for n, p, c, table in zip(sizes, precisions, cache_rows, report["per_table"], strict=True):
        assert model.memory(n, p, c) == table["total_bytes"]


def _skewed_profile():
    rng = np.random.default_rng(0)
    n = 40_000
    columns = [rng.integers(0, 8, n), np.minimum(rng.zipf(1.3, n) - 1, 99_999), rng.integers(0, 20_000, n)]
    return profile_split(_split(columns), [8, 100_000, 20_000])


def test_plan_fits_the_budget_and_spends_it_where_misses_cost() -> None:
    profile = _skewed_profile()
    fp32 = CostModel.from_modules(16, total_rows=120_008).memory(120_008, "fp32", 0)
    roomy = make_plan(profile, fp32 * 1.01, 16)
    assert [c.precision for c in roomy.choices] == ["fp32"] * 3 and roomy.loss == 0
    tight = make_plan(profile, fp32 / 4, 16)
    assert tight.total_bytes <= fp32 / 4
    small, skewed, uniform = tight.choices
    assert small.precision == "fp32" and small.cache_rows == 0  # 8 rows: full precision costs nothing
    assert skewed.cache_rows > 0 and skewed.hit_rate > 0.6  # a small cache catches most of its lookups
    baseline = uniform_choice(profile, 16, "int8", 0.05)  # one shared cache of 5 % of all rows
    same_memory = make_plan(profile, baseline["bytes"], 16)
    assert same_memory.total_bytes <= baseline["bytes"] and same_memory.loss < baseline["loss"]
    with pytest.raises(SlipcacheError, match="below the smallest plan"):
        make_plan(profile, 1000, 16)


def test_plan_command_writes_a_config_the_trainer_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = make_dataset(tmp_path / "data", n=800, skewed=True)
    out = tmp_path / "plan" / "tables.toml"
    args = ["plan", "--data", str(data), "--budget-gb", "0.000008", "--out", str(out), "--world-size", "2"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "precision" in printed and "sharding plan" in printed
    plan = tomllib.loads(out.read_text())
    assert len(plan["train"]["precision"]) == 26 and len(plan["train"]["cache_rows"]) == 26
    assert plan["plan"]["planned_bytes"] <= 8000
    assert {s["table"] for s in plan["sharding"]["shards"]} == {f"C{t + 1}" for t in range(26)}
    assert {s["rank"] for s in plan["sharding"]["shards"]} == {0, 1}
    assert out.with_suffix(".png").stat().st_size > 0


def test_plan_drives_a_training_run(tmp_path: Path) -> None:
    from slipcache.training import trainer as train

    data = make_dataset(tmp_path / "data", n=1000, skewed=True)
    out = tmp_path / "plan.toml"
    assert (
        cli.main(["plan", "--data", str(data), "--budget-gb", "0.000006", "--dim", "8", "--out", str(out)])
        == 0
    )
    planned = tomllib.loads(out.read_text())
    assert set(planned["train"]["precision"]) - {"fp32"}  # the budget forces some tables below fp32
    overrides = {"out": str(tmp_path / "run"), "bottom_mlp": [16, 8], "top_mlp": [16, 1], "epochs": 1}
    config = make_config(
        load_config_file(out), {**overrides, "batch_size": 64, "progress": False}
    )
    summary = train.train(config)
    assert summary["config"]["precision"] == planned["train"]["precision"]
    assert summary["config"]["cache_rows"] == planned["train"]["cache_rows"]
    tables = build_model(config, SIZES, 13).embeddings
    assert (
        sum(t["total_bytes"] for t in tables.memory_report()["per_table"]) == planned["plan"]["planned_bytes"]
    )
    assert summary["cache_hit_rate"] > 0


def test_plan_runs_the_memory_pre_check_on_what_it_proposes(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipcache import memory

    data = make_dataset(tmp_path / "data", n=400, skewed=True)
    base = ["plan", "--data", str(data), "--dim", "8", "--sample-rows", "200"]
    assert cli.main([*base, "--budget-gb", "0.000008"]) == 0
    assert "warning" not in capsys.readouterr().err  # fits this machine

    monkeypatch.setenv(memory.ENV_AVAILABLE, "0.5")  # less than the runtime alone: nothing fits
    out = tmp_path / "plan.toml"
    assert cli.main([*base, "--budget-gb", "0.000008", "--out", str(out)]) == 0  # a plan for another machine
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("slipcache plan: warning: does not fit this machine: plan: ") and "available 0.5 GB" in err
    assert out.is_file()

    monkeypatch.setenv(memory.ENV_AVAILABLE, "1.001")  # the small plan fits, a budget of 0.5 GB would not
    assert cli.main([*base, "--budget-gb", "0.5"]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--budget-gb 0.5 is more than this machine has available for tables (0.0 GB)" in err


def test_the_plan_plot_names_the_largest_tables_and_groups_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    from slipcache.planning.cli import NAMED_CURVES

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its legend
    data = make_dataset(tmp_path / "data", n=800, skewed=True)
    assert cli.main(["plan", "--data", str(data), "--budget-gb", "0.000008", "--out", str(tmp_path / "p.toml")]) == 0
    (figure,) = figures
    legend = figure.axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(texts) == NAMED_CURVES + 1 and texts[-1] == f"{26 - NAMED_CURVES} smaller tables"
    assert texts[0].startswith("C3 (50 rows)")  # the largest table first (helpers.SIZES)
    colours = [tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color()
               for line in legend.get_lines()]
    assert len(set(colours)) == len(colours)  # every named table its own colour, the rest one grey


@pytest.mark.usefixtures("private_cache_dir")
def test_plan_toml_parses_with_a_newline_in_the_data_path(tmp_path: Path) -> None:
    import tomllib

    data = make_dataset(tmp_path / "odd\nname", n=400)
    out = tmp_path / "plan.toml"
    assert main(["plan", "--data", str(data), "--budget-gb", "0.001", "--out", str(out), "--no-progress"]) == 0
    parsed = tomllib.loads(out.read_text())
    assert parsed.get("train", parsed)["data"] == str(data)


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.slow
def test_plan_out_replaces_only_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = make_dataset(tmp_path / "d", n=400)
    notes = tmp_path / "notes.toml"
    notes.write_text("mine = 1\n")
    argv = ["plan", "--data", str(data), "--budget-gb", "0.001", "--no-progress", "--out"]
    cli_fails([*argv, str(notes)], capsys, "exists and is not a plan written by slipcache plan")
    assert notes.read_text() == "mine = 1\n"
    assert main([*argv, str(tmp_path / "plan.toml")]) == 0
    assert main([*argv, str(tmp_path / "plan.toml")]) == 0  # its own plan: replaced



def test_the_sharding_preview_weights_shards_by_the_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--world-size` plans with the profile's histograms and lookups per sample, by the plan's table names."""
    pytest.importorskip("torchrec", reason="torchrec not installed (the torchrec extra)")
    from slipcache.interop import torchrec_planner
    from slipcache.planning.cli import preview_sharding

    given: list[Any] = []
    planner = torchrec_planner.slipcache_planner

    def recording(*args: Any, **kwargs: Any) -> Any:
        given.append(kwargs.get("lookups"))
        return planner(*args, **kwargs)

    monkeypatch.setattr(torchrec_planner, "slipcache_planner", recording)
    profile = _skewed_profile()
    plan = make_plan(profile, 1e9, 16, names=["small", "skewed", "uniform"])
    sharding = preview_sharding(plan, profile, 2)
    assert {s["table"] for s in sharding["shards"]} == {"small", "skewed", "uniform"}
    (lookups,) = given
    assert list(lookups) == ["small", "skewed", "uniform"]
    assert lookups["skewed"].histogram == tuple(profile.tables[1].histogram.tolist())
    assert lookups["skewed"].lookups_per_sample == profile.tables[1].lookups_per_sample == 1.0
