"""Where a run's data comes from: synthetic data from the cache, a dataset read in place, or raw Criteo
files preprocessed once into the cache (keyed by the files and every preprocessing option).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import stat
from pathlib import Path
from typing import Any

from slipcache.cache_dir import default_cache_root
from slipcache.data.batches import BatchIterator, SampleFilter
from slipcache.data.formats import Dataset
from slipcache.errors import SlipcacheError
from slipcache.training.config import TrainConfig

logger = logging.getLogger(__name__)


def _synthetic_dataset(config: TrainConfig) -> Path:
    from slipcache.data.synthetic import default_synthetic_path

    # Dataset seed 0 whatever the run seed: runs with different seeds then compare on the same data.
    return default_synthetic_path(
        None,
        config.data.synthetic_samples,
        config.data.synthetic_scale,
        0,
        generator=config.data.synthetic_generator,
        progress=config.schedule.progress,
    )


def _raw_inputs(path: Path) -> list[Path]:
    """The raw files of `--data`: the file, or a directory's files. Subdirectories are not read: named."""
    if not path.is_dir():
        return [path]
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    files = sorted(p for p in entries if p.is_file())
    nested = sorted(p.name for p in entries if p.is_dir())
    if nested:
        named = f"{', '.join(nested[:3])}{', ...' if len(nested) > 3 else ''}"
        warn_line(f"--data {path}: subdirectories are not read ({named})")
    if not files:
        raise SlipcacheError(f"no data files in {path}")
    return files


def resolve_data(text: str) -> Path:
    """`--data` as an absolute path, so the run can be resumed and evaluated from anywhere; a symlink
    loop or a pipe (`--data <(zcat ...)`: data is read more than once and memory-mapped) is one line."""
    path = Path(text).expanduser()
    try:
        if stat.S_ISFIFO(path.stat().st_mode):
            raise SlipcacheError(
                f"--data {text} is a pipe; slipcache reads its data more than once: write it to a file first"
            )
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # resolve() raises RuntimeError on a loop (Python 3.11)
        if isinstance(exc, FileNotFoundError):
            return path.absolute()  # named as not found where it is read
        if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP:
            raise SlipcacheError(f"--data {text}: symlink loop") from exc
        raise SlipcacheError(f"--data {text}: {exc.strerror or exc}") from exc


def preprocessed_root() -> Path:
    """Where raw input is preprocessed to: `preprocessed/` in the cache ($SLIPCACHE_CACHE_DIR, else
    ~/.cache/slipcache), shared by every run that reads the same files with the same options."""
    return default_cache_root() / "preprocessed"


def prepare_data(config: TrainConfig, cache_root: Path | None = None) -> Path:
    """The preprocessed dataset dir for `config.data.data`, preprocessing raw files into `cache_root` once.

    The cache key covers the input files (path, size, mtime) and every preprocessing option, so a
    changed file or option produces a new dataset instead of silently reusing a stale one.
    """
    if config.data.data is None:
        return _synthetic_dataset(config)
    path = resolve_data(config.data.data)
    if not path.exists():
        raise SlipcacheError(f"data not found: {path}")
    from slipcache.data.formats import detect_format

    if (path / "meta.json").is_file() or detect_format(path) is not None:
        return path  # read in place (slipcache.data.formats)
    cache_root = cache_root if cache_root is not None else preprocessed_root()
    inputs = _raw_inputs(path)
    key_parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in inputs]
    key_parts += [config.data.vocab, str(config.data.max_rows), str(config.data.min_count), str(config.data.strict)]
    key = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:12]
    out_dir = cache_root / f"{path.stem}-{config.data.vocab}-{key}"
    if (out_dir / "meta.json").is_file():
        return out_dir
    from slipcache.data.dataset import remove_dead_staging
    from slipcache.data.preprocess import preprocess

    if cache_root.is_dir():  # what preprocessing runs killed before finishing left behind
        for other in cache_root.iterdir():
            if other.is_dir():
                remove_dead_staging(other)
    # Held-back splits: contiguous 80/10/10 in file order (Criteo is time-ordered), the preprocess default.
    # Hash seed 0 whatever the run seed, so runs with different seeds share one preprocessed dataset.
    preprocess(
        inputs,
        out_dir,
        vocab=config.data.vocab,
        min_count=config.data.min_count,
        max_rows=config.data.max_rows,
        strict=config.data.strict,
        progress=config.schedule.progress,
        seed=0,
    )
    return out_dir


def open_dataset(path: Path, config: TrainConfig | None = None) -> Dataset:
    """The dataset at `path` in any supported layout (`formats.open_any`); errors become one line."""
    from slipcache.data.formats import open_any

    try:
        if config is None:
            return open_any(path)
        dataset = open_any(path, table_sizes=config.data.table_sizes, split_order=config.data.split_order)
    except SlipcacheError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise SlipcacheError(f"cannot open dataset {path}: {exc}") from exc
    require_inferred_sizes_fit(dataset, config.embeddings.embeddings, **config.embedding_options())
    return dataset


