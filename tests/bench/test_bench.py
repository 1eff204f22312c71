"""`slipcache bench embedding` at a tiny scale: the JSON it writes, not how fast anything is."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from slipcache.bench import cli as bench
from slipcache.bench import peers as bench_peers
from slipcache.bench import timing as bench_timing
from slipcache.bench import workload as bench_workload
from slipcache.data.kaggle import KAGGLE_CARDINALITIES, kaggle_table_sizes
from slipcache.data.synthetic import synthetic_table_sizes
from slipcache.errors import SlipcacheError
from slipcache.training.config import make_config

ROW_KEYS = {
    "name",
    "impl",
    "precision",
    "cache_fraction",
    "policy",
    "dim",
    "samples_per_s",
    "ratio_vs_fbgemm_fp32",
    "samples_per_cpu_s",
    "ratio_vs_fbgemm_fp32_cpu",
    "bytes",
    "memory_ratio",
    "hit_rate",
    "bytes_moved_per_sample",
    "status",
}
TINY = ["--scale", "0.0001", "--min-rows", "50", "--batch-size", "64", "--warmup-steps", "2", "--steps", "3"]
TINY += ["--cache-warmup-steps", "4", "--rounds", "2", "--min-seconds", "0", "--profile-steps", "2"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    return parser.parse_args(["embedding", *argv])


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "out"
    assert bench.run_bench(_args(*TINY, "--skip-probes", "--out", str(out), *argv)) == 0
    assert (out / "bench.md").read_text().startswith("# slipcache bench embedding")
    return json.loads((out / "bench.json").read_text())


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("bench"), "--dims", "8,16")


@pytest.mark.slow
def test_schema(result: dict[str, Any]) -> None:
    assert {"machine", "command", "date", "rows"} <= set(result)
    assert result["command"].startswith("slipcache bench embedding")
    machine = result["machine"]
    assert machine["torch"] == torch.__version__ and machine["logical_cores"] >= 1
    rows = result["rows"]
    assert len(rows) == 2 * len(bench_peers.CONFIGS)
    assert {(r["name"], r["dim"]) for r in rows} == {(c.name, d) for c in bench_peers.CONFIGS for d in (8, 16)}
    for r in rows:
        assert set(r) >= ROW_KEYS, r
        assert r["impl"] in ("slipcache", "torch", "fbgemm")
        assert r["status"] in ("ok", "not installed") or r["status"].startswith("skipped: "), r


@pytest.mark.slow
def test_numbers_are_positive_and_finite(result: dict[str, Any]) -> None:
    for r in result["rows"]:
        if r["impl"] != "fbgemm":
            assert r["status"] == "ok", r  # torch and ours fit easily at this scale
        if r["status"] != "ok":
            continue
        assert _positive(r["samples_per_s"]) and _positive(r["bytes"]) and _positive(r["memory_ratio"]), r
        if r["impl"] == "slipcache":
            assert 0.0 <= r["hit_rate"] <= 1.0
            assert r["bytes_moved_per_sample"] >= 0 and math.isfinite(r["bytes_moved_per_sample"])
            if r["cache_fraction"] == 0:
                assert r["hit_rate"] == 0.0
            else:
                assert r["hit_rate"] > 0.0  # power-law ids: the hot rows are hit after warm-up
        else:
            assert r["hit_rate"] is None and r["bytes_moved_per_sample"] is None


@pytest.mark.slow
def test_peer_memory_ratios_and_fbgemm_ratio(result: dict[str, Any]) -> None:
    by = {(r["name"], r["dim"]): r for r in result["rows"]}
    for dim in (8, 16):
        assert by[("torch-fp32", dim)]["memory_ratio"] == 1.0
        fb32, fb16 = by[("fbgemm-fp32", dim)], by[("fbgemm-fp16", dim)]
        if fb32["status"] != "ok":
            assert all(r["ratio_vs_fbgemm_fp32"] is None for r in result["rows"] if r["dim"] == dim)
            continue
        assert fb32["ratio_vs_fbgemm_fp32"] == 1.0
        assert fb16["memory_ratio"] == pytest.approx(2.0)
        for r in result["rows"]:
            if r["dim"] == dim and r["status"] == "ok":
                assert r["ratio_vs_fbgemm_fp32"] == pytest.approx(r["samples_per_s"] / fb32["samples_per_s"])


@pytest.mark.slow
def test_memory_ratios_match_memory_report(result: dict[str, Any]) -> None:
    from slipcache.embedding.collection import CachedEmbeddingBagCollection

    sizes = kaggle_table_sizes(0.0001, min_rows=50)
    for r in result["rows"]:
        if r["impl"] != "slipcache":
            continue
        cfg = next(c for c in bench_peers.CONFIGS if c.name == r["name"])
        config = bench_peers._slipcache_config(cfg, sizes, r["dim"], 0.1, 0)
        report = CachedEmbeddingBagCollection(config).memory_report()
        assert r["bytes"] == report["total_bytes"]
        assert r["memory_ratio"] == pytest.approx(report["memory_ratio"])
        estimate = bench_peers.slipcache_static_estimate(cfg, sizes, r["dim"])
        if estimate is not None:
            assert estimate["memory_ratio"] == pytest.approx(report["memory_ratio"])


@pytest.mark.slow
def test_targets_reported(result: dict[str, Any]) -> None:
    # dims 8/16 measure no target dim for memory (64, 128): those are N/A, never a silent PASS.
    targets = {t["target"]: t for t in result["targets"]}
    assert targets["slipcache-int8-lru5 memory ratio at dim 64 >= 3.0x"]["result"] == "N/A"
    for t in result["targets"]:
        assert t["result"] in ("PASS", "MISS", "N/A")
        assert (t["result"] == "N/A") == (t["value"] is None)


def test_over_budget_configurations_are_skipped_not_allocated(tmp_path: Path) -> None:
    result = _run(tmp_path, "--dims", "64", "--memory-budget-gb", "0.000001")
    for r in result["rows"]:
        if r["impl"] == "fbgemm" and r["status"] == "not installed":
            continue
        assert r["status"].startswith("does not fit: needs "), r
        assert r["samples_per_s"] is None
        if r["impl"] != "slipcache":
            assert _positive(r["bytes"])
    by = {r["name"]: r for r in result["rows"]}
    # The module's static estimate still gives the memory figures of ours.
    assert by["slipcache-int8-lru5"]["memory_ratio"] > 3.0
    targets = {t["target"]: t for t in result["targets"]}
    assert targets["slipcache-int8-lru5 memory ratio at dim 64 >= 3.0x"]["result"] == "PASS"


@pytest.mark.slow
def test_missing_fbgemm_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_timing, "fbgemm_available", lambda: "ImportError: no module named fbgemm_gpu")
    result = _run(tmp_path, "--dims", "16", "--configs", "torch-fp32,fbgemm-fp32,fbgemm-fp16")
    by = {r["name"]: r for r in result["rows"]}
    assert by["fbgemm-fp32"]["status"] == "not installed" == by["fbgemm-fp16"]["status"]
    assert by["torch-fp32"]["status"] == "ok" and by["torch-fp32"]["ratio_vs_fbgemm_fp32"] is None


def test_user_errors() -> None:
    with pytest.raises(SlipcacheError):
        bench.run_bench(_args("--dims", "0", "--out", "unused"))
    with pytest.raises(SlipcacheError):
        bench.run_bench(_args("--configs", "nope", "--out", "unused"))
    with pytest.raises(SlipcacheError):
        bench.run_bench(_args("--memory-budget-gb", "-1", "--out", "unused"))


@pytest.mark.slow
def test_cached_configurations_warm_up_longer() -> None:
    work = bench_workload.make_workload([100, 200], batch_size=8, warmup_steps=2, timed_steps=3, cache_warmup_steps=5)
    assert work.batches.shape[0] == 8 and work.first_timed == 5
    row = bench_timing.measure(bench_peers.CONFIGS[0], 8, work, budget_bytes=1 << 30)
    assert row["status"] == "ok" and row["samples_per_s"] > 0


def test_profile_runs_batches_the_timed_section_never_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    # A replay of timed batches finds their rows cached: the profile would show a step without misses.
    work = bench_workload.make_workload([100, 200], batch_size=8, warmup_steps=1, timed_steps=2, profile_steps=3)
    assert work.batches.shape[0] == 1 + 2 + 3
    stepped: list[int] = []

    class Clock:
        seconds: dict[str, float] = dict.fromkeys(bench_timing.PHASE_NAMES, 0.0)

        def enable(self, timer: object = None) -> None: ...

        def disable(self) -> None: ...

    def step(ids: torch.Tensor, grad: torch.Tensor) -> None:
        stepped.append(next(i for i, batch in enumerate(work.batches) if torch.equal(ids, batch)))

    built = bench_peers.Built(step=step, bytes=1, fp32_bytes=1, clock=Clock())
    bench_timing._profile(built, work, work.grad(4), steps=4)
    assert stepped == [3, 4, 5, 3]


def test_workload_shape_and_skew() -> None:
    sizes = [3, 1000, 20_000]
    work = bench_workload.make_workload(sizes, batch_size=512, warmup_steps=1, timed_steps=3, seed=1)
    assert work.batches.shape == (4, 512, 3) and work.batches.dtype == torch.int64
    ids = work.batches.reshape(-1, 3)
    for t, n in enumerate(sizes):
        assert int(ids[:, t].min()) >= 0 and int(ids[:, t].max()) < n
    counts = torch.bincount(ids[:, 2], minlength=20_000).sort(descending=True).values
    assert counts[:1000].sum() / counts.sum() > 0.5  # top 5 % of rows take most lookups
    assert 0.5 < work.lookup_share_top_5pct < 1.0
    again = bench_workload.make_workload(sizes, batch_size=512, warmup_steps=1, timed_steps=3, seed=1)
    assert torch.equal(work.batches, again.batches)


def test_one_scale_for_the_generator_and_the_benchmarks() -> None:
    # "scale 0.05" is the same tables in `bench embedding`, `bench cache` and the synthetic data.
    full = kaggle_table_sizes(1.0)
    assert full == KAGGLE_CARDINALITIES and sum(full) == 33_762_577
    assert sum(kaggle_table_sizes(0.05)) == 1_688_571 and kaggle_table_sizes(0.05) == synthetic_table_sizes(0.05)
    quick = kaggle_table_sizes(0.01)
    assert max(quick) == round(10_131_227 * 0.01)
    assert all(q == n for q, n in zip(quick, full, strict=True) if n <= 100)  # small tables keep their size
    assert min(q for q, n in zip(quick, full, strict=True) if n > 100) == 100  # bigger ones stop at 100


@pytest.mark.slow
def test_rounds_are_combined_and_ours_is_profiled(result: dict[str, Any]) -> None:
    assert result["rounds"] == 2 and result["machine"]["torch_threads"] >= 1
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        assert r["rounds"] == 2 and len(r["samples_per_s_rounds"]) == 2
        assert r["samples_per_s_min"] <= r["samples_per_s"] <= r["samples_per_s_max"]
        assert len(r["samples_per_cpu_s_rounds"]) == 2 and _positive(r["samples_per_cpu_s"])
        profile = r["phase_us_per_sample"]
        if r["impl"] != "slipcache":
            assert profile is None
            continue
        assert set(profile) == {*bench_timing.PHASE_NAMES.values(), "Python overhead", "total"}
        assert all(v >= 0 for v in profile.values())
        assert sum(v for k, v in profile.items() if k != "total") == pytest.approx(profile["total"], rel=1e-6)
        assert profile["cache lookup"] > 0 and profile["forward gather/pool"] > 0


def test_phases_can_be_profiled_in_cpu_time(tmp_path: Path) -> None:
    argv = ["--dims", "8", "--configs", "slipcache-int8-lru5", "--rounds", "1", "--profile-clock", "cpu"]
    result = _run(tmp_path, *argv)
    assert result["profile_clock"] == "cpu" and "--profile-clock cpu" in result["command"]
    (row,) = result["rows"]
    assert row["status"] == "ok" and _positive(row["samples_per_cpu_s"]) and row["cpu_s"] > 0
    assert row["phase_us_per_sample"]["total"] > 0


def test_combine_rounds_takes_the_median() -> None:
    rows = [{**bench_timing._row(bench_peers.CONFIGS[0], 8), "samples_per_s": v, "load_avg_1m": 0.1}
            for v in (5.0, 1.0, 3.0)]
    row = bench_timing.combine_rounds(rows)
    assert (row["samples_per_s"], row["samples_per_s_min"], row["samples_per_s_max"]) == (3.0, 1.0, 5.0)
    rows[1]["status"] = "skipped: failed (RuntimeError: x)"
    assert bench_timing.combine_rounds(rows)["status"] == "ok in 2 of 3 rounds"


def _steady_clock(monkeypatch: pytest.MonkeyPatch, step_s: float = 0.01) -> None:
    """The timing loop's clock advances `step_s` per reading, so a test of how long it runs does not
    depend on how loaded the machine is."""
    ticks = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: step_s * next(ticks), process_time=time.process_time)
    monkeypatch.setattr(bench_timing, "time", clock)


@pytest.mark.slow
def test_timed_section_lasts_at_least_min_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    _steady_clock(monkeypatch)
    work = bench_workload.make_workload([100, 200], batch_size=8, warmup_steps=1, timed_steps=2)
    row = bench_timing.measure(bench_peers.CONFIGS[0], 8, work, budget_bytes=1 << 30, min_seconds=0.05)
    assert row["timed_steps"] == 5 and row["timed_s"] == pytest.approx(0.05)  # cycled over the two batches


def test_busy_machine_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (bench, bench_timing):  # the load before the run, and before and after each configuration
        monkeypatch.setattr(module, "_load_average", lambda: 40.0)
    result = _run(tmp_path, "--dims", "8", "--configs", "torch-fp32", "--rounds", "1")
    assert any("machine was busy" in w for w in result["warnings"])


@pytest.mark.slow
def test_bench_train_runs_each_implementation_on_the_same_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipcache.bench import train as bench_train
    from tests.helpers import make_dataset

    data = make_dataset(tmp_path / "data", n=800, sizes=[300] * 26)
    monkeypatch.setattr(bench_train, "torchrec_available", lambda: "ImportError: no module named torchrec")
    argv = ["train", "--quick", "--data", str(data), "--samples", "320", "--batch-size", "64", "--rounds", "2"]
    argv += ["--impls", "torch-fp32,torchrec-fbgemm", "--out", str(tmp_path / "out"), "--dim", "8"]
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    assert bench.run_bench(parser.parse_args(argv)) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "out" / "train_bench.json").read_text())["rows"]}
    assert rows["torchrec-fbgemm"]["status"].startswith("skipped: ImportError")
    ours = rows["torch-fp32"]
    assert ours["status"] == "ok" and len(ours["auc_rounds"]) == 2 and ours["train_samples"] == 320
    assert ours["auc_rounds"][0] == ours["auc_rounds"][1]  # same data, same seed: timing is all that varies
    assert ours["samples_per_s_min"] <= ours["samples_per_s"] <= ours["samples_per_s_max"]
    assert ours["embedding_bytes"] == 26 * 300 * 8 * 4  # --dim reached the model: fp32 tables of dim 8
    report = (tmp_path / "out" / "train_bench.md").read_text()
    assert "- machine: " in report and '"samples": 320' in report and "| torch-fp32 |" in report
    assert '"embedding_dim": 8' in report


def test_bench_train_rows_compare_speed_and_memory_with_torchrec() -> None:
    from slipcache.bench import train as bench_train

    rows = [
        {"impl": "slipcache-int8-lru5", "status": "ok", "samples_per_s": 150.0, "embedding_bytes": 100},
        {"impl": "torchrec-fbgemm", "status": "ok", "samples_per_s": 100.0, "embedding_bytes": 300},
        {"impl": "torch-fp32", "status": "skipped: no"},
    ]
    bench_train._attach_peer_ratios(rows)
    assert rows[0]["speed_vs_torchrec"] == 1.5 and rows[0]["memory_ratio_vs_torchrec"] == 3.0
    assert rows[2]["speed_vs_torchrec"] is None
    for r in rows[:2]:
        r.update(samples_per_s_min=r["samples_per_s"], samples_per_s_max=r["samples_per_s"], auc=0.5)
    assert "| 1.50x | 0.5000 | 0.000 | 3.00x | ok |" in bench_train.format_train_table(rows)


def test_torchrec_peer_trains(tmp_path: Path) -> None:
    from slipcache.bench import train as bench_train
    from tests.helpers import make_dataset

    if bench_train.torchrec_available() is not None:
        pytest.skip("torchrec is not installed")
    data = make_dataset(tmp_path / "data", n=800, sizes=[300] * 26)
    config = make_config({}, {"quick": True, "data": str(data), "samples": 640, "batch_size": 64})
    outcome = bench_train._run_torchrec(config, tmp_path)
    assert outcome["train_samples"] == 640 and 0.0 < outcome["auc"] < 1.0 and outcome["samples_per_s"] > 0


def test_hottest_counts_rank_rows_of_all_tables_by_probability() -> None:
    sizes = [3, 1000, 20_000]
    norms = [sum(k**-1.05 for k in range(1, n + 1)) for n in sizes]
    counts = bench_workload.hottest_counts(sizes, norms, 1.05, 500)
    assert sum(counts) == pytest.approx(500, abs=len(sizes)) and counts[0] == 3
    least_kept = min(counts[t] ** -1.05 / norms[t] for t in range(3))
    most_left = max((counts[t] + 1) ** -1.05 / norms[t] for t in range(3) if counts[t] < sizes[t])
    assert least_kept >= most_left  # every row kept is at least as probable as every row left out
    assert bench_workload.hottest_counts(sizes, norms, 1.05, 10**9) == sizes


def _cache_after(work: bench_workload.Workload, cfg: bench_peers.BenchConfig, prefill: bool) -> tuple[float, int]:
    """(share of cache slots holding a row, evictions in the workload's timed batches) without a warm-up."""
    built = bench_peers._build_slipcache(cfg, work.table_sizes, 8, 0.1, 0)
    if prefill:
        bench_timing._prefill(built, work, 8)
    occupied = float((built.owner.cache.slot_rows >= 0).float().mean())
    built.reset_stats()
    for i in range(work.first_timed, work.batches.shape[0]):
        built.step(work.batches[i], work.grad(8))
    return occupied, int(built.stats()["evictions"])


def test_prefill_fills_the_cache_so_timing_evicts() -> None:
    cfg = next(c for c in bench_peers.CONFIGS if c.name == "slipcache-int8-lru5")
    sizes = [20, 3000, 8000]
    work = bench_workload.make_workload(sizes, batch_size=64, warmup_steps=0, timed_steps=3, hot_rows=2 * 550)
    full, evictions = _cache_after(work, cfg, prefill=True)
    assert full > 0.98 and evictions > 0  # a set that few hot rows hash to may keep a way free
    cold, cold_evictions = _cache_after(work, cfg, prefill=False)  # the old behaviour: still filling
    assert cold < 0.8 and cold_evictions < evictions
    assert work.describe()["prefill"]
    assert not bench_workload.make_workload(sizes, batch_size=64, warmup_steps=0, timed_steps=3).describe()["prefill"]


@pytest.mark.slow
def test_bench_reports_evictions_per_step_and_keeps_no_prefill(tmp_path: Path) -> None:
    result = _run(tmp_path, "--dims", "8", "--configs", "slipcache-int8-lru5", "--rounds", "1", "--no-prefill")
    (row,) = result["rows"]
    assert "--no-prefill" in result["command"] and row.get("prefill_steps") is None
    assert row["evictions_per_step"] == row["evictions"] / row["timed_steps"]
    result = _run(tmp_path, "--dims", "8", "--configs", "slipcache-int8-lru5", "--rounds", "1")
    (row,) = result["rows"]
    assert row["prefill_steps"] > 0 and "evict/step" in (tmp_path / "out" / "bench.md").read_text()


@pytest.mark.slow
def test_a_cache_replaying_its_timed_batches_is_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _steady_clock(monkeypatch)  # 0.2 s is 20 steps of the 3 batches, on any machine
    argv = ["--dims", "8", "--configs", "slipcache-int8-lru5", "--rounds", "1"]
    plain = _run(tmp_path, *argv)  # by default no timed batch is replayed, whatever the time it takes
    assert not any("more than once" in w for w in plain["warnings"])
    assert [r["replayed_batches"] for r in plain["rows"]] == [0]
    replayed = _run(tmp_path, *argv, "--min-seconds", "0.2")
    assert any("ran over its 3 batches more than once" in w for w in replayed["warnings"])
    assert replayed["rows"][0]["replayed_batches"] == replayed["rows"][0]["timed_steps"] - 3 > 0


def test_the_recorded_command_names_huge_pages_and_the_allocators_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the bench ran with must be in the command it records, or the figures cannot be reproduced."""
    import argparse

    from slipcache.bench import cli as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_bench_arguments(parser)
    args = parser.parse_args(["embedding", "--out", str(tmp_path), "--huge-pages", "auto", "--dims", "8"])
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    command = bench_cli._command(args, [8], [])
    assert command.startswith("THP_MEM_ALLOC_ENABLE=1 slipcache bench embedding") and "--huge-pages auto" in command
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    args = parser.parse_args(["embedding", "--out", str(tmp_path), "--dims", "8"])
    command = bench_cli._command(args, [8], [])
    assert command.startswith("slipcache bench embedding") and "--huge-pages" not in command
