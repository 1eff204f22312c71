"""The compiled Adagrad / row-wise Adagrad step agrees with a float64 reference, and with the torch step,
within a stated tolerance (not bit for bit: row-wise, the mean square is summed in a different order and
precision), and takes the same overflow fitting and range checks as the compiled SGD loops."""

from collections import Counter

import pytest
import torch

from slipcache import _native
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")

# |compiled - float64 reference| <= RTOL * |reference| + ATOL after a few steps: each step rounds a handful of
# fp32 operations (a few ulp, ~1e-7 relative); the margin covers their accumulation over the steps.
RTOL, ATOL = 1e-5, 1e-6
LR, EPS = 0.3, 1e-8


def reference_steps(weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                    grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Adagrad (state [R, D]) or row-wise Adagrad (state [R]) in float64, one step per gradient."""
    weights, state = weights.double(), state.double()
    for grad in grads:
        grad = grad.double()
        if state.dim() == 1:
            state[rows] += (grad * grad).mean(dim=1)
            denominator = (state[rows].sqrt() + EPS)[:, None]
        else:
            state[rows] += grad * grad
            denominator = state[rows].sqrt() + EPS
        weights[slots] += grad / denominator * -LR
    return weights, state


@pytest.mark.parametrize("rowwise", [False, True])
def test_compiled_adagrad_is_within_tolerance_of_float64(rowwise: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(200, 16, generator=g)
    state = torch.rand(500, generator=g) if rowwise else torch.rand(500, 16, generator=g)
    slots = torch.randperm(200, generator=g)[:120]  # distinct slots in no particular order
    rows = torch.randperm(500, generator=g)[:120]
    grads = [torch.randn(120, 16, generator=g) * scale for scale in (1.0, 1e-3, 30.0, 0.5)]
    expected_weights, expected_state = reference_steps(weights, state, slots, rows, grads)
    compiled_weights, compiled_state = weights.clone(), state.clone()
    torch_weights, torch_state = weights.clone(), state.clone()
    for grad in grads:
        assert _native.adagrad_update(compiled_weights, slots, compiled_state, rows, grad, LR, EPS)
        # the torch step, as kernels.adagrad_update computes it without the compiled loop
        if rowwise:
            torch_state[rows] = torch_state[rows] + grad.pow(2).mean(dim=1)
            denominator = (torch_state[rows].sqrt() + EPS)[:, None]
        else:
            torch_state[rows] = torch_state[rows] + grad * grad
            denominator = torch_state[rows].sqrt() + EPS
        torch_weights.index_add_(0, slots, grad / denominator * -LR)
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(compiled_weights[untouched], weights[untouched])
    for got in ((compiled_weights, compiled_state), (torch_weights, torch_state)):
        torch.testing.assert_close(got[0].double(), expected_weights, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got[1].double(), expected_state, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(compiled_weights, torch_weights, rtol=RTOL, atol=ATOL)


def test_compiled_adagrad_without_slots_updates_rows_in_order_and_checks_ranges() -> None:
    g = torch.Generator().manual_seed(1)
    values, state = torch.randn(5, 4, generator=g), torch.zeros(10, 4)
    rows, grad = torch.tensor([9, 0, 4, 7, 2]), torch.randn(5, 4, generator=g)
    expected_weights, expected_state = reference_steps(values, state, torch.arange(5), rows, [grad])
    assert _native.adagrad_update(values, None, state, rows, grad, LR, EPS)
    torch.testing.assert_close(values.double(), expected_weights, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state.double(), expected_state, rtol=RTOL, atol=ATOL)
    before = (values.clone(), state.clone())
    for bad_slots, bad_rows in ((torch.tensor([0, 1, 5, 2, 3]), rows), (None, torch.tensor([9, 0, 10, 7, 2]))):
        with pytest.raises(ValueError, match="out of range"):
            _native.adagrad_update(values, bad_slots, state, bad_rows, grad, LR, EPS)
        assert torch.equal(values, before[0]) and torch.equal(state, before[1])  # nothing written
    with pytest.raises(ValueError, match="state"):
        _native.adagrad_update(values, None, torch.zeros(10, 3), rows, grad, LR, EPS)


def test_compiled_adagrad_reports_an_overflow() -> None:
    weights = torch.full((2, 4), 3e38)
    state = torch.zeros(2, 4)
    assert not _native.adagrad_update(
        weights, torch.tensor([1]), state, torch.tensor([0]), -torch.ones(1, 4), 1e38, EPS
    )
    assert torch.isinf(weights[1]).all() and torch.equal(weights[0], torch.full((4,), 3e38))


SIZES = [50, 300, 1000]


def train(optimizer: str, cache_rows: int, steps: int = 5) -> tuple[CachedEmbeddingBagCollection, list[torch.Tensor]]:
    """Skewed multi-table batches (duplicates in each) over more rows than the cache holds."""
    config = EmbeddingConfig(SIZES, dim=8, precision="fp32", cache_rows=cache_rows, ways=4, optimizer=optimizer,
                             lr=LR, seed=1)
    coll = CachedEmbeddingBagCollection(config)
    g = torch.Generator().manual_seed(3)
    outputs = []
    for _ in range(steps):
        ids = torch.stack([(torch.rand(96, generator=g) ** 3 * n).long() for n in SIZES], dim=1)
        out = coll(ids)
        out.backward(torch.randn(out.shape, generator=g))
        outputs.append(out.detach())
    return coll, outputs


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("cache_rows", [48, 0])
def test_training_with_the_compiled_step_stays_within_tolerance_of_torch(
    optimizer: str, cache_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter = Counter()
    original = _native.adagrad_update

    def counted(*args, **kwargs):  # the compiled step must run, or the comparison proves nothing
        calls["cache" if args[1] is not None else "storage"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_native, "adagrad_update", counted)
    compiled, compiled_out = train(optimizer, cache_rows)
    assert calls["storage"] > 0 and (calls["cache"] > 0) == (cache_rows > 0)
    monkeypatch.setattr(_native, "native", lambda: None)
    reference, reference_out = train(optimizer, cache_rows)
    for a, b in zip(compiled_out, reference_out, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    state_a, state_b = compiled.state_dict(), reference.state_dict()
    for key, value in state_a.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(value, state_b[key], rtol=RTOL, atol=ATOL, msg=key)
