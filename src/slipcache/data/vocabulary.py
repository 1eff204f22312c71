"""A run's vocabulary: how raw Criteo rows become the model's inputs, for scoring new data.

A model scores new raw rows only if they are mapped exactly as its training data was: the same dense
transform, and the same categorical vocabulary (`slipcache preprocess`'s frequency vocabulary, a row per
value seen in train, or its hash). The dataset a run trained on holds it (meta.json, vocab.npz); an export
keeps a copy (`vocabulary.pt`, model.json's "vocabulary"). Values without a row go to the table's default
row 0, as in training, and are counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipcache.data.criteo import MISSING
from slipcache.data.preprocess import hash_ids, lookup_rows
from slipcache.errors import SlipcacheError

VOCABULARY_FILE = "vocabulary.pt"
VOCABULARY_KINDS = ("frequency", "hash", "ids", "missing")


def _load_tensors(path: Path) -> Any:
    if not path.is_file():
        raise SlipcacheError(f"{path}: not found (the export is incomplete)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch raises several kinds
        raise SlipcacheError(f"{path}: cannot read: {exc}") from exc


@dataclass
class Vocabulary:
    """How raw Criteo rows become the model's inputs.

    kind: "frequency" (a row per raw value seen in train, by count; others row 0), "hash" (row = 1 +
    hash(value, seed) mod (max_rows - 1)), "ids" (the run trained on ids that are already rows: synthetic
    data or preprocessed files from elsewhere; raw files cannot be mapped) or "missing" (the run's dataset,
    which held its vocabulary, is gone). Missing values are row 0 in every kind.
    """

    kind: str
    table_sizes: list[int]
    source: str = ""  # where it was read from, for messages
    values: list[np.ndarray] = field(default_factory=list)  # frequency: raw values per table, ascending
    rows: list[np.ndarray] = field(default_factory=list)  # frequency: their rows
    max_rows: int | None = None  # hash
    hash_seed: int | None = None  # hash
    min_count: int | None = None  # frequency: values rarer than this in train share row 0
    note: str = ""  # ids / missing: why raw files cannot be mapped

    @property
    def maps_raw(self) -> bool:
        return self.kind in ("frequency", "hash")

    def check_sizes(self, table_sizes: list[int]) -> None:
        if self.maps_raw and list(self.table_sizes) != list(table_sizes):
            raise SlipcacheError(
                f"the vocabulary of {self.source} gives tables of {sum(self.table_sizes):,} rows, the model has "
                f"{sum(table_sizes):,}: it is not the vocabulary the model was trained with"
            )

    def require_raw(self) -> None:
        """One line when raw files cannot be mapped with this vocabulary."""
        if not self.maps_raw:
            raise SlipcacheError(f"raw Criteo files cannot be scored with this model: {self.note}")

    def encode(self, categorical: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Raw categorical values int64 [n, T] (MISSING = -1) -> (rows int64 [n, T], per-table counts of
        present values without a row, None for hash: every value has one)."""
        self.require_raw()
        if self.kind == "hash":
            assert self.max_rows is not None
            return hash_ids(categorical, self.max_rows, self.hash_seed or 0).astype(np.int64), None
        ids = np.stack(
            [lookup_rows(v, r, categorical[:, t]) for t, (v, r) in enumerate(zip(self.values, self.rows, strict=True))],
            axis=1,
        ).astype(np.int64)
        unseen = ((categorical != MISSING) & (ids == 0)).sum(axis=0)
        return ids, unseen

    def info(self) -> dict[str, Any]:
        """model.json's "vocabulary" entry."""
        entry: dict[str, Any] = {"kind": self.kind, "table_sizes": list(self.table_sizes), "unknown_row": 0,
                                 "dense_transform": "log(1 + max(x, 0)); missing -> 0"}
        if self.kind == "frequency":
            entry.update(file=VOCABULARY_FILE, min_count=self.min_count)
        elif self.kind == "hash":
            entry.update(max_rows=self.max_rows, hash_seed=self.hash_seed)
        else:
            entry["note"] = self.note
        return entry

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """vocabulary.pt's content (frequency only)."""
        return {
            "values": [torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for v in self.values],
            "rows": [torch.from_numpy(np.ascontiguousarray(r, dtype=np.int32)) for r in self.rows],
        }

    def same_mapping(self, other: Vocabulary) -> bool:
        """Whether two vocabularies map every raw value to the same row."""
        if self.kind != other.kind or list(self.table_sizes) != list(other.table_sizes):
            return False
        if self.kind == "hash":
            return (self.max_rows, self.hash_seed or 0) == (other.max_rows, other.hash_seed or 0)
        if self.kind == "frequency":
            return all(
                np.array_equal(a, b) and np.array_equal(r, s)
                for a, b, r, s in zip(self.values, other.values, self.rows, other.rows, strict=True)
            )
        return True

    # ------------------------------------------------------------------------------------- readers
    @classmethod
    def from_dataset(cls, path: str | Path) -> Vocabulary:
        """The vocabulary a dataset directory was built with (its meta.json, and vocab.npz for frequency)."""
        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            return cls("ids", [], str(path), note=f"{path} holds ids that are already rows (no raw vocabulary)")
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError) as exc:
            raise SlipcacheError(f"{meta_file}: cannot read: {exc}") from exc
        sizes, kind = [int(n) for n in meta.get("table_sizes", [])], meta.get("vocabulary")
        if kind == "hash":
            seed = int(meta.get("hash_seed") or 0)
            return cls("hash", sizes, str(path), max_rows=int(meta["max_rows"]), hash_seed=seed)
        if kind == "frequency":
            try:
                with np.load(path / "vocab.npz", allow_pickle=False) as arrays:
                    values = [arrays[f"t{t}"].astype(np.int64) for t in range(len(sizes))]
                    rows = [arrays[f"ids{t}"].astype(np.int32) for t in range(len(sizes))]
            except (OSError, KeyError, ValueError) as exc:
                raise SlipcacheError(f"{path / 'vocab.npz'}: cannot read the frequency vocabulary: {exc}") from exc
            return cls("frequency", sizes, str(path), values, rows, min_count=meta.get("min_count"))
        what = "synthetic data" if kind == "synthetic" else "ids that are already rows"
        return cls("ids", sizes, str(path), note=f"{path} holds {what} (no raw vocabulary)")

    @classmethod
    def of_run(cls, config: dict[str, Any], table_sizes: list[int]) -> Vocabulary:
        """A run's vocabulary, from its saved config: the dataset it trained on holds it."""
        data, dataset = config.get("data"), config.get("dataset")
        if data is None:
            note = "the run trained on synthetic data, whose ids are rows"
            return cls("ids", list(table_sizes), "the run", note=note)
        if isinstance(dataset, str) and (Path(dataset) / "meta.json").is_file():
            return cls.from_dataset(dataset)
        raw = isinstance(dataset, str) and Path(dataset) != Path(data)  # raw files were preprocessed into the cache
        if raw and config.get("vocab") == "hash":  # rebuilt from the config: prepare_data hashes with seed 0
            rows = int(config.get("max_rows") or 0)
            return cls("hash", [rows] * len(table_sizes), f"the run's config ({data})", max_rows=rows, hash_seed=0)
        where = dataset if isinstance(dataset, str) else data
        return cls("missing", list(table_sizes), str(where),
                   note=f"the run's vocabulary was in its dataset {where}, which no longer exists "
                   "(export the model while it does, or preprocess the same files again)")

    @classmethod
    def from_export(cls, directory: Path, entry: dict[str, Any]) -> Vocabulary:
        kind = entry.get("kind")
        if kind not in VOCABULARY_KINDS:
            raise SlipcacheError(f"{directory}: unknown vocabulary kind {kind!r} in model.json")
        sizes = [int(n) for n in entry.get("table_sizes", [])]
        if kind == "hash":
            return cls("hash", sizes, str(directory), max_rows=int(entry["max_rows"]),
                       hash_seed=int(entry.get("hash_seed") or 0))
        if kind == "frequency":
            saved = _load_tensors(directory / entry.get("file", VOCABULARY_FILE))
            try:
                values = [t.numpy().astype(np.int64) for t in saved["values"]]
                rows = [t.numpy().astype(np.int32) for t in saved["rows"]]
            except (KeyError, TypeError, AttributeError) as exc:
                raise SlipcacheError(f"{directory / VOCABULARY_FILE}: not a slipcache vocabulary") from exc
            return cls("frequency", sizes, str(directory), values, rows, min_count=entry.get("min_count"))
        return cls(kind, sizes, str(directory), note=str(entry.get("note", "")))  # ids, missing
