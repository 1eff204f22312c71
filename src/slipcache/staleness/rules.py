"""Staleness rules: what a hot row's score is and how it is measured. One strategy object per rule.

The detector (``slipcache.staleness.detector``) owns the hot set, the per-row flags and the threshold; a
rule only turns reads of hot rows into one score per hot row (lower = staler). ``read`` is the detector's
row reader (it counts the rows read and copies them off the collection).

- ``PaperRule`` (``paper``): the L-infinity change of a row between the latest two snapshots of every hot
  row. A row not updated between them has change 0 and looks converged: in ``--quick`` 56,395 of 56,407 hot
  rows were "stale" that way.
- ``ConvergenceRule`` (``convergence``): a row is judged only once it was updated at least ``min_updates``
  times since its span began; its score is the L-infinity change over the span divided by the number of
  updates and by the row's own L-infinity norm. Rows not yet measured are unknown (inf, never stale).
  Update counts are kept for the hot rows only, through ``HotIndex``, and a re-check reads back only the
  rows with enough updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from slipcache.errors import InvalidInputError
from slipcache.staleness.config import StalenessConfig
from slipcache.staleness.filtering import count_hot_lookups
from slipcache.staleness.hotset import HotIndex, HotSet, _to_numpy

__all__ = ["ConvergenceRule", "EmbeddingRowSource", "PaperRule", "RandomRule", "StalenessRule", "make_rule"]



class EmbeddingRowSource(Protocol):
    """The part of the embedding collection interface the detector needs (see docs/design.md)."""

    table_offsets: torch.Tensor
    dim: int

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor: ...


Reader = Callable[[np.ndarray], torch.Tensor]


class StalenessRule(Protocol):
    """What the detector asks of a rule; ``relative`` says the scores are relative (fit up to the largest)."""

    name: str
    relative: bool

    def reset(self, hot: HotSet | None) -> None: ...
    def begin_window(self, read: Reader, hot: HotSet) -> None: ...
    def end_window(self, read: Reader, hot: HotSet) -> None: ...
    def recheck(self, read: Reader, hot: HotSet) -> None: ...
    def measured(self) -> bool: ...
    def record_updates(self, sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, flags: np.ndarray) -> None: ...
    def score(self) -> np.ndarray: ...
    def stats(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PaperRule:
    """Slipstream's measure: L-infinity change of each hot row between two snapshots of the whole hot set."""

    name = "paper"
    relative = False

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self.reset(None)

    def reset(self, hot: HotSet | None) -> None:
        self.snap_prev: torch.Tensor | None = None
        self.snap_cur: torch.Tensor | None = None
        self._change_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin_window(self, read: Reader, hot: HotSet) -> None:
        self.snap_prev, self.snap_cur = read(hot.rows), None

    def end_window(self, read: Reader, hot: HotSet) -> None:
        self.snap_cur = read(hot.rows)

    def recheck(self, read: Reader, hot: HotSet) -> None:
        self.snap_prev, self.snap_cur = self.snap_cur, read(hot.rows)

    def measured(self) -> bool:
        return self.snap_cur is not None

    def record_updates(self, sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, flags: np.ndarray) -> None:
        """The paper's rule counts nothing."""

    def row_change(self) -> torch.Tensor:
        """float32 [hot rows]: largest per-dimension change between the latest two snapshots."""
        if self.snap_prev is None or self.snap_cur is None:
            raise InvalidInputError("row_change needs two snapshots (begin_window, end_window)")
        prev, cur = self.snap_prev, self.snap_cur
        memo = self._change_memo  # the filter, refits and stats all ask between two snapshots
        if memo is None or memo[0] is not prev or memo[1] is not cur:
            change = torch.zeros(0) if prev.shape[0] == 0 else (cur - prev).abs().amax(dim=1)
            self._change_memo = memo = (prev, cur, change)
        return memo[2]

    def score(self) -> np.ndarray:
        return self.row_change().numpy()

    def stats(self) -> dict[str, Any]:
        return {"unknown_rows": None, "index_bytes": 0}

    def state_dict(self) -> dict[str, Any]:
        return {"snap_prev": self.snap_prev, "snap_cur": self.snap_cur}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snap_prev = None if state["snap_prev"] is None else state["snap_prev"].clone()
        self.snap_cur = None if state["snap_cur"] is None else state["snap_cur"].clone()


