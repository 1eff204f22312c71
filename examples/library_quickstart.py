"""The README's library snippet, whole: three tables in INT8 behind a 5 % fp32 cache, trained for a few batches.

    python examples/library_quickstart.py

A test runs this file, so the README's snippet cannot drift from code that works.
"""

import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

tables = CachedEmbeddingBagCollection(EmbeddingConfig(
    table_sizes=[1460, 583, 10_131_227], dim=16,
    precision="int8", cache_size=0.05, policy="lru", rounding="stochastic",
    optimizer="sgd", lr=0.1,
))
for step in range(10):
    ids = torch.stack([torch.randint(0, n, (2048,)) for n in tables.table_sizes], dim=1)  # [batch, tables]
    pooled = tables(ids)              # [batch, tables, dim], differentiable
    pooled.sum().backward()           # the row update is applied here (fused optimizer)
    if step == 0:
        first = tables.stats()["hit_rate"]  # 0.0: the cache starts empty, so every first lookup of a row misses
# The hit rate is cumulative over all lookups: it grows as the cache fills. These ids are uniform, so the two
# small tables end up held whole and the large one hits only its rows already in the cache.
print(f"cache hit rate {tables.stats()['hit_rate']:.2f} after 10 batches ({first:.2f} after the first: "
      f"the cache starts empty); embedding memory {tables.memory_report()['memory_ratio']:.2f}x less than fp32")
