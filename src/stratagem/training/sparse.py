"""Sparse gradients: the rows of a large variable (an embedding table) that a step touched.

A step that reads a few rows of a table (``var.gather(ids)``) has a gradient that is zero everywhere
else. :class:`IndexedSlices` carries just those rows, as TensorFlow's type of the same name does, so
that a strategy that can move rows may move only rows (it says so with ``sparse_gradients = True``
and gets the merged slices in ``on_apply_gradients``). The parameter-server strategies do: they pull
only the rows a step gathers and push only the rows of its gradient, and the servers update only
those rows where that is exactly the dense update (:mod:`stratagem.ps_service.rows`). The other
built-in strategies turn them into the dense gradient first (:func:`densify`), as TensorFlow's
``MirroredStrategy`` does, so the update is exactly the dense one.

    >>> import numpy as np
    >>> grad = IndexedSlices(np.ones((2, 3), np.float32), np.array([4, 1]), dense_shape=(5, 3))
    >>> densify(grad)[[1, 4]].tolist(), float(densify(grad).sum())
    ([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 6.0)
    >>> merged = IndexedSlices(np.ones((3, 1)), np.array([2, 0, 2]), (4, 1)).merged()
    >>> merged.indices.tolist(), merged.values.ravel().tolist()      # repeated rows are summed
    ([0, 2], [1.0, 2.0])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.variables import array_module


class IndexedSlices:
    """``values[i]`` is the gradient of row ``indices[i]`` of a variable of shape ``dense_shape``.

    ``values`` has shape ``(len(indices),) + dense_shape[1:]``; indices may repeat (their rows add up)
    and need not be sorted. Checked on construction, with errors that say what is wrong.
    """

    __slots__ = ("values", "indices", "dense_shape")

    def __init__(self, values, indices, dense_shape):
        xp = array_module(values)
        self.values = values if hasattr(values, "shape") else np.asarray(values)
        indices = xp.asarray(indices)
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ConfigurationError(f"IndexedSlices indices must be a 1-D array of integers, got "
                                     f"{indices.dtype} of shape {tuple(indices.shape)}")
        self.indices = indices.astype(np.int64, copy=False)
        self.dense_shape = tuple(int(d) for d in dense_shape)
        if not self.dense_shape:
            raise ConfigurationError("IndexedSlices need a variable with rows (dense_shape of 1 or more dimensions)")
        expected = (len(self.indices),) + self.dense_shape[1:]
        if tuple(self.values.shape) != expected:
            raise ConfigurationError(f"IndexedSlices values have shape {tuple(self.values.shape)}; with "
                                     f"{len(self.indices)} indices into {self.dense_shape} they must be {expected}")
        if len(self.indices) and (int(self.indices.min()) < 0 or int(self.indices.max()) >= self.dense_shape[0]):
            raise ConfigurationError(f"IndexedSlices indices must be rows of the variable, 0 to "
                                     f"{self.dense_shape[0] - 1}; got {int(self.indices.min())} to "
                                     f"{int(self.indices.max())}")

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.indices.nbytes)

    def merged(self) -> "IndexedSlices":
        """The same gradient with sorted, unique indices (repeated rows summed): what an update needs
        so that every row is written once."""
        xp = array_module(self.values)
        unique, inverse = xp.unique(self.indices, return_inverse=True)
        if len(unique) == len(self.indices) and bool((self.indices[1:] > self.indices[:-1]).all()):
            return self
        values = xp.zeros((len(unique),) + self.dense_shape[1:], self.values.dtype)
        xp.add.at(values, inverse.ravel(), self.values)
        return IndexedSlices(values, unique, self.dense_shape)

    def __repr__(self) -> str:
        return (f"IndexedSlices({len(self.indices)} rows of {self.dense_shape}, "
                f"{np.dtype(self.values.dtype).name})")


def is_sparse(grad: Any) -> bool:
    return isinstance(grad, IndexedSlices)


def densify(grad: IndexedSlices, dtype=None):
    """The dense gradient (zeros outside the rows; repeated rows added)."""
    xp = array_module(grad.values)
    dense = xp.zeros(grad.dense_shape, dtype or grad.values.dtype)
    xp.add.at(dense, grad.indices, grad.values)
    return dense
