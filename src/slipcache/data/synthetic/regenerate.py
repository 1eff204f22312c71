"""The ceiling of a generated dataset written without one: its rows generated again from meta.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from slipcache.data.synthetic.ceiling import CoverageCeiling, no_ceiling_reason
from slipcache.data.synthetic.generate import (
    DAYS,
    DRIFT_RATE,
    GENERATOR_VERSIONS,
    NEW_ENTITY_RATE,
    TEACHER_AUC_ROWS,
    _log_rows,
    make_generator,
    split_bounds,
)
from slipcache.errors import SlipcacheError
from slipcache.metrics import auc
from slipcache.progress import progress_bar

logger = logging.getLogger(__name__)


def regenerate_ceiling(meta: dict[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """The ceiling of the dataset `meta` describes, by generating its training and test rows again (the
    validation rows are skipped). Also returns, as `_first_rows_teacher_auc`, the teacher's AUC on the rows
    meta.json's `teacher_auc` was computed on, for the caller to check the rows were reproduced."""
    spec = meta["generator"]
    name = {v: k for k, v in GENERATOR_VERSIONS.items()}[spec["version"]]
    gen = make_generator(
        name,
        spec["scale"],
        spec["seed"],
        num_samples=spec["num_samples"],
        days=spec.get("days", DAYS),
        new_entity_rate=spec.get("new_entity_rate", NEW_ENTITY_RATE),
        drift_rate=spec.get("drift_rate", DRIFT_RATE),
        table_sizes=spec.get("table_sizes"),
    )
    gen.calibrate()
    bounds = split_bounds(spec["num_samples"], spec["val_fraction"], spec["test_fraction"],
                          meta.get("layout", "slipcache"))
    ceiling = CoverageCeiling(gen)
    wanted = [bounds["train"], bounds["test"]]
    total = sum(b - a for a, b in wanted)
    with progress_bar(total=total, unit="rows", unit_scale=True, desc="ceiling", disable=not progress) as bar:
        for start, end, dense, _, _, labels, latent in _log_rows(gen, spec["seed"], spec["num_samples"], wanted):
            ceiling.add_chunk(bounds, start, dense, labels, latent)
            bar.update(sum(max(0, min(b, end) - max(a, start)) for a, b in wanted))
    result = ceiling.result() or {}
    scored = min(result.get("test_rows", 0), TEACHER_AUC_ROWS)
    if scored:
        labels = np.concatenate(ceiling.labels)[:scored]
        result["_first_rows_teacher_auc"] = auc(labels, np.concatenate(ceiling.logits["teacher"])[:scored])
    return result


def dataset_ceiling(path: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """The ceiling of a generated dataset: from its meta.json when it was recorded at generation, else by
    generating its rows again from the recorded settings (the teacher's AUC must then match the recorded one,
    so rows that were not reproduced are never scored). Raises SlipcacheError where no ceiling is known."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise SlipcacheError(f"no ceiling is known for {path}: only data that slipcache generated has a known teacher")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise SlipcacheError(f"no ceiling is known for {path}: its meta.json does not read ({exc})") from exc
    reason = no_ceiling_reason(meta)
    if reason:
        raise SlipcacheError(f"{reason} ({path})")
    if meta.get("ceiling"):
        return dict(meta["ceiling"])
    logger.info("%s: counting latent values by generating its %s rows again", path,
                f"{meta['generator']['num_samples']:,}")
    ceiling = regenerate_ceiling(meta, progress=progress)
    recorded = meta.get("teacher_auc")
    if recorded is not None and abs(ceiling.pop("_first_rows_teacher_auc") - recorded) > 1e-9:
        raise SlipcacheError(
            f"no ceiling is known for {path}: its rows were not reproduced from meta.json (teacher AUC "
            f"{recorded:.6f} recorded); was it written by another version of slipcache?"
        )
    ceiling.pop("_first_rows_teacher_auc", None)
    return ceiling
