"""`CachedEmbeddingBagCollection`: many embedding tables in low precision behind one fp32 row cache.

All tables share one row space (global row = table offset + id), so a batch is served by a handful of
vectorized operations whatever the number of tables. A training step:

1. look the batch's rows up in the cache; hits are pinned for the step;
2. missing rows are read from storage (dequantized) into free or victim slots; victims are rounded
   back into storage first; rows that find no slot (more misses than evictable ways) are served
   straight from storage and updated there in fp32, then rounded back;
3. backward applies the optimizer update itself (SGD, Adagrad, row-wise Adagrad or Adam): cached rows in
   fp32 in the cache, the others in storage.

The collection wires parts that each own one thing: `RowStorage` the quantized rows (and its version),
`RowCache` the cached rows and their residency (and its version), `LookupInputs` the input boundary and
pooling, `StepPlanner` the step count, the plans in flight and their pins, `FusedOptimizer` the learning
rate, the optimizer state and the gradients pending until the end of backward, `Prefetcher` the lookahead
window and the background prefetch, `TrafficCounters` the counts, `RowWriter` the rounding stream of
write-backs. The configuration is in `config`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from slipcache._native import quantize
from slipcache.embedding.accounting import COUNTERS, PhaseClock, TrafficCounters, memory_report, row_bytes
from slipcache.embedding.cache import RowCache
from slipcache.embedding.config import FLOAT32_MAX, EmbeddingConfig
from slipcache.embedding.hostmem import StorageFile
from slipcache.embedding.inputs import LookupInputs, SparseFeatures
from slipcache.embedding.plan import StepPlanner, _FusedLookup
from slipcache.embedding.prefetch import Prefetcher, after_prefetch
from slipcache.embedding.quant import RowStorage, TableRowStorage
from slipcache.embedding.replicas import refuse_replicated_training
from slipcache.embedding.scratch import Scratch
from slipcache.embedding.tables import EmbeddingTables
from slipcache.embedding.update import FusedOptimizer
from slipcache.embedding.writeback import RowWriter
from slipcache.errors import InvalidInputError, SlipcacheError

__all__ = ["CachedEmbeddingBagCollection", "EmbeddingConfig", "SparseFeatures"]

_INIT_CHUNK_ROWS = 1 << 20
# Rows are drawn and rounded a chunk of about 1 MB of fp32 at a time: it stays in the core's cache between
# the draw and the rounding, and bounds what creation holds in fp32 whatever the table sizes.
_INIT_CHUNK_VALUES = 1 << 18
# A progress bar when creation rounds at least this many values (a few seconds).
PROGRESS_VALUES = 1 << 30


def initial_rows(table_sizes: list[int], dim: int, seed: int) -> Iterator[tuple[int, int, Tensor]]:
    """(table, its first row, fp32 values) chunk by chunk: DLRM's uniform(-1/sqrt(n), 1/sqrt(n)) per table from
    one generator seeded by `seed`. The one draw of initial rows: the collection writes every chunk, each rank
    of a sharded one keeps its shards' rows. The values tensor is reused: use it before the next chunk."""
    generator = torch.Generator().manual_seed(seed)  # not the write-back stream: a fresh one
    chunk_rows = _init_chunk_rows(dim)
    chunk = torch.empty(chunk_rows, dim)
    for table, size in enumerate(table_sizes):
        bound = 1.0 / math.sqrt(size)
        for first in range(0, size, chunk_rows):
            count = min(chunk_rows, size - first)
            values = chunk[:count]
            if quantize.uniform((count, dim), generator, out=values) is None:  # compiled: torch's values, faster
                values.uniform_(generator=generator)
            yield table, first, values.mul_(2).sub_(1).mul_(bound)


