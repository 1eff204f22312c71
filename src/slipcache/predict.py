"""`slipcache predict`: score new data with a trained run or an export, one probability per input row.

Inputs are raw Criteo files (any of the three formats `slipcache.data.criteo` reads, gzip too, or a
directory of them) or a dataset directory (one split, `--split`). Raw rows are mapped as the run's
training data was (`slipcache.serving.Vocabulary`): the same dense transform, the same frequency or hash
vocabulary; a value the vocabulary has no row for is scored with its table's default row 0, as in
training, and counted.

It streams: raw text is parsed a chunk (8 MiB) at a time and scored as it comes, a dataset a batch at a
time, and the metrics are kept in fixed-size histograms, so a Criteo day scores in bounded memory. AUC is
computed from a histogram of the float32 probabilities binned by their leading 22 bits (a relative width
of 2^-13): tied pairs count a half, as in the exact rank statistic, which makes the figure exact for
scores that differ by more than that and within about 1e-4 of it otherwise. Log loss is exact.

The output is written under a temporary name beside `--out` and renamed over it when complete, so a
failed or interrupted run leaves no half file; a link at `--out` is refused, never followed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from slipcache.errors import SlipcacheError
from slipcache.options import add_progress_flag, add_threads_flag, positive_int
from slipcache.safe_files import open_fd, prepare_output_file

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
DEFAULT_BATCH_ROWS = 65_536  # rows of a dataset scored at once (raw text: a parse chunk at a time)
BIN_SHIFT = 10  # float32 bits dropped when binning probabilities for the AUC (leading 22 bits kept)
NUM_BINS = (np.float32(1.0).view(np.uint32) >> BIN_SHIFT) + 1  # probabilities lie in [0, 1]
NPY_HEADER_BYTES = 128  # .npy header written before the rows, rewritten with their count at the end
EPS = 1e-7  # probabilities clipped to [EPS, 1 - EPS] for the log loss, as `slipcache.metrics`


class StreamingMetrics:
    """AUC and log loss of any number of (label, probability) pairs in fixed memory (2 x 1 M counts)."""

    def __init__(self) -> None:
        self.positives = np.zeros(NUM_BINS, dtype=np.int64)
        self.negatives = np.zeros(NUM_BINS, dtype=np.int64)
        self.loss_sum = 0.0
        self.rows = 0

    def add(self, labels: np.ndarray, probs: np.ndarray) -> None:
        probs = np.ascontiguousarray(probs, dtype=np.float32)
        positive = np.asarray(labels) > 0.5
        bins = np.minimum(np.clip(probs, 0.0, 1.0).view(np.uint32) >> BIN_SHIFT, NUM_BINS - 1)
        self.positives += np.bincount(bins[positive], minlength=NUM_BINS)
        self.negatives += np.bincount(bins[~positive], minlength=NUM_BINS)
        p = np.clip(probs.astype(np.float64), EPS, 1.0 - EPS)
        self.loss_sum += float(-(np.log(p[positive]).sum() + np.log1p(-p[~positive]).sum()))
        self.rows += len(probs)

    def result(self) -> dict[str, float]:
        n_pos, n_neg = int(self.positives.sum()), int(self.negatives.sum())
        if n_pos == 0 or n_neg == 0:
            auc = float("nan")
        else:
            below = np.cumsum(self.negatives) - self.negatives  # negatives in lower bins
            pairs = (self.positives * below).sum() + 0.5 * (self.positives * self.negatives).sum()
            auc = float(pairs / (float(n_pos) * float(n_neg)))
        return {
            "rows": self.rows,
            "auc": auc,
            "logloss": self.loss_sum / self.rows if self.rows else float("nan"),
            "positive_rate": n_pos / self.rows if self.rows else float("nan"),
        }


# ------------------------------------------------------------------------------------- the output file
def check_out(out: Path, *, force: bool) -> None:
    """Before any work: `--out` must name a file (not a directory, not a link), new unless `force`; its
    parent directory is created (as `slipcache plan` and `export` do)."""
    if out.is_symlink():
        raise SlipcacheError(f"--out {out} is a symbolic link; slipcache never writes through a link: name a file")
    if out.is_dir():
        raise SlipcacheError(f"--out {out} is a directory; name the file to write (.txt, or .npy for NumPy)")
    if out.exists() and not force:
        raise SlipcacheError(f"--out {out} exists; choose a new name, or --force to replace it")
    if out.exists() and not out.is_file():
        raise SlipcacheError(f"--out {out} exists and is not a regular file")
    prepare_output_file(out, "--out")


def _npy_header(rows: int) -> bytes:
    """A .npy (version 1.0) header for float32 [rows], padded to NPY_HEADER_BYTES whatever `rows` is."""
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows},), }}"
    body = text.ljust(NPY_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class ScoreWriter:
    """Probabilities appended to a temporary file beside `out` (created new, never through a link) and
    renamed over `out` by `commit`: text, one "%.6g" probability per line, or .npy float32 [n]."""

    def __init__(self, out: Path) -> None:

        self.out = out
        self.npy = out.suffix.lower() == ".npy"
        self.rows = 0
        self.tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()  # left by a killed run of this pid (or a planted link: removed, not followed)
        self.file: BinaryIO = open(open_fd(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")  # noqa: SIM115
        if self.npy:
            self.file.write(_npy_header(0))

    def write(self, probs: np.ndarray) -> None:
        probs = np.ascontiguousarray(probs, dtype=np.float32)
        if self.npy:
            self.file.write(probs.astype("<f4").tobytes())
        elif len(probs):
            self.file.write(("\n".join(f"{p:.6g}" for p in probs.tolist()) + "\n").encode())
        self.rows += len(probs)

    def commit(self) -> None:
        if self.npy:
            self.file.seek(0)
            self.file.write(_npy_header(self.rows))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.out)

    def abort(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


# ------------------------------------------------------------------------------------- the inputs
@dataclass
class Scored:
    """What a prediction run saw: rows, metrics, and the values its vocabulary had no row for."""

    rows: int
    metrics: dict[str, float]
    unseen: np.ndarray | None  # per table; None: a hash vocabulary, or ids read from a dataset
    present: np.ndarray | None  # per table: values present (not missing) in the raw rows
    malformed: int
    malformed_examples: list[str]
    inputs: list[str]


def input_kind(path: Path) -> str:
    """"dataset" (a slipcache dataset or TorchRec / DLRM / MLPerf files), "raw-dir" or "raw"."""
    from slipcache.data.formats import detect_format

    if not path.exists():
        raise SlipcacheError(f"{path}: no such file or directory")
    if path.is_dir():
        return "dataset" if (path / "meta.json").is_file() or detect_format(path) is not None else "raw-dir"
    return "raw"


def raw_files(paths: list[Path]) -> list[Path]:
    from slipcache.training.datasets import _raw_inputs

    files: list[Path] = []
    for path in paths:
        files.extend(_raw_inputs(path))
    return files


def _open_dataset(path: Path, model: Any) -> Any:
    """The dataset, checked to be mapped as the model's training data was."""
    from slipcache.data.formats import open_any
    from slipcache.serving import Vocabulary
    from slipcache.training.datasets import check_table_sizes

    config = model.training_config
    try:
        dataset = open_any(path, table_sizes=config.get("table_sizes"), split_order=config.get("split_order"))
    except SlipcacheError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise SlipcacheError(f"cannot open dataset {path}: {exc}") from exc
    check_table_sizes(model.table_sizes, dataset.table_sizes, f"dataset {path}")
    theirs = Vocabulary.from_dataset(path)
    if model.vocabulary.maps_raw and theirs.maps_raw and not theirs.same_mapping(model.vocabulary):
        raise SlipcacheError(
            f"dataset {path} was preprocessed with another vocabulary than the model's ({model.vocabulary.source}): "
            "its ids mean other values; score its raw files instead"
        )
    return dataset


