"""`CachedEmbeddingBagCollection`: many embedding tables in low precision behind one fp32 row cache.

All tables share one row space (global row = table offset + id), so a batch is served by a handful of
vectorized operations whatever the number of tables. A training step:

1. look the batch's rows up in the cache; hits are pinned for the step;
2. missing rows are read from storage (dequantized) into free or victim slots; victims are rounded
   back into storage first; rows that find no slot (more misses than evictable ways) are served
   straight from storage and updated there in fp32, then rounded back;
3. backward applies the optimizer update itself (SGD, Adagrad or row-wise Adagrad): cached rows in
   fp32 in the cache, the others in storage.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from slipcache import _native
from slipcache.embedding.cache import POLICIES, RowCache
from slipcache.embedding.lookahead import Window
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS, RowStorage
from slipcache.errors import InvalidInputError

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
POOLINGS = ("sum", "mean")
COUNTERS = ("lookups", "hits", "misses", "evictions", "rows_in", "rows_out", "overflow_rows")
_INIT_CHUNK_ROWS = 1 << 20
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class EmbeddingConfig:
    """Tables, storage precision, cache and fused optimizer of a `CachedEmbeddingBagCollection`."""

    table_sizes: list[int]
    dim: int = 16
    precision: str = "int8"
    cache_size: float = 0.05  # a fraction of all rows when < 1, else a number of rows; 0: no cache
    policy: str = "lru"
    rounding: str = "stochastic"
    optimizer: str = "sgd"
    lr: float = 0.1
    eps: float = 1e-8  # Adagrad denominator term
    pooling: str = "sum"
    ways: int = 16  # cache associativity
    lfu_halving_interval: int = 1000  # LFU counts halve every this many steps; 0: never
    seed: int = 0
    storage_device: str = "cpu"
    cache_device: str = "cpu"
    table_names: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        self.table_sizes = [int(n) for n in self.table_sizes]
        if not self.table_sizes or any(n <= 0 for n in self.table_sizes):
            raise ValueError(
                f"table_sizes must be a non-empty list of positive row counts, got {self.table_sizes}"
            )
        if self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        for name, value, allowed in (
            ("precision", self.precision, PRECISIONS),
            ("policy", self.policy, POLICIES),
            ("rounding", self.rounding, ROUNDINGS),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("pooling", self.pooling, POOLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        if self.cache_size < 0:
            raise ValueError(
                f"cache_size must be >= 0 (a fraction below 1 or a row count), got {self.cache_size}"
            )
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.ways <= 0:
            raise ValueError(f"ways must be positive, got {self.ways}")
        if self.table_names is not None and len(self.table_names) != len(self.table_sizes):
            raise ValueError("table_names must name every table")

    @property
    def num_rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def cache_rows(self) -> int:
        """Requested cache capacity in rows (the cache rounds up to whole sets)."""
        if self.policy == "none" or self.cache_size == 0:
            return 0
        if self.cache_size < 1:
            return max(1, round(self.cache_size * self.num_rows))
        return min(int(self.cache_size), self.num_rows)


@dataclass(frozen=True)
class SparseFeatures:
    """Multi-hot ids: `values` of all bags, table-major (`num_tables` groups of `batch_size` bags).

    `offsets[i]:offsets[i + 1]` are the values of bag i, bag i = table * batch_size + sample.
    """

    values: Tensor
    offsets: Tensor
    num_tables: int

    @property
    def batch_size(self) -> int:
        return (self.offsets.numel() - 1) // self.num_tables

    @classmethod
    def from_lengths(cls, values: Tensor, lengths: Tensor) -> SparseFeatures:
        """`lengths` [num_tables, batch_size]: the number of values in each bag."""
        if lengths.dim() != 2:
            raise InvalidInputError(
                f"lengths must be [num_tables, batch_size], got shape {tuple(lengths.shape)}"
            )
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
        return cls(values, offsets, lengths.shape[0])


class PhaseClock:
    """Wall time per phase of the training step, off unless `enable`d (`slipcache bench embedding` profile).

    `mark()` starts a lap, `lap(name)` adds the time since the last mark to `name` and starts the next; when
    off both return at once, so the hot path keeps only a few no-op calls. On GPU the laps time the launch,
    not the kernels.
    """

    PHASES = ("lookup", "evict", "fill", "forward", "backward", "other")

    def __init__(self) -> None:
        self.seconds: dict[str, float] | None = None
        self._last = 0.0

    def enable(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def disable(self) -> None:
        self.seconds = None

    def mark(self) -> None:
        if self.seconds is not None:
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.seconds is not None:
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now


@dataclass
class _Lookup:
    """One batch's lookups: global rows in bag order and how they pool."""

    rows: Tensor  # [L] global rows
    batch_size: int
    bag_of_value: Tensor | None  # [L] bag of each value; None when each bag holds exactly one id
    value_weight: Tensor | None  # [L] 1 / bag length for mean pooling


