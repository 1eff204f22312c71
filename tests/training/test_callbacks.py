"""Training callbacks: a feature joins the loop at fixed hooks, and its state survives a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slipcache.callback import Callback
from slipcache.training import trainer as train
from slipcache.training.callbacks import Callbacks
from tests.helpers import make_dataset
from tests.helpers import tiny_config as tiny


class _Drop(Callback):
    def __init__(self, column: int, below: int) -> None:
        self.column, self.below = column, below

    def sample_filter(self, run: Any):  # noqa: ANN201 - a SampleFilter
        return lambda sparse: sparse[:, self.column] >= self.below


def test_filters_are_combined_each_seeing_what_the_earlier_kept() -> None:
    sparse = np.array([[0, 5], [1, 0], [2, 9], [3, 1]])
    seen: list[np.ndarray] = []

    class _Second(Callback):
        def sample_filter(self, run: Any):  # noqa: ANN201
            def keep(rows: np.ndarray) -> np.ndarray:
                seen.append(rows.copy())
                return rows[:, 1] > 2

            return keep

    combined = Callbacks([_Drop(0, 1), _Second()]).sample_filter(None)  # type: ignore[arg-type]
    assert combined is not None
    assert combined(sparse, np.arange(len(sparse))).tolist() == [False, False, True, False]
    assert seen[0].tolist() == [[1, 0], [2, 9], [3, 1]]
    assert Callbacks([Callback()]).sample_filter(None) is None  # type: ignore[arg-type]


def test_loss_weights_multiply_and_none_means_the_plain_mean() -> None:
    class _Weigh(Callback):
        def __init__(self, w: float) -> None:
            self.w = w

        def loss_weights(self, run: Any, n: int) -> torch.Tensor:
            return torch.full((n,), self.w)

    assert Callbacks([Callback()]).loss_weights(None, 3) is None  # type: ignore[arg-type]
    weights = Callbacks([_Weigh(2.0), Callback(), _Weigh(1.5)]).loss_weights(None, 3)  # type: ignore[arg-type]
    assert weights is not None and weights.tolist() == [3.0, 3.0, 3.0]


class _Recorder(Callback):
    """Counts what it sees and keeps the count in the checkpoint."""

    state_key = "recorder"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.steps = 0

    def on_start(self, run: Any) -> None:
        self.calls.append("on_start")

    def start_epoch(self, run: Any) -> None:
        self.calls.append("start_epoch")

    def after_step(self, run: Any, batch: Any, logits: torch.Tensor, loss: float) -> None:
        assert logits.shape == batch.labels.shape and not logits.requires_grad
        self.steps += 1

    def event_fields(self, run: Any) -> dict[str, Any]:
        return {"recorded_steps": self.steps}

    def after_eval(self, run: Any, scores: dict[str, Any]) -> None:
        self.calls.append("after_eval")

    def summary_fields(self, run: Any) -> dict[str, Any]:
        return {"recorded_steps": self.steps}

    def on_finish(self, run: Any, summary: dict[str, Any]) -> None:
        self.calls.append("on_finish")

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


def _recording(made: list[_Recorder]) -> list[Any]:
    """`train(..., extra_callbacks=...)` for a run that gets a new `_Recorder` besides its usual callbacks."""

    def new_recorder(run: Any, hot_inputs: Any) -> _Recorder:
        made.append(_Recorder())
        return made[-1]

    return [new_recorder]


@pytest.mark.slow
def test_a_callback_sees_every_hook_and_its_state_survives_a_resume(tmp_path: Path) -> None:
    """A callback joins the loop through the trainer's one hook for callbacks of its own (`extra_callbacks`)."""
    data = make_dataset(tmp_path / "data", n=640)
    run = tmp_path / "run"
    recorders: list[_Recorder] = []
    summary = train.train(tiny(data, run, epochs=2, log_every=128, eval_every=320, checkpoint_every=320),
                          extra_callbacks=_recording(recorders))
    first = recorders[0]
    assert summary["recorded_steps"] == first.steps == 20  # 2 epochs of 10 batches
    assert first.calls[:2] == ["on_start", "start_epoch"] and first.calls[-1] == "on_finish"
    assert first.calls.count("start_epoch") == 2 and "after_eval" in first.calls
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_events = [e for e in events if e["event"] == "train"]  # checkpoint events carry no fields of callbacks
    assert [e["recorded_steps"] for e in train_events] == [e["samples"] // 64 for e in train_events]

    resumed = tmp_path / "resumed"
    train.train(tiny(data, resumed, epochs=1, log_every=128, eval_every=320, checkpoint_every=320),
                extra_callbacks=_recording(recorders))
    summary = train.train(tiny(data, resumed, resume=str(resumed), epochs=2, allow_changes=True),
                          extra_callbacks=_recording(recorders))
    assert recorders[-1].calls[0] == "on_start" and summary["recorded_steps"] == 20  # 10 restored + 10
