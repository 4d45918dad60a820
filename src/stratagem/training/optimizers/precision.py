"""Which dtypes an optimizer updates, and the precision it computes an update in.

Half-precision variables (float16, and bfloat16 from ``ml_dtypes``) are updated in float32, with
their slots kept in float32: their own precision loses small updates entirely.
"""

from __future__ import annotations

import numpy as np


def is_float_dtype(dtype: np.dtype) -> bool:
    """True for the floating dtypes an optimizer updates: numpy's, and ``ml_dtypes``' (bfloat16...)."""
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes")
                                 and "float" in dtype.name)


def compute_dtype(dtype) -> np.dtype:
    """The dtype an update of a ``dtype`` variable is computed in (and its slots are kept in).

    >>> compute_dtype(np.float16), compute_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
    """
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype
