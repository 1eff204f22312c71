"""`CachedEmbeddingBagCollection`: many embedding tables in low precision behind one fp32 row cache.

All tables share one row space (global row = table offset + id), so a batch is served by a handful of
vectorized operations whatever the number of tables. A training step:

1. look the batch's rows up in the cache; hits are pinned for the step;
2. missing rows are read from storage (dequantized) into free or victim slots; victims are rounded
   back into storage first; rows that find no slot (more misses than evictable ways) are served
   straight from storage and updated there in fp32, then rounded back;
3. backward applies the optimizer update itself (SGD, Adagrad or row-wise Adagrad): cached rows in
   fp32 in the cache, the others in storage.

The class is assembled from parts in their own modules: input validation and pooling (`inputs`), the
step plan of a training forward (`plan`), the fused optimizer (`update`), lookahead and prefetch (`prefetch`), counters and memory accounting
(`accounting`); the configuration is in `config`.
"""

from __future__ import annotations

import math
import sys
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from slipcache.embedding.accounting import COUNTERS, Accounting, PhaseClock
from slipcache.embedding.cache import RowCache
from slipcache.embedding.config import OPTIMIZERS, EmbeddingConfig
from slipcache.embedding.inputs import LookupInputs, SparseFeatures
from slipcache.embedding.lookahead import Window
from slipcache.embedding.plan import StepPlanner, _FusedLookup, _StepPlan
from slipcache.embedding.prefetch import Prefetcher
from slipcache.embedding.quant import RowStorage, TableRowStorage
from slipcache.embedding.replicas import refuse_replicated_training
from slipcache.embedding.update import FusedOptimizer
from slipcache.errors import InvalidInputError, SlipcacheError

# OPTIMIZERS: still imported from here by slipcache.training.
__all__ = ["OPTIMIZERS", "CachedEmbeddingBagCollection", "EmbeddingConfig", "SparseFeatures"]

_INIT_CHUNK_ROWS = 1 << 20
# Rows are drawn and rounded a chunk of about 1 MB of fp32 at a time: it stays in the core's cache between
# the draw and the rounding, and bounds what creation holds in fp32 whatever the table sizes.
_INIT_CHUNK_VALUES = 1 << 18
# A progress bar when creation rounds at least this many values (a few seconds).
PROGRESS_VALUES = 1 << 30


