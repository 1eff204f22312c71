"""The DLRM training loop (`train`) and evaluation; `slipcache train` / `eval` are in `training/cli.py`.

Read top to bottom: the schedule, then the loop (`train`) and its steps in the order they run. The loop
holds a `Loop`: the `Run` (what the run is made of, and its `Progress`), its callbacks, and the clock,
progress bar and cache counts around them. Callbacks see only the `Run`. A run writes its directory:

    <out>/config.json      the resolved config
    <out>/metrics.jsonl    one JSON object per logging or evaluation event
    <out>/summary.json     final test metrics, throughput, memory
    <out>/report.md        plots of the above (see slipcache.training.report)
    <out>/checkpoints/     latest.pt plus the newest periodic checkpoints (atomic, checksummed writes)

Around the loop: `config.py` (TrainConfig), `datasets.py` (where the data comes from; raw Criteo input is
preprocessed once into the cache), `rundir.py` (which `--out` and `--resume` are allowed), `snapshot.py`
(what a checkpoint holds of the run). Nothing is written outside `<out>` and the cache.

Determinism: everything random is seeded from `config.model.seed`, and a checkpoint holds all state the loop reads,
so an interrupted run resumed with `--resume` ends exactly where the uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from slipcache.data.batches import Batch, BatchIterator
from slipcache.data.formats import Dataset
from slipcache.errors import SlipcacheError
from slipcache.iostats import AnonPeak
from slipcache.memory import peak_rss_bytes
from slipcache.model import DLRM
from slipcache.options import torch_threads
from slipcache.progress import ProgressBar, progress_bar
from slipcache.safe_files import refuse_link
from slipcache.training import checkpoint as ckpt
from slipcache.training import run as runs
from slipcache.training.backend import LocalBackend, RunBackend, dense_optimizer, embedding_optimizer
from slipcache.training.callbacks import Callbacks
from slipcache.training.config import TrainConfig, cache_rows_note
from slipcache.training.datasets import (
    check_table_sizes,
    data_quality,
    malformed_message,
    open_dataset,
    prepare_data,
    resolve_data,
    run_dataset_dir,
    training_batches,
)
from slipcache.training.evaluation import evaluate
from slipcache.training.features import CallbackFactory, run_callbacks
from slipcache.training.loop_state import Progress
from slipcache.training.parts import CHECKPOINTS_PER_RUN, EVALS_PER_RUN, LOGS_PER_RUN
from slipcache.training.run import Run, TrainingClock
from slipcache.training.run_state import TrainingCheckpoint
from slipcache.training.rundir import load_resume, new_run_dir, prepare_out_dir, remove_empty_dirs, run_record, warn
from slipcache.training.schedule import budget_steps, nearest_quotient
from slipcache.training.settings import change_lines
from slipcache.training.snapshot import TrainingState
from slipcache.training.tensorboard import check_available as check_tensorboard
from slipcache.training.tensorboard import embedding_event_fields, resolve_setting
from slipcache.units import amount

if TYPE_CHECKING:
    from slipcache.training.runlock import RunLock

logger = logging.getLogger(__name__)

# bench/train.py and benchmarks/runner.py read these as trainer.<name>: one seam for a fake trainer in the tests.
__all__ = ["TrainConfig", "evaluate", "open_dataset", "prepare_data", "resolve_schedule", "train"]

# ----------------------------------------------------------------------------------------------------
# Schedule


def resolve_schedule(config: TrainConfig, train_rows: int) -> TrainConfig:
    """Fill derived counts: the sample budget, and log/checkpoint intervals in whole batches."""
    batch = config.schedule.batch_size
    batches_per_epoch = train_rows // batch
    if batches_per_epoch == 0:
        raise SlipcacheError(f"the training split has {train_rows} rows, fewer than one batch of {batch}")
    schedule = config.schedule
    samples = schedule.samples if schedule.samples is not None else schedule.epochs * batches_per_epoch * batch

    def every(value: int | None, parts: int) -> int:  # integer arithmetic: exact up to 2**63 samples
        exact = nearest_quotient(value, batch) if value is not None else nearest_quotient(samples, parts * batch)
        return max(1, exact) * batch

    return config.replaced(
        samples=samples,
        log_every=every(config.schedule.log_every, LOGS_PER_RUN),
        # Evaluation follows the data consumed (trained + skipped), so runs with and without skipping
        # evaluate at the same positions; a given interval stays exact (see `_crossed`).
        eval_every=config.schedule.eval_every if config.schedule.eval_every is not None else every(None, EVALS_PER_RUN),
        checkpoint_every=every(config.schedule.checkpoint_every, CHECKPOINTS_PER_RUN),
    )


def _stats_totals(model: DLRM) -> tuple[int, int]:
    """Cumulative (lookups, hits); lookups count as 0 for a collection without a cache (hit_rate None)."""
    stats = model.embeddings.stats()
    if stats.get("hit_rate") is None and not stats.get("hits"):
        return 0, 0
    return int(stats.get("lookups") or 0), int(stats.get("hits") or 0)


class CacheWindow:
    """The cache's lookups and hits of the open logging window, from the collection's cumulative counters
    (which may or may not come back with a resumed collection's state: counted relative to what they say)."""

    def __init__(self, model: DLRM, open_lookups: int = 0, open_hits: int = 0) -> None:
        self.model = model
        self.lookups, self.hits = _stats_totals(model)
        self.lookups -= open_lookups  # a resumed window's counts so far
        self.hits -= open_hits

    def sync(self, progress: Progress) -> None:
        lookups, hits = _stats_totals(self.model)
        progress.window_lookups = lookups - self.lookups
        progress.window_hits = hits - self.hits

    def reset(self) -> None:
        """A new window (evaluation lookups do not count)."""
        self.lookups, self.hits = _stats_totals(self.model)


@dataclass
class Loop:
    """What the loop holds while it runs: the run, its callbacks, and the bookkeeping around them."""

    run: Run
    callbacks: Callbacks
    bar: ProgressBar
    cache: CacheWindow
    clock: TrainingClock
    lock: RunLock | None  # run.lock of the run directory (rank 0 of N holds it), released at the end
    anon_peak: AnonPeak | None  # the peak of the process's own (anonymous) memory
    last_checkpoint: dict[str, Any] | None = None  # bytes and write time of the newest checkpoint written

    @property
    def state(self) -> TrainingState:
        """What a checkpoint saves of the run, and puts back."""
        return TrainingState(self.run, self.callbacks)


# ----------------------------------------------------------------------------------------------------
# Training: the loop first, then its steps in the order they run.


def train(
    config: TrainConfig, backend: RunBackend | None = None, *, extra_callbacks: Sequence[CallbackFactory] = ()
) -> dict[str, Any]:
    """Train DLRM as configured, writing the run directory; returns the summary dict.

    `backend`: where the run executes (default: this process alone; `distributed.training` passes one
    rank of N). `extra_callbacks`: features outside the product (a study's research arm, `benchmarks/`),
    each built from the run and the epoch's hot inputs; a resume must pass them again. Features join the
    loop as callbacks (`callbacks.py`, chosen in `features.py`); what must survive a resume is the
    `Progress` and the callbacks' own `state_dict`s (`snapshot.TrainingState`). Training time
    (`progress.train_wall_s`) runs from the clock's restart to the end of `record_step`; evaluation and
    checkpoints fall outside it.
    """
    anon_peak = AnonPeak().start()  # from before the tables are built
    try:
        with contextlib.ExitStack() as settings:  # the run's threads and huge pages: the caller's come back after
            return run_loop(config, backend, settings, anon_peak, extra_callbacks)
    finally:
        anon_peak.stop()


def run_loop(
    config: TrainConfig, backend: RunBackend | None, settings: contextlib.ExitStack, anon_peak: AnonPeak | None = None,
    extra_callbacks: Sequence[CallbackFactory] = (),
) -> dict[str, Any]:
    """`train`'s loop; `settings` holds the process settings the run applies until `train` returns."""
    loop = start_run(config, backend or LocalBackend(), settings, extra_callbacks, anon_peak)
    run, callbacks = loop.run, loop.callbacks
    schedule = run.schedule
    try:
        while run.more_epochs():
            batches = epoch_batches(loop)
            for batch in batches:
                loop.clock.mark_started()
                loss, logits = train_step(loop, batch, batches)
                consumed_before = run.consumed
                last = record_step(loop, batch, loss, logits, batches)
                eval_due = _crossed(consumed_before, run.consumed, schedule.eval_every) or last
                if run.progress.samples % schedule.log_every == 0 or eval_due:
                    log_event(loop, evaluate_now=eval_due)
                every = run.progress.samples % schedule.checkpoint_every == 0
                if (callbacks.checkpoint_due(run) or every) and not last:  # due: time, or a signal
                    save_checkpoint(loop)
                if last:
                    # A filtered (skipping) run's last epoch can end with trained + skipped just under the
                    # budget (the tail that fills no batch is dropped); it must not restart the epoch.
                    run.progress.finished = True
                    break
                loop.clock.restart()  # eval and checkpoints excluded
            else:  # the iterator ran out: next epoch (a sample filter may have made this one shorter)
                end_epoch(loop)
        if not _checkpointed_here(loop):  # resumed from its final checkpoint (killed before the end): not twice
            save_checkpoint(loop)
        return finish_run(loop)
    finally:
        loop.bar.close()
        callbacks.close(run)
        if loop.lock is not None:
            loop.lock.release()


def _checkpointed_here(loop: Loop) -> bool:
    """Whether the newest event is the checkpoint of where the run stands (it resumed from that one);
    then the summary reports that checkpoint."""
    events = loop.run.progress.events
    last = events[-1] if events else {}
    if last.get("event") != "checkpoint" or last.get("samples") != loop.run.progress.samples:
        return False
    loop.last_checkpoint = {k: last.get(k) for k in ("samples", "bytes", "write_s")}
    return True


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (before, after]: a schedule in samples that batches step over."""
    return after // every > before // every


def start_run(
    config: TrainConfig, backend: RunBackend, settings: contextlib.ExitStack,
    extra_callbacks: Sequence[CallbackFactory] = (), anon_peak: AnonPeak | None = None,
) -> Loop:
    """A new run, or an interrupted one restored from its checkpoint (`config.run.resume`); `settings` takes
    this process's threads and huge pages for the run, put back when it closes."""
    if backend.writes_files:  # the extra is missing: refused before any directory or data is made
        check_tensorboard(config.schedule.tensorboard)
    checkpoint: TrainingCheckpoint | None = None
    saved: dict[str, Any] = {}
    changes: dict[str, list[Any]] = {}
    new_dirs: list[Path] = []  # what this call creates: taken away again, where still empty, if the start fails
    if config.run.resume is not None:
        # the run's threads, unless given
        checkpoint, saved, config, changes = load_resume(config, backend.read_resume_checkpoint)
        run_dir = Path(config.run.out or "")
        if backend.writes_files:  # a run that had --tensorboard keeps it: refused before the model is built
            check_tensorboard(config.schedule.tensorboard)
    else:
        out = (Path(config.run.out) if config.run.out else new_run_dir()).expanduser().resolve()
        new_dirs = [p for p in (out, *out.parents) if not p.exists()]
        run_dir = prepare_out_dir(out, restart_ok=True)
    lock = None
    try:
        settings.enter_context(torch_threads(config.process.threads))  # torch's and the compiled loops' threads
        # The run's own copy from here on (the caller's config stays as given), its paths absolute, so the run
        # can be resumed, evaluated and exported from anywhere.
        config = config.replaced(**({} if config.data.data is None else {"data": str(resolve_data(config.data.data))}))
        if config.embeddings.storage_path:
            config.embeddings.storage_path = str(Path(config.embeddings.storage_path).expanduser().absolute())

        dataset_dir = run_dataset_dir(config, saved.get("dataset"))
        dataset = open_dataset(dataset_dir, config)
        if config.run.resume is None and (note := cache_rows_note(config, list(dataset.table_sizes))):  # said once
            warn(note)
        config.data.split_order = config.data.split_order or dataset.meta.get("split_order")
        config = resolve_schedule(config, dataset.splits["train"])
        config.run.out = str(run_dir)
        config.schedule.tensorboard = resolve_setting(config.schedule.tensorboard, run_dir)
        state = checkpoint.state if checkpoint is not None else None
        config_dict = run_record(config, dataset, dataset_dir, saved, changes, state)
        lock = backend.claim_run_dir(run_dir, config_dict)  # one writer per run directory from here on
        if changes and backend.writes_files:  # --allow-changes: each change said once, where it takes effect
            for line in change_lines(config_dict["changed_on_resume"][-1]):
                logger.info(f"slipcache train: resuming with {line} (--allow-changes)")
        return _build_run(config, config_dict, run_dir, dataset, checkpoint, changes, backend, extra_callbacks,
                          lock, anon_peak)
    except BaseException:
        if lock is not None:
            lock.release()
        remove_empty_dirs(new_dirs)
        raise


def _build_run(
    config: TrainConfig,
    config_dict: dict[str, Any],
    run_dir: Path,
    dataset: Dataset,
    checkpoint: TrainingCheckpoint | None,
    changes: dict[str, list[Any]],
    backend: RunBackend,
    extra_callbacks: Sequence[CallbackFactory],
    lock: RunLock | None,
    anon_peak: AnonPeak | None,
) -> Loop:
    """The model, optimizers, callbacks and state of a run whose directory this process holds (`lock`)."""
    dataset_dir = Path(config_dict["dataset"])
    quality = data_quality(dataset)
    if quality is not None and quality["malformed_lines"]:
        warn(malformed_message(quality, config.data.data))

    # Model and optimizers. Seeding first makes the MLP init (torch's global RNG) reproducible.
    random.seed(config.model.seed)
    np.random.seed(config.model.seed)
    torch.manual_seed(config.model.seed)
    # A resumed run loads every row from its checkpoint: none are drawn (minutes at the MLPerf sizes).
    model = backend.build_model(config, dataset, run_dir, draw_rows=checkpoint is None)
    dense_opt = dense_optimizer(config, model)
    # The budget counts inputs trained or skipped, so a skipping run covers the same data; it ends after
    # as many epochs as the run without skipping, even though its epochs have fewer batches.
    batches_per_epoch = dataset.splits["train"] // config.schedule.batch_size
    schedule = runs.schedule_of(config)
    total_steps = budget_steps(schedule.samples, config.schedule.batch_size)
    run = Run(
        config=config,
        schedule=schedule,
        config_dict=config_dict,
        run_dir=run_dir,
        dataset=dataset,
        model=model,
        dense_opt=dense_opt,
        emb_opt=embedding_optimizer(config, model),
        backend=backend,
        budget=total_steps * config.schedule.batch_size,
        max_epochs=-(-total_steps // batches_per_epoch),
        batches_per_epoch=batches_per_epoch,
        data_quality=quality,
        changed=frozenset(changes),
    )
    callbacks = run_callbacks(run, extra_callbacks)
    if checkpoint is not None:
        check_table_sizes(checkpoint.state["table_sizes"], dataset.table_sizes, f"dataset {dataset_dir}")
        TrainingState(run, callbacks).load_state_dict(checkpoint)  # then config.json's settings over it
    if backend.writes_files:  # the checkpoint is restored: from here on the run changes its directory
        refuse_link(run_dir / "checkpoints")  # everything written into it would land elsewhere
        for directory in (run_dir, run_dir / "checkpoints"):  # left by a process killed while writing
            ckpt.remove_partial_writes(directory)
        if run.backend.stops_alone:
            check_checkpoint_room(run, callbacks)
    callbacks.on_start(run)
    bar = progress_bar(  # off a terminal: a plain line every 30 s
        total=run.budget,
        initial=run.progress.samples,
        desc="train",
        unit=" samples",
        unit_scale=True,
        disable=not config.schedule.progress,
        dynamic_ncols=True,
    )
    cache = CacheWindow(model, run.progress.window_lookups, run.progress.window_hits)
    return Loop(run, callbacks, bar, cache, TrainingClock(), lock, anon_peak)


def epoch_batches(loop: Loop) -> BatchIterator:
    """The current epoch's training batches from where the run stands; starts the training clock."""
    run, callbacks = loop.run, loop.callbacks
    loop.clock.restart()  # wall time includes reading and filtering batches, not eval or checkpoints
    callbacks.start_epoch(run)
    return training_batches(
        run.dataset,
        run.config.schedule.batch_size,
        seed=run.config.model.seed,
        epoch=run.progress.epoch,
        start_batch=run.progress.batch_in_epoch,
        sample_filter=callbacks.sample_filter(run),
        groups=callbacks.input_groups(run),  # an order of the features (the cold-first order)
        time_order=run.config.data.time_order,
        part=None if callbacks.reads_batch_ids else run.backend.batch_part(),
    )


def train_step(loop: Loop, batch: Batch, batches: BatchIterator | None = None) -> tuple[float, torch.Tensor]:
    """Forward, backward and optimizer steps on one batch; returns its mean loss and (detached) logits.

    `batches` (the iterator `batch` came from) lets the callbacks see the batches that follow, after the
    sample filter: those that will be trained.
    """
    run, callbacks = loop.run, loop.callbacks
    t0 = time.perf_counter()
    if batches is not None:
        callbacks.before_step(run, batches)
    logits = batch.logits(run.model)
    weights = callbacks.loss_weights(run, batch.labels.shape[0])
    loss = F.binary_cross_entropy_with_logits(logits, batch.labels, weight=weights)
    loss_value = loss.item()
    if not math.isfinite(loss_value):
        # Stop before backward: a fused embedding update would write the bad gradient into storage.
        raise _non_finite_loss(run, loss_value)
    run.dense_opt.zero_grad(set_to_none=True)
    if run.emb_opt is not None:
        run.emb_opt.zero_grad(set_to_none=True)
    loss.backward()  # with fused_update, this also updates the embedding rows
    run.dense_opt.step()
    if run.emb_opt is not None:
        run.emb_opt.step()
    run.progress.compute_s += time.perf_counter() - t0
    return loss_value, logits.detach()


def _non_finite_loss(run: Run, loss_value: float) -> SlipcacheError:
    p = run.progress
    latest = run.run_dir / "checkpoints" / ckpt.LATEST
    where = f"last good checkpoint: {latest}" if latest.exists() else "no checkpoint was written yet"
    return SlipcacheError(
        f"training loss is {loss_value} at sample {p.samples} (epoch {p.epoch}, "
        f"batch {p.batch_in_epoch}); stopped. Check the input data or lower --lr; {where}"
    )


def record_step(loop: Loop, batch: Batch, loss_value: float, logits: torch.Tensor, batches: BatchIterator) -> bool:
    """Per-batch bookkeeping after a step (callbacks, counters, clock); returns whether it was the last."""
    run = loop.run
    progress = run.progress
    loop.callbacks.after_step(run, batch, logits, loss_value)
    if (skipped := loop.callbacks.skipped_inputs()) is not None:  # counted by the part that skips them
        progress.skipped = skipped
    n = batch.labels.shape[0]
    # The budget is reached, or, in the last epoch, no batch follows (a filtered epoch has fewer batches).
    last = run.consumed + n >= run.budget or (progress.epoch == run.max_epochs - 1 and not batches.peek(1))
    elapsed = loop.clock.count(progress)
    progress.step += 1
    progress.samples += n
    progress.batch_in_epoch += 1
    progress.window_steps += 1
    progress.window_loss += loss_value * n
    progress.window_samples += n
    progress.window_wall_s += elapsed
    loop.bar.update(n)
    return last


def log_event(loop: Loop, *, evaluate_now: bool) -> None:
    """Close the logging window into a `metrics.jsonl` event, with validation metrics when `evaluate_now`."""
    run, callbacks = loop.run, loop.callbacks
    progress = run.progress
    loop.cache.sync(progress)
    event = progress.close_window(disk_counted=loop.clock.disk_counted)
    event.update(embedding_event_fields(run.model.embeddings, progress.samples, progress.skipped))
    event.update(callbacks.event_fields(run))
    loop.bar.set_postfix(_postfix(event), refresh=False)
    if evaluate_now:
        scores = evaluate(
            run.model, run.dataset.split("val"), max_samples=run.config.schedule.eval_samples,
            part=run.backend.batch_part()
        )
        event.update({f"val_{k}": v for k, v in scores.items()})
        callbacks.after_eval(run, scores)
    progress.events.append(event)
    callbacks.on_event(run, event)
    loop.cache.reset()  # evaluation lookups do not count


def _postfix(event: dict[str, Any]) -> dict[str, str]:
    postfix = {"loss": f"{event['train_loss']:.4f}"}
    if event["hit_rate"] is not None:
        postfix["hit"] = f"{100 * event['hit_rate']:.1f}%"
    return postfix


def check_checkpoint_room(run: Run, callbacks: Callbacks) -> None:
    """Say at the start what a full disk would otherwise say at a checkpoint hours in: a warning when the
    checkpoints the run keeps at once do not all fit, an error when not one does."""
    config = run.config
    each = ckpt.tensor_bytes(TrainingState(run, callbacks).state_dict())
    # The scheduled ones and the final one; timed ones (--checkpoint-minutes) depend on a speed not known yet.
    every, done = run.schedule.checkpoint_every, run.progress.samples
    writes = 0 if done >= run.budget else 1 + max(0, (run.budget - 1) // every - done // every)
    directory = run.run_dir / "checkpoints"
    at_once, fit, free = ckpt.checkpoints_that_fit(directory, each, writes, config.schedule.keep_checkpoints)
    if at_once <= fit:
        return
    have = f"{directory} has {amount(free)} free"
    if not fit:
        raise SlipcacheError(
            f"a checkpoint of this run takes about {amount(each)} and {have}: not one fits; free space, or give "
            "--out a directory on a disk with room"
        )
    fix = (
        f"give --keep-checkpoints {fit - 1}" if fit > 1 else
        f"give --checkpoint-every {run.budget} --checkpoint-minutes 0 (the final checkpoint alone)"
    )
    warn(
        f"checkpoints of this run take about {amount(each)} each and {at_once} new ones are on disk at once (the "
        f"newest is complete before the oldest of --keep-checkpoints {config.schedule.keep_checkpoints} goes), "
        f"but {have}, "
        f"room for {fit}: the run will stop at a checkpoint that does not fit; {fix}, or --out on a disk with room"
    )


def save_checkpoint(loop: Loop) -> None:
    """A checkpoint of the whole run (`TrainingState.state_dict`), written by the backend; the open
    window's cache counts travel with it."""
    run = loop.run
    loop.cache.sync(run.progress)
    start = time.perf_counter()
    # Its own metrics.jsonl event, in the events the checkpoint holds with size and time still unknown
    # (a run resumed from it fills the size in from the file: `fill_checkpoint_event`).
    event: dict[str, Any] = {"event": "checkpoint", "samples": run.progress.samples, "bytes": None, "write_s": None}
    run.progress.events.append(event)
    state = loop.state.state_dict()  # a copy of the events: this one stays open below
    event["bytes"] = run.backend.save_checkpoint(
        run.run_dir, state, run.progress.samples, keep=run.config.schedule.keep_checkpoints
    )
    event["write_s"] = time.perf_counter() - start
    loop.callbacks.on_event(run, event)
    loop.last_checkpoint = {k: event[k] for k in ("samples", "bytes", "write_s")}


def end_epoch(loop: Loop) -> None:
    """The epoch's batches ran out: count the time spent filtering its tail and move to the next epoch."""
    progress = loop.run.progress
    if progress.batch_in_epoch == 0:
        raise SlipcacheError(f"epoch {progress.epoch} produced no training batches")
    loop.clock.count(progress)
    progress.epoch += 1
    progress.batch_in_epoch = 0


def finish_run(loop: Loop) -> dict[str, Any]:
    """Test-set evaluation and the summary; the callbacks write it (summary.json, report.md, ...)."""
    run, clock = loop.run, loop.clock
    progress, model = run.progress, run.model
    test = evaluate(model, run.dataset.split("test"), part=run.backend.batch_part())
    memory = model.embeddings.memory_report()
    summary: dict[str, Any] = {
        "auc": test["auc"],
        "logloss": test["logloss"],
        "accuracy": test["accuracy"],
        "normalized_entropy": test["normalized_entropy"],
        "test_samples": test["samples"],
        "train_samples": progress.samples,
        "samples_per_s": progress.samples / progress.train_wall_s if progress.train_wall_s else None,
        "train_wall_s": progress.train_wall_s,  # wall clock of the loop: the figure speedups use
        "compute_s": progress.compute_s,
        "train_cpu_s": progress.train_cpu_s,
        "embedding_bytes": int(memory["total_bytes"]),
        "fp32_embedding_bytes": int(memory["fp32_bytes"]),
        "memory_ratio": float(memory["memory_ratio"]),
        "table_sizes": [int(n) for n in run.dataset.table_sizes],
        "startup_s": clock.startup_s,
        # The OS's peak resident set of this process so far: tables, data loading, evaluation, checkpoints.
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_anon_bytes": loop.anon_peak.peak() if loop.anon_peak is not None else None,
        # disk bytes of the training loop alone (the span of train_wall_s), and of the start-up before it
        "train_disk_read_bytes": progress.train_disk_read_bytes if clock.disk_counted else None,
        "train_disk_write_bytes": progress.train_disk_write_bytes if clock.disk_counted else None,
        "startup_disk_read_bytes": clock.startup_disk_read_bytes,
        "last_checkpoint": loop.last_checkpoint,  # samples, bytes and write time of the final checkpoint
        "memory_components": memory["components"],
        "memory_per_rank": memory.get("per_rank"),  # N processes: each rank's own report
        "embedding_stats": {k: v for k, v in model.embeddings.stats().items() if k != "per_table"},
        "cache_hit_rate": progress.train_hits / progress.train_lookups if progress.train_lookups else None,
        "data_quality": run.data_quality,
        # generated data: the best AUC a model can reach on this test split (slipcache.data.synthetic.ceiling)
        "ceiling": run.dataset.meta.get("ceiling"),
        "run_dir": str(run.run_dir),
        "config": run.config_dict,
        "distributed": run.backend.summary(model),
    }
    summary.update(loop.callbacks.summary_fields(run))
    loop.callbacks.on_finish(run, summary)
    return summary
