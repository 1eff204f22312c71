"""The collection's row operations, each choosing once between its compiled loop and torch.

Every function here runs the compiled loop (`slipcache._native`) where the library is there and the tensors
are contiguous CPU tensors of the loop's dtype, and the torch code otherwise; the torch code is the
reference (tests compare the two). Callers never ask which ran. The cache's own loops (lookup, the fused
gather, slot assignment) choose in `RowCache`, the quantize pass in `RowStorage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from slipcache import _native

if TYPE_CHECKING:
    from slipcache.embedding.scratch import Scratch


def global_rows(
    ids: Tensor, offsets: Tensor, sizes: Tensor, scratch: Scratch
) -> tuple[Tensor, tuple[int, int] | None]:
    """(offsets[t] + ids[:, t] flattened, None) for int64 ids [B, T]; with an id outside its table
    `[0, sizes[t])`, (no usable rows, (table, id)). The compiled loop writes into the scratch buffer "rows"."""
    if ids.numel() and _native.usable(ids, offsets):
        rows, bad = _native.global_rows(ids, offsets, scratch.get("rows", (ids.numel(),), torch.int64))
        return rows, None if bad < 0 else (bad % ids.shape[1], int(ids.reshape(-1)[bad]))
    if ids.numel():
        lo, hi = ids.amin(dim=0), ids.amax(dim=0)
        bad_tables = (lo < 0) | (hi >= sizes)
        if bool(bad_tables.any()):
            t = int(torch.nonzero(bad_tables)[0])
            return ids, (t, int(lo[t]) if int(lo[t]) < 0 else int(hi[t]))
    return (ids + offsets[:-1]).reshape(-1), None


def pool_bags(values: Tensor, bags: Tensor, weight: Tensor | None, num_bags: int) -> Tensor:
    """Pooled bags [num_bags, D]: row bags[i] adds values[i] (times weight[i] when given), in value order."""
    if values.dtype == torch.float32 and _native.usable(values, bags, *([] if weight is None else [weight])):
        return _native.pool_bags(values, bags, weight, num_bags)  # one pass, without the weighted copy
    if weight is not None:
        values = values * weight[:, None]
    return values.new_zeros(num_bags, values.shape[1]).index_add_(0, bags, values)


def distinct_rows(rows: Tensor, any_order: bool = True) -> tuple[Tensor, Tensor]:
    """(distinct rows, index of each row there). With `any_order`, the compiled loop finds them by hashing
    (in order of first occurrence); else sorted, as `torch.unique` gives them (compiled: hashed, then the
    distinct rows radix-sorted)."""
    if _native.usable(rows) and rows.dtype == torch.int64:
        if any_order:
            return _native.unique_rows(rows)
        found = _native.sorted_unique(rows)
        if found is not None:
            return found[1], found[2]
    return torch.unique(rows, return_inverse=True)


def missing_rows(rows: Tensor, slots: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The lookups a forward missed (slot < 0): (their positions, their distinct rows ascending, the index of
    each there, the uses of each): `nonzero`, `index_select` and `torch.unique` with inverse and counts in
    one compiled pass where it can run, the same tensors."""
    if _native.usable(rows, slots) and rows.dtype == slots.dtype == torch.int64:
        found = _native.sorted_unique(rows, slots)
        if found is not None:
            positions, missing, inverse, uses = found
            assert positions is not None
            return positions, missing, inverse, uses
    positions = torch.nonzero(slots < 0).squeeze(1)
    missing, inverse, uses = torch.unique(rows.index_select(0, positions), return_inverse=True, return_counts=True)
    return positions, missing, inverse, uses


def fill_misses(
    positions: Tensor, inverse: Tensor, assigned: Tensor, slots: Tensor, weights: Tensor, out: Tensor | None
) -> bool:
    """`slots[positions] = assigned[inverse]`, and with `out` each of those lookups with a slot copied from
    `weights` into `out` (compiled, one pass). Without the loop (or `out`) only the slots are written, and
    False says the copies are the caller's."""
    if out is not None and _native.usable(positions, inverse, assigned, slots, weights, out):
        _native.fill_misses(positions, inverse, assigned, slots, weights, out)
        return True
    slots.index_copy_(0, positions, assigned[inverse])
    return False


