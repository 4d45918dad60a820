"""The accepting side of the ``zmq`` transport (:mod:`stratagem.transports.zmq`): messages that
arrive at this task's ROUTER, the handshake as acceptor (HELLO, then CHALLENGE/AUTH with a cluster
secret, then WELCOME), and refusals.

:class:`Acceptor` is a mixin of :class:`~stratagem.transports.zmq.ZmqTransport`; it uses the
transport's mailbox, its peer tables and ``_ensure_peer`` / ``_forget_peer`` / ``_peer_gone``, and
runs on whichever thread holds the reader lock (the only thread that touches the ROUTER).

Every answer (CHALLENGE, WELCOME, REJECT) goes back on the connection the HELLO came in on, never
to the task a HELLO *claims* to be: a forged HELLO gets its answer itself, and the task it names
hears nothing. Data is accepted only on connections that completed the handshake. A malformed or
unauthenticated message is dropped with a logged reason (the first few per connection, then one in
:data:`_LOG_EVERY`) and, for a refused handshake, a REJECT with the reason; the server keeps serving
everyone else.

Messages on a connection into the ROUTER have one of four shapes (see the transport's docstring):
a whole frame in one part (header, envelope and buffers, as :func:`stratagem.core.wire.encode_bytes`
makes it: small messages); a whole frame ``[head, buffer...]``; a stream piece ``[b"", piece]`` of a frame too large for one
part, fed to the connection's :class:`~stratagem.transports.grpc_framing.Reassembler`; and the
no-op ``[b""]`` that ``flush`` sends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from ..core import handshake, wire
from ..core.cluster import TaskId
from ..core.errors import ConfigurationError, ProtocolError
from ..core.transport import Message
from ..core.wire import Kind
from .grpc_framing import CONTROL_LIMITS, Reassembler

log = logging.getLogger("stratagem.transports.zmq")

_LOG_EVERY = 100  # after the first few, log one rejected frame in this many per connection


@dataclass
class Incoming:
    """The state of one connection into our ROUTER, keyed by ZeroMQ's routing id."""

    task: TaskId
    authenticated: bool = False
    nonce_c: bytes = b""
    nonce_s: bytes = b""
    #: Reassembles frames that arrive as stream pieces (made on the first piece).
    stream: Reassembler | None = field(default=None, repr=False)


def _source_fd(frame: zmq.Frame) -> int:
    """The socket a received message came in on (ZeroMQ's deprecated but present SRCFD; -1 if not)."""
    try:
        return frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return -1


