"""Embedding tables: quantized row storage, the fp32 row cache, and the collection that trains both."""

from slipcache.embedding.collection import CachedEmbeddingBagCollection
from slipcache.embedding.config import OPTIMIZERS, POOLINGS, EmbeddingConfig
from slipcache.embedding.inputs import SparseFeatures

__all__ = ["OPTIMIZERS", "POOLINGS", "CachedEmbeddingBagCollection", "EmbeddingConfig", "SparseFeatures"]
