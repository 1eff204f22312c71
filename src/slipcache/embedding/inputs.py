"""The collection's input boundary: ids or `SparseFeatures` validated once and turned into global rows
(`_Lookup`), and the pooling of looked-up rows into bags and its gradient back (`LookupInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slipcache.embedding import kernels
from slipcache.embedding.scratch import Scratch
from slipcache.errors import InvalidInputError

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


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


# An input torch.export takes: its tensors are the program's inputs, num_tables a constant of it.
torch.export.register_dataclass(SparseFeatures, serialized_type_name="slipcache.SparseFeatures")


@dataclass
class _Lookup:
    """One batch's lookups: global rows in bag order and how they pool."""

    rows: Tensor  # [L] global rows
    batch_size: int
    bag_of_value: Tensor | None  # [L] bag of each value; None when each bag holds exactly one id
    value_weight: Tensor | None  # [L] 1 / bag length for mean pooling


class LookupInputs:
    """Input validation and pooling over tables of `table_sizes` rows of `dim` values.

    `table_offsets` [T + 1] and `table_sizes` [T] are the collection's buffers, handed over again with
    `bind` after they moved; lookups are made on their device.
    """

    def __init__(
        self,
        table_sizes: list[int],
        table_names: list[str],
        dim: int,
        pooling: str,
        scratch: Scratch,
        table_offsets: Tensor,
        size_tensor: Tensor,
    ) -> None:
        self.table_sizes, self.table_names, self.dim, self.pooling = table_sizes, table_names, dim, pooling
        self.num_rows = sum(table_sizes)
        self.scratch = scratch
        self.bind(table_offsets, size_tensor)

    def bind(self, table_offsets: Tensor, size_tensor: Tensor) -> None:
        self.table_offsets, self._table_sizes = table_offsets, size_tensor
        self.device = table_offsets.device

    def prepare(self, features: Tensor | SparseFeatures) -> _Lookup:
        """Validate input once, at the boundary, and turn it into global rows."""
        num_tables = len(self.table_sizes)
        if isinstance(features, SparseFeatures):
            return self.prepare_sparse(features)
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
        rows, bad = kernels.global_rows(ids, self.table_offsets, self._table_sizes, self.scratch)
        if bad is not None:
            self._raise_out_of_range(*bad)
        return _Lookup(rows, ids.shape[0], None, None)

    def prepare_sparse(self, features: SparseFeatures) -> _Lookup:
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
        if self.pooling == "mean":
            weight = 1.0 / lengths.clamp_min(1).float()[bag_of_value]
        return _Lookup(values + self.table_offsets[table_of_value], batch_size, bag_of_value, weight)

    def _raise_out_of_range(self, table: int, value: int) -> None:
        size = self.table_sizes[table]
        raise InvalidInputError(f"{self.table_names[table]} (size {size}): id {value} is outside [0, {size})")

    def check_rows(self, rows: Tensor, caller: str) -> Tensor:
        """Global rows as int64 on the cache device; anything but a 1-D integer tensor in range is refused."""
        if not isinstance(rows, Tensor) or rows.dtype not in _INTEGER_DTYPES or rows.dim() != 1:
            shape = tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__
            dtype = rows.dtype if isinstance(rows, Tensor) else ""
            raise InvalidInputError(f"{caller}: rows must be a 1-D integer tensor, got {dtype} {shape}")
        rows = rows.to(self.device, torch.int64)
        lo, hi = (int(v) for v in torch.aminmax(rows)) if rows.numel() else (0, 0)
        if lo < 0 or hi >= self.num_rows:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(
                f"{caller}: row {bad} is outside [0, {self.num_rows}) (global rows of all tables)"
            )
        return rows

    def traced_rows(self, features: Tensor | SparseFeatures) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`prepare` in torch operations only, unchecked (a traced program cannot raise on a value): the
        global rows, and for bags each value's bag and its mean-pooling weight."""
        if isinstance(features, Tensor):
            return (features.to(self.device, torch.int64) + self.table_offsets[:-1]).reshape(-1), None, None
        values, offsets = features.values.to(self.device, torch.int64), features.offsets.to(self.device, torch.int64)
        bag = torch.searchsorted(offsets[1:], torch.arange(values.numel(), device=self.device), right=True)
        rows = values + self.table_offsets[bag // features.batch_size]
        weight = 1.0 / offsets.diff().clamp_min(1).float()[bag] if self.pooling == "mean" else None
        return rows, bag, weight

    def traced_pool(self, values: Tensor, bag: Tensor | None, weight: Tensor | None, batch_size: int) -> Tensor:
        """`pool` in torch operations only: the bags' sums (or means) [batch, tables, dim]."""
        num_tables = len(self.table_sizes)
        if bag is None:
            return values.view(batch_size, num_tables, self.dim)
        weighted = values if weight is None else values * weight[:, None]
        pooled = torch.zeros(num_tables * batch_size, self.dim, device=values.device).index_add(0, bag, weighted)
        return pooled.view(num_tables, batch_size, self.dim).transpose(0, 1)

    def pool(self, values: Tensor, lookup: _Lookup) -> Tensor:
        num_tables = len(self.table_sizes)
        if lookup.bag_of_value is None:
            return values.view(lookup.batch_size, num_tables, self.dim)
        bags, weight = lookup.bag_of_value, lookup.value_weight
        pooled = kernels.pool_bags(values, bags, weight, num_tables * lookup.batch_size)
        return pooled.view(num_tables, lookup.batch_size, self.dim).transpose(0, 1)

    def unpool(self, grad_out: Tensor, lookup: _Lookup) -> Tensor:
        """Gradient of the pooled output [B, T, D] -> gradient of each looked-up value [L, D]."""
        if lookup.bag_of_value is None:
            return grad_out.reshape(-1, self.dim)
        grad = grad_out.transpose(0, 1).reshape(-1, self.dim)[lookup.bag_of_value]
        if lookup.value_weight is not None:
            grad = grad * lookup.value_weight[:, None]
        return grad

