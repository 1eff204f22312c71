"""Raw Criteo readers: the three real sample formats, gzip, malformed lines, strict mode."""

from __future__ import annotations

import gzip
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from slipcache.cli import main
from slipcache.data import criteo
from slipcache.data.criteo import MISSING, ReadStats, detect_format, read_chunks
from slipcache.errors import SlipcacheError
from tests.helpers import SHARED_CRITEO, SHARED_CRITEO_REASON, train_argv

SHARED = SHARED_CRITEO
needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(),
    reason=SHARED_CRITEO_REASON,
)


def read_all(path: Path, **kwargs: object) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReadStats]:
    stats = ReadStats()
    chunks = list(read_chunks(path, stats=stats, **kwargs))  # type: ignore[arg-type]
    labels = np.concatenate([c.labels for c in chunks]) if chunks else np.empty(0, np.float32)
    dense = np.concatenate([c.dense for c in chunks]) if chunks else np.empty((0, 13), np.float32)
    cats = np.concatenate([c.categorical for c in chunks]) if chunks else np.empty((0, 26), np.int64)
    return labels, dense, cats, stats


def tsv_line(label: str = "0", dense: list[str] | None = None, cats: list[str] | None = None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats])


# The first row of the Kaggle training set, present in both Kaggle samples.
FIRST_DENSE = [1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, np.nan, 2]


@needs_shared
def test_kaggle_tsv_sample() -> None:
    labels, dense, cats, stats = read_all(SHARED / "kaggle_train_head.tsv")
    # The README says 999 rows (`wc -l`), but the last line has no newline: there are 1000 records.
    assert len(labels) == 1000 and stats.good == 1000 and stats.bad == 0
    assert stats.formats[str(SHARED / "kaggle_train_head.tsv")] == "tsv"
    assert int(labels.sum()) == 205 and set(np.unique(labels)) <= {0.0, 1.0}
    np.testing.assert_array_equal(dense[0], np.array(FIRST_DENSE, dtype=np.float32))
    assert cats[0, 0] == 0x68FD1E64 and cats[0, 25] == 0x9727DD16 and cats[0, 21] == MISSING
    # Line 1000 has 38 fields: C25 and C26 were cut off and read as missing.
    assert cats[999, 23] == 0x3B183C5C and cats[999, 24] == MISSING and cats[999, 25] == MISSING
    assert dense[999, 4] == 8647 and np.isnan(dense[999, 5])


@needs_shared
def test_kaggle_csv_sample() -> None:
    labels, dense, cats, stats = read_all(SHARED / "kaggle_train_tiny.csv")
    assert len(labels) == 1999 and stats.bad == 0
    assert stats.formats[str(SHARED / "kaggle_train_tiny.csv")] == "kaggle_csv"
    assert int(labels.sum()) == 418
    np.testing.assert_array_equal(dense[0], np.array(FIRST_DENSE, dtype=np.float32))
    assert cats[0, 0] == 0x68FD1E64 and cats[0, 25] == 0x9727DD16  # no '\r' left on the last field
    tsv = read_all(SHARED / "kaggle_train_head.tsv")
    np.testing.assert_array_equal(cats[:1000], tsv[2])  # the same rows as the TSV sample


@needs_shared
def test_deepctr_csv_sample() -> None:
    labels, dense, cats, stats = read_all(SHARED / "deepctr_criteo_sample.csv")
    assert len(labels) == 200 and stats.bad == 0
    assert stats.formats[str(SHARED / "deepctr_criteo_sample.csv")] == "csv"
    assert int(labels.sum()) == 49
    assert dense[0, 2] == 260.0 and dense[0, 4] == 17668.0 and np.isnan(dense[0, 0]) and dense[0, 11] == 0.0
    assert dense[1, 1] == -1.0
    assert cats[0, 0] == 0x05DB9164 and cats[0, 25] == MISSING


@needs_shared
def test_gzip_matches_plain(tmp_path: Path) -> None:
    plain = read_all(SHARED / "kaggle_train_tiny.csv")
    gz = tmp_path / "train.csv.gz"
    gz.write_bytes(gzip.compress((SHARED / "kaggle_train_tiny.csv").read_bytes()))
    packed = read_all(gz)
    for a, b in zip(plain[:3], packed[:3], strict=True):
        np.testing.assert_array_equal(a, b)


@needs_shared
def test_small_chunks_give_the_same_rows() -> None:
    whole = read_all(SHARED / "kaggle_train_head.tsv")
    chunked = read_all(SHARED / "kaggle_train_head.tsv", chunk_bytes=1000)
    for a, b in zip(whole[:3], chunked[:3], strict=True):
        np.testing.assert_array_equal(a, b)


