"""The compiled quantize pass: fp32 rows into storage rows (int8/int4 with row-wise parameters, fp16, bf16,
fp32), nearest or stochastic, written straight into the storage buffers at given rows.

One pass per row instead of torch's dozen passes over [n, D] temporaries: table creation, loading and
eviction all round through it when the library is there. Results are bit-identical to the torch path in
`slipcache.embedding.quant` (tests compare every precision and both roundings).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slipcache import _native
from slipcache._native import _check

KINDS = {"int8": 0, "int4": 1, "fp16": 2, "bf16": 3, "fp32": 4}
_PAYLOAD_DTYPES = {
    "int8": torch.uint8, "int4": torch.uint8, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
}


def available() -> bool:
    return _native.native() is not None


def quantize_rows(
    values: Tensor,
    precision: str,
    payload: Tensor,
    bias: Tensor | None = None,
    scale_code: Tensor | None = None,
    *,
    scales: Tensor,
    limit: float,
    max_span: float | None = None,
    noise: Tensor | None = None,
    rows: Tensor | None = None,
    bad: Tensor | None = None,
    source: Tensor | None = None,
    stream: Tensor | None = None,
) -> int:
    """Round fp32 `values` [n, D] into storage row `rows[i]` (distinct rows; row i when `rows` is None) of `payload`
    ([R, D] or [R, ceil(D / 2)] for int4), `bias` (fp16 [R]) and `scale_code` (uint8 [R]; int precisions).

    `scales` is the 256-entry float table of scale codes; `noise` (uniform [n, D]) makes the rounding
    stochastic. Rows holding inf/NaN, a value beyond ±`limit` or (int) a span beyond `max_span` are left
    unwritten and flagged in `bad` (uint8 [n], when given); returns how many there were. With `source`
    (int64 [n]), row i is read from `values[source[i]]` (`values` then [any, D]: e.g. the cache's rows, read
    at the evicted slots without a gathered copy). With `stream` (a CPU generator's `get_state()`, and no
    `noise`), the noise is drawn inside the pass, on one thread, as `torch.rand((n, D))` would draw it, and
    `stream` is advanced past those draws (set it back into the generator).
    """
    library = _native.native()
    assert library is not None
    dim = values.shape[1]
    n = values.shape[0] if source is None else source.numel()
    width = (dim + 1) // 2 if precision == "int4" else dim
    _check("values", values, (torch.float32,), (values.shape[0] if source is not None else n, dim))
    _check("source", source, (torch.int64,), (n,))
    _check("payload", payload, (_PAYLOAD_DTYPES[precision],), (None, width))
    _check("noise", noise, (torch.float32,), (n, dim))
    _check("rows", rows, (torch.int64,), (n,))
    _check("bad", bad, (torch.uint8,), (n,))
    _check("scales", scales, (torch.float32,), (256,))
    _check("stream", stream, (torch.uint8,), (stream.numel() if stream is not None else 0,))
    if stream is not None and (noise is not None or stream.numel() < _MT_STATE_BYTES):
        raise ValueError("compiled loop: a stream state without noise, of a CPU generator's state size")
    if precision in ("int8", "int4"):
        if bias is None or scale_code is None:
            raise ValueError("compiled loop: int precisions need bias and scale_code")
        _check("bias", bias, (torch.float16,), (payload.shape[0],))
        _check("scale_code", scale_code, (torch.uint8,), (payload.shape[0],))
    if rows is None and n > payload.shape[0]:
        raise ValueError(f"compiled loop: {n} rows do not fit {payload.shape[0]} storage rows")
    if n == 0:
        return 0
    count = library.quantize_rows(
        values.data_ptr(), n, dim, KINDS[precision],
        noise.data_ptr() if noise is not None else None,
        scales.data_ptr(), float(min(limit, torch.finfo(torch.float32).max)),
        -1.0 if max_span is None else float(max_span),
        rows.data_ptr() if rows is not None else None,
        payload.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        scale_code.data_ptr() if scale_code is not None else None,
        bad.data_ptr() if bad is not None else None,
        source.data_ptr() if source is not None else None,
        stream.data_ptr() if stream is not None else None,
        payload.shape[0], values.shape[0],
    )  # rows and source checked in the compiled pass, before anything is written
    if count == -3:
        raise ValueError(f"compiled loop: a row is outside [0, {payload.shape[0]})")
    if count == -4:
        raise ValueError(f"compiled loop: a source row is outside [0, {values.shape[0]})")
    if count == -2:
        raise ValueError("compiled loop: not a generator state it can read")
    if count < 0:
        raise ValueError(f"compiled loop: cannot quantize to {precision} at dim {dim}")
    return int(count)


def dequantize_rows(
    precision: str,
    payload: Tensor,
    bias: Tensor | None,
    scale_code: Tensor | None,
    *,
    scales: Tensor,
    rows: Tensor,
    dim: int,
    out: Tensor | None = None,
    out_rows: Tensor | None = None,
) -> Tensor:
    """fp32 [n, dim] of storage `rows` (int64), decoded as `quant.dequantize_int` does (bit-identical), in one
    pass that prefetches the scattered rows ahead. With `out` and `out_rows` (distinct int64 rows of `out`,
    fp32 [*, dim]), row i is decoded straight into `out[out_rows[i]]` (e.g. the cache slots of admitted rows)
    and `out` returned. Rows are checked in the compiled pass (ValueError, nothing written)."""
    library = _native.native()
    assert library is not None
    width = (dim + 1) // 2 if precision == "int4" else dim
    _check("payload", payload, (_PAYLOAD_DTYPES[precision],), (None, width))
    _check("rows", rows, (torch.int64,), (rows.numel(),))
    _check("scales", scales, (torch.float32,), (256,))
    if precision in ("int8", "int4"):
        _check("bias", bias, (torch.float16,), (payload.shape[0],))
        _check("scale_code", scale_code, (torch.uint8,), (payload.shape[0],))
    else:
        bias = scale_code = None
    if (out is None) != (out_rows is None):
        raise ValueError("compiled loop: out and out_rows go together")
    if out is None:
        out = torch.empty(rows.numel(), dim)
    else:
        _check("out", out, (torch.float32,), (None, dim))
        _check("out_rows", out_rows, (torch.int64,), (rows.numel(),))
    status = library.dequantize_rows(
        payload.data_ptr(), KINDS[precision],
        bias.data_ptr() if bias is not None else None,
        scale_code.data_ptr() if scale_code is not None else None,
        scales.data_ptr(), rows.data_ptr(), rows.numel(), dim, out.data_ptr(), payload.shape[0],
        out_rows.data_ptr() if out_rows is not None else None, out.shape[0],
    )  # fmt: skip
    if status == -2:
        raise ValueError(f"compiled loop: a row is outside [0, {payload.shape[0]})")
    if status == -3:
        raise ValueError(f"compiled loop: an out row is outside [0, {out.shape[0]})")
    if status != 0:
        raise ValueError(f"compiled loop: cannot dequantize {precision} at dim {dim}")
    return out


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, out: Tensor | None = None) -> Tensor | None:
    """`torch.rand(shape, generator=generator)` on CPU, drawn by the compiled loop, faster: the same
    values, and the generator left in the same state; into `out` (contiguous fp32 of that shape) where given.
    None where it cannot (no library, not a CPU generator, or the check against torch.rand at first use
    failed): the caller draws with torch then."""
    generator = torch.default_generator if generator is None else generator
    if generator.device.type != "cpu" or not _uniform_checked():
        return None
    return _draw(shape, generator, out)


_MT_STATE_BYTES = 24 + 624 * 8  # what torch_uniform reads of a CPU generator's state


def stream_state(generator: torch.Generator | None) -> Tensor | None:
    """A copy of `generator`'s state for `quantize_rows(stream=...)` to draw from (then `set_state` it back);
    None where the compiled draws cannot stand in for torch.rand (see `uniform`)."""
    generator = torch.default_generator if generator is None else generator
    if generator.device.type != "cpu" or not _uniform_checked():
        return None
    state = generator.get_state()
    if state.dtype != torch.uint8 or state.numel() < _MT_STATE_BYTES or not state.is_contiguous():
        return None
    return state


def _draw(shape: tuple[int, ...], generator: torch.Generator, out: Tensor | None = None) -> Tensor | None:
    library = _native.native()
    if library is None:  # gone since the check (a test's switch): the caller draws with torch
        return None
    state = generator.get_state()
    if state.dtype != torch.uint8 or state.numel() < _MT_STATE_BYTES or not state.is_contiguous():
        return None  # not the mt19937 layout the loop reads (seed, left, seeded, next, 624 words)
    if out is None:
        out = torch.empty(shape)
    elif out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.shape != shape:
        raise ValueError(f"uniform: out must be a contiguous CPU float32 tensor of shape {shape}")
    if library.torch_uniform(state.data_ptr(), out.data_ptr(), out.numel()) != 0:
        return None
    generator.set_state(state)
    return out


_uniform_ok: bool | None = None


def _uniform_checked() -> bool:
    """Whether the compiled draws equal torch.rand here (values and the state after), checked once."""
    global _uniform_ok
    if _uniform_ok is None:
        _uniform_ok = False
        if available():
            ours, theirs = torch.Generator().manual_seed(20261201), torch.Generator().manual_seed(20261201)
            torch.rand(5, generator=ours), torch.rand(5, generator=theirs)
            drawn = _draw((1500, 3), ours)  # crosses the generator's refills of 624 words
            expected = torch.rand((1500, 3), generator=theirs)
            _uniform_ok = (
                drawn is not None
                and torch.equal(drawn, expected)
                and torch.equal(ours.get_state(), theirs.get_state())
            )
    return _uniform_ok
