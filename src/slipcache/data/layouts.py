"""Which external Criteo format a directory holds, from its file names (`detect_format`).

The DLRM reference's output directory holds more than its data: the combined
``kaggleAdDisplayChallenge_processed.npz`` (or ``terabyte_processed.npz``) is written beside the per-day
``<prefix>_day_{i}_processed.npz`` it was concatenated from, ``<prefix>_fea_count.npz`` (table sizes) and
``<prefix>_day_count.npz`` (rows per day). The combined file is the one its loader reads, so it is the one
read here (the per-day files are listed as ignored); the day counts give its day boundaries.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from slipcache.errors import SlipcacheError

SINGLE_FILE_DAYS = {"kaggleAdDisplayChallenge_processed.npz": 7, "terabyte_processed.npz": 24}
_TORCHREC = re.compile(r"^day_(\d+)_(dense|sparse|labels)\.npy$")
_DLRM_DAY = re.compile(r"^(.+)_(\d+)_processed\.npz$")
_MLPERF = re.compile(r"^(.+)_(train|test|val)\.bin$")
_SLIPCACHE = re.compile(r"^(?:(?:train|val|test)\.(?:labels|dense|sparse)\.npy|meta\.json)$")
_COUNTS = re.compile(r"^.+_fea_count\.npz$")
_DAY_COUNTS = re.compile(r"^.+_day_count\.npz$")


@dataclass
class Layout:
    """What a directory holds: the format, its files in day order, and the side files."""

    format: str
    files: list[Path]  # torchrec: one dir entry per day (the dense file); dlrm: npz per day; mlperf: bins
    counts_file: Path | None = None
    days: int = 0  # dlrm single file: days it holds
    day_counts_file: Path | None = None  # dlrm single file: rows per day (`total_per_file`)
    ignored: list[Path] = field(default_factory=list)  # files of the format not read (per-day beside combined)


def detect_format(path: str | os.PathLike[str]) -> Layout | None:
    """The external format of a directory, None if it holds none of them; mixed or incomplete: error."""
    path = Path(path)
    if not path.is_dir():
        return None
    names = sorted(p.name for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    found: dict[str, list[str]] = {}
    for name in names:
        if _TORCHREC.match(name):
            found.setdefault("torchrec", []).append(name)
        elif name in SINGLE_FILE_DAYS or (_DLRM_DAY.match(name) and not _COUNTS.match(name)):
            found.setdefault("dlrm", []).append(name)
        elif _MLPERF.match(name):
            found.setdefault("mlperf", []).append(name)
        elif _SLIPCACHE.match(name):
            found.setdefault("slipcache", []).append(name)
    if len(found) > 1:  # one dataset per directory: which files a reader takes must never be a guess
        (a, fa), (b, fb) = list(found.items())[:2]
        raise SlipcacheError(
            f"{path}: mixed data formats: {fa[0]} ({a}) and {fb[0]} ({b}); keep one per directory"
        )
    found.pop("slipcache", None)  # our own format: read by `CriteoDataset`, not an external layout
    if not found:
        return None
    if len(found) > 1:
        (a, fa), (b, fb) = list(found.items())[:2]
        raise SlipcacheError(
            f"{path}: mixed data formats: {fa[0]} ({a}) and {fb[0]} ({b}); keep one per directory"
        )
    fmt, files = next(iter(found.items()))
    counts = next((path / n for n in names if _COUNTS.match(n)), None)
    if fmt == "torchrec":
        return _torchrec_layout(path, files, counts)
    if fmt == "dlrm":
        day_counts = next((path / n for n in names if _DAY_COUNTS.match(n)), None)
        return _dlrm_layout(path, files, counts, day_counts)
    return _mlperf_layout(path, files, counts)


def _torchrec_layout(path: Path, files: list[str], counts: Path | None) -> Layout:
    days = sorted({int(_TORCHREC.match(n).group(1)) for n in files})  # type: ignore[union-attr]
    for i in range(max(days) + 1):
        for part in ("dense", "sparse", "labels"):
            if f"day_{i}_{part}.npy" not in files:
                raise SlipcacheError(f"{path / f'day_{i}_{part}.npy'}: missing file of the TorchRec layout")
    if len(days) < 2:
        raise SlipcacheError(f"{path}: TorchRec layout needs at least 2 days (train days, then val/test)")
    return Layout("torchrec", [path / f"day_{i}_dense.npy" for i in days], counts)


def _dlrm_layout(path: Path, files: list[str], counts: Path | None, day_counts: Path | None) -> Layout:
    single = [n for n in files if n in SINGLE_FILE_DAYS]
    if len(single) > 1:
        raise SlipcacheError(f"{path}: {single[0]} beside {single[1]}; keep one")
    if single:  # the reference's loader reads the combined file; the per-day files it came from stay unread
        ignored = [path / n for n in files if n != single[0]]
        return Layout("dlrm", [path / single[0]], counts, SINGLE_FILE_DAYS[single[0]], day_counts, ignored)
    by_prefix: dict[str, dict[int, str]] = {}
    for n in files:
        m = _DLRM_DAY.match(n)
        by_prefix.setdefault(m.group(1), {})[int(m.group(2))] = n  # type: ignore[union-attr]
    if len(by_prefix) > 1:
        raise SlipcacheError(f"{path}: per-day files of several prefixes ({', '.join(sorted(by_prefix))})")
    prefix, days_found = next(iter(by_prefix.items()))
    for i in range(max(days_found) + 1):
        if i not in days_found:
            raise SlipcacheError(f"{path / f'{prefix}_{i}_processed.npz'}: missing day of the DLRM layout")
    if len(days_found) < 2:
        raise SlipcacheError(f"{path}: per-day DLRM layout needs at least 2 days")
    return Layout("dlrm", [path / days_found[i] for i in sorted(days_found)], counts, len(days_found))


def _mlperf_layout(path: Path, files: list[str], counts: Path | None) -> Layout:
    by_kind: dict[str, list[str]] = {}
    for n in files:
        m = _MLPERF.match(n)
        by_kind.setdefault(m.group(2), []).append(n)  # type: ignore[union-attr]
    for kind in ("train", "test"):
        if kind not in by_kind:
            raise SlipcacheError(f"{path}: {files[0]} has no matching *_{kind}.bin (MLPerf layout)")
    if any(len(v) > 1 for v in by_kind.values()):
        raise SlipcacheError(f"{path}: several MLPerf file sets ({', '.join(files)})")
    return Layout("mlperf", [path / by_kind[k][0] for k in ("train", "test", "val") if k in by_kind], counts)
