"""Forward/backward contract of the fused update: shared tables, pipelined steps, unbackpropagated forwards.

Every check compares against `nn.EmbeddingBag` + the torch optimizer on fp32 storage, where the collection
must train exactly like it whatever the cache does.
"""

import pytest
import torch
from torch import nn

from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.plan import PIN_STEPS
from slipcache.errors import SlipcacheError
from slipcache.training.config import load_config_file, make_config
from tests.helpers import FailsInBackward

SIZES = [40, 7, 300, 3]
DIM = 4


def random_ids(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, n, (batch,), generator=g) for n in SIZES], dim=1)


def collection(optimizer: str, cache: dict) -> CachedEmbeddingBagCollection:
    config = EmbeddingConfig(SIZES, dim=DIM, precision="fp32", optimizer=optimizer, lr=0.05, eps=1e-10, **cache)
    return CachedEmbeddingBagCollection(config)


class Reference:
    """nn.EmbeddingBag tables + torch optimizer, started from the collection's rows."""

    def __init__(self, coll: CachedEmbeddingBagCollection, optimizer: str) -> None:
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in SIZES)
        with torch.no_grad():
            for bag, table in zip(self.bags, coll.export_tables(), strict=True):
                bag.weight.copy_(table)
        params = [b.weight for b in self.bags]
        self.opt = (
            torch.optim.SGD(params, lr=0.05)
            if optimizer == "sgd"
            else torch.optim.Adagrad(params, lr=0.05, eps=1e-10)
        )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, t : t + 1]) for t, bag in enumerate(self.bags)], dim=1)

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def assert_matches(self, coll: CachedEmbeddingBagCollection) -> None:
        for table, bag in zip(coll.export_tables(), self.bags, strict=True):
            assert torch.allclose(table, bag.weight, atol=1e-5)


def loss_of(out: torch.Tensor, seed: int) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return ((out - target) ** 2).sum()


CACHES = [
    {"cache_rows": 6, "ways": 2},  # far smaller than a batch: most rows are updated in storage
    {"cache_size": 0.1},
    {"cache_size": 0.0, "policy": "none"},
    {"cache_size": [0.5, 0.0, 0.05, 1.0], "ways": 4},  # one part of the cache per table
]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_table_shared_by_several_features_takes_one_step_per_row(optimizer: str, cache: dict) -> None:
    """Two or three lookups of the same tables before one backward: one update on the summed gradient."""
    coll = collection(optimizer, cache)
    ref = Reference(coll, optimizer)
    for step in range(6):
        features = [random_ids(24, 10 * step + k) for k in range(2 + step % 2)]
        ours = [coll(ids) for ids in features]
        sum(loss_of(out, k) for k, out in enumerate(ours)).backward()
        theirs = [ref(ids) for ids in features]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
        ref.step(sum(loss_of(out, k) for k, out in enumerate(theirs)))
        ref.assert_matches(coll)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_pipelined_steps_update_the_current_rows(optimizer: str, cache: dict) -> None:
    """forward A, forward B, backward A, forward C, backward B, ...: each backward is one step."""
    coll = collection(optimizer, cache)
    ref = Reference(coll, optimizer)
    ours, theirs = {}, {}
    for step in range(8):
        ids = random_ids(24, step)
        ours[step], theirs[step] = coll(ids), ref(ids)
        assert torch.allclose(ours[step], theirs[step], atol=1e-6)
        if step >= 1:  # two steps in flight, the older one finishes
            loss_of(ours.pop(step - 1), step - 1).backward()
            ref.step(loss_of(theirs.pop(step - 1), step - 1))
            ref.assert_matches(coll)
    loss_of(ours.pop(7), 7).backward()
    ref.step(loss_of(theirs.pop(7), 7))
    ref.assert_matches(coll)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_release_and_flush_between_forward_and_backward_are_safe(optimizer: str) -> None:
    coll = collection(optimizer, {"cache_size": 0.2})
    ref = Reference(coll, optimizer)
    for step in range(5):
        ids = random_ids(24, step)
        out, expected = coll(ids), ref(ids)
        coll.flush()
        _, resident = coll.cache.cached()
        assert coll.release_rows(resident[::2]) > 0  # some rows of this very batch leave the cache
        loss_of(out, step).backward()
        ref.step(loss_of(expected, step))
        ref.assert_matches(coll)


