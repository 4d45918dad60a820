"""MPI's own collectives behind :class:`~stratagem.core.communicator.Communicator` (``mpi`` transport).

:meth:`MpiTransport.native_collectives` returns :meth:`MpiCollectives.table`; each entry has the
signature of the core algorithm it replaces (``core/collectives.py``) and keeps its semantics:

* Every member of a communicator gets its own MPI communicator, made on the first call
  (``MPI_Comm_create_group`` over the members, after a core barrier so that nobody waits in it for a
  member that never comes).
* Every call first *agrees*: an ``MPI_Iallreduce`` (max) of a hash of the call's fingerprint
  (sequence number, collective, op, dtype, shape, root) and of its negation. Unequal hashes mean the
  ranks called different things: every rank raises ``CollectiveMismatchError`` naming both calls
  (gathered on the spot) instead of hanging or reducing garbage. The agreement is also the barrier.
* The data then moves with MPI's nonblocking collectives (``MPI_Iallreduce``, ``MPI_Ibcast``,
  ``MPI_Iallgather``, ``MPI_Ireduce_scatter`` with the ``np.array_split`` counts), polled with the
  communicator's timeout and the transport's loss detection, so nothing blocks for ever. On a failure
  the MPI communicator is revoked where MPI supports it (ULFM), so the other members fail at once.
* Reductions MPI does exactly and identically on every rank run natively: sum/prod/mean of integer,
  float32/float64 and complex dtypes, min/max of integers and bools (``MPI_LAND``/``MPI_LOR``), and
  min/max of floating-point dtypes (float16 and bfloat16 too) as integer min/max of an order-preserving
  key of the bits (so ``-0.0 < +0.0`` on every rank, where MPI's float MIN depends on operand order).
  The rest falls back to core's algorithm after the agreement: float16/bfloat16 sum/prod/mean (no MPI
  type), complex min/max, float min/max when some rank holds a NaN (numpy propagates NaN; MPI does not),
  and counts beyond a C int.
"""

from __future__ import annotations

import hashlib
import weakref
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from ..core import collectives as coll
from ..core.collective_session import CollectiveSession, describe, fingerprint
from ..core.errors import CollectiveMismatchError, ConfigurationError, PeerLostError
from ..core.wire import DTYPES, dtype_name

#: Bytes of a broadcast's header (dtype and shape, msgpack) and of a call's description on mismatch.
_HEADER_BYTES = 1024
_MAX_COUNT = (1 << 31) - 1
_KEY_TYPES = {2: np.int16, 4: np.int32, 8: np.int64}
_HALF_FLOATS = (np.dtype(np.float16), DTYPES["bfloat16"])


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


