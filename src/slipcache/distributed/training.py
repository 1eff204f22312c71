"""`slipcache train` across N processes: the trainer's model under TorchRec's DistributedModelParallel.

The loop itself (slipcache.training.trainer) does not change and knows no process count: it sees one
model (`model.ShardedDLRM`) that takes this rank's slice of the global batch and returns the whole batch's
logits, and this backend, which says what differs across processes:

- which part of the data a rank reads: its slice of every global batch (`BatchIterator(part=(rank, N))`)
  and of every evaluation batch; the loss, logged figures and validation/test metrics (AUC, log loss) are
  computed on the gathered logits, identically on every rank;
- rank checks: every rank runs the same settings on the same data, or all stop with one line naming the
  first difference; combinations not supported across processes yet are refused in one line (`check_config`);
- one writer: rank 0 alone writes config.json, metrics.jsonl, summary.json, report.md and the checkpoints'
  metadata; the other ranks send their output to rank-<r>.log in the run directory;
- checkpoints: a DCP of the sharded tables beside rank 0's trainer state (`checkpoint.py`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from slipcache.distributed import checkpoint as dckpt
from slipcache.distributed.launch import DistributedContext, announce_stop, redirect_output, shutdown
from slipcache.errors import RunLockedError, SlipcacheError
from slipcache.model import DLRM
from slipcache.training import runlock
from slipcache.training.backend import RunBackend
from slipcache.training.run_state import TrainingCheckpoint
from slipcache.training.runlock import RunLock
from slipcache.training.step_checkpoint import MANIFEST, RESHARDED, read_trainer_state

if TYPE_CHECKING:
    from slipcache.data.formats import Dataset
    from slipcache.embedding.tables import EmbeddingTables

logger = logging.getLogger(__name__)

# Settings that may differ by rank: who shows progress, where each node reads its data (the fingerprint
# says whether it is the same), and the run id each rank drew before rank 0's was agreed on.
_PER_RANK_SETTINGS = ("progress", "tensorboard", "data", "dataset", "run_id")


def unsupported(config: Any) -> str | None:
    """What the sharded trainer does not do, as the one line that refuses it; None if all is supported.

    Every skip rule, `--prefetch` and the lookahead policies run on every rank alike: the ranks read whole
    batches, decide on the global batch and its gathered logits, read hot rows from every rank's shards at
    once, and show each shard the rows of the upcoming batches it holds."""
    embeddings = config.embeddings.embeddings
    if embeddings != "cached":
        return (f"--embeddings {embeddings} is sharded only as slipcache's cached tables (--embeddings cached) "
                "with more than one process")
    return None


class DistributedBackend(RunBackend):
    """One rank of N under DistributedModelParallel (module doc)."""

    def __init__(self, ctx: DistributedContext) -> None:
        self.ctx = ctx
        self.model: Any = None  # the ShardedDLRM, once built
        self.resume_from: tuple[Path, dict[str, Any]] | None = None  # (step directory, manifest) to load

    @property
    def is_main(self) -> bool:
        return self.ctx.rank == 0

    @property
    def writes_files(self) -> bool:
        return self.is_main

    @property
    def stops_alone(self) -> bool:
        """A rank cannot stop on its own (the others would wait in a collective)."""
        return False

    def batch_part(self) -> tuple[int, int]:
        """(rank, world size): each rank reads its slice of every global batch."""
        return self.ctx.rank, self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    # ------------------------------------------------------------------------------------- set-up
    def check_config(self, config: Any) -> None:
        """Refuse what does not work across processes yet, with the same one-line error on every rank."""
        line = unsupported(config)
        if line is not None:
            raise SlipcacheError(line)
        world, batch = self.ctx.world_size, config.schedule.batch_size
        if batch % world:
            raise SlipcacheError(
                f"--batch-size {batch} does not split evenly over {world} processes (TorchRec's row-wise shards "
                f"need equal slices): give a multiple of {world}"
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

    def build_model(self, config: Any, dataset: Dataset, run_dir: Path, *, draw_rows: bool = True) -> Any:
        """The run's DLRM with its tables sharded by TorchRec's planner over the ranks, each shard weighted
        by the lookups a profile of the training split puts in its rows (`plan_lookups`). A new run's shards
        take the rows one process would draw (so N processes start where one does), streamed so that a rank
        holds only its own shards; a resumed one draws none (its rows come from the checkpoint)."""
        from slipcache.distributed.model import KeyedTables, bag_configs, plan_lookups, plan_tables, shard_model
        from slipcache.interop.torchrec import KeyedCachedEmbeddingBagCollection

        table_sizes, num_dense = list(dataset.table_sizes), dataset.num_dense

        self.check_config(config)  # the resolved settings (a resumed run's come from its checkpoint)
        options = config.embedding_options()
        dim = options.pop("dim", config.model.embedding_dim)
        # Every rank has checked the run directory by now; from here on the others write their logs in it.
        dist.barrier()
        if not self.is_main:
            redirect_output(run_dir, self.ctx.rank)
        tables = KeyedCachedEmbeddingBagCollection(bag_configs(table_sizes, dim), device="meta",
                                                   draw_like_one_process=draw_rows, **options)
        keyed = cast("EmbeddingTables", KeyedTables(tables, table_sizes, dim))  # DLRM's collection interface
        dlrm = DLRM(config.model_config(table_sizes, num_dense), keyed)
        # rank 0 plans for all (`collective_plan`): only it profiles the data, and says on every rank why not
        lookups, refusal = None, None
        if self.is_main:
            try:
                lookups = plan_lookups(dataset, tables, config.model.seed)
            except SlipcacheError as exc:
                refusal = str(exc)
        refusal = self.agree(refusal)
        if refusal is not None:
            raise SlipcacheError(refusal)
        plan, sharder = plan_tables(dlrm, self.ctx.world_size, config.schedule.batch_size, self.ctx.device,
                                    wire_precision=config.embeddings.wire_precision, lookups=lookups)
        self.require_node_fits(config, tables, plan, table_sizes, num_dense, staged=draw_rows)
        self.model = shard_model(dlrm, plan, sharder, self.ctx.rank, self.ctx.world_size, self.ctx.device)
        if self.is_main:
            logger.info(_plan_line(self.model))
        return self.model

    def require_node_fits(self, config: Any, tables: Any, plan: Any, table_sizes: list[int], num_dense: int, *,
                          staged: bool) -> None:
        """Stop with one line, on every rank, unless what this node's ranks allocate next fits its memory:
        the shards the plan gives them (and, for a new run, the fp32 rows they stream in) and each rank's
        dense layers; with --storage-path, their shards' rows go to files there instead, which must fit its
        disk. torchrun numbers a node's ranks consecutively, so they are known without a collective; the
        ranks then share their verdicts, so that every rank stops if any node is short."""
        from slipcache.distributed.model import shard_bytes_of_ranks
        from slipcache.memory import GB, MemoryShortError, limiting_memory, model_bytes, storage_room_refusal
        from slipcache.model import DENSE_PART

        per_node = self.ctx.local_world_size
        first = self.ctx.rank - self.ctx.local_rank
        ranks = range(first, first + per_node)
        shards, in_files = shard_bytes_of_ranks(tables, plan, ranks, staged=staged)
        dense = per_node * model_bytes(config.model_config(table_sizes, num_dense), config.schedule.batch_size,
                                       config.model.dense_optimizer)
        refusals: list[str | None] = [None] * self.ctx.world_size  # every node's verdict, so all ranks stop
        refusal = node_memory_refusal(shards, dense, ranks, limiting_memory(), staged=staged)
        storage_path = config.embeddings.storage_path
        if refusal is None and storage_path is not None and self.ctx.local_rank == 0:  # one rank a node asks
            refusal = storage_room_refusal(Path(storage_path), in_files, _who(ranks))
        dist.all_gather_object(refusals, refusal)
        refusal = next((line for line in refusals if line is not None), None)
        if refusal is not None:
            raise MemoryShortError(refusal)
        logger.debug("ranks %d-%d: shards %.2f GB (and %.2f GB in files), %s %.2f GB", ranks[0], ranks[-1],
                     shards / GB, in_files / GB, DENSE_PART, dense / GB)

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, run_dir: Path, state: dict[str, Any], samples: int, keep: int) -> int | None:
        """A DCP of every rank's shards beside rank 0's trainer state (`checkpoint.save_step`)."""
        assert self.model is not None
        tables = self.model.embeddings  # `state` holds no tables (`ShardedTables.state_dict`): DCP saves them
        return dckpt.save_step(
            run_dir, samples, self.ctx.rank, self.ctx.world_size, state, dckpt.dcp_state(tables),
            dckpt.sharding_plan_record(tables.sharded), keep=keep,
        )

    def read_resume_checkpoint(self, path: Path, home: Path | None) -> TrainingCheckpoint:
        """The trainer state to resume from, its tables loaded by DCP once the model is built: exactly with
        the world size and plan that wrote it, re-sharded on another (rank 0 says so)."""
        path = Path(path)  # the newest complete checkpoint, or the one --resume names (`find_checkpoint`)
        if not (path / MANIFEST).is_file():
            if path.is_file():
                raise SlipcacheError(
                    f"{path} was written by one process; resume it on one process (without torchrun), or start "
                    "the run again on N"
                )
            raise SlipcacheError(
                f"no complete checkpoint (with its {MANIFEST}) under {home or path}; "
                "start the run again with its --out"
            )
        manifest, state = read_trainer_state(path)
        line = None
        if manifest["world_size"] != self.ctx.world_size:
            line = (f"re-sharding {path}, written by {manifest['world_size']} processes, over "
                    f"{self.ctx.world_size}: {RESHARDED}")
            if self.is_main:
                logger.info(line)

        def load(tables: Any) -> None:
            dckpt.load_into_shards(path, manifest, tables, self.ctx.rank, self.ctx.world_size)

        return TrainingCheckpoint(path, state, load_tables=load, resharding=line)

    # ------------------------------------------------------------------------------------- summary
    def summary(self, model: Any) -> dict[str, Any]:
        """Launch facts and the plan: each table's sharding type and ranks."""
        return {
            "world_size": self.ctx.world_size,
            "backend": self.ctx.backend,
            "threads_per_rank": self.ctx.threads,
            "plan": _plan_of(model),
        }


