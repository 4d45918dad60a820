"""Collective algorithms, written once over the transport contract (:mod:`stratagem.core.transport`).

Every algorithm here only calls ``Transport.send`` and ``Transport.recv`` (mailbox semantics, ordered
per ``(src, dst, tag)``), so it runs over every transport. The public face is
:class:`stratagem.collectives.communicator.Communicator`; this module is the machinery behind it.

Entry points (also the signature a transport's ``native_collectives()`` callables must have)::

    allreduce(session, x, op="sum", algorithm="auto", out=None) -> array of x's shape (or out)
    broadcast(session, x, root=0, algorithm="auto")   -> array of the root's shape and dtype
    allgather(session, x)                              -> array of shape (size, *x.shape)
    reduce_scatter(session, x, op="sum")               -> this rank's segment of the reduced, flattened x
    barrier(session)                                   -> None

``session`` is the communicator's :class:`CollectiveSession` (``rank``, ``size``, ``members``,
``transport``, ``timeout``, ``chunk_bytes``, ``small_bytes``); ``x`` is a numpy array, or a cupy array
when the transport carries device buffers. A native implementation may ignore the options it has no
use for.

Algorithms:

* all-reduce, large tensors at 2 ranks and at 5 or more: ring reduce-scatter + ring all-gather,
  each ring segment cut into chunks of at most ``chunk_bytes`` and pipelined (a chunk is received,
  reduced and sent on before the next one is touched). Each segment is reduced along one chain and
  then copied around the ring, so every rank ends with bitwise-identical bits.
* all-reduce in worlds of up to :data:`DIRECT_MAX_RANKS` ranks: up to ``small_bytes``, or while a
  rank sends at most :data:`DIRECT_BYTES`, a direct exchange: every rank sends its tensor to every
  other and combines all of them in rank order (so every rank computes the same bits), one round of
  messages instead of log2(p) or 2(p-1) dependent ones. Above that, at 3 and 4 ranks, the pairwise
  algorithm: a reduce-scatter and an all-gather of one round of direct messages each, the bytes of
  the ring in 2 rounds (chunked like the ring). At 2 ranks the ring is the same messages. When the
  members' addresses name more than one host, the ring above ``small_bytes`` instead: messages to
  every peer at once overflow a slow link's queue.
* all-reduce, small tensors in larger worlds (``nbytes <= small_bytes``, or fewer elements than
  ranks): recursive doubling. A non-power-of-two world first folds its extra ranks into partners and
  hands them the result at the end. Partners combine with the lower rank's operand first, so both
  hold the same bits.
* broadcast: every rank first tells every other one which call it makes (an *agreement*: one round
  of bufferless messages, all at once), so that a rank that disagrees (another root, dtype or shape)
  makes every rank raise, the root included. Small tensors ride on the root's agreement messages
  (``direct``: one round in all); large ones then go by scatter down the binomial tree and a ring
  all-gather (van de Geijn), which costs ~2x the tensor per rank instead of log2(p)x; the binomial
  tree (chunked) is still there to choose.
* all-gather and reduce-scatter: the pipelined ring. Barrier: dissemination (ceil(log2 p) rounds).

Safety: all of a communicator's traffic uses one tag (``coll/<name>``), and every message carries the
call's *fingerprint* (sequence number, collective, op, dtype, shape and algorithm settings). A receiver
compares it with its own and raises :class:`CollectiveMismatchError` naming both sides instead of
hanging or reducing garbage; it then tells every other rank (an *abort* message), so they raise the
same error instead of waiting for their timeout. That protocol lives in ``collective_session.py``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable, Sequence

import numpy as np

from stratagem.collectives.session import CollectiveCall, CollectiveSession, fingerprint
from stratagem.core.errors import CollectiveMismatchError, ConfigurationError
from stratagem.core.transport import SendHandle
from stratagem.core.wire import DTYPES, dtype_name

log = logging.getLogger(__name__)

#: Largest piece of a ring segment sent in one message; smaller pieces pipeline better, larger ones
#: pay less per-message overhead.
DEFAULT_CHUNK_BYTES = 4 << 20
#: All-reduces and broadcasts of at most this many bytes use the latency-optimal algorithms.
DEFAULT_SMALL_BYTES = 64 << 10

#: op name -> the ufunc that combines two operands. ``mean`` sums, then divides by the world size.
OPS: dict[str, np.ufunc] = {
    "sum": np.add,
    "mean": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
}
ALLREDUCE_ALGORITHMS = ("auto", "ring", "recursive_doubling", "direct", "pairwise")
#: In worlds of up to this many ranks, all-reduces exchange directly (one round of messages) up to
#: :data:`DIRECT_BYTES` of traffic per rank and use the pairwise algorithm (two rounds) above; larger
#: worlds use recursive doubling (log2 rounds) up to ``small_bytes`` and the ring above.
DIRECT_MAX_RANKS = 4
#: The most bytes a rank sends in a direct exchange chosen by ``auto`` ((ranks - 1) x the tensor).
DIRECT_BYTES = 2 << 20
BROADCAST_ALGORITHMS = ("auto", "binomial_tree", "scatter_allgather")   # and "direct", which auto picks


# -- argument checks (shared with the Communicator, which checks before dispatching) ----------------

_WIRE_DTYPES = frozenset(DTYPES.values())


def check_dtype(dtype, collective: str) -> np.dtype:
    """The dtype if the wire can carry it, else a ``ConfigurationError`` listing the ones it can."""
    dtype = np.dtype(dtype)
    native = dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype
    if native not in _WIRE_DTYPES:
        raise ConfigurationError(
            f"{collective}: dtype {dtype} cannot be sent between tasks; allowed: {', '.join(DTYPES)} "
            f"(convert with x.astype(...))"
        )
    return dtype


def check_op(op: str, dtype, collective: str) -> None:
    """Refuse unknown ops, and bool ops whose numpy meaning would change the dtype."""
    if op not in OPS:
        raise ConfigurationError(f"{collective}: unknown op {op!r}; use one of {', '.join(OPS)}")
    if np.dtype(dtype) == np.bool_ and op in ("sum", "prod"):
        # numpy's np.sum/np.prod of bools count into int64; a same-dtype result would silently be
        # logical or/and instead, so make the caller say which one they mean.
        raise ConfigurationError(
            f"{collective}: op {op!r} on bool arrays is ambiguous (numpy would count into int64); use "
            f"op='max' for logical or, op='min' for logical and, op='mean' for the fraction of True, "
            f"or cast first with x.astype(np.int64)"
        )


def check_algorithm(algorithm: str, known: Sequence[str], collective: str) -> None:
    if algorithm not in known:
        raise ConfigurationError(
            f"{collective}: unknown algorithm {algorithm!r}; use one of {', '.join(known)}"
        )


def check_root(root, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ConfigurationError(f"broadcast: root must be a rank in 0..{size - 1}, got {root!r}")
    return int(root)


def working_dtype(op: str | None, dtype) -> np.dtype:
    """The dtype the reduction runs (and returns) in.

    Native byte order always; ``mean`` of integers or bools follows numpy's ``np.mean``: float64.
    """
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("=")
    if op == "mean" and (dtype.kind in "iub"):
        return np.dtype(np.float64)
    return dtype


def check_allreduce(x, op: str, algorithm: str, out) -> np.dtype:
    """An all-reduce's arguments checked, as core's :func:`allreduce` checks them (``check_out``
    below); returns the dtype it reduces and returns in. For native all-reduces, which are handed
    what the caller passed."""
    check_dtype(x.dtype, "allreduce")
    check_op(op, x.dtype, "allreduce")
    check_algorithm(algorithm, ALLREDUCE_ALGORITHMS, "allreduce")
    dtype = working_dtype(op, x.dtype)
    if out is not None:
        check_out(out, x, dtype, "allreduce")
    return dtype


# -- small helpers ----------------------------------------------------------------------------------

def is_device_array(x) -> bool:
    """True for a cupy array, without importing cupy (which may not be installed)."""
    return type(x) is not np.ndarray and type(x).__module__.startswith("cupy")


def _array_module(x):
    """numpy, or cupy for a cupy array: allocations must live where the data lives."""
    if is_device_array(x):
        return importlib.import_module("cupy")
    return np


def as_array(x):
    """``x`` as an array of its own kind (cupy stays cupy; lists and scalars become numpy)."""
    return x if is_device_array(x) else np.asarray(x)


def _working_copy(x, dtype: np.dtype):
    """A fresh C-ordered flat copy of ``x``: the caller's array is never written to."""
    return x.astype(dtype, order="C", copy=True).reshape(-1)


