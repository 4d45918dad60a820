"""The ``fp16`` and ``bf16`` compressors: gradients sent in 16 bits, half the bytes of float32.

Both are element-wise, so the replicas' payloads add up. No error feedback by default (the rounding
error is relative, 2^-11 for fp16 and 2^-8 for bf16); ``error_feedback=True`` carries it over.

- ``fp16``: IEEE half precision: 10 bits of mantissa, but a range of only ~6e-8 to 65504; larger
  values (or sums) become inf, smaller ones lose precision. ``scale`` multiplies before the cast and
  divides after (loss-scaling style) when gradients are very small or very large. numpy is slow with
  float16: ``astype(np.float16)`` takes ~0.5 us per value that underflows to a subnormal half, and
  widening a subnormal half back ~20 ns, where gradients have 10-25% of such values;
  :func:`to_float16` and :func:`from_float16` do both at numpy's fast speed, bit for bit the same (see
  them). Each float16 addition converts its operands one by one (~40 ns), so on the host the replicas'
  float16 payloads are all-gathered (one float16 buffer for every array of the call, cast straight
  into it) and summed in float32 (float64 for float64 gradients), in rank order: as many bytes as a
  ring all-reduce with 2 replicas, ``(N - 1) / 2`` times as many with N. cupy gradients are summed by
  a float16 all-reduce instead (NCCL adds float16 natively).
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

import functools

import ml_dtypes
import numpy as np

from stratagem.compression.base import Compressed, Compressor, check_number
from stratagem.training.variables import array_module, is_device_array

#: float16's largest finite value: larger magnitudes round to inf.
FP16_MAX = 65504.0


class Fp16Compressor(Compressor):
    """Gradients sent as float16 (IEEE half precision); summed widened on the host, in float16 on a
    GPU. See the module doc.

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
        scaled = self._scaled(array)
        if is_device_array(array):
            with np.errstate(over="ignore"):
                half = scaled.astype(np.float16)
        else:
            half = to_float16(scaled)
        return Compressed((half,), tuple(array.shape), array.dtype, {})

    def layout(self, shape, dtype, meta) -> list:
        return [(shape, np.float16)]

    def expand(self, compressed: Compressed):
        half = compressed.payload[0]
        out = half.astype(compressed.dtype) if is_device_array(half) else from_float16(half, compressed.dtype)
        return self._unscale(out)

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
        """Host arrays: every array cast into one float16 buffer, all-gathered, and each replica's
        halves widened and summed in rank order (numpy's float16 additions are slow); cupy arrays: one
        float16 sum all-reduce per bucket."""
        arrays = [self.check_array(array) for array in arrays]
        if any(is_device_array(array) for array in arrays):
            return self._reduce_by_sum(comm, [self.compress(a, s) for a, s in zip(arrays, states)])
        bounds = np.cumsum([0] + [int(array.size) for array in arrays]).tolist()
        halves = np.empty(bounds[-1], np.float16)
        for array, state, lo, hi in zip(arrays, states, bounds, bounds[1:]):
            self._encode_into(halves[lo:hi], array, state)
        rows = comm.allgather(halves)              # (replicas, elements): every replica's halves
        results = []
        for array, lo, hi in zip(arrays, bounds, bounds[1:]):
            wide = np.float64 if array.dtype == np.float64 else np.float32
            total = from_float16(rows[0, lo:hi], wide)
            scratch = np.empty_like(total) if comm.size > 2 else None
            for rank in range(1, comm.size):
                total += from_float16(rows[rank, lo:hi], wide, out=scratch)
            total = self._unscale(total)
            if array.dtype == np.float16:     # (a sum of float16 gradients, rounded back as numpy would)
                total = to_float16(total)
            results.append(total.astype(array.dtype, copy=False).reshape(array.shape))
        return results

    def _encode_into(self, slot, array, state: dict) -> None:
        """``compress(array, state)``'s payload, written into ``slot`` (a flat float16 view)."""
        residual = state.get("residual") if self.error_feedback else None
        corrected = array if residual is None else array + residual
        to_float16(self._scaled(corrected), out=slot)
        if residual is not None:    # what this step did not send waits for the next one
            np.subtract(corrected, self._unscale(from_float16(slot, array.dtype)).reshape(array.shape),
                        out=residual)

    def _scaled(self, array):
        scale = float(self.config["scale"])
        return array * array.dtype.type(scale) if scale != 1.0 else array

    def _unscale(self, array):
        """``array`` (a fresh array of the gradient's dtype, or float32/float64) divided by ``scale``, in place."""
        scale = float(self.config["scale"])
        if scale != 1.0:
            array /= array.dtype.type(scale)
        return array


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