def _plan_of(model: Any) -> dict[str, Any]:
    """{table: {"sharding": type, "ranks": [...]}} from TorchRec's plan."""
    plan = getattr(model, "plan", None)
    found: dict[str, Any] = {}
    for module_plan in (plan.plan.values() if plan is not None else []):
        for table, sharding in module_plan.items():
            found[table] = {"sharding": sharding.sharding_type, "ranks": list(sharding.ranks or [])}
    return found


def node_memory_refusal(shards: int, dense: int, ranks: range, limit: tuple[int, str] | None, *,
                        staged: bool) -> str | None:
    """The line that refuses a node whose ranks' `shards` and `dense` bytes (with the runtime of each) exceed
    `limit` (bytes, what it is); None when they fit or no limit is known."""
    from slipcache.memory import GB, RUNTIME_BYTES
    from slipcache.model import DENSE_PART

    if limit is None:
        return None
    available, source = limit
    runtime = len(ranks) * RUNTIME_BYTES
    if shards + dense + runtime <= available:
        return None
    who = _who(ranks)
    staging = " (with the fp32 rows a new run streams in)" if staged else ""
    return (f"{who}: their shards of the tables{staging} need {shards / GB:.1f} GB + {DENSE_PART} "
            f"{dense / GB:.1f} GB + {runtime / GB:.1f} GB runtime, and {source} is {available / GB:.1f} GB; "
            "spread the ranks over more machines, or store the tables at a lower precision or with a "
            "smaller cache")


