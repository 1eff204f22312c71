"""The fused optimizer of `CachedEmbeddingBagCollection`: gradients collected as backward runs, then one
SGD, Adagrad, row-wise Adagrad or Adam step per row (with optional L2 weight decay), applied where the row
lives (cache slot in fp32, or storage: read, updated in fp32, rounded back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from slipcache.embedding import kernels
from slipcache.embedding.accounting import PhaseClock, TrafficCounters
from slipcache.embedding.cache import RowCache
from slipcache.embedding.config import EmbeddingConfig
from slipcache.embedding.hostmem import host_zeros
from slipcache.embedding.quant import VALUE_LIMIT, RowStorage, TableRowStorage, fit_to_range
from slipcache.embedding.writeback import RowWriter
from slipcache.torch_private import graph_task_id, queue_callback

if TYPE_CHECKING:
    from slipcache.embedding.plan import _StepPlan


class FusedOptimizer:
    """The optimizer update, run once at the end of each backward pass, over the given cache and storage.

    Owns the learning rate (0 is valid: the rows stay bit for bit, while Adagrad's sums and Adam's moments
    and step count go on as in torch's and TorchRec's optimizers), the optimizer state (`state`: Adagrad's
    squared-gradient sums, Adam's two moments side by side, None for SGD), the count of steps taken (Adam's
    bias correction), of skipped updates and the gradients of the running backward pass: they are applied
    together when the pass ends, so a row read several times in one step takes one step.
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        cache: RowCache,
        storage: RowStorage | TableRowStorage,
        writer: RowWriter,
        counters: TrafficCounters,
        clock: PhaseClock,
        state: Tensor | None,
    ) -> None:
        self.config, self.cache, self.storage, self.writer, self.clock = config, cache, storage, writer, clock
        self.counters = counters
        self.state = state
        self.lr = config.lr
        self.dim = config.dim
        self.skipped_updates = 0  # backward passes whose gradient held inf or NaN (update dropped)
        self.steps = 0  # updates applied (Adam's bias correction counts them)
        # With mixed precision, set to the torch.amp.GradScaler that scales the loss: the update then
        # divides by its current scale (and, like scaler.step, skips a step whose gradient is not finite).
        self.grad_scaler: Any = None
        self._pending: list[tuple[_StepPlan, Tensor]] = []  # gradients of the running backward pass
        self._pending_task: int | None = -1  # the autograd graph task they belong to

    @staticmethod
    def state_row_shape(optimizer: str, dim: int) -> tuple[int, ...] | None:
        """The optimizer state of one row: per value (Adagrad), two per value (Adam), one (row-wise), None."""
        return {"sgd": None, "adagrad": (dim,), "rowwise_adagrad": (), "adam": (2 * dim,)}[optimizer]

    @staticmethod
    def new_state(config: EmbeddingConfig, device: torch.device) -> Tensor | None:
        """The optimizer's zero state for `config`'s rows (fp32), or None for SGD."""
        shape = FusedOptimizer.state_row_shape(config.optimizer, config.dim)
        return None if shape is None else host_zeros((config.num_rows, *shape), torch.float32, device,
                                                          config.huge_pages)

    @property
    def device(self) -> torch.device:
        return self.cache.weights.device

    def forget(self) -> None:
        """Drop the gradients collected so far (their plans moved away, or the state was replaced)."""
        self._pending.clear()

    def receive(self, plan: _StepPlan, grad: Tensor) -> None:
        """Collect one forward's gradient; the first one of a backward pass schedules the update."""
        task = graph_task_id()
        if self._pending and task is not None and task != self._pending_task:
            # A backward pass that failed before its end: like a torch optimizer never stepped, its
            # gradients are dropped.
            self._pending.clear()
        # Without a task id, the gradients waiting may be a failed pass's, whose callback is gone: each
        # gradient then schedules one (the first to run applies them all).
        schedule = not self._pending or task is None
        self._pending.append((plan, grad))
        self._pending_task = task
        if schedule and not queue_callback(self.apply_pending):  # not inside the autograd engine: apply now
            self.apply_pending()

    def apply_pending(self) -> None:
        """The fused optimizer over every gradient of the backward pass, summed per row: one step per row."""
        entries, self._pending = self._pending, []
        if not entries:
            return
        self.clock.mark()
        if len(entries) == 1 and (self._fused_update(*entries[0]) or self._fused_storage_update(*entries[0])):
            self.clock.lap("backward")
            return
        if not all(kernels.all_finite(grad) for _, grad in entries):
            self.skipped_updates += 1  # a diverged step: keep every row as it was (counted in stats())
            return
        self.steps += 1
        factor = self._gradient_factor(entries)
        if factor != 1.0:
            entries = [(plan, grad * factor) for plan, grad in entries]
        cache_parts: list[tuple[Tensor, Tensor]] = []  # (slots, gradient of each)
        storage_parts: list[tuple[_StepPlan, Tensor, Tensor, Tensor]] = []  # (plan, rows, index, gradient)
        for plan, grad in entries:
            slots, storage_rows, storage_index = plan.slots, plan.storage_rows, plan.storage_index
            if plan.residency_version != self.cache.version:  # rows moved since the forward
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

    def _plain_sgd_step(self, plan: _StepPlan) -> bool:
        """What both fused steps need: plain SGD at a rate above 0, a gradient neither rescaled (GradScaler) nor
        clipped, and the cache's residency as the forward left it."""
        scaler = self.grad_scaler
        return (
            self.config.optimizer == "sgd"
            and self.lr != 0
            and not self.config.weight_decay
            and not (scaler is not None and scaler.is_enabled())
            and self.config.max_grad_norm is None
            and plan.residency_version == self.cache.version
        )

    def _fused_update(self, plan: _StepPlan, grad: Tensor) -> bool:
        """The common step in one compiled pass: one forward's SGD update on the cache slots its forward
        found (no second lookup), applied only if the whole gradient is finite; rows it served from storage
        then take the general storage update. Returns False, having done nothing, where the general path
        must run: another optimizer, a GradScaler or clipping (the gradient is rescaled), residency changed
        since the forward, no cache, or no compiled loop."""
        if not self._plain_sgd_step(plan) or not self.cache.capacity:
            return False
        fused = kernels.sgd_scatter_if_finite(self.cache.weights, plan.slots, grad, self.lr)
        if fused is None:
            return False
        applied, finite = fused
        if not applied:
            self.skipped_updates += 1  # a diverged step: keep every row as it was (counted in stats())
            return True
        self.steps += 1
        if not finite:
            self._fit_cached(plan.slots)
        if plan.storage_rows.numel():
            self._update_storage([(plan, plan.storage_rows, plan.storage_index, grad[plan.slots < 0])])
        return True

    def _fused_storage_update(self, plan: _StepPlan, grad: Tensor) -> bool:
        """The common step of a forward served wholly from storage (no cache, or every row missed it): the
        gradient summed per row and checked finite in one pass, the rows' fp32 copy from the forward updated
        and rounded back; what the general path does, with one pass over the gradient fewer. Returns False,
        having done nothing, where the general path must run (as `_fused_update`), or the rows changed."""
        if (
            not self._plain_sgd_step(plan)
            or plan.storage_version != self.storage.version
            or not plan.storage_rows.numel()
            or plan.storage_index.numel() != plan.slots.numel()
        ):
            return False
        summed = kernels.sum_rows_if_finite(plan.storage_index, grad, plan.storage_rows.numel())
        if summed is None:
            self.skipped_updates += 1  # a diverged step: keep every row as it was (counted in stats())
            return True
        self.steps += 1
        values = plan.storage_values
        values.add_(summed, alpha=-self.lr)
        self.writer.write(plan.storage_rows, values, tables=plan.storage_tables)
        return True

    def _gradient_factor(self, entries: list[tuple[_StepPlan, Tensor]]) -> float:
        """1 / the GradScaler's scale, times clip_grad_norm_'s coefficient when clipping is on."""
        factor = 1.0
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            factor = 1.0 / float(scaler.get_scale())
        if self.config.max_grad_norm is not None:
            rows, inverse = torch.unique(torch.cat([plan.rows for plan, _ in entries]), return_inverse=True)
            summed = kernels.sum_rows(inverse, torch.cat([grad for _, grad in entries]), rows.numel())
            norm = float(summed.norm()) * factor  # the norm of the dense gradient of the tables
            factor *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        return factor

    def _update_cached(self, parts: list[tuple[Tensor, Tensor]]) -> None:
        weights = self.cache.weights
        if self.lr == 0 and self.state is None:
            return  # lr 0 and no state to keep: nothing changes
        if self.config.optimizer == "sgd" and not self.config.weight_decay:
            for slots, grad in parts:  # SGD is linear: one scatter per part equals the summed step
                if not slots.numel():
                    continue
                if not kernels.sgd_scatter(weights, slots, grad, self.lr):
                    self._fit_cached(slots)
            return
        parts = [part for part in parts if part[0].numel()]
        if not parts:
            return
        slots = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        grad = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        unique_slots, inverse = kernels.distinct_rows(slots)  # each row's sum is in batch order in any order
        summed = kernels.sum_rows(inverse, grad, unique_slots.numel())
        rows = self.cache.slot_rows[unique_slots].long()
        if self.lr == 0:  # the state steps (as TorchRec's and torch's optimizers do); the rows stay bit for bit
            self._apply_rows(weights.index_select(0, unique_slots), None, rows, summed)
            return
        if not self._apply_rows(weights, unique_slots, rows, summed):
            self._fit_cached(unique_slots)

    def _fit_cached(self, slots: Tensor) -> None:
        """After an update that overflowed: the cached rows at `slots` fitted to fp32's range as storage
        fits what it stores (±inf -> ±largest float, NaN -> 0), the values replaced counted as non-finite."""
        slots = torch.unique(slots[slots >= 0])
        fitted = fit_to_range(self.cache.weights.index_select(0, slots), VALUE_LIMIT["fp32"])
        if fitted.nonfinite is not None:
            self.cache.weights.index_copy_(0, slots, fitted.values)
            self.counters.count_fitted(self.counters.tables_of(self.cache.slot_rows[slots].long()), fitted)

    def _update_storage(self, parts: list[tuple[_StepPlan, Tensor, Tensor, Tensor]]) -> None:
        """Rows outside the cache: read, update in fp32, round back, once per row. At lr 0 nothing is written
        back (a rounding again would move stochastically rounded rows): only the optimizer state steps."""
        if not parts or (self.lr == 0 and self.state is None):
            return
        if len(parts) == 1:
            plan, rows, index, grad = parts[0]
            current = (
                plan.storage_version == self.storage.version and plan.residency_version == self.cache.version
            )
            values = plan.storage_values if current else self.storage.read(rows, self.device)
        else:
            rows, index = torch.unique(torch.cat([p[1][p[2]] for p in parts]), return_inverse=True)
            grad = torch.cat([p[3] for p in parts])
            values = self.storage.read(rows, self.device)
        summed = kernels.sum_rows(index, grad, rows.numel())
        if self.lr == 0:
            self._apply_rows(values.clone(), None, rows, summed)  # the state only
            return
        if self.config.optimizer == "sgd" and not self.config.weight_decay:
            values.add_(summed, alpha=-self.lr)
        else:
            self._apply_rows(values, None, rows, summed)  # the writer fits what it stores
        self.writer.write(rows, values)

    def _apply_rows(self, target: Tensor, slots: Tensor | None, rows: Tensor, grad: Tensor) -> bool:
        """The optimizer's step of unique `rows` (gradient summed per row, weight decay added) in place on
        `target`'s rows at `slots` (row i of `target` when None). Returns False after an overflow at `slots`."""
        if self.config.weight_decay:
            current = target if slots is None else target.index_select(0, slots)
            grad = grad + self.config.weight_decay * current
        if self.config.optimizer == "sgd":
            step = grad * -self.lr
        elif self.config.optimizer == "adam":
            step = self._adam_step(rows, grad)
        else:
            assert self.state is not None  # Adagrad's sums
            return kernels.adagrad_update(target, slots, self.state, rows, grad, self.lr, self.config.eps)
        if slots is None:
            target.add_(step)
            return True
        target.index_add_(0, slots, step)
        return kernels.all_finite(target.index_select(0, slots))

    def _adam_step(self, rows: Tensor, grad: Tensor) -> Tensor:
        """Adam's moments of unique `rows` updated (rows a step does not touch keep theirs) and the update
        to add, bias-corrected by the number of steps taken."""
        assert self.state is not None  # Adam's moments
        state_rows = rows.to(self.state.device)
        beta1, beta2 = self.config.beta1, self.config.beta2
        moments = self.state[state_rows].to(self.device)
        first = moments[:, : self.dim].mul_(beta1).add_(grad, alpha=1 - beta1)
        second = moments[:, self.dim :].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self.state[state_rows] = moments.to(self.state.device)
        first_hat = first / (1 - beta1**self.steps)
        second_hat = second / (1 - beta2**self.steps)
        return first_hat / (second_hat.sqrt() + self.config.eps) * -self.lr
