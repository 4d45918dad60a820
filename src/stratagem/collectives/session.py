"""How one collective call talks: its fingerprint, its messages, and what happens when it fails.

Every message of a collective carries the call's *fingerprint* (sequence number, collective, op,
dtype, shape and algorithm settings) under the communicator's single tag, packed once per call
(msgpack bytes). A receiver compares it with its own (one comparison of bytes; the fields are read
only when they differ) and raises :class:`CollectiveMismatchError` naming both sides instead of hanging or reducing
garbage. A rank that fails a call sends an *abort* notice to every other rank so they raise the same
kind of error now instead of at their timeout. The algorithms (``collectives.py``) only call
:meth:`CollectiveCall.send`, ``send_async`` and ``recv``.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import msgpack
import numpy as np

from stratagem.collectives.results import ResultMemory
from stratagem.core.cluster import TaskId, host_of
from stratagem.core.errors import CollectiveMismatchError, CommunicationError, PeerLostError, TransportTimeout
from stratagem.core.transport import Message, SendHandle, Transport

log = logging.getLogger(__name__)

#: Abort notices are best-effort: never wait long on a peer that may itself be the problem.
ABORT_SEND_TIMEOUT = 2.0
#: An elastic session's receive looks at the peer's loss count at least this often (seconds).
WATCH_SECONDS = 0.25


def fingerprint(collective: str, **fields) -> dict:
    """Plain-data description of one call (lists, not tuples: the wire turns tuples into lists)."""
    fp = {"coll": collective, **fields}
    shape = fields.get("shape")
    if shape is not None:
        fp["shape"] = [int(d) for d in shape]
    return fp


def pack_fingerprint(fp: dict) -> bytes:
    """The fingerprint as it travels: packed once per call, so that a receiver checks each message
    with one comparison of bytes (and the wire checks one bytes value, not a dict)."""
    return msgpack.packb(fp, use_bin_type=True)


def unpack_fingerprint(data) -> dict | None:
    """A received fingerprint as a dict, or None if it is not one (only read when the bytes differ
    from ours: the mismatch is then described from it)."""
    if isinstance(data, dict):
        return data
    if not isinstance(data, (bytes, bytearray)):
        return None
    try:
        fp = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception:  # garbage from a peer means "no fingerprint", never a crash
        return None
    return fp if isinstance(fp, dict) else None


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

    ``generation`` (elastic communicators, :mod:`stratagem.collectives.elastic`): the number of this
    membership. It is part of every fingerprint, and a message of an older generation (the rest of a
    ring that a lost peer broke, an abort notice about it) is discarded, never reduced. A receive then
    also watches the transport's count of the peer's losses (``peer_losses``, read when the generation
    began): a transport accepts a restarted process as the same peer, so without it a member could wait
    forever on a process that died and was replaced before anyone noticed.
    """

    def __init__(self, transport: Transport, members: Sequence[TaskId], rank: int, *, name: str,
                 timeout: float | None, chunk_bytes: int, small_bytes: int, generation: int | None = None):
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
        #: Per-call work that depends only on the call's arguments, kept by the algorithms
        #: (``collectives.algorithms._allreduce_plan``).
        self.plans: dict = {}
        #: Memory for large all-reduce results, used again once the caller dropped them.
        self.results = ResultMemory()
        self.generation = generation
        #: Each member's loss count when this generation began (elastic sessions only).
        self.losses = {} if generation is None else {m: transport.peer_losses(m) for m in self.members}
        #: True when the members' cluster addresses name more than one host (the same on every rank:
        #: it depends on the cluster only). ``auto`` then keeps to the ring for large all-reduces.
        self.spans_hosts = len(_hosts_of(transport, self.members)) > 1

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

    def collective(self, fingerprint: dict, learn: Sequence[str] = ()) -> "_Running":
        """Run one collective call (``with session.collective(fp) as call:``): number it, and on
        failure break the session and warn the peers."""
        self.seq += 1
        return self.current(fingerprint, learn)

    def current(self, fingerprint: dict, learn: Sequence[str] = ()) -> "_Running":
        """Run the call numbered last (``session.seq``) as :meth:`collective` runs a new one: what a
        native collective uses, the communicator having numbered its call already."""
        fp = {"seq": self.seq, **fingerprint}
        if self.generation is not None:
            fp["gen"] = self.generation
        return _Running(self, CollectiveCall(self, fp, learn))

    def abort(self, call: "CollectiveCall", error: Exception) -> None:
        """``call`` failed with ``error``: the session is broken from now on (``broken``), and every other
        rank is told (:meth:`_notify_peers`), so that it fails now rather than at its timeout."""
        self.broken = error
        self._notify_peers(call, error)

    def _notify_peers(self, call: "CollectiveCall", exc: Exception) -> None:
        """Best-effort abort notice to every other rank, so they fail now instead of at their timeout.

        Ranks that receive one pass it on (the rank waiting on *them* may not hear from the origin),
        so the notice spreads along every wait chain.
        """
        meta = getattr(exc, "abort_meta", None) or _abort_meta(self, call, exc)
        skip = {self.rank, meta.get("origin")}
        lost = set(self.transport.lost_peers())
        if meta.get("task"):
            lost.add(TaskId.parse(meta["task"]))
        told = []
        for rank, task in enumerate(self.members):
            if rank in skip or task in lost:
                continue
            try:
                self.transport.send(task, self.tag, Message(dict(meta)), timeout=ABORT_SEND_TIMEOUT)
                told.append(task)
            except Exception as send_error:  # best effort: the peer may be the one that is gone
                log.debug("%s: could not send abort notice to %s: %s", self.tag, task, send_error)
        # The error is raised next, and a script that does not catch it ends: a notice still queued
        # in this process would die with it, and its receiver would blame this rank's exit instead.
        try:
            self.transport.flush(ABORT_SEND_TIMEOUT, told)
        except Exception as flush_error:
            log.debug("%s: could not flush the abort notices: %s", self.tag, flush_error)


