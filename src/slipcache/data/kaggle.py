"""Criteo Kaggle's shape and the one way slipcache scales it: the synthetic generators, `bench embedding`
and `bench cache` all take their tables from `kaggle_table_sizes`, so "scale 0.05" is the same tables
everywhere (1,688,571 rows).
"""

from __future__ import annotations

from slipcache.errors import SlipcacheError

# Criteo Kaggle categorical cardinalities, C1..C26 (33,762,577 rows in all).
KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
SMALL_TABLE = 100  # tables up to this size keep their size under a scale; bigger ones never shrink below it


def kaggle_table_sizes(scale: float, *, min_rows: int = SMALL_TABLE) -> list[int]:
    """Kaggle's cardinalities times `scale`, rounded; a table of at most `min_rows` rows keeps its size
    and a bigger one never shrinks below `min_rows` (scaling a 24-row table by 0.01 would leave one row:
    another workload). Scale 1 is Kaggle itself."""
    if not scale > 0:
        raise SlipcacheError(f"scale must be positive, got {scale}")
    if min_rows < 1:
        raise SlipcacheError(f"min_rows must be positive, got {min_rows}")
    return [max(min(c, min_rows), int(round(c * scale))) for c in KAGGLE_CARDINALITIES]
