"""Where a parameter-server strategy puts each variable: ``device()``, ``replica_device_setter()``,
the placement policies and the partitioners (README: "Parameter servers").

Under the ``between_graph`` and ``parameter_server`` strategies every variable lives on a ``ps`` task
(a *shard*). Which one is decided, in order of precedence, by:

1. an explicit ``with stratagem.device("/job:ps/task:1"):`` around the variable's creation;
2. the innermost ``with stratagem.replica_device_setter(ps_strategy=...):`` block, whose policy places
   every variable created inside it;
3. the strategy's own ``placement=`` option (``"round_robin"``, the default, or ``"greedy"``).

Policies: :class:`RoundRobin` deals variables to the shards in turn (TF's default); :class:`GreedyByBytes`
puts each on the shard holding the fewest bytes so far, so loads stay even (TF's
``GreedyLoadBalancingStrategy``): with variables placed in any order, no shard ends more than the
largest single piece above the lightest.

A variable larger than the strategy's ``partition_bytes`` (default :data:`DEFAULT_PARTITION_BYTES`,
1 MiB) is *partitioned*: split along its first axis into slices (like ``np.array_split``), each
placed as its own piece, so that one huge embedding does not sit on one shard; by default into one
slice per ps task, so every shard holds an even share of every large variable, and only variables of
at most 1 MiB are placed whole: with ``greedy`` the shards' loads differ by at most that much
(``round_robin`` deals the whole ones by count). The threshold was 16 MiB until issue 22 (5c): a
40 MB model of 20, 16 and 4 MB matrices then sat on 4 ps tasks as 5 + 21 + 5 + 9 MB, the 16 MB and
4 MB matrices whole, so the busiest ps task's link carried half the model and 4 ps tasks moved it
at most 1.9x as fast as one. :func:`fixed_size_partitioner` gives a fixed number of slices,
:func:`min_slice_partitioner` as many as keep each slice above a minimum size. Workers reassemble the
slices, so a partitioned variable reads and checkpoints like any other.

With ``piece_bytes`` (the transport's :attr:`~stratagem.core.transport.Transport.whole_buffer_bytes`:
4 MiB for ``zmq``), every piece still larger than that is cut further into row slices on the same
shard, so that each piece's gradient and values travel as one buffer that arrives without a copy
(a larger buffer is received in parts and joined: one more pass over it at both ends, which cost
a parameter server a quarter of its throughput on 2 cores). Partitioning decides which shards hold
a variable; this only decides in how many pieces they hold it.

    >>> plan = Placer(num_ps=2, policy="greedy", partition_bytes=1000)
    >>> [(p.name, p.ps, p.lo, p.hi) for p in plan.place("emb", (100, 4), "float32")]  # 1600 bytes: split
    [('emb/part_0', 0, 0, 50), ('emb/part_1', 1, 50, 100)]
    >>> with device("/job:ps/task:1"):
    ...     [(p.name, p.ps) for p in plan.place("bias", (4,), "float32")]
    [('bias', 1)]
    >>> plan.loads
    [800, 816]
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError

__all__ = [
    "device", "replica_device_setter", "DeviceSetter", "RoundRobin", "GreedyByBytes", "Placer", "Piece",
    "fixed_size_partitioner", "min_slice_partitioner", "current_placement", "make_policy", "POLICIES",
    "DEFAULT_PARTITION_BYTES",
]

#: Names of the built-in placement policies accepted by ``placement=`` and ``ps_strategy=``.
POLICIES = ("round_robin", "greedy")

#: The strategies' default ``partition_bytes``: variables larger than this are split over the ps tasks
#: (one slice each), so that only variables of at most this much are placed whole (see the module doc).
DEFAULT_PARTITION_BYTES = 1 << 20

#: The innermost active ``device()`` / ``replica_device_setter()`` context: a TaskId or a DeviceSetter.
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_device", default=None)


# -- policies -------------------------------------------------------------------------------------------

class RoundRobin:
    """Deal pieces to the shards in turn: 0, 1, ..., n-1, 0, ...

    >>> policy = RoundRobin()
    >>> [policy.choose(10, [0, 0, 0]) for _ in range(4)]
    [0, 1, 2, 0]
    """

    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, nbytes: int, loads: list[int]) -> int:
        index = self._next % len(loads)
        self._next += 1
        return index

    def __repr__(self) -> str:
        return "RoundRobin()"


class GreedyByBytes:
    """Put each piece on the shard holding the fewest bytes (the lowest index on a tie).

    Greedy list scheduling: whatever the order of the pieces, the heaviest shard ends at most the
    largest piece above the lightest one.

    >>> policy = GreedyByBytes()
    >>> loads = [0, 0]
    >>> for nbytes in (100, 10, 10, 10):
    ...     loads[policy.choose(nbytes, loads)] += nbytes
    >>> loads
    [100, 30]
    """

    name = "greedy"

    def choose(self, nbytes: int, loads: list[int]) -> int:
        return min(range(len(loads)), key=lambda i: (loads[i], i))

    def __repr__(self) -> str:
        return "GreedyByBytes()"


def make_policy(policy) -> Any:
    """A policy object from a name (``"round_robin"``, ``"greedy"``) or an object with ``choose``.

    >>> make_policy("greedy")
    GreedyByBytes()
    """
    if isinstance(policy, str):
        if policy == "round_robin":
            return RoundRobin()
        if policy in ("greedy", "greedy_by_bytes"):
            return GreedyByBytes()
        raise ConfigurationError(f"unknown placement policy {policy!r}; use one of: {', '.join(POLICIES)} "
                                 f"(or an object with a choose(nbytes, loads) method)")
    if callable(getattr(policy, "choose", None)):
        return policy
    raise ConfigurationError(
        f"a placement policy is 'round_robin', 'greedy' or an object with choose(nbytes, loads) -> shard "
        f"index, not {policy!r}"
    )


# -- partitioners -----------------------------------------------------------------------------------------

def fixed_size_partitioner(num_shards: int) -> Callable[[tuple, np.dtype], int]:
    """Split a partitioned variable into ``num_shards`` slices (fewer if it has fewer rows).

    >>> fixed_size_partitioner(4)((10, 3), np.dtype("float32")), fixed_size_partitioner(4)((2, 3), np.dtype("float32"))
    (4, 2)
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigurationError(f"num_shards must be an integer >= 1, got {num_shards!r}")

    def partitions(shape: tuple, dtype: np.dtype) -> int:
        return max(1, min(num_shards, shape[0] if shape else 1))
    partitions.__qualname__ = f"fixed_size_partitioner({num_shards})"
    return partitions


