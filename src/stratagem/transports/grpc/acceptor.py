"""The accepting side of the ``grpc`` transport (:mod:`stratagem.transports.grpc.transport`): the server's one
method, the handshake as acceptor, and frames from peers into the mailbox.

:class:`Acceptor` is a mixin of :class:`~stratagem.transports.grpc.transport.GrpcTransport`; it uses the
transport's mailbox, locks and peer tables, and its ``_declare_lost`` and ``_retire``.

Each incoming stream gets a reader thread that consumes the requests (under the handshake's tiny
limits until the peer is accepted), while the gRPC server thread that runs the method only sends
the responses the reader queues (CHALLENGE, WELCOME, REJECT, GOODBYE). A refused stream gets a
REJECT with the reason and then an error status (UNAUTHENTICATED for handshake and secret failures,
INVALID_ARGUMENT for malformed or oversized frames); the reason is logged. Streams still in their
handshake have a budget of ``max_workers``: a new one that finds it full cuts off the oldest
(RESOURCE_EXHAUSTED, which a task's transport answers by trying again), so connections that never
complete a handshake cannot hold the server's call slots.
"""

from __future__ import annotations

import logging
import threading

import grpc

from stratagem.core import handshake, wire
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.core.transport import Message
from stratagem.core.wire import Kind
from stratagem.transports.framing import CONTROL_LIMITS, Reassembler, frame_bytes
from stratagem.transports.grpc.streams import Abort, Incoming

log = logging.getLogger("stratagem.transports.grpc.transport")

_LOG_EVERY = 100  # after the first few, log one refused stream in this many


