"""Embedding tables: quantized row storage, the fp32 row cache, and the collection that trains both."""

from slipcache.embedding.collection import (
    OPTIMIZERS,
    POOLINGS,
    CachedEmbeddingBagCollection,
    EmbeddingConfig,
    SparseFeatures,
)

__all__ = ["OPTIMIZERS", "POOLINGS", "CachedEmbeddingBagCollection", "EmbeddingConfig", "SparseFeatures"]
