"""The ranks of a Horovod-style script over one communicator: ``stratagem.horovod``'s collectives on numpy
arrays, and ``join()`` for uneven inputs.

Every collective starts with a small negotiation (an all-gather of a fixed-size descriptor per rank:
what this rank calls, with which op, dtype and element count, or that it has joined), as Horovod's
coordinator negotiates each tensor. It costs one small exchange per call and buys three things:

- **join**: a rank that ran out of data calls :meth:`HorovodWorld.join`; it then answers every
  collective the others still make (its all-reduce contribution is the op's identity, zeros for a
  sum, and an average divides by the ranks that have not joined; an all-gather gets no rows from it;
  a broadcast reaches it too), and an optimizer step registered with :meth:`HorovodWorld.follow` is
  followed (the joined rank reduces zeros and applies the same update, so every rank keeps the same
  weights). ``join()`` returns once every rank has joined, with the rank that joined last;
- **clear mismatches**: ranks calling different collectives, ops, dtypes or sizes raise one
  ``CollectiveMismatchError`` on every rank describing each rank's call;
- **ragged all-gather**: ranks may pass different numbers of rows (dimension 0), as Horovod allows.

Alone, a world of one::

    >>> import numpy as np
    >>> from stratagem.testing.world import local_world
    >>> (comm,) = local_world(1)
    >>> world = HorovodWorld(comm)
    >>> world.rank, world.size, world.local_rank, world.local_size, world.cross_rank, world.cross_size
    (0, 1, 0, 1, 0, 1)
    >>> world.allreduce(np.array([1.0, 3.0], np.float32), "average")
    array([1., 3.], dtype=float32)
    >>> world.allgather(np.arange(4).reshape(2, 2)).shape
    (2, 2)
    >>> world.join()
    0
    >>> comm.close()
"""

from __future__ import annotations

import json
import zlib
from typing import Callable

import numpy as np

from stratagem.core.errors import CollectiveMismatchError, ConfigurationError
from stratagem.core.wire import DTYPES
from stratagem.training.replica_sync import broadcast_arrays, broadcast_json, dtype_from_key, dtype_key

#: The ops of :meth:`HorovodWorld.allreduce` (Horovod's Average, Sum, Min, Max, Product), by wire code.
OPS = ("average", "sum", "min", "max", "product")
#: What a joined rank contributes to each op (the op's identity); ``average`` and ``sum`` add zeros.
_WIRE_OP = {"average": "sum", "sum": "sum", "min": "min", "max": "max", "product": "prod"}

# The descriptor every rank contributes to a negotiation: one int64 per field.
_STATE, _KIND, _OP, _DTYPE, _COUNT, _SIG, _ROOT, _ROWS, _FIRST, _IDENT = range(10)
_FIELDS = 10
_FIELD_INDEX = {"kind": _KIND, "op": _OP, "dtype": _DTYPE, "count": _COUNT, "sig": _SIG, "root": _ROOT,
                "rows": _ROWS, "ident": _IDENT}
_ACTIVE, _JOINED = 1, 2
_ALLREDUCE, _ALLGATHER, _BROADCAST, _STEP = 1, 2, 3, 4
_KIND_NAMES = {_ALLREDUCE: "allreduce", _ALLGATHER: "allgather", _BROADCAST: "broadcast", _STEP: "optimizer step"}
_DTYPE_CODES = {np.dtype(dtype): code for code, dtype in enumerate(DTYPES.values())}
_DTYPE_OF_CODE = list(DTYPES.values())


def signature(obj) -> int:
    """A stable 31-bit checksum of ``obj``'s ``repr`` (the same in every process, unlike ``hash``)."""
    return zlib.crc32(repr(obj).encode()) & 0x7FFFFFFF


def _identity(op: str, dtype: np.dtype):
    if op in ("average", "sum"):
        return 0
    if op == "product":
        return 1
    if dtype == np.bool_:
        return op == "min"
    info = np.finfo(dtype) if np.issubdtype(dtype, np.floating) else np.iinfo(dtype)
    return info.max if op == "min" else info.min


