"""Rows of a table on the parameter servers: pulling only the rows a step gathers, pushing only the rows
its sparse gradient touched, and applying such a gradient on the server.

A table read through ``var.gather(ids)`` and trained with an
:class:`~stratagem.training.sparse.IndexedSlices` gradient need not move whole: the worker asks the shards
that hold the rows for just those rows (operation ``pull_rows``), and pushes, per piece, the row
indices (int64, relative to the piece's first row) and the rows of the gradient (operation ``push``
with ``rows``). Everything travels as wire buffers (no pickle).

On the server, a row gradient is applied to the rows alone when the rule leaves a row with a zero
gradient and its slots exactly as they were (``optimizer.sparse_exact``: plain SGD, Adagrad), so the
result is bit for bit the dense update's. For the other rules (SGD with momentum, Adam) a zero
gradient still moves every row (the momentum decays), so the server rebuilds the dense gradient of the
piece from the received rows and runs the ordinary dense update: only rows on the wire, the dense
update's cost on the server, the dense update's result.

An exact row update writes into the piece's array in place, unless a reply still sends that array
(then into a copy: :meth:`~stratagem.ps_service.buffers.PieceValues.update`). A ``sync`` round sums
row gradients as rows (:func:`add_rows`, :func:`row_sum`), the dense weighted mean bit for bit.

Splitting sorted rows over the pieces of a partitioned table (rows 0-4 on one shard, 5-9 on another)::

    >>> import numpy as np
    >>> from stratagem.ps_service.placement import Piece
    >>> pieces = [Piece("t/part_0", "t", 0, 0, 2, 0, 5, 80), Piece("t/part_1", "t", 1, 1, 2, 5, 10, 80)]
    >>> [(p.name, lo, hi, local.tolist()) for p, lo, hi, local in split_rows(np.array([1, 4, 5, 9]), pieces)]
    [('t/part_0', 0, 2, [1, 4]), ('t/part_1', 2, 4, [0, 4])]
"""

from __future__ import annotations

import numpy as np

from stratagem.core.errors import ProtocolError
from stratagem.ps_service.protocol import RequestRefused
from stratagem.training.sparse import IndexedSlices
from stratagem.training.variables import to_module

__all__ = ["RowRequestError", "split_rows", "fetch_rows", "split_gradient", "check_rows", "check_real",
           "read_rows", "row_gradients", "add_rows", "row_sum"]


class RowRequestError(RequestRefused):
    """A row request or a row gradient the server refuses (the message says what is wrong)."""


# -- the worker's side ---------------------------------------------------------------------------------

def split_rows(rows: np.ndarray, pieces) -> list[tuple]:
    """``(piece, lo, hi, local rows)`` for each piece that holds some of ``rows`` (sorted, unique, int64):
    ``rows[lo:hi]`` fall in the piece, and ``local`` are those rows counted from its first row."""
    return [(piece, lo, hi, rows[lo:hi] - piece.lo) for piece, lo, hi in _spans(rows, pieces) if hi > lo]


def _spans(rows: np.ndarray, pieces):
    """``(piece, lo, hi)`` for every piece: ``rows[lo:hi]`` (sorted) fall in the piece's row range."""
    for piece in pieces:
        lo, hi = (int(i) for i in np.searchsorted(rows, [piece.lo, piece.hi]))
        yield piece, lo, hi


def fetch_rows(client, pieces, rows: np.ndarray, shape: tuple, dtype) -> tuple[np.ndarray, dict]:
    """Rows ``rows`` (int64, checked; repeats and any order allowed) of a variable of ``shape`` and
    ``dtype`` stored as ``pieces``, pulled with ``client`` (a
    :class:`~stratagem.ps_service.client.PSClient`): each distinct row once, one request per shard that
    holds some, all shards at once. Returns a new array and the replies (their status and step)."""
    unique, inverse = np.unique(rows, return_inverse=True)
    out = np.empty((len(unique), *shape[1:]), dtype)
    requests: dict[int, tuple[list, list]] = {}
    span: dict[str, tuple[int, int]] = {}
    for piece, lo, hi, local in split_rows(unique, pieces):
        names, arrays = requests.setdefault(piece.ps, ([], []))
        names.append(piece.name)
        arrays.append(local)
        span[piece.name] = (lo, hi)
    replies = client.pull_rows(requests) if requests else {}
    for index, reply in replies.items():
        for name, value in zip(reply.meta.get("names") or [], reply.buffers):
            lo, hi = span.get(name, (0, -1))
            if tuple(value.shape) != (hi - lo, *shape[1:]):
                raise ProtocolError(f"{client.shards[index]} answered rows of {name!r} of shape "
                                    f"{tuple(value.shape)}, expected {(hi - lo, *shape[1:])}")
            out[lo:hi] = value
    if len(unique) == len(rows) and bool((unique == rows).all()):
        return out, replies
    return out[inverse.reshape(-1)], replies