def test_detect_format() -> None:
    assert detect_format(b"Id,Label,I1,I2\r\n") == "kaggle_csv"
    assert detect_format(b"label,I1,I2\n") == "csv"
    assert detect_format(b"0\t1\t2\n") == "tsv"
    with pytest.raises(SlipcacheError, match="unrecognized format"):
        detect_format(b"hello world\n")


EDGE_LINES = [
    tsv_line(),  # 1 good
    tsv_line("1", cats=[f"{i:08x}" for i in range(24)]),  # 2 good: two trailing fields cut off
    tsv_line(dense=[""] * 13, cats=[""] * 26),  # 3 good: everything empty
    tsv_line(cats=["zz" + "0" * 6] + [f"{i:08x}" for i in range(25)]),  # 4 bad hex
    tsv_line() + "\textra",  # 5 too many fields
    "",  # 6 blank line
    tsv_line(dense=["abc"] + ["1"] * 12),  # 7 non-numeric dense
    tsv_line("2"),  # 8 bad label
    tsv_line(cats=["abc"] + [f"{i:08x}" for i in range(25)]),  # 9 short categorical
    "0\t1\t2",  # 10 too few fields
    tsv_line("1", dense=["-3", "2.5", "1e2"] + ["7"] * 10, cats=["ABCDEF01"] + [""] * 25),  # 11 good
]


def test_edge_cases_default_mode(tmp_path: Path) -> None:
    path = tmp_path / "edge.txt"
    path.write_text("\n".join(EDGE_LINES) + "\n")
    labels, dense, cats, stats = read_all(path)
    assert stats.good == 4 and stats.bad == 7
    np.testing.assert_array_equal(labels, [0, 1, 0, 1])
    assert cats[1, 23] == 23 and cats[1, 24] == MISSING and cats[1, 25] == MISSING
    assert np.isnan(dense[2]).all() and (cats[2] == MISSING).all()
    np.testing.assert_array_equal(dense[3, :3], [-3, 2.5, 100])
    assert cats[3, 0] == 0xABCDEF01
    stats_small = ReadStats(max_examples=100)
    list(read_chunks(path, stats=stats_small))
    reasons = {}
    for example in stats_small.examples:
        assert example.startswith(f"{path}:")
        line, reason = example[len(str(path)) + 1 :].split(": ", 1)
        reasons[line] = reason
    assert set(reasons) == {"4", "5", "6", "7", "8", "9", "10"}
    assert "C1 is not 8 hex digits: 'zz000000'" in reasons["4"]
    assert "expected 15 to 40 fields, found 41" in reasons["5"]
    assert reasons["6"] == "blank line"
    assert "non-numeric dense feature I1: 'abc'" in reasons["7"]
    assert "bad label '2'" in reasons["8"]
    assert "C1 is not 8 hex digits: 'abc'" in reasons["9"]
    assert "found 3" in reasons["10"]
    assert stats.examples[0] == f"{path}:4: categorical feature C1 is not 8 hex digits: 'zz000000'"
    assert len(stats.examples) == 5  # only the first few are kept


def test_strict_mode_raises_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "edge.txt"
    path.write_text("\n".join(EDGE_LINES) + "\n")
    with pytest.raises(SlipcacheError, match=rf"^{path}:4: categorical feature C1"):
        list(read_chunks(path, strict=True))
    path.write_text("\n".join(EDGE_LINES[:3] + EDGE_LINES[6:7]) + "\n")
    with pytest.raises(SlipcacheError, match=rf"^{path}:4: non-numeric dense feature I1"):
        list(read_chunks(path, strict=True))


def test_csv_edge_cases(tmp_path: Path) -> None:
    header = (
        "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    )
    good = "7,1," + ",".join(["3"] * 13) + "," + ",".join(["0000000a"] * 26)
    path = tmp_path / "k.csv"
    path.write_bytes(f"{header}\r\n{good}\r\n{good[:-9]}\r\n\r\n{good}".encode())
    labels, dense, cats, stats = read_all(path)
    assert stats.good == 2 and stats.bad == 2
    assert stats.examples[0] == f"{path}:3: expected 41 fields, found 40"
    assert stats.examples[1] == f"{path}:4: blank line"
    assert (cats == 10).all() and (dense == 3).all()


def test_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SlipcacheError, match="no such file"):
        list(read_chunks(tmp_path / "nope.tsv"))
    with pytest.raises(SlipcacheError, match="is a directory"):
        list(read_chunks(tmp_path))
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    assert list(read_chunks(empty)) == []
    broken = tmp_path / "broken.gz"
    broken.write_bytes(gzip.compress(("\n".join(EDGE_LINES[:3]) * 50).encode())[:-30])
    with pytest.raises(SlipcacheError, match="read error"):
        list(read_chunks(broken))


