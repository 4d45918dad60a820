"""Sharing plain data, arrays and nested states between replicas, over a Communicator.

Strategies use these to compare what replicas created (``allgather_json``), to hand the chief's
values to everyone (``broadcast_arrays``) and to move checkpoint state, which mixes plain data and
arrays (``flatten_state``/``rebuild_state``). JSON, not pickle: what arrives is data, never code.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np


def broadcast_json(comm, obj, root: int = 0):
    """The root's ``obj`` (JSON-encodable plain data) on every rank; the others' ``obj`` is ignored.

    Every rank gets the decoded copy (tuples come back as lists), the root included.
    """
    if comm.rank == root:
        data = comm.broadcast(np.frombuffer(json.dumps(obj).encode(), np.uint8), root=root)
    else:
        data = comm.broadcast(None, root=root)
    return json.loads(data.tobytes().decode())


def allgather_json(comm, obj) -> list:
    """Every rank's ``obj`` (JSON-encodable plain data), in rank order, on every rank."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = comm.allgather(np.array([data.size], np.int64))[:, 0]
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:data.size] = data
    gathered = comm.allgather(padded)
    return [json.loads(gathered[rank, :int(n)].tobytes().decode()) for rank, n in enumerate(lengths)]


def dtype_key(dtype) -> str:
    """A dtype's name as sent between replicas (``"float32"``, ``"bfloat16"``)."""
    return np.dtype(dtype).name


def dtype_from_key(name: str) -> np.dtype:
    from stratagem.core.wire import DTYPES

    return DTYPES.get(name) or np.dtype(name)


def broadcast_arrays(comm, specs: list[tuple], arrays: list | None, root: int = 0) -> list:
    """The root's ``arrays`` on every rank, one broadcast per dtype; others pass ``arrays=None``.

    ``specs`` (the same on every rank) gives each array's ``(shape, dtype name)``. The results are
    views into one received buffer per dtype.
    """
    groups: dict[str, list[int]] = {}
    for index, (_, name) in enumerate(specs):
        groups.setdefault(name, []).append(index)
    out: list = [None] * len(specs)
    for name, indices in groups.items():
        dtype = dtype_from_key(name)
        sizes = [int(np.prod(specs[i][0], dtype=np.int64)) for i in indices]
        if not sum(sizes):  # nothing to send (every rank knows it from the specs)
            flat = np.empty(0, dtype)
        elif comm.rank == root:
            flat = comm.broadcast(np.concatenate([np.ascontiguousarray(arrays[i], dtype=dtype).reshape(-1)
                                                  for i in indices]), root=root)
        else:
            flat = comm.broadcast(None, root=root)
        offset = 0
        for i, n in zip(indices, sizes):
            out[i] = flat[offset:offset + n].reshape(tuple(specs[i][0]))
            offset += n
    return out


_ARRAY_MARK = "__stratagem_array__"


def flatten_state(state) -> tuple[Any, list]:
    """Split a nested state (dicts, lists, numbers, arrays) into JSON data with array placeholders
    and the list of arrays (numpy), in a deterministic order."""
    arrays: list = []

    def walk(node):
        if isinstance(node, Mapping):
            return {str(key): walk(value) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(value) for value in node]
        if isinstance(node, np.generic):
            return node.item()
        if hasattr(node, "shape") and hasattr(node, "dtype"):
            arrays.append(node.get() if type(node).__module__.startswith("cupy") else np.asarray(node))
            return {_ARRAY_MARK: len(arrays) - 1}
        return node

    return walk(state), arrays


def rebuild_state(skeleton, arrays: list):
    """The inverse of :func:`flatten_state`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_ARRAY_MARK}:
            return arrays[skeleton[_ARRAY_MARK]]
        return {key: rebuild_state(value, arrays) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [rebuild_state(value, arrays) for value in skeleton]
    return skeleton
