"""The hierarchical all-reduce: inside each host first, then between hosts (Horovod's hierarchical
all-reduce, NCCL's tree of rings), for ``stratagem.communicator(..., hierarchical=True)``.

With ``k`` members on each of ``h`` hosts, one all-reduce runs in three phases, all inside one
collective call (one fingerprint, one tag, the abort protocol of :mod:`~stratagem.collectives.session`):

1. a reduce-scatter among the ``k`` members of each host: local rank ``l`` ends with its host's
   reduction of shard ``l`` (``1/k`` of the tensor, split like ``np.array_split``);
2. an all-reduce of shard ``l`` among the members of local rank ``l`` on every host: ``k`` rings of
   ``h`` members, side by side;
3. an all-gather among the members of each host.

So each host's link carries ``2(h-1)/h`` of the tensor each way (``k`` rings of ``1/k`` of it), where
the flat ring over ``n = h k`` tasks placed host by host carries ``2(n-1)/n`` of it through the link
of every host it crosses: with 2 hosts of 2 tasks, ``S`` bytes against ``1.5 S``. Which transport
carries which phase is the transport's affair: over ``shm`` with ``transport_options={"remote":
"zmq"}`` the tasks of a host exchange through shared-memory rings and the hosts over zmq, chosen per
peer; over ``zmq`` alone the phases inside a host go over loopback TCP. Every phase is core's
pipelined ring (:func:`~stratagem.collectives.algorithms.pipelined_ring`) run over a subgroup of the
call's members, so each shard is reduced along one chain and every rank ends with the same bits.

Which members share a host (:class:`HostLayout`): with ``hierarchical=True``, those whose cluster
addresses name the same host (``stratagem launch --hosts``, ``--nnodes``, a hostfile or TF_CONFIG
give each host its own address); or the groups given, ``hierarchical=[[0, 1], [2, 3]]`` (ranks, or
tasks). Every host must have as many members as the others.

    >>> import numpy as np
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from stratagem.testing.world import local_world
    >>> comms = local_world(4, hierarchical=[[0, 1], [2, 3]])      # two "hosts" of two ranks
    >>> with ThreadPoolExecutor(4) as pool:
    ...     out = list(pool.map(lambda c: c.allreduce(np.full(5, c.rank + 1.0), algorithm="hierarchical"), comms))
    >>> out[3]
    array([10., 10., 10., 10., 10.])
    >>> for c in comms: c.close()
"""

from __future__ import annotations

import importlib
import queue
import threading
import zlib
from typing import Sequence

import numpy as np

from stratagem.collectives import algorithms as coll
from stratagem.collectives.session import CollectiveCall, CollectiveSession, fingerprint
from stratagem.core.cluster import ClusterSpec, TaskId, host_of
from stratagem.core.errors import CommunicationError, ConfigurationError
from stratagem.core.wire import dtype_name

#: The algorithm name the communicator's ``allreduce`` takes (``algorithm="hierarchical"``).
ALGORITHM = "hierarchical"
#: The flat algorithms that ``auto`` replaces with the hierarchical one, where the layout spans hosts
#: with more than one member each: the bandwidth-bound ones (the latency-bound ones stay flat).
REPLACES = ("ring", "pairwise")


