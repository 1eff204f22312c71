"""Writing a synthetic dataset (`generate_synthetic`), reading a window of its rows without writing it,
and the cache of generated datasets (`default_synthetic_path`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.cache_dir import default_cache_root
from slipcache.data.streaming import StreamingDatasetWriter, TorchRecWriter, torchrec_day_rows
from slipcache.data.synthetic.ceiling import CoverageCeiling
from slipcache.data.synthetic.teacher import (
    CHUNK_ROWS,
    DENSE_MISSING,
    HOT_ROWS,
    TEACHER_DIM,
    Teacher,
    expected_auc,
    sigmoid,
)
from slipcache.data.synthetic.v3 import DAYS, DRIFT_RATE, MISSING_ROW, NEW_ENTITY_RATE, GeneratorV3
from slipcache.data.synthetic.v4 import GeneratorV4
from slipcache.data.synthetic.v5 import GeneratorV5
from slipcache.errors import SlipcacheError
from slipcache.metrics import auc
from slipcache.progress import progress_bar

GENERATOR_VERSIONS = {"v5": 5, "v4": 4, "v3": 3}  # `--generator` name -> the version recorded in meta.json
DEFAULT_GENERATOR = "v5"
LAYOUTS = ("slipcache", "torchrec")  # `synth --format`: our dataset files, or TorchRec's day files
TEACHER_AUC_ROWS = 1 << 22  # test rows the teacher's AUC is computed on (bounds the memory it takes)
DEFAULT_SAMPLES = 2_500_000  # 2M train + 250k val + 250k test with the default fractions


def make_generator(
    generator: str,
    scale: float,
    seed: int,
    *,
    num_samples: int,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
    table_sizes: list[int] | None = None,
) -> Teacher:
    """The (uncalibrated) generator `generator` ("v5", "v4" or "v3") of a dataset of `num_samples` rows, of
    Kaggle's table sizes times `scale` or of explicit `table_sizes` (26, in column order)."""
    if generator not in GENERATOR_VERSIONS:
        raise SlipcacheError(f"generator must be one of {', '.join(GENERATOR_VERSIONS)}, got {generator!r}")
    if days < 1:
        raise SlipcacheError(f"days must be at least 1, got {days}")
    if not (0 <= new_entity_rate <= 1 and 0 <= drift_rate <= 1):
        raise SlipcacheError("new-entity and drift rates are shares of ranks per day, in [0, 1]")
    kind = {"v5": GeneratorV5, "v4": GeneratorV4, "v3": GeneratorV3}[generator]
    return kind(
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
        table_sizes=table_sizes,
    )


