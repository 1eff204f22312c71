"""Generator v2, research code: every table drawn independently by rank from a bounded continuous Zipf law,
kept bit for bit so figures measured before v3 reproduce.

`python -m benchmarks.generator_v2 --out DIR [--samples N] [--scale S] [--seed K]` writes its dataset, which
`slipcache train --data DIR` trains on. The library's generators (v3 and later) build on `Teacher` too.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from slipcache.data.dataset import NUM_TABLES
from slipcache.data.synthetic import DEFAULT_SAMPLES, generate_synthetic
from slipcache.data.synthetic.teacher import HOT_ROWS, TEACHER_DIM, Teacher, synthetic_table_sizes


class GeneratorV2(Teacher):
    """v2: tables drawn independently of each other and of time (kept so earlier figures reproduce).

    Ranks map to row ids by a random permutation per table (int32, 135 MB at full scale); the teacher has
    parameters for the `HOT_ROWS` most popular rows of each table."""

    version = 2

    def __init__(self, scale: float, seed: int) -> None:
        super().__init__(seed)
        self.sizes = np.array(synthetic_table_sizes(scale), dtype=np.int64)
        rng = np.random.default_rng([seed, 0])
        self.exponents = rng.uniform(1.05, 1.2, NUM_TABLES)
        n1 = (self.sizes + 1).astype(np.float64)
        self._cdf_span = 1.0 - n1 ** (1.0 - self.exponents)
        self._inv = 1.0 / (1.0 - self.exponents)
        # A random permutation rank -> id per table, so hot rows are spread over the table (4 bytes/row).
        self.table_offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.rank_to_id = np.concatenate([rng.permutation(int(n)).astype(np.int32) for n in self.sizes])
        self.hot = np.minimum(self.sizes, HOT_ROWS)
        self.hot_offsets = np.concatenate([[0], np.cumsum(self.hot)[:-1]]).astype(np.int64)
        total_hot = int(self.hot.sum())
        self.first_order = np.append(rng.standard_normal(total_hot), 0.0).astype(np.float32)
        self.vectors = np.vstack(
            [rng.standard_normal((total_hot, TEACHER_DIM)), np.zeros((1, TEACHER_DIM))]
        ).astype(np.float32)
        self.init_dense(rng)

    def sample(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense float32 [n, 13] after log1p, ids int32 [n, 26], teacher logit terms float64 [n, 3]).

        `start` (the position of the first row in the log) does not matter: v2 has no time."""
        u = rng.random((n, NUM_TABLES))
        x = (1.0 - u * self._cdf_span) ** self._inv  # continuous Zipf on [1, size + 1)
        ranks = np.minimum(x.astype(np.int64) - 1, self.sizes - 1)
        ids = self.rank_to_id[self.table_offsets + ranks]
        dense = self.draw_dense(rng, n)
        # Rows past the hot ones read the all-zero parameter row at index total_hot.
        params = np.where(ranks < self.hot, self.hot_offsets + ranks, len(self.first_order) - 1)
        return dense, ids, self.terms(dense, params)

    def describe(self) -> dict[str, Any]:
        return {"zipf_exponents": [round(float(e), 4) for e in self.exponents]}


def write_v2(out: str, *, num_samples: int = DEFAULT_SAMPLES, scale: float = 1.0, seed: int = 0,
             progress: bool = True) -> dict[str, Any]:
    """Write the v2 dataset of these parameters to `out` (80/10/10 train/val/test) and return its meta."""
    return generate_synthetic(out, num_samples=num_samples, scale=scale, seed=seed,
                              generator=GeneratorV2(scale, seed), progress=progress)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generator_v2", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="dataset directory to write (must not exist)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="rows (default %(default)s)")
    parser.add_argument("--scale", type=float, default=1.0, help="table sizes relative to Kaggle's (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    meta = write_v2(args.out, num_samples=args.samples, scale=args.scale, seed=args.seed)
    print(f"wrote {args.out}: {args.samples:,} rows, teacher AUC {meta['teacher_auc']:.4f}")


if __name__ == "__main__":
    main()
