"""`slipcache train` across N processes: what the training loop needs beyond one process.

The loop itself (slipcache.training.trainer) does not change. It sees one model, `DistributedDLRM`, that
takes the whole global batch like DLRM does and returns the logits of the whole batch:

    global batch [B] -> this rank's slice (B split as evenly as possible: the first B mod N ranks take one
    sample more) -> bottom MLP (DistributedDataParallel) and the sharded tables (all-to-all) -> interaction
    and top MLP -> this slice's logits -> all ranks' logits gathered into [B]

so the loss, the logged figures and validation/test metrics are computed over the whole batch or split on
every rank, identically. In backward each rank keeps its slice's gradient of the (global mean) loss; the
dense gradients are summed over ranks (a DDP communication hook that sums instead of averaging), so every
gradient equals the one-process gradient of the same global batch up to float summation order.

Every rank reads only its slice of each global batch from the memory-mapped dataset (the same shuffle on
every rank: `BatchIterator(part=(rank, N))`), plus the global batch's labels; a run whose callbacks read
the ids of every sample (skipping) reads whole batches and keeps its slice. Rank 0 alone prints and writes
config.json, metrics.jsonl, summary.json, report.md and the plan (plan.json); other ranks write their output
to rank-<r>.log in the run directory.
Cache statistics and memory are collectives that sum over ranks and keep each rank's figures
(`ShardedEmbeddingCollection.stats` / `memory_report`), called at the same points on every rank.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from slipcache.data.batches import slice_bounds
from slipcache.distributed import checkpoint as dckpt
from slipcache.distributed.launch import DistributedContext, announce_stop, redirect_output, shutdown
from slipcache.distributed.planner import ShardingPlan, plan_sharding, table_specs
from slipcache.distributed.sharded import ShardedEmbeddingCollection
from slipcache.errors import RunLockedError, SlipcacheError
from slipcache.model import DLRM, ModelConfig, embedding_config
from slipcache.safe_files import write_atomic
from slipcache.training import checkpoint as ckpt
from slipcache.training import runlock
from slipcache.training.backend import RunBackend
from slipcache.training.run_state import TrainingCheckpoint, check_checkpoint
from slipcache.training.rundir import load_training_checkpoint
from slipcache.training.runlock import RunLock

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
# Settings that may differ by rank: who shows progress, where each node reads its data (the fingerprint
# says whether it is the same), and the run id each rank drew before rank 0's was agreed on.
_PER_RANK_SETTINGS = ("progress", "tensorboard", "data", "dataset", "run_id")


class _GatherLogits(torch.autograd.Function):
    """Every rank's logits concatenated; backward keeps this rank's slice of the (identical) gradient."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, sizes: list[int], rank: int) -> Tensor:
        ctx.bounds = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
        padded = local.new_zeros(max(sizes))
        padded[: local.numel()] = local
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        start, end = ctx.bounds
        return grad[start:end], None, None


def _sum_gradients(state, bucket):  # noqa: ANN001, ANN201 - DDP checks real annotations, not strings
    """DDP communication hook: sum the ranks' gradients (each is its slice's part of the global mean)."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda f: f.value()[0])


class DistributedDLRM(nn.Module):
    """DLRM over N ranks with DLRM's interface: global batch in, global logits out (see module doc)."""

    ddp: DistributedDataParallel  # set through __dict__ in __init__: not a child module

    def __init__(self, model: DLRM, ctx: DistributedContext) -> None:
        super().__init__()
        self.inner = model
        self.ctx = ctx
        # DDP holds `model` too; kept out of this module's children so state dicts keep DLRM's keys.
        # The tables hold no parameters and differ by rank: their buffers are never broadcast.
        with warnings.catch_warnings():  # the suggested replacement still syncs buffers at init
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            ddp = DistributedDataParallel(model, broadcast_buffers=False)
        ddp.register_comm_hook(None, _sum_gradients)
        self.__dict__["ddp"] = ddp

    @property
    def embeddings(self) -> ShardedEmbeddingCollection:
        tables = self.inner.embeddings
        assert isinstance(tables, ShardedEmbeddingCollection)  # build_model made them
        return tables

    @property
    def config(self) -> ModelConfig:
        return self.inner.config

    def dense_parameters(self) -> list[nn.Parameter]:
        return self.inner.dense_parameters()

    def forward(self, dense: Tensor, sparse: Tensor, batch_size: int | None = None) -> Tensor:
        """Logits of the global batch. `batch_size` None: dense and sparse hold the whole global batch and
        this rank keeps its slice; else they hold only this rank's slice of a global batch of that size."""
        world, rank = self.ctx.world_size, self.ctx.rank
        total = dense.shape[0] if batch_size is None else batch_size
        sizes = [end - start for start, end in (slice_bounds(total, world, r) for r in range(world))]
        if batch_size is None:
            start, end = slice_bounds(total, world, rank)
            dense, sparse = dense[start:end], sparse[start:end]
        elif dense.shape[0] != sizes[rank] or sparse.shape[0] != sizes[rank]:
            raise SlipcacheError(
                f"rank {rank} got {dense.shape[0]} rows of a global batch of {total}; its slice holds {sizes[rank]}"
            )
        device = self.ctx.device
        local = self.ddp(dense.to(device), sparse.to(device))
        return _GatherLogits.apply(local, sizes, rank).to(dense.device)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # torch's overloads
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.inner.load_state_dict(state, strict=strict, assign=assign)


