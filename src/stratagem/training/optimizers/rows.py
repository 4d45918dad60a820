"""Row updates for sparse gradients: :meth:`Optimizer.update_rows` (a parameter server applies an
embedding table's row gradients with it when the rule allows; see :mod:`stratagem.ps_service.rows`).

The rows of the variable and of its slots are gathered, the optimizer's own rule runs on them with the
same ufuncs as the dense update, and they are scattered back; for a ``sparse_exact`` rule (a zero
gradient leaves a row and its slots as they are) that is the dense update, bit for bit.
"""

from __future__ import annotations

import numpy as np

from stratagem.core.errors import ConfigurationError, StratagemError
from stratagem.training.optimizers.precision import compute_dtype, is_float_dtype
from stratagem.training.variables import _detach, array_module, is_device_array, to_module


def update_rows(optimizer, name: str, value, rows, grad_rows, *, slots_for, update_into) -> None:
    """See :meth:`stratagem.training.optimizers.base.Optimizer.update_rows`, which hands over its rule:
    ``slots_for(name, xp, shape, dtype)``, the slot arrays of variable ``name`` (made on first use), and
    ``update_into(xp, src, w, g, slots, t)``, the update it runs on whole variables."""

    if not optimizer.sparse_exact:
        raise ConfigurationError(
            f"{optimizer!r} updates every row even where the gradient is zero, so a row update is not the "
            f"dense one: densify the gradient (stratagem.training.sparse.densify) and call update_array"
        )
    if optimizer.iterations < 1:
        raise StratagemError(f"{optimizer.name}.update_rows needs iterations >= 1 (it is {optimizer.iterations}): "
                             f"increment opt.iterations before the step")
    dtype = np.dtype(value.dtype)
    if not is_float_dtype(dtype) or not value.ndim:
        raise ConfigurationError(f"update_rows of {name!r}: the variable must be a floating-point array "
                                 f"with rows, got {dtype} of shape {tuple(value.shape)}")
    xp = array_module(value)
    rows = to_module(rows, xp).astype(np.int64, copy=False)
    grad_rows = to_module(_detach(grad_rows) if not is_device_array(grad_rows) else grad_rows, xp)
    if rows.ndim != 1 or tuple(grad_rows.shape) != (len(rows), *value.shape[1:]):
        raise ConfigurationError(
            f"update_rows of {name!r}: {tuple(rows.shape)} rows with a gradient of shape "
            f"{tuple(grad_rows.shape)}; the gradient must be ({len(rows)},) + {tuple(value.shape[1:])}"
        )
    if len(rows) > 1 and not bool((rows[1:] > rows[:-1]).all()) and len(xp.unique(rows)) != len(rows):
        raise ConfigurationError(f"update_rows of {name!r}: rows repeat; sum their gradients first "
                                 f"(IndexedSlices(...).merged())")
    work_dtype = compute_dtype(dtype)
    slots = slots_for(name, xp, tuple(value.shape), work_dtype)
    w = value[rows].astype(work_dtype, copy=False)       # fancy indexing: copies
    row_slots = {slot: array[rows] for slot, array in slots.items()}
    update_into(xp, w, w, grad_rows.astype(work_dtype, copy=False), row_slots, optimizer.iterations)
    for slot, array in slots.items():
        array[rows] = row_slots[slot]
    value[rows] = w.astype(dtype, copy=False) if work_dtype != dtype else w
