"""The best AUC a model can reach on generated data: the teacher's test AUC and the coverage ceilings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data.synthetic import generate_synthetic
from slipcache.data.synthetic.ceiling import CoverageCeiling
from slipcache.data.synthetic.generate import _log_rows, make_generator, split_bounds
from slipcache.data.synthetic.regenerate import dataset_ceiling
from slipcache.errors import SlipcacheError
from slipcache.metrics import auc
from slipcache.training.cli import format_summary

ROWS = 60_000


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ceiling") / "data"
    generate_synthetic(out, num_samples=ROWS, scale=0.01, seed=5, progress=False)
    return out


def test_generation_records_ceilings_that_fall_as_rarer_values_are_removed(generated: Path) -> None:
    meta = json.loads((generated / "meta.json").read_text())
    ceiling = meta["ceiling"]
    coverage = ceiling["coverage_auc"]
    assert ceiling["test_rows"] == int(ROWS * 0.1)
    assert ceiling["teacher_auc"] == pytest.approx(meta["teacher_auc"])  # all test rows are scored here
    assert ceiling["teacher_auc"] > coverage["1"] > coverage["10"] > coverage["100"] > 0.5


def test_removing_every_value_leaves_the_dense_term_alone(generated: Path) -> None:
    """With k above every count, each source's row is the zero row: what is left is the dense features' AUC."""
    gen = make_generator("v5", 0.01, 5, num_samples=ROWS)
    gen.calibrate()
    bounds = split_bounds(ROWS, 0.1, 0.1, "slipcache")
    ceiling = CoverageCeiling(gen, ks=(ROWS + 1,))
    labels, dense_only = [], []
    for start, end, dense, _, _, chunk_labels, (params, sources) in _log_rows(gen, 5, ROWS):
        lo, hi = max(bounds["test"][0], start) - start, end - start
        ceiling.add_train(sources[: max(0, min(bounds["train"][1], end) - start)])
        if lo < hi:
            ceiling.add_test(dense[lo:hi], params[lo:hi], sources[lo:hi], chunk_labels[lo:hi])
            zero = np.full_like(params[lo:hi], len(gen.first_order) - 1)
            dense_only.append(gen.logits(gen.terms(dense[lo:hi], zero)))
            labels.append(chunk_labels[lo:hi])
    result = ceiling.result()
    assert result is not None
    expected = auc(np.concatenate(labels), np.concatenate(dense_only))
    assert result["coverage_auc"][str(ROWS + 1)] == pytest.approx(expected, abs=1e-12)
    assert 0.5 < expected < result["teacher_auc"]


def test_a_dataset_without_a_recorded_ceiling_gets_it_by_generating_again(generated: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    meta = json.loads((generated / "meta.json").read_text())
    recorded = meta.pop("ceiling")
    (copy / "meta.json").write_text(json.dumps(meta))
    assert dataset_ceiling(copy, progress=False) == recorded
    meta["teacher_auc"] += 0.01  # rows that cannot be the ones recorded
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SlipcacheError, match="were not reproduced"):
        dataset_ceiling(copy, progress=False)


def test_other_data_has_no_known_ceiling(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(json.dumps({"source": {"format": "criteo-kaggle"}}))
    with pytest.raises(SlipcacheError, match="no ceiling is known"):
        dataset_ceiling(tmp_path)
    with pytest.raises(SlipcacheError, match="no ceiling is known"):
        dataset_ceiling(tmp_path / "train.txt")


def test_stats_reports_the_ceiling(generated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stats.json"
    assert main(["stats", str(generated), "--ceiling", "--json", str(out), "--no-progress"]) == 0
    ceiling = json.loads(out.read_text())["ceiling"]
    assert set(ceiling["coverage_auc"]) == {"1", "10", "100"} and ceiling["teacher_auc"] > 0.7
    assert f"teacher AUC {ceiling['teacher_auc']:.4f}" in capsys.readouterr().out


def test_the_training_summary_says_how_far_the_model_is_from_the_ceiling() -> None:
    summary = {
        "auc": 0.70, "logloss": 0.5, "normalized_entropy": 0.9, "embedding_bytes": 1, "fp32_embedding_bytes": 2,
        "memory_ratio": 2.0, "samples_per_s": 1.0, "train_wall_s": 1.0, "train_samples": 1,
        "ceiling": {"teacher_auc": 0.80, "coverage_auc": {"1": 0.77, "10": 0.74, "100": 0.73}, "test_rows": 9},
    }  # fmt: skip
    assert "0.7400 (values seen >= 10 times), 0.0400 to go" in format_summary(summary)