def sum_rows(index: Tensor, values: Tensor, count: int) -> Tensor:
    """Rows of `values` [n, D] summed by `index` into [count, D], each sum in row order."""
    summed = values.new_zeros(count, values.shape[1])
    if _native.usable(summed, index):
        _native.sgd_update(summed, index, values, -1.0)  # summed[index[i]] += values[i]
    else:
        summed.index_put_((index,), values, accumulate=True)
    return summed


def sum_rows_if_finite(index: Tensor, values: Tensor, count: int) -> Tensor | None:
    """`sum_rows` when every value of `values` is finite, else None: compiled, the check is made in the
    summing pass (one read of `values` instead of two)."""
    if values.dtype == torch.float32 and _native.usable(index, values):
        return _native.sum_rows_finite(index, values, count)
    return sum_rows(index, values, count) if all_finite(values) else None


def sgd_scatter(weights: Tensor, slots: Tensor, grad: Tensor, lr: float) -> bool:
    """weights[slots[i]] -= lr * grad[i] (repeated slots add up); whether every row written is finite."""
    if _native.usable(weights, slots):
        return _native.sgd_update(weights, slots, grad, lr)
    # index_put_ with accumulate sums repeated slots and is faster than index_add_ on CPU
    weights.index_put_((slots,), grad * -lr, accumulate=True)
    return all_finite(weights.index_select(0, slots))


def sgd_scatter_if_finite(
    weights: Tensor, slots: Tensor, grad: Tensor, lr: float
) -> tuple[bool, bool] | None:
    """`sgd_scatter` of the lookups with a slot (-1: skipped), applied only if all of `grad` is finite, in one
    compiled pass: (applied, every value written finite); None, having done nothing, without the loop."""
    if grad.dtype != torch.float32 or not _native.usable(weights, slots, grad):
        return None
    return _native.sgd_update_finite(weights, slots, grad, lr)


def adagrad_update(
    target: Tensor,
    slots: Tensor | None,
    state: Tensor,
    rows: Tensor,
    grad: Tensor,
    lr: float,
    eps: float,
) -> bool:
    """Adagrad's step of unique `rows` (gradient summed per row) added to `target`'s rows at `slots` (row i
    when None); `state` holds a squared-gradient sum per value, or per row (row-wise: 1-D, the mean square).
    The compiled pass is within a few ulp of torch's, not bit for bit (see `_native.adagrad_update`).
    Returns False after an overflow at `slots`; with `slots` None nothing is checked."""
    tensors = (target, state, grad) if slots is None else (target, state, grad, slots)
    if all(t.dtype == torch.float32 for t in (target, state, grad)) and _native.usable(*tensors, rows):
        return _native.adagrad_update(target, slots, state, rows, grad, lr, eps) or slots is None
    state_rows = rows.to(state.device)
    if state.dim() > 1:
        accumulated = state[state_rows].to(target.device) + grad * grad
        denominator = accumulated.sqrt() + eps
    else:
        accumulated = state[state_rows].to(target.device) + grad.pow(2).mean(dim=1)
        denominator = (accumulated.sqrt() + eps)[:, None]
    state[state_rows] = accumulated.to(state.device)
    step = grad / denominator * -lr
    if slots is None:
        target.add_(step)
        return True
    target.index_add_(0, slots, step)
    return all_finite(target.index_select(0, slots))


def all_finite(values: Tensor) -> bool:
    """Whether every value is finite (compiled: one pass, no temporary as large as `values`)."""
    if values.dtype == torch.float32 and _native.usable(values):
        return _native.all_finite(values)
    return bool(torch.isfinite(values).all())