class _Running:
    """The context of one call (a class, not a generator-based context manager: it is entered on
    every collective, and this costs a fraction of one)."""

    __slots__ = ("session", "call")

    def __init__(self, session: CollectiveSession, call: "CollectiveCall"):
        self.session, self.call = session, call

    def __enter__(self) -> "CollectiveCall":
        return self.call

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception):
            error = exc
            if isinstance(exc, PeerLostError) and not hasattr(exc, "abort_meta"):
                error = self.call.last_words(exc)
            self.session.abort(self.call, error)
            if error is not exc:
                raise error from exc
        return False


def _abort_meta(session: CollectiveSession, call: "CollectiveCall", exc: Exception) -> dict:
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
    if kind != "lost" and isinstance(origin, int) and 0 <= origin < session.size:
        # The rank that failed the call first (a lost peer's error blames that peer instead): what
        # this rank's failure report tells the launcher (stratagem.core.failures).
        error.culprit = session.members[origin]
    return error


class CollectiveCall:
    """One collective call in progress: sends and receives under its fingerprint.

    ``learn`` names fingerprint fields this rank does not know yet (a broadcast receiver that passed
    no array); they are adopted from the first message instead of compared.
    """

    def __init__(self, session: CollectiveSession, fp: dict, learn: Sequence[str] = ()):
        self.session = session
        self.fp = fp
        self._learn = set(learn)
        self._pending: dict[int, Message] = {}
        self._meta: dict | None = None   # {"fp": packed fingerprint}, made on the first send/receive
        #: Chunk size (elements) imposed by another rank (a broadcast's root); None: our own option.
        self.chunk: int | None = None
        self._partial_forms: frozenset = frozenset()   # agreement fingerprints accepted as they are

    @property
    def meta(self) -> dict:
        """The metadata of every message of this call (never modified once made: shared by them)."""
        meta = self._meta
        if meta is None:
            meta = self._meta = {"fp": pack_fingerprint(self.fp)}
        return meta

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
        meta = self._meta
        if meta is None:
            meta = self.meta
        s.transport.send(s.members[dst], s.tag, Message(meta, list(buffers)), timeout=s.timeout)

    def send_async(self, dst: int, *buffers) -> SendHandle:
        """Send, possibly still reading the buffers after returning: ``wait()`` before modifying them."""
        s = self.session
        return s.transport.send_async(s.members[dst], s.tag, Message(self.meta, list(buffers)),
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

    def expect_partial(self, *lacking: Sequence[str]) -> None:
        """Say which agreement messages are expected (:meth:`agree`): ours, without each of the given
        sets of fields (None there). Those are accepted with one comparison of bytes, the others are
        compared field by field."""
        self._partial_forms = frozenset(pack_fingerprint({**self.fp, **dict.fromkeys(fields)}) for fields in lacking)

    def agree(self, src: int) -> None:
        """Receive ``src``'s agreement message: a bufferless one saying which call it makes, sent as it
        entered the call, so some fields may still be unknown to it (None: a broadcast receiver that
        passed no array knows neither dtype nor shape, and no receiver knows the root's algorithm).
        The fields it gives must be ours, else :class:`CollectiveMismatchError`."""
        message = self._pending.pop(src, None) or self._receive(src, partial=True)
        if message.buffers:
            raise self._mismatch(src, f"sent {len(message.buffers)} buffers where an agreement (none) was expected")

    def last_words(self, lost: PeerLostError) -> Exception:
        """The error to raise for a lost peer: the abort notice it queued before it went, if any.

        A rank that fails a call tells the others why, then its script ends; a rank that meets its
        departure first (a send to it fails) would otherwise blame it instead of the member it lost.
        """
        s = self.session
        try:
            task = TaskId.parse(lost.task) if isinstance(lost.task, (str, TaskId)) else None
        except ValueError:
            return lost
        if task is None or task not in s.members:
            return lost
        while True:
            try:
                message = s.transport.recv(task, s.tag, timeout=0)
            except Exception:  # noqa: BLE001 - nothing (more) left from it: its loss is the error
                return lost
            if "abort" in message.meta:
                return _error_from_abort(s, message.meta)

    def _receive(self, src: int, partial: bool = False) -> Message:
        """``src``'s next message, its fingerprint checked (``partial``: fields it gives as None are
        ones it does not know yet, see :meth:`agree`)."""
        s = self.session
        if s.generation is None:
            message = s.transport.recv(s.members[src], s.tag, timeout=s.timeout)
        else:
            message = self._receive_current(src)
        meta = message.meta
        theirs = meta.get("fp")
        mine = self._meta
        if theirs is None or theirs != (self.meta if mine is None else mine)["fp"]:  # the same bytes: the same call (the usual case)
            if partial and theirs in self._partial_forms:
                return message
            if "abort" in meta:
                raise _error_from_abort(s, meta)
            self._check_fingerprint(src, unpack_fingerprint(theirs), partial)
        return message

    def _receive_current(self, src: int) -> Message:
        """An elastic session's receive: messages of older generations are dropped, and the wait ends
        with ``PeerLostError`` once the transport has declared ``src`` lost since the generation began."""
        s = self.session
        task = s.members[src]
        deadline = None if s.timeout is None else time.monotonic() + s.timeout
        while True:
            # A lost peer's last messages (an abort notice naming the member *it* lost) are still
            # read: they say more than its loss does. Only an empty queue turns the loss into the error.
            lost = s.transport.peer_losses(task) != s.losses.get(task, 0)
            remaining = None if deadline is None else deadline - time.monotonic()
            if not lost and remaining is not None and remaining <= 0:
                raise TransportTimeout(f"{s.transport.task}: no message {s.tag!r} from {task} within "
                                       f"{s.timeout:g} s (is that task running and calling the same operation?)")
            wait = 0 if lost else WATCH_SECONDS if remaining is None else min(WATCH_SECONDS, remaining)
            try:
                message = s.transport.recv(task, s.tag, timeout=wait)
            except (TransportTimeout, PeerLostError) as exc:
                if lost or isinstance(exc, PeerLostError):
                    raise PeerLostError(task, f"{task} was lost while {s.who(s.rank)} waited for it in "
                                              f"{describe(self.fp)} (a new process may have taken its place)"
                                        ) from None
                continue
            fp = unpack_fingerprint(message.meta.get("fp"))
            gen = fp.get("gen") if fp is not None else None
            if not (isinstance(gen, int) and gen < s.generation):
                return message   # older generations' leftovers are dropped: never reduced

    def _check_fingerprint(self, src: int, theirs: dict | None, partial: bool = False) -> None:
        s = self.session
        if not isinstance(theirs, dict):
            raise CollectiveMismatchError(
                f"{s.who(src)} sent a message without a collective fingerprint on tag {s.tag!r} of "
                f"communicator {s.name!r}: something else uses this tag; give each communicator its own name"
            )
        mine = self.fp
        differs = [k for k in set(mine) | set(theirs) if k not in self._learn and mine.get(k) != theirs.get(k)
                   and not (partial and k in theirs and theirs[k] is None)]
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
        if self._learn and not partial:
            for key in self._learn:
                mine[key] = theirs.get(key)
            self._learn.clear()
            self._meta = None  # what we learned goes into our own messages from now on

    def _mismatch(self, src: int, what: str) -> CollectiveMismatchError:
        s = self.session
        return CollectiveMismatchError(
            f"collective mismatch on communicator {s.name!r}: in {describe(self.fp)}, {s.who(src)} {what} "
            f"(by {s.who(s.rank)})"
        )


def _hosts_of(transport: Transport, members: Sequence[TaskId]) -> set[str]:
    """The hosts named by ``members``' cluster addresses (the part before the port, as written);
    members without an address (a cluster from an MPI world) name none."""
    cluster = getattr(transport, "cluster", None)
    if cluster is None:
        return set()
    hosts = set()
    for member in members:
        try:
            address = cluster.address(member)
        except Exception:  # noqa: BLE001 - a member the cluster cannot place names no host
            address = None
        if address:
            hosts.add(host_of(address))
    return hosts

