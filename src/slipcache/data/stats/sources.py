"""Where the rows come from: raw Criteo files, a dataset directory or in-memory arrays, as chunks in order."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.data.criteo import MISSING, ReadStats, read_chunks
from slipcache.data.dataset import SPLIT_NAMES
from slipcache.data.formats import detect_format, open_any
from slipcache.errors import SlipcacheError

READ_ROWS = 262_144  # rows per read from a preprocessed dataset
Chunk = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]  # categorical, dense, labels


@dataclass
class Source:
    """Where the rows come from: `chunks(record=True)` starts a fresh pass over them (`record=False`: a
    second pass, whose malformed lines are not counted again)."""

    chunks: Callable[..., Iterator[Chunk]]
    info: dict[str, Any]
    missing_value: int | None
    total_rows: int | None = None
    read_stats: ReadStats | None = None
    dense_nan_is_missing: bool = True  # False for datasets: they store a missing dense feature as 0


def _natural_key(path: Path) -> list[Any]:
    """day_2 before day_10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.name)]


def _raw_source(files: list[Path], info: dict[str, Any]) -> Source:
    stats = ReadStats()

    def chunks(record: bool = True) -> Iterator[Chunk]:
        target = stats if record else ReadStats()
        for path in files:
            try:
                for chunk in read_chunks(path, stats=target):
                    yield chunk.categorical, chunk.dense, chunk.labels
            except SlipcacheError as exc:
                if str(path) in str(exc):
                    raise
                raise SlipcacheError(f"{path}: {exc}") from exc

    source = Source(
        chunks=chunks,
        info=info,
        missing_value=MISSING,
        read_stats=stats,
    )
    source.info["missing"] = f"empty field -> {MISSING}, counted as one value of its table"
    source.info["dense_missing"] = "empty field -> NaN"
    return source


def _dataset_source(path: Path, splits: Sequence[str] | None) -> Source:
    dataset = open_any(path)  # a slipcache dataset or TorchRec / DLRM / MLPerf files (data.formats)
    names = list(splits) if splits else [s for s in SPLIT_NAMES if s in dataset.splits]
    names += [s for s in dataset.splits if not splits and s not in names]
    arrays = [(name, dataset.split(name)) for name in names]  # validates names and shapes
    vocabulary = dataset.meta.get("vocabulary")
    if "missing_row" in dataset.meta:
        missing = dataset.meta["missing_row"]
        missing_text = f"row {missing} (meta.json missing_row)"
    elif vocabulary == "hash":
        missing, missing_text = 0, "row 0 = empty field (hash vocabulary)"
    elif vocabulary == "frequency":
        missing, missing_text = (
            0,
            "row 0 = empty field, rare value or value unseen in train (frequency vocabulary)",
        )
    else:
        missing, missing_text = None, "none (no row stands for an empty field)"

    def chunks(record: bool = True) -> Iterator[Chunk]:
        for _, split in arrays:
            for start in range(0, len(split), READ_ROWS):
                end = min(start + READ_ROWS, len(split))
                yield (
                    np.asarray(split.sparse[start:end], dtype=np.int64),
                    np.asarray(split.dense[start:end], dtype=np.float32),
                    np.asarray(split.labels[start:end]),
                )

    info = {
        "path": str(path),
        "kind": "dataset",
        "vocabulary": vocabulary,
        "generator": dataset.meta.get("generator"),
        "splits": {name: len(split) for name, split in arrays},
        "missing": missing_text,
        "dense_missing": "not recorded (the dataset stores a missing dense feature as 0: the dense shapes "
        "are of the stored values, log(1 + max(x, 0)), and a zero share counts the missing ones too)",
    }
    return Source(chunks, info, None if missing is None else int(missing), sum(len(s) for _, s in arrays),
                  dense_nan_is_missing=False)


def open_source(path: str | os.PathLike[str], splits: Sequence[str] | None = None) -> Source:
    """A raw Criteo file, a directory of raw files (in natural name order) or a dataset directory."""
    p = Path(path)
    if p.is_dir():
        if (p / "meta.json").is_file() or detect_format(p) is not None:
            return _dataset_source(p, splits)
        files = sorted(
            (f for f in p.iterdir() if f.is_file() and not f.name.startswith(".") and f.suffix != ".md"),
            key=_natural_key,
        )
        if not files:
            raise SlipcacheError(f"{p}: no data files in this directory")
        return _raw_source(files, {"path": str(p), "kind": "raw", "files": [f.name for f in files]})
    if not p.exists():
        raise SlipcacheError(f"{p}: no such file or directory")
    return _raw_source([p], {"path": str(p), "kind": "raw"})


def rechunk(chunks: Iterator[Chunk], chunk_rows: int, max_rows: int | None) -> Iterator[Chunk]:
    """The rows in order, cut into pieces of exactly `chunk_rows` (the last may be shorter)."""
    parts: list[Chunk] = []
    buffered = 0
    taken = 0

    def cut(parts: list[Chunk], n: int) -> tuple[Chunk, list[Chunk]]:
        joined = tuple(None if p[0] is None else np.concatenate(p) for p in zip(*parts, strict=True))
        cats, dense, labels = joined
        assert cats is not None  # every chunk has its ids
        head = (cats[:n], None if dense is None else dense[:n], None if labels is None else labels[:n])
        rest = (cats[n:], None if dense is None else dense[n:], None if labels is None else labels[n:])
        return head, ([rest] if len(rest[0]) else [])

    try:
        for chunk in chunks:
            if max_rows is not None and taken + len(chunk[0]) >= max_rows:
                keep = max_rows - taken
                chunk = (chunk[0][:keep], *(None if a is None else a[:keep] for a in chunk[1:]))  # type: ignore[assignment]
            parts.append(chunk)
            buffered += len(chunk[0])
            taken += len(chunk[0])
            while buffered >= chunk_rows:
                head, parts = cut(parts, chunk_rows)
                buffered -= chunk_rows
                yield head
            if max_rows is not None and taken >= max_rows:
                break
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    if buffered:
        yield cut(parts, buffered)[0]
