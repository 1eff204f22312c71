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
import sys
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from slipcache import _native
from slipcache.embedding.cache import POLICIES, RowCache
from slipcache.embedding.lookahead import Window
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS, Fitted, RowStorage, TableRowStorage
from slipcache.errors import InvalidInputError, SlipcacheError

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
POOLINGS = ("sum", "mean")
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "evictions",
    "rows_in",
    "rows_out",
    "overflow_rows",
    "saturated_values",  # values written beyond the storage's range, clamped (see quant.fit_to_range)
    "nonfinite_values",  # inf or NaN values written, replaced
)
_INIT_CHUNK_ROWS = 1 << 20
# Counter columns the fused forward adds to in its compiled pass.
_FUSED_COLUMNS = (COUNTERS.index("lookups"), COUNTERS.index("hits"), COUNTERS.index("misses"))


def _init_chunk_rows(dim: int) -> int:
    """Rows drawn at once at initialization: 2^20 up to dim 16 (as always), 64 MB of fp32 beyond."""
    return max(1, min(_INIT_CHUNK_ROWS, (1 << 24) // dim))

# A forward's cache rows stay pinned until its backward, until its graph is freed, or until this many
# later training forwards have run (then its rows may be evicted; its update still lands correctly).
PIN_STEPS = 8
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class EmbeddingConfig:
    """Tables, storage precision, cache and fused optimizer of a `CachedEmbeddingBagCollection`."""

    table_sizes: list[int]
    dim: int = 16
    # One value for all tables, or a list with one per table. One cache_size/cache_rows value: one cache
    # shared by all tables (rows compete for it); a list: each table gets its own part of the cache.
    precision: str | list[str] = "int8"
    cache_size: float | list[float] = 0.05  # share of rows cached, in [0, 1]: 1.0 holds every row; 0: none
    cache_rows: int | list[int] | None = None  # a row count instead of the share (capped at every row)
    policy: str = "lru"
    rounding: str = "stochastic"
    optimizer: str = "sgd"
    lr: float = 0.1
    eps: float = 1e-8  # Adagrad denominator term
    # Clip each step's embedding gradient to this L2 norm, as torch.nn.utils.clip_grad_norm_ would over the
    # tables alone (that function cannot see these rows: they are updated inside backward). None: no clipping.
    max_grad_norm: float | None = None
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
        num_tables = len(self.table_sizes)
        for name in ("precision", "cache_size", "cache_rows"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                if len(value) != num_tables:
                    raise ValueError(f"{name} must be one value or one per table ({num_tables}), got {len(value)}")
                setattr(self, name, list(value))
        for precision in self.precisions:
            if precision not in PRECISIONS:
                raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("rounding", self.rounding, ROUNDINGS),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("pooling", self.pooling, POOLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        shares = self.cache_size if isinstance(self.cache_size, list) else [self.cache_size]
        for share in shares:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                hint = ""
                if isinstance(share, (int, float)) and share > 1:
                    hint = f"; for a number of rows use cache_rows={share:g}"
                raise ValueError(f"cache_size is the share of rows cached, in [0, 1]; got {share}{hint}")
        counts = self.cache_rows if isinstance(self.cache_rows, list) else [self.cache_rows]
        for count in counts:
            if count is not None and (
                isinstance(count, bool)
                or not isinstance(count, (int, float))
                or int(count) != count
                or count < 0
            ):
                raise ValueError(f"cache_rows must be a whole number of rows >= 0, got {count!r}")
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.ways <= 0:
            raise ValueError(f"ways must be positive, got {self.ways}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm}")
        if self.table_names is not None and len(self.table_names) != len(self.table_sizes):
            raise ValueError("table_names must name every table")

    @property
    def num_rows(self) -> int:
        return sum(self.table_sizes)

    @property
    def precisions(self) -> list[str]:
        """The storage precision of each table."""
        if isinstance(self.precision, list):
            return list(self.precision)
        return [self.precision] * len(self.table_sizes)

    @property
    def cache_per_table(self) -> bool:
        """Whether each table has its own part of the cache (a list of sizes) or all share one."""
        return isinstance(self.cache_size, list) or isinstance(self.cache_rows, list)

    @property
    def cache_capacities(self) -> list[int]:
        """Requested cache rows of each table (a per-table cache only); every row of the table at most."""
        shares = self.cache_size if isinstance(self.cache_size, list) else [self.cache_size] * len(self.table_sizes)
        counts = self.cache_rows if isinstance(self.cache_rows, list) else [self.cache_rows] * len(self.table_sizes)
        return [
            0 if self.policy == "none" else _capacity(size, share, count)
            for size, share, count in zip(self.table_sizes, shares, counts, strict=True)
        ]

    @property
    def cache_capacity(self) -> int:
        """Requested cache capacity in rows, all tables together (the cache rounds up to whole sets)."""
        if self.cache_per_table:
            return sum(self.cache_capacities)
        if self.policy == "none":
            return 0
        return _capacity(self.num_rows, self.cache_size, self.cache_rows)


def _capacity(rows: int, share: float, count: int | None) -> int:
    if count is not None:
        return min(int(count), rows)
    if share == 0:
        return 0
    return min(rows, max(1, round(share * rows)))


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
    """Where each lookup of a training forward lived, kept until its gradient arrives.

    The slots and the storage copy are only a shortcut: when the cache's residency or the storage changed
    since the forward (another forward, `release_rows`, `flush`), the backward locates the rows again, so an
    update always lands on the row's current value wherever the row now lives.
    """

    step: int
    rows: Tensor  # [L] global rows
    slots: Tensor  # [L] cache slot per lookup, -1 when served from storage
    storage_rows: Tensor  # [m] unique rows served from storage
    storage_index: Tensor  # index into storage_rows of each lookup with slot -1, in lookup order
    storage_values: Tensor  # [m, D] fp32 copy of those rows as read in the forward
    residency_version: int  # the collection's versions when the plan was made
    storage_version: int
    gathered: Tensor | None = None  # [L, D] values the fused forward already gathered (taken by the forward)


class _FusedLookup(torch.autograd.Function):
    """Pooled embeddings forward; the optimizer update at the end of the backward pass (no dense gradient).

    Every forward's gradient is collected as its backward node runs; the update is applied once, after the
    whole backward pass, on the gradient summed per row: a table read by several features (or called
    several times) within one step takes one optimizer step, as `nn.EmbeddingBag` + a torch optimizer does.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, coll: CachedEmbeddingBagCollection, lookup: _Lookup, plan: _StepPlan
    ) -> Tensor:
        ctx.coll, ctx.lookup, ctx.plan = coll, lookup, plan
        coll.clock.mark()
        values, plan.gathered = (plan.gathered if plan.gathered is not None else coll._gather(plan)), None
        pooled = coll._pool(values, lookup)
        coll.clock.lap("forward")
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        coll, lookup, plan = ctx.coll, ctx.lookup, ctx.plan
        if plan is None:
            raise SlipcacheError(
                "a second backward through the same embedding lookup (retain_graph=True): its update was "
                "applied by the first; run the forward again for another update"
            )
        ctx.coll = ctx.lookup = ctx.plan = None
        coll.clock.mark()
        grad = coll._unpool(grad_out, lookup)
        coll.clock.lap("backward")
        coll._receive_gradient(plan, grad)
        return None, None, None, None


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
        measure precision alone. Chunks of at most 64 MB of fp32 bound the memory it takes.
        """
        generator = torch.Generator().manual_seed(self.config.seed)
        chunk_rows = _init_chunk_rows(self.dim)
        start = 0
        for size in self.table_sizes:
            bound = 1.0 / math.sqrt(size)
            for chunk_start in range(0, size, chunk_rows):
                count = min(chunk_rows, size - chunk_start)
                values = (torch.rand(count, self.dim, generator=generator) * 2 - 1) * bound
                self.storage.write_range(start + chunk_start, values.to(self.storage_device), "nearest", None)
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
            plan = self._plan_step(lookup)
            return _FusedLookup.apply(self._anchor, self, lookup, plan)
        return self._pool(self._read_rows(lookup.rows), lookup)

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
        if ids.numel() and _native.usable(ids, self.table_offsets):
            scratch = self._scratch("rows", (ids.numel(),), torch.int64)
            rows, bad = _native.global_rows(ids.contiguous(), self.table_offsets, scratch)
            if bad >= 0:
                self._raise_out_of_range(bad % num_tables, int(ids.reshape(-1)[bad]))
            return _Lookup(rows, ids.shape[0], None, None)
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

    def _pin_since(self) -> int:
        """Oldest step whose cache rows are still pinned: in-flight forwards within `PIN_STEPS`."""
        oldest = self.step
        for step, ref in list(self._in_flight.items()):
            if ref() is None or step <= self.step - PIN_STEPS:
                del self._in_flight[step]
            else:
                oldest = min(oldest, step)
        return oldest

    def _plan_step(self, lookup: _Lookup) -> _StepPlan:
        """Bring the batch's rows into the cache where they fit; read the rest from storage."""
        self._join_prefetch()
        window, self._window = self._window, None  # a window describes the batches after this one only
        prefetch, self._prefetch_next = self._prefetch_next, False
        self.step += 1
        step, rows, cache, clock = self.step, lookup.rows, self.cache, self.clock
        clock.mark()
        if not cache.capacity:
            return self._plan_uncached(lookup, step)
        # The fused path: one compiled pass probes, touches, counts and copies every hit's row into the
        # forward's output; only the missed positions are filled below. Multi-hot bags pool in torch.
        gathered = fused = None
        if lookup.bag_of_value is None and cache.capacity and not cache.partitioned:
            gathered = self._scratch("gathered", (rows.numel(), self.dim), torch.float32)
            slots = self._scratch("slots", (rows.numel(),), torch.int64)
            fused = cache.gather_and_touch(
                rows, len(self.table_sizes), gathered, self.counters, _FUSED_COLUMNS, step, slots
            )
        if fused is not None:
            slots, hits = fused
            any_miss = hits < rows.numel()
            miss = slots < 0 if any_miss else None
        else:
            gathered = None
            slots = cache.lookup_and_touch(rows, step)
            hit = slots >= 0
            self._count("lookups", None, lookup)
            self._count("hits", hit, lookup)
            miss = ~hit
            any_miss = bool(miss.any())
        clock.lap("lookup")
        storage_rows = storage_index = rows.new_empty(0)
        if any_miss:
            positions = torch.nonzero(miss).squeeze(1)  # found once, used for every write below
            missing, miss_inverse, uses = torch.unique(
                rows.index_select(0, positions), return_inverse=True, return_counts=True
            )
            clock.lap("lookup")
            assignment = cache.assign(missing, self._pin_since(), window)
            if assignment.victim_slots.numel():
                victim_tables = self._write_storage(assignment.victim_rows, cache.weights[assignment.victim_slots])
                self._count_tables("evictions", victim_tables)
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
                self._residency_version += 1
            clock.lap("fill")
            slots.index_copy_(0, positions, assignment.slots[miss_inverse])
            if fused is None:
                self._count("misses", miss, lookup)
            missing_tables = self._tables_of(missing)
            self._count_tables("rows_in", missing_tables)
            if not bool(admitted.all()):
                left_out = ~admitted
                storage_rows = missing[left_out]
                if storage_rows.numel() == missing.numel():
                    storage_index = miss_inverse  # nothing was admitted
                else:
                    position = torch.cumsum(left_out, 0) - 1
                    storage_index = position[miss_inverse][assignment.slots[miss_inverse] < 0]
                self._count_tables("overflow_rows", missing_tables[left_out])
        clock.lap("other")
        storage_values = (
            self.storage.read(storage_rows, self.device)
            if storage_rows.numel()
            else rows.new_empty(0, self.dim, dtype=torch.float32)
        )
        plan = _StepPlan(
            step,
            rows,
            slots,
            storage_rows,
            storage_index,
            storage_values,
            self._residency_version,
            self._storage_version,
        )
        if gathered is not None and miss is not None:
            self._fill_missed(gathered, plan, positions)
        plan.gathered = gathered
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        if prefetch and window is not None and len(window) and cache.capacity:
            self._start_prefetch(window)
        clock.lap("other")
        return plan

    def _plan_uncached(self, lookup: _Lookup, step: int) -> _StepPlan:
        """Without a cache every lookup reads storage, each distinct row once (the general plan's outcome,
        without its cache bookkeeping). When writing rows back does not depend on their order (fp32 storage
        or nearest rounding: no random draws), they are found by hashing instead of sorting."""
        rows, clock = lookup.rows, self.clock
        self._pin_since()  # drops forwards whose graph is gone, as every training forward does
        self._count("lookups", None, lookup)
        self._count("misses", None, lookup)
        order_free = self.config.rounding == "nearest" or all(p == "fp32" for p in self.config.precisions)
        if order_free and _native.usable(rows):
            storage_rows, storage_index = _native.unique_rows(rows)
        else:
            storage_rows, storage_index = torch.unique(rows, return_inverse=True)
        clock.lap("lookup")
        tables = self._tables_of(storage_rows)
        self._count_tables("rows_in", tables)
        self._count_tables("overflow_rows", tables)
        clock.lap("other")
        plan = _StepPlan(
            step,
            rows,
            torch.full_like(rows, -1),
            storage_rows,
            storage_index,
            self.storage.read(storage_rows, self.device),
            self._residency_version,
            self._storage_version,
        )
        clock.lap("fill")
        self._in_flight[step] = weakref.ref(plan)
        return plan

    def _fill_missed(self, values: Tensor, plan: _StepPlan, positions: Tensor) -> None:
        """Write the rows of the lookups at `positions`, which missed the fused gather, into `values`: from
        their new cache slot, or from the storage copy when they found none."""
        slots = plan.slots[positions]
        if not plan.storage_rows.numel():
            values[positions] = self.cache.weights[slots]
            return
        cached = slots >= 0
        values[positions[cached]] = self.cache.weights[slots[cached]]
        values[positions[~cached]] = plan.storage_values[plan.storage_index]

    def _gather(self, plan: _StepPlan) -> Tensor:
        if not plan.storage_rows.numel():
            return self.cache.weights.index_select(0, plan.slots)
        if plan.storage_index.numel() == plan.slots.numel():
            return plan.storage_values.index_select(0, plan.storage_index)
        values = torch.empty(plan.slots.numel(), self.dim, device=self.device)
        cached = plan.slots >= 0
        values[cached] = self.cache.weights[plan.slots[cached]]
        values[~cached] = plan.storage_values[plan.storage_index]
        return values

    # ------------------------------------------------------------------------------ fused optimizer
    def _receive_gradient(self, plan: _StepPlan, grad: Tensor) -> None:
        """Collect one forward's gradient; the first one of a backward pass schedules the update."""
        self._in_flight.pop(plan.step, None)
        task = torch._C._current_graph_task_id()
        if self._pending and task != self._pending_task:
            # A backward pass that failed before its end: like a torch optimizer never stepped, its
            # gradients are dropped.
            self._pending.clear()
        first = not self._pending
        self._pending.append((plan, grad))
        if first:
            self._pending_task = task
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._apply_pending)
            except RuntimeError:  # not inside the autograd engine: apply now
                self._apply_pending()

    def _apply_pending(self) -> None:
        """The fused optimizer over every gradient of the backward pass, summed per row: one step per row."""
        entries, self._pending = self._pending, []
        if not entries:
            return
        self.clock.mark()
        if len(entries) == 1 and self._fused_update(*entries[0]):
            self.clock.lap("backward")
            return
        if not all(_finite(grad) for _, grad in entries):
            self.skipped_updates += 1  # a diverged step: keep every row as it was (counted in stats())
            return
        factor = self._gradient_factor(entries)
        if factor != 1.0:
            entries = [(plan, grad * factor) for plan, grad in entries]
        cache_parts: list[tuple[Tensor, Tensor]] = []  # (slots, gradient of each)
        storage_parts: list[tuple[_StepPlan, Tensor, Tensor, Tensor]] = []  # (plan, rows, index, gradient)
        for plan, grad in entries:
            slots, storage_rows, storage_index = plan.slots, plan.storage_rows, plan.storage_index
            if plan.residency_version != self._residency_version:  # rows moved since the forward
                slots = self.cache.lookup(plan.rows)
                storage_rows, storage_index = torch.unique(plan.rows[slots < 0], return_inverse=True)
            on_storage = slots < 0 if storage_rows.numel() else None
            if on_storage is None:
                cache_parts.append((slots, grad))
            elif storage_index.numel() == slots.numel():
                storage_parts.append((plan, storage_rows, storage_index, grad))
            else:
                cached = ~on_storage
                cache_parts.append((slots[cached], grad[cached]))
                storage_parts.append((plan, storage_rows, storage_index, grad[on_storage]))
        self._update_cached(cache_parts)
        self._update_storage(storage_parts)
        self.clock.lap("backward")

    def _fused_update(self, plan: _StepPlan, grad: Tensor) -> bool:
        """The common step in one compiled pass: one forward's SGD update on the cache slots its forward
        found (no second lookup), applied only if the whole gradient is finite; rows it served from storage
        then take the general storage update. Returns False, having done nothing, where the general path
        must run: another optimizer, a GradScaler or clipping (the gradient is rescaled), residency changed
        since the forward, no cache, or no compiled loop."""
        scaler = self.grad_scaler
        weights = self.cache.weights
        if (
            self.config.optimizer != "sgd"
            or (scaler is not None and scaler.is_enabled())
            or self.config.max_grad_norm is not None
            or plan.residency_version != self._residency_version
            or not self.cache.capacity
            or grad.dtype != torch.float32
            or not _native.usable(weights, plan.slots, grad)
        ):
            return False
        if not _native.sgd_update_finite(weights, plan.slots, grad, self.lr):
            self.skipped_updates += 1  # a diverged step: keep every row as it was (counted in stats())
            return True
        if plan.storage_rows.numel():
            self._update_storage([(plan, plan.storage_rows, plan.storage_index, grad[plan.slots < 0])])
        return True

    def _gradient_factor(self, entries: list[tuple[_StepPlan, Tensor]]) -> float:
        """1 / the GradScaler's scale, times clip_grad_norm_'s coefficient when clipping is on."""
        factor = 1.0
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            factor = 1.0 / float(scaler.get_scale())
        if self.config.max_grad_norm is not None:
            rows, inverse = torch.unique(torch.cat([plan.rows for plan, _ in entries]), return_inverse=True)
            summed = self._sum_rows(inverse, torch.cat([grad for _, grad in entries]), rows.numel())
            norm = float(summed.norm()) * factor  # the norm of the dense gradient of the tables
            factor *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        return factor

    def _update_cached(self, parts: list[tuple[Tensor, Tensor]]) -> None:
        weights = self.cache.weights
        if self.config.optimizer == "sgd":
            for slots, grad in parts:  # SGD is linear: one scatter per part equals the summed step
                if not slots.numel():
                    continue
                if _native.usable(weights, slots):
                    _native.sgd_update(weights, slots, grad, self.lr)
                else:
                    # index_put_ with accumulate sums repeated slots and is faster than index_add_ on CPU
                    weights.index_put_((slots,), grad * -self.lr, accumulate=True)
            return
        parts = [part for part in parts if part[0].numel()]
        if not parts:
            return
        slots = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        grad = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        unique_slots, inverse = torch.unique(slots, return_inverse=True)
        summed = self._sum_rows(inverse, grad, unique_slots.numel())
        rows = self.cache.slot_rows[unique_slots].long()
        weights.index_add_(0, unique_slots, self._adagrad_step(rows, summed))

    def _update_storage(self, parts: list[tuple[_StepPlan, Tensor, Tensor, Tensor]]) -> None:
        """Rows outside the cache: read, update in fp32, round back, once per row."""
        if not parts:
            return
        if len(parts) == 1:
            plan, rows, index, grad = parts[0]
            current = (
                plan.storage_version == self._storage_version
                and plan.residency_version == self._residency_version
            )
            values = plan.storage_values if current else self.storage.read(rows, self.device)
        else:
            rows, index = torch.unique(torch.cat([p[1][p[2]] for p in parts]), return_inverse=True)
            grad = torch.cat([p[3] for p in parts])
            values = self.storage.read(rows, self.device)
        summed = self._sum_rows(index, grad, rows.numel())
        if self.config.optimizer == "sgd":
            updated = values.add_(summed, alpha=-self.lr)
        else:
            updated = values.add_(self._adagrad_step(rows, summed))
        self._write_storage(rows, updated)

    def _write_storage(self, rows: Tensor, values: Tensor) -> Tensor:
        """Round fp32 `values` of unique `rows` into storage and count the traffic; returns their tables."""
        fitted = self.storage.write(rows, values, self.config.rounding, self._generator)
        self._storage_version += 1
        tables = self._tables_of(rows)
        self._count_tables("rows_out", tables)
        self._count_fitted(tables, fitted)
        return tables

    def _count_fitted(self, tables: Tensor, fitted: Fitted, counters: Tensor | None = None) -> None:
        counters = self.counters if counters is None else counters
        for name, per_row in (("saturated_values", fitted.saturated), ("nonfinite_values", fitted.nonfinite)):
            if per_row is not None:
                counts = torch.bincount(tables, weights=per_row.to(tables.device), minlength=len(self.table_sizes))
                counters[:, COUNTERS.index(name)] += counts.long()

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

    def _check_rows(self, rows: Tensor, caller: str) -> Tensor:
        """Global rows as int64 on the cache device; anything but a 1-D integer tensor in range is refused."""
        if not isinstance(rows, Tensor) or rows.dtype not in _INTEGER_DTYPES or rows.dim() != 1:
            shape = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
            dtype = rows.dtype if isinstance(rows, Tensor) else ""
            raise InvalidInputError(f"{caller}: rows must be a 1-D integer tensor, got {dtype} {shape}")
        rows = rows.to(self.device, torch.int64)
        lo, hi = (int(v) for v in torch.aminmax(rows)) if rows.numel() else (0, 0)
        if lo < 0 or hi >= self.config.num_rows:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(
                f"{caller}: row {bad} is outside [0, {self.config.num_rows}) (global rows of all tables)"
            )
        return rows

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
        per_table_counts = self.counters.cpu().tolist()

        def summarize(counts: list[int]) -> dict[str, Any]:
            entry = dict(zip(COUNTERS, counts, strict=True))
            entry["hit_rate"] = entry["hits"] / entry["lookups"] if entry["lookups"] else None
            return entry

        per_table = []
        for name, counts, row_bytes in zip(self.table_names, per_table_counts, self._row_bytes(), strict=True):
            entry = {"table": name, **summarize(counts)}
            entry["bytes_in"] = entry["rows_in"] * sum(row_bytes)
            entry["bytes_out"] = entry["rows_out"] * sum(row_bytes)
            per_table.append(entry)
        totals = summarize([sum(column) for column in zip(*per_table_counts, strict=True)])
        totals["bytes_in"] = sum(t["bytes_in"] for t in per_table)
        totals["bytes_out"] = sum(t["bytes_out"] for t in per_table)
        totals["per_table"] = per_table
        totals["cache_rows"] = self.cache.capacity
        totals["skipped_updates"] = self.skipped_updates  # backward passes dropped for inf/NaN gradients
        totals["prefetched_rows"] = self.prefetched_rows  # rows the prefetch brought in (also in rows_in)
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
        if self._generator is not None or self.device.type == "meta":  # (estimate_memory: as if built)
            components["other"] += torch.Generator().get_state().numel()
        if self._prefetch_generator is not None:
            components["other"] += self._prefetch_generator.get_state().numel()
        total = sum(components.values())
        fp32 = self.config.num_rows * self.dim * 4 + components["optimizer_state"]
        per_table = self._memory_per_table()
        return {
            "components": components,
            "total_bytes": total,
            "fp32_bytes": fp32,
            "memory_ratio": fp32 / total,
            "per_table": per_table,
            "shared_bytes": total - sum(t["total_bytes"] for t in per_table),
        }

    # ------------------------------------------------------------------------------------ lookahead
    def set_lookahead(self, upcoming: list[Tensor | SparseFeatures], prefetch: bool = False) -> None:
        """The ids of the batches after the next training step's (e.g. `BatchIterator.peek(k)`), for that
        step only: the lookahead policies evict by their use, and with `prefetch` the first one's missing
        rows are brought into the cache in the background while that step computes (a thread on CPU, a
        side stream on GPU), never in place of a row of a batch in flight or of the next one.

        Why per step: a window left over from an earlier step would be off by one batch.
        """
        known = {id(features): rows for features, rows in self._upcoming_rows}
        self._upcoming_rows = [
            (features, known[id(features)] if id(features) in known else torch.unique(self._prepare(features).rows))
            for features in upcoming
        ]
        self._window = Window([rows for _, rows in self._upcoming_rows])
        self._prefetch_next = prefetch

    def _start_prefetch(self, window: Window) -> None:
        """Run `_prefetch` for the window's first batch in the background; `_join_prefetch` waits for it.

        Rows every in-flight forward read from storage are left alone: their backward writes them there
        (with the shortcut of the values it read), so they must not be copied into the cache meanwhile.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipcache-prefetch")
        if self._prefetch_generator is None:
            self._prefetch_generator = self._new_prefetch_generator()
        pin_since = self._pin_since()
        live = [ref() for ref in self._in_flight.values()]
        in_storage = [plan.storage_rows for plan in live if plan is not None and plan.storage_rows.numel()]
        args = (window, torch.cat(in_storage) if in_storage else None, pin_since, self.step)
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))  # this step's work first

            def on_side_stream() -> tuple[Tensor, int]:
                with torch.cuda.stream(self._side_stream):
                    return self._prefetch(*args)

            self._prefetching = self._executor.submit(on_side_stream)
        else:
            self._prefetching = self._executor.submit(self._prefetch, *args)

    def _prefetch(
        self, window: Window, in_storage: Tensor | None, pin_since: int, step: int
    ) -> tuple[Tensor, int]:
        """Install the missing rows of the window's first batch (run while step `step` computes).

        Touches only what the running steps do not: slots of rows outside every in-flight batch (pinned
        from `pin_since`) and outside the next one, and rows none of them serves from storage. Counts go to
        a tensor of their own and the residency and storage versions are bumped on join, so a backward
        running meanwhile keeps the shortcuts its plan recorded (still valid: none of its rows moved).
        """
        cache, counts = self.cache, torch.zeros_like(self.counters)
        rows = window.batches[0]
        slots = cache.lookup(rows)
        hit = slots >= 0
        cache.last_used[slots[hit]] = step + 1  # the next step's rows stay; its lookup will say so too
        missing = rows[~hit]
        if in_storage is not None:
            missing = missing[~torch.isin(missing, in_storage)]
        assignment = cache.assign(missing, pin_since, window)
        if assignment.victim_slots.numel():
            victims = assignment.victim_rows
            fitted = self.storage.write(
                victims, cache.weights[assignment.victim_slots], self.config.rounding, self._prefetch_generator
            )
            tables = self._tables_of(victims)
            self._count_tables("evictions", tables, counts)
            self._count_tables("rows_out", tables, counts)
            self._count_fitted(tables, fitted, counts)
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
        pending, self._prefetching = self._prefetching, None
        if pending is None:
            return
        counts, admitted = pending.result()
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.counters += counts
        self.prefetched_rows += admitted
        self._residency_version += 1
        self._storage_version += 1

    def _new_prefetch_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.config.seed + 1)

    def _row_bytes(self) -> list[tuple[int, int]]:
        """(payload, quantization parameters) bytes of one row of each table."""
        if isinstance(self.storage, RowStorage):
            return [self.storage.row_bytes()] * len(self.table_sizes)
        return [self.storage.row_bytes_of(p) for p in self.config.precisions]

    def _memory_per_table(self) -> list[dict[str, Any]]:
        """Each table's bytes by component; the cache's only when each table has its own part (None when the
        tables share it). What no table owns (counters, a shared cache, index tables) is the difference to
        the totals: `shared_bytes`."""
        state = getattr(self, "optimizer_state", None)
        state_row = 0 if state is None else state[0].numel() * state.element_size()
        cache = self.cache
        per_slot_cache = self.dim * cache.weights.element_size()
        per_slot_bookkeeping = sum(
            getattr(cache, name).element_size() for name in ("slot_rows", "last_used", "use_count") if hasattr(cache, name)
        )
        tables = []
        for t, (size, (payload, params)) in enumerate(zip(self.table_sizes, self._row_bytes(), strict=True)):
            slots = cache.part_slots[t] if cache.partitioned else None
            entry = {
                "table": self.table_names[t],
                "precision": self.config.precisions[t],
                "storage_payload": size * payload,
                "quantization_params": size * params,
                "cache_rows": None if slots is None else slots * per_slot_cache,
                "cache_bookkeeping": None if slots is None else slots * per_slot_bookkeeping,
                "optimizer_state": size * state_row,
            }
            entry["total_bytes"] = sum(v for k, v in entry.items() if isinstance(v, int))
            entry["fp32_bytes"] = size * self.dim * 4 + entry["optimizer_state"]
            tables.append(entry)
        return tables

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


def _finite(values: Tensor) -> bool:
    if values.dtype == torch.float32 and _native.usable(values):
        return _native.all_finite(values)
    return bool(torch.isfinite(values).all())


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


def _component_of(buffer_name: str) -> str:
    if buffer_name.startswith("storage."):
        leaf = buffer_name.rsplit(".", 1)[1]
        if leaf == "payload":
            return "storage_payload"
        if leaf in ("bias", "scale_code"):
            return "quantization_params"
        return "other"  # the table -> part index of mixed precisions
    if buffer_name == "cache.weights":
        return "cache_rows"
    if buffer_name.startswith("cache."):
        return "cache_bookkeeping"
    if buffer_name == "optimizer_state":
        return "optimizer_state"
    return "other"