def _init_chunk_rows(dim: int) -> int:
    """Rows drawn at once at initialization (the draw is one generator stream: chunking changes nothing)."""
    return max(1, _INIT_CHUNK_VALUES // max(dim, 1))


class CachedEmbeddingBagCollection(LookupInputs, StepPlanner, FusedOptimizer, Prefetcher, Accounting, nn.Module):
    """Embedding bags over many tables: low-precision storage, an fp32 cache, a fused optimizer.

    forward(ids [B, T] or SparseFeatures) -> pooled [B, T, D]. In training mode with gradients enabled,
    backward updates the rows; otherwise lookups are read-only and leave the cache as it is.
    """

    fused_update = True
    # True for one rank's shards inside slipcache's sharded collection: meant to differ by rank (replicas.py)
    sharded_by_slipcache = False

    def __init__(self, config: EmbeddingConfig) -> None:
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.table_sizes = list(config.table_sizes)
        self.table_names = config.table_names or [f"table {t}" for t in range(len(self.table_sizes))]
        self.lr = config.lr
        self.step = 0
        # Forwards whose gradient has not arrived yet (weak: a graph that is freed unpins its rows).
        self._in_flight: dict[int, weakref.ref[_StepPlan]] = {}
        self._pending: list[tuple[_StepPlan, Tensor]] = []  # gradients of the running backward pass
        self._pending_task = -1  # the autograd graph task they belong to
        self._residency_version = 0  # bumped whenever a row enters or leaves the cache
        self._storage_version = 0  # bumped whenever storage is written
        self.skipped_updates = 0  # backward passes whose gradient held inf or NaN (update dropped)
        # With mixed precision, set to the torch.amp.GradScaler that scales the loss: the fused update then
        # divides by its current scale (and, like scaler.step, skips a step whose gradient is not finite).
        self.grad_scaler: Any = None
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
            RowStorage(num_rows, config.dim, precisions[0], self.storage_device)
            if len(set(precisions)) == 1
            else TableRowStorage(self.table_sizes, config.dim, precisions, self.storage_device)
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
        )
        state_shape = {"sgd": None, "adagrad": (num_rows, config.dim), "rowwise_adagrad": (num_rows,)}[
            config.optimizer
        ]
        if state_shape is not None:
            self.register_buffer("optimizer_state", torch.zeros(state_shape, device=self.storage_device))
        self.register_buffer(
            "counters",
            torch.zeros(len(self.table_sizes), len(COUNTERS), dtype=torch.int64, device=self.device),
        )
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        self._generator: torch.Generator | None = None
        # Lookahead (set_lookahead): the window for the next step, its rows per batch, the prefetch in flight.
        self._window: Window | None = None
        self._upcoming_rows: list[tuple[object, Tensor]] = []
        self._prefetch_next = False
        self._prefetching: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._side_stream: Any = None
        # The prefetch thread's own rounding generator (made on first use): draws never interleave by timing.
        self._prefetch_generator: torch.Generator | None = None
        self.prefetched_rows = 0
        self.clock = PhaseClock()
        self._scratch_buffers: dict[str, Tensor] = {}  # see _scratch
        if not meta:
            self._generator = torch.Generator(device=self.device).manual_seed(config.seed)
            self._initialize_rows()
            if self.storage_device.type == "cpu" and self.device.type == "cuda":
                self.storage.pin_memory_()

    # ------------------------------------------------------------------------------ device and dtype
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
        self._join_prefetch()
        super()._apply(fn, recurse)
        self._follow_buffers()
        return self

    def _follow_buffers(self) -> None:
        """After the buffers moved: devices, the gradient anchor and the rounding generator follow them."""
        self.device, self.storage_device = self.counters.device, next(self.storage.buffers()).device
        self.config.cache_device, self.config.storage_device = str(self.device), str(self.storage_device)
        self._anchor = torch.zeros(0, device=self.device, requires_grad=True)
        generator = self._generator
        if generator is not None and generator.device != self.device:
            # Generator states do not carry across device types: continue from a seed drawn from the old one.
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            self._generator = None
            if self.device.type != "meta":
                self._generator = torch.Generator(device=self.device).manual_seed(seed)
        if self._prefetch_generator is not None and self._prefetch_generator.device != self.device:
            self._prefetch_generator = None  # made again, from the seed, on the new device
        self._side_stream = None
        self._scratch_buffers.clear()
        self._in_flight.clear()  # plans hold tensors on the old device
        self._pending.clear()
        self._residency_version += 1
        self._storage_version += 1

    # ----------------------------------------------------------------------------------------- set-up
    def _initialize_rows(self) -> None:
        """DLRM's uniform(-1/sqrt(n), 1/sqrt(n)) per table, drawn in fp32 and rounded to nearest into storage.

        The draw depends on the seed and the table shapes only, never on the precision: a seed's INT8, INT4
        or FP16 run starts from the rounding of the very rows its FP32 run starts from, so paired runs
        measure precision alone. One reused chunk of about 1 MB of fp32 at a time: the compiled quantize
        pass rounds it while it is still in cache, and creation never holds more than that in fp32.
        """
        generator = torch.Generator().manual_seed(self.config.seed)
        chunk_rows = _init_chunk_rows(self.dim)
        chunk = torch.empty(chunk_rows, self.dim)
        total = sum(self.table_sizes)
        with tqdm(
            total=total, unit="rows", unit_scale=True, desc="creating tables", leave=False,
            disable=total * self.dim < PROGRESS_VALUES,
        ) as bar:
            start = 0
            for size in self.table_sizes:
                bound = 1.0 / math.sqrt(size)
                for chunk_start in range(0, size, chunk_rows):
                    count = min(chunk_rows, size - chunk_start)
                    # In place, the same float operations as (rand * 2 - 1) * bound: the same values.
                    values = chunk[:count].uniform_(generator=generator).mul_(2).sub_(1).mul_(bound)
                    self.storage.write_range(start + chunk_start, values.to(self.storage_device), "nearest", None)
                    bar.update(count)
                start += size

    def load_tables(self, tables: list[Tensor]) -> None:
        """Replace every row with the given fp32 tables (rounded to nearest); empties the cache."""
        self._join_prefetch()
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
                self._count_fitted(torch.full((chunk.shape[0],), t, device=self.device), fitted)
        slots, _ = self.cache.cached()
        self.cache.evict(slots)
        self._residency_version += 1
        self._storage_version += 1

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
        lookup = self._prepare(features)
        if self.training and torch.is_grad_enabled():
            refuse_replicated_training(self)
            plan = self._plan_step(lookup)
            return _FusedLookup.apply(self._anchor, self, lookup, plan)
        return self._pool(self._read_rows(lookup.rows), lookup)

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A buffer reused from step to step while nothing else holds it (the last step's output, plan or
        rows are gone): a fresh megabytes-large tensor costs its page faults every step."""
        buffer = self._scratch_buffers.get(name)
        # References to the Python tensor: the dict, `buffer` and getrefcount's argument; any more is a holder.
        if (
            buffer is None
            or buffer.shape != shape
            or buffer.dtype != dtype
            or sys.getrefcount(buffer) > 3
            or not _storage_alone(buffer)
        ):
            buffer = self._scratch_buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    # -------------------------------------------------------------------------------- cache traffic
    def read_rows(self, rows: Tensor) -> Tensor:
        """fp32 values of global `rows` (cache overlaid on storage); changes nothing."""
        return self._read_rows(self._check_rows(rows, "read_rows"))

    def _read_rows(self, rows: Tensor) -> Tensor:
        self._join_prefetch()
        slots = self.cache.lookup(rows)
        hit = slots >= 0
        if self.cache.capacity and bool(hit.all()):
            return self.cache.weights[slots]
        values = self.storage.read(rows, self.device)
        if self.cache.capacity:
            values[hit] = self.cache.weights[slots[hit]]
        return values

    # -------------------------------------------------------------------------------- storage writes
    def _write_storage(self, rows: Tensor, values: Tensor) -> Tensor:
        """Round fp32 `values` of unique `rows` into storage and count the traffic; returns their tables."""
        fitted = self.storage.write(rows, values, self.config.rounding, self._generator)
        self._storage_version += 1
        tables = self._tables_of(rows)
        self._count_tables("rows_out", tables)
        self._count_fitted(tables, fitted)
        return tables

    def flush(self) -> None:
        """Round every cached row back into storage; the cache keeps its contents."""
        self._join_prefetch()
        slots, rows = self.cache.cached()
        for start in range(0, slots.numel(), _INIT_CHUNK_ROWS):
            chunk = slice(start, start + _INIT_CHUNK_ROWS)
            self._write_storage(rows[chunk], self.cache.weights[slots[chunk]])

    def release_rows(self, rows: Tensor) -> int:
        """Write cached `rows` back and free their slots (e.g. rows found stale); returns how many.

        Safe between a forward and its backward: the update then lands on the row in storage.
        """
        self._join_prefetch()
        slots = self.cache.lookup(self._check_rows(rows, "release_rows"))
        slots = torch.unique(slots[slots >= 0])
        if slots.numel():
            self._write_storage(self.cache.slot_rows[slots].long(), self.cache.weights[slots])
            self.cache.evict(slots)
            self._residency_version += 1
        return int(slots.numel())

    # ----------------------------------------------------------------------------------- state dict
    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._join_prefetch()  # the saved cache includes the prefetched rows, so a resumed run matches
        super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Checkpoints written before the saturation counters existed hold fewer counter columns."""
        self._join_prefetch()
        counters = state_dict.get(prefix + "counters")
        if isinstance(counters, Tensor) and counters.dim() == 2 and counters.shape[1] < len(COUNTERS):
            padding = counters.new_zeros(counters.shape[0], len(COUNTERS) - counters.shape[1])
            state_dict[prefix + "counters"] = torch.cat([counters, padding], dim=1)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def get_extra_state(self) -> dict[str, Any]:
        config = asdict(self.config)
        return {
            "step": self.step,
            "skipped_updates": self.skipped_updates,
            "lr": self.lr,
            "generator": self._generator.get_state() if self._generator is not None else None,
            "prefetch_generator": (
                self._prefetch_generator.get_state() if self._prefetch_generator is not None else None
            ),
            "config": {k: config[k] for k in _STATE_KEYS},
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        config = asdict(self.config)
        saved = state["config"]
        mismatched = [k for k in _STATE_KEYS if saved.get(k) != config[k]]
        if mismatched:
            details = ", ".join(f"{k}: saved {saved.get(k)!r}, here {config[k]!r}" for k in mismatched)
            raise InvalidInputError(f"embedding state does not match this collection ({details})")
        self.step, self.lr = state["step"], state["lr"]
        self.skipped_updates = state.get("skipped_updates", 0)
        self._in_flight.clear()
        self._pending.clear()
        self._residency_version += 1  # plans made before the load must locate their rows again
        self._storage_version += 1
        if self._generator is not None and state["generator"] is not None:
            self._generator.set_state(state["generator"])
        if self._generator is not None and state.get("prefetch_generator") is not None:
            self._prefetch_generator = self._new_prefetch_generator()
            self._prefetch_generator.set_state(state["prefetch_generator"])

    @classmethod
    def estimate_memory(cls, config: EmbeddingConfig) -> dict[str, Any]:
        """The memory report of a collection with this config, without allocating it."""
        meta = EmbeddingConfig(**{**asdict(config), "storage_device": "meta", "cache_device": "meta"})
        return cls(meta).memory_report()


def _use_count(tensor: Tensor) -> int | None:
    """How many tensors share `tensor`'s storage (plus the temporary that asks); None where torch cannot say."""
    try:
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return None


_ALONE = _use_count(torch.empty(1))  # the count of a tensor nothing else shares


def _storage_alone(tensor: Tensor) -> bool:
    """Whether no other tensor (an output the caller kept, a view of it) shares `tensor`'s storage."""
    count = _use_count(tensor)
    return _ALONE is not None and count is not None and count <= _ALONE


_STATE_KEYS = ("table_sizes", "dim", "precision", "cache_size", "cache_rows", "policy", "optimizer", "ways")


