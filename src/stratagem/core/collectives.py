"""Collective algorithms, written once over the transport contract (DESIGN §5).

Every algorithm here only calls ``Transport.send`` and ``Transport.recv`` (mailbox semantics, ordered
per ``(src, dst, tag)``), so it runs over every transport. The public face is
:class:`stratagem.core.communicator.Communicator`; this module is the machinery behind it.

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

* all-reduce, large tensors: ring reduce-scatter + ring all-gather, each ring segment cut into chunks
  of at most ``chunk_bytes`` and pipelined (a chunk is received, reduced and sent on before the next
  one is touched). Each segment is reduced along one chain and then copied around the ring, so every
  rank ends with bitwise-identical bits.
* all-reduce, small tensors (``nbytes <= small_bytes``, or fewer elements than ranks): recursive
  doubling. A non-power-of-two world first folds its extra ranks into partners and hands them the
  result at the end. Partners combine with the lower rank's operand first, so both hold the same bits.
* broadcast: binomial tree (chunked) for small tensors; scatter down the binomial tree, then a ring
  all-gather, for large ones (van de Geijn), which costs ~2x the tensor per rank instead of log2(p)x.
* all-gather and reduce-scatter: the pipelined ring. Barrier: dissemination (ceil(log2 p) rounds).

Safety: all of a communicator's traffic uses one tag (``coll/<name>``), and every message carries the
call's *fingerprint* (sequence number, collective, op, dtype, shape and algorithm settings). A receiver
compares it with its own and raises :class:`CollectiveMismatchError` naming both sides instead of
hanging or reducing garbage; it then tells every other rank (an *abort* message), so they raise the
same error instead of waiting for their timeout.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Callable, Iterator, Sequence

import numpy as np

from .cluster import TaskId
from .errors import CollectiveMismatchError, CommunicationError, ConfigurationError, PeerLostError
from .transport import Message, SendHandle, Transport
from .wire import DTYPES, dtype_name

log = logging.getLogger(__name__)

#: Largest piece of a ring segment sent in one message; smaller pieces pipeline better, larger ones
#: pay less per-message overhead.
DEFAULT_CHUNK_BYTES = 4 << 20
#: All-reduces and broadcasts of at most this many bytes use the latency-optimal algorithms.
DEFAULT_SMALL_BYTES = 64 << 10
#: Abort notices are best-effort: never wait long on a peer that may itself be the problem.
ABORT_SEND_TIMEOUT = 2.0

#: op name -> the ufunc that combines two operands. ``mean`` sums, then divides by the world size.
OPS: dict[str, np.ufunc] = {
    "sum": np.add,
    "mean": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
}
ALLREDUCE_ALGORITHMS = ("auto", "ring", "recursive_doubling")
BROADCAST_ALGORITHMS = ("auto", "binomial_tree", "scatter_allgather")


# -- argument checks (shared with the Communicator, which checks before dispatching) ----------------

def check_dtype(dtype, collective: str) -> np.dtype:
    """The dtype if the wire can carry it, else a ``ConfigurationError`` listing the ones it can."""
    dtype = np.dtype(dtype)
    native = dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype
    if native not in DTYPES.values():
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


# -- small helpers ----------------------------------------------------------------------------------

def is_device_array(x) -> bool:
    """True for a cupy array, without importing cupy (which may not be installed)."""
    return type(x).__module__.startswith("cupy")


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


def _fingerprint(collective: str, **fields) -> dict:
    """Plain-data description of one call (lists, not tuples: the wire turns tuples into lists)."""
    fp = {"coll": collective}
    for key, value in fields.items():
        if key == "shape" and value is not None:
            value = [int(d) for d in value]
        fp[key] = value
    return fp


def describe(fp: dict) -> str:
    """``allreduce(sum, float32, (10,)) as collective #5`` -- how errors name a call."""
    args = []
    if fp.get("op"):
        args.append(str(fp["op"]))
    if "root" in fp:
        args.append(f"root={fp['root']}")
    if fp.get("dtype"):
        args.append(str(fp["dtype"]))
    if fp.get("shape") is not None:
        args.append(str(tuple(fp["shape"])))
    return f"{fp.get('coll', '?')}({', '.join(args)}) as collective #{fp.get('seq', '?')}"


def _settings(fp: dict) -> str:
    return f"algorithm={fp.get('algo')}, chunk={fp.get('chunk')} elements"


# -- the per-communicator session and the per-call context ------------------------------------------

