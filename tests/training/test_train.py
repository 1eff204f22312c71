"""End-to-end tests of the training loop on a tiny dataset (tests/helpers.py, format: docs/design.md)."""

import argparse
import json
import types
from pathlib import Path

import pytest
import torch

from slipcache import iostats
from slipcache.embedding import hostmem
from slipcache.errors import SlipcacheError
from slipcache.training import checkpoint
from slipcache.training import trainer as train
from slipcache.training.cli import (
    add_eval_arguments,
    add_train_arguments,
    evaluate_checkpoint,
    format_summary,
    run_eval,
)
from slipcache.training.config import QUICK, load_config_file, make_config
from tests.helpers import SHARED_CRITEO, SHARED_CRITEO_REASON, CriteoRows, make_dataset
from tests.helpers import tiny_config as tiny

SUMMARY_KEYS = {
    "auc",
    "logloss",
    "accuracy",
    "normalized_entropy",
    "samples_per_s",
    "train_wall_s",
    "embedding_bytes",
    "fp32_embedding_bytes",
    "memory_ratio",
    "cache_hit_rate",
    "config",
}
# A checkpoint event's bytes vary too: the file holds the events before it, their timings included.
TIMING = {"samples_per_s", "train_wall_s", "train_seconds", "train_cpu_s", "write_s", "bytes"}
# and the disk's bytes: what the page cache already held is not read again
TIMING |= {"disk_read_bytes_per_step", "disk_write_bytes_per_step", "train_disk_read_bytes"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"))


def events_without_timing(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING | {"train_wall_s"}} for line in lines
    ]