def test_a_forward_without_backward_does_not_pin_its_rows() -> None:
    coll = CachedEmbeddingBagCollection(EmbeddingConfig([64], dim=2, precision="fp32", cache_rows=4, ways=4))
    out = coll(torch.arange(4).view(4, 1))
    del out  # never backpropagated (the graph is gone)
    coll(torch.arange(10, 14).view(4, 1)).sum().backward()
    assert coll.stats()["overflow_rows"] == 0  # the four new rows took the four slots

    # an output kept alive pins its rows only for PIN_STEPS further forwards
    kept = coll(torch.arange(20, 24).view(4, 1))
    for step in range(PIN_STEPS):
        coll(torch.tensor([[30 + step]])).sum().backward()
    before = coll.stats()["overflow_rows"]
    coll(torch.arange(40, 44).view(4, 1)).sum().backward()
    assert coll.stats()["overflow_rows"] == before
    kept.sum().backward()  # a late backward still updates its rows (now in storage)
    assert torch.allclose(coll.read_rows(torch.arange(20, 24)), coll.storage.read(torch.arange(20, 24), "cpu"))


def test_second_backward_with_retain_graph_is_a_clear_error() -> None:
    coll = collection("sgd", {"cache_size": 0.1})
    out = coll(random_ids(8, 0))
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(SlipcacheError, match="second backward"):
        loss.backward()


def test_read_and_release_rows_reject_invalid_rows() -> None:
    coll = collection("sgd", {"cache_size": 0.1})
    coll(random_ids(8, 0)).sum().backward()
    total = sum(SIZES)
    for call in (coll.read_rows, coll.release_rows):
        with pytest.raises(SlipcacheError, match="row -1 is outside"):
            call(torch.tensor([0, -1]))
        with pytest.raises(SlipcacheError, match=f"row {total} is outside"):
            call(torch.tensor([total]))
        with pytest.raises(SlipcacheError, match="1-D integer tensor"):
            call(torch.tensor([0.0]))
        with pytest.raises(SlipcacheError, match="1-D integer tensor"):
            call(torch.zeros(2, 2, dtype=torch.long))
    assert coll.release_rows(torch.tensor([5, 5, 5])) <= 1  # repeats release a row once


@pytest.mark.parametrize("cache", [{"cache_size": 1.0}, {"cache_rows": 10_000}, {"cache_rows": sum(SIZES)}])
@pytest.mark.parametrize("native", [True, False])
def test_a_full_cache_holds_every_row(cache: dict, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """cache_size=1.0 (or cache_rows >= all rows) makes every row resident: no set conflicts, no overflow."""
    if not native:
        monkeypatch.setenv("SLIPCACHE_NATIVE", "0")
        monkeypatch.setattr("slipcache._native.native", lambda: None)
    coll = CachedEmbeddingBagCollection(EmbeddingConfig(SIZES, dim=DIM, precision="int8", ways=4, **cache))
    for seed in range(30):
        coll(random_ids(64, seed)).sum().backward()
    longest = max(SIZES)
    ids = torch.stack([torch.arange(longest) % n for n in SIZES], dim=1)  # every row of every table
    coll(ids).sum().backward()
    stats = coll.stats()
    assert stats["overflow_rows"] == 0 and stats["evictions"] == 0
    assert coll.cache.cached()[0].numel() == sum(SIZES)  # every row is resident
    assert coll.cache.capacity < sum(SIZES) + 4  # and the cache is no larger than it needs to be


def test_cache_size_is_a_share_and_cache_rows_a_count() -> None:
    assert EmbeddingConfig(SIZES, cache_size=0.1).cache_capacity == 35
    assert EmbeddingConfig(SIZES, cache_size=1.0).cache_capacity == sum(SIZES)
    assert EmbeddingConfig(SIZES, cache_size=1.0, cache_rows=12).cache_capacity == 12
    assert EmbeddingConfig(SIZES, cache_size=0.5, policy="none").cache_capacity == 0
    with pytest.raises(ValueError, match="use cache_rows=1000"):
        EmbeddingConfig(SIZES, cache_size=1000)
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ValueError, match=r"in \[0, 1\]"):
            EmbeddingConfig(SIZES, cache_size=bad)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="cache_rows must be a whole number"):
            EmbeddingConfig(SIZES, cache_rows=bad)


