"""slipcache's tables in TorchRec: the names a TorchRec user imports.

- `KeyedCachedEmbeddingBagCollection` (`keyed.py`): our cached low-precision tables where TorchRec's
  `EmbeddingBagCollection` goes (KJT in, KeyedTensor out);
- `KeyedCachedEmbeddingCollection` (`keyed.py`): the same tables where TorchRec's `EmbeddingCollection` goes
  (sequence features: KJT in, a JaggedTensor of rows per feature out);
- `KeyedCachedEmbeddingBagCollectionSharder` (`torchrec_sharding.py`): shards the bag collection under
  TorchRec's `DistributedModelParallel`;
- `KeyedCachedEmbeddingCollectionSharder` (`torchrec_sequence_sharding.py`): shards the sequence collection
  (table-wise, column-wise, row-wise, data-parallel);
- `slipcache_planner`, `SlipcacheStorageEstimator` (`torchrec_planner.py`): TorchRec's planner, costing
  these tables by what they hold;
- `SlipcachePerfEstimator`, `TableLookups`, `lookups_from_profile` (`torchrec_perf.py`): its perf estimate,
  weighted by where each table's lookups fall.

torchrec is optional (`pip install 'slipcache[torchrec]'`): the sharder and planner names import it when
first used; the collection imports it only to convert a KJT or build a KeyedTensor.
"""

from __future__ import annotations

from typing import Any

from slipcache.interop.keyed import (
    INSTALL_HINT,
    KeyedCachedEmbeddingBagCollection,
    KeyedCachedEmbeddingCollection,
    import_torchrec,
    keyed_tensor,
    keyed_tensor_of,
    kjt_to_sparse,
    sparse_to_kjt,
)

# The sharder and planner names (`__getattr__` below) derive from torchrec's classes: imported on first use.
__all__ = [
    "INSTALL_HINT",
    "KeyedCachedEmbeddingBagCollection",
    "KeyedCachedEmbeddingCollection",
    "import_torchrec",
    "keyed_tensor",
    "keyed_tensor_of",
    "kjt_to_sparse",
    "sparse_to_kjt",
]


def __getattr__(name: str) -> Any:
    """The names whose classes derive from torchrec's, imported on first use (torchrec is an extra)."""
    if name in ("KeyedCachedEmbeddingBagCollectionSharder", "ShardedKeyedCachedEmbeddingBagCollection"):
        import_torchrec()
        from slipcache.interop import torchrec_sharding

        return getattr(torchrec_sharding, name)
    if name in ("KeyedCachedEmbeddingCollectionSharder", "ShardedKeyedCachedEmbeddingCollection"):
        import_torchrec()
        from slipcache.interop import torchrec_sequence_sharding

        return getattr(torchrec_sequence_sharding, name)
    if name in ("slipcache_planner", "SlipcacheStorageEstimator"):
        import_torchrec()
        from slipcache.interop import torchrec_planner

        return getattr(torchrec_planner, name)
    if name in ("SlipcachePerfEstimator", "TableLookups", "lookups_from_profile"):
        import_torchrec()
        from slipcache.interop import torchrec_perf

        return getattr(torchrec_perf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