class DistributedBackend(RunBackend):
    """One rank of N: the launch, the plan, sharded checkpoints (re-sharded on another world size), and
    rank 0 alone writing the run directory."""

    def __init__(self, ctx: DistributedContext) -> None:
        self.ctx = ctx
        self.plan: ShardingPlan | None = None  # from the checkpoint on resume, else made at model build

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    @property
    def writes_files(self) -> bool:
        return self.is_main

    def batch_part(self) -> tuple[int, int]:
        """(rank, world size): each rank reads its slice of every global batch."""
        return self.ctx.rank, self.ctx.world_size

    @property
    def processes(self) -> int:
        return self.ctx.world_size

    # ------------------------------------------------------------------------------------- set-up
    def check_config(self, config: Any) -> None:
        """Refuse what does not work across processes yet, with the same one-line error on every rank."""
        n = self.ctx.world_size
        if config.embeddings.embeddings != "cached":
            raise SlipcacheError(
                f"--embeddings {config.embeddings.embeddings} is not supported with {n} > 1 processes "
                "(only cached tables are sharded)"
            )

    def check_same_settings(self, record: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> None:
        """Every rank must run the same settings on the same data: a rank started with another --lr or
        --batch-size would train silently apart or break a collective later. Every rank sees every rank's
        settings and stops with the same line naming the first difference. Agrees on rank 0's run id."""
        compared = {k: v for k, v in record.items() if k not in _PER_RANK_SETTINGS + ignore}
        everyone: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, compared)
        mine = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs == mine:
                continue
            name = next(k for k in [*mine, *theirs] if mine.get(k, "(unset)") != theirs.get(k, "(unset)"))
            if name == "data_fingerprint":
                detail = "the data differ (their dataset fingerprints)"
            else:
                detail = (f"{name} is {mine.get(name, '(unset)')!r} on rank 0 but {theirs.get(name, '(unset)')!r} "
                          f"on rank {rank}")
            raise SlipcacheError(f"the ranks were started with different settings: {detail}; "
                                 "start every rank with the same command and data")
        if "run_id" in record:
            record["run_id"] = self.agree(record["run_id"])

    def claim_run_dir(self, run_dir: Path, record: dict[str, Any]) -> RunLock:
        """The ranks first agree on their settings and data (one line naming the first difference, on every
        rank), then rank 0 takes `run.lock` and tells the others whether it could."""
        self.check_same_settings(record)
        lock, refusal = None, None
        if self.is_main:
            try:
                lock = runlock.acquire(run_dir, record["run_id"])
            except RunLockedError as exc:
                refusal = str(exc)
        refusal = self.agree(refusal)
        if refusal is not None:
            raise RunLockedError(refusal)
        return lock if lock is not None else runlock.RunLock(run_dir / runlock.LOCK_NAME, -1, {})

    def agree(self, value: Any) -> Any:
        """Rank 0's value on every rank (e.g. a run directory named after the clock)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def build_model(
        self, config: Any, table_sizes: list[int], num_dense: int, run_dir: Path, *, draw_rows: bool = True
    ) -> DistributedDLRM:
        tables_config = embedding_config(
            table_sizes,
            **config.embedding_options(),
            storage_device=str(self.ctx.device),
            cache_device=str(self.ctx.device),
        )
        if self.plan is None:
            specs = table_specs(
                table_sizes,
                config.model.embedding_dim,
                precision=config.embeddings.precision,
                cache_size=config.embeddings.cache_size,
                optimizer=config.embeddings.optimizer,
            )
            self.plan = plan_sharding(specs, self.ctx.world_size)
        self._require_rank_fits(config, tables_config, table_sizes, num_dense)
        # Every rank has checked the run directory by now; from here on the others write their logs in it.
        dist.barrier()
        if self.is_main:
            logger.info(self.plan.format_table())
            write_atomic(run_dir / PLAN_FILE, json.dumps(self.plan.to_dict(), indent=2) + "\n")
        else:
            redirect_output(run_dir, self.ctx.rank)
        tables = ShardedEmbeddingCollection(
            tables_config, self.plan, self.ctx.rank, self.ctx.embedding_group,
            wire_precision=config.embeddings.wire_precision, draw_rows=draw_rows,
        )
        return DistributedDLRM(DLRM(config.model_config(table_sizes, num_dense), tables).to(self.ctx.device), self.ctx)

    def _require_rank_fits(self, config: Any, tables_config: Any, table_sizes: list[int], num_dense: int) -> None:
        """This rank's shards, the MLPs and its per-batch buffers against its host's memory, before any of
        them is allocated (tables on a GPU are that device's business: the host check prices the rest)."""
        from slipcache.distributed.sharded import shard_config
        from slipcache.memory import model_bytes, require_bytes, require_tables_fit
        from slipcache.model import DENSE_ADVICE, DENSE_PART

        dense = model_bytes(config.model_config(table_sizes, num_dense), config.schedule.batch_size,
                            config.model.dense_optimizer)
        assert self.plan is not None  # planned before the tables are priced
        shards = self.plan.shards_of(self.ctx.rank)
        what = f"rank {self.ctx.rank}'s tables"
        if shards and torch.device(tables_config.storage_device).type == "cpu":
            require_tables_fit(shard_config(tables_config, shards, self.ctx.rank), what, extra_bytes=dense,
                               extra_what=DENSE_PART, extra_advice=DENSE_ADVICE)
        else:
            require_bytes(0, what=what, config=tables_config, choice="no tables here",
                          extra_bytes=dense, extra_what=DENSE_PART, extra_advice=DENSE_ADVICE)

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, run_dir: Path, state: dict[str, Any], samples: int, keep: int) -> int | None:
        """Rank 0's file holds the full trainer state; the others only their shards. Returns (on rank 0)
        the bytes of every rank's file, as the step's manifest records them."""
        directory = run_dir / "checkpoints"
        mine = state if self.is_main else {"embeddings": state["embeddings"]}
        assert self.plan is not None
        step_dir = dckpt.save_sharded(
            directory,
            samples,
            self.ctx.rank,
            self.ctx.world_size,
            mine,
            {"plan": self.plan.to_dict()},
            keep=keep,
            group=self.ctx.embedding_group,
        )
        return sum(dckpt.read_manifest(step_dir)["files"].values()) if self.is_main else None

    def read_resume_checkpoint(self, path: Path, home: Path | None) -> TrainingCheckpoint:
        """The trainer state to resume from: rank 0's file, with this rank's shards as "embeddings".

        With the world size it was written with, the plan and the shards are taken as saved (exact
        resume); with another (a one-process checkpoint included), a new plan is made and loading the
        checkpoint re-shards the tables (`reshard_into`, `reshard_from_single`); rank 0 prints what it did.
        """
        path = Path(path)  # the newest complete checkpoint, or the one --resume names (`find_checkpoint`)
        step_dir = path if (path / dckpt.MANIFEST).is_file() else None
        if step_dir is not None:
            _check_step_complete(step_dir)
        if step_dir is None:
            single = path
            if not single.is_file():
                raise SlipcacheError(
                    f"no complete checkpoint (with its {dckpt.MANIFEST}) under {home or path}; "
                    "start the run again with its --out"
                )
            state = load_training_checkpoint(single)
            tables = partial(dckpt.reshard_from_single, embeddings=state.pop("embeddings"))
            line = (
                f"re-sharding {single}, written by 1 process, over {self.ctx.world_size} processes: "
                f"{dckpt.RESHARDED}"
            )
            self._say(line)
            return TrainingCheckpoint(single, state, load_tables=tables, resharding=line)
        manifest = dckpt.read_manifest(step_dir)
        state = dckpt.load_rank_state(step_dir, 0)
        check_checkpoint(state, step_dir)
        if manifest["world_size"] == self.ctx.world_size:
            self.plan = ShardingPlan.from_dict(manifest["plan"])
            if self.ctx.rank != 0:
                state["embeddings"] = dckpt.load_rank_state(step_dir, self.ctx.rank)["embeddings"]
            return TrainingCheckpoint(step_dir, state)
        del state["embeddings"]  # rank 0's shards under the old plan: re-sharded instead
        line = (
            f"re-sharding {step_dir}, written by {manifest['world_size']} processes, over "
            f"{self.ctx.world_size}: {dckpt.RESHARDED}"
        )
        self._say(line)
        tables = partial(dckpt.reshard_into, step_dir=step_dir, manifest=manifest)
        return TrainingCheckpoint(step_dir, state, load_tables=tables, resharding=line)

    def _say(self, line: str) -> None:
        if self.is_main:
            logger.info(line)

    # ------------------------------------------------------------------------------------- summary
    def summary(self, model: DistributedDLRM) -> dict[str, Any]:
        """Launch facts and the all-to-all bytes sent per sample (a collective)."""
        assert self.plan is not None
        return {
            "world_size": self.ctx.world_size,
            "backend": self.ctx.backend,
            "threads_per_rank": self.ctx.threads,
            "plan_bytes_per_rank": self.plan.bytes_per_rank(),
            "plan_lookups_per_rank": self.plan.lookups_per_rank(),
            "traffic": model.embeddings.combined_traffic(),
        }


