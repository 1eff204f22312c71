"""Scoring with a trained model: `slipcache.load_model(path)`, from an export or a run.

The model comes with the run's vocabulary (`slipcache.data.vocabulary`), so new raw rows are mapped to rows
exactly as its training data was.

An export directory (`slipcache export`) holds, beside the tables:

    model.json      {"format": "slipcache-model", "model": ModelConfig's fields, "tables": [files],
                     "vocabulary": {"kind": ..., ...}, "trained": the run's config and checkpoint}
    model.pt        the dense layers' state dict (bottom.*, top.*), for DLRM(ModelConfig(...))
    vocabulary.pt   frequency vocabulary: {"values": [int64 [n_t]], "rows": [int32 [n_t]]}, raw value ->
                    row per table (values ascending); absent for hash and id vocabularies

Every file reads with plain `torch.load(path, weights_only=True)`.
"""

from __future__ import annotations

import json
import logging
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slipcache.data.vocabulary import Vocabulary
from slipcache.errors import SlipcacheError
from slipcache.export import (
    FILES,
    MODEL_FILE,
    MODEL_FORMAT,
    MODEL_INFO,
    MODEL_VERSION,
    dequantize_rowwise_int8,
    table_name,
)

if typing.TYPE_CHECKING:
    from slipcache.model import DLRM

log = logging.getLogger(__name__)

# The table file a loader reads, best first: fp32 rows as trained, then the INT8 layouts (dequantized).
TABLE_PREFERENCE = ("fp32", "torchrec", "int8", "tbe-int8")


