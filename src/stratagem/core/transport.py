"""The transport contract: the smallest thing every transport can provide well (README: "Transports").

Mailbox semantics. A task sends a :class:`Message` to a peer under a string *tag*; the peer receives
it with ``recv(src, tag)``. Delivery is reliable and ordered per ``(src, dst, tag)``; ``src=None``
receives from any peer, in arrival order. Every blocking call takes a timeout, and a peer that is
gone raises :class:`~stratagem.core.errors.PeerLostError` naming it, never a hang.

Collectives, strategies and the parameter-server service are written once over this contract;
a transport only moves messages (and may offer faster native collectives).

Example (two endpoints of the in-process transport)::

    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec, TaskId
    >>> from stratagem.transports.local import LocalTransport
    >>> cluster = ClusterSpec({"worker": ["local:1", "local:2"]})
    >>> opts = LocalTransport.world_options()
    >>> a = LocalTransport(cluster, TaskId("worker", 0), **opts); a.start()
    >>> b = LocalTransport(cluster, TaskId("worker", 1), **opts); b.start()
    >>> a.send(TaskId("worker", 1), "greeting", Message({"step": 1}, [np.arange(3)]))
    >>> m = b.recv(TaskId("worker", 0), "greeting", timeout=5)
    >>> m.meta["step"], m.buffers[0].tolist(), str(m.src)
    (1, [0, 1, 2], '/job:worker/task:0')
    >>> a.close(); b.close()
"""

from __future__ import annotations

import abc
import copy
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, TypeVar

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError, PeerLostError, TransportClosed
from stratagem.core.lifecycle import end_at_exit
from stratagem.core.options import peer_timeout_from_env
from stratagem.core.timeline import OFF, NullRecorder, Recorder
from stratagem.core.traffic import Traffic
from stratagem.core.wire import Limits

log = logging.getLogger(__name__)

#: Default seconds a blocking call waits before raising ``TransportTimeout``.
DEFAULT_TIMEOUT = 300.0
#: Default seconds of silence after which a connected peer is declared lost (``STRATAGEM_PEER_TIMEOUT``
#: in the environment replaces it for every transport that is given none).
DEFAULT_PEER_TIMEOUT = 30.0

_Peer = TypeVar("_Peer")


@dataclass
class Message:
    """Small metadata (a dict of plain values: str, int, float, bool, None, bytes, lists, dicts)
    plus a list of array buffers (numpy, or cupy where the transport carries device memory).

    ``src`` is filled in by ``recv`` with the task the message came from. Lists come back as lists
    (tuples in ``meta`` arrive as lists).
    """

    meta: dict = field(default_factory=dict)
    buffers: list = field(default_factory=list)
    src: TaskId | None = None

    @property
    def nbytes(self) -> int:
        total = 0
        for b in self.buffers:
            total += int(b.nbytes)
        return total

    def delivered_copy(self, src: TaskId) -> "Message":
        """A copy as delivered to a mailbox from ``src``: the sender may reuse its buffers at once
        (used for in-process delivery, and by every transport for a task sending to itself)."""
        return Message(copy.deepcopy(self.meta), [b.copy() for b in self.buffers], src)


class SendHandle:
    """The completion of :meth:`Transport.send_async`: ``wait()`` returns once the buffers may be reused."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the message's buffers may be reused (raises ``TransportTimeout`` on timeout)."""

    def done(self) -> bool:
        return True


#: The handle of a send that completed before it returned.
COMPLETED = SendHandle()


