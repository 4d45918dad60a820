"""The ``fp16`` and ``bf16`` compressors: gradients sent in 16 bits, half the bytes of float32.

Both are element-wise, so the replicas' payloads add up. No error feedback by default (the rounding
error is relative, 2^-11 for fp16 and 2^-8 for bf16); ``error_feedback=True`` carries it over.

- ``fp16``: IEEE half precision: 10 bits of mantissa, but a range of only ~6e-8 to 65504; larger
  values (or sums) become inf, smaller ones lose precision. ``scale`` multiplies before the cast and
  divides after (loss-scaling style) when gradients are very small or very large. numpy is slow with
  float16: each addition converts its operands one by one (~40 ns), and ``astype(np.float16)`` takes
  ~0.5 us per value that underflows to a subnormal half (:func:`to_float16` converts those by
  arithmetic instead, bit for bit the same; widening back is numpy's, slower for subnormals too). So on the host the replicas' float16 payloads are all-gathered and
  summed in the gradient's dtype
  (decompress-reduce: as many bytes as a ring all-reduce with 2 replicas, ``(N - 1) / 2`` times as many
  with N). cupy gradients are summed by a float16 all-reduce instead (NCCL adds float16 natively).
- ``bf16``: bfloat16, float32's range with 7 bits of mantissa: it never overflows where float32 does
  not. numpy has no bfloat16, so the payload is the top 16 bits of each float32 as ``uint16``, rounded
  to nearest even (NaN kept a NaN); float64 gradients are rounded to float32 first. The payload is
  all-reduced as it is (``reduction = "sum"``), summed as ``ml_dtypes.bfloat16`` (the same bits; its
  additions are fast), which every transport's all-reduce carries; the sum is rounded to bfloat16 at
  every addition.

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
from stratagem.training.variables import array_module, is_device_array

#: float16's largest finite value: larger magnitudes round to inf.
FP16_MAX = 65504.0


class Fp16Compressor(Compressor):
    """Gradients sent as float16 (IEEE half precision); summed in float16. See the module doc.

    Options: ``scale`` (default 1.0: multiply before casting, divide after), ``error_feedback``
    (default False).
    """

    name = "fp16"
    options = {"scale": 1.0}
    reduction = "custom"       # host: all-gather and sum widened; device: a float16 sum all-reduce
    device_arrays = True

    def check_config(self) -> None:
        check_number(f"compressor {self.name!r}", "scale", self.config["scale"], low=0, low_open=True)

    def encode(self, array, state: dict) -> Compressed:
        scale = float(self.config["scale"])
        scaled = array * array.dtype.type(scale) if scale != 1.0 else array
        if is_device_array(array):
            with np.errstate(over="ignore"):
                half = scaled.astype(np.float16)
        else:
            half = to_float16(scaled)
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

    def allreduce(self, comm, arrays, states) -> list:
        """Host arrays: the float16 payloads all-gathered, widened and summed in rank order (numpy's
        float16 additions are slow); cupy arrays: one float16 sum all-reduce per bucket."""
        compressed = [self.compress(array, state) for array, state in zip(arrays, states)]
        if compressed and is_device_array(compressed[0].payload[0]):
            return self._reduce_by_sum(comm, compressed)
        return self._reduce_by_gather(comm, compressed)


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


#: float16's smallest normal magnitude; subnormal halves are its multiples of 2^-24.
_FP16_MIN_NORMAL = np.float32(2.0 ** -14)


def to_float16(array):
    """numpy's ``array.astype(np.float16)`` (round to nearest even, beyond the range inf), bit for bit,
    without its slow path: numpy converts normal values fast but takes ~0.5 us per value that
    underflows to a subnormal or zero (gradients of magnitude 1e-6 convert ~20 times slower than ones
    of magnitude 1). Those are converted here by arithmetic over the whole array: a subnormal half's
    bits are ``|x| / 2^-24`` rounded to nearest even (``np.rint``; 1024 carries into the smallest
    normal, as it should). float64 arrays are rounded to float32 first.

    >>> to_float16(np.array([1.0, 65519.0, 65520.0, 1e-7, -2.0 ** -25], np.float32)).tolist()
    [1.0, 65504.0, inf, 1.1920928955078125e-07, -0.0]
    """
    with np.errstate(over="ignore"):   # beyond float16's (or float32's) range: inf, as documented
        x = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)   # 1-D: 0-d operations give scalars
        magnitude = np.abs(x)
        small = magnitude < _FP16_MIN_NORMAL
        # numpy's slow path costs ~0.5 us per small value, the whole-array arithmetic below ~10 ns per
        # value: under one small value in 50, numpy's conversion is the cheaper
        if np.count_nonzero(small) * 50 < x.size:
            with np.errstate(under="ignore"):
                return x.astype(np.float16).reshape(np.shape(array))
        normal = np.where(small, np.float32(0), magnitude).astype(np.float16).view(np.uint16)
        subnormal = np.rint(np.fmin(magnitude, _FP16_MIN_NORMAL) * np.float32(2.0 ** 24)).astype(np.uint16)  # fmin: NaN too
    bits = np.where(small, subnormal, normal)
    bits |= np.signbit(x).astype(np.uint16) << np.uint16(15)
    return bits.view(np.float16).reshape(np.shape(array))


def to_bfloat16_bits(array):
    """The bfloat16 nearest each element (ties to even) as its bits: the top half of the float32.

    >>> to_bfloat16_bits(np.array([1.0, -2.5, np.inf, np.nan], np.float32)).tolist()
    [16256, 49184, 32640, 32704]
    """
    xp = array_module(array)
    with np.errstate(over="ignore"):   # float64 beyond float32's range: inf, as bfloat16 would give
        bits = xp.ascontiguousarray(array, dtype=np.float32).reshape(-1).view(np.uint32)   # 1-D: see to_float16
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits. A carry
    # into the exponent is right (it rounds up to the next binade, or to inf past the largest value).
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = xp.isnan(bits.view(np.float32))
    if nan.any():   # rounding could carry a NaN's low mantissa bits into inf: keep it a (quiet) NaN
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out.reshape(array.shape)


def from_bfloat16_bits(bits, dtype=np.float32):
    """The values of bfloat16 bit patterns (``uint16``), as ``dtype`` (exact for float32 and float64).

    >>> from_bfloat16_bits(np.array([16256, 49184], np.uint16)).tolist()
    [1.0, -2.5]
    """
    wide = (bits.reshape(-1).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(bits.shape)
    return wide if np.dtype(dtype) == np.float32 else wide.astype(dtype)
