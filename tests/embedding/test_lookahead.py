"""The lookahead policy and prefetch: eviction by future use, and background fills that change nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipcache.embedding.cache import EMPTY, LOOKAHEAD_POLICIES
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.lookahead import Window, belady_hits
from slipcache.training.backend import build_model
from slipcache.training.config import CONFIG_FIELDS, make_config


def _resident(coll: CachedEmbeddingBagCollection) -> set[int]:
    rows = coll.cache.slot_rows
    return set(rows[rows != EMPTY].tolist())


def _train(
    coll: CachedEmbeddingBagCollection, batches: list[torch.Tensor], k: int, prefetch: bool = False, check=None
) -> None:
    """One step per batch, each told the k batches after it, as the trainer does with `peek(k)`."""
    for i, ids in enumerate(batches):
        if k:
            coll.set_lookahead(batches[i + 1 : i + 1 + k], prefetch=prefetch)
        before = _resident(coll)
        out = coll(ids)
        if check is not None:
            check(i, before)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()


def test_window_next_use() -> None:
    window = Window([torch.tensor([3, 7]), torch.tensor([1, 7, 9]), torch.tensor([2])])
    assert window.next_use(torch.tensor([7, 9, 2, 5, 1])).tolist() == [1, 2, 3, 0, 2]
    assert window.next_use(torch.tensor([[3], [5]], dtype=torch.int32)).tolist() == [[1], [0]]


batch_lists = st.lists(
    st.lists(st.integers(0, 39), min_size=1, max_size=10), min_size=2, max_size=10
)


@settings(max_examples=60, deadline=None)
@given(batches=batch_lists, capacity=st.integers(2, 24), ways=st.sampled_from([2, 4, 32]), k=st.integers(1, 4),
       prefetch=st.booleans(), policy=st.sampled_from(LOOKAHEAD_POLICIES))
def test_never_evicts_a_row_of_the_batch_in_flight_or_the_next(batches, capacity, ways, k, prefetch, policy) -> None:
    tensors = [torch.tensor(b).view(-1, 1) for b in batches]
    coll = CachedEmbeddingBagCollection(
        EmbeddingConfig([40], dim=2, precision="fp32", cache_rows=capacity, ways=ways, policy=policy)
    )

    def check(i: int, before: set[int]) -> None:
        coll.prefetcher.join()  # the prefetch started by this step must obey the rule too
        evicted = before - _resident(coll)
        needed = set(batches[i]) | (set(batches[i + 1]) if i + 1 < len(batches) else set())
        assert not evicted & needed, (i, evicted & needed)

    _train(coll, tensors, k, prefetch, check)


@settings(max_examples=80, deadline=None)
@given(
    trace=st.lists(st.integers(0, 29), min_size=1, max_size=40),
    capacity=st.integers(1, 16),
    policy=st.sampled_from(LOOKAHEAD_POLICIES),
)
def test_equals_belady_on_a_trace_shorter_than_the_window(trace, capacity, policy) -> None:
    """Fully associative, the whole trace in the window, one row per batch: Belady's rule (with bypass) is
    the optimum there, whatever its ties, so the policy's hits must equal it."""
    tensors = [torch.tensor([[row]]) for row in trace]
    coll = CachedEmbeddingBagCollection(
        EmbeddingConfig([30], dim=1, precision="fp32", cache_rows=capacity, ways=capacity, policy=policy)
    )
    _train(coll, tensors, k=len(tensors))
    lookup_hits, row_hits = belady_hits([t.view(-1) for t in tensors], capacity)
    assert coll.stats()["hits"] == lookup_hits.sum() == row_hits.sum()


def test_belady_rule_is_no_bound_for_batches_of_several_rows() -> None:
    """With several rows per batch a tie in next use can decide which row a later batch may keep (rows of
    the batch in flight are never evicted): Belady's rule is then a near-optimal reference, not the optimum.
    Found by hypothesis: the rule evicts row 0 at batch 1 (0 and 1 are both next used at batch 3), so 0
    misses at batch 4; the policy kept 0 and hits once more."""
    batches = [[0, 1], [2], [2], [0, 1, 2], [0], [0], [0, 1, 2], [0, 1]]
    tensors = [torch.tensor(b).view(-1, 1) for b in batches]
    lookup_hits, _ = belady_hits([t.view(-1) for t in tensors], capacity=2)
    assert int(lookup_hits.sum()) == 7
    for policy in LOOKAHEAD_POLICIES:
        coll = CachedEmbeddingBagCollection(
            EmbeddingConfig([30], dim=1, precision="fp32", cache_rows=2, ways=2, policy=policy)
        )
        _train(coll, tensors, k=len(tensors))
        assert coll.stats()["hits"] == 8


