"""Criteo-shaped synthetic data with a hidden teacher; `slipcache synth` (and `synth --compare`).

Why synthetic: the full Criteo set is 45M rows and not available offline, but experiments need data
with its shape (26 tables with the Kaggle cardinalities, power-law id popularity, skewed dense counts,
positive rate 0.256) and a known achievable AUC. Labels come from a teacher that a DLRM can represent:
a dense linear term, first-order terms and pairwise dot products of per-value teacher vectors.

The generators (docs/data.md), each building on the one before:
- v3: the big tables are views of latent entities (user, ad, site) with their own power-law
  popularity, derived with table-specific collisions and noise, so they recur together as in real rows;
  missing values come in the real rows' groups; rows are in time order over days, with new entities and
  drifting popularity; splits follow time. Everything per value is a hash, so no per-row arrays.
- v4: v3 with the label signal, dense shapes and links of real rows;
- v5, the default: v4 with the label signal reaching the rarer values.
The earlier v2 (independent tables) is research code now: `python -m benchmarks.generator_v2`.

Modules: `teacher` (the shape and the labelling teacher the generators share), `v3`, `v4`, `v5`, `generate`
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