class CollectiveSession:
    """What one communicator's collectives share: the world, the tag, the options, the call counter.

    Not thread-safe: the communicator serialises calls. After a failed collective the session is
    *broken* (``broken`` holds the error): peers may be mid-call, so later traffic cannot be trusted.
    """

    def __init__(self, transport: Transport, members: Sequence[TaskId], rank: int, *, name: str,
                 timeout: float | None, chunk_bytes: int, small_bytes: int):
        self.transport = transport
        self.members = list(members)
        self.rank = rank
        self.name = name
        self.tag = f"coll/{name}"
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.small_bytes = small_bytes
        self.seq = 0
        self.broken: BaseException | None = None

    @property
    def size(self) -> int:
        return len(self.members)

    def who(self, rank: int) -> str:
        """``rank 2 (/job:worker/task:2)``: how messages name a rank."""
        return f"rank {rank} ({self.members[rank]})"

    def chunk_elems(self, itemsize: int) -> int:
        return max(1, self.chunk_bytes // max(1, itemsize))

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @contextlib.contextmanager
    def collective(self, fingerprint: dict, learn: Sequence[str] = ()) -> Iterator["_Call"]:
        """Run one collective call: number it, and on failure break the session and warn the peers."""
        call = _Call(self, {"seq": self.next_seq(), **fingerprint}, learn)
        try:
            yield call
        except Exception as exc:
            self.broken = exc
            self._notify_peers(call, exc)
            raise

    def _notify_peers(self, call: "_Call", exc: Exception) -> None:
        """Best-effort abort notice to every other rank, so they fail now instead of at their timeout.

        Ranks that receive one pass it on (the rank waiting on *them* may not hear from the origin),
        so the notice spreads along every wait chain.
        """
        meta = getattr(exc, "abort_meta", None) or _abort_meta(self, call, exc)
        skip = {self.rank, meta.get("origin")}
        lost = set(self.transport.lost_peers())
        if meta.get("task"):
            lost.add(TaskId.parse(meta["task"]))
        for rank, task in enumerate(self.members):
            if rank in skip or task in lost:
                continue
            try:
                self.transport.send(task, self.tag, Message(dict(meta)), timeout=ABORT_SEND_TIMEOUT)
            except Exception as send_error:  # best effort: the peer may be the one that is gone
                log.debug("%s: could not send abort notice to %s: %s", self.tag, task, send_error)


def _abort_meta(session: CollectiveSession, call: "_Call", exc: Exception) -> dict:
    meta = {"abort": "failed", "origin": session.rank, "fp": call.fp, "reason": f"{type(exc).__name__}: {exc}"}
    if isinstance(exc, CollectiveMismatchError):
        meta.update(abort="mismatch", reason=str(exc))
    elif isinstance(exc, PeerLostError):
        meta.update(abort="lost", task=str(exc.task), reason=str(exc))
    return meta


def _error_from_abort(session: CollectiveSession, meta: dict) -> Exception:
    """The error a rank raises on an abort notice: the same kind the origin raised."""
    origin = meta.get("origin")
    origin_name = session.who(origin) if isinstance(origin, int) and 0 <= origin < session.size else "a peer"
    kind, reason = meta.get("abort"), str(meta.get("reason", ""))
    if kind == "mismatch":
        error: Exception = CollectiveMismatchError(reason)
    elif kind == "lost" and meta.get("task"):
        error = PeerLostError(TaskId.parse(meta["task"]), f"reported by {origin_name} on communicator "
                                                           f"{session.name!r}: {reason}")
    else:
        error = CommunicationError(f"{origin_name} failed a collective on communicator {session.name!r} "
                                   f"and aborted it: {reason}")
    error.abort_meta = meta  # so this rank forwards the same notice, not a new one
    return error


class _Call:
    """One collective call in progress: sends and receives under its fingerprint.

    ``learn`` names fingerprint fields this rank does not know yet (a broadcast receiver that passed
    no array); they are adopted from the first message instead of compared.
    """

    def __init__(self, session: CollectiveSession, fp: dict, learn: Sequence[str] = ()):
        self.session = session
        self.fp = fp
        self._learn = set(learn)
        self._pending: dict[int, Message] = {}
        #: Chunk size (elements) imposed by another rank (a broadcast's root); None: our own option.
        self.chunk: int | None = None

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def size(self) -> int:
        return self.session.size

    def chunk_elems(self, itemsize: int) -> int:
        return self.chunk if self.chunk is not None else self.session.chunk_elems(itemsize)

    def send(self, dst: int, *buffers) -> None:
        """Send and return once the buffers may be modified again."""
        s = self.session
        s.transport.send(s.members[dst], s.tag, Message({"fp": self.fp}, list(buffers)), timeout=s.timeout)

    def send_async(self, dst: int, *buffers) -> SendHandle:
        """Send, possibly still reading the buffers after returning: ``wait()`` before modifying them."""
        s = self.session
        return s.transport.send_async(s.members[dst], s.tag, Message({"fp": self.fp}, list(buffers)),
                                      timeout=s.timeout)

    def wait(self, handles) -> None:
        for handle in handles:
            handle.wait(self.session.timeout)

    def prime(self, src: int) -> None:
        """Receive ``src``'s next message now (to learn from its fingerprint); ``recv`` returns it later."""
        self._pending[src] = self._receive(src)

    def recv(self, src: int, count: int | None = None, dtype=None):
        """The array in ``src``'s next message (``None`` for a bufferless one), checked against what
        this rank expects: the fingerprint, then ``count`` elements of ``dtype``."""
        message = self._pending.pop(src, None) or self._receive(src)
        expected_buffers = 0 if count is None else 1
        if len(message.buffers) != expected_buffers:
            raise self._mismatch(src, f"sent {len(message.buffers)} buffers where {expected_buffers} were expected")
        if count is None:
            return None
        data = message.buffers[0]
        if data.size != count or (dtype is not None and data.dtype != dtype):
            raise self._mismatch(src, f"sent {data.size} elements of {data.dtype} where this rank expected "
                                      f"{count} of {np.dtype(dtype) if dtype is not None else 'any dtype'}")
        return data.reshape(-1)

    def _receive(self, src: int) -> Message:
        s = self.session
        message = s.transport.recv(s.members[src], s.tag, timeout=s.timeout)
        if "abort" in message.meta:
            raise _error_from_abort(s, message.meta)
        self._check_fingerprint(src, message.meta.get("fp"))
        return message

    def _check_fingerprint(self, src: int, theirs) -> None:
        s = self.session
        if not isinstance(theirs, dict):
            raise CollectiveMismatchError(
                f"{s.who(src)} sent a message without a collective fingerprint on tag {s.tag!r} of "
                f"communicator {s.name!r}: something else uses this tag; give each communicator its own name"
            )
        mine = self.fp
        differs = [k for k in set(mine) | set(theirs) if k not in self._learn and mine.get(k) != theirs.get(k)]
        if differs:
            mine_text, theirs_text = describe(mine), describe(theirs)
            hint = ("every rank must make the same collective calls, in the same order, with the same op, "
                    "dtype and shape")
            if mine_text == theirs_text:  # same call, different options
                mine_text += f" [{_settings(mine)}]"
                theirs_text += f" [{_settings(theirs)}]"
                hint = "give every rank the same chunk_bytes, small_bytes and algorithm"
            raise CollectiveMismatchError(
                f"collective mismatch on communicator {s.name!r}: {s.who(src)} called {theirs_text}, but "
                f"{s.who(s.rank)} called {mine_text}; {hint}"
            )
        for key in self._learn:
            mine[key] = theirs.get(key)
        self._learn.clear()

    def _mismatch(self, src: int, what: str) -> CollectiveMismatchError:
        s = self.session
        return CollectiveMismatchError(
            f"collective mismatch on communicator {s.name!r}: in {describe(self.fp)}, {s.who(src)} {what} "
            f"(by {s.who(s.rank)})"
        )


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

def _ring(call: _Call, work, bounds: Sequence[int], position: int, *, shift: int, steps: int,
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


def _recursive_doubling(call: _Call, work, ufunc: np.ufunc) -> None:
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


def _tree_broadcast(call: _Call, work, v: int, root: int) -> None:
    """Binomial-tree broadcast, chunked so a long tensor streams down the tree."""
    size = call.size
    parent = (_tree_parent(v) + root) % size if v else None
    children = [(c + root) % size for c in _tree_children(v, size)]
    for a, b in _chunks(0, work.size, call.chunk_elems(work.dtype.itemsize)):
        if parent is not None:
            work[a:b] = call.recv(parent, b - a, work.dtype)
        for child in children:
            call.send(child, work[a:b])


def _scatter_allgather(call: _Call, work, v: int, root: int) -> None:
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
    if nbytes <= session.small_bytes or length < session.size:
        return "recursive_doubling"
    return "ring"


def allreduce(session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
    """Reduce ``x`` elementwise over all ranks; every rank gets the same (bitwise) result.

    Returns a new array of ``x``'s shape, in ``x``'s dtype (float64 for ``mean`` of integers/bools),
    or writes into ``out`` (checked by :func:`check_out`; ``out=x`` reduces in place) and returns it.
    Reusing ``out`` across calls saves allocating (and page-faulting) a result every call.
    """
    x = as_array(x)
    check_dtype(x.dtype, "allreduce")
    check_op(op, x.dtype, "allreduce")
    check_algorithm(algorithm, ALLREDUCE_ALGORITHMS, "allreduce")
    dtype = working_dtype(op, x.dtype)
    if out is not None:
        check_out(out, x, dtype, "allreduce")
    algo = choose_allreduce_algorithm(session, x.size * dtype.itemsize, x.size, algorithm)
    chunk = session.chunk_elems(dtype.itemsize) if algo == "ring" else None
    fp = _fingerprint("allreduce", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo=algo, chunk=chunk)
    if algo == "ring":
        # Out of place: the ring writes every element of ``work`` itself, so no copy of x first
        # (and with out=x, src and work are the same memory: the classic in-place ring).
        work = _array_module(x).empty(x.size, dtype=dtype) if out is None else out.reshape(-1)
        src = work if out is x else _flat_view(x, dtype)
    else:
        work = _working_copy(x, dtype)
    with session.collective(fp) as call:
        if algo == "ring":
            _ring(call, work, split_bounds(work.size, call.size), call.rank, shift=0,
                  steps=2 * (call.size - 1), reduce_steps=call.size - 1, ufunc=OPS[op], src=src)
        elif algo == "recursive_doubling":
            _recursive_doubling(call, work, OPS[op])
    _finish_mean(work, op, session.size)
    if out is None:
        return work.reshape(x.shape)
    if algo != "ring":
        out[...] = work.reshape(x.shape)
    return out


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
    elif out is not x and isinstance(out, np.ndarray) and np.shares_memory(out, x):
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
    fp = _fingerprint("reduce_scatter", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo="ring", chunk=chunk)
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
    fp = _fingerprint("allgather", dtype=dtype_name(x.dtype), shape=x.shape, algo="ring", chunk=chunk)
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
        return "binomial_tree"
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


def _broadcast_root(session: CollectiveSession, x, root: int, algorithm: str):
    if x is None:
        raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
    check_dtype(x.dtype, "broadcast")
    work = _working_copy(x, working_dtype(None, x.dtype))
    algo = choose_broadcast_algorithm(session, work.nbytes, work.size, algorithm)
    fp = _fingerprint("broadcast", root=root, dtype=dtype_name(x.dtype), shape=x.shape, algo=algo,
                      chunk=session.chunk_elems(work.dtype.itemsize))
    with session.collective(fp) as call:
        _run_broadcast(call, work, algo, root)
    return work.reshape(x.shape)


def _broadcast_receive(session: CollectiveSession, x, root: int):
    learn = ["algo", "chunk"]
    if x is None:
        learn += ["dtype", "shape"]
        dtype = shape = None
    else:
        dtype, shape = dtype_name(check_dtype(x.dtype, "broadcast")), x.shape
    fp = _fingerprint("broadcast", root=root, dtype=dtype, shape=shape, algo=None, chunk=None)
    v = (session.rank - root) % session.size
    with session.collective(fp, learn=learn) as call:
        parent = (_tree_parent(v) + root) % session.size
        call.prime(parent)  # its fingerprint says the dtype, shape and algorithm the root chose
        dtype, shape = DTYPES[call.fp["dtype"]], tuple(call.fp["shape"])
        xp = np if x is None else _array_module(x)
        work = xp.empty(int(np.prod(shape, dtype=np.int64)), dtype=dtype)
        # The root's chunking governs: receivers must cut chunks exactly as the senders do.
        call.chunk = int(call.fp["chunk"])
        _run_broadcast(call, work, call.fp["algo"], root)
    return work.reshape(shape)


def _run_broadcast(call: _Call, work, algo: str, root: int) -> None:
    v = (call.rank - root) % call.size
    if algo == "binomial_tree":
        _tree_broadcast(call, work, v, root)
    elif algo == "scatter_allgather":
        _scatter_allgather(call, work, v, root)


def barrier(session: CollectiveSession) -> None:
    """Return only once every rank has entered the barrier (dissemination: ceil(log2 size) rounds)."""
    with session.collective(_fingerprint("barrier")) as call:
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
