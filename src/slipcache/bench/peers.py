"""The implementations `slipcache bench embedding` compares: `nn.EmbeddingBag` + SGD (torch), FBGEMM's
fused tables, and our `CachedEmbeddingBagCollection`, each built behind one `Built.step(ids, grad)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class BenchConfig:
    """One row of the benchmark, before it is measured at a given dim."""

    name: str
    impl: str  # slipcache | torch | fbgemm
    precision: str
    cache_fraction: float = 0.0
    policy: str = "none"
    huge_pages: str = "off"  # ours only (`--huge-pages`): the peers allocate as torch does


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("torch-fp32", "torch", "fp32"),
    BenchConfig("fbgemm-fp32", "fbgemm", "fp32"),
    BenchConfig("fbgemm-fp16", "fbgemm", "fp16"),
    BenchConfig("slipcache-fp32", "slipcache", "fp32"),
    BenchConfig("slipcache-fp16", "slipcache", "fp16"),
    BenchConfig("slipcache-int8-lru5", "slipcache", "int8", 0.05, "lru"),
    BenchConfig("slipcache-int8-lfu5", "slipcache", "int8", 0.05, "lfu"),
    BenchConfig("slipcache-int8", "slipcache", "int8"),
    BenchConfig("slipcache-int4-lru1", "slipcache", "int4", 0.01, "lru"),
)

def _fill_uniform(flat: Tensor, seed: int, bound: float = 0.01) -> None:
    """Fill a (possibly huge) tensor with uniform values by tiling one random block.

    Why: `uniform_` runs at well under 1 GB/s on two cores, so initializing 9 GB of fp32 tables would take
    longer than the measurement; a copy runs at memory speed. The values only need to be touched and
    plausible, not independent, for a throughput benchmark.
    """
    flat = flat.view(-1)
    gen = torch.Generator().manual_seed(seed)
    block_len = min(flat.numel(), 1 << 22)
    if block_len == 0:
        return
    block = (torch.rand(block_len, generator=gen) * (2 * bound) - bound).to(flat.dtype)
    for start in range(0, flat.numel(), block_len):
        end = min(start + block_len, flat.numel())
        flat[start:end].copy_(block[: end - start])


@dataclass
class Built:
    """A constructed implementation: how to run one step and what it holds."""

    step: Callable[[Tensor, Tensor], None]  # (ids [B, T], grad [B, T, D])
    bytes: int
    fp32_bytes: int
    stats: Callable[[], dict[str, Any]] | None = None
    reset_stats: Callable[[], None] | None = None
    clock: Any = None  # our PhaseClock, for the phase profile
    owner: Any = None  # the module; dropped to free memory
    cache_rows: int = 0  # rows its cache holds (0: no cache), for the prefill


class _TorchBags(nn.Module):
    """26 `nn.EmbeddingBag` (sum, sparse gradients) and `torch.optim.SGD`: the DLRM reference setup."""

    def __init__(self, table_sizes: list[int], dim: int, lr: float, seed: int, batch_size: int) -> None:
        super().__init__()
        bags = []
        for t, n in enumerate(table_sizes):
            weight = torch.empty(n, dim)
            _fill_uniform(weight, seed + t)
            bags.append(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, _weight=weight))
        self.bags = nn.ModuleList(bags)
        self.optimizer = torch.optim.SGD(self.bags.parameters(), lr=lr)
        self.offsets = torch.arange(batch_size, dtype=torch.long)

    def step(self, ids: Tensor, grad: Tensor) -> None:
        cols = ids.t().contiguous()
        offsets = self.offsets[: ids.shape[0]]
        out = torch.stack([bag(cols[t], offsets) for t, bag in enumerate(self.bags)], dim=1)
        out.backward(grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _build_torch(sizes: list[int], dim: int, lr: float, seed: int, batch_size: int) -> Built:
    bags = _TorchBags(sizes, dim, lr, seed, batch_size)
    nbytes = sum(w.numel() * w.element_size() for w in bags.bags.parameters())
    return Built(step=bags.step, bytes=nbytes, fp32_bytes=sum(sizes) * dim * 4, owner=bags)


def fbgemm_available() -> str | None:
    """None when FBGEMM's table-batched embedding imports; else the reason it does not."""
    try:
        with warnings.catch_warnings():  # it warns about optional SSD/GPU kernels the CPU build lacks
            warnings.simplefilter("ignore")
            import fbgemm_gpu  # noqa: F401
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
                SplitTableBatchedEmbeddingBagsCodegen,
            )
    except Exception as exc:  # ImportError, or OSError/RuntimeError from mismatched native libraries
        return f"{type(exc).__name__}: {exc}"
    return None