def test_end_to_end_writes_run_dir(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train.train(tiny(data_dir, run))
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.md", "training.png", "memory.png"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "latest.pt").is_file()
    on_disk = json.loads((run / "summary.json").read_text())
    assert set(on_disk) >= SUMMARY_KEYS
    assert on_disk["auc"] == pytest.approx(summary["auc"])
    assert summary["auc"] > 0.55  # learned something
    # no feature joined: the summary holds no feature's fields (a skipping run's callback adds its own)
    assert summary["memory_ratio"] == 1.0 and "skipped_fraction" not in summary and "staleness" not in summary
    assert summary["cache_hit_rate"] is None  # the baseline has no cache
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_events = [e for e in events if e["event"] == "train"]
    assert all("samples" in e and "train_loss" in e and "samples_per_s" in e for e in train_events)
    # the kernel's counts where it keeps them (Linux): disk bytes of the loop, of the start-up, per step
    disk = ("train_disk_read_bytes", "train_disk_write_bytes", "startup_disk_read_bytes")
    if iostats.disk_io() is not None:
        assert all(isinstance(on_disk[k], int) and on_disk[k] >= 0 for k in disk)
        assert all(e["disk_read_bytes_per_step"] >= 0 and e["disk_write_bytes_per_step"] >= 0 for e in train_events)
        assert train_events[-1]["train_disk_read_bytes"] == on_disk["train_disk_read_bytes"]
    if iostats.rss_anon_bytes() is not None:
        assert 0 < on_disk["peak_rss_anon_bytes"] <= on_disk["peak_rss_bytes"] * 1.05  # sampled later: a little slack
    assert any("val_auc" in e for e in events)
    config = json.loads((run / "config.json").read_text())
    assert config["samples"] == 2 * (2000 // 64) * 64 and config["dataset"] == str(data_dir)
    assert "![Training](training.png)" in (run / "report.md").read_text()


def test_train_leaves_the_callers_config_as_given(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run resolves its paths, schedule and split order on a copy: a library caller's config object is
    the one it built, reusable for the next run."""
    monkeypatch.chdir(data_dir.parent)
    config = tiny(Path(data_dir.name), Path(tmp_path.name) / "run", epochs=1, storage_path=str(tmp_path))
    config.embeddings.embeddings = "cached"
    before = config.flat()
    train.train(config)
    assert before["samples"] is None and not Path(before["data"]).is_absolute()
    assert config.flat() == before  # relative data path, no samples, intervals or split order filled in


def test_cached_embeddings_end_to_end(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train.train(
        tiny(data_dir, run, embeddings="cached", precision="int8", cache_size=0.25, epochs=1)
    )
    # Tiny tables: cache sets and quantization parameters outweigh the int8 savings, so only check the ratio.
    ratio = summary["fp32_embedding_bytes"] / summary["embedding_bytes"]
    assert summary["memory_ratio"] == pytest.approx(ratio)
    assert 0.0 < summary["cache_hit_rate"] <= 1.0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= e["hit_rate"] <= 1.0 for e in events if e["event"] == "train")
    assert (run / "hit_rate.png").is_file()


@pytest.mark.parametrize(
    "embeddings", ["torch", "cached", "cached-streamed", "cached-streamed-mapped", "cached-streamed-files"]
)
@pytest.mark.slow
def test_resume_matches_uninterrupted(
    embeddings: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed = embeddings.startswith("cached-streamed")
    with pytest.MonkeyPatch.context() as raw:
        if streamed:  # every tensor of 256 bytes and more written and read raw, as the tables of a big run
            raw.setattr(checkpoint, "RAW_MIN_BYTES", 256)
        if embeddings.endswith("mapped"):  # every host tensor of the tables in a huge-page memory map
            raw.setattr(hostmem, "MIN_BYTES", 1)
            raw.setattr(hostmem, "thp_setting", lambda path=None: "madvise")
        rows = tmp_path / "rows"
        extra: dict[str, object] = {"storage_path": str(rows)} if embeddings.endswith("files") else {}
        if embeddings.endswith("mapped"):
            extra["huge_pages"] = "on"
        _resume_matches_uninterrupted("cached" if streamed else embeddings, data_dir, tmp_path, monkeypatch, extra)
        assert not rows.exists() or list(rows.iterdir()) == []
        lazy = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints", lazy=True)
        assert (checkpoint.tensor_bytes(lazy, checkpoint.RawTensor) > 0) is streamed


def _resume_matches_uninterrupted(
    embeddings: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: dict | None = None
) -> None:
    settings = {"embeddings": embeddings, "cache_size": 0.25, **(extra or {})}
    full = train.train(tiny(data_dir, tmp_path / "full", **settings))

    real_loss = torch.nn.functional.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def crash_midway(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 45:  # epoch 1, after the checkpoint at 640 samples (10 steps) and 1920 (30 steps)
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny(data_dir, tmp_path / "part", **settings))
    monkeypatch.undo()
    state = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints")
    assert state["progress"]["samples"] == 2560  # last periodic checkpoint before the crash

    resumed = train.train(make_config({}, {"resume": str(tmp_path / "part"), "progress": False}))
    for key in ("auc", "logloss", "accuracy", "normalized_entropy", "train_samples"):
        assert resumed[key] == full[key], key
    assert events_without_timing(tmp_path / "part") == events_without_timing(tmp_path / "full")
    a = checkpoint.load_checkpoint(tmp_path / "full" / "checkpoints")
    b = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints")
    for name, tensor in a["dense"].items():
        assert torch.equal(tensor, b["dense"][name]), name
    for name, tensor in a["embeddings"].items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, b["embeddings"][name]), name


def test_resume_refuses_changes_to_the_run_unless_allowed(data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "r"
    first = train.train(tiny(data_dir, run, epochs=1))
    resume = {"resume": str(run), "progress": False}
    with pytest.raises(SlipcacheError, match=r"change the run's definition \(lr 0.3 -> 0.5\).*--allow-changes"):
        train.train(make_config({}, {**resume, "lr": 0.5}))
    # --quick on a finished run: it would extend the budget and replace the results (issue 12, item 10)
    with pytest.raises(SlipcacheError, match=r" samples 1984 -> 600000.*quick False -> True"):
        train.train(make_config({}, {**resume, "quick": True}))
    with pytest.raises(SlipcacheError, match="cannot change bottom_mlp, embedding_dim when resuming"):
        train.train(make_config({}, {**resume, "embedding_dim": 4, "allow_changes": True}))
    assert json.loads((run / "summary.json").read_text())["train_samples"] == first["train_samples"]
    longer = train.train(make_config({}, {**resume, "samples": 2560, "allow_changes": True}))
    assert longer["train_samples"] == 2560
    assert longer["config"]["changed_on_resume"] == [{"samples": 1984, "changes": {"samples": [1984, 2560]}}]


def test_nan_loss_stops_with_checkpoint_intact(tmp_path: Path) -> None:
    bad = make_dataset(tmp_path / "bad", nan_row=0)
    run = tmp_path / "run"
    # Unshuffled order is unknown, so make every train row NaN after the first and check the message.
    with pytest.raises(SlipcacheError, match="loss is nan"):
        train.train(tiny(bad, run))
    assert not (run / "summary.json").exists()


def test_nan_loss_after_checkpoint(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_loss = torch.nn.functional.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def nan_after_20(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if calls["n"] > 20 else loss

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", nan_after_20)
    run = tmp_path / "run"
    with pytest.raises(SlipcacheError, match="last good checkpoint") as info:
        train.train(tiny(data_dir, run))
    assert "\n" not in str(info.value)
    state = checkpoint.load_checkpoint(run / "checkpoints")
    assert state["progress"]["samples"] == 1280
    assert all(torch.isfinite(t).all() for t in state["dense"].values())


def parse_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(argv)


def test_config_file_and_flag_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.05\nbatch-size = 256\npolicy = "lfu"\nbottom_mlp = [32, 16]\n')
    file_values = load_config_file(toml)
    args = parse_flags(["--config", str(toml), "--lr", "0.2"])
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    config = make_config(file_values, flags)
    assert config.embeddings.lr == 0.2  # flag beats file
    assert config.schedule.batch_size == 256 and config.embeddings.policy == "lfu"  # file beats default
    assert config.embeddings.precision == "int8"  # default

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("quick: true\nbatch_size: 128\n")
    quick = make_config(load_config_file(yaml_file), {})
    assert quick.schedule.batch_size == 128  # an explicit value beats the --quick preset
    assert quick.schedule.samples == QUICK["samples"]


def test_config_file_errors(tmp_path: Path) -> None:
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text("learning_rate: 0.1\n")
    with pytest.raises(SlipcacheError, match="unknown key 'learning_rate'"):
        load_config_file(bad_key)
    for text, meant in [("dim: 8\n", "the flag --dim is the key 'embedding_dim'"),
                        ("batchsize: 8\n", "did you mean 'batch_size'"),
                        ("no_stale_guard: true\n", "the flag --no-stale-guard is the key 'stale_guard' set to false"),
                        ("learning_rate: 0.1\n", "did you mean 'lr'"),
                        ("zzz: 1\n", "--help-all. lists every setting")]:
        bad_key.write_text(text)
        with pytest.raises(SlipcacheError, match=meant):
            load_config_file(bad_key)
    bad_type = tmp_path / "t.toml"
    bad_type.write_text('batch_size = "big"\n')
    with pytest.raises(SlipcacheError, match="batch_size"):
        load_config_file(bad_type)
    with pytest.raises(SlipcacheError, match="not found"):
        load_config_file(tmp_path / "missing.toml")
    with pytest.raises(SlipcacheError, match="precision"):
        make_config({}, {"precision": "int3"})


def test_eval_checkpoint_and_vocab_mismatch(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    summary = train.train(tiny(data_dir, run, epochs=1))
    scores = evaluate_checkpoint(run, split="test")
    assert scores["auc"] == pytest.approx(summary["auc"])
    parser = argparse.ArgumentParser()
    add_eval_arguments(parser)
    assert run_eval(parser.parse_args(["--checkpoint", str(run / "checkpoints" / "latest.pt")])) == 0
    assert "auc" in capsys.readouterr().out
    other = make_dataset(tmp_path / "other", sizes=[21, 7, 50] + [5] * 23)
    with pytest.raises(SlipcacheError, match="table 0 has 21 rows vs 20.*; to score other data with the run's own "
                       "vocabulary: slipcache predict --checkpoint"):
        evaluate_checkpoint(run, data=str(other))


def test_bad_checkpoint_is_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "x.pt").write_bytes(b"junk")
    with pytest.raises(SlipcacheError, match="not a slipcache checkpoint"):
        evaluate_checkpoint(tmp_path / "x.pt")


@pytest.mark.slow  # ~30 s on 2 idle cores (first run also generates the 800k-row synthetic dataset)
def test_quick_run_from_the_command_line(quick_run: tuple[Path, str]) -> None:
    """`slipcache train --quick`: synthetic data, recommended settings, AUC > 0.70."""
    run, out = quick_run
    assert "AUC (test)" in out and "samples/s" in out
    assert out.count(f"run: {run}\n") <= 1 and f"finished: {run}\n" in out  # named once at the start, once at the end
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auc"] > 0.70
    assert summary["config"]["precision"] == "int8" and summary["config"]["embeddings"] == "cached"


RAW_TSV = SHARED_CRITEO / "kaggle_train_head.tsv"


def test_train_and_preprocess_build_the_same_tables_from_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default `train --data FILE` builds the tables `preprocess FILE` builds: a row per value seen in train
    (not 26 hashed tables of 1 M rows each); the hash vocabulary stays an explicit choice."""
    import numpy as np

    from slipcache.cli import main

    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    raw = CriteoRows(n=400, seed=5).write_tsv(tmp_path / "day.tsv")
    assert main(["preprocess", str(raw), "--out", str(tmp_path / "pp"), "--quiet"]) == 0
    summary = train.train(tiny(raw, tmp_path / "run", epochs=1))
    trained_on = Path(summary["config"]["dataset"])
    ours, theirs = (json.loads((d / "meta.json").read_text()) for d in (trained_on, tmp_path / "pp"))
    assert ours["vocabulary"] == theirs["vocabulary"] == "frequency"
    assert ours["table_sizes"] == theirs["table_sizes"] and max(ours["table_sizes"]) <= 400
    with np.load(trained_on / "vocab.npz") as a, np.load(tmp_path / "pp" / "vocab.npz") as b:
        assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    hashed = train.prepare_data(tiny(raw, tmp_path / "run2", vocab="hash", max_rows=64))
    assert json.loads((hashed / "meta.json").read_text())["table_sizes"] == [64] * 26


@pytest.mark.skipif(not RAW_TSV.is_file(), reason=SHARED_CRITEO_REASON)
@pytest.mark.parametrize("vocab", ["hash", "frequency"])
def test_raw_criteo_file_is_preprocessed_into_the_cache(
    vocab: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny(RAW_TSV, tmp_path / "runs" / "a", vocab=vocab, max_rows=1000, epochs=1)
    summary = train.train(config)
    dataset = Path(summary["config"]["dataset"])
    assert dataset.parent == tmp_path / "cache" / "preprocessed" and (dataset / "meta.json").is_file()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["a"]  # nothing beside the run directory
    sizes = json.loads((dataset / "meta.json").read_text())["table_sizes"]
    assert (sizes == [1000] * 26) == (vocab == "hash")
    assert train.prepare_data(config) == dataset  # cached, not redone


def test_eval_schedule_in_samples_and_train_seconds_exclude_eval(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--eval-every counts samples (not rounded to batches); train_seconds leaves evaluation and checkpoints out."""
    clock = {"now": 0.0}

    def tick() -> float:
        clock["now"] += 0.001
        return clock["now"]

    def slow(function: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            clock["now"] += 1000.0  # each evaluation or checkpoint "takes" 1000 s
            return function(*args, **kwargs)  # type: ignore[operator]

        return wrapped

    monkeypatch.setattr(train, "time", types.SimpleNamespace(perf_counter=tick, process_time=tick))
    monkeypatch.setattr(train, "evaluate", slow(train.evaluate))
    monkeypatch.setattr(train.ckpt, "save_run_checkpoint", slow(train.ckpt.save_run_checkpoint))
    run = tmp_path / "run"
    train.train(tiny(data_dir, run, epochs=1, eval_every=600, eval_samples=100))
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if "val_auc" in e]
    assert [e["samples"] for e in evals] == [640, 1216, 1856, 1984]  # first batch end past each 600; the end
    assert all(e["val_samples"] == 100 for e in evals)
    seconds = [e["train_seconds"] for e in evals]
    assert seconds == sorted(seconds) and 0 < seconds[-1] < 1000
    cpu = [e["train_cpu_s"] for e in evals]  # the same span by the process CPU clock: evaluation left out too
    assert cpu == sorted(cpu) and 0 < cpu[-1] < 1000


def test_summary_table_shows_the_skipped_share_of_a_skipping_run() -> None:
    summary = {
        "auc": 0.75, "logloss": 0.5, "normalized_entropy": 0.87, "embedding_bytes": 1 << 20,
        "fp32_embedding_bytes": 3 << 20, "memory_ratio": 3.0, "samples_per_s": 1000.0, "train_wall_s": 2.0,
        "train_samples": 2000, "cache_hit_rate": 0.9, "skipped_fraction": 0.1586, "staleness": None,
    }  # fmt: skip
    assert "skipped" not in format_summary(summary)
    summary["staleness"] = {"skipped_fraction": 0.1586}
    assert "skipped as stale    15.9% of inputs" in format_summary(summary)


@pytest.mark.slow
def test_a_library_call_puts_the_process_settings_back(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--threads holds for the run only: a caller of `train` gets its own settings back; --huge-pages is a
    setting of the run's tables, not of the process."""
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    seen: dict[str, object] = {}
    real_finish = train.finish_run

    def finish(loop: train.Loop) -> object:  # inside the run: its settings hold
        seen.update(threads=torch.get_num_threads(), mode=loop.run.model.embeddings.config.huge_pages)
        return real_finish(loop)

    monkeypatch.setattr(train, "finish_run", finish)
    train.train(tiny(data_dir, tmp_path / "run", threads=wanted, huge_pages="auto", embeddings="cached"))
    assert seen == {"threads": wanted, "mode": "auto"}
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_a_resume_draws_no_initial_rows(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row comes from the checkpoint: the initial draw (minutes at the MLPerf sizes) is skipped."""
    from slipcache.embedding.collection import CachedEmbeddingBagCollection

    run = tmp_path / "run"
    train.train(tiny(data_dir, run, embeddings="cached", epochs=1))
    drawn: list[int] = []
    monkeypatch.setattr(CachedEmbeddingBagCollection, "_initialize_rows", lambda self: drawn.append(1))
    resumed = train.train(make_config({}, {"resume": str(run), "progress": False, "allow_changes": True, "epochs": 2}))
    assert drawn == [] and resumed["train_samples"] > 0
