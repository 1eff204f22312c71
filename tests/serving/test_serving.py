"""Serving end to end: `slipcache export` writes the whole model, `slipcache.load_model` scores as the trained
model does, and `slipcache predict` maps new raw rows with the run's vocabulary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import slipcache
from slipcache import cli, metrics
from slipcache.errors import SlipcacheError
from slipcache.predict import StreamingMetrics, predict
from slipcache.training import trainer as train
from slipcache.training.saved_run import find_checkpoint, load_saved_model
from tests.helpers import CriteoRows, make_dataset, tiny_config


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run trained on a raw TSV file (frequency vocabulary, INT8 tables behind a cache), and its export."""
    root = tmp_path_factory.mktemp("serving")
    rows = CriteoRows(n=800, seed=3)
    raw = rows.write_tsv(root / "day.tsv")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIPCACHE_CACHE_DIR", str(root / "cache"))
        config = tiny_config(raw, root / "run", embeddings="cached", precision="int8", cache_size=0.3, epochs=2,
                             vocab="frequency")
        train.train(config)
    assert cli.main(["export", "--checkpoint", str(root / "run"), "--out", str(root / "export")]) == 0
    dataset = Path(json.loads((root / "run" / "config.json").read_text())["dataset"])
    return {"root": root, "raw": raw, "run": root / "run", "export": root / "export", "dataset": dataset}


def _trained(run: Path) -> torch.nn.Module:
    saved = find_checkpoint(run).read()
    model = load_saved_model(saved, 13)
    model.eval()
    return model


