"""The accepting side of the ``zmq`` transport (:mod:`stratagem.transports.zmq.transport`): the messages
that arrive at this task's ROUTER, fed to the handshake's state machine
(:mod:`stratagem.transport_kit.acceptor`), whose actions this carries out.

:class:`ZmqAcceptor` is owned by the transport and talks to it only through what it is given: the
mailbox, the counters, and four functions (send a control frame back on a connection, forget our
connection to a task, connect to a task to watch it, and mark a task gone). It runs on whichever
thread holds the transport's reader lock (the only thread that touches the ROUTER).

Every answer (CHALLENGE, WELCOME, REJECT) goes back on the connection the HELLO came in on, never
to the task a HELLO *claims* to be: a forged HELLO gets its answer itself, and the task it names
hears nothing. Data is accepted only on connections that completed the handshake. A malformed or
unauthenticated message is dropped with a logged reason (the first few per connection, then one in
:data:`_LOG_EVERY`) and, when it ends a handshake, a REJECT with the reason; the server keeps
serving everyone else. (A malformed frame from an admitted peer drops that frame only: ZeroMQ
cannot end one connection of a ROUTER, and an admitted peer does not read REJECTs.)

Messages on a connection into the ROUTER have one of four shapes (see the transport's docstring):
a whole frame in one part (header, envelope and buffers, as :func:`stratagem.core.wire.encode_bytes`
makes it: small messages); a whole frame ``[head, buffer...]``; a stream piece ``[b"", piece]`` of a frame too large for one
part, fed to the connection's :class:`~stratagem.transports.framing.Reassembler`; and the
no-op ``[b""]`` that ``flush`` sends.
"""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from stratagem.core.failures import said_goodbye
from stratagem.core import wire
from stratagem.transport_kit.acceptor import DELIVER, Acceptor, Admitted, Connection, Dropped, GaveUp, Left, Refused, Reply
from stratagem.core.cluster import TaskId
from stratagem.core.errors import ProtocolError
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import Message
from stratagem.core.wire import Kind
from stratagem.transports.framing import Reassembler

log = logging.getLogger("stratagem.transports.zmq.transport")

_LOG_EVERY = 100  # after the first few, log one rejected frame in this many per connection
_MAX_ROUTING_ID = 255  # ZeroMQ routing ids are 1 to 255 bytes: a longer first part is not one


def _source_fd(frame) -> int:
    """The socket a received message came in on (ZeroMQ's deprecated but present SRCFD; -1 if not)."""
    try:
        return frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError):
        return -1