class HorovodWorld:
    """The Horovod view of a communicator's ranks: rank, size, the ranks of this host, the collectives
    with their negotiation, and the join protocol (see the module doc).

    Args:
        comm: a :class:`~stratagem.collectives.communicator.Communicator` (its members are the ranks).
        cluster: the cluster (``local_rank`` and ``local_size`` group the members by the host of
            their address); default: the communicator's transport's.
    """

    def __init__(self, comm, cluster=None):
        self.comm = comm
        cluster = cluster if cluster is not None else comm.transport.cluster
        hosts = [_host(cluster.address(task)) for task in comm.members]
        mine = hosts[comm.rank]
        same_host = [rank for rank, host in enumerate(hosts) if host == mine]
        self.local_rank = same_host.index(comm.rank)
        self.local_size = len(same_host)
        distinct = list(dict.fromkeys(hosts))       # hosts in the order of their first rank
        self.cross_rank, self.cross_size = distinct.index(mine), len(distinct)
        self._followers: list[Callable[[int], None]] = []

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    # -- negotiation ---------------------------------------------------------------------------------
    def _negotiate(self, what: str, **fields) -> tuple[np.ndarray, list[int]]:
        """Every rank's descriptor and the ranks that have not joined; raises on a mismatch among those."""
        desc = np.zeros(_FIELDS, np.int64)
        desc[_STATE] = _ACTIVE
        for key, value in fields.items():
            desc[_FIELD_INDEX[key]] = value
        table = self.comm.allgather(desc)
        active = [rank for rank in range(self.size) if table[rank, _STATE] == _ACTIVE]
        _check_agree(table, active, what)
        return table, active

    def follow(self, step: Callable[[int], None]) -> int:
        """Register ``step(active)``, called on a joined rank when the others run optimizer step number
        ``ident`` (the return value; every rank registers its steps in the same order). It must make the
        same exchanges as :meth:`step_round`'s caller does after it, with zeros for gradients."""
        self._followers.append(step)
        return len(self._followers) - 1

    def step_round(self, ident: int, layout) -> int:
        """Announce optimizer step ``ident`` (registered with :meth:`follow`) over gradients of ``layout``
        (compared between ranks); return how many ranks take part with gradients (the others have joined
        and follow)."""
        _, active = self._negotiate(f"optimizer step #{ident}", kind=_STEP, ident=ident, sig=signature(layout))
        return len(active)

    # -- collectives -----------------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, op: str = "average", name: str | None = None) -> np.ndarray:
        """``array`` reduced over the ranks that have not joined (``op`` in :data:`OPS`); a new array.
        ``average`` of integers truncates toward zero, as Horovod's does."""
        if op not in OPS:
            raise ConfigurationError(f"allreduce: unknown op {op!r}; use one of {', '.join(OPS)}")
        array = np.ascontiguousarray(array)
        _, active = self._negotiate(_what("allreduce", name), kind=_ALLREDUCE, op=OPS.index(op),
                                    dtype=_dtype_code(array.dtype), count=array.size, sig=signature(array.shape))
        result = self.reduce_announced(array.reshape(-1), op, array.dtype, array.size, len(active))
        return result.reshape(array.shape)

    def reduce_announced(self, flat, op: str, dtype: np.dtype, count: int, active: int) -> np.ndarray:
        """The exchange of an all-reduce already announced (by :meth:`allreduce`'s negotiation or by
        :meth:`step_round`) among ``active`` contributing ranks: ``flat`` (1-d, ``count`` elements of
        ``dtype``) reduced with ``op``; ``flat`` None: a joined rank, contributing the op's identity."""
        if flat is None:
            flat = np.full(count, _identity(op, dtype), dtype)
        if self.size == 1:
            total = flat.copy()
        else:
            total = self.comm.allreduce(flat, op=_WIRE_OP[op])
        if op != "average":
            return total
        if np.issubdtype(dtype, np.inexact):
            total /= active
            return total
        return (total / active).astype(dtype)

    def allgather(self, array: np.ndarray, name: str | None = None) -> np.ndarray:
        """Every rank's ``array`` concatenated along dimension 0 in rank order (ranks may pass different
        numbers of rows; the rest of the shape and the dtype must agree; a joined rank adds none)."""
        array = np.ascontiguousarray(array)
        if array.ndim == 0:
            raise ConfigurationError("allgather: pass an array of at least one dimension (rows to concatenate)")
        row = int(np.prod(array.shape[1:], dtype=np.int64))
        table, _ = self._negotiate(_what("allgather", name), kind=_ALLGATHER, dtype=_dtype_code(array.dtype),
                                   count=row, rows=array.shape[0], sig=signature(array.shape[1:]))
        pieces = self._allgather_wire(array.reshape(-1), table, array.dtype, row)
        return np.concatenate(pieces).reshape(-1, *array.shape[1:])

    def _allgather_wire(self, flat, table: np.ndarray, dtype: np.dtype, row: int) -> list:
        rows = table[:, _ROWS]
        longest = int(rows.max()) * row
        if self.size == 1 or longest == 0:
            return [flat if flat is not None else np.empty(0, dtype)]
        padded = np.zeros(longest, dtype)
        if flat is not None:
            padded[:flat.size] = flat
        gathered = self.comm.allgather(padded)
        return [gathered[rank, :int(rows[rank]) * row] for rank in range(self.size)]

    def broadcast(self, state, root: int, name: str | None = None):
        """The root's ``state`` on every rank: an array, or nested dicts and lists of arrays and plain
        values (JSON, never pickle). Other ranks' ``state`` is only their wish (ignored)."""
        root = self.check_root(root)
        table, _ = self._negotiate(_what("broadcast", name), kind=_BROADCAST, root=root)
        return self._broadcast_wire(state if self.rank == root else None, root, table)

    def _broadcast_wire(self, state, root: int, table: np.ndarray):
        if table[root, _STATE] != _ACTIVE:
            raise ConfigurationError(f"broadcast from root rank {root}, which has already joined (hvd.join()): "
                                     f"broadcast from a rank that still has data")
        if self.size == 1:
            return _copy(state)
        skeleton, arrays = (_flatten(state) if self.rank == root else (None, None))
        header = broadcast_json(self.comm, None if skeleton is None else
                                {"skeleton": skeleton, "specs": [[list(a.shape), dtype_key(a.dtype)] for a in arrays]},
                                root=root)
        specs = [(tuple(shape), name) for shape, name in header["specs"]]
        received = broadcast_arrays(self.comm, specs, arrays, root=root)
        received = [np.array(a, dtype=dtype_from_key(spec[1])).reshape(spec[0]) for a, spec in zip(received, specs)]
        return _rebuild(header["skeleton"], received)

    def check_root(self, root) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise ConfigurationError(f"root_rank must be a rank in 0..{self.size - 1}, got {root!r}")
        return int(root)

    # -- join ------------------------------------------------------------------------------------------
    def join(self) -> int:
        """Stop contributing data: answer the collectives and optimizer steps the other ranks still make
        (see the module doc) until every rank has joined; return the rank that joined last (of several
        joining in the last round, the highest)."""
        first = True
        while True:
            desc = np.zeros(_FIELDS, np.int64)
            desc[_STATE], desc[_FIRST] = _JOINED, int(first)
            table = self.comm.allgather(desc) if self.size > 1 else desc[None, :]
            first = False
            active = [rank for rank in range(self.size) if table[rank, _STATE] == _ACTIVE]
            if not active:
                return max(rank for rank in range(self.size) if table[rank, _FIRST])
            _check_agree(table, active, "join")
            self._answer(table, table[active[0]], len(active))

    def _answer(self, table: np.ndarray, call: np.ndarray, active: int) -> None:
        """Take part, with nothing of our own, in the call the active ranks make."""
        kind = int(call[_KIND])
        if kind == _ALLREDUCE:
            dtype = _DTYPE_OF_CODE[int(call[_DTYPE])]
            self.reduce_announced(None, OPS[int(call[_OP])], dtype, int(call[_COUNT]), active)
        elif kind == _ALLGATHER:
            self._allgather_wire(None, table, _DTYPE_OF_CODE[int(call[_DTYPE])], int(call[_COUNT]))
        elif kind == _BROADCAST:
            self._broadcast_wire(None, int(call[_ROOT]), table)
        elif kind == _STEP:
            ident = int(call[_IDENT])
            if not 0 <= ident < len(self._followers):
                raise ConfigurationError(
                    f"the other ranks run optimizer #{ident}'s step, but this rank created only "
                    f"{len(self._followers)} DistributedOptimizer(s): every rank must create the same ones"
                )
            self._followers[ident](active)