def test_train_config_takes_cache_share_or_rows(tmp_path) -> None:
    from slipcache.training.backend import build_model

    with pytest.raises(SlipcacheError, match="use --cache-rows 5000"):
        make_config(flag_values={"cache_size": 5000.0})
    with pytest.raises(SlipcacheError, match=r"finite|in \[0, 1\]"):
        make_config(flag_values={"cache_size": float("inf")})
    path = tmp_path / "run.toml"
    path.write_text("cache_size = 1.0\ncache_rows = 64\n")
    config = make_config(load_config_file(path))
    model = build_model(config, [100, 50], num_dense=13)
    assert model.embeddings.cache.capacity == 64
    model = build_model(make_config(flag_values={"cache_size": 1.0}), [100, 50], num_dense=13)
    assert model.embeddings.cache.holds_every_row


def test_max_grad_norm_clips_like_clip_grad_norm_over_the_tables() -> None:
    coll = collection("sgd", {"cache_rows": 6, "ways": 2})
    coll.config.max_grad_norm = 0.5
    ref = Reference(coll, "sgd")
    for step in range(4):
        features = [random_ids(24, 10 * step + k) for k in range(2)]
        sum(loss_of(coll(f), k) for k, f in enumerate(features)).backward()
        ref.opt.zero_grad()
        sum(loss_of(ref(f), k) for k, f in enumerate(features)).backward()
        for bag in ref.bags:  # clip_grad_norm_ takes dense gradients
            bag.weight.grad = bag.weight.grad.to_dense()
        norm = nn.utils.clip_grad_norm_([b.weight for b in ref.bags], 0.5)
        assert float(norm) > 0.5  # clipping is active in this test
        ref.opt.step()
        ref.assert_matches(coll)
    with pytest.raises(ValueError, match="max_grad_norm"):
        EmbeddingConfig(SIZES, max_grad_norm=0.0)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_grad_scaler_is_divided_out_and_its_skipped_steps_skip(optimizer: str) -> None:
    coll = collection(optimizer, {"cache_size": 0.1})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    coll.grad_scaler = scaler
    ref = Reference(coll, optimizer)
    for step in range(3):
        ids = random_ids(24, step)
        scaler.scale(loss_of(coll(ids), step)).backward()
        ref.step(loss_of(ref(ids), step))
        ref.assert_matches(coll)
    before = torch.cat(coll.export_tables())
    scaler.scale(coll(random_ids(24, 9)).sum() * float("inf")).backward()  # overflow: the step is skipped
    assert torch.allclose(torch.cat(coll.export_tables()), before) and coll.stats()["skipped_updates"] == 1


def test_a_backward_pass_that_fails_midway_drops_its_update_and_training_goes_on() -> None:
    aborted, plain = collection("sgd", {"cache_rows": 20}), collection("sgd", {"cache_rows": 20})
    weight = torch.ones(1, requires_grad=True)
    failing = FailsInBackward.apply(weight)  # created first: runs after the lookup's node in backward
    out = aborted(random_ids(24, 0))
    with pytest.raises(RuntimeError, match="boom"):
        (out.sum() + failing.sum()).backward()
    plain(random_ids(24, 0))  # same forward, never backpropagated
    for coll in (aborted, plain):
        loss_of(coll(random_ids(24, 1)), 1).backward()
    for a, b in zip(aborted.export_tables(), plain.export_tables(), strict=True):
        assert torch.equal(a, b)
