"""`slipcache stats`: figures against hand-computed values, every source kind, the CLI, the real rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data.criteo import MISSING, ReadStats, read_chunks
from slipcache.data.dataset import CriteoDataset
from slipcache.data.preprocess import preprocess
from slipcache.data.stats import compute_stats, compute_stats_arrays, format_stats, plot_stats
from slipcache.errors import InvalidInputError, SlipcacheError
from tests.data.test_readers import SHARED, needs_shared
from tests.helpers import make_dataset

# Three tables, eight rows; -1 is the empty field of table 2. By hand:
#   table 0 counts {1: 2, 2: 1, 3: 3, 4: 1, 5: 1}: 5 values, rows that recur 5/8, singletons 3/5, top value 3/8
#   table 1 counts {7: 4, 8: 2, 9: 2}: every row recurs
#   table 2 counts {-1: 3, 10: 1, 11: 1, 12: 2, 13: 1}: missing 3/8, rows that recur 5/8
# All three recur in rows 0, 1, 4, 5 (4/8); independent tables would give 5/8 * 1 * 5/8.
HAND = np.array(
    [
        [1, 7, -1],
        [1, 7, -1],
        [2, 7, 10],
        [3, 7, 11],
        [3, 8, 12],
        [3, 8, 12],
        [4, 9, 13],
        [5, 9, -1],
    ]
)
ROW_MB = 64 / 2**20  # one fp32 row of dim 16


def test_per_table_figures_by_hand() -> None:
    stats = compute_stats_arrays(HAND, missing_value=-1)
    t0, t1, t2 = stats["tables"]
    assert stats["rows"] == 8 and stats["num_tables"] == 3
    assert t0["distinct"] == 5 and t1["distinct"] == 3 and t2["distinct"] == 5
    assert t0["recur_share"] == pytest.approx(5 / 8) and t1["recur_share"] == 1.0
    assert t2["recur_share"] == pytest.approx(5 / 8)
    assert t0["singleton_share"] == pytest.approx(3 / 5) and t1["singleton_share"] == 0.0
    assert t0["missing_rate"] == 0.0 and t2["missing_rate"] == pytest.approx(3 / 8)
    # top 0.1 %, 1 %, 5 % of 5 values are all k = 1 value; 5 % of 3 values too.
    assert t0["top_share"] == pytest.approx({"0.1%": 3 / 8, "1%": 3 / 8, "5%": 3 / 8})
    assert t1["top_share"]["5%"] == pytest.approx(4 / 8)
    # Without a missing value the -1 is an ordinary id, and no missing rate is claimed.
    assert compute_stats_arrays(HAND)["tables"][2]["missing_rate"] is None
    assert all(stats["exact"][k] for k in ("per_table", "co_recurrence", "hot_input_share", "new_id_rate"))


def test_top_share_counts_ceil_of_fraction_of_values() -> None:
    # 100 values: value 0 has 101 rows, values 1..99 one row each; top 5 % = 5 values = 101 + 4 rows.
    column = np.concatenate([np.zeros(101, np.int64), np.arange(1, 100)])
    table = compute_stats_arrays(column[:, None])["tables"][0]
    assert table["top_share"] == pytest.approx({"0.1%": 101 / 200, "1%": 101 / 200, "5%": 105 / 200})


def test_cross_table_figures_by_hand() -> None:
    stats = compute_stats_arrays(HAND, missing_value=-1)
    assert stats["big_tables"] == ["C1", "C2", "C3"]  # fewer than five tables: all of them
    co = stats["co_recurrence"]
    assert co["all_recur"] == pytest.approx(0.5)
    assert co["independent"] == pytest.approx(5 / 8 * 5 / 8, abs=1e-6)
    matrix = stats["recurrence_correlation"]["matrix"]
    # Table 1 always recurs, so its correlation is undefined; tables 0 and 2: phi = (8*4 - 5*5) / (5*3).
    assert matrix[0][1] is None and matrix[0][2] == pytest.approx(7 / 15, abs=1e-6)
    only_two = compute_stats_arrays(HAND, missing_value=-1, big_tables=[0, 2])
    assert only_two["co_recurrence"]["all_recur"] == pytest.approx(4 / 8)
    assert only_two["big_tables"] == ["C1", "C3"]


def test_hot_input_share_by_hand() -> None:
    # Counts over all tables: 4 (t1:7), 3 (t0:3), 3 (t2:-1), 2 (t0:1, t1:8, t1:9, t2:12), then six 1s.
    budgets = [3 * ROW_MB, 5 * ROW_MB, 7 * ROW_MB, 13 * ROW_MB]
    hot = compute_stats_arrays(HAND, missing_value=-1, budgets_mb=budgets, hot_fractions=[])["hot_inputs"]
    assert [h["hot_rows"] for h in hot] == [3, 5, 7, 13]
    # 3 rows: no input has all three lookups among {t0:3, t1:7, t2:-1}.
    assert hot[0]["hot_input_share"] == 0.0 and hot[0]["hot_lookup_share"] == pytest.approx(10 / 24)
    assert hot[0]["count_threshold"] == 3
    # 5 rows: two of the four rows counted twice win the tie.
    assert hot[1]["count_threshold"] == 2 and hot[1]["hot_lookup_share"] == pytest.approx(14 / 24)
    # 7 rows: exactly the recurring values are hot, so hot inputs are the rows where all recur.
    assert hot[2]["hot_input_share"] == pytest.approx(0.5) and hot[2]["hot_lookup_share"] == pytest.approx(
        18 / 24
    )
    assert hot[3]["hot_input_share"] == 1.0 and hot[3]["hot_lookup_share"] == 1.0
    # Budgets as shares of the 13 values: 7/13 of them is the 7-row budget.
    by_fraction = compute_stats_arrays(HAND, missing_value=-1, hot_fractions=[7 / 13])[
        "hot_inputs_by_fraction"
    ]
    assert by_fraction[0]["hot_rows"] == 7 and by_fraction[0]["hot_input_share"] == pytest.approx(0.5)


def test_hot_ties_are_broken_for_exactly_the_budget() -> None:
    # 50 values of one table seen twice each: a 20-row budget makes exactly 20 of them hot.
    column = np.repeat(np.arange(50), 2)
    hot = compute_stats_arrays(column[:, None], budgets_mb=[20 * ROW_MB], hot_fractions=[])["hot_inputs"][0]
    assert hot["hot_lookup_share"] == pytest.approx(0.4) and hot["hot_input_share"] == pytest.approx(0.4)


def test_over_time_by_hand() -> None:
    # Chunk 0: 1 1 2 2 3 4; chunk 1: 1 1 5 5 6 2 -> new ids 5, 5, 6 (3 of 6 lookups);
    # top recurring values {1, 2} then {1, 5}: overlap 1 of 2.
    column = np.array([1, 1, 2, 2, 3, 4, 1, 1, 5, 5, 6, 2])
    time = compute_stats_arrays(column[:, None], chunk_rows=6)["over_time"]
    assert [c["rows"] for c in time["chunks"]] == [6, 6]
    assert time["chunks"][0]["new_id_rate"] == 1.0 and time["chunks"][0]["top_overlap_per_table"] == [None]
    assert time["chunks"][1]["new_id_rate"] == pytest.approx(0.5)
    assert time["chunks"][1]["top_overlap_per_table"] == [pytest.approx(0.5)]
    assert time["new_id_rate_mean"] == pytest.approx(0.5)
    # The same rows in chunks of 4: new ids in chunk 1 (3 4 1 1): 3, 4; chunk 2 (5 5 6 2): 5, 5, 6.
    rates = [
        c["new_id_rate"] for c in compute_stats_arrays(column[:, None], chunk_rows=4)["over_time"]["chunks"]
    ]
    assert rates == pytest.approx([1.0, 0.5, 0.75])


@pytest.mark.parametrize("exponent", [0.8, 1.2])
def test_power_law_fit_on_exact_zipf_counts(exponent: float) -> None:
    ranks = np.arange(1, 200_000)
    counts = np.floor(5000 * ranks**-exponent).astype(np.int64)
    counts = counts[counts > 0]
    column = np.random.default_rng(0).permutation(np.repeat(np.arange(len(counts)) * 7 + 3, counts))
    table = compute_stats_arrays(column[:, None])["tables"][0]
    assert table["power_law_exponent"] == pytest.approx(exponent, abs=0.05)
    assert table["distinct"] == len(counts)
    assert table["rank_frequency"][0] == [1.0, 5000.0]


def test_too_few_recurring_values_give_no_exponent() -> None:
    table = compute_stats_arrays(np.array([[1], [1], [2], [3], [4]]))["tables"][0]
    assert table["power_law_exponent"] is None


def _zipf_rows(n: int, tables: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    entity = rng.zipf(1.3, n)  # shared by all tables, so they co-recur
    noise = rng.zipf(1.5, (n, tables))
    return np.where(rng.random((n, tables)) < 0.7, entity[:, None], noise + 10**6).astype(np.int64)


def test_sampled_counts_estimate_the_exact_figures() -> None:
    rows = _zipf_rows(30_000, 3)
    exact = compute_stats_arrays(rows, chunk_rows=5000)
    approx = compute_stats_arrays(rows, chunk_rows=5000, max_values=4000, sample_rows=6000)
    assert not approx["exact"]["per_table"] and not approx["exact"]["co_recurrence"]
    assert not approx["exact"]["hot_input_share"] and approx["exact"]["sample_standard_error"] > 0
    assert exact["exact"]["per_table"] and exact["exact"]["sample_standard_error"] == 0
    assert max(t["sampling_level"] for t in approx["tables"]) >= 1
    assert all(t["exact"] == (t["sampling_level"] == 0) for t in approx["tables"])
    for e, a in zip(exact["tables"], approx["tables"], strict=True):
        assert a["distinct"] == pytest.approx(e["distinct"], rel=0.15)
        assert a["recur_share"] == pytest.approx(e["recur_share"], abs=0.05)
        assert a["singleton_share"] == pytest.approx(e["singleton_share"], abs=0.05)
        assert a["top_share"]["1%"] == pytest.approx(e["top_share"]["1%"], abs=0.05)
    assert approx["co_recurrence"]["all_recur"] == pytest.approx(
        exact["co_recurrence"]["all_recur"], abs=0.03
    )
    for e, a in zip(exact["hot_inputs_by_fraction"], approx["hot_inputs_by_fraction"], strict=True):
        assert a["hot_lookup_share"] == pytest.approx(e["hot_lookup_share"], abs=0.05)
        assert a["hot_input_share"] == pytest.approx(e["hot_input_share"], abs=0.05)
    late = slice(1, None)
    e_rates = [c["new_id_rate"] for c in exact["over_time"]["chunks"][late]]
    a_rates = [c["new_id_rate"] for c in approx["over_time"]["chunks"][late]]
    assert a_rates == pytest.approx(e_rates, abs=0.05)


def test_row_sample_alone_keeps_per_table_figures_exact() -> None:
    rows = _zipf_rows(20_000, 3, seed=1)
    exact = compute_stats_arrays(rows)
    sampled = compute_stats_arrays(rows, sample_rows=4000)
    assert sampled["exact"]["per_table"] and not sampled["exact"]["co_recurrence"]
    assert sampled["tables"] == exact["tables"]
    assert sampled["co_recurrence"]["all_recur"] == pytest.approx(
        exact["co_recurrence"]["all_recur"], abs=0.03
    )


def test_max_rows_and_bad_arguments() -> None:
    stats = compute_stats_arrays(HAND, missing_value=-1, max_rows=4, chunk_rows=3)
    assert stats["rows"] == 4 and stats["tables"][0]["distinct"] == 3
    with pytest.raises(InvalidInputError):
        compute_stats_arrays(np.zeros((4, 2)))  # floats are not ids
    with pytest.raises(InvalidInputError):
        compute_stats_arrays(HAND, labels=np.zeros(3))
    with pytest.raises(SlipcacheError, match="max-rows"):
        compute_stats_arrays(HAND, max_rows=0)
    with pytest.raises(SlipcacheError, match="no rows"):
        compute_stats_arrays(np.zeros((0, 3), np.int64))
    with pytest.raises(SlipcacheError, match="big tables"):
        compute_stats_arrays(HAND, big_tables=[5])


# ------------------------------------------------------------------------------------------- raw files

CATS = [
    ["aaaaaaaa", "bbbbbbbb", "", "dddddddd"],
    ["aaaaaaaa", "cccccccc", "", "dddddddd"],
    ["0000000a", "bbbbbbbb", "12345678", ""],
    ["aaaaaaaa", "bbbbbbbb", "12345678", ""],
]  # C1..C4; C5..C26 repeat C1


def _fields(i: int) -> tuple[str, list[str], list[str]]:
    cats = CATS[i] + [CATS[i][0]] * 22
    dense = [str(i), "", "260", "-1"] + ["3"] * 9
    return str(i % 2), dense, cats


def _write_formats(root: Path) -> dict[str, Path]:
    """The four rows in the three formats and gzip, each with one malformed line."""
    root.mkdir()
    rows = [_fields(i) for i in range(len(CATS))]
    tsv = ["\t".join([label, *dense, *cats]) for label, dense, cats in rows]
    tsv[3] = tsv[3].rstrip("\t")  # trailing empty fields cut off, as in train.txt
    tsv.insert(2, "x\t1\t2")
    names = ",".join([f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)])
    kaggle = [f"Id,Label,{names}"] + [
        ",".join([str(10_000_000 + i), label, *dense, *cats]) for i, (label, dense, cats) in enumerate(rows)
    ]
    kaggle.insert(3, "1,2,3")
    csv = [f"label,{names}"] + [
        ",".join([label, *(f"{d}.0" if d else d for d in dense), *cats]) for label, dense, cats in rows
    ]
    csv.append(",".join(["1", *["1"] * 13, "zzzzzzzz", *["aaaaaaaa"] * 25]))
    files = {
        "tsv": root / "day_0",
        "kaggle_csv": root / "train.csv",
        "csv": root / "sample.csv",
        "gzip": root / "day_0.gz",
    }
    files["tsv"].write_text("\n".join(tsv) + "\n")
    files["kaggle_csv"].write_bytes(("\r\n".join(kaggle) + "\r\n").encode())
    files["csv"].write_text("\n".join(csv))
    files["gzip"].write_bytes(gzip.compress(files["tsv"].read_bytes()))
    return files


def test_all_raw_formats_and_gzip_agree(tmp_path: Path) -> None:
    files = _write_formats(tmp_path / "raw")
    results = {name: compute_stats(path, progress=name == "gzip") for name, path in files.items()}
    for name, stats in results.items():
        read = ReadStats()
        rows = sum(len(c) for c in read_chunks(files[name], stats=read))
        assert stats["rows"] == rows == 4 and stats["source"]["bad_lines"] == read.bad == 1, name
        assert len(stats["source"]["bad_examples"]) == 1
        assert stats["tables"] == results["tsv"]["tables"], name
        assert stats["positive_rate"] == 0.5
    tables = results["tsv"]["tables"]
    # C1: aaaaaaaa x3, 0000000a; C3: empty x2, 12345678 x2; C4: dddddddd x2, empty x2.
    assert tables[0]["distinct"] == 2 and tables[0]["recur_share"] == pytest.approx(0.75)
    assert tables[2]["missing_rate"] == pytest.approx(0.5) and tables[2]["recur_share"] == 1.0
    assert tables[3]["missing_rate"] == pytest.approx(0.5) and tables[4]["missing_rate"] == 0.0
    # I2 is empty everywhere; the rest never.
    assert results["csv"]["dense_missing_rate"][:3] == [0.0, 1.0, 0.0]
    assert results["kaggle_csv"]["source"]["formats"] == {str(files["kaggle_csv"]): "kaggle_csv"}


def test_directory_of_raw_files_in_day_order(tmp_path: Path) -> None:
    files = _write_formats(tmp_path / "raw")
    (tmp_path / "raw" / "README.md").write_text("not data\n")
    stats = compute_stats(tmp_path / "raw", chunk_rows=4)
    assert stats["source"]["files"] == ["day_0", "day_0.gz", "sample.csv", "train.csv"]
    assert stats["rows"] == 16 and stats["source"]["bad_lines"] == 4
    # The same four rows in each file: after the first chunk no id is new and the top values repeat.
    later = stats["over_time"]["chunks"][1:]
    assert [c["new_id_rate"] for c in later] == [0.0, 0.0, 0.0]
    assert files  # written


def test_missing_source_and_non_criteo_file(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="no such file"):
        compute_stats(tmp_path / "nope.tsv")
    other = tmp_path / "notes.txt"
    other.write_text("hello world\n")
    with pytest.raises(SlipcacheError, match="notes.txt.*unrecognized format"):
        compute_stats(other)
    with pytest.raises(SlipcacheError, match="no data files"):
        (tmp_path / "empty").mkdir()
        compute_stats(tmp_path / "empty")


# ------------------------------------------------------------------------------------------- datasets


def test_preprocessed_dataset_matches_its_raw_file(tmp_path: Path) -> None:
    files = _write_formats(tmp_path / "raw")
    preprocess(
        [files["tsv"]], tmp_path / "ds", vocab="hash", max_rows=1 << 20, split="0.5,0.25,0.25", progress=False
    )
    raw = compute_stats(files["tsv"])
    ds = compute_stats(tmp_path / "ds")
    assert ds["source"]["kind"] == "dataset" and ds["source"]["splits"] == {"train": 2, "val": 1, "test": 1}
    assert "row 0" in ds["source"]["missing"]
    # Hashing is one-to-one on these few values, and row 0 is the empty field.
    for r, d in zip(raw["tables"], ds["tables"], strict=True):
        assert {k: d[k] for k in ("distinct", "missing_rate", "recur_share", "top_share")} == {
            k: r[k] for k in ("distinct", "missing_rate", "recur_share", "top_share")
        }
    assert ds["dense_missing_rate"] is None
    # The dense shapes are the stored values' (log(1 + max(x, 0)), missing 0): the empty I2 and I4's -1
    # are stored as 0, I3's 260 is not.
    assert [d["name"] for d in ds["dense"]] == [f"I{j}" for j in range(1, 14)]
    assert [ds["dense"][j]["zero_share"] for j in (1, 2, 3)] == [1.0, 0.0, 1.0]
    assert ds["dense"][0]["missing_rate"] == 0.0 and "stored" in ds["source"]["dense_missing"]
    assert compute_stats(tmp_path / "ds", splits=["val", "test"])["rows"] == 2


def test_synthetic_dataset_matches_its_arrays(tmp_path: Path) -> None:
    path = make_dataset(tmp_path / "ds", n=400, skewed=True)
    ds = CriteoDataset(path)
    sparse = np.concatenate([np.asarray(ds.split(s).sparse) for s in ("train", "val", "test")])
    labels = np.concatenate([np.asarray(ds.split(s).labels) for s in ("train", "val", "test")])
    from_files = compute_stats(path, chunk_rows=150)
    from_arrays = compute_stats_arrays(sparse, labels=labels, chunk_rows=150)
    assert from_files["source"]["missing"].startswith("none")
    for key in ("tables", "co_recurrence", "hot_inputs", "over_time", "positive_rate"):
        assert from_files[key] == from_arrays[key], key


# ------------------------------------------------------------------------------------------- output


@pytest.mark.slow
def test_format_plot_and_json(tmp_path: Path) -> None:
    stats = compute_stats_arrays(_zipf_rows(3000, 26), missing_value=1, chunk_rows=1000)
    text = format_stats(stats)
    assert "C3, C4, C12, C16, C21" in text and "all figures exact" in text
    assert "hot inputs" in text and "new-id rate" in text
    json.dumps(stats, allow_nan=False)
    out = plot_stats(stats, tmp_path / "stats.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    approx = compute_stats_arrays(_zipf_rows(3000, 26), sample_rows=500)
    assert "approximate: co_recurrence" in format_stats(approx)


@pytest.mark.slow
def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _write_formats(tmp_path / "raw")
    json_path, png = tmp_path / "s.json", tmp_path / "s.png"
    argv = ["stats", str(files["gzip"]), "--json", str(json_path), "--plot", str(png), "--chunk-rows", "2"]
    assert main([*argv, "--budgets-mb", "1,2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "malformed" in out and "C1" in out
    stats = json.loads(json_path.read_text())
    assert [h["budget_mb"] for h in stats["hot_inputs"]] == [1, 2] and png.stat().st_size > 0
    assert main(["stats", str(files["tsv"]), "--json", "-", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 4
    assert main(["stats", str(tmp_path / "nope"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_output_paths_are_made_or_refused_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json into a directory that does not exist yet is created before the statistics are computed; a
    directory or a link as the file stops with one line before any of the work."""
    import os

    from slipcache.data.stats import cli as stats_cli

    files = _write_formats(tmp_path / "raw")
    out = tmp_path / "not" / "yet" / "s.json"
    assert main(["stats", str(files["tsv"]), "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["rows"] == 4
    assert [p.name for p in out.parent.iterdir()] == ["s.json"]  # no temporary file left

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("computed before the output paths were checked")

    monkeypatch.setattr(stats_cli, "compute_stats", no_work)
    (tmp_path / "target.json").write_text("keep")
    os.symlink(tmp_path / "target.json", tmp_path / "link.json")
    for flag, value, message in (("--json", tmp_path, "is a directory"),
                                 ("--json", tmp_path / "link.json", "is a symbolic link"),
                                 ("--plot", tmp_path / "raw.png", "")):
        if not message:
            (tmp_path / "raw.png").mkdir()
            message = "is a directory"
        assert main(["stats", str(files["tsv"]), flag, str(value), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert (tmp_path / "target.json").read_text() == "keep"


# ------------------------------------------------------------------------------------------- real rows


@needs_shared
def test_real_kaggle_rows_co_recur_as_the_issue_measured() -> None:
    """Issue 9: big tables each recur in 0.42-0.57 of rows; all five in 0.42 against 0.025 if independent."""
    stats = compute_stats(SHARED / "kaggle_train_tiny.csv")
    assert stats["rows"] == 1999 and stats["source"]["bad_lines"] == 0
    big = [t["recur_share"] for t in stats["tables"] if t["name"] in stats["big_tables"]]
    assert min(big) == pytest.approx(0.42, abs=0.005) and max(big) == pytest.approx(0.57, abs=0.005)
    assert stats["co_recurrence"]["all_recur"] == pytest.approx(0.42, abs=0.005)
    assert stats["co_recurrence"]["independent"] == pytest.approx(0.025, abs=0.001)
    assert stats["tables"][0]["missing_rate"] == 0.0 and stats["tables"][2]["missing_rate"] > 0


@needs_shared
@pytest.mark.parametrize("name", ["kaggle_train_head.tsv", "deepctr_criteo_sample.csv"])
def test_other_real_files(name: str) -> None:
    read = ReadStats()
    rows = sum(len(c) for c in read_chunks(SHARED / name, stats=read))
    stats = compute_stats(SHARED / name, chunk_rows=100)
    assert stats["rows"] == rows and stats["source"]["bad_lines"] == read.bad
    assert stats["exact"]["per_table"] and len(stats["over_time"]["chunks"]) == -(-rows // 100)
    assert MISSING == -1 and stats["tables"][21]["missing_rate"] > 0.5  # C22 is mostly empty in Kaggle


def test_target_auc_follows_its_definition() -> None:
    """Means over the first 5/6, unseen values scored by the first part's rate, ties at average rank."""
    from slipcache.data.stats.signal import auc_with_ties, target_auc

    values = np.array([1, 1, 2, 2, 3, 3, 1, 2, 3, 4, 9, 9])  # 12 rows: first 10 fit, last 2 scored
    labels = np.array([1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0], dtype=np.float32)
    # value 9 unseen in the first part: both later rows get the first part's rate -> one tie -> AUC 0.5
    assert target_auc(values, labels) == pytest.approx(0.5)
    assert auc_with_ties(np.array([0.1, 0.4, 0.4, 0.9]), np.array([0, 0, 1, 1])) == pytest.approx(0.875)
    rng = np.random.default_rng(0)
    value = rng.integers(0, 50, 6000)
    p = (value % 2) * 0.6 + 0.2  # odd values click at 0.8, even at 0.2: memorisable signal
    assert target_auc(value, (rng.random(6000) < p).astype(np.float32)) > 0.75


def test_stats_report_dense_shapes_count_bands_and_links() -> None:
    from slipcache.data.stats import compute_stats_arrays

    rng = np.random.default_rng(1)
    cats = rng.integers(0, 30, (3000, 26))
    cats[:, 12] = cats[:, 10] % 7  # C11 determines C13
    dense = rng.integers(-1, 5, (3000, 13)).astype(np.float32)
    dense[:100, 0] = np.nan
    stats = compute_stats_arrays(cats, dense, rng.integers(0, 2, 3000).astype(np.float32))
    d0 = stats["dense"][0]
    assert d0["missing_rate"] == pytest.approx(100 / 3000, abs=1e-6)
    assert d0["zero_share"] == pytest.approx(float(np.mean(dense[100:, 0] == 0)), abs=1e-6)
    assert d0["negative_share"] == pytest.approx(float(np.mean(dense[100:, 0] < 0)), abs=1e-6)
    bands = stats["tables"][0]["lookup_share_by_count"]
    counts = np.bincount(cats[:, 0])[cats[:, 0]]  # per lookup, how often its value was seen
    assert bands[">=100"] == pytest.approx(float(np.mean(counts >= 100)), abs=1e-6)
    assert bands["10-99"] == pytest.approx(float(np.mean((counts >= 10) & (counts <= 99))), abs=1e-6)
    assert sum(bands.values()) == pytest.approx(1.0, abs=1e-5)
    link = next(lk for lk in stats["links"] if lk["from"] == "C11")
    assert link["purity"] == pytest.approx(1.0) and link["determined"] == pytest.approx(1.0) and link["chance"] < 0.5
