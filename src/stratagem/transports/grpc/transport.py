"""The ``grpc`` transport: the wire format of ``core/wire.py`` over gRPC streams (HTTP/2), with TLS.

**No generated code.** Each task runs one gRPC server whose only method, ``/stratagem.Transport/Stream``,
is registered with ``grpc.method_handlers_generic_handler`` and ``stream_stream_rpc_method_handler``
without (de)serializers, so gRPC hands us the raw bytes of each message. The payload already is a
Stratagem wire frame (header, msgpack envelope, raw buffers): a protobuf schema would only add a
protoc/codegen step and a protobuf dependency, and an encode and a decode pass (with copies) over
every array, for a message that is opaque bytes anyway. Any gRPC client can still speak to the
server: it is an ordinary bidirectional-streaming method whose messages are bytes.

**Streams.** Every directed pair of tasks A→B uses one long-lived bidirectional stream that A opens on
its channel to B's server (one channel per peer, with its own connection). A's frames (HELLO, AUTH,
DATA, GOODBYE) travel as requests; B's control frames (CHALLENGE, WELCOME, REJECT, GOODBYE) as
responses. One stream per pair keeps every frame from A to B in order, which gives the contract's
per-(src, dst, tag) ordering. The frames are one byte stream cut into messages of at most
``chunk_bytes`` (1 MiB by default, never above :data:`MAX_MESSAGE_BYTES`; the first piece of a large
buffer also carries the frame's head, up to 16 KiB), so gRPC's per-message limit never bites; the
receiver reassembles them with every limit checked before it allocates (see
:mod:`stratagem.transports.framing`).

**Handshake.** The stream starts with the protocol's handshake (``transport_kit/handshake.py``; the accepting
side is ``transport_kit/acceptor.py``'s state machine, the connecting side ``transport_kit/connector.py``'s): HELLO →
WELCOME, or with a cluster secret HELLO → CHALLENGE → AUTH → WELCOME. Data is sent only after
WELCOME. Until then the acceptor accepts nothing but the next handshake frame, under tiny control
limits, and refuses a stream that has not completed it within ``handshake_timeout``. A peer that
fails the handshake, or a malformed, oversized or unexpected frame, gets a REJECT with the reason
and its stream is ended with an error status; the reason is logged, and the server goes on serving
every other stream. Streams in their handshake have a budget of their own (``max_workers``): a new
stream that finds it full cuts off the oldest unfinished handshake (RESOURCE_EXHAUSTED), so idle
or flooding connections cannot hold the server's call slots; a task whose stream is refused that
way, or by gRPC's own call limit, opens another within its send timeout.

**Sending.** A message whose frame fits in one chunk is copied into it at once (``send`` returns
immediately; queued small frames are coalesced into one gRPC message). A larger one is cut into
chunks by gRPC's request thread, straight from the caller's arrays (one copy, into the ``bytes``
that gRPC's Python API requires), the frame's head riding with the first one (a 4 MiB array goes in
four messages, not five); ``send_async`` returns a handle that completes when the last chunk has been
made, after which the arrays may be reused, and ``send`` waits for it.

**Receiving.** A reader thread per incoming stream files each frame into the shared
:class:`~stratagem.transport_kit.mailbox.Mailbox`; ``recv`` waits on the mailbox. (The zmq transport lets a
waiting ``recv`` read its socket itself; here gRPC's own threads read the connection, so there is no
socket to pump, and the reader thread is where the bytes arrive anyway.) Received arrays are owned
by the receiver and writable, as with zmq: each buffer is filled from the messages (a buffer that
spans several messages has to be made contiguous anyway), its memory taken as its bytes arrive,
never on the word of a header (see :mod:`~stratagem.transports.framing`).

**Copies.** gRPC's Python API moves ``bytes`` only, so on top of the kernel's copies a byte costs
one copy of ours when sent (into the message) and one when received (into its array), plus gRPC's
own: one when sent (into its slice) and two when received (grpcio 1.85 copies each slice into a
``bytes``, then joins them). zmq needs one in all.

**Throughput (profiled).** A 64 MiB float32 all-reduce between two processes on 2 cores is CPU-bound:
about 37 ms of CPU per process and call, against 18 for zmq (per-thread CPU from
``/proc/<pid>/task/*/schedstat``, perf, strace). Per process: gRPC's request thread (our copy, gRPC's
copy, ``sendmsg``) about 9 ms; gRPC's event-engine threads (TCP reads, HTTP/2) 7 to 9; the reader
thread here (the copy into the array, gRPC's request iterator) 5 to 7; the server's completion-queue
thread (gRPC's two receive copies) 5 to 6; the reduction 6. Each gRPC message also costs about 25
futex calls (thread hand-offs through condition variables on both sides), and the receive buffers
gRPC allocates fault in fresh pages whenever glibc has trimmed its arenas. A bare grpcio exchange of
the same bytes in 1 MiB messages, with no stratagem code and no copy into arrays, takes as long as
our whole all-reduce: that is grpcio's floor on this machine, about 0.5 to 0.6 x zmq, and no setting
below moves it. Measured and left at gRPC's defaults: flow control (``grpc.http2.bdp_probe`` off with
``grpc.http2.lookahead_bytes`` from 64 KiB to 16 MiB: small windows cut the page faults but stall
traffic that flows both ways at once, large ones change nothing), ``grpc.http2.max_frame_size`` 16 MiB,
``grpc.experimental.tcp_{min,max}_read_chunk_size``, ``grpc.http2.write_buffer_size``,
``grpc.optimization_target=throughput``, Unix-domain sockets, ``grpc.aio`` (more CPU than the
threaded API), and two streams per direction (no faster: the run is CPU-bound). Messages of 1 MiB
are the sweet spot: at 256 KiB the hand-offs cost more, 2 MiB is no better, and at 4 MiB gRPC's
receive path touches fresh pages and misses the cache, so much that letting the receiver keep
gRPC's ``bytes`` instead of copying them (possible once a buffer arrives whole) still loses.

**Failure detection.** Channels and server send HTTP/2 keepalive pings every ``peer_timeout / 10``
from gRPC's own threads and drop a connection whose ping stays unanswered ``peer_timeout``, so a
silent peer (host down, process stopped) is lost ``peer_timeout`` after the last thing heard from
it, never sooner, and at most a tenth of it (or a second) later
(:func:`~stratagem.transports.grpc.config.keepalive_ms`). A peer process that dies breaks its
streams at once. A broken incoming stream marks its peer lost at once (everything that peer sent
came on that stream, in order, and has been filed); a broken outgoing stream marks it lost after a
short grace, and only once its incoming stream (if any) has ended too, so data already received is
kept. ``recv(src)`` opens a stream to ``src`` (as zmq connects to it), so a source that never sent
us anything is watched too. A clean ``close()`` sends GOODBYE both ways and waits (``linger``, 1 s)
until each peer has read everything; ``abort()`` cancels every stream at once. Both return within
about that whatever the peers do, and leave no thread in the server's method. The server runs its
calls on daemon threads, so a script that ends without closing its transport still exits, and its
peers see its connections drop (see :mod:`~stratagem.transports.grpc.threads`).

**TLS.** Give ``tls_cert`` and ``tls_key`` (PEM files: this task's certificate, used by its server
and, when a server asks for one, as its client certificate) and ``tls_ca`` (the CA that signed the
peers' certificates); ``tls_client_auth=True`` makes the server require and verify a client
certificate (mutual TLS). Without them the transport speaks plain-text HTTP/2.

Helpers live beside this module: ``grpc_config`` (options, TLS files, bind address),
``grpc_framing`` (chunking and reassembly; no grpc import), ``grpc_streams`` (per-stream state) and
``grpc_threads`` (the server's daemon threads, closing channels without waiting).

    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.core.transport import Message
    >>> from stratagem.testing.world import free_ports
    >>> p0, p1 = free_ports(2)
    >>> cluster = ClusterSpec({"worker": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]})
    >>> with GrpcTransport(cluster, "worker:0") as a, GrpcTransport(cluster, "worker:1") as b:
    ...     a.send(b.task, "x", Message({"k": 1}, [np.arange(3.0)]))
    ...     m = b.recv(a.task, "x", timeout=10)
    >>> m.meta, m.buffers[0].tolist()
    ({'k': 1}, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

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
    TransportClosed,
    TransportTimeout,
)
from stratagem.transport_kit.connector import GOODBYE, READY, Connector, Failed, Send
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import COMPLETED, Message, SendHandle, Transport
from stratagem.core.wire import Kind
from stratagem.transports.grpc.config import (
    DEFAULT_CHUNK_BYTES,
    FULL_METHOD,
    MAX_MESSAGE_BYTES,
    METHOD,
    SERVICE,
    channel_options,
    load_tls,
    server_options,
)
from stratagem.transports.framing import Reassembler, frame_bytes
from stratagem.transports.grpc.acceptor import GrpcAcceptor
from stratagem.transports.grpc.streams import Eager, LazySend, Outgoing, fresh
from stratagem.transports.grpc.threads import DaemonExecutor, close_in_background

log = logging.getLogger(__name__)

_LOSS_GRACE = 0.2          # seconds between a broken outgoing stream and declaring the peer lost
_BUSY_RETRY = 0.05         # first pause before opening a stream again when the acceptor had no room


class GrpcTransport(Transport):
    """gRPC transport (see the module docstring for the design).

    Options:
        bind_host: interface to bind (default: the host of this task's address if it is an IP
            literal or localhost, else all interfaces; ``STRATAGEM_BIND_HOST`` overrides).
        chunk_bytes: size of the pieces frames are cut into, each one gRPC message (the first piece of
            a large buffer also carries the frame's head, up to 16 KiB).
        tls_cert, tls_key: PEM files of this task's certificate and key; enable TLS.
        tls_ca: PEM file of the CA that signed the peers' certificates.
        tls_client_auth: require and verify a client certificate (mutual TLS; needs ``tls_ca``).
        tls_server_name: the name the peers' certificates are checked against, instead of the host
            of their cluster address.
        handshake_timeout: seconds an incoming stream may take to complete its handshake.
        linger: seconds ``close()`` waits for queued frames to be delivered (1 by default, as the
            zmq transport): ``close()`` returns within about that, whatever the peers do.
        max_workers: incoming streams served at once after their handshake (each holds a thread of
            the server); default the cluster size plus 8. Streams still in their handshake have a
            budget of the same size of their own: when it is full, the oldest is cut off to make
            room (its owner, if a task, tries again), so connections that never complete a
            handshake cannot keep the cluster's tasks out.
    """

    name = "grpc"
    elastic = True   # a restarted peer is re-accepted (transport_kit/acceptor.py: an Admitted again)

    def __init__(self, cluster, task, *, bind_host: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
                 tls_client_auth: bool = False, tls_server_name: str | None = None,
                 handshake_timeout: float = 30.0, linger: float = 1.0, max_workers: int | None = None,
                 **common):
        super().__init__(cluster, task, **common)
        host, _, port = self._own_address().rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._bind_host = ports.bind_host(self._host, bind_host)
        if not 1 <= int(chunk_bytes) <= MAX_MESSAGE_BYTES:
            raise ConfigurationError(f"chunk_bytes must be between 1 and {MAX_MESSAGE_BYTES} (gRPC's message "
                                     f"limit), got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        if handshake_timeout <= 0 or linger < 0:
            raise ConfigurationError("handshake_timeout must be > 0 and linger >= 0 seconds")
        self._handshake_timeout = float(handshake_timeout)
        self._linger = float(linger)
        self._max_workers = int(max_workers or len(self.cluster) + 8)
        if self._max_workers < 1:
            raise ConfigurationError(f"max_workers must be at least 1 (streams served at once), got {max_workers}")
        self._tls = load_tls(tls_cert, tls_key, tls_ca, bool(tls_client_auth))
        self._tls_server_name = tls_server_name
        self._cluster_id = self.cluster.cluster_id
        self._mailbox = Mailbox(self.task, traffic=self.traffic, recorder=self.recorder)
        self._lock = threading.RLock()            # peers, and the acceptor's streams and epochs
        self._peers: dict[TaskId, Outgoing] = {}
        #: The streams other tasks open to this one: the handshake, then data into the mailbox.
        self._acceptor = GrpcAcceptor(
            Acceptor(self.task, self.cluster, self.secret, limits=self.limits, slots=self._max_workers),
            self._mailbox, lock=self._lock, handshake_timeout=self._handshake_timeout,
            take_peer=self._take_peer, retire=self._retire, declare_lost=self._declare_lost)
        self._server: grpc.Server | None = None
        self.address: str | None = None
        #: Counters a test or an operator can read: frames and streams refused, streams cut off in their
        #: handshake to make room for newer ones, data frames received.
        self.stats = self._acceptor.stats

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._server is not None:
            return
        if self._closed:
            raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            METHOD: grpc.stream_stream_rpc_method_handler(self._acceptor.serve_stream),  # raw bytes both ways
        })
        pool = DaemonExecutor(f"stratagem-grpc-{self.task.short}")  # never holds the interpreter at exit
        server = grpc.server(pool, handlers=[handler], options=server_options(self.peer_timeout),
                             maximum_concurrent_rpcs=2 * self._max_workers)  # served + handshaking
        endpoint = ports.format_address(self._bind_host, self._port)
        try:
            if self._tls is None:
                port = server.add_insecure_port(endpoint)
            else:
                credentials = grpc.ssl_server_credentials(
                    [(self._tls["key"], self._tls["cert"])], root_certificates=self._tls["ca"],
                    require_client_auth=self._tls["client_auth"])
                port = server.add_secure_port(endpoint, credentials)
        except RuntimeError as exc:
            port, why = 0, f" ({exc})"
        else:
            why = ""
        if not port:
            server.stop(None)
            pool.shutdown(wait=False)
            raise ConfigurationError(f"{self.task} cannot bind {endpoint}{why} "
                                     f"(is another process using the port?)")
        server.start()
        self._server, self._pool, self._port = server, pool, port
        self.address = f"{self._host}:{port}"

    def _shutdown(self, graceful: bool) -> None:
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            streams = self._acceptor.shut()
        if self._server is None:
            self._mailbox.close("closed before it started")
            return
        lost = self._mailbox.lost()
        self._mailbox.close(said_goodbye(self.task))  # wakes waiting recv() calls at once
        deadline = time.monotonic() + (self._linger if graceful else 0.0)
        closed = TransportClosed(f"{self.task}: transport closed")
        if graceful:
            for peer in peers:  # GOODBYE, then the end of the stream, after what is queued
                goodbye = peer.welcomed and peer.error is None and peer.task not in lost
                peer.fail(None, Eager(frame_bytes(wire.encode(Kind.GOODBYE, ""))) if goodbye else None)
            # Wait until each peer has read everything and ended its side (bounded by linger).
            for peer in peers:
                if peer.welcomed and peer.error is None:
                    peer.finished.wait(max(0.0, deadline - time.monotonic()))
            goodbye = frame_bytes(wire.encode(Kind.GOODBYE, ""))
            for conn in streams:
                if conn.hs.accepted:
                    conn.out.put(goodbye)
                conn.out.put(None)
        for peer in peers:
            peer.fail(closed)
            if peer.call is not None:
                peer.call.cancel()
        stopped = self._server.stop(max(0.0, deadline - time.monotonic()) if graceful else 0)
        stopped.wait(10)
        for conn in streams:
            conn.out.put(None)
        for peer in peers:
            if peer.channel is not None:
                close_in_background(peer.channel, f"stratagem-grpc-{self.task.short}-close-{peer.task.short}")
        self._pool.shutdown(wait=False)

    # -- messaging ---------------------------------------------------------------------------------
    def send(self, dst, tag, msg, timeout=None) -> None:
        timeout = self._timeout(timeout)
        self.send_async(dst, tag, msg, timeout).wait(timeout)

    def send_async(self, dst, tag, msg, timeout=None) -> SendHandle:
        self._require_started()
        dst = self._route(dst, tag, msg, self._mailbox)
        if dst is None:
            return COMPLETED
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _BUSY_RETRY
        while True:
            peer = self._ensure_peer(dst)
            if not peer.ready.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TransportTimeout(
                    f"{self.task}: no handshake with {dst} at {peer.address} within {timeout:g} s (is it "
                    f"running, and do all tasks share the same STRATAGEM_SECRET and TLS settings?)"
                )
            if peer.error is None:
                break
            if peer.busy and (deadline is None or time.monotonic() + pause < deadline):
                # The acceptor had no room for our stream (too many connections in their handshake):
                # a new stream, a little later, within the send's timeout.
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            if not self._drop_refused(peer):
                raise fresh(peer.error)
        parts = wire.encode(Kind.DATA, tag, msg.meta, msg.buffers, self.limits)
        if sum(len(p) for p in parts) <= self.chunk_bytes:
            peer.enqueue(Eager(frame_bytes(parts)))  # copied: the caller may reuse at once
            return COMPLETED
        handle = LazySend(parts, f"{self.task}: sending {msg.nbytes} bytes to {dst}")
        peer.enqueue(handle)
        return handle

    def recv(self, src, tag, timeout=None) -> Message:
        self._require_started()
        if src is not None:
            src = self._check_peer(src)
            if src != self.task and self._mailbox.is_lost(src) is None:
                # A stream to the source lets us watch it even if it never sends us anything.
                self._ensure_peer(src)
        return self._mailbox.get(src, tag, self._timeout(timeout))

    def lost_peers(self):
        return self._mailbox.lost()

    def peer_losses(self, task):
        return self._mailbox.losses(TaskId.parse(task))

    def _require_started(self) -> None:
        if self._server is None or self._closed:
            raise TransportClosed(f"{self.task}: the grpc transport is "
                                  f"{'closed' if self._closed else 'not started (call start())'}")

    def _drop_refused(self, peer: Outgoing) -> bool:
        """Forget a peer that refused a frame of ours (not for the secret), so that the next send
        opens a fresh stream. True if the reason has been raised to a sender already (send again
        now), False if the caller must raise it."""
        if not isinstance(peer.error, ProtocolError) or isinstance(peer.error, AuthenticationError):
            return False
        with self._lock:
            if self._peers.get(peer.task) is peer:
                del self._peers[peer.task]
        self._retire(peer)
        reported, peer.reported = peer.reported, True
        return reported

    # -- outgoing streams --------------------------------------------------------------------------
    def _ensure_peer(self, task: TaskId) -> Outgoing:
        peer, new = self._connection(self._peers, self._lock, task, self._connect)
        if new:
            threading.Thread(target=self._read_responses, args=(peer,), daemon=True,
                             name=f"stratagem-grpc-{self.task.short}-to-{task.short}").start()
        return peer

    def _connect(self, task: TaskId, address: str) -> Outgoing:
        """A stream to ``task`` at ``address``, its HELLO queued (under the lock)."""
        peer = Outgoing(task, address, Connector(self.task, task, self._cluster_id, self.secret, address))
        peer.queue.put(Eager(frame_bytes(wire.encode(Kind.HELLO, "", peer.hs.hello))))
        peer.channel = self._channel(address)
        stream = peer.channel.stream_stream(FULL_METHOD)  # no (de)serializers: raw bytes
        peer.call = stream(peer.requests(self.chunk_bytes), wait_for_ready=True)
        return peer

    def _channel(self, address: str) -> grpc.Channel:
        options = channel_options(self.peer_timeout, self._tls_server_name)
        if self._tls is None:
            return grpc.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self._tls["ca"], private_key=self._tls["key"],
                                                   certificate_chain=self._tls["cert"])
        return grpc.secure_channel(address, credentials, options=options)

    def _read_responses(self, peer: Outgoing) -> None:
        """Reads the acceptor's control frames on our stream to ``peer``, then handles its end."""
        reassembler = Reassembler(CONTROL_LIMITS, (Kind.CHALLENGE, Kind.WELCOME, Kind.REJECT, Kind.GOODBYE),
                                  "from the acceptor")
        how = "the stream ended"
        try:
            for message in peer.call:
                reassembler.feed(message, lambda frame: self._on_response(peer, frame))
        except grpc.RpcError as exc:
            how = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc)
            # Before WELCOME, RESOURCE_EXHAUSTED means no room for the stream (gRPC's call limit, or
            # the acceptor cut off its oldest handshake): worth another try.
            code = exc.code() if hasattr(exc, "code") else None
            peer.busy = not peer.welcomed and code == grpc.StatusCode.RESOURCE_EXHAUSTED
        except ProtocolError as exc:  # what it sends next cannot be trusted to be framed either
            self._carry_out(peer, peer.hs.malformed(str(exc)))
            peer.call.cancel()
        except Exception as exc:  # must never die silently: senders would wait for the handshake
            log.exception("%s: the response reader of %s crashed", self.task, peer.task)
            peer.fail(ProtocolError(f"response reader crashed: {exc}"))
        finally:
            peer.finished.set()
        self._outgoing_ended(peer, how)

    def _on_response(self, peer: Outgoing, frame: wire.Frame) -> None:
        """One control frame of the acceptor; the rules are :class:`~stratagem.transport_kit.connector.Connector`'s."""
        self._carry_out(peer, peer.hs.on_frame(frame.kind, frame.meta))

    def _carry_out(self, peer: Outgoing, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                peer.enqueue(Eager(frame_bytes(wire.encode(action.kind, "", action.meta))))
            elif action is READY:
                peer.ready.set()
            elif action is GOODBYE:
                peer.goodbye = True
            elif isinstance(action, Failed):
                log.warning("%s: %s", self.task, action.error)
                if action.reject is not None:  # the REJECT goes out, then our side of the stream ends
                    peer.fail(action.error, Eager(frame_bytes(wire.encode(Kind.REJECT, "", action.reject))))
                else:
                    peer.fail(action.error)
                    if not action.by_peer:  # the acceptor ends the stream after its own REJECT
                        peer.call.cancel()

    def _outgoing_ended(self, peer: Outgoing, how: str) -> None:
        with self._lock:
            current = self._peers.get(peer.task) is peer
            if current and (peer.error is None or peer.reported):
                # The next send opens a new stream. A peer that refused us stays until a send has
                # raised the reason (see _drop_refused).
                del self._peers[peer.task]
            epoch = self._acceptor.epoch(peer.task)
        if self._closed or not current:
            peer.fail(TransportClosed(f"{self.task}: transport closed") if self._closed else None)
            return
        if peer.error is not None:  # refused or failed: the sender sees peer.error
            self._retire(peer)
            return
        if peer.goodbye:
            reason = said_goodbye(peer.task)
        elif peer.welcomed:
            reason = (f"connection to {peer.task} at {peer.address} was lost ({how}; the process died, "
                      f"or the network failed)")
        else:
            reason = f"connection to {peer.task} at {peer.address} ended during the handshake ({how})"
        peer.fail(PeerLostError(peer.task, reason))
        self._retire(peer)
        if peer.welcomed:
            self._schedule_loss(peer.task, reason, epoch, time.monotonic() + self.peer_timeout)

    def _take_peer(self, task: TaskId) -> Outgoing | None:
        with self._lock:
            return self._peers.pop(task, None)

    def _retire(self, peer: Outgoing) -> None:
        peer.cancel()
        if peer.channel is not None:
            close_in_background(peer.channel, f"stratagem-grpc-{self.task.short}-close-{peer.task.short}")

    # -- losses ------------------------------------------------------------------------------------
    def _schedule_loss(self, task: TaskId, reason: str, epoch: int, latest: float) -> None:
        timer = threading.Timer(_LOSS_GRACE, self._settle_loss, args=(task, reason, epoch, latest))
        timer.daemon = True
        timer.start()

    def _settle_loss(self, task: TaskId, reason: str, epoch: int, latest: float) -> None:
        with self._lock:
            if self._closed or self._acceptor.epoch(task) != epoch:
                return  # closed, or a new incarnation of the task connected since
            receiving = self._acceptor.receiving(task)
        if receiving and time.monotonic() < latest:
            # What it sent may still be arriving on its own stream to us: wait for that to end.
            self._schedule_loss(task, reason, epoch, latest)
            return
        self._declare_lost(task, reason, epoch)

    def _declare_lost(self, task: TaskId, reason: str, epoch: int | None = None) -> None:
        with self._lock:
            if self._closed or (epoch is not None and self._acceptor.epoch(task) != epoch):
                return
            self._mailbox.mark_lost(task, reason)
            peer = self._peers.pop(task, None)
        if peer is not None:
            peer.fail(PeerLostError(task, reason))
            self._retire(peer)