def _who(ranks: range) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]} on this machine"


def _plan_line(model: Any) -> str:
    groups: dict[str, list[str]] = {}
    for table, entry in _plan_of(model).items():
        groups.setdefault(f"{entry['sharding']} on ranks {entry['ranks']}", []).append(table)
    parts = [f"{', '.join(tables)} {how}" for how, tables in groups.items()]
    return "sharding plan (TorchRec's planner): " + "; ".join(parts)


TORCHREC_INSTALL = "pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 && pip install -e '.[torchrec]'"


def require_torchrec() -> None:
    """Many processes train under TorchRec's DistributedModelParallel: without torchrec, one line saying how
    to install it (the same on every rank, before any collective)."""
    import importlib.util

    if importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None:
        raise SlipcacheError(
            "training on more than one process needs torchrec and FBGEMM's CPU build (the torchrec extra): "
            f"{TORCHREC_INSTALL}, or run on one process"
        )


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
        require_torchrec()
        # The flags as given first (a rank with other flags fails here, before anything it would do apart
        # from the others); the resolved settings and the data's fingerprint when the run starts.
        run.check_same_settings(config.flat(), ignore=("out", "resume"))
        if config.run.resume is None:  # a resumed run's settings are its checkpoint's: checked once they are read
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
        run.model = None  # the sharded model holds the group
        shutdown()