def _build_fbgemm(sizes: list[int], dim: int, precision: str, lr: float, seed: int) -> Built:
    """FBGEMM TBE on the host: CPU compute, exact SGD, fp32 or fp16 weights (it has no cache on CPU)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    weights_precision = {"fp32": SparseType.FP32, "fp16": SparseType.FP16}[precision]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in sizes],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=lr,
        weights_precision=weights_precision,
        pooling_mode=PoolingMode.SUM,
        device="cpu",
    )
    with torch.no_grad():
        _fill_uniform(tbe.weights_host, seed)  # FBGEMM zero-fills lazily; touch every page like the others
    num_tables = len(sizes)
    offsets_cache: dict[int, Tensor] = {}

    def step(ids: Tensor, grad: Tensor) -> None:
        batch = ids.shape[0]
        offsets = offsets_cache.get(batch)
        if offsets is None:
            offsets = offsets_cache[batch] = torch.arange(num_tables * batch + 1, dtype=torch.long)
        out = tbe(ids.t().contiguous().view(-1), offsets)  # table-major indices, one id per bag
        out.backward(grad.reshape(batch, -1))

    nbytes = tbe.weights_host.numel() * tbe.weights_host.element_size()
    return Built(step=step, bytes=nbytes, fp32_bytes=sum(sizes) * dim * 4, owner=tbe)


def _slipcache_module() -> Any:
    """Import our embedding module lazily: the benchmark must still run the peers if it is broken."""
    from slipcache.embedding import collection as embedding

    return embedding


def _slipcache_config(cfg: BenchConfig, sizes: list[int], dim: int, lr: float, seed: int) -> Any:
    embedding = _slipcache_module()
    return embedding.EmbeddingConfig(
        table_sizes=list(sizes),
        dim=dim,
        precision=cfg.precision,
        cache_size=cfg.cache_fraction,
        policy=cfg.policy,
        rounding="stochastic",
        optimizer="sgd",
        lr=lr,
        seed=seed,
        huge_pages=cfg.huge_pages,
    )


def slipcache_static_estimate(cfg: BenchConfig, sizes: list[int], dim: int) -> dict[str, Any]:
    """The module's memory report for this configuration, without allocating it."""
    embedding = _slipcache_module()
    return embedding.CachedEmbeddingBagCollection.estimate_memory(_slipcache_config(cfg, sizes, dim, 0.1, 0))




def _build_slipcache(
    cfg: BenchConfig, sizes: list[int], dim: int, lr: float, seed: int
) -> Built:
    embedding = _slipcache_module()
    coll = embedding.CachedEmbeddingBagCollection(_slipcache_config(cfg, sizes, dim, lr, seed))
    coll.train()
    report = coll.memory_report()

    def step(ids: Tensor, grad: Tensor) -> None:
        out = coll(ids)
        out.backward(grad)

    return Built(
        step=step,
        bytes=int(report["total_bytes"]),
        fp32_bytes=int(report["fp32_bytes"]),
        stats=coll.stats,
        reset_stats=coll.reset_stats,
        clock=coll.clock,
        owner=coll,
        cache_rows=coll.cache.capacity if cfg.cache_fraction else 0,
    )


def estimate_bytes(cfg: BenchConfig, sizes: list[int], dim: int) -> tuple[int, dict[str, Any] | None]:
    """(bytes to compare with the budget, the module's static report for ours if any)."""
    rows = sum(sizes)
    if cfg.impl == "torch":
        return rows * dim * 4, None
    if cfg.impl == "fbgemm":
        return rows * dim * (4 if cfg.precision == "fp32" else 2), None
    static = slipcache_static_estimate(cfg, sizes, dim)
    # The static report is the steady state; add initialization temporaries (one chunk of fp32 rows and
    # what rounding it allocates, the module's chunk is 2^20 rows).
    return int(static["total_bytes"]) + 4 * min(rows, 1 << 20) * dim * 4, static