def test_belady_keeps_the_row_used_again() -> None:
    # One slot: row 1 is used again at batch 2, row 2 never; Belady serves row 2 from storage.
    assert belady_hits(torch.tensor([[1], [2], [1]]), capacity=1)[0].tolist() == [0, 0, 1]
    # Rows of the batch in flight stay: 3 cannot take 1's slot at batch 1 even though 1 is never used again.
    lookup_hits, row_hits = belady_hits([torch.tensor([1]), torch.tensor([1, 3]), torch.tensor([3, 3])], capacity=1)
    assert lookup_hits.tolist() == [0, 1, 0] and row_hits.tolist() == [0, 1, 0]
    lookup_hits, row_hits = belady_hits([torch.tensor([5, 5, 5]), torch.tensor([5, 5])], capacity=1)
    assert lookup_hits.tolist() == [0, 2] and row_hits.tolist() == [0, 1]


def _stream(num_batches: int, batch: int, rows: int, seed: int) -> list[torch.Tensor]:
    """Power-law ids over two tables, so some rows recur and others come and go."""
    gen = torch.Generator().manual_seed(seed)
    ranks = (torch.rand(num_batches, batch, 2, generator=gen) ** 3 * rows).long()
    return list(ranks)


def _config(**kw) -> EmbeddingConfig:
    base = dict(table_sizes=[300, 200], dim=4, precision="fp32", cache_rows=96, ways=16, lr=0.05)
    return EmbeddingConfig(**{**base, **kw})


def test_training_with_prefetch_equals_training_without_bit_for_bit() -> None:
    batches = _stream(30, 16, 200, seed=3)
    for policy, k in (("lru", 1), ("lookahead", 4)):
        plain, fetched = (CachedEmbeddingBagCollection(_config(policy=policy)) for _ in range(2))
        _train(plain, batches, k)
        _train(fetched, batches, k, prefetch=True)
        stats = fetched.stats()
        assert stats["prefetched_rows"] > 0 and stats["evictions"] > 0
        assert plain.stats()["overflow_rows"] == 0 == stats["overflow_rows"]  # every row trains in the cache
        for a, b in zip(plain.export_tables(), fetched.export_tables(), strict=True):
            assert torch.equal(a, b)
        # The step finds the prefetched rows in place.
        assert stats["hit_rate"] > plain.stats()["hit_rate"]


def test_prefetch_with_stochastic_rounding_is_reproducible() -> None:
    batches = _stream(20, 16, 200, seed=4)
    runs = []
    for _ in range(2):
        coll = CachedEmbeddingBagCollection(_config(precision="int8", policy="lookahead", cache_rows=48))
        _train(coll, batches, 4, prefetch=True)
        runs.append(torch.cat(coll.export_tables()))
        assert coll.stats()["prefetched_rows"] > 0
    assert torch.equal(runs[0], runs[1])


def test_lookahead_beats_lru_under_eviction_pressure() -> None:
    batches = _stream(40, 32, 200, seed=5)
    rates = {}
    for policy in ("lru", "lfu", *LOOKAHEAD_POLICIES):
        coll = CachedEmbeddingBagCollection(_config(policy=policy, cache_rows=48))
        _train(coll, batches, 8)
        rates[policy] = coll.stats()["hit_rate"]
    assert rates["lookahead"] > rates["lru"] and rates["lookahead-lfu"] > rates["lfu"]


def test_a_window_serves_one_step_only() -> None:
    coll = CachedEmbeddingBagCollection(_config(policy="lookahead"))
    coll.set_lookahead([torch.zeros(4, 2, dtype=torch.long)], prefetch=True)
    coll(torch.ones(4, 2, dtype=torch.long)).sum().backward()
    assert coll.prefetcher.window is None and not coll.prefetcher.prefetch_next
    assert coll.stats()["prefetched_rows"] == 2  # rows 0 of both tables


