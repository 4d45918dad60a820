"""MPI's own collectives behind :class:`~stratagem.collectives.communicator.Communicator` (``mpi`` transport).

:meth:`MpiTransport.native_collectives` returns :meth:`MpiCollectives.table`: a
:class:`~stratagem.core.transport.NativeCollective` per collective, whose ``run`` has the signature of
the core algorithm it replaces (``collectives/algorithms.py``) and keeps its semantics, and whose
``accepts`` declines, before anything moves, the calls MPI cannot do exactly (below):

* Every member of a communicator gets its own MPI communicator, made on the first call
  (``MPI_Comm_create_group`` over the members, after a barrier over point-to-point within that call,
  :func:`~stratagem.collectives.algorithms.meet`, so that nobody waits in it for a member that never
  comes).
* Every call first *agrees*: an all-reduce (max) of a hash of the call's fingerprint (collective,
  op, dtype, shape, root; the sequence number mixed in) and of its negation -- three int64s, a few
  microseconds. Unequal hashes mean the ranks called different things: every rank raises
  ``CollectiveMismatchError`` naming both calls (gathered on the spot) instead of hanging or
  reducing garbage (a blocking collective with unequal counts may complete on one rank with wrong
  data, so the agreement must come first). The agreement is also the barrier. A repeated call
  (same collective, op, dtype and shape) reuses its hash and plan.
* The data then moves with MPI's collectives (``Allreduce``, ``Bcast``, ``Allgather``,
  ``Reduce_scatter`` with the ``np.array_split`` counts), in one of two ways (the transport's
  ``blocking_collectives``, chosen at start):

  - *blocking, guarded* (ULFM and ``MPI_THREAD_MULTIPLE``): MPI's blocking calls, the very calls
    of a plain mpi4py program (Open MPI's tuned algorithms, no Python polling), with a guard armed
    around the collective. The transport's background reader watches armed guards every few
    milliseconds (heartbeats, goodbyes with their grace, the deadline, closing) and, when the call
    must end, records why and revokes the communicator (``MPI_Comm_revoke``): the call returns with
    ``MPI_ERR_REVOKED`` on every member, and raises ``PeerLostError``, ``TransportTimeout`` or
    ``TransportClosed``. A member whose process dies fails the call by itself
    (``MPI_ERR_PROC_FAILED``: ``PeerLostError`` naming it).
  - *polled* (no ULFM, or only ``MPI_THREAD_SERIALIZED``): the nonblocking forms
    (``MPI_Iallreduce``...: libnbc's algorithms) polled with the timeout and loss detection. Without
    ULFM a revoke does not end a blocked call, so blocking would risk a hang on a peer that hangs;
    a rank that dies ends the whole job there anyway (Open MPI's launcher kills it).

  Either way nothing blocks for ever, and on a failure the communicator is revoked where MPI
  supports it, so the other members fail at once.
* Reductions MPI does exactly and identically on every rank run natively: sum/prod/mean of integer,
  float32/float64 and complex dtypes, min/max of integers and bools (``MPI_LAND``/``MPI_LOR``), and
  min/max of floating-point dtypes (float16 and bfloat16 too) as integer min/max of an order-preserving
  key of the bits (so ``-0.0 < +0.0`` on every rank, where MPI's float MIN depends on operand order);
  when some rank holds a NaN (the agreement's flag says so), a logical-or of the NaN positions follows
  and puts NaN there, as numpy propagates it. Broadcasts beyond a C int's count of elements move in
  pieces. The rest is declined (core's algorithm runs it), by the same choice on every rank:
  float16/bfloat16 sum/prod/mean (no MPI type), complex min/max, reductions and all-gathers beyond a C
  int's count.
"""

from __future__ import annotations

