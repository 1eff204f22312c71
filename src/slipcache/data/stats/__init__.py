"""Access-pattern statistics of Criteo-shaped data; `slipcache stats`.

Modules: `sources` (rows in order, from files, datasets or arrays), `counting` (distinct values within a
memory bound), `figures` (per table, across tables, over time), `compute` (the passes), `report` (text
and plot), `cli`.

Why: every cache hit rate and every skipped input depends on which rows are hot, how many inputs touch
only hot rows and how fast rows come and go. These figures say how a dataset (real, preprocessed or
synthetic) looks by exactly those measures, so synthetic data can be held against real logs.

Definitions (the sample is the rows read, after `max_rows`; a "value" is one distinct id of one table):
- Missing fields count as one value of their table. Raw files: an empty field is `criteo.MISSING` (-1).
  Preprocessed datasets: row 0, which is "empty" for the hash vocabulary and "empty, rare or unseen in
  train" for the frequency vocabulary. Synthetic datasets: none (unless meta.json names `missing_row`).
- A row's value *recurs* iff it occurs at least twice in the sample; singletons are values seen once.
  `recur_share`: share of rows whose value recurs; `singleton_share`: share of distinct values seen once.
- `top_share[f]`: share of lookups taken by the k = max(1, ceil(f * distinct)) most frequent values.
- `power_law_exponent`: s of count ~ rank^-s, least squares on log count vs log rank at 40 log-spaced
  ranks among the values that recur (the singleton tail is flat by construction); None if < 5 recur.
- Co-recurrence: share of rows whose values in all big tables recur, against the product of the tables'
  recur shares (what independent tables would give). Big tables: C3, C4, C12, C16, C21 for 26 tables,
  else the five with most distinct values.
- Hot inputs (Slipstream's rule): a budget of B bytes holds K = B / (4 * 16) fp32 rows of dim 16; the
  hot rows are the K values with the highest counts over all tables (ties broken by a hash of the value,
  so exactly K are hot); an input is hot iff all its lookups are hot. `hot_fractions` also sets K as a
  share of all distinct values, which stays informative on samples smaller than any byte budget.
- Over time (the rows in their order, cut into chunks of `chunk_rows`): `new_id_rate` is the share of a
  chunk's lookups whose value was not seen in earlier chunks; `top_overlap` is |A & B| / k for the top-k
  values (k = min(top_k, values recurring within each of the two chunks)) of consecutive chunks.

Memory: counts are exact while all tables together hold at most `max_values` distinct values. Beyond
that (the full Kaggle set has 33.8 M), the table with most values keeps only values whose hash falls
below a threshold that halves each time (distinct-value sampling: a kept value's count stays exact and
stands for 2^level values); the new-id rate is then estimated from the kept values. Per-row figures
(co-recurrence, correlation, hot inputs) use a uniform reservoir of `sample_rows` rows: exact when the
sample has no more rows, else estimates (binomial standard error <= 0.5 / sqrt(sample_rows)). When
counts were sampled, a second pass counts the reservoir's values exactly; the sampled tables' figures and
the hot-row thresholds then come from those lookups (a value seen c times stands for
rows / (sample lookups * c) values, so heavy values, which value sampling would catch or miss by luck,
are measured well). `exact` in the result says which figures are exact.
"""

from slipcache.data.stats.compute import compute_stats, compute_stats_arrays
from slipcache.data.stats.report import format_stats, plot_stats

__all__ = ["compute_stats", "compute_stats_arrays", "format_stats", "plot_stats"]