def generate_synthetic(
    out_dir: str | os.PathLike[str],
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    generator: str | Teacher = DEFAULT_GENERATOR,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
    progress: bool = True,
    table_sizes: list[int] | None = None,
    layout: str = "slipcache",
) -> dict[str, Any]:
    """Write a synthetic dataset to `out_dir` (atomically) and return its meta. Deterministic per seed.

    Rows are written in log order and the splits are contiguous: with v3 (time-ordered over `days` days)
    train holds the earlier days, validation and test the last ones, as in the standard Criteo split.
    `days` and the two rates apply to v3 and later. `generator` may also be a `Teacher` built elsewhere
    (the research code's earlier generators), of `scale` and `seed`.

    Memory is bounded whatever `num_samples`: rows are generated a chunk at a time and appended to the
    files (`slipcache.data.streaming`); the teacher's AUC is taken on the first TEACHER_AUC_ROWS test rows.
    `layout="torchrec"` writes TorchRec's day files instead (v3's days, the last one held out)."""
    if layout not in LAYOUTS:
        raise SlipcacheError(f"format must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if num_samples < 1:
        raise SlipcacheError(f"number of samples must be at least 1, got {num_samples}")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SlipcacheError("val and test fractions must be in [0, 1) and sum to less than 1")
    gen = generator if isinstance(generator, Teacher) else make_generator(
        generator,
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
        table_sizes=table_sizes,
    )
    gen.calibrate()
    bounds = split_bounds(num_samples, val_fraction, test_fraction, layout)
    n_test = bounds["test"][1] - bounds["test"][0]
    n_train = bounds["train"][1]
    positives = dict.fromkeys(bounds, 0)
    scored = min(n_test, TEACHER_AUC_ROWS)
    test_logits = np.empty(scored)
    test_labels = np.empty(scored, dtype=np.float32)
    ceiling = CoverageCeiling(gen) if isinstance(gen, GeneratorV3) else None
    split_rows = {k: b - a for k, (a, b) in bounds.items()}
    if layout == "torchrec":
        days_rows = torchrec_day_rows(n_train, num_samples - n_train, getattr(gen, "days", DAYS))
        writer: Any = TorchRecWriter(out_dir, days_rows)
    else:
        writer = StreamingDatasetWriter(out_dir, split_rows)
    bar_settings = {"unit": "rows", "unit_scale": True, "desc": "synth", "disable": not progress}
    with writer, progress_bar(total=num_samples, **bar_settings) as bar:
        for start, end, dense, ids, logits, labels, latent in _log_rows(gen, seed, num_samples):
            if ceiling is not None:
                ceiling.add_chunk(bounds, start, dense, labels, latent)
            if layout == "torchrec":
                writer.append(labels.astype(np.int32), dense, ids)
            for name, (a, b) in bounds.items():
                lo, hi = max(a, start), min(b, end)
                if lo >= hi:
                    continue
                part = slice(lo - start, hi - start)
                if layout != "torchrec":
                    writer.write(name, lo - a, labels[part], dense[part], ids[part])
                positives[name] += int(labels[part].sum())
                if name == "test" and lo - a < scored:
                    keep = slice(lo - a, min(hi - a, scored))
                    test_logits[keep] = logits[part][: keep.stop - keep.start]
                    test_labels[keep] = labels[part][: keep.stop - keep.start]
            bar.update(end - start)
        sizes = split_rows
        meta = writer.commit(
            {
                **({"splits": sizes} if layout == "torchrec" else {}),
                "table_sizes": gen.output_sizes if isinstance(gen, GeneratorV3) else [int(s) for s in gen.sizes],
                "positive_rate": sum(positives.values()) / num_samples,
                "split_positive_rate": {k: (positives[k] / sizes[k] if sizes[k] else None) for k in sizes},
                "vocabulary": "synthetic",
                "teacher_auc": auc(test_labels, test_logits) if scored else None,
                "teacher_expected_auc": expected_auc(test_logits) if scored else None,
                **({"ceiling": ceiling.result()} if ceiling is not None and n_test else {}),
                "source": {"generator": "slipcache.data.synthetic"},
                "time_ordered": isinstance(gen, GeneratorV3),
                **({"missing_row": MISSING_ROW} if isinstance(gen, GeneratorV3) else {}),
                **({"layout": layout, "teacher_auc_rows": scored} if layout == "torchrec" or scored < n_test else {}),
                "generator": {
                    "version": gen.version,
                    "num_samples": num_samples,
                    "scale": scale,
                    "seed": seed,
                    "val_fraction": val_fraction,
                    "test_fraction": test_fraction,
                    "hot_rows": HOT_ROWS,
                    "teacher_dim": TEACHER_DIM,
                    "variance_shares": list(gen.variance_shares),
                    "logit_scale": gen.logit_scale,
                    "logit_bias": gen.logit_bias,
                    "dense_missing": DENSE_MISSING,
                    **gen.describe(),
                },
            }
        )
    return meta


def split_bounds(
    num_samples: int, val_fraction: float, test_fraction: float, layout: str
) -> dict[str, tuple[int, int]]:
    """Rows [first, end) of each split in log order: train, then validation, then test."""
    n_val = int(num_samples * val_fraction)
    n_test = int(num_samples * test_fraction)
    if layout == "torchrec":  # its reader halves the held-out day: validation first, taking the odd row
        n_val, n_test = (n_val + n_test + 1) // 2, (n_val + n_test) // 2
    n_train = num_samples - n_val - n_test
    return {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, num_samples)}


def _log_rows(
    gen: Teacher, seed: int, num_samples: int, wanted: list[tuple[int, int]] | None = None
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]]:
    """The log a chunk at a time: (first row, end, dense, ids, teacher logits, labels, latent), where latent
    is (parameter rows, latent values) for generators that have them (v3 and later), else None. With
    `wanted` ([first, end) ranges), only the chunks that overlap them (each chunk has its own stream)."""
    for chunk, start in enumerate(range(0, num_samples, CHUNK_ROWS)):
        end = min(start + CHUNK_ROWS, num_samples)
        if wanted is not None and not any(a < end and start < b for a, b in wanted):
            continue
        rng = _chunk_rng(seed, chunk)
        if isinstance(gen, GeneratorV3):
            dense, ids, params, sources = gen.sample_latent(rng, start, end - start)
            terms, latent = gen.terms(dense, params), (params, sources)
        else:
            (dense, ids, terms), latent = gen.sample(rng, start, end - start), None
        logits = gen.logits(terms)
        labels = (rng.random(end - start) < sigmoid(logits)).astype(np.float32)
        yield start, end, dense, ids, logits, labels, latent