def _init_chunk_rows(dim: int) -> int:
    """Rows drawn at once at initialization (the draw is one generator stream: chunking changes nothing)."""
    return max(1, _INIT_CHUNK_VALUES // max(dim, 1))


class CachedEmbeddingBagCollection(EmbeddingTables):
    """Embedding bags over many tables: low-precision storage, an fp32 cache, a fused optimizer.

    forward(ids [B, T] or SparseFeatures) -> pooled [B, T, D]. In training mode with gradients enabled,
    backward updates the rows; otherwise lookups are read-only and leave the cache as it is.
    """

    # buffers (register_buffer), declared for the type checker
    table_offsets: Tensor
    _table_sizes: Tensor
    optimizer_state: Tensor
    counters: Tensor

    fused_update = True
    # True for one rank's shards inside slipcache's sharded collection: meant to differ by rank (replicas.py)
    sharded_by_slipcache = False
    # True when the caller lets each process of a multi-process job train its own copy (replicas.py)
    independent_replica = False

    def __init__(self, config: EmbeddingConfig, *, draw_rows: bool = True) -> None:
        """`draw_rows` False: every row is loaded right after (a checkpoint), so the initial draw (minutes
        at the MLPerf sizes) is skipped and the storage left as allocated until then."""
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.table_sizes = list(config.table_sizes)
        self.table_names = config.table_names or [f"table {t}" for t in range(len(self.table_sizes))]
        meta = torch.device(config.storage_device).type == "meta"
        self.storage_device = torch.device(config.storage_device)
        self.device = torch.device(config.cache_device)
        sizes = torch.tensor(self.table_sizes, dtype=torch.int64)
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        self.register_buffer("table_offsets", offsets.to(self.device), persistent=False)
        self.register_buffer("_table_sizes", sizes.to(self.device), persistent=False)
        num_rows = config.num_rows
        precisions = config.precisions
        self.storage: RowStorage | TableRowStorage = (
            RowStorage(
                num_rows, config.dim, precisions[0], self.storage_device, empty=not meta, path=config.storage_path,
                huge_pages=config.huge_pages,
            )
            if len(set(precisions)) == 1
            else TableRowStorage(
                self.table_sizes, config.dim, precisions, self.storage_device, empty=not meta, path=config.storage_path,
                huge_pages=config.huge_pages,
            )
        )
        per_table = config.cache_per_table
        self.cache = RowCache(
            config.cache_capacities if per_table else config.cache_capacity,
            config.dim,
            config.policy,
            self.table_sizes if per_table else num_rows,
            config.ways,
            config.lfu_halving_interval,
            self.device,
            config.huge_pages,
        )
        # The parts' tensors are registered here, under the names checkpoints know (`optimizer_state`,
        # `counters`); `_bind_parts` hands them over again whenever they are replaced (moves, loads).
        state = FusedOptimizer.new_state(config, self.storage_device)
        if state is not None:
            self.register_buffer("optimizer_state", state)
        self.register_buffer("counters", TrafficCounters.new(len(self.table_sizes), self.device))
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        self.frozen = False  # requires_grad_(False): training forwards read rows only
        self.clock = PhaseClock()
        self.scratch = Scratch(self.device)
        self.traffic = TrafficCounters(self.table_offsets, self.counters)
        generator = None if meta else torch.Generator(device=self.device).manual_seed(config.seed)
        self.writer = RowWriter(self.storage, self.traffic, config.rounding, generator)
        self.inputs = LookupInputs(
            self.table_sizes, self.table_names, config.dim, config.pooling, self.scratch, self.table_offsets,
            self._table_sizes,
        )
        order_free = config.rounding == "nearest" or all(p == "fp32" for p in precisions)
        self.planner = StepPlanner(
            self.cache, self.storage, self.writer, self.traffic, self.clock, self.scratch, config.dim, order_free
        )
        self.optimizer = FusedOptimizer(config, self.cache, self.storage, self.writer, self.traffic, self.clock, state)
        self.prefetcher = Prefetcher(
            self.inputs, self.planner, self.cache, self.storage, self.traffic, config.rounding, config.seed
        )
        if not meta:
            if draw_rows:
                self._initialize_rows()
            if self.storage_device.type == "cpu" and self.device.type == "cuda":
                self.storage.pin_memory_()

    def _bind_parts(self) -> None:
        """Hand the parts the tensors registered here, after a move or a load replaced them."""
        self.traffic.bind(self.table_offsets, self.counters)
        self.inputs.bind(self.table_offsets, self._table_sizes)
        self.optimizer.state = getattr(self, "optimizer_state", None)

    # ----------------------------------------------------------------------------- state of the parts
    @property
    def lr(self) -> float:
        """The fused optimizer's learning rate (schedules set it)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= FLOAT32_MAX:
            raise InvalidInputError(f"lr must be a number >= 0 within fp32's range, got {value!r}")
        self.optimizer.lr = float(value)

    def set_optimizer(self, **settings: Any) -> None:
        """Set the fused optimizer's settings (`optimizer`, `lr`, `eps`, `weight_decay`, `beta1`, `beta2`), as
        TorchRec's `fused_params` and `apply_optimizer_in_backward` choose a table's optimizer. Another
        optimizer starts from a zero state, so it is refused once the tables have taken a step."""
        unknown = sorted(set(settings) - set(OPTIMIZER_SETTINGS))
        if unknown:
            raise InvalidInputError(f"set_optimizer takes {', '.join(OPTIMIZER_SETTINGS)}; got {', '.join(unknown)}")
        try:
            config = replace(self.config, **settings)  # checked as at creation
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(str(exc)) from exc
        switched = config.optimizer != self.config.optimizer
        lr = config.lr if "lr" in settings else self.optimizer.lr  # a schedule's current rate stays
        if switched:
            if self.optimizer.steps or self.step:
                raise InvalidInputError(
                    f"the tables have trained with {self.config.optimizer} ({self.optimizer.steps} updates); choose "
                    f"the optimizer ({config.optimizer}) before training"
                )
            self._buffers.pop("optimizer_state", None)
            state = FusedOptimizer.new_state(config, self.storage_device)
            if state is not None:
                self.register_buffer("optimizer_state", state)
        for name in OPTIMIZER_SETTINGS:
            setattr(self.config, name, getattr(config, name))  # the parts share this config
        if switched:  # before any step: nothing pending, no step counted
            previous = self.optimizer
            self.optimizer = FusedOptimizer(
                self.config, self.cache, self.storage, self.writer, self.traffic, self.clock,
                getattr(self, "optimizer_state", None),
            )  # fmt: skip
            self.optimizer.grad_scaler = previous.grad_scaler
        self.optimizer.lr = lr

    def requires_grad_(self, requires_grad: bool = True) -> CachedEmbeddingBagCollection:
        """`requires_grad_(False)` freezes the tables: training forwards then read rows as evaluation does
        (no update, the cache left as it is); `requires_grad_(True)` trains them again.

        The rows are not parameters (the update runs inside backward), so a freeze of a module that holds
        this collection does not reach it: `nn.Module.requires_grad_` sets only parameters. Call it here.
        """
        super().requires_grad_(requires_grad)
        self.frozen = not requires_grad
        return self

    @property
    def step(self) -> int:
        """Training forwards run so far."""
        return self.planner.step

    @step.setter
    def step(self, value: int) -> None:
        self.planner.step = value

    @property
    def skipped_updates(self) -> int:
        """Backward passes whose gradient held inf or NaN (their update was dropped)."""
        return self.optimizer.skipped_updates

    @property
    def grad_scaler(self) -> Any:
        """With mixed precision, the torch.amp.GradScaler that scales the loss: the fused update divides by
        its current scale (and, like scaler.step, skips a step whose gradient is not finite)."""
        return self.optimizer.grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: Any) -> None:
        self.optimizer.grad_scaler = scaler

    @property
    def prefetched_rows(self) -> int:
        return self.prefetcher.prefetched_rows

    # ------------------------------------------------------------------------------ device and dtype
    @after_prefetch
    def _apply(self, fn: Any, recurse: bool = True) -> CachedEmbeddingBagCollection:
        """`.to(device)`, `.cuda()`, `.cpu()` move every tensor the module holds; dtype changes are refused.

        The storage precision is part of the configuration (`precision`) and the cache, optimizer state and
        quantization parameters have fixed dtypes the update relies on: `.half()`, `.double()`, `.float()`
        or `.to(dtype)` that would convert one of them raise instead of silently retyping buffers.
        """
        for dtype in {b.dtype for b in self.buffers() if b.is_floating_point()}:
            converted = fn(torch.zeros(1, dtype=dtype))
            if converted.dtype != dtype:
                raise SlipcacheError(
                    f"CachedEmbeddingBagCollection keeps its dtypes (storage precision {self.config.precision!r}, "
                    f"fp32 cache): converting {dtype} buffers to {converted.dtype} is refused; choose the storage "
                    "precision with EmbeddingConfig(precision=...) and convert only the dense layers"
                )
        super()._apply(fn, recurse)  # the cache's and the storage's versions change with their move
        self._follow_buffers()
        return self

    def _follow_buffers(self) -> None:
        """After the buffers moved: devices, the parts, the gradient anchor and the generators follow them."""
        self.device, self.storage_device = self.counters.device, next(self.storage.buffers()).device
        self.config.cache_device, self.config.storage_device = str(self.device), str(self.storage_device)
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        self._bind_parts()
        self.writer.follow(self.device)
        self.prefetcher.follow(self.device)
        self.scratch.follow(self.device)
        self.planner.forget()  # plans hold tensors on the old device
        self.optimizer.forget()

    # ----------------------------------------------------------------------------------------- set-up
    def _initialize_rows(self) -> None:
        """DLRM's uniform(-1/sqrt(n), 1/sqrt(n)) per table, drawn in fp32 and rounded to nearest into storage.

        The draw depends on the seed and the table shapes only, never on the precision: a seed's INT8, INT4
        or FP16 run starts from the rounding of the very rows its FP32 run starts from, so paired runs
        measure precision alone. One reused chunk of about 1 MB of fp32 at a time: the compiled quantize
        pass rounds it while it is still in cache, and creation never holds more than that in fp32.
        """
        total = sum(self.table_sizes)
        offsets = self.table_offsets.tolist()
        with tqdm(
            total=total, unit="rows", unit_scale=True, desc="creating tables", leave=False,
            disable=total * self.dim < PROGRESS_VALUES or not sys.stderr.isatty(),
        ) as bar:
            for table, first, values in initial_rows(self.table_sizes, self.dim, self.config.seed):
                self.storage.write_range(offsets[table] + first, values.to(self.storage_device), "nearest", None)
                bar.update(values.shape[0])

    def storage_files(self) -> list[StorageFile]:
        """The mapped files that hold the rows (`storage_path`): a checkpoint's rows go into them with pwrite."""
        parts = self.storage.parts.values() if isinstance(self.storage, TableRowStorage) else [self.storage]
        return [file for file in (part.payload_file for part in parts) if file is not None]

    def _table_storage(self, table: int) -> tuple[RowStorage, int]:
        """The storage holding `table`, and the table's first row in it."""
        storage = self.storage
        if isinstance(storage, TableRowStorage):
            return storage.parts[self.config.precisions[table]], storage.table_start(table)
        return storage, int(self.table_offsets[table])

    def _int8_storage(self, table: int) -> tuple[RowStorage, int]:
        part, start = self._table_storage(table)
        if part.precision != "int8":
            raise SlipcacheError(f"table {self.table_names[table]!r} is not stored in INT8")
        return part, start

    @after_prefetch
    def stored_int8(self, table: int) -> tuple[Tensor, Tensor, Tensor]:
        """Copies of INT8 `table`'s codes [rows, dim], fp16 biases [rows] and scale codes [rows] as stored,
        the rows the cache holds rounded to nearest into them (what a flush to nearest would store): the
        bytes themselves, for a checkpoint that keeps them exactly."""
        part, start = self._int8_storage(table)
        rows = int(self.config.table_sizes[table])
        payload, bias, scale_code = (buffer[start : start + rows].clone() for buffer in part.buffers())
        slots, cached = self.cache.cached()
        first = int(self.table_offsets[table])
        mine = (cached >= first) & (cached < first + rows)
        if bool(mine.any()):
            encoded, _ = part.encode(self.cache.weights[slots[mine]].float(), "nearest", None)
            local = (cached[mine] - first).to(payload.device)
            for value, codes in zip((payload, bias, scale_code), encoded, strict=True):
                value[local] = codes.to(value.device)
        return payload, bias, scale_code

    @after_prefetch
    def load_int8(self, table: int, payload: Tensor, bias: Tensor, scale_code: Tensor) -> None:
        """INT8 `table`'s stored bytes (as `stored_int8` gives them) put back exactly, over what
        `load_tables` rounded: the cache holds none of its rows then (it was emptied by that load)."""
        part, start = self._int8_storage(table)
        rows = int(self.config.table_sizes[table])
        for name, buffer, value in zip(("payload", "bias", "scale_code"), part.buffers(), (payload, bias, scale_code),
                                       strict=True):
            mine = buffer[start : start + rows]
            if tuple(value.shape) != tuple(mine.shape) or value.dtype != mine.dtype:
                raise InvalidInputError(
                    f"table {self.table_names[table]!r}: saved INT8 {name} is {value.dtype} {list(value.shape)}, "
                    f"the table's is {mine.dtype} {list(mine.shape)}"
                )
            mine.copy_(value)
        part.version += 1

    def set_lookahead_rows(self, upcoming: list[Tensor], prefetch: bool = False) -> None:
        """`set_lookahead` with each upcoming batch given as its sorted unique rows of this collection (a
        shard of a sharded table works out which of a global batch's ids are its own)."""
        self.prefetcher.set_lookahead_rows([rows.to(self.device) for rows in upcoming], prefetch)

    @after_prefetch
    def load_tables(self, tables: list[Tensor]) -> None:
        """Replace every row with the given fp32 tables (rounded to nearest); empties the cache."""
        if len(tables) != len(self.table_sizes):
            raise InvalidInputError(f"expected {len(self.table_sizes)} tables, got {len(tables)}")
        for t, (table, size) in enumerate(zip(tables, self.table_sizes, strict=True)):
            if tuple(table.shape) != (size, self.dim):
                raise InvalidInputError(
                    f"{self.table_names[t]}: expected shape ({size}, {self.dim}), got {tuple(table.shape)}"
                )
            start = int(self.table_offsets[t])
            for chunk_start in range(0, size, _INIT_CHUNK_ROWS):
                chunk = (
                    table[chunk_start : chunk_start + _INIT_CHUNK_ROWS]
                    .detach()
                    .float()
                    .to(self.storage_device)
                )
                fitted = self.storage.write_range(start + chunk_start, chunk, "nearest", None)
                self.traffic.count_fitted(torch.full((chunk.shape[0],), t, device=self.device), fitted)
        slots, _ = self.cache.cached()
        self.cache.evict(slots)

    def export_tables(self) -> list[Tensor]:
        """Current fp32 values of every table (cached rows overlaid on storage)."""
        tables = []
        for t, size in enumerate(self.table_sizes):
            start = int(self.table_offsets[t])
            chunks = [
                self._read_rows(
                    torch.arange(start + s, start + min(s + _INIT_CHUNK_ROWS, size), device=self.device)
                )
                for s in range(0, size, _INIT_CHUNK_ROWS)
            ]
            tables.append(torch.cat(chunks))
        return tables

    # ------------------------------------------------------------------------------------- forward
    def forward(self, features: Tensor | SparseFeatures) -> Tensor:
        training = self.training and torch.is_grad_enabled() and not self.frozen
        if torch.compiler.is_compiling() and not training:
            return self._traced_forward(features)
        lookup = self.inputs.prepare(features)
        if training:
            refuse_replicated_training(self)
            self.prefetcher.join()
            window, prefetch = self.prefetcher.take_window()
            self.prefetcher.read_ahead(window)
            # At lr 0 the rows stay bit for bit: the cache admits nothing (an eviction would round a row back).
            moving = self.optimizer.lr != 0
            plan = self.planner.plan(lookup, window, admit=moving)
            if self.cache.capacity:
                if moving and prefetch and window is not None and len(window):
                    self.prefetcher.start(window)
                self.clock.lap("other")
            return _FusedLookup.apply(self._anchor, (self.inputs, self.planner, self.optimizer), lookup, plan)
        return self.inputs.pool(self._read_rows(lookup.rows), lookup)

    def _traced_forward(self, features: Tensor | SparseFeatures) -> Tensor:
        """Inference in torch operations only, for `torch.export` and `torch.compile`: the rows (cache over
        storage) read and pooled without a compiled loop and without a branch on the ids' values, so the
        graph has no break. The ids are not range-checked here: a traced program cannot raise on a value."""
        if not isinstance(features, (Tensor, SparseFeatures)):
            raise InvalidInputError(f"expected ids [batch, tables] or SparseFeatures, got {type(features).__name__}")
        rows, bag, weight = self.inputs.traced_rows(features)
        values = self.storage.read_traceable(rows, self.device)
        if self.cache.capacity:
            slots = self.cache.lookup(rows)
            cached = self.cache.weights.index_select(0, slots.clamp_min(0))
            values = torch.where((slots >= 0)[:, None], cached, values)
        batch = features.shape[0] if isinstance(features, Tensor) else features.batch_size
        return self.inputs.traced_pool(values, bag, weight, batch)

    def set_lookahead(self, upcoming: Sequence[Tensor | SparseFeatures], prefetch: bool = False) -> None:
        """The ids of the batches after the next training step's (e.g. `BatchIterator.peek(k)`), for that
        step only: the lookahead policies evict by their use, and with `prefetch` the first one's missing
        rows are brought into the cache in the background while that step computes (a thread on CPU, a
        side stream on GPU), never in place of a row of a batch in flight or of the next one.

        Why per step: a window left over from an earlier step would be off by one batch.
        """
        self.prefetcher.set_lookahead(upcoming, prefetch)

    # -------------------------------------------------------------------------------- cache traffic
    def read_rows(self, rows: Tensor) -> Tensor:
        """fp32 values of global `rows` (cache overlaid on storage); changes nothing."""
        return self._read_rows(self.inputs.check_rows(rows, "read_rows"))

    @after_prefetch
    def _read_rows(self, rows: Tensor) -> Tensor:
        slots = self.cache.lookup(rows)
        hit = slots >= 0
        if self.cache.capacity and bool(hit.all()):
            return self.cache.weights[slots]
        if not bool(hit.any()):
            self.prefetcher.read_now(rows)
            return self.storage.read(rows, self.device)
        # Only the rows the cache lacks are read from storage: with storage on disk, each is a page to read.
        values = torch.empty(rows.numel(), self.dim, device=self.device)
        values[hit] = self.cache.weights[slots[hit]]
        self.prefetcher.read_now(rows[~hit])
        values[~hit] = self.storage.read(rows[~hit], self.device)
        return values

    @after_prefetch
    def flush(self) -> None:
        """Round every cached row back into storage; the cache keeps its contents."""
        slots, rows = self.cache.cached()
        for start in range(0, slots.numel(), _INIT_CHUNK_ROWS):
            chunk = slice(start, start + _INIT_CHUNK_ROWS)
            self.writer.write(rows[chunk], self.cache.weights[slots[chunk]])

    @after_prefetch
    def write_rows(self, rows: Tensor, values: Tensor) -> None:
        """Set fp32 `values` [n, D] of unique global `rows`: cached rows in the cache, the others rounded to
        nearest into storage. For a feature that holds rows fixed (freezing); counts no traffic."""
        rows = self.inputs.check_rows(rows, "write_rows")
        values = values.to(self.device, torch.float32)
        slots = self.cache.lookup(rows)
        hit = slots >= 0
        if bool(hit.any()):
            self.cache.weights[slots[hit]] = values[hit]
        if not bool(hit.all()):
            self.storage.write(rows[~hit], values[~hit], "nearest", None)

    @after_prefetch
    def release_rows(self, rows: Tensor) -> int:
        """Write cached `rows` back and free their slots (e.g. rows found stale); returns how many.

        Safe between a forward and its backward: the update then lands on the row in storage.
        """
        slots = self.cache.lookup(self.inputs.check_rows(rows, "release_rows"))
        slots = torch.unique(slots[slots >= 0])
        if slots.numel():
            self.writer.write(self.cache.slot_rows[slots].long(), self.cache.weights[slots])
            self.cache.evict(slots)
        return int(slots.numel())

    # ----------------------------------------------------------------------------------- accounting
    @after_prefetch
    def reset_stats(self) -> None:
        self.traffic.reset()
        self.prefetcher.prefetched_rows = 0

    @after_prefetch
    def stats(self) -> dict[str, Any]:
        """Cumulative lookups, hits, misses, evictions and traffic, in total and per table."""
        totals = self.traffic.summary(self.table_names, row_bytes(self.storage, self.config.precisions))
        totals["cache_rows"] = self.cache.capacity
        totals["skipped_updates"] = self.skipped_updates  # backward passes dropped for inf/NaN gradients
        totals["prefetched_rows"] = self.prefetched_rows  # rows the prefetch brought in (also in rows_in)
        return totals

    def memory_report(self) -> dict[str, Any]:
        """Bytes of every tensor this module holds, by component, against plain fp32 tables."""
        generators = int(self.writer.generator is not None or self.device.type == "meta")  # meta: as if built
        generators += int(self.prefetcher.generator is not None)
        state = getattr(self, "optimizer_state", None)
        return memory_report(self, self.config, self.cache, self.storage, state, generators)

    # ----------------------------------------------------------------------------------- state dict
    @after_prefetch
    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """After the prefetch in flight: the saved cache includes its rows, so a resumed run matches."""
        super()._save_to_state_dict(*args, **kwargs)

    @after_prefetch
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Checkpoints written before the saturation counters existed hold fewer counter columns."""
        counters = state_dict.get(prefix + "counters")
        if isinstance(counters, Tensor) and counters.dim() == 2 and counters.shape[1] < len(COUNTERS):
            padding = counters.new_zeros(counters.shape[0], len(COUNTERS) - counters.shape[1])
            state_dict[prefix + "counters"] = torch.cat([counters, padding], dim=1)
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._bind_parts()  # load_state_dict(assign=True) replaces the tensors

    def get_extra_state(self) -> dict[str, Any]:
        config = asdict(self.config)
        return {
            "step": self.step,
            "skipped_updates": self.skipped_updates,
            "optimizer_steps": self.optimizer.steps,
            "lr": self.lr,
            "generator": self.writer.generator.get_state() if self.writer.generator is not None else None,
            "prefetch_generator": (
                self.prefetcher.generator.get_state() if self.prefetcher.generator is not None else None
            ),
            "config": {k: config[k] for k in _STATE_KEYS},
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restores the step, the rounding generators and the counts; the learning rate stays this
        collection's own (the one it was built with, or set since): a run resumed with another lr trains with
        it. The saved lr stays in the state for reference."""
        config = asdict(self.config)
        saved = state["config"]
        mismatched = [k for k in _STATE_KEYS if saved.get(k) != config[k]]
        if mismatched:
            details = ", ".join(f"{k}: saved {saved.get(k)!r}, here {config[k]!r}" for k in mismatched)
            raise InvalidInputError(f"embedding state does not match this collection ({details})")
        self.planner.step = state["step"]
        self.optimizer.skipped_updates = state.get("skipped_updates", 0)
        self.optimizer.steps = state.get("optimizer_steps", 0)
        self.planner.forget()
        self.optimizer.forget()
        # Plans made before the load locate their rows again: the cache and storage bumped their versions.
        self.cache.invalidate()
        generator = self.writer.generator
        if generator is not None and state["generator"] is not None:
            generator.set_state(state["generator"])
        if generator is not None and state.get("prefetch_generator") is not None:
            self.prefetcher.generator = self.prefetcher.new_generator()
            self.prefetcher.generator.set_state(state["prefetch_generator"])

    @classmethod
    def estimate_memory(cls, config: EmbeddingConfig) -> dict[str, Any]:
        """The memory report of a collection with this config, without allocating it."""
        meta = EmbeddingConfig(**{**asdict(config), "storage_device": "meta", "cache_device": "meta"})
        return cls(meta).memory_report()


OPTIMIZER_SETTINGS = ("optimizer", "lr", "eps", "weight_decay", "beta1", "beta2")
_STATE_KEYS = ("table_sizes", "dim", "precision", "cache_size", "cache_rows", "policy", "optimizer", "ways")


