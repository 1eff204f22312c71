"""What the study tests share: a study run as `python -m benchmarks.studies` runs it, its progress lines,
and the config a fake trainer takes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import studies

RAN = re.compile(r"^\[\d+/\d+\] ")  # the line a study prints for each run it starts


def study_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    studies.add_experiment_arguments(parser)
    return parser.parse_args(list(argv))


def run_study(*argv: str) -> list[str]:
    """Run the study; it must succeed. Returns the lines it logged."""
    lines: list[str] = []
    assert studies.run_experiment(study_args(*argv), log=lines.append) == 0
    return lines


@dataclasses.dataclass
class FakeConfig:
    """The TrainConfig fields the experiment sets, including the stale-skipping ones."""

    data: str | None = None
    out: str | None = None
    precision: str = "int8"
    cache_size: float = 0.05
    policy: str = "lru"
    rounding: str = "stochastic"
    batch_size: int = 512
    lr: float = 0.1
    bottom_mlp: list[int] = dataclasses.field(default_factory=list)
    top_mlp: list[int] = dataclasses.field(default_factory=list)
    eval_samples: int = 0
    seed: int = 0
    progress: bool = False
    epochs: int = 1
    checkpoint_every: int = 0
    eval_every: int | None = None
    skip_rule: str | None = None
    stale_target: float = 0.3
    stale_rule: str = "convergence"
    stale_warmup: str = "val"
    stale_warmup_min: float = 0.1
    stale_decision: str = "rolling"
    stale_keep: float = 0.05

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> FakeConfig:
        """As `TrainConfig.from_flat`: the runner builds its configs from flat keys."""
        return cls(**values)

    def flat(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fake_trainer(train: Callable[[FakeConfig], dict[str, Any]]) -> types.SimpleNamespace:
    """The trainer module the studies' runner calls, with `train` in place of training (no tables)."""
    return types.SimpleNamespace(
        TrainConfig=FakeConfig,
        train=train,
        prepare_data=lambda config, root: Path(config.data),
        open_dataset=lambda path: types.SimpleNamespace(table_sizes=[100] * 26),
    )


def write_fake_run(config: FakeConfig, events: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """A run directory as training leaves one: metrics.jsonl with `events`, summary.json with `summary` and
    the config; returns the summary."""
    run = Path(str(config.out))
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {**summary, "config": {**dataclasses.asdict(config), "embedding_dim": 16}}
    (run / "summary.json").write_text(json.dumps(summary))
    return summary