def min_slice_partitioner(min_slice_bytes: int, max_partitions: int | None = None) -> Callable[[tuple, np.dtype], int]:
    """Split into as many slices as keep each at least ``min_slice_bytes`` (at most ``max_partitions``).

    >>> min_slice_partitioner(1000)((100, 4), np.dtype("float32"))     # 1600 bytes: 1 slice of >= 1000
    1
    >>> min_slice_partitioner(400, max_partitions=3)((100, 4), np.dtype("float32"))
    3
    """
    if isinstance(min_slice_bytes, bool) or not isinstance(min_slice_bytes, int) or min_slice_bytes < 1:
        raise ConfigurationError(f"min_slice_bytes must be an integer >= 1, got {min_slice_bytes!r}")

    def partitions(shape: tuple, dtype: np.dtype) -> int:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        count = max(1, nbytes // min_slice_bytes)
        if max_partitions is not None:
            count = min(count, max_partitions)
        return max(1, min(count, shape[0] if shape else 1))
    partitions.__qualname__ = f"min_slice_partitioner({min_slice_bytes})"
    return partitions


# -- contexts -----------------------------------------------------------------------------------------------

@dataclass
class DeviceSetter:
    """What ``replica_device_setter()`` returns: a placement policy (and partitioner) for a block.

    Use it as a context manager, directly or through ``device()``; every variable created in the
    block is placed by its policy (an explicit ``device("/job:ps/task:N")`` inside still wins).
    """

    policy: Any
    partitioner: Callable | None = None
    ps_tasks: int | None = None

    def __enter__(self) -> "DeviceSetter":
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._token)


