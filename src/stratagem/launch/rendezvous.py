"""The rendezvous of a multi-node launch (``stratagem launch --nnodes N --node-rank I --rdzv HOST:PORT``).

Node 0's launcher listens on ``HOST:PORT``; every other node's launcher connects to it and proves that
it knows the cluster secret by the HMAC challenge-response of :mod:`stratagem.transport_kit.handshake` (node
``I`` is the connector ``node:I``, node 0 the acceptor ``node:0``; the secret never travels). An
admitted node says what it brings (its address, a free port for each of its tasks, how many workers
and ps tasks); once all ``N`` nodes are in, node 0 numbers the tasks node-major
(:func:`assemble_cluster`) and sends every node the same cluster. The connection then stays open as the
job's control channel (:class:`Channel`: heartbeats both ways, the job's events; see
:mod:`stratagem.launch.multinode`).

Frames are :mod:`stratagem.core.wire` frames (msgpack metadata, no buffers): nothing from the network
is ever unpickled, and a connection is held to the handshake's small limits until it is admitted.

    >>> cluster, placement = assemble_cluster({0: {"address": "10.0.0.1", "ports": [2001, 2002], "workers": 1, "ps": 1},
    ...                                        1: {"address": "10.0.0.2", "ports": [2003], "workers": 1, "ps": 0}})
    >>> cluster.as_dict()
    {'worker': ['10.0.0.1:2001', '10.0.0.2:2003'], 'ps': ['10.0.0.1:2002']}
    >>> placement
    {'worker:0': 0, 'ps:0': 0, 'worker:1': 1}
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from typing import Callable, Mapping

from stratagem.transport_kit import handshake
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import AuthenticationError, ConfigurationError, ProtocolError, StratagemError
from stratagem.transport_kit.ports import format_address
from stratagem.core.wire import HEADER_SIZE, Kind, Limits, encode_bytes, read_envelope, read_header

#: The cluster id the rendezvous handshake binds its proofs to (no task's transport uses it).
RDZV_ID = "stratagem-rendezvous"
#: Limits on an admitted node's control frames: metadata only (a cluster, a summary), no buffers.
CHANNEL_LIMITS = Limits(max_envelope_bytes=4 << 20, max_payload_bytes=0, max_buffers=0)
#: Seconds node 0 waits for every node to join (and a node for node 0 to listen), as torchrun's join timeout.
DEFAULT_RDZV_TIMEOUT = 300.0
#: Seconds a node's launcher may be silent (no heartbeat) before the job ends naming it; as the transports' peer timeout.
DEFAULT_NODE_TIMEOUT = 30.0
#: Seconds a connecting node has to finish the handshake and say what it brings.
HANDSHAKE_SECONDS = 10.0
#: Seconds between a node's attempts to reach node 0 while node 0 is not listening yet.
RETRY_SECONDS = 0.5


def node_id(rank: int) -> TaskId:
    """The name a node's launcher has in the rendezvous handshake: ``node:RANK``."""
    return TaskId("node", rank)


def parse_endpoint(text: str, what: str = "--rdzv") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``; a ``ConfigurationError`` naming the fix."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(f"{what} must be HOST:PORT (node 0's address and a free port on it, "
                                 f"e.g. {what} 10.0.0.1:29400), not {text!r}")
    return host, int(port)


def assemble_cluster(joins: Mapping[int, Mapping]) -> tuple[ClusterSpec, dict[str, int]]:
    """One cluster from every node's join (``address``, ``ports``, ``workers``, ``ps``), numbered
    node-major: node 0's workers first, then node 1's, ...; the same for ps tasks. The chief is
    ``worker:0`` (on node 0). Returns the cluster and each task's node (``{"worker:1": 1}``)."""
    jobs: dict[str, list[str]] = {"worker": [], "ps": []}
    placement: dict[str, int] = {}
    for rank in sorted(joins):
        join = joins[rank]
        ports = iter(join["ports"])
        for job, count in (("worker", "workers"), ("ps", "ps")):
            for _ in range(join[count]):
                placement[f"{job}:{len(jobs[job])}"] = rank
                jobs[job].append(format_address(join["address"], next(ports)))
    return ClusterSpec({job: addresses for job, addresses in jobs.items() if addresses}), placement


