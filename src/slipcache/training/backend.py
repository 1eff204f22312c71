"""Where a run executes: one process (`LocalBackend`) or N (`distributed.training.DistributedBackend`).

The backend is everything the training loop does differently across processes: building the model,
reading the checkpoint to resume from (a `TrainingCheckpoint` that puts its tables back itself, re-sharded
where another number of processes wrote it), writing checkpoints, which process writes the run directory,
and what the summary adds. The loop calls it and never asks which one it has. The one-process backend
knows only one-process files and reads a step directory of N processes whole (`step_checkpoint`).
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path
from typing import Any

import torch

from slipcache.errors import SlipcacheError
from slipcache.memory import model_bytes
from slipcache.model import DLRM, build_embeddings
from slipcache.safe_files import ensure_dir
from slipcache.training import checkpoint as ckpt
from slipcache.training import runlock
from slipcache.training.run_state import TrainingCheckpoint
from slipcache.training.rundir import has_checkpoint, load_training_checkpoint
from slipcache.training.runlock import RunLock
from slipcache.training.step_checkpoint import read_step

if typing.TYPE_CHECKING:
    from slipcache.data.formats import Dataset
    from slipcache.training.config import TrainConfig

logger = logging.getLogger(__name__)


def build_model(config: TrainConfig, table_sizes: list[int], num_dense: int, *, draw_rows: bool = True) -> DLRM:
    """The DLRM of `config` on these tables (`draw_rows` False: a checkpoint's rows are loaded next); the
    sharded model builds its own (distributed.training)."""
    model_config = config.model_config(table_sizes, num_dense)
    embeddings = build_embeddings(  # the MLPs and per-batch buffers priced in the tables' memory check
        list(table_sizes), embeddings=config.embeddings.embeddings, draw_rows=draw_rows,
        extra_bytes=model_bytes(model_config, config.schedule.batch_size, config.model.dense_optimizer),
        **config.embedding_options(),
    )
    return DLRM(model_config, embeddings)


def dense_optimizer(config: TrainConfig, model: DLRM) -> torch.optim.Optimizer:
    """The MLPs' optimizer (`--dense-optimizer`, one of config.DENSE_OPTIMIZERS) at `--dense-lr`, else `--lr`."""
    params, lr = model.dense_parameters(), config.mlp_lr()
    if config.model.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if config.model.dense_optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def embedding_optimizer(config: TrainConfig, model: DLRM) -> torch.optim.Optimizer | None:
    """A torch optimizer for embeddings without a fused update (the baseline); sparse gradients."""
    if model.embeddings.fused_update:
        return None
    params = list(model.embeddings.parameters())
    if config.embeddings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.embeddings.lr)
    if config.embeddings.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=config.embeddings.lr)
    raise SlipcacheError(f"optimizer {config.embeddings.optimizer!r} needs the cached embeddings (--embeddings cached)")


class RunBackend:
    """What the loop needs from where it runs; `LocalBackend` is the one-process answer to each."""

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run directory's files (config, metrics, summary, report)."""
        raise NotImplementedError

    @property
    def stops_alone(self) -> bool:
        """Whether this process may stop the run by itself (a full disk foreseen, a signal, a timer): one
        process may; a rank of N may not, the others would wait in a collective (torchrun stops them all)."""
        return True

    def claim_run_dir(self, run_dir: Path, record: dict[str, Any]) -> RunLock:
        """Take the run directory for this run (`run.lock`): one writer per run directory."""
        raise NotImplementedError

    def build_model(self, config: TrainConfig, dataset: Dataset, run_dir: Path, *, draw_rows: bool = True) -> Any:
        """The run's model on the dataset's tables; `draw_rows` False: a checkpoint's rows are loaded next, so
        none are drawn."""
        raise NotImplementedError

    def batch_part(self) -> tuple[int, int] | None:
        """(part, parts): the slice of every global batch this process reads (`BatchIterator(part=...)`);
        None: the whole batch."""
        raise NotImplementedError

    @property
    def rank(self) -> int:
        """This process's rank among the run's processes (0 for one process)."""
        return 0

    def read_resume_checkpoint(self, path: Path, home: Path | None) -> TrainingCheckpoint | None:
        """The checkpoint to resume from (`path`: the one `--resume` names, inside run dir `home`): its state
        and how its tables go into this backend's model (`TrainingCheckpoint.load_into`), or None when the
        run stopped before its first checkpoint (it starts again from its config.json)."""
        raise NotImplementedError

    def save_checkpoint(self, run_dir: Path, state: dict[str, Any], samples: int, keep: int) -> int | None:
        """Write the checkpoint; returns its bytes on disk (all files of it; None where this process
        does not know them)."""
        raise NotImplementedError

    def summary(self, model: Any) -> dict[str, Any] | None:
        """summary.json's "distributed" block (None for one process)."""
        raise NotImplementedError


class LocalBackend(RunBackend):
    """One process: it builds the whole model and writes every file."""

    @property
    def writes_files(self) -> bool:
        return True

    def claim_run_dir(self, run_dir: Path, record: dict[str, Any]) -> RunLock:
        return runlock.acquire(run_dir, record["run_id"])

    def build_model(self, config: TrainConfig, dataset: Dataset, run_dir: Path, *, draw_rows: bool = True) -> DLRM:
        return build_model(config, list(dataset.table_sizes), dataset.num_dense, draw_rows=draw_rows)

    def batch_part(self) -> None:
        return None

    def read_resume_checkpoint(self, path: Path, home: Path | None) -> TrainingCheckpoint | None:
        if path.is_dir():  # a step of N processes: read by its writer's reader, its tables gathered into one
            checkpoint = read_step(path)
            if checkpoint.resharding:
                logger.info(checkpoint.resharding)
            return checkpoint
        if home is not None and path.name == ckpt.LATEST and not has_checkpoint(home):
            return None
        return TrainingCheckpoint(path, load_training_checkpoint(path))

    def save_checkpoint(self, run_dir: Path, state: dict[str, Any], samples: int, keep: int) -> int | None:
        """`checkpoints/ckpt-<samples>.pt` and `latest.pt`; a failed write names what is left to resume."""
        directory = ensure_dir(run_dir / "checkpoints", inside=run_dir)  # a link there is refused
        try:
            return ckpt.save_run_checkpoint(directory, state, samples, keep=keep).stat().st_size
        except OSError as exc:  # a full disk, a quota: the previous checkpoint is intact (atomic writes)
            complete = ckpt.complete_checkpoints(directory)
            then = (
                f"the last complete checkpoint is {complete[0]}; free space, then --resume {run_dir}"
                if complete
                else f"no checkpoint was written yet; free space, then --resume {run_dir} starts it again"
            )
            raise SlipcacheError(
                f"cannot write a checkpoint into {directory}: {exc.strerror or exc}; {then}"
            ) from exc

    def summary(self, model: DLRM) -> dict[str, Any] | None:
        return None