def test_dense_values_beyond_float32_are_malformed(tmp_path: Path) -> None:
    path = tmp_path / "big.tsv"
    huge = "1" * 44  # parsed by float() as 1e43: stored as float32 it would become inf (then 88.72 after log1p)
    lines = [tsv_line(), tsv_line(dense=[huge] + ["1"] * 12), tsv_line(dense=["1e39"] + ["1"] * 12)]
    path.write_text("\n".join(lines) + "\n")
    labels, dense, _, stats = read_all(path)
    assert len(labels) == 1 and stats.bad == 2 and np.isfinite(dense).all()
    assert "I1 beyond the float32 range" in stats.examples[0]
    with pytest.raises(SlipcacheError, match=r"big.tsv:2: dense feature I1 beyond the float32 range"):
        read_all(path, strict=True)


def test_huge_line_is_read_in_bounded_memory_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import slipcache.data.criteo as criteo

    monkeypatch.setattr(criteo, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.tsv"
    reads: list[int] = []
    with open(path, "w") as f:
        f.write(tsv_line() + "\n" + "\t".join(["1"] * 40) + "\t" + "x" * 50_000 + "\n" + tsv_line() + "\n")
    real_open = criteo.open_raw

    def spy_open(p: object) -> object:
        fh = real_open(p)  # type: ignore[arg-type]
        real_readline = fh.readline

        def readline(limit: int = -1) -> bytes:
            line = real_readline(limit)
            reads.append(len(line))
            return line

        fh.readline = readline  # type: ignore[method-assign]
        return fh

    monkeypatch.setattr(criteo, "open_raw", spy_open)
    labels, _, _, stats = read_all(path, chunk_bytes=400)  # the long line straddles a chunk end
    assert len(labels) == 2 and stats.bad == 1
    assert "line longer than 1000 bytes" in stats.examples[0]
    assert max(reads) <= 1001  # never the whole 50 kB line at once (that is what an endless line needs)


def test_unrecognized_file_is_named(tmp_path: Path) -> None:
    stray = tmp_path / "README"
    stray.write_text("these are my notes\n")
    with pytest.raises(SlipcacheError, match=rf"^{stray}: unrecognized format"):
        read_all(stray)


@pytest.mark.usefixtures("private_cache_dir")
@pytest.mark.slow
def test_subdirectories_of_raw_data_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    raw = tmp_path / "raw"
    (raw / "day_2").mkdir(parents=True)
    line = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a0b0c0d"] * 26) + "\n"
    (raw / "day_0.tsv").write_text(line * 700)
    main(train_argv(raw, tmp_path))
    assert "subdirectories are not read (day_2)" in capsys.readouterr().err


@pytest.mark.usefixtures("private_cache_dir")
def test_blank_lines_cost_bytes_not_field_arrays(tmp_path: Path) -> None:
    good = "0\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"
    path = tmp_path / "blank.tsv.gz"
    blank_lines = 300_000
    with gzip.open(path, "wb") as fh:
        fh.write((good * 50 + "\n" * blank_lines + good * 50).encode())
    stats = criteo.ReadStats()
    tracemalloc.start()
    try:
        rows = sum(len(chunk) for chunk in criteo.read_chunks(path, stats=stats))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == 100 and stats.good == 100 and stats.bad == blank_lines
    assert stats.examples[0].endswith(":51: blank line") and len(stats.examples) == 5
    # per-line index arrays of a few dozen bytes: [lines, 40] int64 field arrays took 96 MB each here
    assert peak < 64 * blank_lines, peak


@pytest.mark.usefixtures("private_cache_dir")
def test_strict_stops_at_the_first_bad_line_whichever_kind(tmp_path: Path) -> None:
    good = "0\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"
    path = tmp_path / "bad.tsv"
    path.write_text(good + good.replace("0\t", "7\t", 1) + "\n" + good)
    with pytest.raises(SlipcacheError, match=r"bad.tsv:2: bad label '7'"):
        list(criteo.read_chunks(path, strict=True))
    path.write_text(good + "\n" + good.replace("0\t", "7\t", 1))
    with pytest.raises(SlipcacheError, match=r"bad.tsv:2: blank line"):
        list(criteo.read_chunks(path, strict=True))

