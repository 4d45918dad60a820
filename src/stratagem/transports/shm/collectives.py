"""All-reduce straight through shared memory: the ``shm`` transport's native collective.

Core's ring all-reduce over any transport copies every byte into a ring, out of it into a buffer of
the receiver's, then reduces or copies that into the result: five passes over memory per byte a rank
sends. Here each member of a communicator owns an *arena* (a sealed memfd like a ring's, mapped by
every member) and, per call with sequence number ``k``:

1. *agrees*: sends every other member a tiny message under the call's fingerprint (core's
   :class:`~stratagem.collectives.session.CollectiveCall`: a member that called something else
   raises ``CollectiveMismatchError`` naming both calls) and receives theirs. A member sends it only
   after it finished the previous call, so receiving them all is also the barrier that makes the
   arenas free for this call. The message carries a new arena's token when a member had to grow its
   arena (handed over as rings are, :mod:`~stratagem.transports.shm.rendezvous`).
2. copies its input into its arena, except its own segment (which nobody else reads), and sets its
   ``in`` word to ``k``;
3. waits for every member's ``in`` to reach ``k``, then reduces its own segment over all members'
   contributions, in rank order, straight into the result, copies that segment into its arena and
   sets its ``out`` word to ``k``;
4. waits for every member's ``out``, and copies their segments into the result.

Each segment is reduced by one member and copied by the others, so every member ends with the same
bits. Three passes per byte sent instead of five, no per-chunk messages, no receive buffers.

Waiting polls the peers' words (short sleeps, growing to 1 ms), checking for lost peers and the
call's timeout, so a dead member raises ``PeerLostError`` naming it and a missing one
``TransportTimeout``; never a hang. A member's words are compared for equality-or-more with ``k``
only, and every arena is checked against the size the call needs, so a hostile peer cannot make us
read out of bounds. Calls this path does not take (device arrays, tensors under ``min_bytes``, an
explicit ``algorithm``) are declined before they run (:meth:`ShmCollectives.accepts_allreduce`) and run
core's algorithm, by the same choice on every member (the fingerprint differs between the two paths,
so members that disagree raise a mismatch instead of hanging).

Arena header words (in the region's first 4096 bytes, each on its own cache line): 64 ``in``,
128 ``out``.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np

from stratagem.collectives import algorithms as coll
from stratagem.collectives.session import CollectiveSession, fingerprint
from stratagem.core.errors import CollectiveMismatchError, PeerLostError, TransportClosed, TransportTimeout
from stratagem.core.transport import NativeCollective
from stratagem.core.wire import dtype_name
from stratagem.transports.shm.rendezvous import TOKEN_BYTES, offer, socket_address
from stratagem.transports.shm.ring import MAX_CAPACITY, MIN_CAPACITY, Region, RingError, fence

_IN, _OUT = 64, 128
#: Default smallest all-reduce run here. Smaller ones run core's ring over the rings, which is as fast
#: there (its pipelined copies stay in cache; measured on 2 cores); from about this size on, the
#: arenas' fewer passes over memory win.
NATIVE_MIN_BYTES = 8 << 20
_OFFER_WAIT = 5.0
_MAX_SLEEP = 1e-3


class _Arenas:
    """One communicator's arenas: ours, and every other member's (mapped)."""

    def __init__(self):
        self.mine: Region | None = None
        self.peers: dict[int, Region] = {}
        self.lock = threading.Lock()  # held by the running call (a communicator runs one at a time)

    def close(self) -> None:
        for region in [self.mine, *self.peers.values()]:
            if region is not None:
                region.close()
        self.mine, self.peers = None, {}


class ShmCollectives:
    """The native collectives of one :class:`~stratagem.transports.shm.transport.ShmTransport`.

    ``take_offer(token, wait)``: the transport's listener, taking the memfd a peer offered on our
    socket under ``token`` (``(connection, fd, capacity)``, or None if none came within ``wait`` s)."""

    def __init__(self, transport, take_offer, min_bytes: int = NATIVE_MIN_BYTES):
        self.transport = transport
        self.take_offer = take_offer
        self.min_bytes = min_bytes
        self._arenas: "weakref.WeakKeyDictionary[CollectiveSession, _Arenas]" = weakref.WeakKeyDictionary()

    def table(self) -> dict:
        return {"allreduce": NativeCollective(self.allreduce, self.accepts_allreduce)}

    def close(self) -> None:
        for arenas in list(self._arenas.values()):
            # A running call sees the close within 10 ms, fails, and unmaps its arenas itself.
            if arenas.lock.acquire(timeout=5):
                try:
                    arenas.close()
                finally:
                    arenas.lock.release()
        self._arenas.clear()

    def peer_lost(self, task) -> None:
        """Unmap ``task``'s arenas (any thread; never blocks). A running call that uses them fails
        on its own (it watches for lost peers), then unmaps all of its communicator's."""
        for session, arenas in list(self._arenas.items()):
            if not arenas.lock.acquire(blocking=False):
                continue
            try:
                for rank, region in list(arenas.peers.items()):
                    if session.members[rank] == task:
                        region.close()
                        del arenas.peers[rank]
            finally:
                arenas.lock.release()

    def accepts_allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto",
                          out=None) -> bool:
        """Whether the arenas take this all-reduce: the same choice on every member, from what the
        fingerprint covers. A communicator with a member on another host (``remote="zmq"``) has no
        shared arena: every member sees one and declines alike."""
        if coll.is_device_array(x):
            return False
        x = coll.as_array(x)   # checked by the communicator already (this is on every step's path)
        nbytes = x.size * coll.working_dtype(op, x.dtype).itemsize
        return not (algorithm != "auto" or session.size < 2 or nbytes < self.min_bytes or x.size < session.size
                    or nbytes > MAX_CAPACITY or not self.transport.ring_peers.issuperset(session.members))

    def allreduce(self, session: CollectiveSession, x, op: str = "sum", algorithm: str = "auto", out=None):
        x = coll.as_array(x)
        dtype = coll.check_allreduce(x, op, algorithm, out)
        nbytes = x.size * dtype.itemsize
        fp = fingerprint("allreduce", op=op, dtype=dtype_name(x.dtype), shape=x.shape, algo="shm")
        src = x.reshape(-1) if x.dtype == dtype and x.flags.c_contiguous else x.astype(dtype).reshape(-1)
        work = np.empty(x.size, dtype=dtype) if out is None else out.reshape(-1)
        arenas = self._arenas.get(session)
        if arenas is None:
            arenas = self._arenas[session] = _Arenas()
        with arenas.lock, session.current(fp) as call:
            try:
                self._agree(session, call, arenas, nbytes)
                self._run(session, call.fp["seq"], arenas, src, work, coll.OPS[op], dtype, out is x)
            except BaseException:
                # The communicator is broken now (peers may be mid-call): its arenas go at once.
                self._arenas.pop(session, None)
                arenas.close()
                raise
        if op == "mean":
            np.true_divide(work, work.dtype.type(session.size), out=work)
        return work.reshape(x.shape) if out is None else out

    # -- step 1: agree, and hand over arenas that had to grow ----------------------------------------
    def _agree(self, session: CollectiveSession, call, arenas: _Arenas, nbytes: int) -> None:
        t = self.transport
        grown = None
        if arenas.mine is None or arenas.mine.capacity < nbytes:
            capacity = min(MAX_CAPACITY, max(MIN_CAPACITY, 1 << (nbytes - 1).bit_length()))
            grown = Region.create(f"{t.cluster.cluster_id[:8]}:{t.task.short}:arena", capacity)
        token = os.urandom(TOKEN_BYTES) if grown is not None else bytes(TOKEN_BYTES)
        note = np.frombuffer(token + np.array([0 if grown is None else grown.capacity], np.uint64).tobytes(),
                             dtype=np.uint64)
        try:
            for rank, member in enumerate(session.members):
                if rank == session.rank:
                    continue
                if grown is not None:
                    offer(socket_address(t.cluster.cluster_id, member), token, grown.capacity, grown.fd,
                          session.timeout, who=str(member)).close()
                call.send(rank, note)
            notes = {rank: call.recv(rank, len(note), np.uint64) for rank in range(session.size) if rank != session.rank}
        except BaseException:
            if grown is not None:
                grown.close()
            raise
        # Everyone has finished the previous call (they agree only after it), so no one reads the
        # old arenas any more.
        if grown is not None:
            grown.close_fd()
            if arenas.mine is not None:
                arenas.mine.close()
            arenas.mine = grown
        for rank, theirs in notes.items():
            capacity = int(theirs[-1])
            if capacity:
                old = arenas.peers.pop(rank, None)
                if old is not None:
                    old.close()
                arenas.peers[rank] = self._attach(session, rank, theirs[:-1].tobytes(), capacity)
            region = arenas.peers.get(rank)
            if region is None or region.capacity < nbytes:
                raise CollectiveMismatchError(
                    f"{session.who(rank)} has no shared-memory arena of {nbytes} bytes for {session.name!r}")

    def _attach(self, session: CollectiveSession, rank: int, token: bytes, capacity: int) -> Region:
        taken = self.take_offer(token, _OFFER_WAIT)
        member = session.members[rank]
        if taken is None:
            raise PeerLostError(member, f"{member} announced a shared-memory arena that never reached our socket")
        conn, fd, offered = taken
        conn.close()
        try:
            if offered != capacity:
                raise RingError(f"the offer says {offered} bytes, the announcement {capacity}")
            return Region.attach(fd, capacity)
        except (RingError, OSError, ValueError) as exc:
            raise PeerLostError(member, f"{member} handed over an unusable shared-memory arena: {exc}") from None
        finally:
            os.close(fd)

    # -- steps 2-4: through the arenas ---------------------------------------------------------------
    def _run(self, session: CollectiveSession, seq: int, arenas: _Arenas, src, work, ufunc, dtype,
             in_place: bool = False) -> None:
        """Steps 2-4. ``in_place``: ``src`` and ``work`` are the same memory (``out=x``). Nobody reads
        ``src`` but us (the others read our arena), and the segment we reduce is read before or as it
        is written, except by rank 2 on: the first reductions write our segment before our own
        operand is added (rank order), so that rank copies its segment too into its arena (where
        nobody reads it before step 4, which reads the result written over it) and adds it from there."""
        n, me = session.size, session.rank
        bounds = coll.split_bounds(src.size, n)
        nbytes = src.size * dtype.itemsize
        # Views of the arenas live only in ``views``, emptied on the way out: a view kept alive (by
        # the traceback of an error, say) would keep its arena mapped after a failure unmaps it.
        views = {rank: region.data[:nbytes].view(dtype) for rank, region in arenas.peers.items()}
        views[me] = arenas.mine.data[:nbytes].view(dtype)
        parts: list = []
        try:
            lo, hi = bounds[me], bounds[me + 1]
            late_in_place = in_place and me >= 2
            if late_in_place:
                views[me][:] = src
            else:
                views[me][:lo] = src[:lo]
                views[me][hi:] = src[hi:]
            fence()
            arenas.mine.store(_IN, seq)
            self._wait(session, arenas, _IN, seq, "copy its input into shared memory")
            result = work[lo:hi]
            own = views[me][lo:hi] if late_in_place else src[lo:hi]
            parts.extend(own if rank == me else views[rank][lo:hi] for rank in range(n))
            ufunc(parts[0], parts[1], out=result)
            for i in range(2, n):
                ufunc(result, parts[i], out=result)
            views[me][lo:hi] = result
            fence()
            arenas.mine.store(_OUT, seq)
            self._wait(session, arenas, _OUT, seq, "reduce its segment")
            for rank in range(n):
                if rank != me:
                    a, b = bounds[rank], bounds[rank + 1]
                    work[a:b] = views[rank][a:b]
        finally:
            views.clear()
            parts.clear()

    def _wait(self, session: CollectiveSession, arenas: _Arenas, word: int, seq: int, what: str) -> None:
        """Until every other member's ``word`` reaches ``seq``: a lost member, a close or the timeout raise."""
        t = self.transport
        deadline = None if session.timeout is None else time.monotonic() + session.timeout
        pending = dict(arenas.peers)
        sleep, checked = 0.0, time.monotonic()
        while True:
            pending = {rank: region for rank, region in pending.items() if region.load(word) < seq}
            if not pending:
                fence()
                return
            now = time.monotonic()
            if now - checked > 0.01:  # the slower checks, a hundred times a second
                checked = now
                if t.closed:
                    raise TransportClosed(f"{t.task}: transport closed during an all-reduce")
                for rank in pending:
                    reason = t.lost_peers().get(session.members[rank])
                    if reason is not None:
                        raise PeerLostError(session.members[rank], reason)
                if deadline is not None and now > deadline:
                    who = ", ".join(session.who(rank) for rank in pending)
                    raise TransportTimeout(f"{t.task}: all-reduce #{seq} on {session.name!r}: {who} did not "
                                           f"{what} within {session.timeout:g} s")
            time.sleep(sleep)
            sleep = min(_MAX_SLEEP, sleep * 2 or 2e-5)