def _chunk_rng(seed: int, chunk: int) -> np.random.Generator:
    """The random stream of rows [chunk * CHUNK_ROWS, (chunk + 1) * CHUNK_ROWS) of a dataset."""
    return np.random.default_rng([seed, 2, chunk])


def _chunks_of(
    start: int, rows: int, num_samples: int, seed: int
) -> Iterator[tuple[np.random.Generator, int, int, slice]]:
    """For each generation chunk that rows start..start+rows-1 touch: its random stream, first row, row
    count, and the slice of its rows that falls in the window (the generator draws whole chunks)."""
    end = start + rows
    if not 0 <= start < end <= num_samples:
        raise SlipcacheError(f"rows {start}..{end - 1} are not all within the {num_samples} rows of the log")
    for chunk in range(start // CHUNK_ROWS, (end - 1) // CHUNK_ROWS + 1):
        first = chunk * CHUNK_ROWS
        last = min(first + CHUNK_ROWS, num_samples)
        yield _chunk_rng(seed, chunk), first, last - first, slice(max(start, first) - first, min(end, last) - first)


def synthetic_window(
    start: int,
    rows: int,
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    generator: str = DEFAULT_GENERATOR,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> np.ndarray:
    """The categorical ids [rows, 26] of rows start..start+rows-1 of the dataset `generate_synthetic`
    would write with these parameters (the same rows; no labels, so no calibration is needed)."""
    gen = make_generator(
        generator,
        scale,
        seed,
        num_samples=num_samples,
        days=days,
        new_entity_rate=new_entity_rate,
        drift_rate=drift_rate,
    )
    parts = []
    for rng, first, count, part in _chunks_of(start, rows, num_samples, seed):
        parts.append(gen.sample(rng, first, count)[1][part])
    return np.concatenate(parts)


def synthetic_rows(
    start: int,
    rows: int,
    *,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    generator: str = DEFAULT_GENERATOR,
    days: int = DAYS,
    new_entity_rate: float = NEW_ENTITY_RATE,
    drift_rate: float = DRIFT_RATE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw dense [rows, 13] with NaN where missing, ids [rows, 26], labels [rows]) of rows
    start..start+rows-1 of the dataset `generate_synthetic` would write (calibrated: the same labels;
    the dataset stores `dense_transform` of the raw dense). For `slipcache stats` and `synth --compare`."""
    gen = make_generator(generator, scale, seed, num_samples=num_samples, days=days,
                         new_entity_rate=new_entity_rate, drift_rate=drift_rate)
    gen.calibrate()
    dense, ids, labels = [], [], []
    for rng, first, count, part in _chunks_of(start, rows, num_samples, seed):
        _, chunk_ids, terms = gen.sample(rng, first, count)
        chunk_labels = (rng.random(count) < sigmoid(gen.logits(terms))).astype(np.float32)
        dense.append(gen.raw_dense[part])
        ids.append(chunk_ids[part])
        labels.append(chunk_labels[part])
    return np.concatenate(dense), np.concatenate(ids), np.concatenate(labels)


def default_synthetic_path(
    cache_root: str | os.PathLike[str] | None,
    num_samples: int = DEFAULT_SAMPLES,
    scale: float = 1.0,
    seed: int = 0,
    *,
    generator: str = DEFAULT_GENERATOR,
    progress: bool = True,
) -> Path:
    """A cached synthetic dataset for these parameters: reused when present, generated when not.

    `cache_root` None means $SLIPCACHE_CACHE_DIR, else ~/.cache/slipcache; data lives under `synthetic/`.
    The key holds the generator's version and a digest of its parameters, so data from another generator
    or an older calibration is never reused.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    described = make_generator(generator, scale, seed, num_samples=num_samples).describe()
    version = GENERATOR_VERSIONS[generator]
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:8]
    name = f"n{num_samples}-scale{scale:g}-seed{seed}-v{version}-{digest}"
    path = root / "synthetic" / name
    try:
        gen = json.loads((path / "meta.json").read_text()).get("generator", {})
        if (gen.get("version"), gen.get("num_samples"), gen.get("scale"), gen.get("seed")) == (
            version,
            num_samples,
            scale,
            seed,
        ):
            return path
    except (OSError, ValueError, AttributeError):
        pass
    generate_synthetic(
        path, num_samples=num_samples, scale=scale, seed=seed, generator=generator, progress=progress
    )
    return path