class HostLayout:
    """Which ranks of a communicator share a host: ``groups``, lists of ranks, as many on every host.

    Hosts are ordered by their lowest rank, the ranks of a host by rank; local rank ``l`` of a host
    is its ``l``-th member.

    >>> layout = HostLayout([[0, 2], [1, 3]], size=4)
    >>> layout.hosts, layout.per_host, layout.local(2), layout.cross(2)
    (2, 2, ([0, 2], 1), ([2, 3], 0))
    """

    def __init__(self, groups: Sequence[Sequence[int]], size: int):
        groups = sorted((sorted(int(r) for r in group) for group in groups), key=lambda g: g[0] if g else -1)
        ranks = [r for group in groups for r in group]
        if any(not group for group in groups):
            raise ConfigurationError("hierarchical: every host needs at least one member (an empty group was given)")
        if sorted(ranks) != list(range(size)):
            repeated = sorted({r for r in ranks if ranks.count(r) > 1})
            missing = sorted(set(range(size)) - set(ranks))
            extra = sorted(set(ranks) - set(range(size)))
            what = "; ".join(part for part in (f"repeated: {repeated}" if repeated else "",
                                              f"missing: {missing}" if missing else "",
                                              f"not ranks of this communicator: {extra}" if extra else "") if part)
            raise ConfigurationError(f"hierarchical: the host groups must name every rank 0..{size - 1} once ({what})")
        sizes = {len(group) for group in groups}
        if len(sizes) > 1:
            listed = ", ".join(f"{len(g)} ({', '.join(map(str, g))})" for g in groups)
            raise ConfigurationError(
                f"hierarchical: every host needs the same number of members, but the hosts have {listed}; "
                f"place as many tasks on every host (stratagem launch --tasks-per-host K), or leave "
                f"hierarchical off")
        self.groups = groups
        self.size = size
        self.hosts = len(groups)
        self.per_host = len(groups[0])
        self._host_of = {r: (h, l) for h, group in enumerate(groups) for l, r in enumerate(group)}
        #: The layout in every message's fingerprint: ranks that disagree about it raise a mismatch.
        self.signature = f"{self.hosts}x{self.per_host}:{zlib.crc32(repr(groups).encode()):08x}"

    @property
    def spans_hosts(self) -> bool:
        """Whether the hierarchy differs from a flat ring: several hosts, several members on each."""
        return self.hosts > 1 and self.per_host > 1

    def local(self, rank: int) -> tuple[list[int], int]:
        """``(the ranks on rank's host, rank's position among them)``."""
        host, position = self._host_of[rank]
        return self.groups[host], position

    def cross(self, rank: int) -> tuple[list[int], int]:
        """``(the ranks of rank's local rank on every host, rank's host's position among them)``."""
        host, position = self._host_of[rank]
        return [group[position] for group in self.groups], host

    def __repr__(self) -> str:
        return f"HostLayout({self.groups})"

    @classmethod
    def from_option(cls, option, members: Sequence[TaskId], cluster: ClusterSpec) -> "HostLayout | None":
        """The layout ``hierarchical=option`` asks for: None (``False``/``None``: flat); ``True``: the
        members grouped by the host of their address; a list of groups of ranks or tasks: those."""
        if option is None or option is False:
            return None
        if option is True:
            return cls.by_address(members, cluster)
        if isinstance(option, (str, bytes)) or not isinstance(option, Sequence) or not all(
                isinstance(group, Sequence) and not isinstance(group, (str, bytes)) for group in option):
            raise ConfigurationError(
                f"hierarchical must be True (hosts found from the members' addresses), False, or the members "
                f"of each host as lists of ranks or tasks (e.g. [[0, 1], [2, 3]]), got {option!r}")
        return cls([[_rank_of(m, members) for m in group] for group in option], len(members))

    @classmethod
    def by_address(cls, members: Sequence[TaskId], cluster: ClusterSpec) -> "HostLayout":
        """The members grouped by the host part of their cluster addresses, as written."""
        hosts: dict[str, list[int]] = {}
        for rank, task in enumerate(members):
            address = cluster.address(task)
            if address is None:
                raise ConfigurationError(
                    f"hierarchical=True finds each member's host from its address, but {task} has none (a "
                    f"cluster from an MPI world): pass the hosts' members, hierarchical=[[0, 1], [2, 3]]")
            hosts.setdefault(host_of(address), []).append(rank)
        return cls(list(hosts.values()), len(members))


def _rank_of(member, members: Sequence[TaskId]) -> int:
    if isinstance(member, (int, np.integer)) and not isinstance(member, bool):
        return int(member)
    try:
        return members.index(TaskId.parse(member))
    except (ValueError, TypeError):
        raise ConfigurationError(f"hierarchical: {member!r} is neither a rank nor a member of the communicator "
                                 f"({', '.join(map(str, members))})") from None


