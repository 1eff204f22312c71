"""Named table sizes (`--table-sizes mlperf`), so a benchmark's shape is a word rather than 26 numbers."""

from __future__ import annotations

import argparse

from slipcache.data.kaggle import KAGGLE_CARDINALITIES

# MLPerf's DLRM (Criteo 1 TB, each table capped at 40 M rows), as TorchRec's, NVIDIA's and Intel's recipes
# pass it: 204,184,588 rows.
MLPERF_SIZES = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155,
    4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
PRESETS = {"mlperf": MLPERF_SIZES, "kaggle": list(KAGGLE_CARDINALITIES)}


def parse_table_sizes(text: str) -> list[int]:
    """A preset name (mlperf, kaggle) or comma-separated row counts; argparse's one-line error otherwise."""
    if text.strip().lower() in PRESETS:
        return list(PRESETS[text.strip().lower()])
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(PRESETS)} or comma-separated row counts, got {text!r}"
        ) from exc
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive, got {text!r}")
    return sizes
