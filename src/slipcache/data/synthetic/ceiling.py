"""The best AUC a model can reach on generated data: the teacher's own test AUC, and coverage ceilings.

The generator labels every row from a hidden teacher, so the teacher's AUC on the test split is an upper
bound for any model. No model can know a latent value (a user, ad or site, or an independent table's
value) that training never showed it, so the *coverage ceiling* for k is the teacher's test AUC with the
signal of every latent value seen fewer than k times in the training split removed (its parameter row
replaced by the all-zero row). The gap between a trained model and the k = 10 ceiling says how much it
still has to learn; the gap between the ceilings says how much of the signal is rare.

`CoverageCeiling` does the counting while rows are generated in log order (train first, then validation,
then test), so `generate_synthetic` records the ceiling in meta.json at no extra pass;
`generate.dataset_ceiling` generates again the rows of a dataset written without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slipcache.metrics import auc

CEILING_KS = (1, 10, 100)
FLUSH_ROWS = 1 << 21  # training values counted per bincount (bounds the buffered keys to ~16 MB a source)


class CoverageCeiling:
    """Counts each latent source's values over the training rows, then scores the test rows with the
    teacher at full signal and with the values seen fewer than k times removed, for each k."""

    def __init__(self, teacher: Any, ks: tuple[int, ...] = CEILING_KS) -> None:
        self.teacher = teacher
        self.ks = ks
        self.zero_row = len(teacher.first_order) - 1  # the all-zero parameter row
        self.counts: list[np.ndarray] = []
        self.pending: list[list[np.ndarray]] = []
        self.pending_rows = 0
        self.labels: list[np.ndarray] = []
        self.logits: dict[str, list[np.ndarray]] = {"teacher": [], **{str(k): [] for k in ks}}

    def add_train(self, sources: np.ndarray) -> None:
        """Count the latent values [n, k] of training rows."""
        if not self.counts:
            self.counts = [np.zeros(0, dtype=np.int32) for _ in range(sources.shape[1])]
            self.pending = [[] for _ in range(sources.shape[1])]
        for j in range(sources.shape[1]):
            self.pending[j].append(sources[:, j])
        self.pending_rows += len(sources)
        if self.pending_rows >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        for j, parts in enumerate(self.pending):
            if not parts:
                continue
            keys = np.concatenate(parts)
            seen = np.bincount(keys, minlength=len(self.counts[j]))
            if len(seen) > len(self.counts[j]):
                self.counts[j] = np.concatenate([self.counts[j], np.zeros(len(seen) - len(self.counts[j]), np.int32)])
            self.counts[j] += seen.astype(np.int32)
            parts.clear()
        self.pending_rows = 0

    def add_chunk(
        self,
        bounds: dict[str, tuple[int, int]],
        start: int,
        dense: np.ndarray,
        labels: np.ndarray,
        latent: tuple[np.ndarray, np.ndarray],
    ) -> None:
        """A chunk of the log from row `start`: its training rows counted, its test rows scored."""
        params, sources = latent
        for name in ("train", "test"):
            a, b = bounds[name]
            lo, hi = max(a, start) - start, min(b, start + len(labels)) - start
            if lo >= hi:
                continue
            if name == "train":
                self.add_train(sources[lo:hi])
            else:
                self.add_test(dense[lo:hi], params[lo:hi], sources[lo:hi], labels[lo:hi])

    def add_test(self, dense: np.ndarray, params: np.ndarray, sources: np.ndarray, labels: np.ndarray) -> None:
        """Score test rows: the teacher's logits, and for each k the logits without the rare values' signal.
        `add_train` must have seen every training row first (the generator writes in log order)."""
        self.labels.append(labels)
        for name, logits in self.masked_logits(dense, params, sources).items():
            self.logits[name].append(logits)

    def masked_logits(self, dense: np.ndarray, params: np.ndarray, sources: np.ndarray) -> dict[str, np.ndarray]:
        """The teacher's logits of rows, in full ("teacher") and for each k without the signal of the latent
        values the training rows counted so far hold fewer than k times."""
        if self.pending_rows:
            self._flush()
        seen = np.zeros(sources.shape, dtype=np.int64)
        for j, counts in enumerate(self.counts):
            known = sources[:, j] < len(counts)
            seen[known, j] = counts[sources[known, j]]
        out = {"teacher": self.teacher.logits(self.teacher.terms(dense, params))}
        for k in self.ks:
            masked = np.where(seen < k, self.zero_row, params)
            out[str(k)] = self.teacher.logits(self.teacher.terms(dense, masked))
        return out

    def result(self) -> dict[str, Any] | None:
        """{"teacher_auc", "coverage_auc": {"1": ..., "10": ..., "100": ...}, "test_rows"}; None without test rows."""
        if not self.labels:
            return None
        labels = np.concatenate(self.labels)
        score = {name: auc(labels, np.concatenate(parts)) for name, parts in self.logits.items()}
        return {
            "teacher_auc": score.pop("teacher"),
            "coverage_auc": score,
            "test_rows": int(len(labels)),
            "definition": "teacher AUC on the test split; coverage k: the same with every latent value "
            "(user, ad, site, independent table value) seen fewer than k times in training removed",
        }


def no_ceiling_reason(meta: dict[str, Any]) -> str | None:
    """Why a dataset has no known ceiling (None: it has one, or one can be computed)."""
    if (meta.get("source") or {}).get("generator") != "slipcache.data.synthetic":
        return "no ceiling is known for this data: only data that slipcache generated has a known teacher"
    if (meta.get("generator") or {}).get("version", 0) < 3:
        return "no ceiling is known for this data: generator v2 has no latent sources to count"
    return None