def replica_device_setter(ps_tasks: int | None = None, ps_strategy="round_robin",
                          partitioner: Callable | None = None) -> DeviceSetter:
    """A placement for the variables created in a ``with`` block (TF1's ``replica_device_setter``).

    Args:
        ps_tasks: how many ``ps`` tasks to use (the first ``ps_tasks``; default: all of the cluster's).
        ps_strategy: ``"round_robin"`` (default), ``"greedy"`` (fewest bytes first), or an object with
            ``choose(nbytes, loads) -> shard index``.
        partitioner: for variables over the strategy's ``partition_bytes``: how many slices
            (:func:`fixed_size_partitioner`, :func:`min_slice_partitioner`); default the strategy's.

    >>> with replica_device_setter(ps_strategy="greedy") as setter:
    ...     current_placement() is setter
    True
    """
    if ps_tasks is not None and (isinstance(ps_tasks, bool) or not isinstance(ps_tasks, int) or ps_tasks < 1):
        raise ConfigurationError(f"ps_tasks must be an integer >= 1, got {ps_tasks!r}")
    if partitioner is not None and not callable(partitioner):
        raise ConfigurationError("partitioner must be callable (e.g. fixed_size_partitioner(4))")
    return DeviceSetter(make_policy(ps_strategy), partitioner, ps_tasks)


@contextlib.contextmanager
def device(spec) -> Iterator[Any]:
    """Place the variables created in the block: ``"/job:ps/task:1"`` (or ``"ps:1"``) pins them to
    that ps task; a :class:`DeviceSetter` (from ``replica_device_setter()``) applies its policy.

    >>> with device("/job:ps/task:1"):
    ...     current_placement()
    TaskId('/job:ps/task:1')
    >>> current_placement() is None
    True
    >>> with device("/job:worker/task:0"):
    ...     pass
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: variables live on ps tasks under the parameter-server strategies: use device('/job:ps/task:N'), not '/job:worker/task:0'
    """
    if isinstance(spec, DeviceSetter):
        value = spec
    elif isinstance(spec, (str, TaskId)):
        text = str(spec)
        if isinstance(spec, str) and "/device:" in text:  # TF-style suffix: the device inside a task
            text = text.split("/device:", 1)[0]
        value = TaskId.parse(text)
        if value.job != "ps":
            raise ConfigurationError(
                f"variables live on ps tasks under the parameter-server strategies: use "
                f"device('/job:ps/task:N'), not {str(spec)!r}"
            )
    else:
        raise ConfigurationError(f"device() takes '/job:ps/task:N' or replica_device_setter(...), not {spec!r}")
    token = _CURRENT.set(value)
    try:
        yield value
    finally:
        _CURRENT.reset(token)


def current_placement():
    """The innermost active placement: a ``TaskId`` (explicit), a ``DeviceSetter``, or ``None``."""
    return _CURRENT.get()


# -- the placer --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One stored piece of a variable: ``name`` on ps task ``ps``, rows ``[lo, hi)`` of ``parts``."""

    name: str        # the piece's name on the server: the variable's, or "<variable>/part_<i>"
    variable: str
    ps: int
    part: int
    parts: int
    lo: int
    hi: int
    nbytes: int


