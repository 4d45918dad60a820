"""Step arguments and results of the ``in_graph`` strategy: splitting a global batch over the replicas,
and the replicas' results (:class:`PerReplica`). Arguments and results travel as
:mod:`stratagem.strategies.remote_calls.values` (plain metadata plus array buffers, never pickled).

A step's arguments are a tree: tuples, lists and dicts whose leaves are arrays (numpy, cupy, PyTorch:
anything with a ``shape`` that slices) or plain values (numbers, strings, ``None``...). Every leaf
with rows (an array of at least one dimension) is part of the batch and is split along its first
axis; the other leaves go to every replica unchanged. Rows are split like ``np.array_split``
(:func:`stratagem.training.sharding.shard_batch`'s rule): the first ``rows % N`` replicas get one more.

    >>> import numpy as np
    >>> tree = ((np.arange(5), np.arange(10).reshape(5, 2)), {"lr": 0.1})
    >>> batch_rows(("args", tree))
    5
    >>> [len(split_tree(tree, lo, hi)[0][0]) for lo, hi in zip([0, 3], [3, 5])]
    [3, 2]
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.strategies.distribute import PerReplica  # noqa: F401 - defined there, used here
from stratagem.strategies.remote_calls.values import to_host


def has_rows(leaf) -> bool:
    """True for an array-like leaf with at least one dimension (it is part of the batch)."""
    shape = getattr(leaf, "shape", None)
    return not isinstance(leaf, (str, bytes)) and isinstance(shape, tuple) and len(shape) >= 1


def _children(node):
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, (tuple, list)):
        return list(enumerate(node))
    return None


def _rebuild(node, values: list):
    if isinstance(node, Mapping):
        return dict(zip(node.keys(), values))
    if isinstance(node, tuple):
        return type(node)(*values) if hasattr(node, "_fields") else tuple(values)
    return list(values)


def map_leaves(node, fn, path: str = "args"):
    """``node`` with every leaf replaced by ``fn(leaf, path)`` (containers rebuilt alike)."""
    children = _children(node)
    if children is None:
        return fn(node, path)
    return _rebuild(node, [map_leaves(child, fn, f"{path}[{key!r}]") for key, child in children])


def batch_rows(*named) -> int | None:
    """The number of rows of the batch in the ``(name, tree)`` pairs (``None`` if no leaf has rows).

    Every leaf with rows must have the same number of them; the error names the leaves that differ.

    >>> batch_rows(("args", (np.zeros(3), 0.1)), ("kwargs", {"mask": np.ones(3)}))
    3
    """
    found: list[tuple[str, int]] = []

    def visit(leaf, path):
        if has_rows(leaf):
            found.append((path, int(leaf.shape[0])))
        return leaf

    for name, tree in named:
        map_leaves(tree, visit, name)
    if not found:
        return None
    rows = found[0][1]
    different = [(path, n) for path, n in found if n != rows]
    if different:
        listed = ", ".join(f"{path} has {n}" for path, n in [found[0], *different[:3]])
        raise ConfigurationError(
            f"the step's arrays have different numbers of rows ({listed}); every array argument is "
            f"split over the replicas along its first axis, so each needs one row per example "
            f"(pass values that every replica gets whole as numbers, or as 0-d arrays)"
        )
    return rows


def split_tree(tree, lo: int, hi: int):
    """``tree`` with rows ``lo:hi`` of every leaf that has rows (views where the array type allows)."""
    return map_leaves(tree, lambda leaf, path: leaf[lo:hi] if has_rows(leaf) else leaf)


def reduce_per_replica(op: str, value: PerReplica):
    """Combine ``value.values`` with ``op``; ``mean`` weighs each replica by its rows when known.

    >>> reduce_per_replica("mean", PerReplica([1.0, 4.0], rows=[3, 1]))
    1.75
    >>> reduce_per_replica("max", PerReplica([np.array([1, 5]), np.array([2, 0])])).tolist()
    [2, 5]
    """
    values = list(value.values)
    if not values:
        raise ConfigurationError("nothing to reduce: no replica ran the step (the batch had no rows)")
    scalar = all(isinstance(v, (int, float, np.generic)) and not isinstance(v, bool) for v in values)
    try:
        stacked = np.stack([np.asarray(to_host(v) if hasattr(v, "shape") else v) for v in values])
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot reduce the replicas' values ({', '.join(type(v).__name__ for v in values)}): {exc}; "
            f"reduce numbers or arrays of one shape (reduce each part of a structure on its own)"
        ) from None
    if op == "mean":
        rows = value.rows
        if rows is not None and sum(rows) > 0:
            weights = np.asarray(rows, np.float64) / sum(rows)
            result = np.tensordot(weights, stacked, axes=1)
            if np.issubdtype(stacked.dtype, np.floating):
                result = result.astype(stacked.dtype, copy=False)
        else:
            result = stacked.mean(axis=0)
    else:
        result = getattr(np, op)(stacked, axis=0)
    return np.asarray(result).item() if scalar else result