class _Subgroup:
    """A collective call as some of its members see it: ranks renumbered ``0..len(ranks)-1``, every
    message still under the call's fingerprint (what core's ring needs of a call)."""

    __slots__ = ("_call", "_ranks", "_stopped", "rank", "size", "session")

    def __init__(self, call: CollectiveCall, ranks: Sequence[int], rank: int, stopped: threading.Event | None = None):
        self._call, self._ranks, self._stopped = call, list(ranks), stopped
        self.rank, self.size, self.session = rank, len(self._ranks), call.session

    def chunk_elems(self, itemsize: int) -> int:
        return self._call.chunk_elems(itemsize)

    def send_async(self, dst: int, *buffers):
        return self._call.send_async(self._ranks[dst], *buffers)

    def recv(self, src: int, count: int | None = None, dtype=None):
        data = self._call.recv(self._ranks[src], count, dtype)
        if self._stopped is not None and self._stopped.is_set():
            raise CommunicationError("the hierarchical all-reduce was stopped by an error in its other thread")
        return data


def chooses(layout: HostLayout | None, session: CollectiveSession, x, op: str, algorithm: str) -> bool:
    """Whether an all-reduce of ``x`` runs hierarchically: asked for by name, or ``auto`` where the layout
    spans hosts and the flat choice would be a bandwidth-bound algorithm (the same on every rank)."""
    if algorithm == ALGORITHM:
        if layout is None:
            raise ConfigurationError(
                "allreduce: algorithm='hierarchical' needs to know which members share a host: make the "
                "communicator with hierarchical=True (or the hosts' members, hierarchical=[[0, 1], [2, 3]])")
        return True
    if layout is None or algorithm != "auto" or not layout.spans_hosts or type(op) is not str:
        return False
    nbytes = x.size * coll.working_dtype(op, x.dtype).itemsize
    return coll.choose_allreduce_algorithm(session, nbytes, x.size) in REPLACES


def allreduce(session: CollectiveSession, x, op: str = "sum", algorithm: str = ALGORITHM, out=None, *,
              layout: HostLayout):
    """The hierarchical all-reduce of ``x`` (the module doc): the result of core's ``allreduce``, the
    same bits on every rank, into ``out`` if given (``out=x``: in place).

    A tensor of more than one block (``k x chunk_bytes``: a chunk's worth of shard per member) is
    pipelined: a helper thread runs the phase between hosts block after block while this one runs the
    host's reduce-scatters and then its all-gathers, each block's as soon as its shard is back, so the
    link is busy from the first block's reduce-scatter to the last block's all-gather. Each pair of
    members talks in one thread only (inside a host this one, across hosts the helper), always in the
    same order, so the order of their messages never depends on timing.
    """
    x = coll.as_array(x)
    dtype = coll.check_allreduce(x, op, "auto", out)
    n = int(x.size)
    if out is not None:
        work = out.reshape(-1)
    elif coll.is_device_array(x):
        work = importlib.import_module("cupy").empty(n, dtype=dtype)
    else:   # a large result in memory a former result left (collectives/results.py)
        work = session.results.empty(n, dtype)
    src = work if out is x else _flat(x, dtype)
    chunk = session.chunk_elems(dtype.itemsize)
    fp = fingerprint("allreduce", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo=ALGORITHM,
                     chunk=chunk, hosts=layout.signature)
    block = layout.per_host * chunk
    blocks = [(lo, min(lo + block, n)) for lo in range(0, n, block)] or [(0, 0)]
    with session.collective(fp) as call:
        phases = _Phases(call, layout, work, src, op)
        if len(blocks) == 1 or layout.hosts == 1 or layout.per_host == 1:
            for lo, hi in blocks:
                phases.reduce_inside(lo, hi)
                phases.reduce_across(lo, hi)
                phases.gather_inside(lo, hi)
        else:
            phases.overlapped(blocks)
    return work.reshape(x.shape) if out is None else out