class ScoringModel(nn.Module):
    """A trained DLRM ready to score: eval mode, no gradients; `model(dense, sparse)` -> click probabilities.

    dense: float32 [B, 13], already transformed as in training (log(1 + max(x, 0)), missing 0); sparse: int
    [B, 26] rows. `encode_raw` turns parsed raw rows into both with the run's `vocabulary`.
    """

    def __init__(
        self, model: DLRM, vocabulary: Vocabulary, source: str, training_config: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.vocabulary = vocabulary
        self.source = source
        self.training_config = dict(training_config or {})  # the run's saved config (data options, ...)
        self.requires_grad_(False)
        self.eval()

    @property
    def table_sizes(self) -> list[int]:
        return list(self.model.config.table_sizes)

    @property
    def num_dense(self) -> int:
        return int(self.model.config.num_dense)

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.as_tensor(dense, dtype=torch.float32), torch.as_tensor(sparse).long())

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, sparse))

    def encode_raw(
        self, dense: np.ndarray, categorical: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Parsed raw rows (`slipcache.data.criteo.RawChunk`'s dense and categorical) -> (dense, rows,
        per-table counts of values without a row, None for a hash vocabulary)."""
        from slipcache.data.preprocess import dense_transform

        ids, unseen = self.vocabulary.encode(categorical)
        return dense_transform(dense), ids, unseen


def _load(path: Path, *, mmap: bool = False) -> Any:
    if not path.is_file():
        raise SlipcacheError(f"{path}: not found (the export is incomplete)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # a truncated or foreign file: torch raises several kinds
        raise SlipcacheError(f"{path}: cannot read: {exc}") from exc


def is_export(path: str | Path) -> bool:
    return (Path(path) / MODEL_INFO).is_file()


def _dequantize_tbe_int8(codes: torch.Tensor, scale_bias: torch.Tensor) -> torch.Tensor:
    params = scale_bias.contiguous().view(torch.float16).float()
    return codes.float() * params[:, :1] + params[:, 1:]


def _export_tables(directory: Path, info: dict[str, Any], sizes: list[int], dim: int) -> list[torch.Tensor]:
    """The fp32 tables of an export, from the best file it has: fp32 files memory-mapped (not copied), the
    INT8 layouts dequantized (their fp32 rows priced against the memory first)."""
    listed = info.get("tables", [])
    have = [fmt for fmt in TABLE_PREFERENCE if FILES[fmt] in listed and (directory / FILES[fmt]).is_file()]
    if not have:
        raise SlipcacheError(f"{directory}: no table file ({', '.join(FILES.values())}); export again")
    fmt = have[0]
    if fmt in ("int8", "tbe-int8"):
        from slipcache.embedding.config import EmbeddingConfig
        from slipcache.memory import require_tables_fit

        require_tables_fit(EmbeddingConfig(sizes, dim), f"loading {directory} (INT8 tables as fp32)",
                           embeddings="torch")
    saved = _load(directory / FILES[fmt], mmap=True)
    try:
        if fmt == "fp32":
            tables = [saved[table_name(t)]["weight"] for t in range(len(sizes))]
        elif fmt == "torchrec":
            tables = [saved[f"embedding_bags.{table_name(t)}.weight"] for t in range(len(sizes))]
        elif fmt == "int8":
            tables = [dequantize_rowwise_int8(saved[table_name(t)]) for t in range(len(sizes))]
        else:
            tables = [_dequantize_tbe_int8(codes, scale_bias) for codes, scale_bias in saved]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise SlipcacheError(f"{directory / FILES[fmt]}: does not hold the tables model.json describes") from exc
    log.info("loaded %d tables from %s", len(tables), directory / FILES[fmt])
    return [t.float() for t in tables]


def load_export(directory: str | Path) -> ScoringModel:
    """The model of an export directory: fp32 `nn.EmbeddingBag` tables and the trained dense layers."""
    from slipcache.model import DLRM, ModelConfig, TorchEmbeddingBagCollection

    directory = Path(directory)
    try:
        info = json.loads((directory / MODEL_INFO).read_text())
    except (OSError, ValueError) as exc:
        raise SlipcacheError(f"{directory / MODEL_INFO}: cannot read: {exc}") from exc
    if not isinstance(info, dict) or info.get("format") != MODEL_FORMAT:
        raise SlipcacheError(f"{directory / MODEL_INFO}: not a slipcache model description")
    if int(info.get("version", 0)) > MODEL_VERSION:
        raise SlipcacheError(f"{directory}: written by a newer slipcache (model format {info['version']})")
    try:
        config = ModelConfig(**info["model"])
    except (KeyError, TypeError) as exc:
        raise SlipcacheError(f"{directory / MODEL_INFO}: bad model configuration: {exc}") from exc
    tables = _export_tables(directory, info, list(config.table_sizes), config.embedding_dim)
    embeddings = TorchEmbeddingBagCollection(list(config.table_sizes), config.embedding_dim, weights=tables)
    model = DLRM(config, embeddings)
    dense = _load(directory / MODEL_FILE)
    if not isinstance(dense, dict):
        raise SlipcacheError(f"{directory / MODEL_FILE}: not a state dict")
    missing, unexpected = model.load_state_dict(dense, strict=False)
    missing = [k for k in missing if not k.startswith("embeddings.")]
    if missing or unexpected:
        raise SlipcacheError(
            f"{directory / MODEL_FILE}: does not match model.json (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    vocabulary = Vocabulary.from_export(directory, info.get("vocabulary", {}))
    vocabulary.check_sizes(list(config.table_sizes))
    return ScoringModel(model, vocabulary, str(directory), (info.get("trained") or {}).get("config"))


def load_run(path: str | Path) -> ScoringModel:
    """The model of a run directory or checkpoint, its tables as trained (any precision, with their cache)."""
    from slipcache.training.saved_run import dense_inputs, find_checkpoint, load_saved_model

    saved = find_checkpoint(path, "--checkpoint").read()
    model = load_saved_model(saved, dense_inputs(saved.state))
    vocabulary = Vocabulary.of_run(saved.state["config"], list(saved.state["table_sizes"]))
    vocabulary.check_sizes(list(saved.state["table_sizes"]))
    return ScoringModel(model, vocabulary, str(saved.path), saved.state["config"])


def load_model(path: str | Path) -> ScoringModel:
    """A trained model ready to score (a `torch.nn.Module` in eval mode), from an export directory
    (`slipcache export`) or a run directory / checkpoint.

    `model(dense, sparse)` returns click probabilities; `model.vocabulary` maps new raw rows as the run's
    training data was mapped (`model.encode_raw`). From an export the tables are fp32 `nn.EmbeddingBag`s;
    from a run they are the trained collection itself (its precision and cache).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise SlipcacheError(f"{path}: not found (expected an export directory, a run directory or a checkpoint)")
    return load_export(path) if is_export(path) else load_run(path)
