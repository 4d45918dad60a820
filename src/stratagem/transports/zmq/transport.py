"""The ``zmq`` transport: ZeroMQ over TCP, array buffers sent without copies.

Each task binds one ROUTER socket at its cluster address and receives everything there. To send to
a peer it opens a DEALER socket to the peer's ROUTER (lazily, once). So every directed pair of tasks
has its own connection, and ZeroMQ keeps messages on it in order, which gives the contract's
per-(src, dst, tag) ordering.

Threads: whoever holds the reader lock reads the ROUTER, the connection monitors and the DEALERs
still in their handshake: it decodes messages, runs both sides of the handshake
(``transport_kit/acceptor.py``, ``transport_kit/connector.py``) and files data into the mailbox. A ``recv`` that has
to wait takes the reader lock itself, so a message reaches the thread that wants it without a
hand-off between threads; it then waits in a receive on the
ROUTER alone (a message already there costs no system call; a poll of every socket costs ZeroMQ two
per socket), and polls every socket at least every 50 ms. A background thread reads when no
``recv`` does. User threads send on the DEALERs of peers that completed the handshake, one lock per
peer. Large buffers are handed to ZeroMQ by reference (``copy=False``) and ``send`` waits on
ZeroMQ's tracker until the memory is released, so the caller may reuse its arrays as soon as
``send`` returns; small messages are copied, which is cheaper than tracking, and those with at most
:data:`SINGLE_PART_BYTES` of buffers travel as one part (the whole frame), which costs ZeroMQ and
both ends less than a part per buffer. Received message memory is kept for reuse
(:mod:`stratagem.transports.zmq.malloc`).

Handshake: the connector sends HELLO on its DEALER; the acceptor answers on that same connection
(CHALLENGE, then WELCOME after AUTH with a cluster secret; WELCOME at once without one; REJECT with
the reason when it refuses), so a forged HELLO never makes us talk to the task it names. Data flows
after WELCOME. What the connector accepts in answer (from the task it connected to only, a CHALLENGE
answering its own HELLO, a valid proof) is :class:`~stratagem.transport_kit.connector.Connector`'s rule,
the same as grpc's.

Memory before the handshake: ZeroMQ allocates a whole message part before we see it, so the ROUTER
refuses (and disconnects) any part over :data:`PART_BYTES` (or the largest frame head the limits
allow, if that is more) and an unauthenticated peer can make us hold at most that much per
connection. A frame with a larger buffer travels as a *stream*: messages ``[b"", piece]`` of at most
that size, which the acceptor reassembles into arrays it allocates only for an authenticated peer
(one copy on receipt; other frames arrive without a copy, as one part or as ``[head, buffer...]``).
A DEALER
only ever receives control frames, so it refuses anything over a control frame's size. ZeroMQ keeps
the parts of an unfinished multipart message without a bound of its own, so with a cluster secret
every connection into the ROUTER must first pass a gate: ZMTP PLAIN credentials carrying a token
derived from the secret (:func:`stratagem.transport_kit.handshake.connection_token`), which our ZAP handler
checks before libzmq reads a single message from the connection. A peer without the secret cannot
make a task buffer anything; the token travels in clear (it only opens the door to the handshake,
which still authenticates with the secret). Without a secret anyone may connect, by design.

Failure detection: a DEALER's monitor reports the connection dropping the moment a peer process dies
(the kernel closes its sockets); ZeroMQ heartbeats catch a peer that went silent without closing
(host down, cable cut, process stopped): ZeroMQ's I/O thread pings every ``peer_timeout / 10`` (it
needs neither the GIL nor the user's step, and the peer's I/O thread answers the same way) and drops
the connection once ``peer_timeout`` passed after the first ping that nothing came back after, so a
peer is lost ``peer_timeout`` after the last thing heard from it, never sooner, and at most a tenth of
it later (see :func:`heartbeat_ms`). Either way the peer is marked
lost and waiting ``recv`` calls raise ``PeerLostError`` naming it. :meth:`ZmqTransport.flush` waits
until what was sent has been written to the sockets, so a notice sent just before a process ends
(a collective's abort notice) is not lost with it.

Security: frames are decoded by ``core/wire.py`` (no pickle, limits checked first), and handled by
the accepting side, :mod:`stratagem.transports.zmq.acceptor`. Data is accepted only on connections
that completed the handshake; with a cluster secret that includes the HMAC challenge-response. A
malformed or unauthenticated frame is dropped with a logged reason; the server keeps serving
everyone else.

    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec, TaskId
    >>> from stratagem.core.transport import Message
    >>> from stratagem.testing.world import free_ports
    >>> p0, p1 = free_ports(2)
    >>> cluster = ClusterSpec({"worker": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]})
    >>> with ZmqTransport(cluster, "worker:0") as a, ZmqTransport(cluster, "worker:1") as b:
    ...     a.send(b.task, "x", Message({"k": 1}, [np.arange(3.0)]))
    ...     m = b.recv(a.task, "x", timeout=10)
    >>> m.meta, m.buffers[0].tolist()
    ({'k': 1}, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import functools
import hmac
import itertools
import logging
import queue
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from stratagem.core.failures import said_goodbye
from stratagem.core import wire
from stratagem.transport_kit import ports
from stratagem.transport_kit.acceptor import CONTROL_LIMITS, Acceptor
from stratagem.core.cluster import TaskId
from stratagem.core.errors import (
    AuthenticationError,
    ConfigurationError,
    PeerLostError,
    ProtocolError,
    StratagemError,
    TransportClosed,
    TransportTimeout,
)
from stratagem.transport_kit.connector import READY, Connector, Failed, Send
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.transport_kit.reading import SharedReader
from stratagem.core.transport import COMPLETED, Message, SendHandle, Transport
from stratagem.core.wire import Kind
from stratagem.transports.zmq.acceptor import ZmqAcceptor
from stratagem.transports.zmq.malloc import keep_message_memory

log = logging.getLogger(__name__)
#: What handling a peer's bad frame raises (its decoding, the acceptor's checks, our own errors).
#: Anything else -- an exception a signal handler raised in this thread, which reads for a waiting
#: recv(), or MemoryError -- is the program's, not the peer's: it goes on up, not taken for a bad frame.
_BAD_FRAME = (StratagemError, ValueError, TypeError, KeyError, IndexError, AttributeError)

_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                   | zmq.EVENT_MONITOR_STOPPED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# A waiting recv() blocks in a receive on the ROUTER and polls every socket only every _FULL_POLL, and
# the background thread stays away while recv() calls read: each of its wake-ups and each full poll
# costs system calls (two per socket: libzmq's fork check and a poll of the socket's command pipe) and
# a thread switch, so on a slow link, where a 64 MiB all-reduce waits about a second on its messages,
# 10 and 20 ms made 2-3 thousand system calls and 50 wake-ups per call. A new connection's handshake
# is read at once either way (a full poll while one runs; _ensure_peer nudges the background thread).
_BACKGROUND_GRACE = 0.1   # the background reader stays away this long after a recv() read
_LOSS_GRACE = 0.2         # seconds between a dropped connection and declaring the peer lost
_FULL_POLL = 0.05         # a reading recv() polls every socket at least this often
_MAX_TTL_MS = 6_553_500   # ZMTP carries the heartbeat TTL in deciseconds, in 16 bits
# pyzmq's constants are enums, whose arithmetic costs more than the call it is for: plain ints here.
_EVENTS, _POLLIN, _NOBLOCK, _SNDMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.SNDMORE)
_RCVMORE, _RCVTIMEO = int(zmq.RCVMORE), int(zmq.RCVTIMEO)
#: The largest message part the ROUTER takes (from anyone: this bounds an unauthenticated peer).
PART_BYTES = 4 << 20
#: Messages with at most this many buffer bytes travel as one part (the frame as ``wire.encode_bytes``
#: makes it), larger ones as ``[head, buffer...]``.
SINGLE_PART_BYTES = 64 << 10
#: The largest part a DEALER takes: it only ever receives control frames.
_CONTROL_PART_BYTES = wire.HEADER_SIZE + CONTROL_LIMITS.max_envelope_bytes
# pyzmq names a monitor endpoint after the socket's file descriptor, which the OS hands out again once
# a socket is closed; a new connection to a restarted peer then failed to bind ("Address already in
# use") while the old monitor still held the name. Ours are numbered, never reused.
_MONITOR_NUMBERS = itertools.count()
#: The ZMTP PLAIN user name of a connection that shows the cluster's token (see _gate_connections).
ZAP_USER = b"stratagem"


class _Peer:
    """Our outgoing connection to one peer: a DEALER socket and its handshake (``hs``)."""

    def __init__(self, task: TaskId, sock: zmq.Socket, monitor: zmq.Socket, hs: Connector, address: str):
        self.task = task
        self.sock = sock
        self.monitor = monitor
        self.hs = hs
        self.address = address
        self.lock = threading.Lock()      # a zmq socket is used by one thread at a time
        self.ready = threading.Event()    # data may flow (set at once without a secret)
        self.error: Exception | None = None
        self.connected = False            # a connection came up, so a later drop means lost
        self.closed = False
        self.handshaking = False          # the reader reads its answers (until WELCOME or a failure)

    def fail(self, error: Exception) -> None:
        self.error = error
        self.ready.set()



class ZmqTransport(Transport):
    """ZeroMQ transport (see the module docstring for the design).

    Options:
        bind_host: interface to bind (default: the host of this task's address if it is an IP
            literal or localhost, else all interfaces; ``STRATAGEM_BIND_HOST`` overrides).
        io_threads: ZeroMQ I/O threads (1 moves over 1 GB/s).
        zero_copy_bytes: messages with at least this many buffer bytes are sent without copying.
        linger: seconds ``close()`` waits to flush queued messages.
        malloc_tuning: let the memory of received messages be reused instead of page-faulted in
            afresh for each (a setting of the process's allocator: see
            :mod:`stratagem.transports.zmq.malloc`; ``False`` leaves the allocator alone).
    """

    name = "zmq"
    elastic = True   # a restarted peer is re-accepted (transport_kit/acceptor.py: an Admitted again)
    whole_buffer_bytes = PART_BYTES

    def __init__(self, cluster, task, *, bind_host: str | None = None, io_threads: int = 1,
                 zero_copy_bytes: int = 256 * 1024, linger: float = 1.0, malloc_tuning: bool = True,
                 **common):
        super().__init__(cluster, task, **common)
        host, _, port = self._own_address().rpartition(":")
        self._host, self._port = host, int(port)
        self._bind_host = ports.bind_host(host, bind_host)
        if io_threads < 1:
            raise ConfigurationError(f"io_threads must be >= 1, got {io_threads}")
        self._io_threads = io_threads
        self.zero_copy_bytes = int(zero_copy_bytes)
        self._part_cap = max(PART_BYTES, wire.HEADER_SIZE + self.limits.max_envelope_bytes)
        self._linger_ms = int(linger * 1000)
        self._malloc_tuning = bool(malloc_tuning)
        self._cluster_id = self.cluster.cluster_id
        self._ctx: zmq.Context | None = None
        self._zap: zmq.Socket | None = None      # the ZAP handler's socket, with a secret
        self._mailbox = self._new_mailbox()
        self._peers: dict[TaskId, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._new_monitors: queue.SimpleQueue = queue.SimpleQueue()
        self._control_lock = threading.Lock()
        # Whoever holds the reader's lock reads the ROUTER and the monitors: a waiting recv() (so a
        # message reaches it without a thread hand-off), else the background thread.
        self._reading = SharedReader(f"stratagem-zmq-{self.task.short}", self._pump,
                                     functools.partial(self._poke, b"wake"), self._reader_crashed,
                                     grace=_BACKGROUND_GRACE, waiter_read=self._read_for_waiter)
        self._monitors: dict[zmq.Socket, _Peer] = {}
        self._handshakes: dict[zmq.Socket, _Peer] = {}   # DEALERs whose answers the reader reads
        self._poller: zmq.Poller | None = None
        self._pending_loss: dict[TaskId, tuple[float, str, _Peer]] = {}
        self._half_read: dict[zmq.Socket, list] = {}   # a message read halfway (see _whole_message)
        self._polled_at = 0.0
        self._router_timeout = -1  # the ROUTER's RCVTIMEO (ms), set by _receive_one
        self.address: str | None = None
        #: Counters a test or an operator can read: frames dropped and why.
        self.stats = {"rejected_frames": 0, "data_frames": 0}
        #: What arrives at the ROUTER: the handshake as acceptor, then data into the mailbox.
        acceptor = Acceptor(self.task, self.cluster, self.secret, limits=self.limits)
        self._zap_token = acceptor.token   # what a connection must show at the gate, with a secret
        self._acceptor = ZmqAcceptor(
            acceptor, self._mailbox, self.stats,
            answer=self._answer, forget_peer=self._forget_peer, watch_peer=self._ensure_peer,
            peer_gone=self._peer_gone, part_cap=self._part_cap)

    def _new_mailbox(self) -> Mailbox:
        """Where received messages go (the shm transport's control transport files into its own)."""
        return Mailbox(self.task, traffic=self.traffic, recorder=self.recorder)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._ctx is not None:
            return
        if self._closed:
            raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
        if self._malloc_tuning:
            keep_message_memory(self._part_cap)
        ctx = zmq.Context(self._io_threads)
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.RCVHWM, 0)  # never drop: the mailbox is the queue
            router.setsockopt(zmq.LINGER, 0)
            # ZeroMQ refuses (and disconnects) a part larger than this before allocating it; bigger
            # buffers come as a stream of parts (see the module docstring).
            router.setsockopt(zmq.MAXMSGSIZE, self._part_cap)
            zap = self._gate_connections(ctx, router)
            router_monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED, self._monitor_address())
            endpoint = f"tcp://{self._bind_host}"
            if self._port == 0:
                self._port = router.bind_to_random_port(endpoint)
            else:
                try:
                    router.bind(f"{endpoint}:{self._port}")
                except zmq.ZMQError as exc:
                    raise ConfigurationError(
                        f"{self.task} cannot bind {self._bind_host}:{self._port}: {exc} "
                        f"(is another process using the port?)"
                    ) from None
            control_in = ctx.socket(zmq.PAIR)
            control_addr = f"inproc://stratagem-control-{id(self)}"
            control_in.bind(control_addr)
            control_out = ctx.socket(zmq.PAIR)
            control_out.connect(control_addr)
        except Exception:
            ctx.destroy(linger=0)
            raise
        self._ctx, self._router, self._control_in, self._control_out = ctx, router, control_in, control_out
        self._router_monitor = router_monitor
        self._zap = zap
        self._poller = zmq.Poller()
        if zap is not None:
            self._poller.register(zap, zmq.POLLIN)
        self._poller.register(router_monitor, zmq.POLLIN)
        self._poller.register(router, zmq.POLLIN)
        self._poller.register(control_in, zmq.POLLIN)
        self.address = f"{self._host}:{self._port}"
        self._reading.start()

    def _shutdown(self, graceful: bool) -> None:
        if self._ctx is None:
            self._mailbox.close("closed before it started")
            return
        # The reader stops first: it may be reading DEALERs in their handshake, which are closed below.
        self._reading.stop()
        self._mailbox.close(said_goodbye(self.task))  # wakes waiting recv() calls
        got_reader = self._reading.lock.acquire(timeout=10)
        try:
            with self._peers_lock:
                peers = list(self._peers.values())
                self._peers.clear()
            lost = self._mailbox.lost()
            for peer in peers:
                # A peer that already left gets nothing more, so waiting to flush to it is pointless.
                linger = self._linger_ms if graceful and peer.task not in lost else 0
                with peer.lock:
                    if linger and not peer.closed and peer.ready.is_set() and peer.error is None:
                        try:
                            peer.sock.send_multipart(wire.encode(Kind.GOODBYE, ""), flags=zmq.NOBLOCK)
                        except zmq.ZMQError:
                            pass
                    _close_socket(peer.sock, linger)
                    peer.closed = True
                # Its monitor too: a peer connected just before we closed may not have handed it to
                # the reader yet, and one socket left open makes the context's end wait for ever.
                peer.monitor.close(linger=0)
                peer.fail(TransportClosed(f"{self.task}: transport closed"))
            while not self._new_monitors.empty():  # monitors no reader got to register yet
                self._new_monitors.get().monitor.close(linger=0)
            for sock in self._monitors:
                sock.close(linger=0)
            self._monitors.clear()
            self._handshakes.clear()
            _close_socket(self._router, 0)
            self._router_monitor.close(linger=0)
            if self._zap is not None:
                self._zap.close(linger=0)
            self._control_in.close(linger=0)
            self._control_out.close(linger=0)
        finally:
            if got_reader:
                self._reading.lock.release()
        # Graceful: every socket keeps its own linger, so the DEALERs closed above still flush for up
        # to linger ms; destroy() (rather than term()) also closes any socket this code lost track of,
        # where term() would wait for it for ever. No other thread uses a socket by now.
        self._ctx.destroy(linger=None if graceful else 0)

    # -- messaging ---------------------------------------------------------------------------------
    def send(self, dst, tag, msg, timeout=None) -> None:
        timeout = self._timeout(timeout)
        handle = self.send_async(dst, tag, msg, timeout)
        if handle is not COMPLETED:   # a small message is copied: done as it returns
            handle.wait(timeout)

    def send_async(self, dst, tag, msg, timeout=None) -> SendHandle:
        if self._ctx is None or self._closed:
            self._require_started()
        peer = self._peers.get(dst)  # a TaskId we connected to: checked then, and never ourselves
        if peer is not None and peer.ready.is_set():
            # The usual case, without re-checking what connecting checked: is it lost, then send.
            reason = self._mailbox.is_lost(dst)
            if reason is not None:
                raise PeerLostError(dst, reason)
            self.traffic.count_sent(dst, msg.nbytes)
            return self._write(peer, dst, tag, msg)
        dst = self._route(dst, tag, msg, self._mailbox)
        if dst is None:
            return COMPLETED
        timeout = self._timeout(timeout)
        peer = self._ensure_peer(dst)
        if not peer.ready.wait(timeout):
            raise TransportTimeout(
                f"{self.task}: no handshake with {dst} at {peer.address} within {timeout:g} s "
                f"(is it running, and do all tasks share the same STRATAGEM_SECRET?)"
            )
        return self._write(peer, dst, tag, msg)

    def _write(self, peer: _Peer, dst: TaskId, tag: str, msg: Message) -> SendHandle:
        """Encode ``msg`` and hand it to ``peer``'s DEALER (handshake done)."""
        if peer.error is not None:
            raise _fresh(peer.error)
        parts = wire.encode(Kind.DATA, tag, msg.meta, msg.buffers, self.limits)
        if len(parts) == 2:   # one buffer: the usual message
            payload = len(parts[1])
            largest = max(payload, len(parts[0]))
        else:
            payload = largest = 0
            for part in parts:
                size = len(part)
                payload += size
                largest = max(largest, size)
            payload -= len(parts[0])  # the head is not payload
        with peer.lock:
            if peer.closed:
                raise _fresh(peer.error) if peer.error else PeerLostError(dst, "connection closed")
            if largest > PART_BYTES:
                tracker = self._send_stream(peer, parts, copy=payload < self.zero_copy_bytes)
            elif payload < self.zero_copy_bytes:  # copied: the caller may reuse its arrays at once
                sock = peer.sock
                if payload <= SINGLE_PART_BYTES:
                    # One part: a multipart message costs ZeroMQ and both ends more per part than
                    # joining a few kilobytes does.
                    sock.send(b"".join(parts) if len(parts) > 1 else parts[0])
                else:
                    for part in parts[:-1]:
                        sock.send(part, _SNDMORE)
                    sock.send(parts[-1])
                return COMPLETED
            else:
                tracker = peer.sock.send_multipart(parts, copy=False, track=True)
        return COMPLETED if tracker is None else _TrackedSend(tracker, self.task, dst, payload)

    @staticmethod
    def _send_stream(peer: _Peer, parts, copy: bool) -> zmq.MessageTracker | None:
        """Send a frame with a part over PART_BYTES as stream pieces ``[b"", piece]`` (peer.lock held)."""
        trackers = []
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), PART_BYTES):
                piece = view[start:start + PART_BYTES]
                if copy:
                    peer.sock.send_multipart([b"", piece], copy=True)
                else:
                    trackers.append(peer.sock.send_multipart([b"", piece], copy=False, track=True))
        return zmq.MessageTracker(*trackers) if trackers else None

    def flush(self, timeout=None, tasks=None) -> None:
        """Wait up to ``timeout`` seconds until everything sent so far to ``tasks`` (default: every
        peer that completed the handshake) has been written to their sockets (best effort: a peer
        that takes nothing is given up on at the deadline). Lets a notice sent just before the
        process ends arrive."""
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        trackers = []
        wanted = None if tasks is None else {TaskId.parse(t) for t in tasks}
        for peer in list(self._peers.values()):
            if wanted is not None and peer.task not in wanted:
                continue
            with peer.lock:
                if peer.closed or not peer.ready.is_set() or peer.error is not None:
                    continue
                # A message is written in order after what was queued before it; this one is
                # handed over by reference, so its tracker tells when ZeroMQ is done with it (which
                # is only once no Frame object holds it either: hence no name for it here).
                try:
                    trackers.append(peer.sock.send(zmq.Frame(b"", track=True, copy=False, copy_threshold=0),
                                                   copy=False, track=True, flags=zmq.NOBLOCK))
                except zmq.ZMQError:
                    continue
        for tracker in trackers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                tracker.wait(remaining)
            except zmq.NotDone:
                return

    def recv(self, src, tag, timeout=None) -> Message:
        if self._ctx is None or self._closed:
            self._require_started()
        if src is not None and src not in self._peers:  # a peer we connected to was checked then
            src = self._check_peer(src)
            if src != self.task and self._mailbox.is_lost(src) is None:
                # Connecting to the source lets us watch it, so its death wakes us.
                self._ensure_peer(src)
        return self._mailbox.get(src, tag, self._timeout(timeout), pump=self._reading.for_waiter)

    def lost_peers(self):
        return self._mailbox.lost()

    def peer_losses(self, task):
        return self._mailbox.losses(TaskId.parse(task))

    # -- outgoing connections ----------------------------------------------------------------------
    def _require_started(self) -> None:
        if self._ctx is None or self._closed:
            raise TransportClosed(f"{self.task}: the zmq transport is {'closed' if self._closed else 'not started (call start())'}")

    def _ensure_peer(self, task: TaskId) -> _Peer:
        peer, new = self._connection(self._peers, self._peers_lock, task, self._connect)
        if new:
            self._new_monitors.put(peer)
            self._poke(b"watch")
            self._reading.nudge()  # its handshake answers are read at once, not after the grace
        return peer

    def _connect(self, task: TaskId, address: str) -> _Peer:
        """A DEALER to ``task`` at ``address``, its HELLO sent (under the peers' lock)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, _CONTROL_PART_BYTES)  # it only ever receives control frames
        hs = Connector(self.task, task, self._cluster_id, self.secret, address)
        if hs.token is not None:
            sock.plain_username = ZAP_USER
            sock.plain_password = hs.token
        interval_ms, timeout_ms, ttl_ms = heartbeat_ms(self.peer_timeout)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, ttl_ms)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS, self._monitor_address())
        sock.connect(f"tcp://{address}")
        peer = _Peer(task, sock, monitor, hs, address)
        peer.handshaking = True  # from now on only the reader uses sock, until WELCOME or a failure
        try:
            # Never block here (we hold the peers' lock): a connection the peer's gate refused (a wrong
            # token) is gone within milliseconds, and a DEALER without a connection blocks a send forever.
            # The refusal then reaches whoever waits as the monitor's handshake failure, and anything
            # else as the caller's own timeout, never a hang.
            sock.send_multipart(wire.encode(Kind.HELLO, "", hs.hello), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("%s: HELLO to %s not queued: its connection is already gone", self.task, task)
        return peer

    def _monitor_address(self) -> str:
        return f"inproc://stratagem-monitor-{id(self):x}-{next(_MONITOR_NUMBERS)}"

    def _poke(self, command: bytes) -> None:
        with self._control_lock:
            try:
                self._control_out.send(command, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _answer(self, routing_id: bytes, kind: Kind, meta: dict) -> None:
        """Send a control frame back on the ROUTER connection ``routing_id`` (dropped if it is gone)."""
        try:
            self._router.send_multipart([routing_id, *wire.encode(kind, "", meta)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("%s: could not answer %s on connection %s: %s", self.task, kind.name, routing_id.hex(), exc)

    def _send_control(self, peer: _Peer, kind: Kind, meta: dict) -> None:
        with peer.lock:
            if not peer.closed:
                peer.sock.send_multipart(wire.encode(kind, "", meta), flags=zmq.NOBLOCK)

    # -- reading: a waiting recv() reads itself; the background thread covers the idle times ----------
    def _read_for_waiter(self, slice_: float) -> None:
        """A waiting recv()'s read (reader lock held): the ROUTER alone, unless connections change."""
        now = time.monotonic()
        if self._handshakes or self._pending_loss or not self._new_monitors.empty():
            self._polled_at = now  # connections are changing: watch every socket
            self._pump(min(slice_, _FULL_POLL))
        elif now - self._polled_at >= _FULL_POLL:
            # Every socket (monitors, control, the connection gate) at least every _FULL_POLL,
            # without waiting: the wait is in the ROUTER's receive, on the next call.
            self._polled_at = now
            self._pump(0.0)
        else:
            self._receive_one(min(slice_, self._polled_at + _FULL_POLL - now))

    def _receive_one(self, timeout: float) -> None:
        """Wait up to ``timeout`` for one message on the ROUTER and handle it (reader lock held).

        A blocking receive on the one socket the data comes in on: when the message is already
        there it costs no system call at all, else one wait on ZeroMQ's own signal, where polling
        every socket costs two system calls per socket (ZeroMQ checks each one's commands before
        and after the wait). The other sockets wait for the next full poll (``_FULL_POLL``)."""
        # In steps of 10 ms (the full poll's slice is 50): changing the option costs a call, and the
        # slice left until the next full poll is different on every call.
        ms = int(timeout * 100) * 10 or int(timeout * 1000)
        if ms != self._router_timeout:
            self._router.setsockopt(_RCVTIMEO, ms)
            self._router_timeout = ms
        try:
            parts = self._whole_message(self._router)
        except zmq.Again:
            return
        except zmq.ZMQError:
            if self._reading.stopping:
                return
            raise
        self._handle(parts)

    def _reader_crashed(self) -> None:
        self._mailbox.close("the zmq background reader crashed (see the log)")

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for socket events and handle all that are ready (reader lock held)."""
        if self._reading.stopping:
            return
        while not self._new_monitors.empty():
            peer = self._new_monitors.get()
            self._monitors[peer.monitor] = peer
            self._poller.register(peer.monitor, zmq.POLLIN)
            if peer.handshaking and not peer.closed:
                self._handshakes[peer.sock] = peer
                self._poller.register(peer.sock, zmq.POLLIN)
        if self._pending_loss:
            timeout = max(0.0, min(timeout, min(d for d, _, _ in self._pending_loss.values()) - time.monotonic()))
        try:
            ready = dict(self._poller.poll(int(timeout * 1000)))
        except zmq.ZMQError:
            if self._reading.stopping:
                return
            raise
        if self._control_in in ready:
            while self._control_in.poll(0):
                self._control_in.recv()  # "wake" (the reader's), "watch": each just wakes the poll
        if self._router_monitor in ready:  # first: a connection's end comes before a reuse of its fd
            while self._router_monitor.poll(0):
                event = self._monitor_event(self._router_monitor)
                if event is not None:
                    self._acceptor.connection_closed(event["value"])
        if self._zap is not None and self._zap in ready:
            self._answer_zap()
        if self._router in ready:
            self._drain_router()
        for sock in [s for s in ready if s in self._handshakes]:
            self._on_answer(self._handshakes[sock])
        for sock in [s for s in ready if s in self._monitors]:
            if self._on_monitor(self._monitors[sock]):
                self._poller.unregister(sock)
                del self._monitors[sock]
                sock.close(linger=0)
        if self._pending_loss:
            self._settle_losses()

    # -- the connection gate (ZAP) -----------------------------------------------------------------
    def _gate_connections(self, ctx, router):
        """With a secret, accept a connection only once its ZMTP handshake shows the token derived
        from the secret (PLAIN credentials, checked by our ZAP handler): libzmq reads no message of a
        connection before that, so a peer without the secret cannot make this task buffer anything,
        however it splits its data. (MAXMSGSIZE bounds one part, not a multipart message that never
        ends: that is what this closes.) Returns the ZAP socket, or None without a secret."""
        if not self.secret:
            return None
        zap = ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind("inproc://zeromq.zap.01")   # the endpoint libzmq asks, per context
        router.setsockopt(zmq.ZAP_DOMAIN, b"stratagem")
        router.plain_server = True
        return zap

    def _answer_zap(self) -> None:
        """Answer libzmq's ZAP requests: 200 for the token, 400 otherwise (the connection is closed)."""
        while True:
            try:
                request = self._zap.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # version, request id, domain, address, identity, mechanism, credentials...
            ok = (len(request) >= 8 and request[5] == b"PLAIN" and request[6] == ZAP_USER
                  and hmac.compare_digest(request[7], self._zap_token))
            if not ok:
                self.stats["refused_connections"] = self.stats.get("refused_connections", 0) + 1
                log.warning("%s: refused a connection from %s without the cluster's connection token "
                            "(a peer without the secret, or a task of another cluster)",
                            self.task, request[3].decode(errors="replace") if len(request) > 3 else "?")
            request_id = request[1] if len(request) > 1 else b""
            self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"no token", b"", b""])

    def _drain_router(self) -> bool:
        """Handle what the ROUTER holds (bounded, so monitors and control are not starved); True if
        there was anything. Readiness is asked of ZeroMQ (EVENTS) rather than learned from a failed
        read, which would cost an exception each time."""
        router = self._router
        for count in range(1000):
            if not router.get(_EVENTS) & _POLLIN:
                return count > 0
            try:
                parts = self._whole_message(router, _NOBLOCK)
            except zmq.Again:
                return count > 0
            self._handle(parts)
        return True

    def _whole_message(self, sock: zmq.Socket, flags: int = 0, copy: bool = False) -> list:
        """The next whole message on ``sock``. Its parts are read one at a time and kept when an
        exception stops the read halfway (one a signal handler raises in a ``recv()`` that reads in the
        main thread): the next read of ``sock`` goes on with that message, whose rest is never taken for
        a message of its own. ``flags`` apply to the first part; the rest is there once the first is."""
        parts = self._half_read.setdefault(sock, [])
        if copy:
            if not parts:
                parts.append(sock.recv(flags, copy=True))
            while sock.get(_RCVMORE):
                parts.append(sock.recv(copy=True))
        else:  # a Frame says whether more parts follow: no getsockopt (and its option enum) per part
            if not parts:
                parts.append(sock.recv(flags, copy=False))
            while parts[-1].more:
                parts.append(sock.recv(copy=False))
        del self._half_read[sock]
        return parts

    def _handle(self, parts: list) -> None:
        """One message from the ROUTER: ``[routing id, ...]``."""
        routing_id = parts[0].bytes
        try:
            self._acceptor.on_message(routing_id, parts[1:], parts[0])
        except _BAD_FRAME as exc:  # a bad frame must never take the server down
            self._acceptor.reject(routing_id, f"error while handling a frame: {type(exc).__name__}: {exc}")
            log.debug("frame handler error", exc_info=True)

    # -- our side of the handshake: the answers to our HELLOs, read by the reader -------------------
    def _on_answer(self, peer: _Peer) -> None:
        """Read what the acceptor answered on ``peer``'s DEALER while its handshake runs; its rules are
        :class:`~stratagem.transport_kit.connector.Connector`'s."""
        while peer.handshaking:
            try:
                parts = peer.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                frame = wire.decode_parts(parts, CONTROL_LIMITS)
            except ProtocolError as exc:
                actions = peer.hs.malformed(str(exc))
            else:
                actions = peer.hs.on_frame(frame.kind, frame.meta)
            for action in actions:
                if isinstance(action, Send):
                    self._send_control(peer, action.kind, action.meta)
                elif action is READY:
                    self._end_handshake(peer)
                    peer.ready.set()
                elif isinstance(action, Failed):
                    log.warning("%s: %s", self.task, action.error)
                    if action.reject is not None:
                        self._send_control(peer, Kind.REJECT, action.reject)
                    self._end_handshake(peer)
                    peer.fail(action.error)
                # GOODBYE comes only after READY, when the reader reads this DEALER no more.

    def _end_handshake(self, peer: _Peer) -> None:
        """Stop reading ``peer``'s DEALER (reader thread): from here on user threads send on it."""
        peer.handshaking = False
        if self._handshakes.pop(peer.sock, None) is not None:
            self._poller.unregister(peer.sock)

    # -- failure detection -------------------------------------------------------------------------
    def _on_monitor(self, peer: _Peer) -> bool:
        """Handle one monitor event; True when the monitor is finished."""
        message = self._monitor_event(peer.monitor)
        if message is None:
            return False
        event = message["event"]
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            peer.connected = True
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            # The peer's connection gate refused us (see _gate_connections): no use retrying.
            if self._peers.get(peer.task) is peer:
                why = ("it refused this task's connection token" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                       else "one of the two tasks has a cluster secret and the other has none")
                self._forget_peer(peer.task, AuthenticationError(
                    f"{self.task} cannot connect to {peer.task}: {why}, so their cluster secrets differ; "
                    f"set the same STRATAGEM_SECRET on every task (`stratagem launch` does it for you)"))
        elif event == zmq.EVENT_DISCONNECTED and peer.connected:
            if self._peers.get(peer.task) is peer:
                # Settle the loss a moment later: what the peer sent before it went may still be on
                # its way into our ROUTER (its connections to us close at the same instant).
                self._pending_loss[peer.task] = (
                    time.monotonic() + _LOSS_GRACE, f"connection to {peer.task} at {peer.address} was "
                    f"lost (the process died, or the network failed)", peer)
        # Read to the end: ZeroMQ's I/O thread *blocks* sending an event to a monitor nobody reads,
        # and then serves no connection of this process at all (not even heartbeats).
        return event == zmq.EVENT_MONITOR_STOPPED

    def _monitor_event(self, monitor: zmq.Socket) -> dict | None:
        """The next event of a monitor socket (a message of two frames; :meth:`_whole_message`)."""
        parts = self._whole_message(monitor, copy=True)
        if len(parts) != 2 or len(parts[0]) != 6:
            # The rest of an event whose first frame was taken and lost (the exception landed after
            # pyzmq had read it): the event is gone; a lost peer is still found by its heartbeats.
            log.debug("%s: skipped the rest of a monitor event: %r", self.task, parts)
            return None
        return parse_monitor_message(parts)

    def _settle_losses(self) -> None:
        now = time.monotonic()
        for task, (deadline, reason, peer) in list(self._pending_loss.items()):
            if deadline <= now:
                del self._pending_loss[task]
                if self._peers.get(task) is peer:
                    self._peer_gone(task, reason)

    def _peer_gone(self, task: TaskId, reason: str) -> None:
        self._mailbox.mark_lost(task, reason)
        self._forget_peer(task, PeerLostError(task, reason))

    def _forget_peer(self, task: TaskId, error: Exception | None = None) -> None:
        with self._peers_lock:
            peer = self._peers.pop(task, None)
        if peer is None:
            return
        self._end_handshake(peer)
        with peer.lock:
            peer.closed = True
            _close_socket(peer.sock, 0)
        peer.fail(error or PeerLostError(task, "reconnected as a new process"))
        self._pending_loss.pop(task, None)
        # Its connections into our ROUTER stay known: frames it sent before going may still be
        # queued there, and they were sent by an authenticated peer.


