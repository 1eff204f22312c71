"""The layout benchmark's two INT8 layouts run the same arithmetic: from the same rows, the split arrays and the
inline rows give the same gathered sums and, after an update, the same codes, biases and scale codes."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from benchmarks import row_layout

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")


def test_split_and_inline_rows_gather_and_update_alike(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPCACHE_CACHE_DIR", str(tmp_path))
    lib = row_layout.compile_kernels()
    rows, dim, per_sample = 50, 16, 3
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    bias = np.full(rows, row_layout.BIAS, np.uint16)
    scale = rng.integers(80, 95, rows, dtype=np.uint8)
    inline = np.zeros((rows, dim + 4), np.uint8)
    inline[:, :dim], inline[:, dim : dim + 2], inline[:, dim + 2] = codes, bias[:, None].view(np.uint8), scale
    ids = rng.integers(0, rows, 30).astype(np.int64)
    outs = [np.zeros((ids.size // per_sample, dim), np.float32) for _ in range(2)]
    u8, u16, i64, f32 = row_layout.U8, row_layout.U16, row_layout.I64, row_layout.F32
    args = (ctypes.c_int64(dim), ids.ctypes.data_as(i64), ctypes.c_int64(ids.size), ctypes.c_int64(per_sample))
    lib.split_gather(codes.ctypes.data_as(u8), bias.ctypes.data_as(u16), scale.ctypes.data_as(u8), *args,
                     outs[0].ctypes.data_as(f32))
    lib.inline_gather(inline.ctypes.data_as(u8), *args, outs[1].ctypes.data_as(f32))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.abs(outs[0]).max() > 0
    distinct = np.unique(ids)
    grads = rng.standard_normal((16, dim)).astype(np.float32) * 0.01
    before = codes.copy()
    update = (distinct.ctypes.data_as(i64), ctypes.c_int64(distinct.size), grads.ctypes.data_as(f32),
              ctypes.c_uint32(3))
    lib.split_update(codes.ctypes.data_as(u8), bias.ctypes.data_as(u16), scale.ctypes.data_as(u8),
                     ctypes.c_int64(dim), *update)
    lib.inline_update(inline.ctypes.data_as(u8), ctypes.c_int64(dim), *update)
    np.testing.assert_array_equal(inline[:, :dim], codes)
    np.testing.assert_array_equal(inline[:, dim : dim + 2].copy().view(np.uint16)[:, 0], bias)
    np.testing.assert_array_equal(inline[:, dim + 2], scale)
    untouched = np.setdiff1d(np.arange(rows), distinct)
    np.testing.assert_array_equal(codes[untouched], before[untouched])
    assert not np.array_equal(codes[distinct], before[distinct])
    assert np.unique(bias[distinct]).size > 1  # each updated row found a bias of its own
    # and the rows read back alike with those biases and scale codes
    again = [np.zeros_like(outs[0]) for _ in range(2)]
    lib.split_gather(codes.ctypes.data_as(u8), bias.ctypes.data_as(u16), scale.ctypes.data_as(u8), *args,
                     again[0].ctypes.data_as(f32))
    lib.inline_gather(inline.ctypes.data_as(u8), *args, again[1].ctypes.data_as(f32))
    np.testing.assert_array_equal(again[0], again[1])
    assert not np.array_equal(again[0], outs[0])