class RendezvousError(StratagemError):
    """The nodes could not assemble (one never joined, node 0 gave up): the launcher exits 1."""


class ChannelClosed(Exception):
    """The other end of a control channel is gone (the text says how)."""


class Channel:
    """One control connection between node 0 and another node's launcher: whole frames both ways.

    Sends come from any thread (a lock keeps frames whole; a peer that takes no data for
    ``send_timeout`` seconds counts as gone). :meth:`start` runs a reader thread that puts
    ``(peer, tag, meta)`` on a queue (``tag`` None and ``meta`` the reason when the connection ends)
    and a heartbeat thread, so that :attr:`last_heard` says how long the peer has been silent.
    """

    def __init__(self, sock: socket.socket, peer: int, send_timeout: float = 30.0):
        sock.settimeout(None)
        self.sock = sock
        self.peer = peer
        self.last_heard = time.monotonic()
        self._send_timeout = send_timeout
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- frames ----------------------------------------------------------------------------------

    def send(self, tag: str, meta: dict | None = None, kind: Kind = Kind.DATA) -> None:
        """Send one frame; raises ``ChannelClosed`` if the peer cannot take it."""
        data = memoryview(encode_bytes(kind, tag, meta or {}, limits=CHANNEL_LIMITS))
        with self._lock:
            if self._closed.is_set():
                raise ChannelClosed("the channel is closed")
            # The socket stays blocking (the reader thread blocks in recv); sends wait with select, so
            # that a peer that takes nothing cannot hold us past the send timeout.
            # A frame cut short would break the stream: a peer that takes nothing for that long is gone.
            deadline = time.monotonic() + self._send_timeout
            while data:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    raise ChannelClosed(f"the peer took no data for {self._send_timeout:g}s")
                try:
                    if select.select([], [self.sock], [], wait)[1]:
                        data = data[self.sock.send(data, socket.MSG_DONTWAIT):]
                except BlockingIOError:
                    continue
                except (OSError, ValueError) as exc:  # ValueError: closed under us
                    raise ChannelClosed(f"cannot send ({exc})") from None

    def try_send(self, tag: str, meta: dict | None = None) -> bool:
        """:meth:`send`, saying False instead of raising when the peer is gone."""
        try:
            self.send(tag, meta)
            return True
        except ChannelClosed:
            return False

    def recv(self, timeout: float | None, limits: Limits = CHANNEL_LIMITS) -> tuple[Kind, str, dict]:
        """The next frame ``(kind, tag, meta)``; ``ChannelClosed`` at the end of the connection or after
        ``timeout`` seconds without a whole frame; ``ProtocolError`` for a frame that breaks the rules."""
        deadline = None if timeout is None else time.monotonic() + timeout
        header = read_header(self._read(HEADER_SIZE, deadline), limits)
        if header.payload_len:
            raise ProtocolError("control frames carry no buffers")
        tag, meta, _ = read_envelope(header, self._read(header.envelope_len, deadline), limits)
        self.last_heard = time.monotonic()
        return header.kind, tag, meta

    def _read(self, size: int, deadline: float | None) -> bytes:
        chunks, left = [], size
        while left:
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    raise ChannelClosed("timed out waiting for the peer")
                try:
                    if not select.select([self.sock], [], [], wait)[0]:
                        continue
                except (OSError, ValueError) as exc:  # ValueError: closed under us
                    raise ChannelClosed(f"connection lost ({exc})") from None
            try:
                chunk = self.sock.recv(min(left, 1 << 16))
            except OSError as exc:
                raise ChannelClosed(f"connection lost ({exc})") from None
            if not chunk:
                raise ChannelClosed("connection closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    # -- a running job ----------------------------------------------------------------------------

    def start(self, events: "queue.Queue", heartbeat: float, send_timeout: float) -> None:
        """Read frames into ``events`` and send a heartbeat every ``heartbeat`` seconds, until closed;
        a send that makes no progress for ``send_timeout`` seconds ends the channel."""
        self._send_timeout = send_timeout
        self.last_heard = time.monotonic()
        for target, args in ((self._read_loop, (events,)), (self._beat_loop, (heartbeat,))):
            thread = threading.Thread(target=target, args=args, name=f"rdzv-node{self.peer}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read_loop(self, events: "queue.Queue") -> None:
        while not self._closed.is_set():
            try:
                _, tag, meta = self.recv(None)
            except (ChannelClosed, ProtocolError) as exc:
                if not self._closed.is_set():
                    events.put((self.peer, None, str(exc)))
                return
            if tag != "hb":
                events.put((self.peer, tag, meta))

    def _beat_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if not self.try_send("hb"):
                return

    def restart_silence(self) -> None:
        """Count the peer's silence from now: we were not looking (this process was stopped, or busy
        stopping its tasks), so what we did not see says nothing about the peer."""
        self.last_heard = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the last frame from the peer (a heartbeat counts)."""
        return time.monotonic() - self.last_heard

    def close(self, linger: float = 0.0) -> None:
        """Close the connection. ``linger`` > 0: first say we are done sending and wait up to that long
        for the peer to close its end, so that what we sent last (the job's summary) is not lost to a
        reset when unread heartbeats are still on our side."""
        if linger > 0 and not self._closed.is_set():
            with self._lock:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            reader = self._threads[0] if self._threads else None
            if reader is not None and reader is not threading.current_thread():
                reader.join(timeout=linger)
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)


# -- node 0 ------------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """Node 0's rendezvous socket on ``host:port``; a ``ConfigurationError`` if it cannot be bound."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, socket.gaierror) as exc:
        raise ConfigurationError(f"--rdzv {host}:{port}: cannot resolve {host!r} ({exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"--rdzv {host}:{port}: node 0 cannot listen there ({exc}); give an address "
                                 f"of node 0 and a free port") from None
    return sock


def admit(sock: socket.socket, secret: bytes, nnodes: int, joined: Mapping[int, object]) -> tuple[Channel, dict, float]:
    """Run the handshake with one connecting node: check its proof of the secret and its join.

    Returns its channel, its join and its clock's offset from ours (seconds, by one round trip).
    Raises ``AuthenticationError``/``ProtocolError``/``ChannelClosed`` (after telling the node why,
    where it got that far); the caller closes the socket then.
    """
    channel = Channel(sock, -1, send_timeout=HANDSHAKE_SECONDS)
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    me = node_id(0)
    kind, _, hello = channel.recv(deadline - time.monotonic(), handshake.CONTROL_LIMITS)
    if kind != Kind.HELLO:
        raise ProtocolError("the first frame is not a HELLO")
    peer = handshake.check_hello(hello, RDZV_ID, secret)
    if peer.job != "node" or not 0 < peer.index < nnodes:
        reason = (f"node rank {peer.index} is out of range for --nnodes {nnodes} (ranks 1..{nnodes - 1} join "
                  f"node 0): give each node a distinct --node-rank below --nnodes")
        reject(channel, reason)
        raise ProtocolError(reason)
    channel.peer = peer.index
    challenge, nonce_s = handshake.make_challenge(secret, RDZV_ID, peer, me, hello["nonce"])
    channel.send("challenge", challenge, Kind.CHALLENGE)
    kind, _, auth = channel.recv(deadline - time.monotonic(), handshake.CONTROL_LIMITS)
    if kind == Kind.REJECT:
        raise AuthenticationError(f"node {peer.index} refused node 0: {auth.get('reason', 'no reason given')}")
    if kind != Kind.AUTH:
        raise ProtocolError("expected AUTH")
    try:
        handshake.check_auth(secret, RDZV_ID, peer, me, hello["nonce"], nonce_s, auth)
    except AuthenticationError:
        reason = (f"node {peer.index} failed the cluster-secret challenge: the secrets differ; give every node "
                  f"the same STRATAGEM_SECRET (or --secret-file)")
        reject(channel, reason)
        raise AuthenticationError(reason) from None
    if peer.index in joined:
        reason = f"node rank {peer.index} has joined already: give each node a distinct --node-rank"
        reject(channel, reason)
        raise ProtocolError(reason)
    sent = time.time()
    channel.send("welcome", {"time": sent}, Kind.WELCOME)
    _, tag, join = channel.recv(deadline - time.monotonic())
    received = time.time()
    if tag != "join":
        raise ProtocolError(f"expected the node's join, got {tag!r}")
    problem = _check_join(join, nnodes)
    if problem:
        reject(channel, problem)
        raise ProtocolError(problem)
    offset = float(join["time"]) - (sent + received) / 2
    return channel, join, offset


def gather(listener: socket.socket, secret: bytes, nnodes: int, joins: dict[int, dict], deadline: float,
           check: Callable[[dict], str | None], log: Callable[[str], None]) -> tuple[dict[int, Channel], dict[int, float]]:
    """Node 0: admit nodes on ``listener`` until all ``nnodes`` have joined (``joins`` holds node 0's own
    and gets each admitted node's); returns their channels and clock offsets. Each connection runs its
    handshake in a thread of its own, so a stranger that connects and says nothing holds up no one.
    ``check(join)`` may refuse a node (a reason); ``log`` tells the user of each refusal and arrival.
    Raises ``RendezvousError`` (the admitted nodes are told why) if ``deadline`` passes first."""
    results: queue.Queue = queue.Queue()
    over = threading.Event()
    lock = threading.Lock()
    channels: dict[int, Channel] = {}
    offsets: dict[int, float] = {}

    def handshake_with(sock: socket.socket, peer_address: str) -> None:
        try:
            outcome = admit(sock, secret, nnodes, dict(joins))
        except (ProtocolError, ChannelClosed, ConfigurationError) as exc:
            outcome = exc
        with lock:
            if not over.is_set():
                results.put((sock, peer_address, outcome))
                return
        _turn_away(sock, outcome, "the rendezvous is over")

    try:
        while len(joins) < nnodes:
            try:
                sock, peer_address, outcome = results.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = ", ".join(str(r) for r in range(nnodes) if r not in joins)
                    raise RendezvousError(
                        f"only {len(joins)} of {nnodes} nodes joined the rendezvous within the --rdzv-timeout "
                        f"(missing node(s) {missing}): start them with --nnodes {nnodes}, the same --rdzv and the "
                        f"same secret") from None
                listener.settimeout(min(left, 0.1))
                try:
                    sock, (peer_address, *_) = listener.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=handshake_with, args=(sock, peer_address), name="rdzv-admit",
                                 daemon=True).start()
                continue
            if isinstance(outcome, Exception):
                log(f"refused a node connecting from {peer_address}: {outcome}")
                sock.close()
                continue
            channel, join, offset = outcome
            problem = (f"node rank {channel.peer} has joined already: give each node a distinct --node-rank"
                       if channel.peer in joins else check(join))
            if problem is not None:
                log(f"refused a node connecting from {peer_address}: {problem}")
                _turn_away(sock, outcome, problem)
                continue
            joins[channel.peer], channels[channel.peer], offsets[channel.peer] = join, channel, offset
            log(f"node {channel.peer} joined from {join['address']} ({join['workers']} worker(s), {join['ps']} ps)")
        return channels, offsets
    except BaseException as exc:
        for channel in channels.values():
            reject(channel, str(exc) if isinstance(exc, RendezvousError) else "node 0 gave up the rendezvous")
            channel.close()
        raise
    finally:
        with lock:
            over.set()
        while not results.empty():  # handshakes that finished after the last look
            sock, _, outcome = results.get_nowait()
            _turn_away(sock, outcome, "the rendezvous is over")


def _turn_away(sock: socket.socket, outcome, reason: str) -> None:
    """Refuse (if it got as far as a channel) and close a connection node 0 will not use."""
    if not isinstance(outcome, Exception):
        reject(outcome[0], reason)
    sock.close()


def _check_join(join: dict, nnodes: int) -> str | None:
    if join.get("nnodes") != nnodes:
        return (f"node {join.get('rank')} was started with --nnodes {join.get('nnodes')}, node 0 with --nnodes "
                f"{nnodes}: give every node the same --nnodes")
    for name in ("workers", "ps"):
        if not isinstance(join.get(name), int) or join[name] < 0:
            return f"node {join.get('rank')} sent no valid {name} count"
    ports = join.get("ports")
    if (not isinstance(ports, list) or len(ports) != join["workers"] + join["ps"]
            or not all(isinstance(p, int) and 0 < p < 65536 for p in ports)):
        return f"node {join.get('rank')} sent no valid port list"
    if not isinstance(join.get("address"), str) or not join["address"]:
        return f"node {join.get('rank')} sent no address"
    if not isinstance(join.get("time"), (int, float)):
        return f"node {join.get('rank')} sent no clock reading"
    return None


def reject(channel: Channel, reason: str) -> None:
    """Tell the node at the other end of ``channel`` why it is refused (if it still listens)."""
    try:
        channel.send("reject", {"reason": reason}, Kind.REJECT)
    except (ChannelClosed, ProtocolError):
        pass


# -- the other nodes -----------------------------------------------------------------------------------


def connect(host: str, port: int, deadline: float) -> socket.socket:
    """A connection to node 0's rendezvous, retried until ``deadline`` (node 0 may start later)."""
    last = None
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as exc:
            last = exc
        if time.monotonic() + RETRY_SECONDS >= deadline:
            raise ConfigurationError(f"cannot reach node 0's rendezvous at {host}:{port} ({last}); start node 0 "
                                     f"with --node-rank 0 and the same --rdzv, or raise --rdzv-timeout")
        time.sleep(RETRY_SECONDS)


def introduce(sock: socket.socket, rank: int, secret: bytes) -> Channel:
    """This node's side of the handshake (up to node 0's WELCOME); an ``AuthenticationError`` naming
    the fix if the secrets differ or node 0 refuses us."""
    channel = Channel(sock, 0, send_timeout=HANDSHAKE_SECONDS)
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    me, node0 = node_id(rank), node_id(0)
    hello, nonce_c = handshake.make_hello(me, RDZV_ID, secret)
    channel.send("hello", hello, Kind.HELLO)
    kind, _, challenge = channel.recv(deadline - time.monotonic(), handshake.CONTROL_LIMITS)
    if kind == Kind.REJECT:
        raise ConfigurationError(f"node 0 refused this node: {challenge.get('reason')}")
    if kind != Kind.CHALLENGE or not handshake.answers_hello(challenge, nonce_c):
        raise ProtocolError("node 0 did not answer the HELLO with its challenge")
    try:
        auth = handshake.answer_challenge(secret, RDZV_ID, me, node0, nonce_c, challenge)
    except AuthenticationError:
        reason = ("node 0 failed the cluster-secret challenge: the secrets differ; give every node the same "
                  "STRATAGEM_SECRET (or --secret-file)")
        reject(channel, reason)
        raise AuthenticationError(reason) from None
    channel.send("auth", auth, Kind.AUTH)
    kind, _, welcome = channel.recv(deadline - time.monotonic(), handshake.CONTROL_LIMITS)
    if kind == Kind.REJECT:
        raise ConfigurationError(f"node 0 refused this node: {welcome.get('reason')}")
    if kind != Kind.WELCOME:
        raise ProtocolError("node 0 did not welcome this node")
    return channel