class Acceptor:
    """Serves the streams other tasks open to this one (mixed into ``GrpcTransport``)."""

    def _serve_stream(self, requests, context):
        """The server's method: one call per incoming stream. A reader thread consumes the requests;
        this generator (on a gRPC server thread) sends the responses it queues."""
        conn = Incoming(requests, context)
        with self._lock:
            if self._closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.task} is shutting down")
            self._streams.add(conn)
            self._handshaking[conn] = None
            # The oldest unfinished handshake gives way: a task's own completes in a round trip or
            # two, so only connections that idle (or flood) are cut off, and a task's is retried.
            oldest = next(iter(self._handshaking)) if len(self._handshaking) > self._max_workers else None
        if oldest is not None:
            self._cut_off(oldest, f"{self._max_workers} connections are waiting for their handshake; "
                                  f"the oldest gives way")
        context.add_callback(lambda: conn.out.put(None))
        conn.timer = timer = threading.Timer(self._handshake_timeout, self._handshake_expired, args=(conn,))
        timer.daemon = True
        timer.start()
        threading.Thread(target=self._read_stream, args=(conn,), daemon=True,
                         name=f"stratagem-grpc-{self.task.short}-from-{conn.peer}").start()
        try:
            while True:
                item = conn.out.get()
                if item is None:
                    return
                if isinstance(item, Abort):
                    context.abort(item.code, item.details)
                yield item
        finally:
            timer.cancel()
            with self._lock:
                self._streams.discard(conn)
                self._handshaking.pop(conn, None)

    def _handshake_expired(self, conn: Incoming) -> None:
        if not conn.accepted and not conn.ended.is_set():
            self._refuse(conn, f"no handshake within {self._handshake_timeout:g} s")

    def _read_stream(self, conn: Incoming) -> None:
        reassembler = Reassembler(CONTROL_LIMITS, (Kind.HELLO,), "before the handshake completed "
                                  "(unauthenticated connection)")
        broken = None
        try:
            for message in conn.requests:
                reassembler.feed(message, lambda frame: self._on_frame(conn, frame, reassembler))
                if conn.refused:
                    break
            else:
                if not conn.accepted and not reassembler.between_frames:
                    self._refuse(conn, "malformed frame: the stream ended in the middle of a frame")
        except grpc.RpcError as exc:
            broken = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc)
        except ProtocolError as exc:
            self._refuse(conn, f"malformed frame: {exc}")
        except Exception as exc:  # a bad stream must never take the server down
            log.debug("stream handler error", exc_info=True)
            self._refuse(conn, f"error while handling a frame: {type(exc).__name__}: {exc}")
        finally:
            conn.ended.set()
            conn.out.put(None)
        if conn.accepted and not conn.goodbye and not conn.refused and not self._closed:
            if broken is None and not reassembler.between_frames:
                broken = "it ended in the middle of a frame"
            how = broken or "it ended without a goodbye"
            self._declare_lost(conn.task, f"connection from {conn.task} was lost ({how}; the process died, or "
                                          f"the network failed)", conn.epoch)

    def _on_frame(self, conn: Incoming, frame: wire.Frame, reassembler: Reassembler) -> None:
        if conn.refused:
            return
        if frame.kind == Kind.DATA:
            with self._stats_lock:
                self.stats["data_frames"] += 1
            self._mailbox.put(conn.task, frame.tag, Message(frame.meta, frame.buffers, conn.task))
        elif frame.kind == Kind.HELLO:
            self._on_hello(conn, frame.meta, reassembler)
        elif frame.kind == Kind.AUTH:
            try:
                handshake.check_auth(self.secret, self._cluster_id, conn.task, self.task, conn.nonce_c,
                                     conn.nonce_s, frame.meta)
            except ProtocolError as exc:
                self._refuse(conn, str(exc))
                return
            self._accept(conn, reassembler)
        elif frame.kind == Kind.GOODBYE:
            conn.goodbye = True
            reassembler.expect((), why="after GOODBYE")
            self._declare_lost(conn.task, f"{conn.task} closed its transport", conn.epoch)
        elif frame.kind == Kind.REJECT:
            reason = frame.meta.get("reason")
            log.warning("%s: %s gave up on its connection: %s", self.task, conn.describe(), reason)
            conn.refused = True
            conn.out.put(None)

    def _on_hello(self, conn: Incoming, meta: dict, reassembler: Reassembler) -> None:
        try:
            task = handshake.check_hello(meta, self._cluster_id, self.secret)
            self.cluster.check(task)
            if task == self.task:
                raise ProtocolError(f"{task} is this task itself (two processes run the same task?)")
        except (ProtocolError, ConfigurationError) as exc:
            self._refuse(conn, f"handshake refused: {exc}", nonce=meta.get("nonce"))
            return
        conn.task, conn.nonce_c = task, meta["nonce"]
        if self.secret is None:
            self._accept(conn, reassembler)
            return
        challenge, conn.nonce_s = handshake.make_challenge(self.secret, self._cluster_id, task, self.task,
                                                           conn.nonce_c)
        reassembler.expect((Kind.AUTH, Kind.REJECT), why="in answer to CHALLENGE")
        conn.out.put(frame_bytes(wire.encode(Kind.CHALLENGE, "", challenge)))

    def _accept(self, conn: Incoming, reassembler: Reassembler) -> None:
        task = conn.task
        with self._lock:
            if self._closed:
                return
            # A new stream from a task replaces the old one: a new incarnation (or a reconnection),
            # so losses pending for the old one no longer apply.
            conn.epoch = self._epochs[task] = self._epochs.get(task, 0) + 1
            self._incoming[task] = conn
            conn.accepted = True
            self._handshaking.pop(conn, None)
            conn.timer.cancel()
            was_lost = self._mailbox.is_lost(task) is not None
            self._mailbox.mark_alive(task)
            old = self._peers.pop(task, None) if was_lost else None
        if old is not None:
            self._retire(old)
        reassembler.expect((Kind.DATA, Kind.GOODBYE), self.limits)
        conn.out.put(frame_bytes(wire.encode(Kind.WELCOME, "", {"task": self.task.short})))

    def _cut_off(self, conn: Incoming, reason: str) -> None:
        """End a stream still in its handshake to make room for a newer one. RESOURCE_EXHAUSTED, and no
        REJECT, tells a task's transport to try again (see ``GrpcTransport.send_async``)."""
        with self._lock:
            if conn.refused or conn.accepted or conn not in self._handshaking:
                return
            del self._handshaking[conn]
            conn.refused = True
        with self._stats_lock:
            self.stats["cut_off_handshakes"] += 1
            count = self.stats["cut_off_handshakes"]
        if count <= 20 or count % _LOG_EVERY == 0:
            log.warning("%s: cut off %s before its handshake completed: %s", self.task, conn.describe(), reason)
        conn.out.put(Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason))

    def _refuse(self, conn: Incoming, reason: str, nonce=None) -> None:
        """Tell the stream's owner why it is refused, end the stream with an error, log the reason."""
        if conn.refused:
            return
        conn.refused = True
        with self._lock:
            self._handshaking.pop(conn, None)
        with self._stats_lock:
            self.stats["rejected_frames"] += 1
            count = self.stats["rejected_frames"]
        if count <= 20 or count % _LOG_EVERY == 0:
            log.warning("%s: refused a frame from %s and closed its stream: %s", self.task, conn.describe(),
                        reason)
        meta = {"task": self.task.short, "reason": reason}
        if isinstance(nonce, bytes):
            meta["nonce"] = nonce
        code = (grpc.StatusCode.UNAUTHENTICATED if "secret" in reason.lower() or "handshake" in reason.lower()
                else grpc.StatusCode.INVALID_ARGUMENT)
        conn.out.put(frame_bytes(wire.encode(Kind.REJECT, "", meta)))
        conn.out.put(Abort(code, reason[:1000]))