def _check_agree(table: np.ndarray, active: list[int], what: str) -> None:
    """Raise one CollectiveMismatchError (the same on every rank) if the active ranks' calls differ."""
    if len(active) < 2:
        return
    keys = [(int(table[r, _KIND]), int(table[r, _OP]), int(table[r, _DTYPE]), int(table[r, _SIG]),
             int(table[r, _ROOT]), int(table[r, _IDENT]),
             int(table[r, _COUNT])) for r in active]
    if all(key == keys[0] for key in keys[1:]):
        return
    calls = "; ".join(f"rank {r}: {_describe(table[r])}" for r in active)
    raise CollectiveMismatchError(
        f"{what}: the ranks called different collectives ({calls}); every rank must make the same "
        f"hvd calls in the same order, with the same op, dtype and shape"
    )


def _describe(row: np.ndarray) -> str:
    kind = int(row[_KIND])
    text = _KIND_NAMES.get(kind, "?")
    if kind == _ALLREDUCE:
        text += f"(op={OPS[int(row[_OP])]}, {_DTYPE_OF_CODE[int(row[_DTYPE])].name}, {int(row[_COUNT])} elements)"
    elif kind == _ALLGATHER:
        text += f"({_DTYPE_OF_CODE[int(row[_DTYPE])].name}, rows of {int(row[_COUNT])} elements)"
    elif kind == _BROADCAST:
        text += f"(root_rank={int(row[_ROOT])})"
    elif kind == _STEP:
        text += f" #{int(row[_IDENT])}"
    return text