@pytest.mark.slow
def test_trainer_with_prefetch_equals_trainer_without(tmp_path) -> None:
    """The whole DLRM run, fp32 storage, no skipping: prefetch and the lookahead window change no bit."""
    from slipcache.training import checkpoint
    from slipcache.training import trainer as train
    from tests.helpers import make_dataset, tiny_config

    data = make_dataset(tmp_path / "data", n=640, sizes=[2000] * 26, skewed=True)
    settings = dict(embeddings="cached", precision="fp32", cache_size=0.03, batch_size=32, epochs=1)
    states = []
    for name, extra in (("plain", {}), ("prefetch", {"prefetch": True}), ("ahead", {"policy": "lookahead"})):
        summary = train.train(tiny_config(data, tmp_path / name, **settings, **extra))
        stats = summary["embedding_stats"]
        assert stats["evictions"] > 0 and stats["overflow_rows"] == 0, (name, stats)
        if extra.get("prefetch"):
            assert stats["prefetched_rows"] > 0
        states.append(checkpoint.load_checkpoint(tmp_path / name / "checkpoints"))
    plain = states[0]
    for other in states[1:]:
        for key, tensor in plain["dense"].items():
            assert torch.equal(tensor, other["dense"][key]), key
    # Values, not placement: rows sit in different slots, so compare tables with the cache written back.
    tables = []
    for name in ("plain", "prefetch", "ahead"):
        coll = _restore_embeddings(checkpoint, tmp_path / name)
        tables.append(torch.cat(coll.export_tables()))
    assert torch.equal(tables[0], tables[1]) and torch.equal(tables[0], tables[2])


def _restore_embeddings(checkpoint, run):
    state = checkpoint.load_checkpoint(run / "checkpoints")
    config = make_config({}, {k: v for k, v in state["config"].items() if k in CONFIG_FIELDS})
    model = build_model(config, state["table_sizes"], 13)
    model.embeddings.load_state_dict(state["embeddings"])
    return model.embeddings


def test_resume_with_lookahead_and_prefetch_matches_uninterrupted(tmp_path, monkeypatch) -> None:
    """INT8 with stochastic rounding: the checkpoint holds the prefetched rows and both rounding generators."""
    import pytest

    from slipcache.training import checkpoint
    from slipcache.training import trainer as train
    from tests.helpers import make_dataset, tiny_config

    data = make_dataset(tmp_path / "data", n=640, sizes=[2000] * 26, skewed=True)
    settings = dict(embeddings="cached", precision="int8", cache_size=0.03, batch_size=32, epochs=1,
                    policy="lookahead", prefetch=True, checkpoint_every=320, eval_every=320)  # fmt: skip
    full = train.train(tiny_config(data, tmp_path / "full", **settings))
    real_loss = train.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def crash_at_step_15(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:  # after the checkpoint at 320 samples (10 steps)
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train.F, "binary_cross_entropy_with_logits", crash_at_step_15)
    with pytest.raises(KeyboardInterrupt):
        train.train(tiny_config(data, tmp_path / "part", **settings))
    monkeypatch.undo()
    resumed = train.train(make_config({}, {"resume": str(tmp_path / "part"), "progress": False}))
    assert resumed["auc"] == full["auc"] and resumed["embedding_stats"]["prefetched_rows"] > 0
    a = checkpoint.load_checkpoint(tmp_path / "full" / "checkpoints")["embeddings"]
    b = checkpoint.load_checkpoint(tmp_path / "part" / "checkpoints")["embeddings"]
    for name, tensor in a.items():
        if isinstance(tensor, torch.Tensor) and name != "counters":  # counters restart with the resumed run
            assert torch.equal(tensor, b[name]), name


def test_every_access_to_the_cache_waits_for_the_prefetch_in_flight() -> None:
    """A prefetch left running while another method reads or changes the cache would race it: each such
    method finishes the prefetch first (it is left in flight here, then each method is called)."""
    config = EmbeddingConfig([40, 30], dim=4, precision="int8", cache_rows=16, ways=4, policy="lru")
    batches = [torch.tensor([[i % 40, (3 * i) % 30]]) for i in range(6)]
    rows = torch.tensor([1, 2, 41])
    calls = {
        "read_rows": lambda c: c.read_rows(rows),
        "write_rows": lambda c: c.write_rows(rows, torch.zeros(3, 4)),
        "release_rows": lambda c: c.release_rows(rows),
        "flush": lambda c: c.flush(),
        "stats": lambda c: c.stats(),
        "reset_stats": lambda c: c.reset_stats(),
        "state_dict": lambda c: c.state_dict(),
        "load_state_dict": lambda c: c.load_state_dict(c.state_dict()),
        "export (eval forward)": lambda c: c.eval()(batches[0]),
        "load_tables": lambda c: c.load_tables([torch.zeros(40, 4), torch.zeros(30, 4)]),
        "to": lambda c: c.to("cpu"),
    }
    for name, call in calls.items():
        coll = CachedEmbeddingBagCollection(config)
        _train(coll, batches[:3], k=1, prefetch=True)
        coll.set_lookahead([batches[4]], prefetch=True)
        out = coll(batches[3])  # starts the prefetch of batches[4]
        out.sum().backward()
        assert coll.prefetcher._prefetching is not None, name
        call(coll)
        assert coll.prefetcher._prefetching is None, f"{name} ran beside the prefetch in flight"