class Placer:
    """Decides the pieces of every variable of one strategy, deterministically.

    Every task that creates the same variables in the same order under the same contexts gets the
    same plan (workers check theirs against the servers' catalog).

    Args:
        num_ps: number of ps tasks.
        policy: the default policy (``placement=`` of the strategy).
        partition_bytes: variables larger than this are partitioned (``None``: never).
        partitioner: how many slices for a partitioned variable (default: one per ps task,
            ``fixed_size_partitioner(num_ps)``).
        piece_bytes: cut pieces larger than this into row slices on the same shard (``None``: never;
            see the module doc).

    >>> [(p.name, p.ps, p.lo, p.hi) for p in Placer(2, piece_bytes=400).place("w", (10, 30), "float32")]
    [('w/part_0', 0, 0, 3), ('w/part_1', 0, 3, 6), ('w/part_2', 0, 6, 8), ('w/part_3', 0, 8, 10)]
    """

    def __init__(self, num_ps: int, policy="round_robin", partition_bytes: int | None = None,
                 partitioner: Callable | None = None, piece_bytes: int | None = None):
        if num_ps < 1:
            raise ConfigurationError(
                "the parameter-server strategies need at least one 'ps' task in the cluster: launch "
                "with --ps M (or add a 'ps' job to the cluster spec)"
            )
        self.num_ps = num_ps
        self.policy = make_policy(policy)
        self.partition_bytes = partition_bytes
        self.partitioner = partitioner or fixed_size_partitioner(num_ps)
        if piece_bytes is not None and (isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int)
                                        or piece_bytes < 1):
            raise ConfigurationError(f"piece_bytes must be an integer >= 1 (or None), got {piece_bytes!r}")
        self.piece_bytes = piece_bytes
        #: Bytes placed on each ps task so far.
        self.loads = [0] * num_ps

    def place(self, name: str, shape, dtype) -> list[Piece]:
        """The pieces of variable ``name`` (of ``shape`` and ``dtype``), with their ps task."""
        shape = tuple(int(n) for n in shape)
        slices = self._slices(name, shape, np.dtype(dtype))
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        cuts = [(ps, lo, hi) for ps, rows in slices for lo, hi in self._cut(rows, shape, nbytes)]
        if len(cuts) == 1:
            ps, lo, hi = cuts[0]
            return [Piece(name, name, ps, 0, 1, lo, hi, nbytes)]
        row_bytes = nbytes // shape[0]
        return [Piece(f"{name}/part_{part}", name, ps, part, len(cuts), lo, hi, (hi - lo) * row_bytes)
                for part, (ps, lo, hi) in enumerate(cuts)]

    def _cut(self, rows: tuple[int, int], shape: tuple, nbytes: int) -> list[tuple[int, int]]:
        """Rows ``[lo, hi)`` of a variable of ``shape`` (``nbytes`` in all) as row ranges of at most
        ``piece_bytes`` each (as even as ``np.array_split``; a row larger than that stays whole)."""
        lo, hi = rows
        if self.piece_bytes is None or not shape or hi - lo < 2:
            return [rows]
        rows_per_piece = max(1, self.piece_bytes // (nbytes // shape[0] or 1))
        count = -(-(hi - lo) // rows_per_piece)
        base, extra = divmod(hi - lo, count)
        cuts = []
        for k in range(count):
            step = base + (1 if k < extra else 0)
            cuts.append((lo, lo + step))
            lo += step
        return cuts

    def _slices(self, name: str, shape: tuple, dtype: np.dtype) -> list[tuple[int, tuple[int, int]]]:
        """The shard and rows of each slice of the variable, as placement and partitioning decide
        (each slice's bytes counted in ``loads`` as it is placed, so the policy sees the earlier ones)."""
        nbytes = math.prod(shape) * dtype.itemsize
        every_row = (0, shape[0] if shape else 0)
        context = current_placement()
        if isinstance(context, TaskId):
            if context.index >= self.num_ps:
                raise ConfigurationError(
                    f"variable {name!r} is pinned to {context}, but the cluster has {self.num_ps} ps "
                    f"task(s) (/job:ps/task:0 to /job:ps/task:{self.num_ps - 1})"
                )
            self.loads[context.index] += nbytes
            return [(context.index, every_row)]
        policy, partitioner, width = self.policy, self.partitioner, self.num_ps
        if isinstance(context, DeviceSetter):
            policy = context.policy
            partitioner = context.partitioner or partitioner
            if context.ps_tasks is not None:
                width = min(width, context.ps_tasks)
        parts = 1
        if self.partition_bytes is not None and shape and nbytes > self.partition_bytes:
            parts = int(partitioner(shape, dtype))
            parts = max(1, min(parts, shape[0]))
        if parts == 1:
            return [(self._choose(policy, nbytes, width, name), every_row)]
        row_bytes = nbytes // shape[0]
        base, extra = divmod(shape[0], parts)
        slices, lo = [], 0
        for part in range(parts):
            hi = lo + base + (1 if part < extra else 0)
            slices.append((self._choose(policy, (hi - lo) * row_bytes, width, name), (lo, hi)))
            lo = hi
        return slices

    def _choose(self, policy, nbytes: int, width: int, name: str) -> int:
        """The shard ``policy`` picks for ``nbytes`` more (checked), counted in ``loads``."""
        index = policy.choose(nbytes, self.loads[:width])
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < width:
            raise ConfigurationError(
                f"placement policy {policy!r} chose shard {index!r} for variable {name!r}; it must "
                f"return an index in [0, {width})"
            )
        self.loads[int(index)] += nbytes
        return int(index)