@dataclass
class _StepPlan:
    """Where each lookup of a training step lives, kept from forward to backward."""

    slots: Tensor  # [L] cache slot per lookup, -1 when served from storage
    on_storage: Tensor | None  # [L] bool, None when every lookup is cached
    storage_rows: Tensor  # [m] unique rows served from storage
    storage_index: Tensor  # index into storage_rows for each lookup with slot -1
    storage_values: Tensor  # [m, D] fp32 working copy of those rows
    storage_tables: Tensor  # [m] table of each of those rows, for the statistics
    all_on_storage: bool  # no lookup is cached (no cache, or nothing fit)


class _FusedLookup(torch.autograd.Function):
    """Pooled embeddings forward; the optimizer update in backward (no dense gradient is formed)."""

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, coll: CachedEmbeddingBagCollection, lookup: _Lookup, plan: _StepPlan
    ) -> Tensor:
        ctx.coll, ctx.lookup, ctx.plan = coll, lookup, plan
        coll.clock.mark()
        pooled = coll._pool(coll._gather(plan), lookup)
        coll.clock.lap("forward")
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        coll, lookup = ctx.coll, ctx.lookup
        coll.clock.mark()
        coll._apply_gradients(ctx.plan, coll._unpool(grad_out, lookup), lookup)
        coll.clock.lap("backward")
        ctx.coll = ctx.lookup = ctx.plan = None
        return grad_out.new_zeros(0), None, None, None


