"""A dataset's fingerprint: what ties a checkpoint to the data it was trained on.

Table sizes alone do not: a regenerated or replaced dataset with the same vocabulary would let `eval`
report another AUC and `--resume` continue on other data, silently. The fingerprint is cheap at terabyte
scale (no full read): the dataset's files by name and size, its split sizes and table sizes, a hash of its
meta data (paths of where it came from left out, so a moved or copied dataset keeps its fingerprint) and
a hash of `BLOCKS` sampled blocks of `BLOCK_BYTES` per file (first, last and evenly spaced between).
A change confined to bytes no block covers is not seen; regenerating, re-preprocessing, truncating,
appending or swapping files is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from slipcache.data.sampled import sampled_digest
from slipcache.errors import SlipcacheError

VERSION = 1


def data_files(dataset: Any) -> list[Path]:
    """The files a dataset reads: its split arrays (and vocabulary) or the external format's files."""
    layout = getattr(dataset, "layout", None)
    if layout is not None:  # formats.ExternalDataset
        from slipcache.data.formats import _all_files

        files = _all_files(layout) + ([layout.counts_file] if layout.counts_file else [])
        return sorted(set(files))
    root = Path(dataset.path)
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".npy", ".npz"))


def fingerprint(dataset: Any) -> dict[str, Any]:
    """{"version", "bytes", "splits", "table_sizes", "digest"}: equal digests mean the same data (as far as
    sampling sees)."""
    meta = {k: v for k, v in dataset.meta.items() if k != "source"}
    sha = hashlib.sha256(f"slipcache-data-fingerprint {VERSION}\n".encode())
    sha.update(json.dumps(meta, sort_keys=True, default=str).encode())
    total = 0
    try:
        for path in data_files(dataset):
            size = path.stat().st_size
            total += size
            sha.update(f"\n{path.name} {size} {sampled_digest(path, size)}".encode())
    except OSError as exc:
        raise SlipcacheError(
            f"cannot read the dataset to fingerprint it: {exc.strerror or exc}: {exc.filename}"
        ) from exc
    return {
        "version": VERSION,
        "bytes": total,
        "splits": {str(k): int(v) for k, v in dataset.splits.items()},
        "table_sizes": [int(s) for s in dataset.table_sizes],
        "digest": sha.hexdigest()[:32],
    }


def difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between two fingerprints, in words; None when they match (or one is of another
    version: an older run is not held to a newer rule)."""
    if not isinstance(recorded, dict) or recorded.get("version") != current.get("version"):
        return None
    if recorded.get("digest") == current.get("digest"):
        return None
    for key, what in (("splits", "split sizes"), ("table_sizes", "table sizes"), ("bytes", "size in bytes")):
        if recorded.get(key) != current.get(key):
            return f"{what} {recorded.get(key)} then, {current.get(key)} now"
    return f"content differs (fingerprint {recorded.get('digest', '?')[:12]} then, {current['digest'][:12]} now)"


def check_same_data(recorded: Any, current: dict[str, Any], *, allow: bool, what: str) -> str | None:
    """Refuse data other than the run's (`what`: e.g. "dataset /d for checkpoint /c"), unless `allow`;
    returns the difference when allowed (to record), None when the data match or nothing was recorded."""
    diff = difference(recorded, current) if recorded else None
    if diff is not None and not allow:
        raise SlipcacheError(
            f"{what} is not the data the run trained on ({diff}); pass --allow-changes to continue anyway"
        )
    return diff