#: The bits of float16's smallest normal magnitude (2^-14) as a float32: below it, halves are subnormal.
_FP16_MIN_NORMAL_BITS = np.uint32(0x38800000)
#: The bits of 0.5 as a float32 (see :func:`to_float16`).
_HALF_BITS = np.uint32(0x3F000000)


def to_float16(array, out=None):
    """numpy's ``array.astype(np.float16)`` (round to nearest even, beyond the range inf), bit for bit,
    without its slow path: numpy converts values in float16's normal range fast (~1 ns each) but takes
    ~0.5 us per value that underflows to a subnormal or zero, and 10-25% of a gradient's values do.
    Those are converted here by float32 arithmetic instead: ``0.5 + |x|`` rounds ``|x|`` to a multiple
    of 2^-24 (float32's spacing just above 0.5, with its ties to even), so the low bits of the sum are
    the subnormal half's (1024 carries into the smallest normal, as it should). float64 arrays are
    rounded to float32 first. ``out``: a float16 array of ``array``'s size to write into (else a new
    one of its shape).

    >>> to_float16(np.array([1.0, 65519.0, 65520.0, 1e-7, -2.0 ** -25], np.float32)).tolist()
    [1.0, 65504.0, inf, 1.1920928955078125e-07, -0.0]
    """
    shape = np.shape(array)
    with np.errstate(over="ignore"):   # beyond float16's (or float32's) range: inf, as documented
        x = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)   # 1-D: 0-d operations give scalars
    half = np.empty(x.size, np.float16) if out is None else out.reshape(-1)
    bits = x.view(np.uint32)
    small = np.flatnonzero((bits & np.uint32(0x7FFFFFFF)) < _FP16_MIN_NORMAL_BITS)
    with np.errstate(over="ignore"):
        if small.size:
            normal = x.copy()
            normal[small] = 0              # numpy converts the others fast; these are done below
            np.copyto(half, normal, casting="unsafe")
        else:
            np.copyto(half, x, casting="unsafe")
    if small.size:
        tiny = bits[small]
        sign = (tiny >> np.uint32(16)) & np.uint32(0x8000)
        tiny &= np.uint32(0x7FFFFFFF)
        rounded = tiny.view(np.float32) + np.float32(0.5)        # |x| + 0.5: ties to even at 2^-24
        subnormal = rounded.view(np.uint32) - _HALF_BITS
        subnormal |= sign
        half.view(np.uint16)[small] = subnormal
    return half.reshape(shape) if out is None else out


def from_float16(half, dtype=np.float32, out=None):
    """numpy's ``half.astype(dtype)`` for float16 ``half`` on the host, bit for bit (a NaN stays a NaN,
    its payload kept for float32), at the speed of a table lookup: numpy widens a normal half in ~1 ns but a subnormal one in ~20.
    ``out``: an array of ``dtype`` and ``half``'s size to write into (else a new one of its shape).

    >>> from_float16(np.array([1.0, 6e-8, -np.inf], np.float16)).tolist()
    [1.0, 5.960464477539063e-08, -inf]
    """
    bits = np.ascontiguousarray(half, dtype=np.float16).reshape(-1).view(np.uint16)
    dtype = np.dtype(dtype)
    target = np.empty(bits.size, dtype) if out is None else out.reshape(-1)   # (out: contiguous)
    if dtype == np.float16:
        target.view(np.uint16)[...] = bits
    elif dtype == np.float32:
        np.take(_float16_values(), bits, out=target, mode="clip")   # ("raise" would copy: every index is valid)
    else:
        with np.errstate(invalid="ignore"):    # (a NaN stays a NaN)
            target[...] = np.take(_float16_values(), bits, mode="clip")
    return target.reshape(np.shape(half)) if out is None else out


@functools.cache
def _float16_values() -> np.ndarray:
    """Every float16 bit pattern's value as float32 (65536 of them, 256 KiB; read-only)."""
    table = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    table.flags.writeable = False
    return table


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