HASHED_IDS_HINT = (
    "pass --table-sizes N to take the ids modulo N rows per table (one N, or 26); TorchRec's DLRM example "
    "hashes with --num_embeddings 100000 by default, and Criteo 1TB runs cap every table at 40 M rows "
    "(--table-sizes 40000000)"
)


def require_inferred_sizes_fit(dataset: Dataset, embeddings: str = "cached", **options: Any) -> None:
    """Tables sized by the data's max id + 1 (hashed ids can reach 2^31 per table): check them against the
    memory before anything is allocated, and say how to size them instead (one line).

    `options`: `EmbeddingConfig` fields, dim included; `embeddings`: the kind the caller builds."""
    from slipcache.memory import MemoryShortError, require_tables_fit
    from slipcache.model import embedding_config

    if dataset.meta.get("table_sizes_from") != "max id + 1":
        return
    tables = embedding_config(list(dataset.table_sizes), **options)
    try:
        require_tables_fit(tables, "tables sized by the ids' max + 1", embeddings=embeddings)
    except MemoryShortError as exc:
        raise MemoryShortError(f"{exc}; the ids look hashed: {HASHED_IDS_HINT}") from exc


def check_table_sizes(expected: list[int], actual: list[int], what: str) -> None:
    """Embedding tables are sized by the vocabulary, so a mismatch means a different preprocessing."""
    if list(expected) != list(actual):
        if len(expected) != len(actual):
            detail = f"{len(actual)} tables vs {len(expected)}"
        else:
            t = next(i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a != b)
            detail = f"table {t} has {actual[t]} rows vs {expected[t]}"
        raise SlipcacheError(f"{what} does not match the checkpoint's vocabulary ({detail})")


def run_dataset_dir(config: TrainConfig, saved_dataset: str | None) -> Path:
    """The dataset a run reads: the one it started on while that is still there, else prepared anew."""
    if saved_dataset is not None and (Path(saved_dataset) / "meta.json").is_file():
        return Path(saved_dataset)
    return prepare_data(config)


def data_quality(dataset: Dataset) -> dict[str, Any] | None:
    """Lines read and skipped as malformed when the dataset was preprocessed from raw files (else None)."""
    source = dataset.meta.get("source") or {}
    if "bad_lines" not in source:
        return None
    return {
        "good_lines": int(source.get("good_lines", 0)),
        "malformed_lines": int(source["bad_lines"]),
        "examples": list(source.get("bad_examples", [])),
    }


def malformed_message(quality: dict[str, Any], data: str | None) -> str:
    """The warning for raw input with malformed lines: how many, and the first ones as read."""
    total = quality["good_lines"] + quality["malformed_lines"]
    lines = [
        f"{quality['malformed_lines']:,} of {total:,} lines of {data} are malformed and were skipped "
        "(--strict stops at the first); the first:"
    ]
    return "\n  ".join(lines + quality["examples"])


def warn_line(message: str) -> None:
    """A warning (on stderr, under the command) that does not stop the run."""
    logger.warning(f"slipcache: warning: {message}")


def training_batches(
    dataset: Dataset,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    start_batch: int = 0,
    sample_filter: SampleFilter | None = None,
    lookahead: int = 0,
    time_order: str = "first",
    part: tuple[int, int] | None = None,
    groups: Any = None,
) -> BatchIterator:
    """One epoch of a dataset's training batches in the training order: the one source of that order for
    the trainer and every benchmark that claims to replay it (`bench cache`, `bench train`).

    Shuffled from (seed, epoch); time-ordered data (meta "time_ordered": synthetic v3/v4, Criteo days)
    keeps its windows in order and shuffles within them in the first epoch, and is shuffled across days
    from the second epoch on (`time_order="first"`, the trainer's default), so validation AUC does not saw
    at epoch boundaries; `time_order="every"` keeps every epoch in time order. Full batches only;
    `start_batch` resumes mid-epoch; `part=(rank, N)` reads only that rank's slice of every batch;
    `groups` trains group 0's rows first, then group 1's (the cold-first order), each in that order.
    """
    return BatchIterator(
        dataset.split("train"),
        batch_size,
        shuffle=True,
        in_order=bool(dataset.meta.get("time_ordered")) and (time_order == "every" or epoch == 0),
        seed=seed,
        epoch=epoch,
        drop_last=True,
        lookahead=lookahead,
        sample_filter=sample_filter,
        start_batch=start_batch,
        part=part,
        groups=groups,
    )