def _what(collective: str, name: str | None) -> str:
    return f"{collective}({name!r})" if name else collective


def _dtype_code(dtype) -> int:
    code = _DTYPE_CODES.get(np.dtype(dtype))
    if code is None:
        raise ConfigurationError(f"dtype {np.dtype(dtype)} cannot be sent; use one of {', '.join(DTYPES)}")
    return code


def _host(address: str | None) -> str:
    if not address:
        return ""
    return address.rsplit(":", 1)[0] if ":" in address else address


_ARRAY = "__hvd_array__"
_TUPLE = "__hvd_tuple__"


def _flatten(state) -> tuple:
    """``(skeleton, arrays)``: JSON data with placeholders for the arrays (dict keys may be ints or
    strings, and tuples stay tuples, as torch's optimizer state needs)."""
    arrays: list = []

    def walk(node):
        if isinstance(node, dict):
            return {"d": [[key, walk(value)] for key, value in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(value) for value in node]}
        if isinstance(node, list):
            return [walk(value) for value in node]
        if isinstance(node, np.generic):
            return node.item()
        if isinstance(node, np.ndarray):
            arrays.append(np.ascontiguousarray(node))
            return {_ARRAY: len(arrays) - 1}
        json.dumps(node)    # anything else must be plain data: fail here, naming it, not on the wire
        return node

    return walk(state), arrays


def _rebuild(skeleton, arrays: list):
    if isinstance(skeleton, dict):
        if _ARRAY in skeleton:
            return arrays[skeleton[_ARRAY]]
        if _TUPLE in skeleton:
            return tuple(_rebuild(value, arrays) for value in skeleton[_TUPLE])
        return {key: _rebuild(value, arrays) for key, value in skeleton["d"]}
    if isinstance(skeleton, list):
        return [_rebuild(value, arrays) for value in skeleton]
    return skeleton


def _copy(state):
    skeleton, arrays = _flatten(state)
    return _rebuild(skeleton, [array.copy() for array in arrays])
