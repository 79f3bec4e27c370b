"""Quantize-dequantize against values worked out by hand from the format definitions."""

from __future__ import annotations

import pytest
import torch

from tracer.errors import TracerError
from tracer.plan.quant import e2m1, fp8_e4m3, mxfp8, nvfp4, quantize_dequantize


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_fp8_e4m3_rounding_saturation_subnormals():
    x = t(1.0, 1.0625, 1.1875, 240.0, 448.0, 464.0, 500.0, -1000.0, 0.0, -0.0,
          2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 7 * 2.0 ** -9, 2.0 ** -6, 300.0)
    # E4M3: 3 mantissa bits (step 1/8 in [1, 2)), ties to even; max 448; subnormal step 2^-9
    want = t(1.0, 1.0, 1.25, 240.0, 448.0, 448.0, 448.0, -448.0, 0.0, -0.0,
             2.0 ** -9, 0.0, 2.0 ** -8, 7 * 2.0 ** -9, 2.0 ** -6, 288.0)
    got = fp8_e4m3(x)
    assert torch.equal(got, want)
    assert torch.signbit(got[9])  # -0 stays -0


def test_mxfp8_blocks_of_32_share_an_e8m0_scale():
    x = torch.zeros(4, 32)
    x[0, :3] = t(300.0, 1.0, -3.0)       # amax 300: floor(log2 300) = 8 -> X = 2^(8-8) = 1
    x[1, :3] = t(1000.0, 0.01, 7.0)      # amax 1000: floor(log2) = 9 -> X = 2; 1000/2 = 500 saturates to 448
    x[2, 0] = 2.0 ** -140                 # X = 2^(-140-8) clamps to 2^-127; 2^-13 < E4M3's 2^-9 -> 0
    # row 3: all zeros
    got = mxfp8(x)
    assert got[0, :3].tolist() == [288.0, 1.0, -3.0]
    # 0.01 / 2 = 0.005 = 2.56 * 2^-9 -> 3 * 2^-9 (subnormal), times X = 2
    assert got[1, :3].tolist() == [896.0, 3 * 2.0 ** -9 * 2, 7.0]
    assert got[2, 0].item() == 0.0
    assert torch.equal(got[3], torch.zeros(32)) and torch.equal(got[0, 3:], torch.zeros(29))


def test_mxfp8_partial_block_is_zero_padded():
    x = t(1000.0, 5.0, 0.3)  # one (padded) block: X = 2
    # 0.3 / 2 = 0.15 in [2^-3, 2^-2): step 2^-6, 0.15 / 2^-6 = 9.6 -> 10 * 2^-6 = 0.15625, times 2
    assert mxfp8(x).tolist() == [896.0, 5.0, 0.3125]


def test_e2m1_grid_ties_to_even_and_saturation():
    x = t(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -2.9, 0.3, 7.0, -100.0, 0.0)
    want = t(0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -3.0, 0.5, 6.0, -6.0, 0.0)
    assert torch.equal(e2m1(x), want)


def test_nvfp4_block_scale_is_e4m3_of_amax_over_6():
    x = torch.zeros(3, 16)
    x[0, :4] = t(6.0, 0.75, -2.5, 5.0)   # s = e4m3(6 / 6) = 1
    x[1, :3] = t(10.0, 3.0, -1.0)        # s = e4m3(1.667) = 1.625; 10/1.625 -> 6, 3/1.625 = 1.85 -> 2, 1/1.625 = .62 -> .5
    got = nvfp4(x)
    assert got[0, :4].tolist() == [6.0, 1.0, -2.0, 4.0]
    assert got[1, :3].tolist() == [6 * 1.625, 2 * 1.625, -0.5 * 1.625]
    assert torch.equal(got[2], torch.zeros(16))


def test_nvfp4_tensor_scale():
    x = torch.zeros(2, 16)
    x[0, 0] = 10.0
    x[1, 0] = 1.0
    # g = 10 / (448 * 6); block 0 scale e4m3(10 / (6 g)) = 448 -> 10 exactly (up to fp32 rounding of g)
    got = nvfp4(x, tensor_scale=True)
    assert got[0, 0].item() == pytest.approx(10.0, rel=1e-6)
    # block 1: 1 / (6 g) = 44.8 -> e4m3 44.8 rounds to 44 (step 4 in [32, 64)); 1 / (44 g) = 6.1 -> 6
    g = 10.0 / (448 * 6)
    assert got[1, 0].item() == pytest.approx(6 * 44 * g, rel=1e-6)


def test_quantize_dequantize_keeps_dtype_and_rejects_unknown_format():
    x = torch.randn(2, 3, 5, 16, dtype=torch.bfloat16)
    for fmt in ("fp8-e4m3", "mxfp8", "nvfp4"):
        y = quantize_dequantize(x, fmt)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert torch.equal(quantize_dequantize(y, "fp8-e4m3") if fmt == "fp8-e4m3" else y, y)
    with pytest.raises(TracerError, match="unknown --kv-format"):
        quantize_dequantize(x, "int4")