import hashlib
import weakref
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from stratagem.collectives import algorithms as coll
from stratagem.collectives.session import CollectiveSession, describe, fingerprint
from stratagem.core.errors import CollectiveMismatchError, ConfigurationError, PeerLostError
from stratagem.core.wire import DTYPES, dtype_name
from stratagem.core.transport import NativeCollective
from stratagem.transports.mpi.progress import Guard

#: Bytes of a broadcast's header (dtype and shape, msgpack) and of a call's description on mismatch.
_HEADER_BYTES = 1024
#: The most elements one MPI call moves (a C int): a broadcast moves larger arrays in pieces, and larger
#: reductions and all-gathers are declined (core's algorithm runs them).
MAX_COUNT = (1 << 31) - 1
_KEY_TYPES = {2: np.int16, 4: np.int32, 8: np.int64}
_HALF_FLOATS = (np.dtype(np.float16), DTYPES["bfloat16"])
#: Mixing a call's sequence number into its hash (an odd 62-bit constant), modulo 2**62.
_SEQ_MIX, _MASK62 = 0x2545F4914F6CDD1D & ((1 << 62) - 1), (1 << 62) - 1


@dataclass(frozen=True)
class _Plan:
    mpi_type: object
    mpi_op: object
    keyed: bool = False  # min/max of floats: reduce order-preserving integer keys of the bits


def _order_keys(values: np.ndarray) -> np.ndarray:
    """Integers that order like the floats ``values`` (IEEE total order); the map is its own inverse."""
    kind = _KEY_TYPES[values.dtype.itemsize]
    bits = values.view(kind)
    return bits ^ ((bits >> (8 * values.dtype.itemsize - 1)) & kind(np.iinfo(kind).max))


def _from_keys(keys: np.ndarray, dtype: np.dtype, out: np.ndarray) -> None:
    out.view(keys.dtype)[...] = _order_keys(keys.view(dtype)).view(keys.dtype)


