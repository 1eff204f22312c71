"""TorchRec interop: our cached, low-precision tables where a TorchRec `EmbeddingBagCollection` goes.

`KeyedCachedEmbeddingBagCollection` is a `CachedEmbeddingBagCollection` built from TorchRec
`EmbeddingBagConfig`s that takes a `KeyedJaggedTensor` and returns a `KeyedTensor`, and answers
`embedding_bag_configs()`, so TorchRec models (`torchrec.models.dlrm.DLRM`, `SparseArch`) accept it in place
of theirs. TorchRec's training tables are fp32/fp16 only (pytorch/torchrec#1180, #2264); these are INT8/INT4
behind an fp32 cache and update themselves in backward (no optimizer over them: give the model's
`parameters()`, which are the dense ones, to a torch optimizer).

torchrec is optional (`pip install 'slipcache[torchrec]'`): it is imported only when a KJT is converted or a
KeyedTensor built, and only its public classes are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig, SparseFeatures
from slipcache.errors import InvalidInputError, SlipcacheError

INSTALL_HINT = (
    "pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 (see README: Using slipcache with TorchRec)"
)


def import_torchrec() -> Any:
    """The torchrec module, or a one-line error saying how to install it."""
    try:
        import torchrec
    except ImportError as exc:
        raise SlipcacheError(f"torchrec is not installed: {INSTALL_HINT}") from exc
    return torchrec


def _pooling_name(pooling: Any) -> str:
    name = str(getattr(pooling, "value", pooling)).lower()
    if name not in ("sum", "mean"):
        raise SlipcacheError(f"pooling {name!r} is not supported (sum or mean)")
    return name


def config_from_torchrec(
    tables: Sequence[Any], **options: Any
) -> tuple[EmbeddingConfig, list[str], list[int]]:
    """Our `EmbeddingConfig` for TorchRec `EmbeddingBagConfig`s, with each feature and its table.

    `options` are `EmbeddingConfig` fields (precision, cache_size, policy, optimizer, lr, ...). All tables
    must share one dim and one pooling (the collection pools alike).
    """
    if not tables:
        raise SlipcacheError("no tables: give at least one EmbeddingBagConfig")
    dims = {int(t.embedding_dim) for t in tables}
    if len(dims) != 1:
        raise SlipcacheError(f"tables must share one embedding_dim, got {sorted(dims)}")
    poolings = {_pooling_name(t.pooling) for t in tables}
    if len(poolings) != 1:
        raise SlipcacheError(f"tables must share one pooling, got {sorted(poolings)}")
    feature_names = [f for t in tables for f in t.feature_names]
    feature_tables = [i for i, t in enumerate(tables) for _ in t.feature_names]
    if len(set(feature_names)) != len(feature_names):
        raise SlipcacheError(f"a feature is named twice: {feature_names}")
    config = EmbeddingConfig(
        table_sizes=[int(t.num_embeddings) for t in tables],
        dim=dims.pop(),
        pooling=poolings.pop(),
        table_names=[str(t.name) for t in tables],
        **options,
    )
    return config, feature_names, feature_tables


def kjt_to_sparse(kjt: Any, feature_names: Sequence[str]) -> SparseFeatures:
    """A `KeyedJaggedTensor` as `SparseFeatures` with one group of bags per feature, in `feature_names` order."""
    keys = list(kjt.keys())
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise InvalidInputError(
            f"KeyedJaggedTensor has no feature {missing[0]!r} (has: {', '.join(kjt.keys())})"
        )
    if kjt.weights_or_none() is not None:
        raise InvalidInputError("weighted KeyedJaggedTensor (per-id weights) is not supported")
    if kjt.variable_stride_per_key():
        raise InvalidInputError("KeyedJaggedTensor with a batch size per feature is not supported")
    if keys != list(feature_names):
        kjt = kjt.permute([keys.index(f) for f in feature_names])
    lengths = kjt.lengths().view(len(feature_names), kjt.stride())
    return SparseFeatures.from_lengths(kjt.values(), lengths)


class KeyedCachedEmbeddingBagCollection(CachedEmbeddingBagCollection):
    """A `CachedEmbeddingBagCollection` that speaks TorchRec: KJT in, `KeyedTensor` out.

    forward(KeyedJaggedTensor) -> KeyedTensor (keys: the features, [B, dim] each); ids [B, T] or
    `SparseFeatures` still give the plain [B, T, D] tensor.
    """

    def __init__(self, tables: Sequence[Any], **options: Any) -> None:
        config, feature_names, feature_tables = config_from_torchrec(tables, **options)
        super().__init__(config)
        self._torchrec_tables = list(tables)
        self.feature_names = feature_names
        # Features of each table; a table several features read is looked up once per feature ("round"),
        # and the collection sums their gradients into one optimizer step per row.
        self._table_features = [
            [f for f, t in enumerate(feature_tables) if t == table] for table in range(len(tables))
        ]

    def embedding_bag_configs(self) -> list[Any]:
        """The TorchRec configs it was built from (what `torchrec.models.dlrm.SparseArch` reads)."""
        return list(self._torchrec_tables)

    def forward(self, features: Any) -> Any:  # type: ignore[override]
        if isinstance(features, (Tensor, SparseFeatures)):
            return super().forward(features)
        if not hasattr(features, "lengths") or not hasattr(features, "keys"):
            raise InvalidInputError(
                f"expected a KeyedJaggedTensor, SparseFeatures or ids [batch, tables], got {type(features).__name__}"
            )
        sparse = kjt_to_sparse(features, self.feature_names)  # one group of bags per feature
        rounds = max(len(f) for f in self._table_features)
        if rounds == 1:  # one feature per table: features are the tables
            return keyed_tensor(super().forward(sparse), self.feature_names)
        lengths = sparse.offsets.diff().view(len(self.feature_names), sparse.batch_size)
        values = torch.split(sparse.values, lengths.sum(dim=1).tolist())
        pooled: list[Tensor | None] = [None] * len(self.feature_names)
        for r in range(rounds):
            members = [(t, f[r]) for t, f in enumerate(self._table_features) if r < len(f)]
            round_lengths = torch.zeros(len(self._table_features), sparse.batch_size, dtype=lengths.dtype)
            for t, f in members:
                round_lengths[t] = lengths[f]
            out = super().forward(
                SparseFeatures.from_lengths(torch.cat([values[f] for _, f in members]), round_lengths)
            )
            for t, f in members:
                pooled[f] = out[:, t]
        return keyed_tensor(torch.stack(pooled, dim=1), self.feature_names)  # type: ignore[arg-type]


def keyed_tensor(pooled: Tensor, feature_names: Sequence[str]) -> Any:
    """[B, F, D] pooled embeddings as a TorchRec `KeyedTensor` keyed by feature."""
    torchrec = import_torchrec()
    batch, features, dim = pooled.shape
    return torchrec.KeyedTensor(
        keys=list(feature_names),
        length_per_key=[dim] * features,
        values=pooled.reshape(batch, features * dim),
        key_dim=1,
    )


def sparse_to_kjt(ids: Tensor, feature_names: Sequence[str]) -> Any:
    """One id per feature ([B, F], as our datasets hold them) as a `KeyedJaggedTensor`."""
    torchrec = import_torchrec()
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=list(feature_names),
        values=ids.t().reshape(-1).to(torch.int64),
        lengths=torch.ones(ids.numel(), dtype=torch.int64),
    )