def _close_socket(sock: zmq.Socket, linger: int) -> None:
    """Close a monitored socket: its monitor first, so that ZeroMQ never waits on a monitor that
    nobody reads any more (its I/O thread would block: see ``_on_monitor``)."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    sock.close(linger=linger)


def heartbeat_ms(peer_timeout: float) -> tuple[int, int, int]:
    """ZeroMQ's heartbeat interval, timeout and TTL (ms) for a peer silent ``peer_timeout`` s to be lost.

    ZeroMQ's I/O thread pings every interval; the first ping sent after the last message that came
    back starts the timeout, which anything arriving cancels. So a peer is dropped ``peer_timeout``
    after the first ping it left unanswered: at least ``peer_timeout`` after the last thing heard
    from it, at most one interval (a tenth of it) more; the loss is declared ``_LOSS_GRACE`` later,
    seen within a poll slice. A peer paused for less (a GC pause, a stopped process continued)
    answers the pings waiting for it as it wakes, before anyone gave up on it. The TTL tells the
    peer's ROUTER to drop our connection after twice that silence: later than our own detection,
    so a pause never makes a peer cut a connection we still count on.

    >>> heartbeat_ms(30.0)
    (3000, 30000, 60000)
    """
    total = int(peer_timeout * 1000)
    interval = max(10, total // 10)
    return interval, max(interval, total), min(2 * max(interval, total), _MAX_TTL_MS)


class _TrackedSend(SendHandle):
    """A zero-copy send: done when ZeroMQ has released our memory (written it to the socket)."""

    def __init__(self, tracker: zmq.MessageTracker, task: TaskId, dst: TaskId, nbytes: int):
        self._tracker, self._task, self._dst, self._nbytes = tracker, task, dst, nbytes

    def done(self) -> bool:
        return self._tracker.done

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._tracker.wait(timeout)
        except zmq.NotDone:
            raise TransportTimeout(f"{self._task}: sending {self._nbytes} bytes to {self._dst} did not "
                                   f"complete within {timeout:g} s") from None


def _fresh(error: Exception) -> Exception:
    """A new instance of a stored error, so each raise gets its own traceback."""
    if isinstance(error, PeerLostError):
        return PeerLostError(error.task, str(error).split(": ", 1)[-1])
    return type(error)(str(error))
