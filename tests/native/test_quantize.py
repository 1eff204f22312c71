"""The compiled quantize pass stores exactly the bytes of the torch path, and table creation is unchanged."""

import math
import os
import subprocess
import sys

import pytest
import torch

from slipcache import _native
from slipcache._native import quantize
from slipcache.embedding.collection import CachedEmbeddingBagCollection, EmbeddingConfig
from slipcache.embedding.quant import _SCALES, RowStorage, encode_scale

pytestmark = pytest.mark.skipif(_native.native() is None, reason="no C compiler: only the torch path exists")


def _awkward_rows(n: int, dim: int) -> torch.Tensor:
    """Rows of every scale, with the edge cases fitting and rounding must treat alike."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(n, dim, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 4)
    x[0, 0], x[1, 0], x[2, :], x[3, 0] = float("nan"), float("inf"), 1e6, -1e5
    x[4, :], x[5, :], x[6, 0], x[7, 0] = 0.0, -0.0, 1e-30, -1e-30
    x[8, 0], x[8, -1] = 5e4, -5e4
    x[9, :] = 0.1
    x[9, -1] = 0.1 + float(_SCALES[100]) * 15  # a span exactly on the scale grid
    return x


def _bytes(storage: RowStorage) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for b in storage.buffers()]


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16", "fp32"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dim", [1, 7, 16, 128, 300])
def test_compiled_writes_match_torch(
    precision: str, rounding: str, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 600
    x = _awkward_rows(n, dim)
    rows = torch.randperm(n + 10, generator=torch.Generator().manual_seed(1))[:n]
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(_native, "native", lambda: None)
        storage = RowStorage(n + 10, dim, precision)
        g = torch.Generator().manual_seed(7)
        fitted = [storage.write_range(3, x[: n - 3], rounding, g), storage.write(rows, x, rounding, g)]
        results.append((_bytes(storage), [(f.saturated, f.nonfinite) for f in fitted]))
    (ours, our_fit), (theirs, their_fit) = results
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    for (sat_a, bad_a), (sat_b, bad_b) in zip(our_fit, their_fit, strict=True):
        assert (sat_a is None) == (sat_b is None)
        if sat_a is not None:
            assert torch.equal(sat_a, sat_b) and torch.equal(bad_a, bad_b)
    if precision != "fp32":  # the awkward rows were fitted, and counted
        assert our_fit[1][1] is not None and int(our_fit[1][1].sum()) >= 2


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16", "fp32"])
@pytest.mark.parametrize("dim", [1, 7, 16, 128, 300])
def test_compiled_reads_match_torch(precision: str, dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 600
    storage = RowStorage(n, dim, precision)
    storage.write_range(0, _awkward_rows(n, dim), "stochastic", torch.Generator().manual_seed(3))
    rows = torch.randint(0, n, (2 * n,), generator=torch.Generator().manual_seed(2))  # repeats included
    ours = storage.read(rows, torch.device("cpu"))
    assert storage.read(rows[:0], torch.device("cpu")).shape == (0, dim)
    monkeypatch.setattr(_native, "native", lambda: None)
    theirs = storage.read(rows, torch.device("cpu"))
    assert ours.shape == (2 * n, dim) and torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_scale_code_is_the_smallest_that_covers_on_the_grid() -> None:
    grid = _SCALES[1:255]
    for needed in (grid, torch.nextafter(grid, torch.zeros_like(grid))):
        codes = encode_scale(needed).long()
        assert bool((_SCALES[codes] >= needed).all())
        assert bool((_SCALES[codes - 1] < needed).all())


def test_rows_outside_the_storage_are_refused() -> None:
    storage = RowStorage(4, 8, "int8")
    with pytest.raises(ValueError, match="outside"):
        quantize.dequantize_rows("int8", *storage.buffers(), scales=_SCALES, rows=torch.tensor([4]), dim=8)
    with pytest.raises(ValueError, match="outside"):
        quantize.quantize_rows(
            torch.zeros(1, 8), "int8", *storage.buffers(), scales=_SCALES, limit=1e4, rows=torch.tensor([4])
        )


@pytest.mark.parametrize("precision", ["int4", "fp16"])
def test_created_tables_are_the_rounded_uniform_draw(precision: str) -> None:
    """Same seed, same tables: each table's rows are (rand * 2 - 1) / sqrt(rows), drawn in table order from
    one generator, rounded to nearest, whatever the chunking of the draw."""
    sizes, dim = [5, 70_000, 3], 8
    collection = CachedEmbeddingBagCollection(
        EmbeddingConfig(table_sizes=sizes, dim=dim, precision=precision, cache_size=0.0, seed=11)
    )
    g = torch.Generator().manual_seed(11)
    expected = RowStorage(sum(sizes), dim, precision)
    start = 0
    for size in sizes:
        values = (torch.rand(size, dim, generator=g) * 2 - 1) * (1.0 / math.sqrt(size))
        for buf, part in zip(expected.buffers(), expected.encode(values, "nearest", None)[0], strict=True):
            buf[start : start + size] = part
        start += size
    for a, b in zip(_bytes(collection.storage), _bytes(expected), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_compiled_float_nearest_matches_torch_casts(precision: str) -> None:
    """Storage rounds fp16/bf16 to nearest with torch's own cast; the compiled pass, called directly (as
    eviction may), gives the same bits."""
    x = _awkward_rows(300, 16)[10:]
    x = x.clamp(-60000, 60000) if precision == "fp16" else x
    storage = RowStorage(x.shape[0], 16, precision)
    bad = quantize.quantize_rows(x, precision, storage.payload, scales=_SCALES, limit=65504.0)
    assert bad == 0
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    assert torch.equal(storage.payload.view(torch.int16), x.to(dtype).view(torch.int16))


def test_bench_quantize_prints_rates_with_the_load(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from slipcache import cli

    assert cli.main(["bench", "quantize", "--rows", "5000", "--dim", "16", "--rounds", "1",
                     "--json", str(tmp_path / "q.json")]) == 0
    out = capsys.readouterr().out
    assert "load average" in out and "create a 5,000-row table" in out
    figures = json.loads((tmp_path / "q.json").read_text())
    for name in ("compiled", "torch", "create"):
        assert figures[name]["wall_mvalues_s"][0] > 0 and figures[name]["cpu_mvalues_s"][0] > 0


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def simd_level(request: pytest.FixtureRequest):
    """Each instruction set of the row kernels in turn (skipped where the CPU lacks it), then the default."""
    level = _native.set_simd(request.param)
    try:
        if level != request.param:
            pytest.skip(f"this CPU has no {request.param}")
        yield level
    finally:
        _native.set_simd(None)


def _clean_rows(n: int, dim: int) -> torch.Tensor:
    """Rows every precision stores as they are (nothing fitted): the one-pass draw-and-round path."""
    g = torch.Generator().manual_seed(dim + 1)
    return torch.randn(n, dim, generator=g) * torch.exp(torch.randn(n, 1, generator=g))


def _written(precision: str, rounding: str, dim: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Stored bytes, the rows read back (as int32 bits) and the generator's state after: clean rows written at
    scattered rows (drawn in the pass), awkward ones (fitted: noise drawn first) and a range."""
    n = 300
    storage = RowStorage(2 * n + 10, dim, precision)
    g = torch.Generator().manual_seed(5)
    rows = torch.randperm(2 * n + 10, generator=torch.Generator().manual_seed(2))
    storage.write(rows[:n], _clean_rows(n, dim), rounding, g)
    storage.write(rows[n : 2 * n], _awkward_rows(n, dim), rounding, g)
    storage.write_range(2 * n, _clean_rows(10, dim), rounding, g)
    read = storage.read(torch.arange(2 * n + 10), torch.device("cpu"))
    return _bytes(storage), read.view(torch.int32), g.get_state()


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dim", [1, 7, 8, 9, 16, 24, 31, 64, 100, 128, 300])
def test_every_simd_level_stores_and_reads_the_bytes_of_the_plain_loops_and_of_torch(
    simd_level: str, precision: str, rounding: str, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _written(precision, rounding, dim)
    _native.set_simd("scalar")
    plain = _written(precision, rounding, dim)
    monkeypatch.setattr(_native, "native", lambda: None)
    theirs = _written(precision, rounding, dim)
    for other in (plain, theirs):
        for a, b in zip(ours[0], other[0], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(ours[1], other[1])
        assert torch.equal(ours[2], other[2])  # the noise drawn in the pass left the stream where torch's is


@pytest.mark.parametrize("skip", [0, 1, 7, 623, 624, 625, 1000])
def test_every_simd_level_draws_torch_rand(simd_level: str, skip: int) -> None:
    """The vectorized twist and tempering give torch.rand's values and state from any point of the stream."""
    ours, theirs = torch.Generator().manual_seed(skip), torch.Generator().manual_seed(skip)
    torch.rand(skip, generator=ours), torch.rand(skip, generator=theirs)
    for count in (1, 5, 17, 623, 624, 2000):
        drawn = quantize.uniform((count,), ours)
        assert drawn is not None and torch.equal(drawn, torch.rand(count, generator=theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())


def test_the_simd_level_is_checked_and_the_environment_can_force_the_plain_loops() -> None:
    with pytest.raises(ValueError, match="SIMD level"):
        _native.set_simd("sse9")
    assert _native.set_simd("scalar") == _native.simd() == "scalar"
    assert _native.set_simd(None) in _native.SIMD_LEVELS
    code = "from slipcache import _native; print(_native.native() is not None, _native.simd())"
    env = {**os.environ, "SLIPCACHE_NATIVE_SIMD": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["True", "scalar"], out.stderr  # the library loaded, on the plain loops


def test_a_stream_state_is_checked_before_the_pass_reads_it() -> None:
    storage = RowStorage(4, 8, "int8")
    args = (torch.zeros(2, 8), "int8", *storage.buffers())
    with pytest.raises(ValueError, match="stream state"):
        quantize.quantize_rows(*args, scales=_SCALES, limit=1e4, stream=torch.zeros(10, dtype=torch.uint8))
    state = torch.Generator().manual_seed(0).get_state()
    state[8:12] = 0  # draws left before the twist: 0 is not a state torch writes
    with pytest.raises(ValueError, match="generator state"):
        quantize.quantize_rows(*args, scales=_SCALES, limit=1e4, stream=state)
    state[8:12] = torch.tensor([600], dtype=torch.int32).view(torch.uint8)
    state[16:24] = torch.tensor([600], dtype=torch.int64).view(torch.uint8)  # 600 + 600 words: past the 624
    with pytest.raises(ValueError, match="generator state"):
        quantize.quantize_rows(*args, scales=_SCALES, limit=1e4, stream=state)