class Acceptor:
    """Handles the messages that arrive at the ROUTER (mixed into ``ZmqTransport``)."""

    def _on_message(self, routing_id: bytes, parts, id_frame) -> None:
        """One message from the connection ``routing_id`` (its routing-id part ``id_frame`` tells the
        socket it came in on): route it by its shape."""
        conn = self._incoming.get(routing_id)
        if conn is None or not conn.authenticated:
            # Which socket a connection uses is learnt before it is trusted (its HELLO), so that its
            # end can be told apart; afterwards it cannot change, and asking costs a call a message.
            fd = _source_fd(id_frame)
            if fd >= 0:
                self._connection_fds[fd] = routing_id
        if len(parts[0]) == 0:
            if len(parts) == 1:
                return  # flush()'s no-op
            self._on_piece(routing_id, parts)
            return
        if conn is not None and conn.stream is not None and not conn.stream.between_frames:
            self._drop_connection_state(routing_id)
            self._reject(routing_id, "a frame arrived in the middle of a streamed frame")
            return
        trusted = conn is not None and conn.authenticated
        try:
            head = parts[0].buffer
            if not trusted and wire.read_header(head, self.limits).kind == Kind.DATA:
                self._reject(routing_id, "data before the handshake completed (unauthenticated connection)")
                return
            # Before the handshake only small control frames are decoded at all.
            limits = self.limits if trusted else CONTROL_LIMITS
            if len(parts) == 1:  # a whole frame in one part (small messages; control frames)
                frame = wire.decode(head, limits)
            else:
                frame = wire.decode_parts([head, *(p.buffer for p in parts[1:])], limits)
        except ProtocolError as exc:
            self._reject(routing_id, f"malformed frame: {exc}")
            return
        self._on_frame(routing_id, conn, frame)

    def _on_piece(self, routing_id: bytes, parts) -> None:
        conn = self._incoming.get(routing_id)
        if conn is None or not conn.authenticated:
            self._reject(routing_id, "data before the handshake completed (unauthenticated connection)")
            return
        if len(parts) != 2:
            self._reject(routing_id, f"a stream piece in {len(parts)} parts (2 expected)")
            return
        if conn.stream is None:
            conn.stream = Reassembler(self.limits, (Kind.DATA,), "in a streamed frame")
        try:
            conn.stream.feed(parts[1].buffer, lambda frame: self._on_frame(routing_id, conn, frame))
        except ProtocolError as exc:
            conn.stream = None  # the rest of that frame cannot be told from a new one
            self._reject(routing_id, f"malformed streamed frame: {exc}")

    def _on_frame(self, routing_id: bytes, conn: Incoming | None, frame: wire.Frame) -> None:
        if frame.kind == Kind.DATA:
            if conn is None or not conn.authenticated:
                self._reject(routing_id, "data before the handshake completed (unauthenticated connection)")
                return
            self.stats["data_frames"] += 1
            self._mailbox.put(conn.task, frame.tag, Message(frame.meta, frame.buffers, conn.task))
        elif frame.kind == Kind.HELLO:
            self._on_hello(routing_id, conn, frame.meta)
        elif frame.kind == Kind.AUTH:
            self._on_auth(routing_id, conn, frame.meta)
        elif frame.kind == Kind.GOODBYE:
            if conn is not None and conn.authenticated:
                self._drop_connection_state(routing_id)
                self._peer_gone(conn.task, f"{conn.task} closed its transport")
        else:  # CHALLENGE, WELCOME and REJECT answer a HELLO: they come back on our own connections
            self._reject(routing_id, f"unexpected {frame.kind.name} frame")

    def _on_hello(self, routing_id: bytes, conn: Incoming | None, meta: dict) -> None:
        if conn is not None:
            self._reject(routing_id, "a second HELLO on one connection")
            return
        try:
            task = handshake.check_hello(meta, self._cluster_id, self.secret)
            self.cluster.check(task)
        except (ProtocolError, ConfigurationError) as exc:
            self._reject(routing_id, f"handshake refused: {exc}")
            nonce = meta.get("nonce") if isinstance(meta, dict) else None
            self._answer(routing_id, Kind.REJECT, {"task": self.task.short, "reason": str(exc), "nonce": nonce})
            return
        if self.secret is None:
            self._incoming[routing_id] = Incoming(task, authenticated=True)
            self._admit(routing_id, task)
            return
        challenge, nonce_s = handshake.make_challenge(self.secret, self._cluster_id, task, self.task,
                                                      meta["nonce"])
        self._incoming[routing_id] = Incoming(task, False, meta["nonce"], nonce_s)
        self._answer(routing_id, Kind.CHALLENGE, challenge)

    def _on_auth(self, routing_id: bytes, conn: Incoming | None, meta: dict) -> None:
        if conn is None or conn.authenticated or not conn.nonce_s:
            self._reject(routing_id, "AUTH without a pending challenge")
            return
        try:
            handshake.check_auth(self.secret, self._cluster_id, conn.task, self.task, conn.nonce_c,
                                 conn.nonce_s, meta)
        except ProtocolError as exc:
            del self._incoming[routing_id]
            self._reject(routing_id, str(exc))
            self._answer(routing_id, Kind.REJECT, {"task": self.task.short, "reason": str(exc),
                                                   "nonce": conn.nonce_c})
            return
        conn.authenticated = True
        self._admit(routing_id, conn.task)

    def _admit(self, routing_id: bytes, task: TaskId) -> None:
        """``task`` proved who it is on ``routing_id``: welcome it, and watch it from our side."""
        # A task that connects again (an earlier connection of it was accepted too) is a new process:
        # our connection to the old one, if any, must go, or it would reconnect to the new one
        # without a handshake.
        again = any(c.task == task and c.authenticated for rid, c in self._incoming.items() if rid != routing_id)
        if again or self._mailbox.is_lost(task) is not None:
            self._forget_peer(task)
        self._mailbox.mark_alive(task)
        self._answer(routing_id, Kind.WELCOME, {"task": self.task.short})
        self._ensure_peer(task)  # connect back, so that we notice if it dies

    def _answer(self, routing_id: bytes, kind: Kind, meta: dict) -> None:
        """Send a control frame back on the connection ``routing_id`` (dropped if it is gone)."""
        try:
            self._router.send_multipart([routing_id, *wire.encode(kind, "", meta)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("%s: could not answer %s on connection %s: %s", self.task, kind.name, routing_id.hex(), exc)

    def _drop_connection_state(self, routing_id: bytes) -> None:
        conn = self._incoming.get(routing_id)
        if conn is not None:
            conn.stream = None

    def _connection_closed(self, fd: int) -> None:
        """A connection into the ROUTER went away: forget what we kept for it, and say why if it
        never got anywhere (so a peer refused by ZeroMQ for an oversized part leaves a trace)."""
        routing_id = self._connection_fds.pop(fd, None)
        if routing_id is None:
            log.warning("%s: a connection into our ROUTER closed before it delivered a whole message: a "
                        "program that does not speak Stratagem, or a message part over %d bytes before "
                        "authentication, refused by ZeroMQ", self.task, self._part_cap)
            return
        self._rejected.pop(routing_id, None)
        self._drop_connection_state(routing_id)  # a frame it was streaming will never be finished
        conn = self._incoming.get(routing_id)
        if conn is not None and not conn.authenticated:
            del self._incoming[routing_id]
            log.warning("%s: connection %s (claiming to be %s) closed before completing the handshake",
                        self.task, routing_id.hex(), conn.task)
        elif conn is None:
            log.warning("%s: connection %s closed without a handshake", self.task, routing_id.hex())
        # An authenticated connection stays known: frames it sent before going may still be queued.

    def _reject(self, routing_id: bytes, reason: str) -> None:
        count = self._rejected[routing_id] = self._rejected.get(routing_id, 0) + 1
        if count <= 3 or count % _LOG_EVERY == 0:
            conn = self._incoming.get(routing_id)
            who = str(conn.task) if conn else f"connection {routing_id.hex()}"
            log.warning("%s: dropped a frame from %s (%d so far): %s", self.task, who, count, reason)
        self.stats["rejected_frames"] += 1  # counted after the log, so a test that sees it sees both
