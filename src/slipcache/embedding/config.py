"""`EmbeddingConfig`: the tables, storage precision, cache and fused optimizer of a collection.

Validated on construction, so a bad setting fails where it is written, not at the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slipcache.embedding.cache import POLICIES
from slipcache.embedding.hostmem import HUGE_PAGE_MODES
from slipcache.embedding.quant import PRECISIONS, ROUNDINGS
from slipcache.errors import SettingError

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
FLOAT32_MAX = 3.4028234663852886e38  # the fused optimizer computes in fp32: a larger lr would be inf
POOLINGS = ("sum", "mean")
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
    eps: float = 1e-8  # Adagrad's and Adam's denominator term
    # Adam's decay rates of the gradient's first and second moments (its state: both, per value)
    beta1: float = 0.9
    beta2: float = 0.999
    # L2 weight decay: each updated row's gradient gains weight_decay * row (rows a step does not touch
    # are left alone, as in TorchRec's fused tables). 0: none.
    weight_decay: float = 0.0
    # Clip each step's embedding gradient to this L2 norm, as torch.nn.utils.clip_grad_norm_ would over the
    # tables alone (that function cannot see these rows: they are updated inside backward). None: no clipping.
    max_grad_norm: float | None = None
    pooling: str = "sum"
    ways: int = 16  # cache associativity
    lfu_halving_interval: int = 1000  # LFU counts halve every this many steps; 0: never
    seed: int = 0
    storage_device: str = "cpu"
    # A directory for the row storage in memory-mapped files (tables larger than RAM; docs/scale.md): only
    # the cache, optimizer state and bookkeeping then count against memory. None: storage in RAM.
    storage_path: str | None = None
    cache_device: str = "cpu"
    # Whether the big host tensors (storage, cache, optimizer state) ask for 2 MiB pages: off, on, or auto
    # (tensors of 64 MiB and more); where the kernel has none, every mode allocates as torch does.
    huge_pages: str = "off"
    table_names: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        self.table_sizes = [int(n) for n in self.table_sizes]
        if not self.table_sizes or any(n <= 0 for n in self.table_sizes):
            raise SettingError(
                "table_sizes", f"table_sizes must be a non-empty list of positive row counts, got {self.table_sizes}"
            )
        if self.dim <= 0:
            raise SettingError("dim", f"dim must be positive, got {self.dim}")
        num_tables = len(self.table_sizes)
        for name in ("precision", "cache_size", "cache_rows"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                if len(value) != num_tables:
                    raise SettingError(
                        name, f"{name} must be one value or one per table ({num_tables}), got {len(value)}"
                    )
                setattr(self, name, list(value))
        for precision in self.precisions:
            if precision not in PRECISIONS:
                raise SettingError("precision", f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("rounding", self.rounding, ROUNDINGS),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("pooling", self.pooling, POOLINGS),
            ("huge_pages", self.huge_pages, HUGE_PAGE_MODES),
        ):
            if value not in allowed:
                raise SettingError(name, f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        shares = self.cache_size if isinstance(self.cache_size, list) else [self.cache_size]
        for share in shares:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                hint = more = ""
                if isinstance(share, (int, float)) and share > 1:
                    hint = f"; for a number of rows use cache_rows={share:g}"
                    more = f" (for a number of rows use {{cache_rows}} {share:g})"  # the caller names cache_rows
                message = f"cache_size is the share of rows cached, in [0, 1]; got {share}{hint}"
                raise SettingError("cache_size", message, f"is the share of rows cached in [0, 1]; got {share}{more}")
        counts = self.cache_rows if isinstance(self.cache_rows, list) else [self.cache_rows]
        for count in counts:
            if count is not None and (
                isinstance(count, bool)
                or not isinstance(count, (int, float))
                or int(count) != count
                or count < 0
            ):
                raise SettingError("cache_rows", f"cache_rows must be a whole number of rows >= 0, got {count!r}")
        if not 0 <= self.lr <= FLOAT32_MAX:  # 0: the tables stay still (a schedule's warm-up or end)
            short = "must be >= 0" if not self.lr >= 0 else f"must fit a float32 (<= {FLOAT32_MAX:.4g})"
            raise SettingError("lr", f"lr must be a number >= 0 within fp32's range (<= {FLOAT32_MAX:.4g}), got "
                               f"{self.lr}", predicate=f"{short}, got {self.lr}")
        if not 0 < self.eps < math.inf:
            raise ValueError(f"eps (Adagrad's denominator term) must be a positive finite number, got {self.eps}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} (Adam's moment decay) must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.ways <= 0:
            raise ValueError(f"ways must be positive, got {self.ways}")
        if isinstance(self.lfu_halving_interval, bool) or not isinstance(self.lfu_halving_interval, int) or (
            self.lfu_halving_interval < 0
        ):
            raise ValueError(
                "lfu_halving_interval must be a whole number of steps >= 0 (0: never), "
                f"got {self.lfu_halving_interval!r}"
            )
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
        share, count = self.cache_size, self.cache_rows
        assert not isinstance(share, list) and not isinstance(count, list)  # one cache: single values
        return _capacity(self.num_rows, share, count)


def _capacity(rows: int, share: float, count: int | None) -> int:
    if count is not None:
        return min(int(count), rows)
    if share == 0:
        return 0
    return min(rows, max(1, round(share * rows)))