class ZmqAcceptor:
    """Handles the messages that arrive at the ROUTER (see the module doc).

    Args:
        acceptor: the handshake's state machine for this task.
        mailbox: where DATA from admitted peers goes.
        stats: the transport's counters (``rejected_frames``, ``data_frames``).
        answer: ``answer(routing_id, kind, meta)`` sends a control frame back on that connection.
        forget_peer: ``forget_peer(task)`` drops our connection to ``task`` (an older process of it).
        watch_peer: ``watch_peer(task)`` connects to ``task``, so that we notice if it dies.
        peer_gone: ``peer_gone(task, reason)`` marks ``task`` lost.
        part_cap: the largest message part the ROUTER takes (for a log message).
    """

    def __init__(self, acceptor: Acceptor, mailbox: Mailbox, stats: dict, *,
                 answer: Callable[[bytes, Kind, dict], None], forget_peer: Callable[[TaskId], None],
                 watch_peer: Callable[[TaskId], object], peer_gone: Callable[[TaskId, str], None], part_cap: int):
        self.acceptor, self.task, self.limits = acceptor, acceptor.task, acceptor.limits
        self._mailbox, self.stats, self._part_cap = mailbox, stats, part_cap
        # What the transport does for us: the ROUTER and our own connections to peers are its.
        self._answer, self._forget_peer, self._watch_peer, self._peer_gone = answer, forget_peer, watch_peer, peer_gone
        self._incoming: dict[bytes, Connection] = {}      # by ZeroMQ's routing id
        self._pieces: dict[bytes, Reassembler] = {}       # frames arriving as stream pieces
        self._rejected: dict[bytes, int] = {}
        self._fds: dict[int, bytes] = {}                  # a connection's socket -> its routing id

    def on_message(self, routing_id: bytes, parts, id_frame) -> None:
        """One message from the connection ``routing_id`` (its routing-id part ``id_frame`` tells the
        socket it came in on): route it by its shape."""
        conn = self._incoming.get(routing_id)
        if conn is not None and conn.open and len(parts) == 1:
            # The usual message: a whole frame in one part from an admitted peer (what the general
            # path below does with it, without the questions it settles for one).
            head = parts[0].buffer
            stream = self._pieces.get(routing_id)
            if len(head) and (stream is None or stream.between_frames):
                try:
                    frame = wire.decode(head, conn.limits)
                except ProtocolError as exc:
                    self.reject(routing_id, f"malformed frame: {exc}")
                    return
                self._on_frame(routing_id, conn, frame)
                return
        if conn is None:
            conn, _ = self.acceptor.connect(routing_id.hex())  # no handshake budget: nothing is cut off
            self._incoming[routing_id] = conn
        if not conn.open:
            # Which socket a connection uses is learnt before it is admitted (its HELLO), so that its
            # end can be told apart; afterwards it cannot change, and asking costs a call a message.
            fd = _source_fd(id_frame)
            if fd >= 0:
                self._fds[fd] = routing_id
        if len(parts[0]) == 0:
            if len(parts) == 1:
                return  # flush()'s no-op
            self._on_piece(routing_id, conn, parts)
            return
        stream = self._pieces.get(routing_id)
        if stream is not None and not stream.between_frames:
            del self._pieces[routing_id]
            self.reject(routing_id, "a frame arrived in the middle of a streamed frame")
            return
        try:
            head = parts[0].buffer
            if not conn.open:
                # Before the handshake only the frames it expects are decoded at all, under its tiny limits.
                kind = wire.read_header(head, self.limits).kind
                if kind not in conn.expects:
                    self._act(routing_id, conn, self.acceptor.on_frame(conn, kind, None))
                    return
            if len(parts) == 1:  # a whole frame in one part (small messages; control frames)
                frame = wire.decode(head, conn.limits)
            else:
                frame = wire.decode_parts([head, *(p.buffer for p in parts[1:])], conn.limits)
        except ProtocolError as exc:
            self.reject(routing_id, f"malformed frame: {exc}")
            return
        self._on_frame(routing_id, conn, frame)

    def _on_piece(self, routing_id: bytes, conn: Connection, parts) -> None:
        if not conn.open:
            self._act(routing_id, conn, self.acceptor.on_frame(conn, Kind.DATA, None))
            return
        if len(parts) != 2:
            self.reject(routing_id, f"a stream piece in {len(parts)} parts (2 expected)")
            return
        stream = self._pieces.get(routing_id)
        if stream is None:
            stream = self._pieces[routing_id] = Reassembler(self.limits, (Kind.DATA,), "in a streamed frame")
        try:
            stream.feed(parts[1].buffer, lambda frame: self._on_frame(routing_id, conn, frame))
        except ProtocolError as exc:
            self._pieces.pop(routing_id, None)  # the rest of that frame cannot be told from a new one
            self.reject(routing_id, f"malformed streamed frame: {exc}")

    def _on_frame(self, routing_id: bytes, conn: Connection, frame: wire.Frame) -> None:
        if frame.kind == Kind.DATA and conn.open:
            self.stats["data_frames"] += 1
            self._mailbox.put(conn.task, frame.tag, Message(frame.meta, frame.buffers, conn.task))
            return
        self._act(routing_id, conn, self.acceptor.on_frame(conn, frame.kind, frame.meta))

    def _act(self, routing_id: bytes, conn: Connection, actions: list) -> None:
        """Carry out what the state machine decided, in order."""
        watch = None
        for action in actions:
            if isinstance(action, Reply):
                self._answer(routing_id, action.kind, action.meta)
            elif isinstance(action, Admitted):
                # A task admitted again is a new process: our connection to the old one, if any, must
                # go, or it would reconnect to the new one without a handshake.
                if action.again or self._mailbox.is_lost(action.task) is not None:
                    self._forget_peer(action.task)
                self._mailbox.mark_alive(action.task, replaced=action.again)
                watch = action.task
            elif isinstance(action, (Refused, Dropped)):
                self.reject(routing_id, action.reason)
            elif isinstance(action, Left):
                self._pieces.pop(routing_id, None)
                self._peer_gone(action.task, said_goodbye(action.task))
            elif isinstance(action, GaveUp):
                log.warning("%s: %s gave up on its connection: %s", self.task, conn.describe(), action.reason)
            elif action is DELIVER:
                raise AssertionError("DATA on an open connection is filed before the state machine is asked")
        if watch is not None:
            self._watch_peer(watch)  # connect back, so that we notice if it dies

    def connection_closed(self, fd: int) -> None:
        """A connection into the ROUTER went away: forget what we kept for it, and say why if it
        never got anywhere (so a peer refused by ZeroMQ for an oversized part leaves a trace)."""
        routing_id = self._fds.pop(fd, None)
        if routing_id is None:
            log.warning("%s: a connection into our ROUTER closed before it delivered a whole message: a "
                        "program that does not speak Stratagem, or a message part over %d bytes before "
                        "authentication, refused by ZeroMQ", self.task, self._part_cap)
            return
        self._rejected.pop(routing_id, None)
        self._pieces.pop(routing_id, None)  # a frame it was streaming will never be finished
        conn = self._incoming.get(routing_id)
        if conn is None or conn.accepted:
            return  # an admitted connection stays known: frames it sent before going may still be queued
        self.acceptor.disconnected(conn)
        del self._incoming[routing_id]
        if conn.task is not None:
            log.warning("%s: connection %s (claiming to be %s) closed before completing the handshake",
                        self.task, routing_id.hex(), conn.task)
        else:
            log.warning("%s: connection %s closed without a handshake", self.task, routing_id.hex())

    def reject(self, routing_id: bytes, reason: str) -> None:
        """Drop a frame from ``routing_id`` for ``reason``: count it, and log it (the first few)."""
        if len(routing_id) > _MAX_ROUTING_ID:
            # Not a connection's id: the rest of a message whose first parts were lost (an exception
            # took them halfway through the read). Logged once per kind, never kept as a connection.
            routing_id = b"<the rest of a message>"
        count = self._rejected[routing_id] = self._rejected.get(routing_id, 0) + 1
        if count <= 3 or count % _LOG_EVERY == 0:
            conn = self._incoming.get(routing_id)
            who = (str(conn.task) if conn is not None and conn.task else
                   f"connection {routing_id.hex()}" if not routing_id.startswith(b"<") else routing_id.decode())
            log.warning("%s: dropped a frame from %s (%d so far): %s", self.task, who, count, reason)
        self.stats["rejected_frames"] += 1  # counted after the log, so a test that sees it sees both
