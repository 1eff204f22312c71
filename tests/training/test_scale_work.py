"""Nothing per training step or per evaluation grows with the number of rows: counted at a small size.

Every torch operation of the steps, the logged events and the evaluations of a short run is watched
(TorchDispatchMode); one that reads or writes a tensor with as many elements as the tables have rows is
O(rows) work that a 204 M-row run would pay every step. Indexing (a gather or a scatter of the batch's rows)
touches the big tensors but only the rows it names, so it is allowed. Start-up (creating the tables) and
checkpoints are O(rows) by nature and are not watched.
"""

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slipcache.training import trainer
from tests.helpers import make_dataset, tiny_config

ROWS = 600_000  # two big tables: far more rows than a batch (or an evaluation batch) touches
SIZES = [400_000, 200_000] + [10] * 24
# Operations that touch only the elements they index (or make views): O(batch) on a big tensor.
INDEXED = {
    "aten.index_select.default", "aten.index.Tensor", "aten.index_put_.default", "aten.index_copy_.default",
    "aten.index_add_.default", "aten.embedding.default", "aten.gather.default", "aten.scatter_.src",
    "aten.slice.Tensor", "aten.select.int", "aten.view.default", "aten.as_strided.default", "aten.detach.default",
    "aten.alias.default", "aten._unsafe_view.default", "aten.expand.default", "aten.unsqueeze.default",
    "aten.reshape.default", "aten.squeeze.dim", "aten.t.default", "aten.lift_fresh.default",
}


class RowsWork(TorchDispatchMode):
    """Counts operations (not indexing) on tensors of at least `limit` elements."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.found = limit, collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func) not in INDEXED:
            tensors = [a for a in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out]))
                       if isinstance(a, torch.Tensor)]
            big = [tuple(t.shape) for t in tensors if t.numel() >= self.limit]
            if big:
                self.found[f"{func} {big[:2]}"] += 1
        return out


@pytest.mark.parametrize("precision, optimizer", [("int4", "sgd"), ("int8", "rowwise_adagrad")])
def test_steps_events_and_evaluations_do_no_work_per_row(
    precision: str, optimizer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_dataset(tmp_path / "data", n=1000, sizes=SIZES)
    mode = RowsWork(limit=ROWS)
    watched = collections.Counter()

    def watch(name: str) -> None:
        real = getattr(trainer, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            watched[name] += 1
            with mode:
                return real(*args, **kwargs)

        monkeypatch.setattr(trainer, name, wrapped)

    for name in ("train_step", "record_step", "log_event", "evaluate"):
        watch(name)
    config = tiny_config(data, tmp_path / "run", embeddings="cached", precision=precision, optimizer=optimizer,
                         cache_size=0.02, epochs=1, log_every=64, eval_every=320)
    trainer.train(config)
    assert watched["train_step"] >= 15 and watched["evaluate"] >= 3 and watched["log_event"] >= 15
    assert not mode.found, dict(mode.found)
