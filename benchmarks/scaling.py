"""A model of memory per rank and all-to-all traffic for many GPUs: `python -m benchmarks.scaling`.

Memory per rank is the tables' bytes (the collection's own memory estimate) spread evenly over the ranks;
traffic from what an all-to-all of the lookups sends: per lookup that leaves its
rank, one int64 id forward, one fp32 row forward and one fp32 gradient row backward. With equal batch slices a lookup
stays on its own rank with
probability 1/N whatever the placement, so (N - 1)/N of the lookups cross. Prints the tables of
docs/scaling.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipcache.data.synthetic import KAGGLE_CARDINALITIES

ID_BYTES = 8  # one int64 per routed lookup

# Criteo 1TB as MLPerf's DLRM reference trains it (ids capped at 40 M rows per table), dim 128.
TERABYTE_40M = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208]
TERABYTE_40M += [11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]

GPUS_PER_NODE = 8
# Published per-GPU bandwidths, one direction, GB/s (1e9 bytes): NVLink 4 (H100 SXM, 900 GB/s both
# directions), NVLink 3 (A100 SXM, 600 GB/s both ways), InfiniBand NDR 400 Gb/s and HDR 200 Gb/s with one
# NIC per GPU (DGX H100 / DGX A100), 100 Gb Ethernet, PCIe 5.0 and 4.0 x16.
LINKS_GB_S = {
    "NVLink 4": 450.0,
    "NVLink 3": 300.0,
    "IB NDR 400G": 50.0,
    "IB HDR 200G": 25.0,
    "100 GbE": 12.5,
    "PCIe 5.0 x16": 64.0,
    "PCIe 4.0 x16": 32.0,
}
CONFIGS = {  # name -> (precision, cache fraction)
    "fp32": ("fp32", 0.0),
    "INT8, no cache": ("int8", 0.0),
    "INT8 + 5 % cache": ("int8", 0.05),
    "INT4 + 1 % cache": ("int4", 0.01),
}


@dataclass(frozen=True)
class Traffic:
    """Bytes that leave their rank per sample of the global batch."""

    ids: float
    embeddings: float
    gradients: float

    @property
    def total(self) -> float:
        return self.ids + self.embeddings + self.gradients


def traffic_per_sample(num_tables: int, dim: int, world_size: int, lookups_per_table: float = 1.0) -> Traffic:
    """Expected all-to-all bytes per sample for equal batch slices (step metadata left out: 16 B per pair)."""
    crossing = num_tables * lookups_per_table * (world_size - 1) / world_size
    return Traffic(crossing * ID_BYTES, crossing * dim * 4, crossing * dim * 4)


def inter_node_share(world_size: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
    """Share of the crossing lookups whose owner sits on another node (uniform owners)."""
    if world_size <= gpus_per_node:
        return 0.0
    return (world_size - gpus_per_node) / (world_size - 1)


def max_rank_gib(sizes: list[int], dim: int, precision: str, cache: float, world_size: int) -> float:
    """GiB of embedding state per rank with the tables' bytes spread evenly over the ranks (row-wise cuts
    where a table is bigger than a rank's share): each table costed as a collection of its own
    (`CachedEmbeddingBagCollection.estimate_memory`: storage, quantization parameters, cache; SGD)."""
    from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

    total = sum(
        CachedEmbeddingBagCollection.estimate_memory(
            EmbeddingConfig(table_sizes=[int(rows)], dim=dim, precision=precision, cache_size=cache)
        )["total_bytes"]
        for rows in sizes
    )
    return total / world_size / 2**30


def main() -> None:
    worlds = [1, 8, 16, 32, 64]
    for title, sizes, dim in (
        ("Criteo Kaggle", KAGGLE_CARDINALITIES, 16),
        ("Criteo 1TB, 40 M cap", TERABYTE_40M, 128),
    ):
        print(f"\n### {title}: {len(sizes)} tables, {sum(sizes):,} rows, dim {dim}\n")
        print("| tables stored as | " + " | ".join(f"N = {n}" for n in worlds) + " |")
        print("|---|" + "---|" * len(worlds))
        for name, (precision, cache) in CONFIGS.items():
            cells = [f"{max_rank_gib(sizes, dim, precision, cache, n):.2f}" for n in worlds]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print("\nGiB of embedding state per rank (the tables spread evenly).\n")
        print("| N | ids B/sample | rows fwd B/sample | grads bwd B/sample | total | off-node share |")
        print("|---|---|---|---|---|---|")
        for n in worlds[1:]:
            t = traffic_per_sample(len(sizes), dim, n)
            print(
                f"| {n} | {t.ids:.0f} | {t.embeddings:.0f} | {t.gradients:.0f} | {t.total:.0f} | "
                f"{inter_node_share(n):.2f} |"
            )
        print("\nUpper bound on samples/s of the whole job from the all-to-all alone (links fully used):\n")
        print("| N | " + " | ".join(["NVLink 4 (N = 8)", "IB NDR 400G", "IB HDR 200G", "100 GbE"]) + " |")
        print("|---|---|---|---|---|")
        for n in worlds[1:]:
            t = traffic_per_sample(len(sizes), dim, n)
            per_gpu = t.total / n  # each GPU sends (and receives) its share of the job's crossing bytes
            cells = []
            for link in ("NVLink 4", "IB NDR 400G", "IB HDR 200G", "100 GbE"):
                share = 1.0 if link == "NVLink 4" else inter_node_share(n)
                if (link == "NVLink 4") != (n <= GPUS_PER_NODE) or share == 0:
                    cells.append("–")
                    continue
                cells.append(f"{LINKS_GB_S[link] * 1e9 / (per_gpu * share) / 1e6:.1f} M")
            print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