class _Phases:
    """The three phases of one call on blocks ``work[lo:hi]`` (the module doc)."""

    def __init__(self, call: CollectiveCall, layout: HostLayout, work, src, op: str):
        session = call.session
        self.work, self.src, self.op, self.size = work, src, op, session.size
        self.ufunc = coll.OPS[op]
        local, self.local_rank = layout.local(session.rank)
        cross, host = layout.cross(session.rank)
        self.per_host = len(local)
        self.inside = _Subgroup(call, local, self.local_rank)
        self.stopped = threading.Event()   # the call failed: the helper must not write any more
        self.across = _Subgroup(call, cross, host, stopped=self.stopped)

    def _shard(self, lo: int, hi: int) -> tuple[list[int], int, int]:
        bounds = coll.split_bounds(hi - lo, self.per_host)
        return bounds, lo + bounds[self.local_rank], lo + bounds[self.local_rank + 1]

    def reduce_inside(self, lo: int, hi: int) -> None:
        """1: this host's reduction of this rank's shard of the block, into ``work``."""
        if self.per_host == 1:
            if self.src is not self.work:
                self.work[lo:hi] = self.src[lo:hi]
            return
        bounds, _, _ = self._shard(lo, hi)
        k = self.per_host
        coll.pipelined_ring(self.inside, self.work[lo:hi], bounds, self.local_rank, shift=1, steps=k - 1,
                            reduce_steps=k - 1, ufunc=self.ufunc, src=self.src[lo:hi])

    def reduce_across(self, lo: int, hi: int) -> None:
        """2: the shard with the same local rank on every other host, in place (then the mean's division,
        on the shard only: the all-gather copies its bits)."""
        _, a, b = self._shard(lo, hi)
        shard, h = self.work[a:b], self.across.size
        if h > 1:
            coll.pipelined_ring(self.across, shard, coll.split_bounds(shard.size, h), self.across.rank, shift=0,
                                steps=2 * (h - 1), reduce_steps=h - 1, ufunc=self.ufunc)
        if self.op == "mean" and self.size > 1:
            np.true_divide(shard, shard.dtype.type(self.size), out=shard)

    def gather_inside(self, lo: int, hi: int) -> None:
        """3: every shard of the block to every member of the host."""
        if self.per_host > 1:
            bounds, _, _ = self._shard(lo, hi)
            coll.pipelined_ring(self.inside, self.work[lo:hi], bounds, self.local_rank, shift=0,
                                steps=self.per_host - 1, reduce_steps=0, ufunc=None)

    def overlapped(self, blocks: list[tuple[int, int]]) -> None:
        """Every block's reduce-scatter here, then its all-gather once the helper thread has reduced its
        shard across hosts (the method doc of :func:`allreduce`)."""
        ready: queue.SimpleQueue = queue.SimpleQueue()     # blocks reduced inside the host (None: stop)
        done: queue.SimpleQueue = queue.SimpleQueue()      # blocks reduced across hosts, or the error

        def across() -> None:
            try:
                for _ in blocks:
                    block = ready.get()
                    if block is None:
                        return
                    self.reduce_across(*block)
                    done.put(block)
            except BaseException as exc:  # noqa: BLE001 - raised by the calling thread
                done.put(exc)

        helper = threading.Thread(target=across, name="stratagem-hierarchical", daemon=True)
        helper.start()
        try:
            for block in blocks:
                self.reduce_inside(*block)
                ready.put(block)
            for _ in blocks:
                block = done.get()
                if isinstance(block, BaseException):
                    raise block
                self.gather_inside(*block)
        except BaseException:
            # The helper may be waiting on a peer of another host: it stops at its next message, or
            # when the transport closes or the timeout passes, and writes nothing more meanwhile.
            self.stopped.set()
            ready.put(None)
            raise
        helper.join()


def _flat(x, dtype):
    """``x`` flattened in ``dtype``: a view when it already is (read, never written), else a copy."""
    if x.dtype == dtype and x.flags.c_contiguous:
        return x.reshape(-1)
    return x.astype(dtype, order="C", copy=True).reshape(-1)
