"""`slipcache train --tensorboard [DIR]`: the metrics.jsonl events as TensorBoard scalars, live.

metrics.jsonl stays the source of truth; this writes the numbers of each of its events (step = samples
trained) under tags TensorBoard groups by prefix:

    train/<key>       loss, hit rate, samples/s, skipped share, ... (the event's top-level numbers)
    val/<metric>      validation AUC, log loss, ... (the event's val_* keys)
    hit_rate/<table>  cumulative cache hit rate per table
    memory/<part>     embedding bytes by component (storage payload, quantization params, cache, ...)
    test/<metric>     the final test metrics, once, at the end

The `tensorboard` package is an optional extra (`pip install 'slipcache[tensorboard]'`), imported only
when a run asks for it.
"""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Any

from slipcache.callback import Callback
from slipcache.errors import SlipcacheError
from slipcache.safe_files import ensure_dir

if typing.TYPE_CHECKING:
    from slipcache.training.run import Run

NESTED_PREFIX = {"hit_rate_per_table": "hit_rate", "memory_bytes": "memory"}


def embedding_event_fields(embeddings: Any, samples: int, skipped: int) -> dict[str, Any]:
    """Keys every metrics.jsonl train event carries: per-table hit rate, memory by component, skipped share."""
    stats = embeddings.stats()
    per_table = {
        str(entry.get("table", f"table {t}")): entry.get("hit_rate")
        for t, entry in enumerate(stats.get("per_table", []))
    }
    return {
        "hit_rate_per_table": per_table,
        "memory_bytes": dict(embeddings.memory_report()["components"]),
        "skipped_fraction": skipped / (samples + skipped) if samples + skipped else 0.0,
    }


def scalars(event: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one metrics.jsonl event (numbers only; None and text skipped)."""
    out: dict[str, float] = {}
    for key, value in event.items():
        if isinstance(value, dict) and key in NESTED_PREFIX:
            for name, inner in value.items():
                if _is_number(inner):
                    out[f"{NESTED_PREFIX[key]}/{name.replace(' ', '_')}"] = float(inner)
        elif _is_number(value) and key not in ("samples", "event"):
            if event.get("event") == "checkpoint":
                tag = f"checkpoint/{key}"
            else:
                tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            out[tag] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def summary_writer_class() -> Any:
    """torch's SummaryWriter, or the one-line error naming the extra when the tensorboard package is missing.

    A run asks for it before it creates anything (`check_available`), so a refusal leaves no directory
    behind to block the retry."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise SlipcacheError(
            "--tensorboard needs the tensorboard package: pip install 'slipcache[tensorboard]'"
        ) from exc
    return SummaryWriter


def check_available(setting: str | None) -> None:
    """Refuse `--tensorboard` without the tensorboard package, before the run creates a directory or data."""
    if setting is not None:
        summary_writer_class()


class TensorBoardWriter:
    """Event files in `log_dir`, flushed every few seconds so a run can be followed while it trains."""

    def __init__(self, log_dir: str | Path) -> None:
        SummaryWriter = summary_writer_class()  # noqa: N806  (a class)
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=5)

    def write_event(self, event: dict[str, Any]) -> None:
        step = int(event.get("samples", 0))
        for tag, value in scalars(event).items():
            self._writer.add_scalar(tag, value, step)

    def write_summary(self, summary: dict[str, Any]) -> None:
        step = int(summary.get("train_samples", 0))
        for key in ("auc", "logloss", "accuracy", "normalized_entropy"):
            if _is_number(summary.get(key)):
                self._writer.add_scalar(f"test/{key}", float(summary[key]), step)

    def close(self) -> None:
        self._writer.close()


def resolve_setting(setting: str | None, run_dir: Path) -> str | None:
    """`--tensorboard DIR` as the run records it, once, at its start: a relative DIR (or an absolute one
    inside the run) is kept relative to the run directory, so a resumed or copied run writes into its own
    directory whatever the working directory; only an absolute DIR outside the run stays absolute."""
    if not setting:
        return setting
    path = Path(setting).expanduser()
    run_dir = run_dir.resolve()
    if path.is_absolute():
        resolved = path.resolve()
        return str(resolved.relative_to(run_dir)) if resolved.is_relative_to(run_dir) else str(resolved)
    inside = (run_dir / path).resolve()
    if not inside.is_relative_to(run_dir):
        raise SlipcacheError(
            f"--tensorboard {setting}: a relative DIR is taken inside the run directory; give an absolute path "
            "to write elsewhere"
        )
    return str(inside.relative_to(run_dir))


def open_writer(setting: str | None, run_dir: Path) -> TensorBoardWriter | None:
    """None when not asked for; "" means `<run dir>/tensorboard`; a relative DIR lies in the run directory."""
    if setting is None:
        return None
    check_available(setting)  # before its directory: a refusal creates nothing
    log_dir = run_dir / (setting or "tensorboard")
    if log_dir.is_relative_to(run_dir):  # inside the run: no directory on the way is a link
        ensure_dir(log_dir, inside=run_dir)
    return TensorBoardWriter(log_dir)


class TensorBoardLog(Callback):
    """`--tensorboard`: every metrics.jsonl event and the final test metrics as scalars."""

    def __init__(self, writer: TensorBoardWriter) -> None:
        self.writer = writer

    def on_event(self, run: Run, event: dict[str, Any]) -> None:
        self.writer.write_event(event)

    def on_finish(self, run: Run, summary: dict[str, Any]) -> None:
        self.writer.write_summary(summary)
        self.writer.close()