def _check_step_complete(step_dir: Path) -> None:
    """Every rank file of a step verifies (each rank checks all of them, so all stop with the same line);
    a damaged one names the complete older steps and how to resume from the newest of them."""
    manifest = dckpt.read_manifest(step_dir)
    damaged = [name for name in manifest["files"] if not ckpt.is_complete(step_dir / name)]
    if not damaged:
        return
    older = [
        step for step in sorted(step_dir.parent.glob("step-*"), reverse=True)
        if step.name < step_dir.name and (step / dckpt.MANIFEST).is_file()
        and all(ckpt.is_complete(f) for f in step.glob("rank-*.pt"))
    ]  # fmt: skip
    then = f"to continue from the newest complete one: --resume {older[0]}" if older else "no older complete checkpoint"
    raise SlipcacheError(f"checkpoint {step_dir} is damaged ({', '.join(damaged)} fails its checksum); {then}")


def lost_rank_error(exc: BaseException, rank: int) -> SlipcacheError:
    """One line for a collective that failed because another rank died or stopped answering."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # gloo prefixes its source file and line
    first = text.splitlines()[0].split(". ")[0] if text else type(exc).__name__
    first = re.sub(r"\s*\[[^\]]*\](:\d+)?:?\s*", ": ", first).strip(": ")  # no peer address or port
    line = f"rank {rank}: another rank stopped ({first[:160]}); resume from the last complete checkpoint with --resume"
    announce_stop(line)  # the console sees it too, and torchrun's SIGTERM that follows adds no second line
    return SlipcacheError(line)


def train_on_ranks(config: Any, ctx: DistributedContext) -> dict[str, Any]:
    """`trainer.train` as one rank of N: the run directory agreed, the data prepared once, rank-0 output."""
    from slipcache.training import trainer
    from slipcache.training.datasets import prepare_data
    from slipcache.training.rundir import new_run_dir

    run = DistributedBackend(ctx)
    try:
        # The flags as given first (a rank with other flags fails here, before anything it would do apart
        # from the others); the resolved settings and the data's fingerprint when the run starts.
        run.check_same_settings(config.flat(), ignore=("out", "resume"))
        run.check_config(config)
        if config.run.out is None and config.run.resume is None:
            config.run.out = run.agree(str(new_run_dir()))
        if not run.is_main:
            config.schedule.progress = False
        if config.run.resume is None and ctx.local_rank == 0:  # once per node, before the others read it
            prepare_data(config)
        dist.barrier()
        return trainer.train(config, run)
    except (dist.DistError, RuntimeError) as exc:
        if isinstance(exc, dist.DistError) or "gloo" in str(exc).lower() or "connection" in str(exc).lower():
            raise lost_rank_error(exc, ctx.rank) from exc
        raise
    finally:
        shutdown()