class MpiCollectives:
    """The native collectives of one :class:`MpiTransport`."""

    def __init__(self, transport):
        self.t = transport
        MPI = self.MPI = transport.MPI
        self._comms: "weakref.WeakKeyDictionary[CollectiveSession, object]" = weakref.WeakKeyDictionary()
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

    def table(self) -> dict:
        return {"allreduce": self.allreduce, "broadcast": self.broadcast, "allgather": self.allgather,
                "reduce_scatter": self.reduce_scatter, "barrier": self.barrier}

    # -- the collectives -------------------------------------------------------------------------------
    def allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
        x = np.asarray(x)
        dtype = coll.working_dtype(op, x.dtype)
        plan = self._plan(op, dtype, x.size)
        src = _flat(x, dtype)
        nan = plan is not None and plan.keyed and bool(np.isnan(src).any())
        fp = self._fingerprint(session, "allreduce", op=op, dtype=dtype_name(x.dtype), shape=x.shape)
        comm = self._comm(session)
        with self.t.reading(session.timeout) as on_poll:
            native = self._agree(session, comm, fp, nan, on_poll) == 0 and plan is not None
            if native:
                flat = np.empty(x.size, dtype) if out is None else out.reshape(-1)
                if plan.keyed:
                    keys = _order_keys(src)
                    self._wait(session, comm, fp, on_poll, [keys],
                               lambda: comm.Iallreduce(self.MPI.IN_PLACE, [keys, plan.mpi_type], plan.mpi_op))
                    _from_keys(keys, dtype, flat)
                elif np.shares_memory(src, flat):  # out=x: in place
                    self._wait(session, comm, fp, on_poll, [flat],
                               lambda: comm.Iallreduce(self.MPI.IN_PLACE, [flat, plan.mpi_type], plan.mpi_op))
                else:
                    self._wait(session, comm, fp, on_poll, [src, flat],
                               lambda: comm.Iallreduce([src, plan.mpi_type], [flat, plan.mpi_type], plan.mpi_op))
        if not native:
            return self._core("allreduce", session, x, op=op, algorithm=algorithm, out=out)
        if op == "mean" and session.size > 1:
            np.true_divide(flat, dtype.type(session.size), out=flat)
        return flat.reshape(x.shape) if out is None else out

    def reduce_scatter(self, session: CollectiveSession, x, op: str = "sum"):
        x = np.asarray(x)
        dtype = coll.working_dtype(op, x.dtype)
        plan = self._plan(op, dtype, x.size)
        src = _flat(x, dtype)
        nan = plan is not None and plan.keyed and bool(np.isnan(src).any())
        fp = self._fingerprint(session, "reduce_scatter", op=op, dtype=dtype_name(x.dtype), shape=x.shape)
        bounds = coll.split_bounds(src.size, session.size)
        counts = [bounds[i + 1] - bounds[i] for i in range(session.size)]
        mine = np.empty(counts[session.rank], dtype)
        comm = self._comm(session)
        with self.t.reading(session.timeout) as on_poll:
            native = self._agree(session, comm, fp, nan, on_poll) == 0 and plan is not None
            if native:
                if plan.keyed:
                    keys, got = _order_keys(src), np.empty(mine.size, _KEY_TYPES[dtype.itemsize])
                    self._wait(session, comm, fp, on_poll, [keys, got], lambda: comm.Ireduce_scatter(
                        [keys, plan.mpi_type], [got, plan.mpi_type], counts, plan.mpi_op))
                    _from_keys(got, dtype, mine)
                else:
                    self._wait(session, comm, fp, on_poll, [src, mine], lambda: comm.Ireduce_scatter(
                        [src, plan.mpi_type], [mine, plan.mpi_type], counts, plan.mpi_op))
        if not native:
            return self._core("reduce_scatter", session, x, op=op)
        if op == "mean" and session.size > 1:
            np.true_divide(mine, dtype.type(session.size), out=mine)
        return mine

    def allgather(self, session: CollectiveSession, x):
        x = np.asarray(x)
        dtype = coll.working_dtype(None, x.dtype)
        fp = self._fingerprint(session, "allgather", dtype=dtype_name(x.dtype), shape=x.shape)
        bits = self._bit_types.get(dtype.itemsize)
        fits = bits is not None and x.size * session.size <= _MAX_COUNT
        comm = self._comm(session)
        with self.t.reading(session.timeout) as on_poll:
            self._agree(session, comm, fp, 0, on_poll)
            if fits:
                src = _flat(x, dtype)
                result = np.empty((session.size, *x.shape), dtype)
                flat = result.reshape(-1)
                self._wait(session, comm, fp, on_poll, [src, result],
                           lambda: comm.Iallgather([src.view(np.uint8), src.size, bits],
                                                   [flat.view(np.uint8), src.size, bits]))
        if not fits:
            return self._core("allgather", session, x)
        return result

    def broadcast(self, session: CollectiveSession, x, root: int = 0, algorithm: str = "auto"):
        root = coll.check_root(root, session.size)
        is_root = session.rank == root
        if is_root and x is None:
            raise ConfigurationError(f"broadcast: the root (rank {root}) must pass the array to send, not None")
        x = None if x is None else np.asarray(x)
        fp = self._fingerprint(session, "broadcast", root=root)
        comm = self._comm(session)
        header = np.zeros(_HEADER_BYTES, np.uint8)
        if is_root:
            work = x.astype(coll.working_dtype(None, x.dtype), order="C", copy=True)
            packed = msgpack.packb([dtype_name(x.dtype), list(x.shape)])
            header[:2] = np.frombuffer(len(packed).to_bytes(2, "little"), np.uint8)
            header[2:2 + len(packed)] = np.frombuffer(packed, np.uint8)
        with self.t.reading(session.timeout) as on_poll:
            self._agree(session, comm, fp, 0, on_poll)
            self._wait(session, comm, fp, on_poll, [header], lambda: comm.Ibcast([header, self.MPI.BYTE], root))
            length = int.from_bytes(header[:2].tobytes(), "little")
            name, shape = msgpack.unpackb(header[2:2 + length].tobytes(), raw=False)
            dtype, shape = DTYPES[name], tuple(shape)
            fp.update(dtype=name, shape=list(shape))
            wrong = x is not None and not is_root and (dtype_name(x.dtype) != name or x.shape != shape)
            self._agree_on_arguments(session, comm, fp, wrong, on_poll, x)
            count = int(np.prod(shape, dtype=np.int64))
            fits = count <= _MAX_COUNT
            if fits:
                if not is_root:
                    work = np.empty(shape, dtype)
                raw = work.reshape(-1).view(np.uint8)
                self._wait(session, comm, fp, on_poll, [work], lambda: comm.Ibcast(
                    [raw, count, self._bit_types[dtype.itemsize]], root))
        if not fits:
            return self._core("broadcast", session, x, root=root, algorithm=algorithm)
        return work

    def barrier(self, session: CollectiveSession) -> None:
        fp = self._fingerprint(session, "barrier")
        comm = self._comm(session)
        with self.t.reading(session.timeout) as on_poll:
            self._agree(session, comm, fp, 0, on_poll)

    # -- helpers ---------------------------------------------------------------------------------------
    def _plan(self, op: str, dtype: np.dtype, count: int) -> _Plan | None:
        """How MPI reduces ``dtype`` with ``op`` exactly and identically on every rank, or None."""
        MPI = self.MPI
        if count > _MAX_COUNT or dtype.byteorder == ">":
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

    def _fingerprint(self, session: CollectiveSession, collective: str, **fields) -> dict:
        # The Communicator already counted this call (session.seq).
        return {"seq": session.seq, **fingerprint(collective, **fields)}

    def _core(self, collective: str, session: CollectiveSession, x, **kwargs):
        """Core's algorithm for what MPI cannot do; it counts the call itself, so uncount it first."""
        session.seq -= 1
        return coll.ALGORITHMS[collective](session, x, **kwargs)

    def _comm(self, session: CollectiveSession):
        """The MPI communicator of ``session``'s members, made on the session's first collective."""
        comm = self._comms.get(session)
        if comm is not None:
            return comm
        # Creating it blocks until every member arrives, without a timeout: meet first (core's
        # barrier, over point-to-point, with the timeout, loss detection and mismatch checks).
        seq = session.seq
        session.seq -= 1
        try:
            coll.barrier(session)
        finally:
            session.seq = seq
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
        self._comms[session] = comm
        return comm

    def _agree(self, session: CollectiveSession, comm, fp: dict, flag, on_poll) -> int:
        """Check that every member makes this very call; returns the max of ``flag`` over the members."""
        digest = hashlib.blake2b(msgpack.packb(fp), digest_size=8).digest()
        h = int.from_bytes(digest, "little") >> 2
        mine = np.array([h, -h, int(flag)], np.int64)
        agreed = np.empty_like(mine)
        self._wait(session, comm, fp, on_poll, [mine, agreed],
                   lambda: comm.Iallreduce([mine, self.MPI.INT64_T], [agreed, self.MPI.INT64_T], self.MPI.MAX))
        if agreed[0] != -agreed[1]:
            raise self._mismatch(session, comm, fp, on_poll)
        return int(agreed[2])

    def _gather_texts(self, session, comm, fp, on_poll, text: str) -> list[str]:
        mine = np.zeros(_HEADER_BYTES, np.uint8)
        raw = text.encode()[:_HEADER_BYTES]
        mine[:len(raw)] = np.frombuffer(raw, np.uint8)
        every = np.empty((session.size, _HEADER_BYTES), np.uint8)
        self._wait(session, comm, fp, on_poll, [mine, every],
                   lambda: comm.Iallgather([mine, self.MPI.BYTE], [every, self.MPI.BYTE]))
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]

    def _mismatch(self, session, comm, fp, on_poll) -> CollectiveMismatchError:
        texts = self._gather_texts(session, comm, fp, on_poll, describe(fp))
        other = next((r for r, t in enumerate(texts) if t != texts[session.rank]), None)
        if other is None:  # the hashes differ although the descriptions agree: name the settings
            other = (session.rank + 1) % session.size
        message = (f"collective mismatch on communicator {session.name!r}: {session.who(other)} called "
                   f"{texts[other]}, but {session.who(session.rank)} called {texts[session.rank]}; every rank "
                   f"must make the same collective calls, in the same order, with the same op, dtype and shape")
        self._broken(session, comm, revoke=False)  # every member found it: nobody is left waiting
        return CollectiveMismatchError(message)

    def _agree_on_arguments(self, session, comm, fp, wrong: bool, on_poll, x) -> None:
        """Broadcast receivers that passed an array must match the root's dtype and shape."""
        mine = describe(fp) if not wrong else f"{fp['coll']}(root={fp['root']}, {x.dtype}, {tuple(x.shape)})"
        if self._agree_flag(session, comm, fp, wrong, on_poll):
            texts = self._gather_texts(session, comm, fp, on_poll, mine if wrong else "")
            bad = [r for r, t in enumerate(texts) if t]
            self._broken(session, comm, revoke=False)
            raise CollectiveMismatchError(
                f"collective mismatch on communicator {session.name!r}: in {describe(fp)}, "
                + "; ".join(f"{session.who(r)} passed an array for {texts[r]}" for r in bad)
                + f", which is not the root's {fp['dtype']} {tuple(fp['shape'])} (pass None, or an array "
                  f"of the root's dtype and shape)")

    def _agree_flag(self, session, comm, fp, flag: bool, on_poll) -> bool:
        mine, every = np.array([int(flag)], np.int64), np.empty(1, np.int64)
        self._wait(session, comm, fp, on_poll, [mine, every],
                   lambda: comm.Iallreduce([mine, self.MPI.INT64_T], [every, self.MPI.INT64_T], self.MPI.MAX))
        return bool(every[0])

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
            raise t.translate(exc, comm, peers, what) from None
        try:
            t.wait_requests([request], session.timeout, peers, what, comm=comm, on_poll=on_poll, eager=True)
        except BaseException as exc:
            # A dead member fails the call for every member by itself (ULFM); anything else (a timeout,
            # a peer that stopped answering) must be told to the others: revoke.
            self._broken(session, comm, revoke=not isinstance(exc, PeerLostError))
            t.abandon([request], keep)
            raise

    def _broken(self, session, comm, revoke: bool = True) -> None:
        """The session is unusable: revoke its MPI communicator (ULFM) so the other members fail too."""
        self._comms.pop(session, None)
        if not revoke:
            return
        try:
            with self.t.mpi_lock:
                comm.Revoke()
        except (NotImplementedError, AttributeError, self.MPI.Exception):
            pass
