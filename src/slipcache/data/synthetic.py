"""Criteo-shaped synthetic data with a hidden teacher; `slipcache synth`.

Why synthetic: the full Criteo set is 45M rows and not available offline, but experiments need data
with its shape (26 tables with the Kaggle cardinalities, power-law id popularity, skewed dense counts,
positive rate 0.256) and a known achievable AUC. Labels come from a teacher that a DLRM can represent:
a dense linear term, per-row first-order terms and pairwise dot products of per-row teacher vectors.

Memory: teacher parameters exist only for the `HOT_ROWS` most popular rows of each table (by popularity
rank); rarer rows carry no signal, as they are too rarely seen to be learned anyway. Ids are drawn by
rank from a bounded continuous Zipf law (inverse CDF, no per-row arrays) and mapped to row ids by a
random permutation per table (int32, 135 MB at full scale), so hot rows are spread over the table
instead of being the low ids.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from slipcache.data.dataset import NUM_DENSE, NUM_TABLES, DatasetWriter
from slipcache.errors import SlipcacheError

KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
TARGET_POSITIVE_RATE = 0.256
TARGET_TEACHER_AUC = 0.80
GENERATOR_VERSION = 2
DEFAULT_SAMPLES = 2_500_000  # 2M train + 250k val + 250k test with the default fractions
SMALL_TABLE = 100  # tables up to this size keep their size under --scale; bigger ones never shrink below it
HOT_ROWS = 20_000  # rows (by popularity rank) per table that carry teacher signal
TEACHER_DIM = 8
CHUNK_ROWS = 32_768
CALIBRATION_ROWS = 4 * CHUNK_ROWS
# Fraction of missing values of I1..I13 in the Kaggle training set (approximate).
DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22]
# Share of teacher logit variance from the dense term, first-order row terms, pairwise interactions.
VARIANCE_SHARES = (0.3, 0.3, 0.4)


def synthetic_table_sizes(scale: float) -> list[int]:
    """Kaggle cardinalities times `scale`; small tables (<= SMALL_TABLE rows) keep their size."""
    if not scale > 0:
        raise SlipcacheError(f"scale must be positive, got {scale}")
    return [max(min(c, SMALL_TABLE), int(round(c * scale))) for c in KAGGLE_CARDINALITIES]


class _Generator:
    """All random parameters of one (scale, seed) dataset, and the sampler of row chunks."""

    def __init__(self, scale: float, seed: int) -> None:
        self.seed = seed
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
        self.dense_mu = rng.uniform(0.0, 4.0, NUM_DENSE)
        self.dense_sigma = rng.uniform(0.8, 2.0, NUM_DENSE)
        self.dense_missing = np.array(DENSE_MISSING)
        self.dense_weights = rng.standard_normal(NUM_DENSE)
        self.component_scale = np.ones(3)  # these three are set by calibrate()
        self.logit_scale = 1.0
        self.logit_bias = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dense float32 [n, 13] after log1p, ids int32 [n, 26], teacher logit terms float64 [n, 3])."""
        u = rng.random((n, NUM_TABLES))
        x = (1.0 - u * self._cdf_span) ** self._inv  # continuous Zipf on [1, size + 1)
        ranks = np.minimum(x.astype(np.int64) - 1, self.sizes - 1)
        ids = self.rank_to_id[self.table_offsets + ranks]
        counts = np.floor(
            np.exp(rng.standard_normal((n, NUM_DENSE)) * self.dense_sigma + self.dense_mu) - 0.5
        )
        dense = np.log1p(np.maximum(counts, 0.0))
        dense[rng.random((n, NUM_DENSE)) < self.dense_missing] = 0.0
        dense = dense.astype(np.float32)

        # Rows past the hot ones read the all-zero parameter row at index total_hot.
        rows = np.where(ranks < self.hot, self.hot_offsets + ranks, len(self.first_order) - 1).ravel()
        terms = np.empty((n, 3))
        terms[:, 0] = dense.astype(np.float64) @ self.dense_weights
        terms[:, 1] = self.first_order[rows].reshape(n, NUM_TABLES).sum(axis=1)
        vec = self.vectors[rows]
        total = vec.reshape(n, NUM_TABLES, TEACHER_DIM).sum(axis=1)
        squares = np.einsum("ij,ij->i", vec, vec).reshape(n, NUM_TABLES).sum(axis=1)
        terms[:, 2] = 0.5 * (np.einsum("ij,ij->i", total, total) - squares)
        return dense, ids, terms

    def logits(self, terms: np.ndarray) -> np.ndarray:
        return self.logit_scale * (terms @ self.component_scale) + self.logit_bias

    def calibrate(self) -> None:
        """Weigh the three logit terms by VARIANCE_SHARES, then pick scale and bias for the targets."""
        rng = np.random.default_rng([self.seed, 1])
        terms = np.concatenate(
            [self.sample(rng, CHUNK_ROWS)[2] for _ in range(CALIBRATION_ROWS // CHUNK_ROWS)]
        )
        self.component_scale = np.sqrt(np.array(VARIANCE_SHARES)) / np.maximum(terms.std(axis=0), 1e-12)
        raw = terms @ self.component_scale
        z = np.sort(raw - raw.mean())  # sorted once so expected_auc's sort is cheap
        lo, hi = 0.01, 20.0
        for _ in range(25):
            mid = math.sqrt(lo * hi)
            if expected_auc(mid * z + _bias_for_rate(mid * z, TARGET_POSITIVE_RATE)) < TARGET_TEACHER_AUC:
                lo = mid
            else:
                hi = mid
        self.logit_scale = math.sqrt(lo * hi)
        bias = _bias_for_rate(self.logit_scale * z, TARGET_POSITIVE_RATE)
        self.logit_bias = bias - self.logit_scale * float(raw.mean())


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _bias_for_rate(logits: np.ndarray, rate: float) -> float:
    """The b with mean(sigmoid(logits + b)) == rate (Newton's method; the mean is increasing in b)."""
    b = math.log(rate / (1.0 - rate)) - float(np.median(logits))
    for _ in range(50):
        p = _sigmoid(logits + b)
        step = (p.mean() - rate) / max(float((p * (1.0 - p)).mean()), 1e-12)
        b -= float(np.clip(step, -5.0, 5.0))
        if abs(step) < 1e-9:
            break
    return b


def expected_auc(logits: np.ndarray) -> float:
    """AUC of the teacher itself, in expectation over labels ~ Bernoulli(sigmoid(logits))."""
    p = _sigmoid(np.asarray(logits, dtype=np.float64))
    order = np.argsort(logits, kind="stable")
    p, q = p[order], 1.0 - p[order]
    negatives_below = np.cumsum(q) - q
    return float((p * negatives_below).sum() / (p.sum() * q.sum() - (p * q).sum()))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank AUC with ties counted half (Mann-Whitney)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, counts)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def generate_synthetic(
    out_dir: str | os.PathLike[str],
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a synthetic dataset to `out_dir` (atomically) and return its meta. Deterministic per seed."""
    if num_samples < 1:
        raise SlipcacheError(f"number of samples must be at least 1, got {num_samples}")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SlipcacheError("val and test fractions must be in [0, 1) and sum to less than 1")
    gen = _Generator(scale, seed)
    gen.calibrate()
    n_val = int(num_samples * val_fraction)
    n_test = int(num_samples * test_fraction)
    n_train = num_samples - n_val - n_test
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, num_samples),
    }
    positives = dict.fromkeys(bounds, 0)
    test_logits = np.empty(n_test)
    test_labels = np.empty(n_test, dtype=np.float32)
    with (
        DatasetWriter(out_dir, {k: b - a for k, (a, b) in bounds.items()}) as writer,
        tqdm(total=num_samples, unit="rows", unit_scale=True, desc="synth", disable=not progress) as bar,
    ):
        for chunk, start in enumerate(range(0, num_samples, CHUNK_ROWS)):
            end = min(start + CHUNK_ROWS, num_samples)
            rng = np.random.default_rng([seed, 2, chunk])
            dense, ids, terms = gen.sample(rng, end - start)
            logits = gen.logits(terms)
            labels = (rng.random(end - start) < _sigmoid(logits)).astype(np.float32)
            for name, (a, b) in bounds.items():
                lo, hi = max(a, start), min(b, end)
                if lo >= hi:
                    continue
                part = slice(lo - start, hi - start)
                writer.write(name, lo - a, labels[part], dense[part], ids[part])
                positives[name] += int(labels[part].sum())
                if name == "test":
                    test_logits[lo - a : hi - a] = logits[part]
                    test_labels[lo - a : hi - a] = labels[part]
            bar.update(end - start)
        sizes = {k: b - a for k, (a, b) in bounds.items()}
        meta = writer.commit(
            {
                "table_sizes": [int(s) for s in gen.sizes],
                "positive_rate": sum(positives.values()) / num_samples,
                "split_positive_rate": {k: (positives[k] / sizes[k] if sizes[k] else None) for k in sizes},
                "vocabulary": "synthetic",
                "teacher_auc": auc(test_logits, test_labels) if n_test else None,
                "teacher_expected_auc": expected_auc(test_logits) if n_test else None,
                "source": {"generator": "slipcache.data.synthetic"},
                "generator": {
                    "version": GENERATOR_VERSION,
                    "num_samples": num_samples,
                    "scale": scale,
                    "seed": seed,
                    "val_fraction": val_fraction,
                    "test_fraction": test_fraction,
                    "zipf_exponents": [round(float(e), 4) for e in gen.exponents],
                    "hot_rows": HOT_ROWS,
                    "teacher_dim": TEACHER_DIM,
                    "variance_shares": list(VARIANCE_SHARES),
                    "logit_scale": gen.logit_scale,
                    "logit_bias": gen.logit_bias,
                    "dense_missing": DENSE_MISSING,
                },
            }
        )
    return meta


def default_cache_root() -> Path:
    env = os.environ.get("SLIPCACHE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slipcache"


def default_synthetic_path(
    cache_root: str | os.PathLike[str] | None,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    *,
    progress: bool = True,
) -> Path:
    """A cached synthetic dataset for these parameters: reused when present, generated when not.

    `cache_root` None means $SLIPCACHE_CACHE_DIR, else ~/.cache/slipcache; data lives under `synthetic/`.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    path = root / "synthetic" / f"n{num_samples}-scale{scale:g}-seed{seed}-v{GENERATOR_VERSION}"
    try:
        gen = json.loads((path / "meta.json").read_text()).get("generator", {})
        if (gen.get("version"), gen.get("num_samples"), gen.get("scale"), gen.get("seed")) == (
            GENERATOR_VERSION,
            num_samples,
            scale,
            seed,
        ):
            return path
    except (OSError, ValueError, AttributeError):
        pass
    generate_synthetic(path, num_samples=num_samples, scale=scale, seed=seed, progress=progress)
    return path


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output dataset directory")
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="total rows (default %(default)s)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplier of the Kaggle table sizes (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_synth(args: argparse.Namespace) -> int:
    meta = generate_synthetic(
        args.out,
        num_samples=args.samples,
        scale=args.scale,
        seed=args.seed,
        val_fraction=args.val_fraction,
        test_fraction=args.test_fraction,
        progress=not args.quiet,
    )
    splits = ", ".join(f"{k} {v}" for k, v in meta["splits"].items())
    print(
        f"wrote {args.out}: {splits}; {sum(meta['table_sizes'])} embedding rows; "
        f"positive rate {meta['positive_rate']:.4f}; teacher AUC {meta['teacher_auc']}"
    )
    return 0