def _flat_view(x, dtype: np.dtype):
    """``x`` flattened, as a view when it is already C-contiguous in ``dtype`` (read, never written)."""
    if x.dtype == dtype and x.flags.c_contiguous:
        return x.reshape(-1)
    return _working_copy(x, dtype)


def split_bounds(length: int, parts: int) -> list[int]:
    """Segment boundaries like ``np.array_split``: the first ``length % parts`` segments get one more."""
    base, extra = divmod(length, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def _chunks(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """Pieces of ``[lo, hi)`` of at most ``size`` elements.

    An empty range still yields one (empty) piece, so every step of an algorithm sends at least one
    message and every peer's fingerprint is checked even for tensors with fewer elements than ranks.
    """
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tree_parent(v: int) -> int:
    """Parent of relative rank ``v > 0`` in the binomial tree: ``v`` without its lowest set bit."""
    return v - (v & -v)


def _tree_children(v: int, size: int) -> list[int]:
    """Children of relative rank ``v``, largest subtree first (it has the longest way to go)."""
    limit = (v & -v) if v else _next_power_of_two(size)
    children, mask = [], limit >> 1
    while mask:
        if v + mask < size:
            children.append(v + mask)
        mask >>= 1
    return children


def _subtree_end(v: int, size: int) -> int:
    """One past the last relative rank in ``v``'s subtree (the subtree is contiguous)."""
    return size if v == 0 else min(v + (v & -v), size)


# -- reduction helpers ------------------------------------------------------------------------------

def _combine(ufunc: np.ufunc, work, other, mine_first: bool) -> None:
    """``work = op(work, other)`` with a canonical operand order, so two partners get the same bits
    even for ops that are not bitwise commutative (e.g. min/max of two different NaNs)."""
    if mine_first:
        ufunc(work, other, out=work)
    else:
        ufunc(other, work, out=work)


def _finish_mean(work, op: str, size: int) -> None:
    """Divide in place; every rank divides identical bits by the same number, so results stay identical."""
    if op == "mean" and size > 1:
        np.true_divide(work, work.dtype.type(size), out=work)


# -- the building blocks ----------------------------------------------------------------------------

def _ring(call: CollectiveCall, work, bounds: Sequence[int], position: int, *, shift: int, steps: int,
          reduce_steps: int, ufunc: np.ufunc | None, src=None) -> None:
    """Pipelined ring over segments ``bounds`` of ``work``, this rank sitting at ``position``.

    At step ``s`` the rank receives segment ``position - shift - s - 1`` from its left neighbour and
    then owns what it will send at step ``s + 1``, so each chunk is sent on as soon as it is reduced
    (the first ``reduce_steps`` steps) or copied (the rest): the transfer of one chunk overlaps the
    reduction of the next.

    ``src`` holds this rank's own contribution (default: ``work`` itself). With a separate ``src`` the
    ring runs out of place: a reduction writes ``op(src, incoming)`` into ``work``, which every
    segment gets exactly once per rank, so ``work`` needs no copy of the input first.

    Sends are asynchronous views of ``src``/``work``; a chunk is only overwritten after its send
    completed, and every send has completed when this returns.
    """
    size = call.size
    src = work if src is None else src
    left, right = (call.rank - 1) % size, (call.rank + 1) % size
    chunk = call.chunk_elems(work.dtype.itemsize)
    in_flight: dict[tuple[int, int], SendHandle] = {}
    from_src: list[SendHandle] = []

    def segment(k: int) -> tuple[int, int]:
        k %= size
        return bounds[k], bounds[k + 1]

    try:
        for a, b in _chunks(*segment(position - shift), chunk):
            from_src.append(call.send_async(right, src[a:b]))
        for step in range(steps):
            for a, b in _chunks(*segment(position - shift - step - 1), chunk):
                incoming = call.recv(left, b - a, work.dtype)
                pending = in_flight.pop((a, b), None)
                if pending is not None:  # we sent this chunk before; it must be out before we overwrite
                    pending.wait(call.session.timeout)
                if step < reduce_steps:
                    ufunc(src[a:b], incoming, out=work[a:b])
                else:
                    work[a:b] = incoming
                if step + 1 < steps:
                    in_flight[(a, b)] = call.send_async(right, work[a:b])
    finally:
        # Never return (or raise) while the transport may still read the caller's memory.
        for handle in [*from_src, *in_flight.values()]:
            try:
                handle.wait(call.session.timeout)
            except Exception:  # the original error, if any, is the one to report
                log.debug("a send did not complete while the ring was unwinding", exc_info=True)


#: The pipelined ring, for algorithms that run it over a subgroup of a call's members: ``call`` may be any
#: object with the call's ``rank``, ``size``, ``session``, ``chunk_elems``, ``send_async`` and ``recv``
#: (:mod:`stratagem.collectives.hierarchical`).
pipelined_ring = _ring


def _recursive_doubling(call: CollectiveCall, work, ufunc: np.ufunc) -> None:
    """All-reduce in log2 steps; any world size.

    The ``size - p2`` ranks above the largest power of two ``p2`` first hand their data to rank
    ``r - p2`` and receive the final result from it at the end.
    """
    size, rank, n = call.size, call.rank, work.size
    p2 = 1 << (size.bit_length() - 1)
    extra = size - p2
    if rank >= p2:
        call.send(rank - p2, work)
        work[...] = call.recv(rank - p2, n, work.dtype)
        return
    if rank < extra:
        _combine(ufunc, work, call.recv(rank + p2, n, work.dtype), mine_first=True)
    mask = 1
    while mask < p2:
        partner = rank ^ mask
        call.send(partner, work)
        _combine(ufunc, work, call.recv(partner, n, work.dtype), mine_first=rank < partner)
        mask <<= 1
    if rank < extra:
        call.send(rank + p2, work)


def _direct(call: CollectiveCall, work, src, ufunc: np.ufunc) -> None:
    """All-reduce in one round: send ``src`` to every other rank, then ``work = x0 op x1 op ...`` in
    rank order (the same order, hence the same bits, on every rank). ``work`` and ``src`` must not
    share memory unless this is rank 0 (rank 0 starts from its own operand)."""
    size, rank, n = call.size, call.rank, work.size
    if size == 2:   # the common small case, without the general loop's closures
        other = 1 - rank
        call.send(other, src)
        theirs = call.recv(other, n, work.dtype)
        ufunc(src, theirs, out=work) if rank == 0 else ufunc(theirs, src, out=work)
        return
    for offset in range(1, size):
        call.send((rank + offset) % size, src)
    operand = lambda r: src if r == rank else call.recv(r, n, work.dtype)  # noqa: E731
    # x0 op x1 straight into work (no copy of x0 first), then the others.
    ufunc(operand(0), operand(1), out=work)
    for r in range(2, size):
        ufunc(work, operand(r), out=work)


def _pairwise(call: CollectiveCall, work, src, bounds: Sequence[int], ufunc: np.ufunc) -> None:
    """All-reduce in two rounds of direct messages (a reduce-scatter, then an all-gather): every rank
    sends each other rank its piece of that rank's segment; rank ``j`` combines the pieces of segment
    ``j`` in rank order (one rank computes each segment, so every rank ends with the same bits) and
    sends the result to every other rank. The bytes of the ring (2(n-1)/n of the tensor per rank) in
    2 rounds instead of 2(n-1) dependent steps, which on an oversubscribed machine each wait for a
    rank to be scheduled. Segments are cut into chunks of at most ``chunk_bytes``: a chunk is combined
    as soon as its pieces are in, while the rest are on their way.

    Sends are asynchronous views of ``src``/``work``; memory is only overwritten once no send reads it
    any more, and every send has completed when this returns.
    """
    size, rank = call.size, call.rank
    chunk = call.chunk_elems(work.dtype.itemsize)
    lo, hi = bounds[rank], bounds[rank + 1]
    # In place, from rank 2 on, the first combinations write our own segment before our operand is
    # added (rank order): each chunk of it is copied aside just before it is combined, into one spare
    # chunk (ranks 0 and 1 read it before or as it is written, element by element).
    spare = _array_module(work).empty(min(chunk, hi - lo), work.dtype) if src is work and rank >= 2 else None
    scatter: list[SendHandle] = []
    gather: list[SendHandle] = []
    try:
        for offset in range(1, size):
            j = (rank + offset) % size
            for a, b in _chunks(bounds[j], bounds[j + 1], chunk):
                scatter.append(call.send_async(j, src[a:b]))
        for a, b in _chunks(lo, hi, chunk):
            mine = src[a:b]
            if spare is not None:
                mine = spare[:b - a]
                mine[...] = src[a:b]
            operand = lambda r: mine if r == rank else call.recv(r, b - a, work.dtype)  # noqa: E731
            ufunc(operand(0), operand(1), out=work[a:b])  # x0 op x1 straight into work, then the others
            for r in range(2, size):
                ufunc(work[a:b], operand(r), out=work[a:b])
        for offset in range(1, size):
            for a, b in _chunks(lo, hi, chunk):
                gather.append(call.send_async((rank + offset) % size, work[a:b]))
        if src is work:  # the segments received next overwrite what the first round's sends read
            _wait_all(call, scatter)
        for offset in range(1, size):
            j = (rank - offset) % size
            for a, b in _chunks(bounds[j], bounds[j + 1], chunk):
                work[a:b] = call.recv(j, b - a, work.dtype)
    finally:
        _wait_all(call, scatter + gather, quiet=True)


def _wait_all(call: CollectiveCall, handles: list, quiet: bool = False) -> None:
    """Wait for sends to release their memory; ``quiet``: while unwinding (the first error counts)."""
    for handle in handles:
        if not quiet:
            handle.wait(call.session.timeout)
            continue
        try:
            handle.wait(call.session.timeout)
        except Exception:
            log.debug("a send did not complete while the all-reduce was unwinding", exc_info=True)
    handles.clear()


def _tree_broadcast(call: CollectiveCall, work, v: int, root: int) -> None:
    """Binomial-tree broadcast, chunked so a long tensor streams down the tree."""
    size = call.size
    parent = (_tree_parent(v) + root) % size if v else None
    children = [(c + root) % size for c in _tree_children(v, size)]
    for a, b in _chunks(0, work.size, call.chunk_elems(work.dtype.itemsize)):
        if parent is not None:
            work[a:b] = call.recv(parent, b - a, work.dtype)
        for child in children:
            call.send(child, work[a:b])


def _scatter_allgather(call: CollectiveCall, work, v: int, root: int) -> None:
    """Broadcast as a binomial-tree scatter of segments, then a ring all-gather (van de Geijn).

    Segment ``u`` belongs to relative rank ``u``; a subtree's segments are contiguous in ``work``, so
    each tree edge carries one slice.
    """
    size = call.size
    bounds = split_bounds(work.size, size)
    chunk = call.chunk_elems(work.dtype.itemsize)
    if v:
        parent = (_tree_parent(v) + root) % size
        for a, b in _chunks(bounds[v], bounds[_subtree_end(v, size)], chunk):
            work[a:b] = call.recv(parent, b - a, work.dtype)
    for child in _tree_children(v, size):
        for a, b in _chunks(bounds[child], bounds[_subtree_end(child, size)], chunk):
            call.send((child + root) % size, work[a:b])
    _ring(call, work, bounds, v, shift=0, steps=size - 1, reduce_steps=0, ufunc=None)


# -- entry points -----------------------------------------------------------------------------------

def choose_allreduce_algorithm(session: CollectiveSession, nbytes: int, length: int, algorithm: str = "auto") -> str:
    """Same inputs on every rank -> same choice on every rank (it depends on nothing local)."""
    if session.size == 1:
        return "local"
    if algorithm != "auto":
        return algorithm
    size = session.size
    if size <= DIRECT_MAX_RANKS:
        # Few ranks: one round of messages while the traffic is small, else two (pairwise). On an
        # oversubscribed machine every dependent step waits for a rank to be scheduled, which costs
        # more than the extra bytes of the direct exchange (see benchmarks/README.md).
        if nbytes <= session.small_bytes or length < size:
            return "direct"
        if session.spans_hosts:
            # Across hosts, the ring: direct and pairwise send to every peer at once, which overflows
            # a slow link's queue (TCP drops and resends: at 100mbit, 4 ranks, 1.6 MB, the ring takes
            # the wire's 0.2 s, pairwise 0.30-0.45 s; benchmarks/README.md, issue 22 5f).
            return "ring"
        if (size - 1) * nbytes <= DIRECT_BYTES:
            return "direct"
        return "ring" if size == 2 else "pairwise"  # the same messages at 2 ranks; the ring pipelines
    if nbytes <= session.small_bytes or length < size:
        return "recursive_doubling"
    return "ring"


def _allreduce_plan(session: CollectiveSession, x, op: str, algorithm: str) -> tuple:
    """``(working dtype, algorithm, chunk, fingerprint)`` for an all-reduce of ``x``, arguments checked.

    Kept per session (a training loop all-reduces the same few shapes every step, and working this
    out again is a good part of a small all-reduce's cost); everything it depends on is in the key
    or fixed for the session.
    """
    cacheable = type(op) is str and type(algorithm) is str  # else the checks below say what is wrong
    key = (x.dtype, x.shape, op, algorithm) if cacheable else None
    plans = session.plans
    plan = plans.get(key) if cacheable else None
    if plan is None:
        check_dtype(x.dtype, "allreduce")
        check_op(op, x.dtype, "allreduce")
        check_algorithm(algorithm, ALLREDUCE_ALGORITHMS, "allreduce")
        dtype = working_dtype(op, x.dtype)
        algo = choose_allreduce_algorithm(session, x.size * dtype.itemsize, x.size, algorithm)
        chunk = session.chunk_elems(dtype.itemsize) if algo in ("ring", "pairwise") else None
        fp = fingerprint("allreduce", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo=algo, chunk=chunk)
        plan = (dtype, algo, chunk, fp)
        if cacheable:
            if len(plans) >= _MAX_PLANS:
                plans.clear()
            plans[key] = plan
    return plan


#: Plans a session keeps (beyond that it starts again: shapes that change every call gain nothing).
_MAX_PLANS = 256


def allreduce(session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
    """Reduce ``x`` elementwise over all ranks; every rank gets the same (bitwise) result.

    Returns a new array of ``x``'s shape, in ``x``'s dtype (float64 for ``mean`` of integers/bools),
    or writes into ``out`` (checked by :func:`check_out`; ``out=x`` reduces in place) and returns it.
    Reusing ``out`` across calls saves allocating (and page-faulting) a result every call; without
    ``out``, a large result reuses the memory of an earlier one the caller dropped
    (:mod:`stratagem.collectives.results`).
    """
    if type(x) is not np.ndarray:
        x = as_array(x)
    plan = _allreduce_plan(session, x, op, algorithm)
    dtype, algo, chunk, fp = plan
    if out is not None:
        check_out(out, x, dtype, "allreduce")
    xp = np if type(x) is np.ndarray else _array_module(x)
    if algo == "ring" or algo == "direct" or algo == "pairwise":
        # Out of place: the algorithm writes every element of ``work`` itself, so no copy of x first
        # (and with out=x, src and work are the same memory: the classic in-place ring).
        if out is not None:
            work = out.reshape(-1)
        else:  # a large result in memory a former result left (see collectives/results.py)
            work = session.results.empty(x.size, dtype) if xp is np else xp.empty(x.size, dtype=dtype)
        src = work if out is x else _flat_view(x, dtype)
        if algo == "direct" and out is x and session.rank:
            src = src.copy()  # the others' operands come first: our own must survive them
    elif out is None:
        work = _working_copy(x, dtype)
    else:  # recursive doubling reduces in place: start from a copy of x in out
        work = out.reshape(-1)
        if out is not x:
            work[...] = x.reshape(-1)
    with session.collective(fp) as call:
        if algo == "ring":
            _ring(call, work, split_bounds(work.size, call.size), call.rank, shift=0,
                  steps=2 * (call.size - 1), reduce_steps=call.size - 1, ufunc=OPS[op], src=src)
        elif algo == "direct":
            _direct(call, work, src, OPS[op])
        elif algo == "pairwise":
            _pairwise(call, work, src, split_bounds(work.size, call.size), OPS[op])
        elif algo == "recursive_doubling":
            _recursive_doubling(call, work, OPS[op])
    if op == "mean":
        _finish_mean(work, op, session.size)
    return work.reshape(x.shape) if out is None else out


def check_out(out, x, dtype: np.dtype, collective: str) -> None:
    """``out`` must be a writeable C-contiguous array of x's shape in the result dtype, and either
    be ``x`` itself or share no memory with it."""
    problems = []
    if type(out) is not type(x) and not (isinstance(out, np.ndarray) and isinstance(x, np.ndarray)):
        problems.append(f"it is a {type(out).__name__}, x is a {type(x).__name__}")
    elif out.shape != x.shape or out.dtype != dtype:
        problems.append(f"it is {out.dtype}{tuple(out.shape)}, the result is {dtype}{tuple(x.shape)}")
    elif not out.flags.c_contiguous or not out.flags.writeable:
        problems.append("it must be C-contiguous and writeable")
    elif (out is not x and isinstance(out, np.ndarray) and np.may_share_memory(out, x)
          and np.shares_memory(out, x)):  # the cheap bounds test first: it rules out the usual case
        problems.append("it overlaps x without being x (pass out=x to reduce in place)")
    if problems:
        raise ConfigurationError(f"{collective}: cannot write the result into out: {problems[0]}")


def reduce_scatter(session: CollectiveSession, x, op: str = "sum"):
    """Reduce ``x`` over all ranks and return this rank's segment of the flattened result.

    Segments split like ``np.array_split(reduced.reshape(-1), size)``: the first ``L % size`` ranks
    get one element more. The result is a new 1-d array (float64 for ``mean`` of integers/bools).
    """
    x = as_array(x)
    check_dtype(x.dtype, "reduce_scatter")
    check_op(op, x.dtype, "reduce_scatter")
    dtype = working_dtype(op, x.dtype)
    src = _flat_view(x, dtype)
    # A world of one has nothing to reduce: its segment is its own input.
    work = _working_copy(x, dtype) if session.size == 1 else _array_module(x).empty(src.size, dtype=dtype)
    bounds = split_bounds(work.size, session.size)
    chunk = session.chunk_elems(work.dtype.itemsize)
    fp = fingerprint("reduce_scatter", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo="ring", chunk=chunk)
    with session.collective(fp) as call:
        if call.size > 1:
            _ring(call, work, bounds, call.rank, shift=1, steps=call.size - 1,
                  reduce_steps=call.size - 1, ufunc=OPS[op], src=src)
    # A copy, so the result does not keep the whole working buffer alive.
    mine = work[bounds[session.rank]:bounds[session.rank + 1]].copy()
    _finish_mean(mine, op, session.size)
    return mine


def allgather(session: CollectiveSession, x):
    """Every rank's ``x``, stacked in rank order: a new array of shape ``(size, *x.shape)``."""
    x = as_array(x)
    check_dtype(x.dtype, "allgather")
    dtype = working_dtype(None, x.dtype)
    xp = _array_module(x)
    n, size = int(x.size), session.size
    work = xp.empty(n * size, dtype=dtype)
    work[session.rank * n:(session.rank + 1) * n] = x.reshape(-1)
    chunk = session.chunk_elems(dtype.itemsize)
    fp = fingerprint("allgather", dtype=dtype_name(x.dtype), shape=x.shape, algo="ring", chunk=chunk)
    with session.collective(fp) as call:
        if size > 1:
            _ring(call, work, [i * n for i in range(size + 1)], call.rank, shift=0, steps=size - 1,
                  reduce_steps=0, ufunc=None)
    return work.reshape((size, *x.shape))


def choose_broadcast_algorithm(session: CollectiveSession, nbytes: int, length: int, algorithm: str = "auto") -> str:
    """Decided by the root alone; receivers follow what its messages say."""
    if session.size == 1:
        return "local"
    if algorithm != "auto":
        return algorithm
    if nbytes <= session.small_bytes or length < session.size:
        return "direct"
    return "scatter_allgather"


def broadcast(session: CollectiveSession, x, root: int = 0, algorithm: str = "auto"):
    """The root's ``x`` on every rank (a new array).

    Receivers pass an array of the root's shape and dtype (checked; its contents are ignored and it
    is not written to) or ``None`` (shape and dtype are then learned from the root). Only the root's
    ``algorithm`` counts: it decides, and the choice travels in its messages.
    """
    root = check_root(root, session.size)
    check_algorithm(algorithm, BROADCAST_ALGORITHMS, "broadcast")
    if session.rank == root:
        return _broadcast_root(session, as_array(x), root, algorithm)
    return _broadcast_receive(session, None if x is None else as_array(x), root)


#: What a broadcast receiver does not know as it enters the call (its agreement message gives None
#: there): the root's algorithm and chunking, and its dtype and shape too if it passed no array.
_RECEIVERS_LACK = (("algo", "chunk"), ("dtype", "shape", "algo", "chunk"))


def _broadcast_root(session: CollectiveSession, x, root: int, algorithm: str):
    if x is None:
        raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
    check_dtype(x.dtype, "broadcast")
    work = _working_copy(x, working_dtype(None, x.dtype))
    algo = choose_broadcast_algorithm(session, work.nbytes, work.size, algorithm)
    fp = fingerprint("broadcast", root=root, dtype=dtype_name(x.dtype), shape=x.shape, algo=algo,
                      chunk=session.chunk_elems(work.dtype.itemsize))
    with session.collective(fp) as call:
        others = [r for r in range(call.size) if r != root]
        # The agreement: ours carries the call's description (and, direct, the tensor) to every rank.
        handles = [call.send_async(r, work) if algo == "direct" else call.send_async(r) for r in others]
        call.expect_partial(*_RECEIVERS_LACK)
        try:
            for r in others:
                call.agree(r)   # every rank makes this call, with this root (and dtype and shape, if given)
        except BaseException:
            _wait_quietly(call, handles)   # never raise while the transport may still read ``work``
            raise
        call.wait(handles)
        if algo != "direct":
            _run_broadcast(call, work, algo, root)
    return work.reshape(x.shape)


def _broadcast_receive(session: CollectiveSession, x, root: int):
    learn = ["algo", "chunk"]
    if x is None:
        learn += ["dtype", "shape"]
        dtype = shape = None
    else:
        dtype, shape = dtype_name(check_dtype(x.dtype, "broadcast")), x.shape
    fp = fingerprint("broadcast", root=root, dtype=dtype, shape=shape, algo=None, chunk=None)
    with session.collective(fp, learn=learn) as call:
        # The agreement: what this rank knows of the call, to every other rank (bufferless, so the
        # sends complete at once), then the root's, which says the dtype, shape and algorithm it
        # chose, then everyone else's (a rank that disagrees on anything makes every rank raise).
        for r in range(call.size):
            if r != call.rank:
                call.send(r)
        call.prime(root)
        dtype, shape = DTYPES[call.fp["dtype"]], tuple(call.fp["shape"])
        xp = np if x is None else _array_module(x)
        count = int(np.prod(shape, dtype=np.int64))
        call.expect_partial(*_RECEIVERS_LACK)
        for r in range(call.size):
            if r not in (call.rank, root):
                call.agree(r)
        # The root's chunking governs: receivers must cut chunks exactly as the senders do.
        call.chunk = int(call.fp["chunk"])
        algo = call.fp["algo"]
        if algo == "direct":
            work = xp.asarray(call.recv(root, count, dtype))   # its agreement message carried the tensor
        else:
            call.recv(root)   # its agreement message, bufferless
            work = xp.empty(count, dtype=dtype)
            _run_broadcast(call, work, algo, root)
    return work.reshape(shape)


def _wait_quietly(call: CollectiveCall, handles) -> None:
    """Wait for sends while another error is on its way out (that one is the error to report)."""
    for handle in handles:
        try:
            handle.wait(call.session.timeout)
        except Exception:  # noqa: BLE001
            log.debug("a send did not complete while a broadcast was unwinding", exc_info=True)


def _run_broadcast(call: CollectiveCall, work, algo: str, root: int) -> None:
    v = (call.rank - root) % call.size
    if algo == "binomial_tree":
        _tree_broadcast(call, work, v, root)
    elif algo == "scatter_allgather":
        _scatter_allgather(call, work, v, root)
    elif algo != "local":
        raise CollectiveMismatchError(f"broadcast: the root chose an algorithm this rank does not know: {algo!r} "
                                      f"(give every rank the same version of stratagem)")


def barrier(session: CollectiveSession) -> None:
    """Return only once every rank has entered the barrier (dissemination: ceil(log2 size) rounds)."""
    with session.collective(fingerprint("barrier")) as call:
        _disseminate(call)


def meet(session: CollectiveSession, purpose: str) -> None:
    """A barrier inside the call numbered last, for a native collective that must know every member
    arrived before it blocks in its library (MPI's communicator creation has no timeout): it has the
    barrier's timeout, loss detection and mismatch checks, and is not a call of its own."""
    with session.current(fingerprint("barrier", purpose=purpose)) as call:
        _disseminate(call)


def _disseminate(call) -> None:
    """Dissemination: ceil(log2 size) rounds of one message to the rank ``distance`` ahead."""
    distance = 1
    while distance < call.size:
        call.send((call.rank + distance) % call.size)
        call.recv((call.rank - distance) % call.size)
        distance <<= 1


#: name -> core implementation; the Communicator falls back to these when the transport has no native one.
ALGORITHMS: dict[str, Callable] = {
    "allreduce": allreduce,
    "broadcast": broadcast,
    "allgather": allgather,
    "reduce_scatter": reduce_scatter,
    "barrier": barrier,
}
