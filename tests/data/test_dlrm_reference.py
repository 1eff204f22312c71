"""The DLRM reference's own output directory, built from real Criteo rows, read and trained on.

`write_reference_output` lays out what the reference's Kaggle preprocessing leaves behind: the raw per-day
`train_day_{i}.npz`, the processed `train_day_{i}_processed.npz` (X_cat the transpose of a float64
array, so Fortran-ordered; X_int clipped at 0), `train_fea_count.npz`, `train_day_count.npz` and the
combined `kaggleAdDisplayChallenge_processed.npz`, all `np.savez_compressed`; rows split into 7 days
with the leftover rows on the first days.
"""

from pathlib import Path

import numpy as np
import pytest

from slipcache.data import formats
from slipcache.data.preprocess import dense_transform
from slipcache.training import trainer as train
from tests.helpers import SHARED_CRITEO, SHARED_CRITEO_REASON, tiny_config

CRITEO = SHARED_CRITEO / "kaggle_train_head.tsv"
DAYS = 7
ROWS = 993  # 6 days of 142 and a last day of 141: an odd last day shows which half takes the extra row


def _criteo_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, raw integer features (missing: 0) and hex categories as ints (missing: 0), as parsed by
    the reference."""
    if not CRITEO.is_file():
        pytest.skip(SHARED_CRITEO_REASON)
    labels, ints, cats = [], [], []
    for line in CRITEO.read_text().splitlines()[:ROWS]:
        fields = (line.split("\t") + [""] * 40)[:40]
        labels.append(int(fields[0]))
        ints.append([int(x) if x else 0 for x in fields[1:14]])
        cats.append([int(x, 16) if x else 0 for x in fields[14:]])
    return np.array(labels, np.int32), np.array(ints, np.int32), np.array(cats, np.int64)


def write_reference_output(root: Path, day_counts: bool = True) -> tuple[np.ndarray, ...]:
    root.mkdir(parents=True, exist_ok=True)
    y, x_int, x_cat_raw = _criteo_rows()
    base, extra = divmod(len(y), DAYS)
    per_day = [base + (1 if d < extra else 0) for d in range(DAYS)]
    mapping = [np.unique(x_cat_raw[:, j]) for j in range(26)]
    x_cat = np.stack([np.searchsorted(mapping[j], x_cat_raw[:, j]) for j in range(26)], 1)
    counts = np.array([len(m) for m in mapping], np.int32)
    bounds = np.cumsum([0, *per_day])
    processed = []
    for d in range(DAYS):
        rows = slice(bounds[d], bounds[d + 1])
        np.savez_compressed(root / f"train_day_{d}.npz", X_int=x_int[rows], X_cat_t=x_cat_raw[rows].T, y=y[rows])
        day = {
            "X_cat": np.transpose(x_cat[rows].T.astype(np.float64)),  # Fortran-ordered float64, as written
            "X_int": np.maximum(x_int[rows], 0),
            "y": y[rows],
        }
        np.savez_compressed(root / f"train_day_{d}_processed.npz", **day)
        processed.append(day)
    np.savez_compressed(root / "train_fea_count.npz", counts=counts)
    if day_counts:
        np.savez_compressed(root / "train_day_count.npz", total_per_file=np.array(per_day))
    combined = {k: np.concatenate([p[k] for p in processed]) for k in ("X_cat", "X_int", "y")}
    np.savez_compressed(root / "kaggleAdDisplayChallenge_processed.npz", **combined, counts=counts)
    return y, np.maximum(x_int, 0), x_cat, counts


pytestmark = pytest.mark.usefixtures("private_cache_dir")


@pytest.mark.parametrize("day_counts", [True, False])
def test_reference_output_reads_the_combined_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], day_counts: bool
) -> None:
    y, x_int, x_cat, counts = write_reference_output(tmp_path / "dlrm", day_counts)
    ds = formats.open_any(tmp_path / "dlrm")
    assert "kaggleAdDisplayChallenge_processed.npz" in capsys.readouterr().err  # it says which it read
    assert Path(ds.path).is_relative_to(tmp_path / "cache" / "converted")  # converted once
    source = ds.meta["source"]
    assert source["files"] == [str(tmp_path / "dlrm" / "kaggleAdDisplayChallenge_processed.npz")]
    assert len(source["ignored"]) == DAYS
    assert ds.table_sizes == counts.tolist() and ds.meta["table_sizes_from"] == "counts"
    # 6 train days of 142 rows; the last day's 141: test takes the first 71, validation the other 70
    assert ds.splits == {"train": 852, "test": 71, "val": 70}
    np.testing.assert_array_equal(np.asarray(ds.split("train").sparse), x_cat[:852])
    np.testing.assert_array_equal(np.asarray(ds.split("test").labels), y[852:923].astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(ds.split("val").dense), dense_transform(x_int[923:].astype(np.float32)), rtol=1e-6
    )


def test_leftover_rows_go_to_the_first_days(tmp_path: Path) -> None:
    """Without a day counts file the combined file is cut as the reference cuts it: extras first."""
    y, x_int, x_cat, counts = write_reference_output(tmp_path / "dlrm", day_counts=False)
    for name in [p.name for p in (tmp_path / "dlrm").iterdir() if p.name.startswith("train_day")]:
        (tmp_path / "dlrm" / name).unlink()
    np.savez(  # uncompressed, Fortran-ordered X_cat: mappable, but converted for row reads
        tmp_path / "dlrm" / "kaggleAdDisplayChallenge_processed.npz",
        X_cat=np.asfortranarray(x_cat.astype(np.float64)),
        X_int=x_int,
        y=y,
        counts=counts,
    )
    ds = formats.open_any(tmp_path / "dlrm")
    assert ds.meta["source"]["converted_from"] == "DLRM .npz with Fortran-ordered arrays"
    assert ds.splits["train"] == 852  # 993 = 6 x 142 + 141: the six first days take the extra rows
    np.testing.assert_array_equal(np.asarray(ds.split("test").sparse), x_cat[852:923])


@pytest.mark.slow
def test_reference_output_trains(tmp_path: Path) -> None:
    write_reference_output(tmp_path / "dlrm")
    config = tiny_config(tmp_path / "dlrm", tmp_path / "run", epochs=2, eval_every=None, checkpoint_every=None)
    summary = train.train(config)
    assert 0 <= summary["auc"] <= 1 and summary["test_samples"] == 71 and summary["train_samples"] > 0
    assert summary["config"]["split_order"] == "test-val"