class CachedEmbeddingBagCollection(nn.Module):
    """Embedding bags over many tables: low-precision storage, an fp32 cache, a fused optimizer.

    forward(ids [B, T] or SparseFeatures) -> pooled [B, T, D]. In training mode with gradients enabled,
    backward updates the rows; otherwise lookups are read-only and leave the cache as it is.
    """

    fused_update = True

    def __init__(self, config: EmbeddingConfig) -> None:
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.table_sizes = list(config.table_sizes)
        self.table_names = config.table_names or [f"table {t}" for t in range(len(self.table_sizes))]
        self.lr = config.lr
        self.step = 0
        self._pin_since = 1
        meta = torch.device(config.storage_device).type == "meta"
        self.storage_device = torch.device(config.storage_device)
        self.device = torch.device(config.cache_device)
        sizes = torch.tensor(self.table_sizes, dtype=torch.int64)
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        self.register_buffer("table_offsets", offsets.to(self.device), persistent=False)
        self.register_buffer("_table_sizes", sizes.to(self.device), persistent=False)
        num_rows = config.num_rows
        self.storage = RowStorage(num_rows, config.dim, config.precision, self.storage_device)
        self.cache = RowCache(
            config.cache_rows,
            config.dim,
            config.policy,
            num_rows,
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
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._side_stream: Any = None
        # The prefetch thread's own rounding generator (made on first use): draws never interleave by timing.
        self._prefetch_generator: torch.Generator | None = None
        self.prefetched_rows = 0
        self.clock = PhaseClock()
        if not meta:
            self._generator = torch.Generator(device=self.device).manual_seed(config.seed)
            self._initialize_rows()
            if self.storage_device.type == "cpu" and self.device.type == "cuda":
                self.storage.pin_memory_()

    # ----------------------------------------------------------------------------------------- set-up
    def _initialize_rows(self) -> None:
        """DLRM's uniform(-1/sqrt(n), 1/sqrt(n)) per table, in chunks."""
        generator = torch.Generator().manual_seed(self.config.seed)
        start = 0
        for size in self.table_sizes:
            for chunk_start in range(0, size, _INIT_CHUNK_ROWS):
                count = min(_INIT_CHUNK_ROWS, size - chunk_start)
                self.storage.fill_uniform_(start + chunk_start, count, 1.0 / math.sqrt(size), generator)
            start += size

    def load_tables(self, tables: list[Tensor]) -> None:
        """Replace every row with the given fp32 tables (rounded to nearest); empties the cache."""
        if len(tables) != len(self.table_sizes):
            raise InvalidInputError(f"expected {len(self.table_sizes)} tables, got {len(tables)}")
        self._join_prefetch()
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
                self.storage.write_range(start + chunk_start, chunk, "nearest", None)
        slots, _ = self.cache.cached()
        self.cache.evict(slots)

    def export_tables(self) -> list[Tensor]:
        """Current fp32 values of every table (cached rows overlaid on storage)."""
        tables = []
        for t, size in enumerate(self.table_sizes):
            start = int(self.table_offsets[t])
            chunks = [
                self.read_rows(
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
            plan = self._plan_step(lookup)
            return _FusedLookup.apply(self._anchor, self, lookup, plan)
        return self._pool(self.read_rows(lookup.rows), lookup)

    def _prepare(self, features: Tensor | SparseFeatures) -> _Lookup:
        """Validate input once, at the boundary, and turn it into global rows."""
        num_tables = len(self.table_sizes)
        if isinstance(features, SparseFeatures):
            return self._prepare_sparse(features)
        if not isinstance(features, Tensor):
            raise InvalidInputError(
                f"expected ids as a LongTensor [batch, {num_tables}] or SparseFeatures, got {type(features).__name__}"
            )
        if features.dtype not in _INTEGER_DTYPES:
            raise InvalidInputError(f"ids must be an integer tensor, got dtype {features.dtype}")
        if features.dim() != 2 or features.shape[1] != num_tables:
            raise InvalidInputError(
                f"ids must have shape [batch, {num_tables}] (one id per table), got {tuple(features.shape)}; "
                "use SparseFeatures for multi-hot bags"
            )
        ids = features.to(self.device, torch.int64)
        if ids.numel():
            lo, hi = ids.amin(dim=0), ids.amax(dim=0)
            bad = (lo < 0) | (hi >= self._table_sizes)
            if bool(bad.any()):
                t = int(torch.nonzero(bad)[0])
                value = int(lo[t]) if int(lo[t]) < 0 else int(hi[t])
                self._raise_out_of_range(t, value)
        return _Lookup((ids + self.table_offsets[:-1]).reshape(-1), ids.shape[0], None, None)

    def _prepare_sparse(self, features: SparseFeatures) -> _Lookup:
        values, offsets, num_tables = features.values, features.offsets, len(self.table_sizes)
        if features.num_tables != num_tables:
            raise InvalidInputError(
                f"SparseFeatures has {features.num_tables} tables, the collection {num_tables}"
            )
        for name, tensor in (("values", values), ("offsets", offsets)):
            if tensor.dtype not in _INTEGER_DTYPES or tensor.dim() != 1:
                raise InvalidInputError(
                    f"{name} must be a 1-D integer tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}"
                )
        if offsets.numel() < 1 or (offsets.numel() - 1) % num_tables:
            raise InvalidInputError(
                f"offsets must hold num_tables * batch_size + 1 = k * {num_tables} + 1 entries, got {offsets.numel()}"
            )
        values = values.to(self.device, torch.int64)
        offsets = offsets.to(self.device, torch.int64)
        lengths = offsets.diff()
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.numel() or bool((lengths < 0).any()):
            raise InvalidInputError(
                f"offsets must start at 0, never decrease and end at len(values) = {values.numel()}; "
                f"got first {int(offsets[0])}, last {int(offsets[-1])}"
            )
        batch_size = features.batch_size
        bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=self.device), lengths)
        table_of_value = bag_of_value // max(batch_size, 1)
        bad = (values < 0) | (values >= self._table_sizes[table_of_value])
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            self._raise_out_of_range(int(table_of_value[i]), int(values[i]))
        weight = None
        if self.config.pooling == "mean":
            weight = 1.0 / lengths.clamp_min(1).float()[bag_of_value]
        return _Lookup(values + self.table_offsets[table_of_value], batch_size, bag_of_value, weight)

    def _raise_out_of_range(self, table: int, value: int) -> None:
        size = self.table_sizes[table]
        raise InvalidInputError(f"{self.table_names[table]} (size {size}): id {value} is outside [0, {size})")

    def _pool(self, values: Tensor, lookup: _Lookup) -> Tensor:
        num_tables = len(self.table_sizes)
        if lookup.bag_of_value is None:
            return values.view(lookup.batch_size, num_tables, self.dim)
        if lookup.value_weight is not None:
            values = values * lookup.value_weight[:, None]
        pooled = values.new_zeros(num_tables * lookup.batch_size, self.dim).index_add_(
            0, lookup.bag_of_value, values
        )
        return pooled.view(num_tables, lookup.batch_size, self.dim).transpose(0, 1)

    def _unpool(self, grad_out: Tensor, lookup: _Lookup) -> Tensor:
        """Gradient of the pooled output [B, T, D] -> gradient of each looked-up value [L, D]."""
        if lookup.bag_of_value is None:
            return grad_out.reshape(-1, self.dim)
        grad = grad_out.transpose(0, 1).reshape(-1, self.dim)[lookup.bag_of_value]
        if lookup.value_weight is not None:
            grad = grad * lookup.value_weight[:, None]
        return grad

    # -------------------------------------------------------------------------------- cache traffic
    def read_rows(self, rows: Tensor) -> Tensor:
        """fp32 values of global `rows` (cache overlaid on storage); changes nothing."""
        self._join_prefetch()
        rows = rows.to(self.device)
        slots = self.cache.lookup(rows)
        hit = slots >= 0
        if self.cache.capacity and bool(hit.all()):
            return self.cache.weights[slots]
        values = self.storage.read(rows, self.device)
        if self.cache.capacity:
            values[hit] = self.cache.weights[slots[hit]]
        return values

    def _plan_step(self, lookup: _Lookup) -> _StepPlan:
        """Bring the batch's rows into the cache where they fit; read the rest from storage."""
        self._join_prefetch()
        window, self._window = self._window, None  # a window describes the batches after this one only
        prefetch, self._prefetch_next = self._prefetch_next, False
        self.step += 1
        step, rows, cache, clock = self.step, lookup.rows, self.cache, self.clock
        clock.mark()
        slots = cache.lookup_and_touch(rows, step)
        clock.lap("lookup")
        hit = slots >= 0
        self._count("lookups", None, lookup)
        self._count("hits", hit, lookup)
        miss = ~hit
        any_miss = bool(miss.any())
        storage_rows = storage_index = storage_tables = rows.new_empty(0)
        on_storage = None
        clock.lap("other")
        if any_miss:
            missing, miss_inverse, uses = torch.unique(rows[miss], return_inverse=True, return_counts=True)
            clock.lap("lookup")
            assignment = cache.assign(missing, self._pin_since, window)
            if assignment.victim_slots.numel():
                self.storage.write(
                    assignment.victim_rows,
                    cache.weights[assignment.victim_slots],
                    self.config.rounding,
                    self._generator,
                )
                self._count_rows("evictions", assignment.victim_rows)
                self._count_rows("rows_out", assignment.victim_rows)
            clock.lap("evict")
            admitted = assignment.slots >= 0
            if bool(admitted.any()):
                admitted_rows = missing[admitted]
                cache.install(
                    assignment.slots[admitted],
                    admitted_rows,
                    self.storage.read(admitted_rows, self.device),
                    step,
                    uses[admitted],
                )
            clock.lap("fill")
            slots[miss] = assignment.slots[miss_inverse]
            self._count("misses", miss, lookup)
            missing_tables = self._tables_of(missing)
            self._count_tables("rows_in", missing_tables)
            if not bool(admitted.all()):
                left_out = ~admitted
                storage_rows, storage_tables = missing[left_out], missing_tables[left_out]
                on_storage = slots < 0
                if storage_rows.numel() == missing.numel():
                    storage_index = miss_inverse  # nothing was admitted
                else:
                    position = torch.cumsum(left_out, 0) - 1
                    storage_index = position[miss_inverse][assignment.slots[miss_inverse] < 0]
                self._count_tables("overflow_rows", storage_tables)
        clock.lap("other")
        storage_values = (
            self.storage.read(storage_rows, self.device)
            if storage_rows.numel()
            else rows.new_empty(0, self.dim, dtype=torch.float32)
        )
        clock.lap("fill")
        all_on_storage = storage_index.numel() == rows.numel() and rows.numel() > 0
        if prefetch and window is not None and len(window) and cache.capacity:
            self._start_prefetch(window, storage_rows)
        clock.lap("other")
        return _StepPlan(
            slots, on_storage, storage_rows, storage_index, storage_values, storage_tables, all_on_storage
        )

    def _gather(self, plan: _StepPlan) -> Tensor:
        if plan.on_storage is None:
            return self.cache.weights.index_select(0, plan.slots)
        if plan.all_on_storage:
            return plan.storage_values.index_select(0, plan.storage_index)
        values = torch.empty(plan.slots.numel(), self.dim, device=self.device)
        cached = ~plan.on_storage
        values[cached] = self.cache.weights[plan.slots[cached]]
        values[plan.on_storage] = plan.storage_values[plan.storage_index]
        return values

    def _apply_gradients(self, plan: _StepPlan, grad: Tensor, lookup: _Lookup) -> None:
        """The fused optimizer: update cached rows in place, the others in fp32 and round them back."""
        cached = None if plan.on_storage is None else ~plan.on_storage
        slots = plan.slots if cached is None else plan.slots[cached]
        cached_grad = grad if cached is None else grad[cached]
        if slots.numel() and not plan.all_on_storage:
            if self.config.optimizer == "sgd" and _native.usable(self.cache.weights, slots):
                _native.sgd_update(self.cache.weights, slots, cached_grad, self.lr)
            elif self.config.optimizer == "sgd":
                # index_put_ with accumulate sums repeated slots and is faster than index_add_ on CPU
                self.cache.weights.index_put_((slots,), cached_grad * -self.lr, accumulate=True)
            else:
                unique_slots, inverse = torch.unique(slots, return_inverse=True)
                summed = self._sum_rows(inverse, cached_grad, unique_slots.numel())
                rows = self.cache.slot_rows[unique_slots].long()
                self.cache.weights.index_add_(0, unique_slots, self._adagrad_step(rows, summed))
        if plan.storage_rows.numel():
            storage_grad = grad if plan.all_on_storage else grad[plan.on_storage]
            summed = self._sum_rows(plan.storage_index, storage_grad, plan.storage_rows.numel())
            if self.config.optimizer == "sgd":
                updated = plan.storage_values.add_(summed, alpha=-self.lr)
            else:
                updated = plan.storage_values.add_(self._adagrad_step(plan.storage_rows, summed))
            self.storage.write(plan.storage_rows, updated, self.config.rounding, self._generator)
            self._count_tables("rows_out", plan.storage_tables)
        self._pin_since = self.step + 1

    def _sum_rows(self, index: Tensor, values: Tensor, count: int) -> Tensor:
        """Rows of `values` summed by `index` into [count, D]."""
        summed = values.new_zeros(count, self.dim)
        if _native.usable(summed, index):
            _native.sgd_update(summed, index, values, -1.0)  # summed[index[i]] += values[i]
        else:
            summed.index_put_((index,), values, accumulate=True)
        return summed

    def _adagrad_step(self, rows: Tensor, grad: Tensor) -> Tensor:
        """Accumulate squared gradients of unique `rows` and return the update to add."""
        state = self.optimizer_state
        state_rows = rows.to(state.device)
        if self.config.optimizer == "adagrad":
            accumulated = state[state_rows].to(self.device) + grad * grad
            denominator = accumulated.sqrt() + self.config.eps
        else:
            accumulated = state[state_rows].to(self.device) + grad.pow(2).mean(dim=1)
            denominator = (accumulated.sqrt() + self.config.eps)[:, None]
        state[state_rows] = accumulated.to(state.device)
        return grad / denominator * -self.lr

    def flush(self) -> None:
        """Round every cached row back into storage; the cache keeps its contents."""
        self._join_prefetch()
        slots, rows = self.cache.cached()
        for start in range(0, slots.numel(), _INIT_CHUNK_ROWS):
            chunk_slots, chunk_rows = (
                slots[start : start + _INIT_CHUNK_ROWS],
                rows[start : start + _INIT_CHUNK_ROWS],
            )
            self.storage.write(
                chunk_rows, self.cache.weights[chunk_slots], self.config.rounding, self._generator
            )
        self._count_rows("rows_out", rows)

    def release_rows(self, rows: Tensor) -> int:
        """Write cached `rows` back and free their slots (e.g. rows found stale); returns how many."""
        self._join_prefetch()
        slots = self.cache.lookup(rows.to(self.device))
        slots = slots[slots >= 0]
        if slots.numel():
            resident = self.cache.slot_rows[slots].long()
            self.storage.write(resident, self.cache.weights[slots], self.config.rounding, self._generator)
            self.cache.evict(slots)
            self._count_rows("rows_out", resident)
        return int(slots.numel())

    # ----------------------------------------------------------------------------------- statistics
    def _count(self, name: str, mask: Tensor | None, lookup: _Lookup) -> None:
        """Add per-table counts of lookups (all, or those where `mask`)."""
        column = COUNTERS.index(name)
        num_tables = len(self.table_sizes)
        if lookup.bag_of_value is None:
            if mask is None:
                self.counters[:, column] += lookup.batch_size
            else:
                self.counters[:, column] += mask.view(-1, num_tables).sum(dim=0)
        else:
            tables = lookup.bag_of_value // max(lookup.batch_size, 1)
            if mask is not None:
                tables = tables[mask]
            self.counters[:, column] += torch.bincount(tables, minlength=num_tables)

    def _tables_of(self, rows: Tensor) -> Tensor:
        return torch.searchsorted(self.table_offsets, rows.to(self.device), right=True) - 1

    def _count_tables(self, name: str, tables: Tensor, counters: Tensor | None = None) -> None:
        counters = self.counters if counters is None else counters
        counters[:, COUNTERS.index(name)] += torch.bincount(tables, minlength=len(self.table_sizes))

    def _count_rows(self, name: str, rows: Tensor, counters: Tensor | None = None) -> None:
        self._count_tables(name, self._tables_of(rows), counters)

    def reset_stats(self) -> None:
        self._join_prefetch()
        self.counters.zero_()
        self.prefetched_rows = 0

    def stats(self) -> dict[str, Any]:
        """Cumulative lookups, hits, misses, evictions and traffic, in total and per table."""
        self._join_prefetch()
        bytes_per_row = self.storage.bytes_per_row
        per_table_counts = self.counters.cpu().tolist()

        def summarize(counts: list[int]) -> dict[str, Any]:
            entry = dict(zip(COUNTERS, counts, strict=True))
            entry["bytes_in"] = entry["rows_in"] * bytes_per_row
            entry["bytes_out"] = entry["rows_out"] * bytes_per_row
            entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
            return entry

        totals = summarize([sum(column) for column in zip(*per_table_counts, strict=True)])
        totals["per_table"] = [
            {"table": name, **summarize(c)}
            for name, c in zip(self.table_names, per_table_counts, strict=True)
        ]
        totals["cache_rows"] = self.cache.capacity
        totals["prefetched_rows"] = self.prefetched_rows
        return totals

    def memory_report(self) -> dict[str, Any]:
        """Bytes of every tensor this module holds, by component, against plain fp32 tables."""
        components = dict.fromkeys(
            (
                "storage_payload",
                "quantization_params",
                "cache_rows",
                "cache_bookkeeping",
                "optimizer_state",
                "other",
            ),
            0,
        )
        for name, buffer in self.named_buffers():
            components[_component_of(name)] += buffer.numel() * buffer.element_size()
        if self._generator is not None:
            components["other"] += self._generator.get_state().numel()
        if self._prefetch_generator is not None:
            components["other"] += self._prefetch_generator.get_state().numel()
        total = sum(components.values())
        fp32 = self.config.num_rows * self.dim * 4 + components["optimizer_state"]
        return {
            "components": components,
            "total_bytes": total,
            "fp32_bytes": fp32,
            "memory_ratio": fp32 / total,
        }

    # ------------------------------------------------------------------------------------ lookahead
    def set_lookahead(self, upcoming: list[Tensor | SparseFeatures], prefetch: bool = False) -> None:
        """The ids of the batches after the next training step's (e.g. `BatchIterator.peek(k)`), for that
        step only: the lookahead policy evicts by their use, and with `prefetch` the first one's missing
        rows are brought into the cache in the background while that step computes (a thread on CPU, a
        side stream on GPU), never in place of a row of the batch in flight or of the next one.

        Why per step: a window left over from an earlier step would be off by one batch.
        """
        known = {id(features): rows for features, rows in self._upcoming_rows}
        self._upcoming_rows = [
            (features, known[id(features)] if id(features) in known else torch.unique(self._prepare(features).rows))
            for features in upcoming
        ]
        self._window = Window([rows for _, rows in self._upcoming_rows])
        self._prefetch_next = prefetch

    def _start_prefetch(self, window: Window, in_storage: Tensor) -> None:
        """Run `_prefetch` for the window's first batch in the background; `_join_prefetch` waits for it."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipcache-prefetch")
        if self._prefetch_generator is None:
            self._prefetch_generator = self._new_prefetch_generator()
        args = (window, in_storage, self._pin_since, self.step)
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))  # this step's work first

            def on_side_stream() -> tuple[Tensor, int]:
                with torch.cuda.stream(self._side_stream):
                    return self._prefetch(*args)

            self._pending = self._executor.submit(on_side_stream)
        else:
            self._pending = self._executor.submit(self._prefetch, *args)

    def _prefetch(self, window: Window, in_storage: Tensor, pin_since: int, step: int) -> tuple[Tensor, int]:
        """Install the missing rows of the window's first batch (run while step `step` computes).

        Touches only what that step does not: slots of rows outside its batch (pinned from `pin_since`)
        and of the next batch's, and rows not served from storage by it (`in_storage`, which its backward
        writes). Counts go to a tensor of their own, added to the counters on join.
        """
        cache, counts = self.cache, torch.zeros_like(self.counters)
        rows = window.batches[0]
        slots = cache.lookup(rows)
        hit = slots >= 0
        cache.last_used[slots[hit]] = step + 1  # the next step's rows stay; its lookup will say so too
        missing = rows[~hit]
        if in_storage.numel():
            missing = missing[~torch.isin(missing, in_storage)]
        assignment = cache.assign(missing, pin_since, window)
        if assignment.victim_slots.numel():
            victims = assignment.victim_rows
            self.storage.write(
                victims, cache.weights[assignment.victim_slots], self.config.rounding, self._prefetch_generator
            )
            self._count_rows("evictions", victims, counts)
            self._count_rows("rows_out", victims, counts)
        admitted = assignment.slots >= 0
        rows_in = missing[admitted]
        if rows_in.numel():
            cache.install(
                assignment.slots[admitted],
                rows_in,
                self.storage.read(rows_in, self.device),
                step + 1,
                torch.zeros_like(rows_in),  # LFU: the next step's lookup counts the uses
            )
            self._count_rows("rows_in", rows_in, counts)
        return counts, int(rows_in.numel())

    def _join_prefetch(self) -> None:
        """Wait for the prefetch in flight, if any, and take in its counts (its errors surface here)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        counts, admitted = pending.result()
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.counters += counts
        self.prefetched_rows += admitted

    # ----------------------------------------------------------------------------------- state dict
    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._join_prefetch()  # the saved cache includes the prefetched rows, so a resumed run matches
        super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._join_prefetch()
        super()._load_from_state_dict(*args, **kwargs)

    def get_extra_state(self) -> dict[str, Any]:
        config = asdict(self.config)
        return {
            "step": self.step,
            "pin_since": self._pin_since,
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
        self.step, self._pin_since, self.lr = state["step"], state["pin_since"], state["lr"]
        if self._generator is not None and state["generator"] is not None:
            self._generator.set_state(state["generator"])
        if self._generator is not None and state.get("prefetch_generator") is not None:
            self._prefetch_generator = self._new_prefetch_generator()
            self._prefetch_generator.set_state(state["prefetch_generator"])

    def _new_prefetch_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.config.seed + 1)

    @classmethod
    def estimate_memory(cls, config: EmbeddingConfig) -> dict[str, Any]:
        """The memory report of a collection with this config, without allocating it."""
        meta = EmbeddingConfig(**{**asdict(config), "storage_device": "meta", "cache_device": "meta"})
        report = cls(meta).memory_report()
        # The stochastic-rounding generator state (not built on the meta device).
        report["components"]["other"] += torch.Generator().get_state().numel()
        report["total_bytes"] = sum(report["components"].values())
        report["memory_ratio"] = report["fp32_bytes"] / report["total_bytes"]
        return report


_STATE_KEYS = ("table_sizes", "dim", "precision", "cache_size", "policy", "optimizer", "ways")


def _component_of(buffer_name: str) -> str:
    if buffer_name == "storage.payload":
        return "storage_payload"
    if buffer_name.startswith("storage."):
        return "quantization_params"
    if buffer_name == "cache.weights":
        return "cache_rows"
    if buffer_name.startswith("cache."):
        return "cache_bookkeeping"
    if buffer_name == "optimizer_state":
        return "optimizer_state"
    return "other"
