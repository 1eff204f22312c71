"""FAE's input order (`input_order = "cold_first"`): each epoch trains the cold inputs first, then the hot
ones, as Slipstream's published code does.

The hot set is profiled once per epoch on a sample of the training split (the detector's own profile:
`profile_fraction`, 5 %, the budget rule or `stale_hot_share`); an input is hot when its lookups are hot
rows (all of them, or `stale_alpha` of them). Every training input is classified once per epoch, in
chunks, into one byte per input (0 cold, 1 hot): the `BatchIterator` visits group 0 and then group 1,
each in the epoch's usual order. Why the whole split and not the sample: the order must place every input,
and one pass over the ids costs a few seconds per 10 M inputs. The classification is a function of the
data, the seed and the epoch only, so a resumed run recomputes it and needs no checkpoint state.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from slipcache.callback import Callback
from slipcache.staleness.detector import StaleInputDetector
from slipcache.staleness.hotset import HotSet

if typing.TYPE_CHECKING:
    from slipcache.data.dataset import SplitArrays
    from slipcache.training.run import Run

CLASSIFY_CHUNK = 1 << 16  # inputs classified at a time: bounded memory whatever the split


class HotInputs:
    """One epoch's hot set and which training inputs are hot: `groups`, one byte per input (1 = hot)."""

    def __init__(self, config: Any, split: SplitArrays, table_sizes: list[int], dim: int) -> None:
        offsets = np.concatenate([[0], np.cumsum(np.asarray(table_sizes, dtype=np.int64))])
        # profiling and classifying read no rows: the rule does not matter here
        self.detector = StaleInputDetector(config.staleness_config(rule="paper"), offsets, dim)
        self.split = split
        self.epoch: int | None = None
        self.groups = np.zeros(0, dtype=np.uint8)
        self.hot: HotSet | None = None
        self.hot_count = 0

    def start_epoch(self, epoch: int) -> None:
        """Profile the epoch's hot set and classify every training input (once per epoch)."""
        if self.epoch == epoch:
            return
        det, n = self.detector, len(self.split)
        det.start_epoch(epoch)
        self.hot = det.profile(self.split.sparse[det.sample_indices(n, det.config.profile_fraction, "profile")])
        groups = np.empty(n, dtype=np.uint8)
        for start in range(0, n, CLASSIFY_CHUNK):
            ids = np.ascontiguousarray(self.split.sparse[start : start + CLASSIFY_CHUNK])
            groups[start : start + ids.shape[0]] = det.hot_input_mask(ids)
        self.groups, self.hot_count, self.epoch = groups, int(np.count_nonzero(groups)), epoch

    @property
    def cold_count(self) -> int:
        return int(self.groups.size) - self.hot_count

    @property
    def hot_share(self) -> float:
        """Hot inputs as a share of the training split."""
        return self.hot_count / self.groups.size if self.groups.size else 0.0

    def hot_positions(self) -> np.ndarray:
        return np.flatnonzero(self.groups)


def schedule_fields(order: str, window_start: int | None, window: int | None, hot_share: float | None,
                    threshold: float | None, skipped_fraction: float | None) -> dict[str, Any]:
    """The summary's `staleness` keys that say where a run's window was: always all present; the window's
    are null when no window opened."""
    opened = window_start is not None
    return {"order": order, "window_start_batch": window_start, "window_batches": window if opened else None,
            "hot_input_share": hot_share, "threshold": threshold if opened else None,
            "skipped_fraction": skipped_fraction if opened else None}


class ColdFirstOrder(Callback):
    """Orders each epoch cold inputs first, then hot ones; shares its hot set with skipping and freezing.

    `reports`: the run has no skipper or freezer that writes the summary's `staleness` block, so this one
    writes it (the order and the hot share; no window).
    """

    def __init__(self, run: Run, reports: bool) -> None:
        self.hot_inputs = HotInputs(run.config, run.dataset.split("train"), list(run.dataset.table_sizes),
                                    int(run.config.model.embedding_dim))
        self.reports = reports

    def start_epoch(self, run: Run) -> None:
        self.hot_inputs.start_epoch(run.progress.epoch)

    def input_groups(self, run: Run) -> np.ndarray | None:
        return self.hot_inputs.groups

    def summary_fields(self, run: Run) -> dict[str, Any]:
        if not self.reports:
            return {}
        return {"staleness": schedule_fields("cold_first", None, None, self.hot_inputs.hot_share, None, None)}
