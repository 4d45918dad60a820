"""How a global batch is split over the replicas: the rule every strategy uses.

Rows are split like ``np.array_split`` (the same rule as the collectives' segments,
``collectives.split_bounds``): the first ``rows % N`` replicas get one row more. Strategies weight
each replica's gradients by its share of the rows, so N replicas on the shards of a global batch make
exactly the update of one process on the whole batch, remainder or not.
"""

from __future__ import annotations

from typing import Any, Mapping

from stratagem.collectives.algorithms import split_bounds
from stratagem.core.errors import ConfigurationError


def shard_batch(batch, rank: int, size: int, *, what: str = "the batch") -> tuple[Any, int, int]:
    """Replica ``rank``'s shard of a global ``batch``: ``(shard, its rows, the batch's rows)``.

    ``batch`` is an array, or a tuple, list or dict of arrays with the same number of rows; the shard
    has the same structure, made of views.

    >>> import numpy as np
    >>> shard, rows, total = shard_batch({"x": np.arange(7), "y": np.arange(7) * 2}, 2, 3)
    >>> shard["y"].tolist(), rows, total
    ([10, 12], 2, 7)
    """
    if isinstance(batch, Mapping):
        keys, parts = list(batch), list(batch.values())
    elif isinstance(batch, (tuple, list)):
        keys, parts = None, list(batch)
    else:
        keys, parts = None, None
    columns = [batch] if parts is None else parts
    if not columns:
        raise ConfigurationError(f"{what} is an empty {type(batch).__name__}; give arrays with rows to split")
    total = _rows(columns[0], what)
    for column in columns[1:]:
        if _rows(column, what) != total:
            counts = ", ".join(str(_rows(c, what)) for c in columns)
            raise ConfigurationError(
                f"the arrays of {what} have different numbers of rows ({counts}); every array of a "
                f"batch needs one row per example"
            )
    lo, hi = split_bounds(total, size)[rank:rank + 2]
    shards = [column[lo:hi] for column in columns]
    if parts is None:
        return shards[0], hi - lo, total
    if keys is not None:
        return dict(zip(keys, shards)), hi - lo, total
    return (tuple(shards) if isinstance(batch, tuple) else shards), hi - lo, total


def _rows(column, what: str) -> int:
    shape = getattr(column, "shape", None)
    if shape is None or len(shape) == 0:
        raise ConfigurationError(
            f"{what} holds a {type(column).__name__} without rows; a batch is an array, or a tuple, list "
            f"or dict of arrays, split along their first axis"
        )
    return int(shape[0])
