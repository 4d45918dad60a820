"""The ``topk`` compressor: send only the largest ``ratio`` of each gradient's entries, with error feedback.

Each gradient sends its ``k = ceil(ratio * size)`` entries of largest magnitude as two arrays: their
flat indices (int32, int64 beyond 2^31 entries; sorted) and their values. What is not sent stays in the
residual (``error_feedback``, on by default) and is added to the next step's gradient, so every entry
is applied eventually: without it, small but consistent gradients would never move their parameters.

Replicas choose different entries, so payloads do not add up: under ``mirrored`` every replica's
payload is all-gathered and the sparse sums added in rank order (``reduction = "gather"``), which moves
about ``(replicas - 1) * 2 * ratio`` of the dense gradient's bytes per replica (8 bytes per kept
float32 entry), against ``2 (replicas - 1) / replicas`` for a dense ring all-reduce: it pays while
``ratio`` is well below ``1 / replicas``.

    >>> import numpy as np
    >>> topk = TopKCompressor(ratio=0.25)
    >>> g = np.array([[0.5, -4.0], [1.0, 0.25]], np.float32)
    >>> state = topk.init_state(g.shape, g.dtype)
    >>> topk.decompress(topk.compress(g, state)).tolist()          # 1 of 4 entries
    [[0.0, -4.0], [0.0, 0.0]]
    >>> topk.decompress(topk.compress(np.zeros_like(g), state)).tolist()   # then the residual's largest
    [[0.0, 0.0], [1.0, 0.0]]
"""

from __future__ import annotations

import math

import numpy as np

from stratagem.compression.base import Compressed, Compressor, check_number
from stratagem.core.errors import ProtocolError

#: Flat indices are int32 below this many entries, int64 from there.
INT32_LIMIT = 2 ** 31


def index_dtype(size: int) -> np.dtype:
    """The dtype of the indices of an array of ``size`` entries."""
    return np.dtype(np.int32 if size < INT32_LIMIT else np.int64)


class TopKCompressor(Compressor):
    """The ``k = ceil(ratio * size)`` largest-magnitude entries of each gradient (see the module doc).

    Options: ``ratio`` (default 0.01: in (0, 1]), ``error_feedback`` (default True).
    """

    name = "topk"
    options = {"ratio": 0.01, "error_feedback": True}
    reduction = "gather"

    def check_config(self) -> None:
        check_number(f"compressor {self.name!r}", "ratio", self.config["ratio"], low=0, high=1, low_open=True)

    def k_for(self, size: int) -> int:
        """How many entries an array of ``size`` entries sends: at least one, unless it is empty."""
        return min(size, max(1, math.ceil(float(self.config["ratio"]) * size))) if size else 0

    def encode(self, array, state: dict) -> Compressed:
        flat = array.reshape(-1)
        size = int(flat.size)
        k = self.k_for(size)
        if k == size:
            indices = np.arange(size, dtype=index_dtype(size))
        else:
            indices = np.argpartition(np.abs(flat), size - k)[size - k:].astype(index_dtype(size))
            indices.sort()
        return Compressed((indices, flat[indices]), tuple(array.shape), array.dtype, {"k": k})

    def layout(self, shape, dtype, meta) -> list:
        size = math.prod(shape)
        k = meta["k"]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= size:
            raise ValueError(f"k must be an integer in [0, {size}], got {k!r}")
        return [((k,), index_dtype(size)), ((k,), dtype)]

    def check_payload(self, compressed: Compressed) -> None:
        indices = compressed.payload[0]
        size = math.prod(compressed.shape)
        if indices.size and (indices[0] < 0 or indices[-1] >= size or np.any(np.diff(indices) <= 0)):
            raise ProtocolError(f"compressor {self.name!r}: indices must be increasing, within [0, {size})")

    def expand(self, compressed: Compressed):
        indices, values = compressed.payload
        out = np.zeros(math.prod(compressed.shape), compressed.dtype)
        out[indices] = values
        return out.reshape(compressed.shape)

    def accumulate(self, out, compressed: Compressed) -> None:
        indices, values = compressed.payload
        out.reshape(-1)[indices] += values      # indices are unique: no entry is added twice

    def error_bound(self, array):
        magnitude = np.abs(np.asarray(array)).reshape(-1)
        size = int(magnitude.size)
        dropped = size - self.k_for(size)
        if dropped == 0:
            return 0.0
        return float(np.partition(magnitude, dropped - 1)[dropped - 1])   # the largest entry not sent