def _dataset_batches(
    dataset: Any, split: str, batch_rows: int
) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    from slipcache.data.batches import BatchIterator

    if split not in dataset.splits or not dataset.splits[split]:
        raise SlipcacheError(f"dataset {dataset.path} has no {split!r} split (has: {', '.join(dataset.splits)})")
    for batch in BatchIterator(dataset.split(split), batch_rows):
        yield batch.labels.numpy(), batch.dense, batch.sparse


def predict(
    model: Any,
    inputs: list[str | Path],
    out: str | Path,
    *,
    split: str = "test",
    strict: bool = True,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    progress: bool = False,
    force: bool = False,
) -> Scored:
    """Score `inputs` (raw Criteo files or directories of them, or dataset directories) with `model` (a
    `slipcache.load_model` result) into file `out`; returns what was scored and the metrics. `strict`: a
    malformed raw line stops the run (so that output line N is input row N); else it is skipped, counted."""
    from slipcache.data.criteo import ReadStats, read_chunks
    from slipcache.progress import progress_bar

    out = Path(out)
    paths = [Path(p).expanduser() for p in inputs]
    if not paths:
        raise SlipcacheError("no input files")
    if split not in SPLITS:
        raise SlipcacheError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    check_out(out, force=force)
    kinds = [input_kind(p) for p in paths]
    datasets = [_open_dataset(p, model) for p, k in zip(paths, kinds, strict=True) if k == "dataset"]
    raw = raw_files([p for p, k in zip(paths, kinds, strict=True) if k != "dataset"])
    if raw:
        model.vocabulary.require_raw()
    tables = len(model.table_sizes)
    unseen = np.zeros(tables, dtype=np.int64) if raw and model.vocabulary.kind == "frequency" else None
    present = np.zeros(tables, dtype=np.int64) if raw else None
    metrics, stats = StreamingMetrics(), ReadStats()
    writer = ScoreWriter(out)
    try:
        with progress_bar(unit="rows", unit_scale=True, desc="scoring", disable=not progress) as bar:
            for dataset in datasets:
                for labels, dense, sparse in _dataset_batches(dataset, split, batch_rows):
                    probs = model(dense, sparse).numpy()
                    writer.write(probs)
                    metrics.add(labels, probs)
                    bar.update(len(probs))
            for path in raw:
                for chunk in read_chunks(path, strict=strict, stats=stats):
                    dense, ids, missed = model.encode_raw(chunk.dense, chunk.categorical)
                    probs = model(torch.from_numpy(dense), torch.from_numpy(ids)).numpy()
                    writer.write(probs)
                    metrics.add(chunk.labels, probs)
                    assert present is not None
                    present += (chunk.categorical >= 0).sum(axis=0)
                    if unseen is not None and missed is not None:
                        unseen += missed
                    bar.update(len(probs))
        if writer.rows == 0:
            first = f"; first: {stats.examples[0]}" if stats.examples else ""
            raise SlipcacheError(f"no rows to score in the input ({stats.bad} malformed lines{first})")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    log.info("scored %d rows into %s", writer.rows, out)
    return Scored(writer.rows, metrics.result(), unseen, present, stats.bad, list(stats.examples),
                  [str(p) for p in paths])