def split_gradient(grad: IndexedSlices, pieces) -> list[tuple]:
    """``(piece, local indices, rows of the gradient)`` for *every* piece of the variable (an empty
    one where the step touched none of its rows: a rule that is not ``sparse_exact`` still updates
    that piece, as the dense update would). ``grad`` is merged (sorted unique indices)."""
    values = to_module(grad.values, np)
    indices = to_module(grad.indices, np).astype(np.int64, copy=False)
    return [(piece, indices[lo:hi] - piece.lo, values[lo:hi]) for piece, lo, hi in _spans(indices, pieces)]


# -- the server's side ---------------------------------------------------------------------------------

def check_rows(name: str, shape: tuple, rows) -> np.ndarray:
    """``rows`` of piece ``name`` (of ``shape``) as int64, or :class:`RowRequestError` saying why not."""
    if not shape:
        raise RowRequestError(f"piece {name!r} is a scalar: it has no rows")
    if rows.ndim != 1 or (rows.size and np.dtype(rows.dtype).kind not in "iu"):
        raise RowRequestError(f"the rows of piece {name!r} must be a 1-D array of integers, got "
                              f"{rows.dtype} of shape {tuple(rows.shape)}")
    rows = rows.astype(np.int64, copy=False)
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= shape[0]):
        raise RowRequestError(f"piece {name!r} has rows 0 to {shape[0] - 1} (counted from its first row), "
                              f"got {int(rows.min())} to {int(rows.max())}: send rows relative to the piece")
    return rows


def read_rows(names: list[str], arrays: list, shapes: list[tuple], values: list) -> list:
    """What ``pull_rows`` answers: for each piece ``names[i]`` (of ``shapes[i]``, value ``values[i]``)
    its rows ``arrays[i]``, checked, as new arrays (gathered: no update has to wait for them)."""
    if len(names) != len(arrays):
        raise RowRequestError(f"pull_rows: {len(names)} piece name(s) but {len(arrays)} row array(s); send "
                              f"one int64 array of rows per piece")
    rows = [check_rows(name, shape, r) for name, r, shape in zip(names, arrays, shapes)]
    return [value[r] for value, r in zip(values, rows)]


def check_real(name: str, grad, what: str = "gradient") -> None:
    """Refuse a gradient of piece ``name`` that is not of real numbers (bool, int or float)."""
    dtype = np.dtype(grad.dtype)
    if dtype.kind not in "biuf" and "float" not in dtype.name:
        raise RowRequestError(f"the {what} of piece {name!r} has dtype {grad.dtype}; gradients are real numbers")


def row_gradients(names: list[str], shapes: list[tuple], arrays: list) -> list[IndexedSlices]:
    """The row gradients of a push: pieces ``names`` (of ``shapes``), two arrays each in ``arrays``
    (int64 rows counted from the piece's first row, and the gradient rows), checked and merged."""
    if 2 * len(names) != len(arrays):
        raise RowRequestError(f"push: {len(names)} row gradient(s) need {2 * len(names)} array(s) (a row "
                              f"gradient is 2: rows, values), got {len(arrays)}")
    return [row_gradient(name, shape, arrays[2 * k], arrays[2 * k + 1])
            for k, (name, shape) in enumerate(zip(names, shapes))]


def row_gradient(name: str, shape: tuple, indices, values) -> IndexedSlices:
    """A pushed row gradient of piece ``name`` (of ``shape``), checked and merged (repeated rows summed)."""
    indices = check_rows(name, shape, indices)
    check_real(name, values, "row gradient")
    expected = (len(indices), *shape[1:])
    if tuple(values.shape) != expected:
        raise RowRequestError(f"the row gradient of piece {name!r} has shape {tuple(values.shape)}; "
                              f"{len(indices)} row(s) of a piece of shape {shape} need {expected}")
    return IndexedSlices(values, indices, shape).merged()


def add_rows(total, grad: IndexedSlices, scale, dtype):
    """``total + scale * grad`` where ``total`` is a dense sum (an array, changed in place and
    returned) or a sum of rows (an ``IndexedSlices`` or ``None``: a new one is returned, its rows in
    the order the gradients came, so that :func:`row_sum` adds each row's terms in that order, as the
    dense sum does)."""
    scaled = np.multiply(grad.values, dtype.type(scale), dtype=dtype)
    if isinstance(total, np.ndarray):
        np.add.at(total, grad.indices, scaled)
        return total
    if total is None:
        return IndexedSlices(scaled, grad.indices, grad.dense_shape)
    return IndexedSlices(np.concatenate([total.values, scaled]), np.concatenate([total.indices, grad.indices]),
                         grad.dense_shape)


def row_sum(rows: IndexedSlices, divisor: float | None) -> IndexedSlices:
    """The summed rows (merged: sorted, unique), divided by ``divisor`` unless it is ``None``."""
    merged = rows.merged()
    if divisor is not None:
        values = merged.values if merged is not rows else merged.values.copy()
        values /= values.dtype.type(divisor)
        merged = IndexedSlices(values, merged.indices, merged.dense_shape)
    return merged
