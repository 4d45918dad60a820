"""The ``fp16`` and ``bf16`` compressors: gradients sent in 16 bits, half the bytes of float32.

Both are element-wise, so the replicas' payloads add up: they are all-reduced as they are
(``reduction = "sum"``), and the sum, rounded to 16 bits at every addition, is widened back to the
gradient's dtype. No error feedback by default (the rounding error is relative, 2^-11 for fp16 and 2^-8
for bf16); ``error_feedback=True`` carries it over.

- ``fp16``: IEEE half precision: 10 bits of mantissa, but a range of only ~6e-8 to 65504; larger
  values (or sums) become inf, smaller ones lose precision. ``scale`` multiplies before the cast and
  divides after (loss-scaling style) when gradients are very small or very large.
- ``bf16``: bfloat16, float32's range with 7 bits of mantissa: it never overflows where float32 does
  not. numpy has no bfloat16, so the payload is the top 16 bits of each float32 as ``uint16``, rounded
  to nearest even (NaN kept a NaN); float64 gradients are rounded to float32 first. The payload is
  summed as ``ml_dtypes.bfloat16`` (the same bits), which every transport's all-reduce carries.

    >>> import numpy as np
    >>> bf16 = Bf16Compressor()
    >>> x = np.array([1.0, 1.00390625, 1.01171875, 3e38, -0.0], np.float32)  # 1 + 2^-8 ties to even
    >>> packed = bf16.compress(x, {})
    >>> packed.payload[0].dtype, bf16.decompress(packed).tolist()
    (dtype('uint16'), [1.0, 1.0, 1.015625, 3.00405527047391e+38, -0.0])
    >>> Fp16Compressor().decompress(Fp16Compressor().compress(np.float64(0.1), {})).item()
    0.0999755859375
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from stratagem.compression.base import Compressed, Compressor, check_number
from stratagem.training.variables import array_module

#: float16's largest finite value: larger magnitudes round to inf.
FP16_MAX = 65504.0


class Fp16Compressor(Compressor):
    """Gradients sent as float16 (IEEE half precision); summed in float16. See the module doc.

    Options: ``scale`` (default 1.0: multiply before casting, divide after), ``error_feedback``
    (default False).
    """

    name = "fp16"
    options = {"scale": 1.0}
    reduction = "sum"
    device_arrays = True

    def _check_config(self) -> None:
        check_number(f"compressor {self.name!r}", "scale", self.config["scale"], low=0, low_open=True)

    def encode(self, array, state: dict) -> Compressed:
        scale = float(self.config["scale"])
        with np.errstate(over="ignore"):   # documented: beyond float16's range becomes inf
            half = (array * array.dtype.type(scale) if scale != 1.0 else array).astype(np.float16)
        return Compressed((half,), tuple(array.shape), array.dtype, {})

    def layout(self, shape, dtype, meta) -> list:
        return [(shape, np.float16)]

    def expand(self, compressed: Compressed):
        out = compressed.payload[0].astype(compressed.dtype)
        scale = float(self.config["scale"])
        if scale != 1.0:
            out /= out.dtype.type(scale)
        return out

    def error_bound(self, array):
        array = np.asarray(array)
        if array.dtype == np.float16:
            return 0.0
        scale = float(self.config["scale"])
        magnitude = np.abs(array.astype(np.float64)) * scale
        # relative half an ulp (2^-11) in the normal range, half the smallest subnormal below it
        bound = (magnitude * 2.0 ** -11 + 2.0 ** -25) / scale
        return np.where(magnitude < FP16_MAX + 16, bound, np.inf)


class Bf16Compressor(Compressor):
    """Gradients sent as bfloat16 bit patterns (uint16, round to nearest even); summed as bfloat16.
    See the module doc. Options: ``error_feedback`` (default False)."""

    name = "bf16"
    reduction = "sum"
    sum_dtype = ml_dtypes.bfloat16
    device_arrays = True

    def encode(self, array, state: dict) -> Compressed:
        return Compressed((to_bfloat16_bits(array),), tuple(array.shape), array.dtype, {})

    def layout(self, shape, dtype, meta) -> list:
        return [(shape, np.uint16)]

    def expand(self, compressed: Compressed):
        return from_bfloat16_bits(compressed.payload[0], compressed.dtype)

    def error_bound(self, array):
        array = np.asarray(array)
        # half a bfloat16 ulp (2^-8 relative) plus float64 -> float32 rounding, and below float32's
        # normal range half the smallest bfloat16 subnormal (2^-133)
        return np.abs(array.astype(np.float64)) * (2.0 ** -8 + 2.0 ** -23) + 2.0 ** -133


def to_bfloat16_bits(array):
    """The bfloat16 nearest each element (ties to even) as its bits: the top half of the float32.

    >>> to_bfloat16_bits(np.array([1.0, -2.5, np.inf, np.nan], np.float32)).tolist()
    [16256, 49184, 32640, 32704]
    """
    xp = array_module(array)
    with np.errstate(over="ignore"):   # float64 beyond float32's range: inf, as bfloat16 would give
        bits = xp.ascontiguousarray(array, dtype=np.float32).reshape(array.shape).view(np.uint32)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits. A carry
    # into the exponent is right (it rounds up to the next binade, or to inf past the largest value).
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = xp.isnan(array)
    if nan.any():   # rounding could carry a NaN's low mantissa bits into inf: keep it a (quiet) NaN
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def from_bfloat16_bits(bits, dtype=np.float32):
    """The values of bfloat16 bit patterns (``uint16``), as ``dtype`` (exact for float32 and float64).

    >>> from_bfloat16_bits(np.array([16256, 49184], np.uint16)).tolist()
    [1.0, -2.5]
    """
    wide = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return wide if np.dtype(dtype) == np.float32 else wide.astype(dtype)