@dataclass(frozen=True)
class NativeCollective:
    """A transport's own implementation of one collective (as Horovod's operation manager asks each
    backend op whether it enabled a call, before it runs).

    ``run(session, x, **kwargs)`` has the signature of the core algorithm it replaces
    (:mod:`stratagem.collectives.algorithms`) and keeps its semantics. ``accepts(session, x, **kwargs)``
    (``None``: every call) decides, before anything moves, whether ``run`` takes the call; core's
    algorithm runs it otherwise. It must decide from what the call's fingerprint covers (collective,
    op, dtype, shape, options) and the transport's fixed state, so that every member decides alike,
    and must not communicate. The communicator numbers the call before ``run``: a native names it
    ``session.seq`` and opens it with ``session.current(fingerprint)``, never renumbering it.
    """

    run: Callable
    accepts: Callable | None = None

    def takes(self, session, x, kwargs: Mapping[str, Any]) -> bool:
        """Whether ``run`` takes this call (see the class doc)."""
        return self.accepts is None or bool(self.accepts(session, x, **kwargs))


class Transport(abc.ABC):
    """Base class of every transport plugin.

    Subclasses implement :meth:`start`, :meth:`_shutdown`, :meth:`send` and :meth:`recv`; they may
    override :meth:`native_collectives`. :meth:`close` and :meth:`abort` are this class's: each ends
    the transport once (``_shutdown(graceful)``), whichever comes first and from whatever thread. Construct with the cluster and this task; options that a
    transport does not know are refused with the list of those it does.

    Args:
        cluster: the cluster this task belongs to.
        task: this process's task.
        secret: the cluster secret (bytes). When set, every connection is authenticated with an
            HMAC challenge-response and a peer that fails it is refused.
        timeout: default seconds a blocking call waits (``send``/``recv`` take their own too).
        peer_timeout: seconds of silence after which a connected peer is declared lost, on every
            transport alike: measured from the last thing heard from the peer, never sooner, and
            declared soon after (over zmq, grpc and shm within a tenth of it plus a few tenths of a
            second). Heartbeats keep a healthy peer heard; the transport's own threads send them
            (ZeroMQ's and gRPC's I/O threads, MPI's progress thread), never the user's step, so a
            long compute step is not a silence, nor is a pause shorter than this (a GC pause).
            Default: ``STRATAGEM_PEER_TIMEOUT`` from the environment, else 30 s.
        limits: the wire limits (frame and metadata sizes) enforced on received frames.
        recorder: where this task's timeline events go (:mod:`stratagem.core.timeline`): everything
            that runs on the transport records through ``transport.recorder``. The transport factory
            hands the process's (``STRATAGEM_TIMELINE``); default: ``timeline.OFF``, which records
            nothing. A path that cannot be written is refused here, before anything starts.
    """

    #: Registered short name (``zmq``, ``local``...).
    name: ClassVar[str] = "abstract"
    #: True if buffers may be device (cupy) arrays that stay on the device.
    device_buffers: ClassVar[bool] = False
    #: True if all endpoints of a world must live in one process (the ``local`` transport).
    in_process: ClassVar[bool] = False
    #: True if a world over it may change (elastic training, ``on_failure="shrink"``): a dead peer
    #: is reported as ``PeerLostError``, and a new process for a lost task is accepted as that peer.
    elastic: ClassVar[bool] = False
    #: The largest buffer that arrives as it was sent, without a copy (``None``: any size). A larger
    #: one is received in parts and joined. A parameter server keeps its pieces within it.
    whole_buffer_bytes: ClassVar[int | None] = None

    def __init__(self, cluster: ClusterSpec, task: TaskId | str, *, secret: bytes | str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, peer_timeout: float | None = None,
                 limits: Limits | None = None, recorder: Recorder | NullRecorder | None = None):
        if recorder is not None and not isinstance(recorder, (Recorder, NullRecorder)):
            raise ConfigurationError(f"recorder must be a stratagem.core.timeline.Recorder (or timeline.OFF), "
                                     f"not {type(recorder).__name__}")
        #: This task's timeline recorder (see the class doc), :data:`~stratagem.core.timeline.OFF` if none.
        self.recorder = OFF if recorder is None else recorder
        self.recorder.check()   # an unwritable STRATAGEM_TIMELINE fails now, not at exit
        self.cluster = ClusterSpec(cluster)
        self.task = self.cluster.check(TaskId.parse(task))
        if isinstance(secret, str):
            secret = secret.encode()
        self.secret: bytes | None = secret or None
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(f"timeout must be > 0 seconds, got {timeout}")
        if peer_timeout is None:
            peer_timeout = peer_timeout_from_env() or DEFAULT_PEER_TIMEOUT
        if not peer_timeout > 0:
            raise ConfigurationError(f"peer_timeout must be > 0 seconds, got {peer_timeout}")
        self.timeout = timeout
        self.peer_timeout = float(peer_timeout)
        self.limits = limits or Limits()
        #: Payload bytes and messages moved, per peer (see :mod:`stratagem.core.traffic`).
        self.traffic = Traffic()
        self._closed = False                     # set once, by the first close() or abort()
        self._closed_lock = threading.Lock()
        # A script that never closes its transport still ends cleanly (stratagem.core.lifecycle).
        end_at_exit(self)

    # -- construction helpers ----------------------------------------------------------------------
    @classmethod
    def world_options(cls) -> dict[str, Any]:
        """Extra constructor options that make several endpoints in one process form one world.

        Socket transports need none (each endpoint binds its own address); the in-process transport
        returns a fresh shared fabric. Used by tests and by single-process multi-replica runs.
        """
        return {}

    @classmethod
    def check_usable(cls) -> None:
        """Raise ``PluginError`` with the reason and the install hint if this transport cannot run here."""

    # -- lifecycle ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Bind this task's address and start serving. Idempotent."""

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`abort` ran."""
        return self._closed

    def close(self) -> None:
        """Tell peers we are leaving, release every resource, and wake blocked callers. Idempotent:
        a second call, or a call after :meth:`abort`, does nothing."""
        self._end(graceful=True)

    def abort(self) -> None:
        """Stop abruptly, as a crash would (no goodbye to peers). Used by failure tests. Idempotent,
        like :meth:`close`."""
        self._end(graceful=False)

    def _end(self, graceful: bool) -> None:
        with self._closed_lock:
            if self._closed:
                return
            self._closed = True
        # Outside the lock: a shutdown joins threads that may themselves call close() (a no-op then).
        self._shutdown(graceful)

    @abc.abstractmethod
    def _shutdown(self, graceful: bool) -> None:
        """End the transport, once (``_closed`` is already set): with ``graceful``, say goodbye to
        peers and let queued messages go first; else drop everything at once, as a crash would.
        Called even if the transport never started."""

    def end_with_script(self, error: str | None) -> None:
        """End the way the script ended: called once at interpreter exit if still open
        (:mod:`stratagem.core.lifecycle`; ``error``: the uncaught exception ending the script, or
        ``None``), and by a strategy that leaves after a failure with the transport it owns.

        Closes, however the script ended: the goodbye tells every peer at once that this task is gone
        (a collective waiting on it raises ``PeerLostError`` naming it), and unlike ``abort()`` it first
        delivers what is queued, such as the abort notices a failed collective sends to the other
        members, which name the culprit. A transport that must do more overrides it (``mpi`` ends the
        process after a failure: MPI_Finalize would wait for the other ranks). It was called
        ``_end_at_exit`` before; a subclass that still overrides that name is refused when constructed,
        with the fix."""
        self.close()

    def __enter__(self) -> "Transport":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- messaging ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, dst: TaskId, tag: str, msg: Message, timeout: float | None = None) -> None:
        """Queue ``msg`` for ``dst`` under ``tag``.

        Returns once the message's buffers may be reused by the caller (not necessarily delivered).
        Raises ``PeerLostError(dst)`` if ``dst`` is known to be gone, ``TransportTimeout`` if the
        message cannot be queued within ``timeout``.
        """

    def send_async(self, dst: TaskId, tag: str, msg: Message, timeout: float | None = None) -> SendHandle:
        """Like :meth:`send`, but may return while the transport still reads the buffers; call
        ``wait()`` on the returned handle before modifying them. Lets a pipelined algorithm keep
        several sends in flight. The default is a blocking ``send``."""
        self.send(dst, tag, msg, timeout)
        return COMPLETED

    @abc.abstractmethod
    def recv(self, src: TaskId | None, tag: str, timeout: float | None = None) -> Message:
        """Wait for the next message under ``tag`` from ``src`` (any peer if ``None``).

        The message's buffers belong to the receiver: no other task, and not the transport, reads
        or writes them any more (a receiver may keep them, e.g. as a variable's storage). Buffers
        may be read-only (a transport that decodes from immutable bytes).

        Messages already delivered are returned even if their sender has died since. Raises
        ``PeerLostError(src)`` when ``src`` is gone and nothing from it is pending,
        ``TransportTimeout`` after ``timeout`` seconds (default: the transport's), ``TransportClosed``
        if the transport is closed while waiting.
        """

    def native_collectives(self) -> Mapping[str, "NativeCollective"]:
        """Faster collective implementations this transport has natively (MPI, NCCL, shared memory).

        Maps a collective name (``allreduce``, ``broadcast``, ``allgather``, ``reduce_scatter``,
        ``barrier``) to a :class:`NativeCollective`, which says whether it takes a call before it
        runs. Core's algorithms run whatever is missing or declined.
        """
        return {}

    def lost_peers(self) -> dict[TaskId, str]:
        """Peers known to be gone, with the reason."""
        return {}

    def peer_losses(self, task: TaskId) -> int:
        """How many times ``task`` was declared lost, even if a new process of it was accepted since
        (a counter that never goes down): an elastic communicator waiting on a member sees that the
        process it waits for was replaced (:mod:`stratagem.collectives.elastic`). The default counts none."""
        return 0

    def flush(self, timeout: float | None = None, tasks=None) -> None:
        """Wait (up to ``timeout`` s, best effort) until what was sent to ``tasks`` (default: every
        peer) has left this process, so that it arrives even if the process ends right after. The
        default has nothing to wait for."""

    # -- helpers for subclasses --------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _route(self, dst, tag: str, msg: Message, mailbox) -> TaskId | None:
        """The common start of a send: check ``dst``; a message to ourselves goes straight into
        ``mailbox`` (returns ``None``: nothing left to send); a peer known to be gone is refused with
        ``PeerLostError``. Returns the checked destination."""
        dst = self._check_peer(dst)
        if dst == self.task:
            mailbox.put(self.task, tag, msg.delivered_copy(self.task))
            return None
        reason = mailbox.is_lost(dst)
        if reason is not None:
            raise PeerLostError(dst, reason)
        self.traffic.count_sent(dst, msg.nbytes)
        return dst

    def _own_address(self) -> str:
        """This task's ``host:port``, for a transport that listens on the network; a clear error where
        the cluster has no addresses."""
        address = self.cluster.address(self.task)
        if address is None:
            raise ConfigurationError(
                f"{self.task} has no network address (the cluster came from an MPI or Slurm world): use "
                f"transport='mpi' under mpiexec, set STRATAGEM_PORT under srun (each task listens on its "
                f"node at STRATAGEM_PORT + SLURM_LOCALID), or give addresses through STRATAGEM_CONFIG/TF_CONFIG"
            )
        return address

    def _connection(self, peers: dict[TaskId, _Peer], lock, task: TaskId,
                    connect: Callable[[TaskId, str], _Peer]) -> tuple[_Peer, bool]:
        """Our connection to ``task`` from ``peers``, else a new one, ``connect(task, address)``, made and
        filed under ``lock`` (once, whatever the threads); returns it and whether it is new."""
        peer = peers.get(task)
        if peer is not None:
            return peer, False
        with lock:
            peer = peers.get(task)
            if peer is not None:
                return peer, False
            if self._closed:
                raise TransportClosed(f"{self.task}: transport closed")
            address = self.cluster.address(task)
            if address is None:
                raise ConfigurationError(f"{task} has no network address in the cluster spec")
            peer = peers[task] = connect(task, address)
        return peer, True

    def _check_peer(self, task: TaskId | str) -> TaskId:
        task = TaskId.parse(task)
        self.cluster.check(task)
        return task

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.task}>"
