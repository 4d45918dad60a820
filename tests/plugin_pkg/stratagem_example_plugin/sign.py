"""The ``sign`` compressor: each gradient as its signs (int8) and one scale, the mean magnitude.

About a quarter of float32's bytes; lossy, so error feedback is on by default (what the signs miss is
added to the next step). Payloads do not add up (each has its own scale): they are all-gathered.
"""

import numpy as np

from stratagem.compression.base import Compressed, Compressor


class SignCompressor(Compressor):
    name = "sign"
    options = {"error_feedback": True}
    reduction = "gather"

    def encode(self, array, state):
        scale = np.array(np.abs(array).mean() if array.size else 0.0, array.dtype)
        return Compressed((np.sign(array).astype(np.int8), scale), tuple(array.shape), array.dtype, {})

    def layout(self, shape, dtype, meta):
        return [(shape, np.int8), ((), dtype)]

    def expand(self, compressed):
        signs, scale = compressed.payload
        return signs.astype(compressed.dtype) * scale

    def error_bound(self, array):
        magnitude = np.abs(np.asarray(array, np.float64))
        return np.maximum(magnitude, magnitude.mean() if magnitude.size else 0.0) * (1 + 1e-6)