class ConvergenceRule:
    """Change per counted update, relative to the row's scale, judged only on rows updated enough."""

    name = "convergence"
    relative = True

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self.reset(None)

    def reset(self, hot: HotSet | None) -> None:
        self.index = None if hot is None else HotIndex(hot.rows)
        self.base: torch.Tensor | None = None  # per hot row, its value when its current span began
        size = 0 if hot is None else len(hot)
        self.updates = np.zeros(size, dtype=np.int64)  # counted updates since the span began
        self._score = np.full(size, np.inf, dtype=np.float32)  # inf = unknown
        self._pending: list[np.ndarray] = []  # hot positions of trained lookups not yet added to updates

    def begin_window(self, read: Reader, hot: HotSet) -> None:
        self.base = read(hot.rows)
        self.updates[:] = 0
        self._score[:] = np.inf
        self._pending = []

    def end_window(self, read: Reader, hot: HotSet) -> None:
        self._measure(read, hot)

    def recheck(self, read: Reader, hot: HotSet) -> None:
        self._measure(read, hot)

    def measured(self) -> bool:
        return self.base is not None

    def record_updates(self, sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, flags: np.ndarray) -> None:
        """Count one update of each hot row per trained input that looks it up (see the detector's docstring)."""
        if self.index is None or self.base is None:
            return
        # Trained ids were validated by the filter already: no range check here (it cost a third of this).
        ids = _to_numpy(sparse)
        if self.config.count_share < 1.0:
            ids = ids[: max(1, math.ceil(ids.shape[0] * self.config.count_share))]
        uncounted = count_hot_lookups(ids, offsets, flags, self.index, self.updates)
        if uncounted.size:
            self._pending.append(uncounted)  # added up with later batches' in one bincount

    def fold_updates(self) -> None:
        if self._pending:
            self.updates += np.bincount(np.concatenate(self._pending), minlength=self.updates.size)
            self._pending = []

    def _measure(self, read: Reader, hot: HotSet) -> None:
        """Score every hot row updated at least ``min_updates`` times since its span began; start a new span.

        Score = L-inf change over the span / (updates x the row's L-inf norm now). Only those rows are read:
        a row with fewer updates keeps its span open and its last score (inf until it has one).
        """
        self.fold_updates()
        estimated = self.updates / self.config.count_share
        ready = np.flatnonzero(estimated >= self.config.min_updates)
        if ready.size:
            assert self.base is not None  # begin_window read it
            idx = torch.from_numpy(ready)
            now = read(hot.rows[ready])
            change = (now - self.base[idx]).abs().amax(dim=1)
            scale = now.abs().amax(dim=1).clamp_min(1e-12)
            self._score[ready] = (change / (scale * torch.from_numpy(estimated[ready]).float())).numpy()
            self.base[idx] = now
            self.updates[ready] = 0

    def score(self) -> np.ndarray:
        if self.base is None:
            raise InvalidInputError("row_score needs a window (begin_window, end_window)")
        return self._score

    def stats(self) -> dict[str, Any]:
        return {"unknown_rows": int(np.count_nonzero(~np.isfinite(self._score))),
                "index_bytes": self.index.nbytes if self.index is not None else 0}

    def state_dict(self) -> dict[str, Any]:
        self.fold_updates()  # sums are order-free: folding early changes no count
        return {"base": self.base, "updates": torch.from_numpy(np.ascontiguousarray(self.updates)),
                "score": torch.from_numpy(np.ascontiguousarray(self._score))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = None if state["base"] is None else state["base"].clone()
        self.updates = state["updates"].numpy().copy()
        self._score = state["score"].numpy().copy()
        self._pending = []


class RandomRule:
    """The equal-compute control: every hot row counts as stale, so every hot input is a candidate, and the
    skipper keeps a random share of them (``slipcache.staleness.skipping``). Measures nothing."""

    name = "random"
    relative = False
    fixed_threshold = 1.0  # every score (0) is below it: no bisection

    def __init__(self, config: StalenessConfig) -> None:
        self.config = config
        self.reset(None)

    def reset(self, hot: HotSet | None) -> None:
        self._size = 0 if hot is None else len(hot)
        self._open = False

    def begin_window(self, read: Reader, hot: HotSet) -> None:
        self._open = True

    def end_window(self, read: Reader, hot: HotSet) -> None:
        self._open = False

    def recheck(self, read: Reader, hot: HotSet) -> None:
        """Nothing to re-measure."""

    def measured(self) -> bool:
        return True

    def record_updates(self, sparse: np.ndarray | torch.Tensor, offsets: np.ndarray, flags: np.ndarray) -> None:
        """Nothing to count."""

    def score(self) -> np.ndarray:
        return np.zeros(self._size, dtype=np.float32)

    def stats(self) -> dict[str, Any]:
        return {"unknown_rows": None, "index_bytes": 0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateless."""


def make_rule(config: StalenessConfig) -> PaperRule | ConvergenceRule | RandomRule:
    """The strategy object for ``config.rule``."""
    rules: dict[str, type[PaperRule | ConvergenceRule | RandomRule]] = {
        "paper": PaperRule, "convergence": ConvergenceRule, "random": RandomRule
    }
    return rules[config.rule](config)
