"""Criteo-shaped synthetic data with a hidden teacher; `slipcache synth` (and `synth --compare`).

Why synthetic: the full Criteo set is 45M rows and not available offline, but experiments need data
with its shape (26 tables with the Kaggle cardinalities, power-law id popularity, skewed dense counts,
positive rate 0.256) and a known achievable AUC. Labels come from a teacher that a DLRM can represent:
a dense linear term, first-order terms and pairwise dot products of per-value teacher vectors.

Two generators (docs/data.md):
- v3, the default: the big tables are views of latent entities (user, ad, site) with their own power-law
  popularity, derived with table-specific collisions and noise, so they recur together as in real rows;
  missing values come in the real rows' groups; rows are in time order over days, with new entities and
  drifting popularity; splits follow time. Everything per value is a hash, so no per-row arrays.
- v2, kept bit for bit so earlier figures reproduce: every table drawn independently by rank from a
  bounded continuous Zipf law (inverse CDF) and mapped to row ids by a random permutation per table
  (int32, 135 MB at full scale); teacher parameters for the `HOT_ROWS` most popular rows of each table.

Modules: `teacher` (the shape and the labelling teacher both generators share), `v2`, `v3`, `generate`
(writing a dataset, windows of rows, the dataset cache), `compare` (`synth --compare`), `cli`.
"""

from slipcache.data.synthetic.compare import compare_with_real, format_comparison
from slipcache.data.synthetic.generate import (
    DEFAULT_GENERATOR,
    DEFAULT_SAMPLES,
    GENERATOR_VERSIONS,
    default_synthetic_path,
    generate_synthetic,
    make_generator,
    synthetic_rows,
    synthetic_window,
)
from slipcache.data.synthetic.teacher import KAGGLE_CARDINALITIES, expected_auc, synthetic_table_sizes
from slipcache.data.synthetic.v3 import MISSING_ROW

__all__ = [
    "DEFAULT_GENERATOR", "DEFAULT_SAMPLES", "GENERATOR_VERSIONS", "KAGGLE_CARDINALITIES", "MISSING_ROW",
    "compare_with_real", "default_synthetic_path", "expected_auc", "format_comparison",
    "generate_synthetic", "make_generator", "synthetic_rows", "synthetic_table_sizes", "synthetic_window",
]  # fmt: skip