def _inputs(sizes: list[int], n: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(n, 13, generator=gen) * 5
    sparse = torch.stack([torch.randint(0, s, (n,), generator=gen) for s in sizes], dim=1)
    return dense, sparse


def test_every_export_file_reads_with_weights_only(raw_run: dict[str, Path]) -> None:
    export = raw_run["export"]
    for name in ("model.pt", "vocabulary.pt", "embedding_bags.pt", "torchrec_ebc.pt", "fbgemm_int8.pt",
                 "fbgemm_tbe_int8.pt"):
        torch.load(export / name, weights_only=True)
    info = json.loads((export / "model.json").read_text())
    assert info["format"] == "slipcache-model" and info["vocabulary"]["kind"] == "frequency"
    assert info["model"]["bottom_mlp"] == [16, 8] and info["model"]["num_dense"] == 13
    dense = torch.load(export / "model.pt", weights_only=True)
    assert set(dense) == {"bottom.0.weight", "bottom.0.bias", "bottom.2.weight", "bottom.2.bias",
                          "top.0.weight", "top.0.bias", "top.2.weight", "top.2.bias"}


def test_load_model_scores_as_the_trained_model(raw_run: dict[str, Path]) -> None:
    trained = _trained(raw_run["run"])
    dense, sparse = _inputs(trained.config.table_sizes)
    with torch.no_grad():
        expected = torch.sigmoid(trained(dense, sparse))
    for where in (raw_run["export"], raw_run["run"], raw_run["run"] / "checkpoints" / "latest.pt"):
        model = slipcache.load_model(where)
        assert isinstance(model, torch.nn.Module) and not model.training
        torch.testing.assert_close(model(dense, sparse), expected, rtol=0, atol=1e-6)
        assert model.vocabulary.kind == "frequency"


def test_load_model_from_an_int8_only_export(raw_run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "int8"
    assert cli.main(["export", "--checkpoint", str(raw_run["run"]), "--out", str(out), "--format", "int8"]) == 0
    model = slipcache.load_model(out)
    exact = slipcache.load_model(raw_run["export"])
    dense, sparse = _inputs(model.table_sizes)
    # INT8 rows are within half a step of the fp32 ones: the scores move only a little.
    torch.testing.assert_close(model(dense, sparse), exact(dense, sparse), rtol=0, atol=2e-2)


def test_predict_raw_rows_score_as_their_preprocessed_split(raw_run: dict[str, Path], tmp_path: Path) -> None:
    """The raw file's last rows are the dataset's test split: scored from text through the vocabulary they
    equal the scores of the preprocessed ids, and the metrics equal `slipcache eval`'s."""
    from slipcache.training.cli import evaluate_checkpoint

    text, npy, held = tmp_path / "out" / "scores.txt", tmp_path / "scores.npy", tmp_path / "test.npy"
    assert cli.main(["predict", "--checkpoint", str(raw_run["export"]), str(raw_run["raw"]), "--out", str(text),
                     "--no-progress"]) == 0
    assert cli.main(["predict", "--checkpoint", str(raw_run["run"]), str(raw_run["raw"]), "--out", str(npy),
                     "--no-progress"]) == 0
    assert cli.main(["predict", "--checkpoint", str(raw_run["export"]), str(raw_run["dataset"]), "--out", str(held),
                     "--split", "test", "--no-progress"]) == 0
    from_text = np.loadtxt(text, dtype=np.float64)
    from_npy = np.load(npy)
    test = np.load(held)
    assert from_text.shape == (800,) and from_npy.shape == (800,) and from_npy.dtype == np.float32
    np.testing.assert_allclose(from_text, from_npy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(from_npy[-len(test):], test, rtol=0, atol=1e-6)
    labels = np.load(raw_run["dataset"] / "test.labels.npy")
    scores = evaluate_checkpoint(raw_run["run"], split="test")
    assert metrics.auc(labels, test) == pytest.approx(scores["auc"], abs=1e-6)
    assert [p.name for p in text.parent.iterdir()] == ["scores.txt"]  # no temporary file left


def test_predict_counts_and_reports_values_never_seen(raw_run: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    rows = CriteoRows(n=50, seed=3)
    rows.categorical[:10, 2] = 0xDEADBEEF  # a value the training rows never had
    new = rows.write_kaggle_csv(tmp_path / "new.csv")
    model = slipcache.load_model(raw_run["export"])
    scored = predict(model, [new], tmp_path / "s.txt")
    assert scored.rows == 50 and scored.unseen is not None and scored.unseen[2] >= 10
    assert cli.main(["predict", "--checkpoint", str(raw_run["export"]), str(new), "--out", str(tmp_path / "t.txt"),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "AUC" in out and "log loss" in out and "unseen values:" in out and "C3" in out
    # the unseen rows are scored with the table's row 0, as in training
    dense, ids, _ = model.encode_raw(rows.dense[:10], rows.categorical[:10])
    assert (ids[:, 2] == 0).all()


def test_predict_float_csv_and_gzip_are_the_same_rows(raw_run: dict[str, Path], tmp_path: Path) -> None:
    import gzip

    rows = CriteoRows(n=120, seed=9)
    model = slipcache.load_model(raw_run["export"])
    tsv = rows.write_tsv(tmp_path / "a.tsv", cut=True)
    csv = rows.write_float_csv(tmp_path / "b.csv")
    gz = tmp_path / "c.gz"
    gz.write_bytes(gzip.compress(rows.write_kaggle_csv(tmp_path / "c.csv").read_bytes()))
    outs = []
    for i, path in enumerate((tsv, csv, gz)):
        predict(model, [path], tmp_path / f"{i}.npy")
        outs.append(np.load(tmp_path / f"{i}.npy"))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_predict_with_a_hash_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path / "cache"))
    raw = CriteoRows(n=300, seed=4).write_tsv(tmp_path / "day.tsv")
    train.train(tiny_config(raw, tmp_path / "run", vocab="hash", max_rows=64, epochs=1))
    model = slipcache.load_model(tmp_path / "run")
    assert model.vocabulary.kind == "hash" and model.table_sizes == [64] * 26
    scored = predict(model, [raw], tmp_path / "s.npy")
    dataset = Path(json.loads((tmp_path / "run" / "config.json").read_text())["dataset"])
    held = predict(model, [dataset], tmp_path / "t.npy", split="test")
    assert scored.unseen is None and scored.rows == 300
    np.testing.assert_allclose(np.load(tmp_path / "s.npy")[-held.rows:], np.load(tmp_path / "t.npy"), atol=1e-6)
    assert cli.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    exported = slipcache.load_model(tmp_path / "export")
    assert exported.vocabulary.kind == "hash" and exported.vocabulary.max_rows == 64
    predict(exported, [raw], tmp_path / "e.npy")
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), np.load(tmp_path / "s.npy"), atol=1e-6)


def test_a_run_on_ids_refuses_raw_files_in_one_line(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data", n=400)
    train.train(tiny_config(data, tmp_path / "run", epochs=1))
    raw = CriteoRows(n=20).write_tsv(tmp_path / "day.tsv")
    model = slipcache.load_model(tmp_path / "run")
    with pytest.raises(SlipcacheError, match="raw Criteo files cannot be scored with this model"):
        predict(model, [raw], tmp_path / "s.txt")
    assert not (tmp_path / "s.txt").exists()
    scored = predict(model, [data], tmp_path / "s.txt", split="val")  # its own kind of data: fine
    assert scored.rows == 100 and len((tmp_path / "s.txt").read_text().splitlines()) == 100
    assert cli.main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    exported = slipcache.load_model(tmp_path / "export")
    assert json.loads((tmp_path / "export" / "model.json").read_text())["vocabulary"]["kind"] == "ids"
    assert not (tmp_path / "export" / "vocabulary.pt").exists()
    with pytest.raises(SlipcacheError, match="synthetic data|ids that are already rows"):
        predict(exported, [raw], tmp_path / "e.txt")
    predict(exported, [data], tmp_path / "e.txt", split="val")
    np.testing.assert_allclose(np.loadtxt(tmp_path / "e.txt"), np.loadtxt(tmp_path / "s.txt"), atol=2e-6)


def test_predict_checks_its_output_before_any_work(raw_run: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import slipcache.serving

    def no_loading(path: object) -> None:
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(slipcache.serving, "load_model", no_loading)
    args = ["predict", "--checkpoint", str(raw_run["export"]), str(raw_run["raw"]), "--no-progress", "--out"]
    (tmp_path / "taken.txt").write_text("mine\n")
    (tmp_path / "target").write_text("keep\n")
    os.symlink(tmp_path / "target", tmp_path / "link.txt")
    for out, message in ((tmp_path / "taken.txt", "exists; choose a new name, or --force"),
                         (tmp_path, "is a directory"),
                         (tmp_path / "link.txt", "is a symbolic link")):
        assert cli.main([*args, str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert (tmp_path / "taken.txt").read_text() == "mine\n" and (tmp_path / "target").read_text() == "keep\n"
    missing = ["predict", "--checkpoint", str(raw_run["export"]), str(tmp_path / "missing.tsv"), "--out",
               str(tmp_path / "x.txt")]
    assert cli.main(missing) == 2 and "no such file" in capsys.readouterr().err
    monkeypatch.undo()
    # --force replaces the file; the parent directories of a new name are created
    assert cli.main([*args, str(tmp_path / "taken.txt"), "--force"]) == 0
    assert len((tmp_path / "taken.txt").read_text().splitlines()) == 800
    assert cli.main([*args, str(tmp_path / "new" / "dir" / "s.txt")]) == 0


def test_a_malformed_line_stops_predict_unless_skipped(raw_run: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lines = raw_run["raw"].read_text().splitlines()[:30]
    lines[5] = "garbage"
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    args = ["predict", "--checkpoint", str(raw_run["export"]), str(bad), "--no-progress", "--out"]
    assert cli.main([*args, str(tmp_path / "a.txt")]) == 2
    assert "bad.tsv:6:" in capsys.readouterr().err and not (tmp_path / "a.txt").exists()
    assert cli.main([*args, str(tmp_path / "b.txt"), "--skip-malformed"]) == 0
    assert len((tmp_path / "b.txt").read_text().splitlines()) == 29
    assert "1 malformed lines were skipped" in capsys.readouterr().err


def test_streaming_metrics_match_the_exact_ones() -> None:
    rng = np.random.default_rng(0)
    labels = (rng.random(200_000) < 0.25).astype(np.float32)
    probs = 1 / (1 + np.exp(-(rng.normal(0, 1, labels.size) + 1.2 * labels - 1.2)))
    probs = probs.astype(np.float32)
    streamed = StreamingMetrics()
    for start in range(0, labels.size, 30_000):
        streamed.add(labels[start:start + 30_000], probs[start:start + 30_000])
    result = streamed.result()
    assert result["rows"] == labels.size
    assert result["auc"] == pytest.approx(metrics.auc(labels, probs), abs=1e-4)
    assert result["logloss"] == pytest.approx(metrics.log_loss(labels, probs), rel=1e-6)
    ties = StreamingMetrics()
    ties.add(np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.9, 0.1], dtype=np.float32))
    assert ties.result()["auc"] == pytest.approx(metrics.auc([1, 0, 1, 0], [0.5, 0.5, 0.9, 0.1]))


def test_export_without_the_runs_dataset_says_what_is_missing(raw_run: dict[str, Path], tmp_path: Path) -> None:
    """A frequency vocabulary lives in the run's dataset: when that is gone, the export still holds the model,
    and raw scoring says why it cannot map the rows."""
    import shutil

    copy = tmp_path / "dataset-copy"
    shutil.copytree(raw_run["dataset"], copy)
    shutil.rmtree(raw_run["dataset"])
    try:
        model = slipcache.load_model(raw_run["run"])
        assert model.vocabulary.kind == "missing"
        with pytest.raises(SlipcacheError, match="no longer exists"):
            predict(model, [raw_run["raw"]], tmp_path / "s.txt")
        assert slipcache.load_model(raw_run["export"]).vocabulary.kind == "frequency"  # the export kept it
    finally:
        shutil.copytree(copy, raw_run["dataset"])


def test_the_readmes_scoring_snippet_runs(raw_run: dict[str, Path]) -> None:
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Scoring new data"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    code = code.replace('"served/criteo"', repr(str(raw_run["export"])))
    code = code.replace('"day_24.gz"', repr(str(raw_run["raw"])))
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    probabilities = namespace["probabilities"]
    assert isinstance(probabilities, torch.Tensor) and probabilities.shape == (800,)
    assert bool(((probabilities > 0) & (probabilities < 1)).all())
