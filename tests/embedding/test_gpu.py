"""The paper's setting: cache rows on the GPU, storage in host memory. Skipped without CUDA.

Run on a GPU machine by tools/gpu_check.sh; every test compares against the same run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SIZES = [500, 300, 2000]


def _batches(n: int, batch: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.stack([(torch.rand(batch, generator=gen) ** 3 * s).long() for s in SIZES], dim=1) for _ in range(n)
    ]


def _train(coll: CachedEmbeddingBagCollection, batches: list[torch.Tensor], device: str, k: int, prefetch: bool):
    for i, ids in enumerate(batches):
        if k:
            coll.set_lookahead([b.to(device) for b in batches[i + 1 : i + 1 + k]], prefetch=prefetch)
        out = coll(ids.to(device))
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
    return torch.cat([t.cpu() for t in coll.export_tables()])


@pytest.mark.parametrize("policy,k,prefetch", [("lru", 0, False), ("lru", 1, True), ("lookahead", 4, True)])
def test_cache_on_gpu_storage_on_host_trains_as_on_cpu(policy: str, k: int, prefetch: bool) -> None:
    batches = _batches(30, 64, seed=0)
    config = dict(table_sizes=SIZES, dim=8, precision="fp32", cache_rows=256, policy=policy, lr=0.05)
    cpu = CachedEmbeddingBagCollection(EmbeddingConfig(**config))
    gpu = CachedEmbeddingBagCollection(EmbeddingConfig(**config, cache_device="cuda", storage_device="cpu"))
    expected = _train(cpu, batches, "cpu", k, prefetch)
    got = _train(gpu, batches, "cuda", k, prefetch)
    assert torch.allclose(got, expected, atol=1e-6)
    assert gpu.stats()["hits"] == cpu.stats()["hits"] and gpu.stats()["evictions"] > 0
    if prefetch:
        assert gpu.stats()["prefetched_rows"] == cpu.stats()["prefetched_rows"] > 0


def test_int8_storage_on_host_with_gpu_cache_is_reproducible() -> None:
    batches = _batches(20, 64, seed=1)
    runs = []
    for _ in range(2):
        coll = CachedEmbeddingBagCollection(
            EmbeddingConfig(SIZES, dim=8, precision="int8", cache_rows=256, policy="lookahead", cache_device="cuda")
        )
        runs.append(_train(coll, batches, "cuda", 4, True))
    assert torch.allclose(runs[0], runs[1], atol=1e-3)  # float atomics on the GPU may reorder sums
