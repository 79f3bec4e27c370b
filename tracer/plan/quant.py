"""Quantize-dequantize of low-precision block formats (pure functions, used on KV caches).

Every function takes a floating tensor of any shape, computes in float32 and returns a float32
tensor of the same shape holding the values the format can represent (quantize, then dequantize).
Blocks run along the last dimension; a last dimension that is not a multiple of the block size
is padded with zeros to one (the padding never affects the other elements' scale, since zeros do
not raise a block's amax). NaN propagates.

Formats:

``fp8-e4m3``
    OCP FP8 E4M3 ("E4M3FN": 4 exponent bits, bias 7, 3 mantissa bits, no infinities), one
    value per element, no scale. Round to nearest even; magnitudes above the largest finite
    value 448 saturate to ±448; subnormals down to 2^-9.
``mxfp8``
    OCP Microscaling MXFP8 (E4M3 elements), spec v1.0: blocks of 32 elements share one E8M0
    scale X = 2^(floor(log2(amax)) - emax_elem) with emax_elem = 8 (E4M3's largest exponent),
    clamped to E8M0's range 2^-127..2^127. Elements are x / X converted to E4M3 (round to nearest
    even, saturating to ±448). A block of zeros gets X = 2^-127 (any scale gives zeros).
``nvfp4``
    NVIDIA NVFP4: E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6; round to nearest even,
    saturating to ±6) in blocks of 16 sharing an FP8 E4M3 scale s = e4m3(amax / 6). With
    ``tensor_scale=True`` a per-tensor FP32 scale g = amax_tensor / (448 * 6) comes first and the
    block scale is s = e4m3(amax_block / (6 * g)); the dequantized value is q * s * g. A block
    whose scale rounds to 0 dequantizes to zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tracer import schema
from tracer.errors import TracerError

if TYPE_CHECKING:  # torch is imported where a tensor is quantized: a --kv-format is checked without it
    import torch

E4M3_MAX = 448.0
E4M3_EMAX = 8  # largest unbiased exponent of a finite E4M3 value (448 = 1.75 * 2^8)
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


@dataclass(frozen=True)
class BlockFormat(schema.Record):
    """What a KV format stores, written into the trace header.

    Attributes:
        name: ``fp8-e4m3`` | ``mxfp8`` | ``nvfp4``.
        element: element type (``e4m3``, ``e2m1``).
        block_size: elements sharing one scale (0 = no block scale).
        scale: scale type (``none``, ``e8m0``, ``e4m3``), plus ``+fp32 tensor`` when present.
        axis: which axis the blocks run along in the KV cache.
        spec: the definition followed.
    """

    name: str
    element: str
    block_size: int
    scale: str
    axis: str = "head_dim (last axis of (batch, kv_heads, seq, head_dim)), zero-padded to a whole block"
    spec: str = ""


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as float32 ``(..., n_blocks, block)`` (zero-padded) and the original last size."""
    import torch

    x = x.float()
    d = x.shape[-1]
    pad = (-d) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), d


def _unblock(b: torch.Tensor, d: int) -> torch.Tensor:
    return b.reshape(*b.shape[:-2], -1)[..., :d]


def fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to FP8 E4M3 (nearest even, saturating at ±448); float32 result, same shape."""
    import torch

    x = x.float()
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to FP4 E2M1 (nearest, ties to even mantissa, saturating at ±6); float32 result."""
    import torch

    x = x.float()
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2  # (7,): 0.25 0.75 1.25 1.75 2.5 3.5 5
    a = x.abs().clamp(max=E2M1_MAX)
    idx = torch.bucketize(a, mids)  # a == mids[k] gives k (the lower neighbour)
    tie = (a == mids[idx.clamp(max=len(mids) - 1)]) & (idx % 2 == 1)  # odd index = odd mantissa
    q = grid[idx + tie.long()]
    q = torch.where(torch.isnan(x), x, q)
    return torch.copysign(q, x)


def mx_scale_exponent(amax: torch.Tensor, emax_elem: int = E4M3_EMAX) -> torch.Tensor:
    """E8M0 shared exponent of blocks with absolute maxima ``amax``: floor(log2 amax) - emax_elem,
    clamped to -127..127 (a zero block gives -127). int32 tensor of ``amax``'s shape."""
    import torch

    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.floor(torch.log2(safe)).to(torch.int32) - emax_elem
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN_EXP))
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def mxfp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP8 (E4M3 elements, E8M0 scale per ``block`` elements) quantize-dequantize; float32."""
    import torch

    b, d = _blocks(x, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(mx_scale_exponent(amax).float())  # exact powers of two
    q = fp8_e4m3(b / scale)
    return _unblock(q * scale, d)


def nvfp4(x: torch.Tensor, block: int = 16, tensor_scale: bool = False) -> torch.Tensor:
    """NVFP4 (E2M1 elements, E4M3 scale per ``block`` elements, optional FP32 tensor scale); float32."""
    import torch

    b, d = _blocks(x, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    g = torch.ones((), dtype=torch.float32, device=b.device)
    if tensor_scale:
        t_amax = b.abs().amax()
        g = torch.where(t_amax > 0, t_amax / (E4M3_MAX * E2M1_MAX), g)
    s = fp8_e4m3(amax / (E2M1_MAX * g))  # the stored block scale
    full = s * g
    safe = torch.where(full > 0, full, torch.ones_like(full))
    q = torch.where(full > 0, e2m1(b / safe), torch.zeros_like(b))
    q = torch.where(torch.isnan(b), b, q)
    return _unblock(q * full, d)


#: name → (quantize-dequantize function, its block format)
FORMATS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], BlockFormat]] = {
    "fp8-e4m3": (fp8_e4m3, BlockFormat("fp8-e4m3", "e4m3", 0, "none", spec="OCP FP8 E4M3 (E4M3FN), saturating to ±448")),
    "mxfp8": (mxfp8, BlockFormat("mxfp8", "e4m3", 32, "e8m0",
                                 spec="OCP Microscaling v1.0: X = 2^(floor(log2 amax) - 8)")),
    "nvfp4": (nvfp4, BlockFormat("nvfp4", "e2m1", 16, "e4m3",
                                 spec="NVIDIA NVFP4: block scale e4m3(amax / 6), no tensor scale")),
}


def check_format(name: str) -> str:
    """Validate a KV format name.

    Raises:
        TracerError: unknown format, listing the known ones.
    """
    if name not in FORMATS:
        raise TracerError(f"unknown --kv-format '{name}'; use one of: {', '.join(FORMATS)}")
    return name


def quantize_dequantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` rounded through format ``fmt`` and cast back to ``x``'s dtype and device.

    Raises:
        TracerError: unknown format.
    """
    fn, _ = FORMATS[check_format(fmt)]
    return fn(x).to(x.dtype)
