import math

import pytest
import torch

from slipcache.embedding.quant import (
    SCALE_STEPS_PER_OCTAVE,
    RowStorage,
    decode_scale,
    dequantize_int,
    encode_scale,
    pack_int4,
    quantize_int,
    round_float,
    unpack_int4,
)

SCALE_SLACK = 2 ** (1 / SCALE_STEPS_PER_OCTAVE)  # the scale grid rounds up by at most one step


def rows(n: int = 64, dim: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_int_error_bound(bits: int, rounding: str) -> None:
    x = rows()
    codes, bias, scale_code = quantize_int(x, bits, rounding, torch.Generator().manual_seed(1))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    restored = dequantize_int(codes, bias, scale_code)
    row_range = (x.amax(1) - x.amin(1))[:, None]
    step = row_range / ((1 << bits) - 1) * SCALE_SLACK * (1 + 1e-3) + 1e-3 * row_range / 2**10
    limit = step / 2 if rounding == "nearest" else step
    assert bool(((restored - x).abs() <= limit + 1e-7).all())
    # the scale never falls short of the row's range and is at most one grid step above it
    needed = row_range.squeeze(1) / ((1 << bits) - 1)
    assert bool((decode_scale(scale_code) >= needed).all())


@pytest.mark.parametrize("dtype,relative", [(torch.float16, 2**-11), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float_error_bound(dtype: torch.dtype, relative: float, rounding: str) -> None:
    x = rows()
    y = round_float(x, dtype, rounding, torch.Generator().manual_seed(0)).float()
    factor = 1 if rounding == "nearest" else 2
    assert bool(((y - x).abs() <= factor * relative * x.abs() + 1e-7).all())


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16", "bf16"])
def test_stochastic_rounding_is_unbiased(precision: str) -> None:
    """Mean of many stochastic roundings of one row converges to the fp32 row (5-sigma bound)."""
    x = rows(1, 32, seed=3).expand(4000, 32).contiguous()
    storage = RowStorage(4000, 32, precision)
    storage.write(torch.arange(4000), x, "stochastic", torch.Generator().manual_seed(7))
    restored = storage.read(torch.arange(4000), torch.device("cpu"))
    if precision.startswith("int"):
        step = float(decode_scale(storage.scale_code[:1]))
    else:
        step = float(x.abs().max()) * (2**-10 if precision == "fp16" else 2**-7)
    sigma = step / 2  # a two-point distribution over one step has standard deviation <= step / 2
    bound = 5 * sigma / math.sqrt(4000)
    error = (restored.mean(0) - x[0]).abs()
    assert float(error.max()) <= bound, (float(error.max()), bound)
    # and nearest rounding of the same row is biased by more than that on some coordinate
    storage.write(torch.arange(4000), x, "nearest", None)
    nearest = storage.read(torch.arange(4000), torch.device("cpu")).mean(0)
    assert float((nearest - x[0]).abs().max()) > bound


@pytest.mark.parametrize("dim", [1, 7, 16, 33])
def test_int4_pack_round_trip(dim: int) -> None:
    codes = torch.randint(0, 16, (10, dim), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (10, (dim + 1) // 2)
    assert torch.equal(unpack_int4(packed, dim), codes)


def test_scale_code_rounds_up_within_one_step() -> None:
    needed = torch.logspace(-6, 2, 500)
    scale = decode_scale(encode_scale(needed))
    assert bool((scale >= needed).all())
    assert bool((scale <= needed * SCALE_SLACK * 1.0001).all())


@pytest.mark.parametrize(
    "precision,bytes_per_row", [("fp32", 64), ("fp16", 32), ("bf16", 32), ("int8", 19), ("int4", 11)]
)
def test_storage_round_trip_and_row_bytes(precision: str, bytes_per_row: int) -> None:
    storage = RowStorage(100, 16, precision)
    assert storage.bytes_per_row == bytes_per_row
    x = rows(100, 16)
    storage.write_range(0, x, "nearest", None)
    y = storage.read(torch.arange(100), torch.device("cpu"))
    tolerance = {"fp32": 0, "fp16": 1e-2, "bf16": 5e-2, "int8": 0.05, "int4": 0.8}[precision]
    assert float((y - x).abs().max()) <= tolerance
