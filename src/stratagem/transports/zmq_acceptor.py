"""The accepting side of the ``zmq`` transport (:mod:`stratagem.transports.zmq`): frames that arrive
at this task's ROUTER, the handshake as acceptor (HELLO, then CHALLENGE/AUTH with a cluster secret),
and refusals.

:class:`Acceptor` is a mixin of :class:`~stratagem.transports.zmq.ZmqTransport`; it uses the
transport's mailbox, its peer tables and ``_ensure_peer`` / ``_send_control`` / ``_forget_peer`` /
``_peer_gone``, and runs on whichever thread holds the reader lock.

Data is accepted only on connections that completed the handshake. A malformed or unauthenticated
frame is dropped with a logged reason (the first few per connection, then one in
:data:`_LOG_EVERY`), and the task the frame claims to come from gets a REJECT when it can be told;
the server keeps serving everyone else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..core import handshake, wire
from ..core.cluster import TaskId
from ..core.errors import AuthenticationError, ConfigurationError, ProtocolError
from ..core.transport import Message
from ..core.wire import Kind

log = logging.getLogger("stratagem.transports.zmq")

_LOG_EVERY = 100  # after the first few, log one rejected frame in this many per connection


@dataclass
class Incoming:
    """The state of one connection into our ROUTER, keyed by ZeroMQ's routing id."""

    task: TaskId
    authenticated: bool = False
    nonce_c: bytes = b""
    nonce_s: bytes = b""


class Acceptor:
    """Handles the frames that arrive at the ROUTER (mixed into ``ZmqTransport``)."""

    def _on_frame(self, routing_id: bytes, parts) -> None:
        try:
            frame = wire.decode_parts([p.bytes if i == 0 else p.buffer for i, p in enumerate(parts)],
                                      self.limits)
        except ProtocolError as exc:
            self._reject(routing_id, f"malformed frame: {exc}")
            return
        conn = self._incoming.get(routing_id)
        if frame.kind == Kind.DATA:
            if conn is None or not conn.authenticated:
                self._reject(routing_id, "data before the handshake completed (unauthenticated connection)")
                return
            self.stats["data_frames"] += 1
            self._mailbox.put(conn.task, frame.tag, Message(frame.meta, frame.buffers, conn.task))
        elif frame.kind == Kind.HELLO:
            self._on_hello(routing_id, frame.meta)
        elif frame.kind == Kind.CHALLENGE:
            self._on_challenge(frame.meta)
        elif frame.kind == Kind.AUTH:
            self._on_auth(routing_id, conn, frame.meta)
        elif frame.kind == Kind.REJECT:
            self._on_reject(frame.meta)
        elif frame.kind == Kind.GOODBYE:
            if conn is not None and conn.authenticated:
                del self._incoming[routing_id]
                self._peer_gone(conn.task, f"{conn.task} closed its transport")
        else:
            self._reject(routing_id, f"unexpected {frame.kind.name} frame")

    def _on_hello(self, routing_id: bytes, meta: dict) -> None:
        try:
            task = handshake.check_hello(meta, self._cluster_id, self.secret)
            self.cluster.check(task)
        except (ProtocolError, ConfigurationError) as exc:
            self._reject(routing_id, f"handshake refused: {exc}")
            self._tell_rejected(meta, str(exc))
            return
        if self._mailbox.is_lost(task) is not None:
            self._forget_peer(task)  # a new incarnation: drop the connection to the old one
        if self.secret is None:
            self._incoming[routing_id] = Incoming(task, authenticated=True)
            self._mailbox.mark_alive(task)
            self._ensure_peer(task)  # connect back, so that we notice if it dies
            return
        challenge, nonce_s = handshake.make_challenge(self.secret, self._cluster_id, task, self.task,
                                                      meta["nonce"])
        self._incoming[routing_id] = Incoming(task, False, meta["nonce"], nonce_s)
        self._send_control(self._ensure_peer(task), Kind.CHALLENGE, challenge)

    def _on_challenge(self, meta: dict) -> None:
        try:
            acceptor = TaskId.parse(meta.get("task", ""))
        except ConfigurationError:
            log.warning("%s: CHALLENGE without a valid task; ignored", self.task)
            return
        peer = self._peers.get(acceptor)
        if peer is None or peer.ready.is_set() or not handshake.answers_hello(meta, peer.nonce):
            log.warning("%s: a CHALLENGE from %s that answers no HELLO of ours; ignored", self.task, acceptor)
            return
        try:
            auth = handshake.answer_challenge(self.secret, self._cluster_id, self.task, acceptor,
                                              peer.nonce, meta)
        except ProtocolError as exc:
            log.warning("%s: %s", self.task, exc)
            peer.fail(exc)
            return
        self._send_control(peer, Kind.AUTH, auth)
        peer.ready.set()

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
            return
        conn.authenticated = True
        self._mailbox.mark_alive(conn.task)

    def _on_reject(self, meta: dict) -> None:
        reason = meta.get("reason") if isinstance(meta.get("reason"), str) else "no reason given"
        try:
            by = TaskId.parse(meta.get("task", ""))
        except ConfigurationError:
            log.warning("%s: a peer refused our connection: %s", self.task, reason)
            return
        log.warning("%s: %s refused our connection: %s", self.task, by, reason)
        peer = self._peers.get(by)
        # Only a REJECT that answers our own HELLO (it echoes our nonce) may fail the connection,
        # so nobody can break an honest connection by claiming to be refused in its name.
        if peer is not None and meta.get("nonce") == peer.nonce:
            error_type = AuthenticationError if "secret" in reason.lower() else ProtocolError
            peer.fail(error_type(f"{by} refused the connection: {reason}"))

    def _tell_rejected(self, hello: dict, reason: str) -> None:
        """Send a REJECT to the task a refused HELLO claims to be, so it fails fast with the reason."""
        try:
            task = self.cluster.check(TaskId.parse(hello.get("task", "")))
        except (ConfigurationError, AttributeError):
            return
        if task != self.task:
            self._send_control(self._ensure_peer(task), Kind.REJECT,
                               {"task": self.task.short, "reason": reason, "nonce": hello.get("nonce")})

    def _reject(self, routing_id: bytes, reason: str) -> None:
        self.stats["rejected_frames"] += 1
        count = self._rejected[routing_id] = self._rejected.get(routing_id, 0) + 1
        if count <= 3 or count % _LOG_EVERY == 0:
            conn = self._incoming.get(routing_id)
            who = str(conn.task) if conn else f"connection {routing_id.hex()}"
            log.warning("%s: dropped a frame from %s (%d so far): %s", self.task, who, count, reason)