def _flat(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` flattened in ``dtype``: a view when possible (read, never written)."""
    if x.dtype == dtype and x.flags.c_contiguous:
        return x.reshape(-1)
    return x.astype(dtype, order="C").reshape(-1)


class _SessionComm:
    """A session's MPI communicator, the guard of its blocking calls, the agreement's buffers, and
    the guard's ``with``, so that a repeated call costs little Python."""

    __slots__ = ("comm", "peers", "guard", "mine", "agreed", "agree_args", "guarded")

    def __init__(self, comm, peers, guards: set, MPI):
        self.comm = comm
        self.peers = peers
        self.guard = Guard(guards, comm, peers)
        self.mine = np.zeros(3, np.int64)
        self.agreed = np.zeros(3, np.int64)
        self.agree_args = ([self.mine, MPI.INT64_T], [self.agreed, MPI.INT64_T], MPI.MAX)
        self.guarded: "_Guarded | None" = None  # made by MpiCollectives._progress, reused


class _Call:
    """One collective call: its sequence number and the hash of the rest of its fingerprint; the
    fingerprint itself (a dict, for messages and mismatch reports) is made only when needed."""

    __slots__ = ("seq", "static", "h", "comm_name", "_fp")

    def __init__(self, seq: int, static: dict, h: int, comm_name: str):
        self.seq, self.static, self.h, self.comm_name, self._fp = seq, static, h, comm_name, None

    @property
    def fp(self) -> dict:
        if self._fp is None:
            self._fp = {"seq": self.seq, **self.static}
        return self._fp

    def what(self) -> str:
        return f"{describe(self.fp)} on communicator {self.comm_name!r}"


class _Guarded:
    """``with``: the guard of a session's blocking calls armed for one collective (see mpi_progress)."""

    __slots__ = ("broken", "session", "sc", "call")

    def __init__(self, broken, session, sc: _SessionComm, call: _Call):
        #: ``broken(session, comm, revoke=)``: the owner's, when the call failed on the watchdog's revoke.
        self.broken, self.session, self.sc, self.call = broken, session, sc, call

    def __enter__(self):
        self.sc.guard.arm(self.session.timeout, self.call.what)
        return None

    def __exit__(self, kind, value, tb):
        error = self.sc.guard.disarm()
        if error is not None and kind is None:  # it completed as the watchdog revoked: the others failed
            self.broken(self.session, self.sc.comm, revoke=False)
            raise error
        return False


class MpiCollectives:
    """The native collectives of one :class:`MpiTransport`."""

    def __init__(self, transport):
        self.t = transport
        MPI = self.MPI = transport.MPI
        #: MPI's blocking calls, guarded (True), or its nonblocking ones, polled (see the module doc).
        self.blocking = bool(transport.blocking_collectives)
        self._comms: "weakref.WeakKeyDictionary[CollectiveSession, _SessionComm]" = weakref.WeakKeyDictionary()
        self._hashes: dict[tuple, int] = {}
        self._value_types = {
            np.dtype(np.bool_): MPI.C_BOOL,
            np.dtype(np.int8): MPI.INT8_T, np.dtype(np.int16): MPI.INT16_T,
            np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T,
            np.dtype(np.uint8): MPI.UINT8_T, np.dtype(np.uint16): MPI.UINT16_T,
            np.dtype(np.uint32): MPI.UINT32_T, np.dtype(np.uint64): MPI.UINT64_T,
            np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
            np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX, np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
        }
        # For moving bits only (broadcast, all-gather): an MPI type of the same size.
        self._bit_types = {1: MPI.UINT8_T, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T,
                           16: MPI.C_DOUBLE_COMPLEX}
        self._key_types = {2: MPI.INT16_T, 4: MPI.INT32_T, 8: MPI.INT64_T}
        self._last: tuple | None = None   # (session, _SessionComm) of the latest call
        #: What a reduction needs, by (collective, op, dtype, shape): asked by ``accepts`` and by the
        #: call itself, on every step, so a repeated call costs one dict lookup for each.
        self._prepared: dict[tuple, tuple] = {}

    def table(self) -> dict:
        return {"allreduce": NativeCollective(self.allreduce, self.accepts_allreduce),
                "reduce_scatter": NativeCollective(self.reduce_scatter, self.accepts_reduce_scatter),
                "allgather": NativeCollective(self.allgather, self.accepts_allgather),
                "broadcast": NativeCollective(self.broadcast), "barrier": NativeCollective(self.barrier)}

    # -- what MPI takes: the same choice on every rank, from what the fingerprint covers --------------
    def accepts_allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto",
                          out=None) -> bool:
        x = np.asarray(x)      # checked by the communicator already (this is on every step's path)
        return self._prepared_for("allreduce", op, x)[1] is not None

    def accepts_reduce_scatter(self, session: CollectiveSession, x, op: str = "sum") -> bool:
        x = np.asarray(x)      # checked by the communicator already
        return self._prepared_for("reduce_scatter", op, x)[1] is not None

    def accepts_allgather(self, session: CollectiveSession, x) -> bool:
        x = np.asarray(x)
        return (coll.working_dtype(None, x.dtype).itemsize in self._bit_types
                and x.size * session.size <= MAX_COUNT)

    # -- the collectives -------------------------------------------------------------------------------
    def allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
        x = np.asarray(x)
        sc, dtype, plan, call, src, nan = self._reduction(session, "allreduce", op, x)
        with self._progress(session, sc, call) as on_poll:
            nan_anywhere = self._agree(session, sc, call, nan, on_poll)
            flat = np.empty(x.size, dtype) if out is None else out.reshape(-1)
            if plan.keyed:
                keys = _order_keys(src)
                nans = self._nan_positions(session, sc, call, on_poll, src) if nan_anywhere else None
                self._run(session, sc, call, on_poll, "Allreduce",
                          self.MPI.IN_PLACE, [keys, plan.mpi_type], plan.mpi_op)
                _from_keys(keys, dtype, flat)
                if nans is not None:
                    flat[nans] = np.nan
            elif out is x:  # in place (the Communicator refuses any other out that overlaps x)
                self._run(session, sc, call, on_poll, "Allreduce",
                          self.MPI.IN_PLACE, [flat, plan.mpi_type], plan.mpi_op)
            else:
                self._run(session, sc, call, on_poll, "Allreduce",
                          [src, plan.mpi_type], [flat, plan.mpi_type], plan.mpi_op)
        if op == "mean" and session.size > 1:
            np.true_divide(flat, dtype.type(session.size), out=flat)
        return flat.reshape(x.shape) if out is None else out

    def reduce_scatter(self, session: CollectiveSession, x, op: str = "sum"):
        x = np.asarray(x)
        sc, dtype, plan, call, src, nan = self._reduction(session, "reduce_scatter", op, x)
        bounds = coll.split_bounds(src.size, session.size)
        counts = [bounds[i + 1] - bounds[i] for i in range(session.size)]
        mine = np.empty(counts[session.rank], dtype)
        with self._progress(session, sc, call) as on_poll:
            nan_anywhere = self._agree(session, sc, call, nan, on_poll)
            if plan.keyed:
                nans = self._nan_positions(session, sc, call, on_poll, src) if nan_anywhere else None
                keys, got = _order_keys(src), np.empty(mine.size, _KEY_TYPES[dtype.itemsize])
                self._run(session, sc, call, on_poll, "Reduce_scatter",
                          [keys, plan.mpi_type], [got, plan.mpi_type], counts, plan.mpi_op)
                _from_keys(got, dtype, mine)
                if nans is not None:
                    mine[nans[bounds[session.rank]:bounds[session.rank + 1]]] = np.nan
            else:
                self._run(session, sc, call, on_poll, "Reduce_scatter",
                          [src, plan.mpi_type], [mine, plan.mpi_type], counts, plan.mpi_op)
        if op == "mean" and session.size > 1:
            np.true_divide(mine, dtype.type(session.size), out=mine)
        return mine

    def allgather(self, session: CollectiveSession, x):
        x = np.asarray(x)
        dtype = coll.working_dtype(None, x.dtype)
        sc = self._comm(session)
        call = self._call(session, "allgather", dtype=dtype_name(x.dtype), shape=x.shape)
        bits = self._bit_types[dtype.itemsize]
        with self._progress(session, sc, call) as on_poll:
            self._agree(session, sc, call, 0, on_poll)
            src = _flat(x, dtype)
            result = np.empty((session.size, *x.shape), dtype)
            flat = result.reshape(-1)
            self._run(session, sc, call, on_poll, "Allgather",
                      [src.view(np.uint8), src.size, bits], [flat.view(np.uint8), src.size, bits])
        return result

    def broadcast(self, session: CollectiveSession, x, root: int = 0, algorithm: str = "auto"):
        root = coll.check_root(root, session.size)
        is_root = session.rank == root
        if is_root and x is None:
            raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
        x = None if x is None else np.asarray(x)
        sc = self._comm(session)
        call = self._call(session, "broadcast", root=root)
        header = np.zeros(_HEADER_BYTES, np.uint8)
        if is_root:
            work = x.astype(coll.working_dtype(None, x.dtype), order="C", copy=True)
            packed = msgpack.packb([dtype_name(x.dtype), list(x.shape)])
            header[:2] = np.frombuffer(len(packed).to_bytes(2, "little"), np.uint8)
            header[2:2 + len(packed)] = np.frombuffer(packed, np.uint8)
        with self._progress(session, sc, call) as on_poll:
            self._agree(session, sc, call, 0, on_poll)
            self._run(session, sc, call, on_poll, "Bcast", [header, self.MPI.BYTE], root)
            length = int.from_bytes(header[:2].tobytes(), "little")
            name, shape = msgpack.unpackb(header[2:2 + length].tobytes(), raw=False)
            dtype, shape = DTYPES[name], tuple(shape)
            call.fp.update(dtype=name, shape=list(shape))
            wrong = x is not None and not is_root and (dtype_name(x.dtype) != name or x.shape != shape)
            self._agree_on_arguments(session, sc, call, wrong, on_poll, x)
            if not is_root:
                work = np.empty(shape, dtype)
            flat, bits = work.reshape(-1), self._bit_types[dtype.itemsize]
            for lo in range(0, flat.size, MAX_COUNT):      # a C int's count of elements at a time
                piece = flat[lo:lo + MAX_COUNT]
                self._run(session, sc, call, on_poll, "Bcast", [piece.view(np.uint8), piece.size, bits], root)
        return work

    def barrier(self, session: CollectiveSession) -> None:
        sc = self._comm(session)
        call = self._call(session, "barrier")
        with self._progress(session, sc, call) as on_poll:
            self._agree(session, sc, call, 0, on_poll)

    # -- helpers ---------------------------------------------------------------------------------------
    def _plan(self, op: str, dtype: np.dtype, count: int) -> _Plan | None:
        """How MPI reduces ``dtype`` with ``op`` exactly and identically on every rank, or None."""
        MPI = self.MPI
        if count > MAX_COUNT or dtype.byteorder == ">":
            return None
        if op in ("sum", "mean", "prod"):
            mpi_type = self._value_types.get(dtype)
            if mpi_type is None or dtype.kind == "b":
                return None
            return _Plan(mpi_type, MPI.PROD if op == "prod" else MPI.SUM)
        if dtype.kind == "b":
            return _Plan(MPI.C_BOOL, MPI.LAND if op == "min" else MPI.LOR)
        mpi_op = MPI.MIN if op == "min" else MPI.MAX
        if dtype.kind in "iu":
            return _Plan(self._value_types[dtype], mpi_op)
        if dtype.kind == "f" or dtype in _HALF_FLOATS:
            return _Plan(self._key_types[dtype.itemsize], mpi_op, keyed=True)
        return None  # complex min/max: core's algorithm (numpy's lexicographic order)

    def _call(self, session: CollectiveSession, collective: str, **fields) -> _Call:
        """This call (the Communicator already counted it: ``session.seq``)."""
        static = fingerprint(collective, **fields)
        return _Call(session.seq, static, self._hash(static), session.name)

    def _reduction(self, session: CollectiveSession, collective: str, op: str, x: np.ndarray) -> tuple:
        """A reduction's call: ``(session comm, working dtype, plan or None, call, x flat in the
        working dtype, whether it holds a NaN that the plan's keyed min/max must hand to core)``."""
        sc = self._comm(session)
        dtype, plan, static, h = self._prepared_for(collective, op, x)
        src = _flat(x, dtype)
        nan = plan is not None and plan.keyed and bool(np.isnan(src).any())
        return sc, dtype, plan, _Call(session.seq, static, h, session.name), src, nan

    def _prepared_for(self, collective: str, op: str, x: np.ndarray) -> tuple:
        """What a reduction of ``x`` needs: ``(working dtype, plan or None, fingerprint without its
        sequence number, its hash)``, kept for the calls that repeat it."""
        key = (collective, op, x.dtype, x.shape)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        dtype = coll.working_dtype(op, x.dtype)
        static = fingerprint(collective, op=op, dtype=dtype_name(x.dtype), shape=x.shape)
        prepared = (dtype, self._plan(op, dtype, x.size), static, self._hash(static))
        if len(self._prepared) >= 256:  # a program cycling through many shapes: keep the newest
            self._prepared.clear()
        self._prepared[key] = prepared
        return prepared

    @staticmethod
    def _hash(static: dict) -> int:
        """A 62-bit hash of a call's fingerprint (without its sequence number)."""
        digest = hashlib.blake2b(msgpack.packb(static), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2

    def _nan_positions(self, session, sc: _SessionComm, call: _Call, on_poll, src: np.ndarray) -> np.ndarray:
        """Where any rank holds a NaN (a logical-or of each rank's ``isnan``): numpy's min/max put NaN
        there, and the keyed min/max would not."""
        nans = np.isnan(src)
        self._run(session, sc, call, on_poll, "Allreduce", self.MPI.IN_PLACE, [nans, self.MPI.C_BOOL], self.MPI.LOR)
        return nans

    def _progress(self, session: CollectiveSession, sc: _SessionComm, call: _Call):
        """``with``, around one collective: polling MPI holds the reader role (and hears heartbeats
        while it polls); blocking calls arm the guard that the background reader watches."""
        if not self.blocking:
            return self.t.progress.reading(session.timeout)
        guarded = sc.guarded
        if guarded is None:
            guarded = sc.guarded = _Guarded(self._broken, session, sc, call)
        guarded.call = call  # one collective at a time per session: the Communicator serialises them
        return guarded

    def _comm(self, session: CollectiveSession) -> _SessionComm:
        """The MPI communicator of ``session``'s members, made on the session's first collective."""
        last = self._last
        if last is not None and last[0] is session:  # the common case: the same communicator again
            return last[1]
        sc = self._comms.get(session)
        if sc is not None:
            self._last = (session, sc)
            return sc
        # Creating it blocks until every member arrives, without a timeout: meet first (over
        # point-to-point, with the timeout, loss detection and mismatch checks).
        coll.meet(session, "mpi communicator")
        ranks = [self.t.rank_of(m) for m in session.members]
        tag = zlib.crc32(session.name.encode()) & 0x7FFF
        with self.t.mpi_lock:
            group = self.t.coll_comm.Get_group().Incl(ranks)
            try:
                comm = self.t.coll_comm.Create_group(group, tag)
            finally:
                group.Free()
            comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        self.t.own(comm)
        peers = [m for m in session.members if m != self.t.task]
        sc = self._comms[session] = _SessionComm(comm, peers, self.t.progress.guards, self.MPI)
        return sc

    def _agree(self, session: CollectiveSession, sc: _SessionComm, call: _Call, flag, on_poll) -> int:
        """Check that every member makes this very call; returns the max of ``flag`` over the members.

        One max-reduction of (h, -h, flag), h mixing the fingerprint's hash with the sequence number:
        every member holds the same h exactly when max(h) == -max(-h)."""
        h = (call.h + call.seq * _SEQ_MIX) & _MASK62
        mine, agreed = sc.mine, sc.agreed
        mine[0], mine[1], mine[2] = h, -h, int(flag)
        self._run(session, sc, call, on_poll, "Allreduce", *sc.agree_args)
        top, negated_top, flag = agreed.tolist()
        if top != -negated_top:
            raise self._mismatch(session, sc, call, on_poll)
        return flag

    def _gather_texts(self, session, sc, call, on_poll, text: str) -> list[str]:
        mine = np.zeros(_HEADER_BYTES, np.uint8)
        raw = text.encode()[:_HEADER_BYTES]
        mine[:len(raw)] = np.frombuffer(raw, np.uint8)
        every = np.empty((session.size, _HEADER_BYTES), np.uint8)
        self._run(session, sc, call, on_poll, "Allgather", [mine, self.MPI.BYTE], [every, self.MPI.BYTE])
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]

    def _mismatch(self, session, sc, call, on_poll) -> CollectiveMismatchError:
        texts = self._gather_texts(session, sc, call, on_poll, describe(call.fp))
        other = next((r for r, t in enumerate(texts) if t != texts[session.rank]), None)
        if other is None:  # the hashes differ although the descriptions agree: name the settings
            other = (session.rank + 1) % session.size
        message = (f"collective mismatch on communicator {session.name!r}: {session.who(other)} called "
                   f"{texts[other]}, but {session.who(session.rank)} called {texts[session.rank]}; every rank "
                   f"must make the same collective calls, in the same order, with the same op, dtype and shape")
        self._broken(session, sc.comm, revoke=False)  # every member found it: nobody is left waiting
        return CollectiveMismatchError(message)

    def _agree_on_arguments(self, session, sc, call, wrong: bool, on_poll, x) -> None:
        """Broadcast receivers that passed an array must match the root's dtype and shape."""
        fp = call.fp
        mine = describe(fp) if not wrong else f"{fp['coll']}(root={fp['root']}, {x.dtype}, {tuple(x.shape)})"
        if self._agree_flag(session, sc, call, wrong, on_poll):
            texts = self._gather_texts(session, sc, call, on_poll, mine if wrong else "")
            bad = [r for r, t in enumerate(texts) if t]
            self._broken(session, sc.comm, revoke=False)
            raise CollectiveMismatchError(
                f"collective mismatch on communicator {session.name!r}: in {describe(fp)}, "
                + "; ".join(f"{session.who(r)} passed an array for {texts[r]}" for r in bad)
                + f", which is not the root's {fp['dtype']} {tuple(fp['shape'])} (pass None, or an array "
                  f"of the root's dtype and shape)")

    def _agree_flag(self, session, sc, call, flag: bool, on_poll) -> bool:
        mine, every = np.array([int(flag)], np.int64), np.empty(1, np.int64)
        self._run(session, sc, call, on_poll, "Allreduce",
                  [mine, self.MPI.INT64_T], [every, self.MPI.INT64_T], self.MPI.MAX)
        return bool(every[0])

    def _run(self, session, sc: _SessionComm, call: _Call, on_poll, name: str, *args) -> None:
        """MPI collective ``name`` (``Allreduce``...) on the session's communicator: the blocking
        call (its guard armed by ``_progress``), or its nonblocking form (``Iallreduce``...) polled
        with the session's timeout and the transport's loss detection."""
        if not self.blocking:
            post = getattr(sc.comm, "I" + name.lower())
            self._wait(session, sc.comm, call.fp, on_poll, list(args), lambda: post(*args))
            return
        try:
            getattr(sc.comm, name)(*args)
        except self.MPI.Exception as exc:
            self.t.progress.abandon([], args)  # MPI may not be done with the buffers of a failed call
            guard = sc.guard
            error = guard.error or self.t.progress.blocking_failure(exc, guard)
            # A dead member fails the call for every member by itself (ULFM); the watchdog revoked
            # for the rest; revoking again is harmless and reaches members that missed it.
            self._broken(session, sc.comm, revoke=not isinstance(error, PeerLostError))
            raise error from None

    def _wait(self, session, comm, fp, on_poll, keep: list, post) -> None:
        """Post a nonblocking collective and poll it to completion, with the session's timeout."""
        t = self.t
        peers = [m for m in session.members if m != t.task]
        what = f"{describe(fp)} on communicator {session.name!r}"
        try:
            with t.mpi_lock:
                request = post()
        except self.MPI.Exception as exc:
            self._broken(session, comm)
            raise t.progress.translate(exc, comm, peers, what) from None
        try:
            t.progress.wait_requests([request], session.timeout, peers, what, comm=comm, on_poll=on_poll, eager=True)
        except BaseException as exc:
            # A dead member fails the call for every member by itself (ULFM); anything else (a timeout,
            # a peer that stopped answering) must be told to the others: revoke.
            self._broken(session, comm, revoke=not isinstance(exc, PeerLostError))
            t.progress.abandon([request], keep)
            raise

    def _broken(self, session, comm, revoke: bool = True) -> None:
        """The session is unusable: revoke its MPI communicator (ULFM) so the other members fail too."""
        self._comms.pop(session, None)
        self._last = None
        if not revoke:
            return
        try:
            with self.t.mpi_lock:
                comm.Revoke()
        except (NotImplementedError, AttributeError, self.MPI.Exception):
            pass