def unseen_message(scored: Scored) -> str | None:
    """'unseen values: ...' for a frequency vocabulary; None when there is nothing to say."""
    if scored.unseen is None or scored.present is None:
        return None
    total, present = int(scored.unseen.sum()), int(scored.present.sum())
    if total == 0:
        return f"unseen values: none (every one of the {present:,} categorical values has its own row)"
    worst = np.argsort(-scored.unseen, kind="stable")[:3]
    most = ", ".join(f"C{t + 1} {int(scored.unseen[t]):,}" for t in worst if scored.unseen[t])
    return (
        f"unseen values: {total:,} of {present:,} categorical values ({100 * total / max(present, 1):.2f}%) have no "
        f"row in the run's vocabulary (never seen in training, or rarer than its --min-count) and were scored "
        f"with their table's default row 0; most in {most}"
    )


# ------------------------------------------------------------------------------------- the command
def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs", nargs="+", metavar="FILE",
        help="raw Criteo files (Kaggle/Terabyte TSV, Kaggle CSV, CSV with header; .gz too), directories of them, "
        "or a dataset directory",
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="RUN_OR_EXPORT",
        help="a run directory or checkpoint file (slipcache train), or an export directory (slipcache export)",
    )
    parser.add_argument(
        "--out", required=True, metavar="PATH",
        help="file of probabilities, one per input row in input order: text (one per line), or NumPy float32 "
        "when it ends in .npy (its directory is created; written whole, then renamed into place)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--split", default="test", choices=SPLITS, help="the split of a dataset directory to score (default test)"
    )
    parser.add_argument(
        "--skip-malformed", action="store_true",
        help="raw files: skip malformed lines (counted; the output then has fewer lines than the input) instead "
        "of stopping at the first, which keeps output line N the score of input row N",
    )
    parser.add_argument(
        "--batch-rows", type=positive_int, default=DEFAULT_BATCH_ROWS,
        help="rows of a dataset scored at once (default %(default)s)",
    )
    add_threads_flag(parser)
    add_progress_flag(parser)


def run_predict(args: argparse.Namespace) -> int:
    import sys

    from slipcache.serving import load_model

    out = Path(args.out)
    check_out(out, force=args.force)  # before the model loads (minutes at scale)
    for path in args.inputs:
        input_kind(Path(path).expanduser())
    model = load_model(args.checkpoint)
    scored = predict(
        model, args.inputs, out, split=args.split, strict=not args.skip_malformed, batch_rows=args.batch_rows,
        progress=args.progress, force=args.force,
    )
    m = scored.metrics
    print(f"scored {scored.rows:,} rows into {out} ({'NumPy float32' if out.suffix.lower() == '.npy' else 'text'})")
    print(f"  AUC       {m['auc']:.4f}")
    print(f"  log loss  {m['logloss']:.4f}")
    print(f"  positive rate {m['positive_rate']:.4f}")
    message = unseen_message(scored)
    if message:
        print(f"  {message}")
    if scored.malformed:
        print(f"slipcache predict: warning: {scored.malformed:,} malformed lines were skipped (not scored); the first:",
              file=sys.stderr)
        for example in scored.malformed_examples:
            print(f"  {example}", file=sys.stderr)
    return 0
