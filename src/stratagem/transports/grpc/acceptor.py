"""The accepting side of the ``grpc`` transport (:mod:`stratagem.transports.grpc.transport`): the server's one
method, whose streams are fed to the handshake's state machine (:mod:`stratagem.transport_kit.acceptor`), and
frames from admitted peers into the mailbox.

:class:`GrpcAcceptor` is owned by the transport and talks to it only through what it is given: the
mailbox, the transport's lock (which also guards its peers, so that admitting a task and declaring
it lost never interleave), and three functions (take our outgoing stream to a task, retire such a
stream, declare a task lost).

Each incoming stream gets a reader thread that consumes the requests (under the handshake's tiny
limits until the peer is admitted), while the gRPC server thread that runs the method only sends
the responses the reader queues (CHALLENGE, WELCOME, REJECT, GOODBYE). A refused stream gets a
REJECT with the reason and then an error status (UNAUTHENTICATED for handshake and secret failures,
INVALID_ARGUMENT for malformed or oversized frames); the reason is logged. Streams still in their
handshake have a budget of ``slots`` (the transport's ``max_workers``): a new one that finds it full
cuts off the oldest (RESOURCE_EXHAUSTED, which a task's transport answers by trying again), so
connections that never complete a handshake cannot hold the server's call slots.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from stratagem.core.failures import said_goodbye
from stratagem.core import wire
from stratagem.transport_kit.acceptor import DELIVER, Acceptor, Admitted, CutOff, GaveUp, Left, Refused, Reply
from stratagem.core.cluster import TaskId
from stratagem.core.errors import ProtocolError
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import Message
from stratagem.core.wire import Kind
from stratagem.transports.framing import Reassembler, frame_bytes
from stratagem.transports.grpc.streams import Abort, Incoming

log = logging.getLogger("stratagem.transports.grpc.transport")

_LOG_EVERY = 100  # after the first few, log one refused stream in this many


class GrpcAcceptor:
    """Serves the streams other tasks open to this one (see the module doc).

    Args:
        acceptor: the handshake's state machine for this task (its ``slots``: the handshake budget).
        mailbox: where DATA from admitted peers goes.
        lock: the transport's lock; the state machine is only ever called under it.
        handshake_timeout: seconds a stream may take to complete its handshake.
        take_peer: ``take_peer(task)`` removes and returns our outgoing stream to ``task`` (or None);
            called under ``lock`` when a task that was lost is admitted again.
        retire: ``retire(peer)`` ends such a stream.
        declare_lost: ``declare_lost(task, reason, epoch)`` marks ``task`` lost, unless it was admitted
            again since its admission ``epoch``.
    """

    def __init__(self, acceptor: Acceptor, mailbox: Mailbox, *, lock, handshake_timeout: float,
                 take_peer: Callable[[TaskId], object], retire: Callable[[object], None],
                 declare_lost: Callable[[TaskId, str, int], None]):
        self.acceptor, self.task = acceptor, acceptor.task
        self._mailbox, self._lock, self._handshake_timeout = mailbox, lock, handshake_timeout
        # What the transport does for us: our own streams to peers, and the losses, are its.
        self._take_peer, self._retire, self._declare_lost = take_peer, retire, declare_lost
        self._streams: set[Incoming] = set()
        self._closing = False
        self._stats_lock = threading.Lock()
        #: Counters: frames and streams refused, streams cut off in their handshake to make room for
        #: newer ones, data frames received.
        self.stats = {"rejected_frames": 0, "cut_off_handshakes": 0, "data_frames": 0}

    # -- what the transport asks (under its lock) ------------------------------------------------------
    def epoch(self, task: TaskId) -> int:
        """How many times ``task`` was admitted (see :class:`~stratagem.transport_kit.acceptor.Admitted`)."""
        return self.acceptor.epoch(task)

    def receiving(self, task: TaskId) -> bool:
        """True while ``task``'s latest admitted stream is still being read."""
        conn = self.acceptor.current(task)
        return conn is not None and not conn.link.ended.is_set()

    def shut(self) -> list[Incoming]:
        """Accept nothing more (under the transport's lock); the streams still open, to end."""
        self._closing = True
        return list(self._streams)

    # -- the server's method ---------------------------------------------------------------------------
    def serve_stream(self, requests, context):
        """One call per incoming stream. A reader thread consumes the requests; this generator (on a
        gRPC server thread) sends the responses it queues."""
        stream = Incoming(requests, context)
        with self._lock:
            if self._closing:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.task} is shutting down")
            self._streams.add(stream)
            # The oldest unfinished handshake gives way: a task's own completes in a round trip or
            # two, so only connections that idle (or flood) are cut off, and a task's is retried.
            stream.hs, cut = self.acceptor.connect(stream.peer, stream)
        for action in cut:
            self._cut_off(action)
        context.add_callback(lambda: stream.out.put(None))
        stream.timer = timer = threading.Timer(self._handshake_timeout, self._handshake_expired, args=(stream,))
        timer.daemon = True
        timer.start()
        threading.Thread(target=self._read_stream, args=(stream,), daemon=True,
                         name=f"stratagem-grpc-{self.task.short}-from-{stream.peer}").start()
        try:
            while True:
                item = stream.out.get()
                if item is None:
                    return
                if isinstance(item, Abort):
                    context.abort(item.code, item.details)
                yield item
        finally:
            timer.cancel()
            with self._lock:
                self._streams.discard(stream)
                self.acceptor.disconnected(stream.hs)

    def _handshake_expired(self, stream: Incoming) -> None:
        with self._lock:
            actions = [] if stream.ended.is_set() else self.acceptor.expire(stream.hs, self._handshake_timeout)
        self._carry_out(stream, actions, None)

    def _read_stream(self, stream: Incoming) -> None:
        conn = stream.hs
        reassembler = Reassembler(conn.limits, conn.expects, conn.why)
        broken = None
        try:
            for message in stream.requests:
                reassembler.feed(message, lambda frame: self._on_frame(stream, frame, reassembler))
                if conn.refused:
                    break
            else:
                if not conn.accepted and not reassembler.between_frames:
                    self._refuse(stream, "malformed frame: the stream ended in the middle of a frame")
        except grpc.RpcError as exc:
            broken = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "code") else str(exc)
        except ProtocolError as exc:
            self._refuse(stream, f"malformed frame: {exc}")
        except Exception as exc:  # a bad stream must never take the server down
            log.debug("stream handler error", exc_info=True)
            self._refuse(stream, f"error while handling a frame: {type(exc).__name__}: {exc}")
        finally:
            stream.ended.set()
            stream.out.put(None)
        if conn.accepted and not conn.goodbye and not conn.refused and not self._closing:
            if broken is None and not reassembler.between_frames:
                broken = "it ended in the middle of a frame"
            how = broken or "it ended without a goodbye"
            self._declare_lost(conn.task, f"connection from {conn.task} was lost ({how}; the process died, or "
                                          f"the network failed)", conn.epoch)

    def _on_frame(self, stream: Incoming, frame: wire.Frame, reassembler: Reassembler) -> None:
        conn = stream.hs
        if conn.refused:
            return
        if frame.kind == Kind.DATA and conn.open:
            with self._stats_lock:
                self.stats["data_frames"] += 1
            self._mailbox.put(conn.task, frame.tag, Message(frame.meta, frame.buffers, conn.task))
            return
        with self._lock:
            if self._closing:
                return
            actions = self.acceptor.on_frame(conn, frame.kind, frame.meta)
            admitted = next((a for a in actions if isinstance(a, Admitted)), None)
            old = self._admitted(admitted.task, admitted.again) if admitted is not None else None
        if old is not None:
            self._retire(old)
        self._carry_out(stream, actions, reassembler)

    def _admitted(self, task: TaskId, again: bool):
        """A new stream from ``task`` is admitted (under the lock): a new incarnation, or a reconnection,
        so a loss noted for the old one no longer applies. Returns our stream to its old process.

        ``again``: not its first admission. The old stream's loss then counts even if its end was not
        seen yet (the epoch moved on, so that end will be ignored as stale when it comes)."""
        was_lost = self._mailbox.is_lost(task) is not None
        self._mailbox.mark_alive(task, replaced=again)
        return self._take_peer(task) if was_lost else None

    def _refuse(self, stream: Incoming, reason: str) -> None:
        """The stream is at fault (a malformed frame...): refuse it."""
        with self._lock:
            actions = self.acceptor.refuse(stream.hs, reason)
        self._carry_out(stream, actions, None)

    def _carry_out(self, stream: Incoming, actions: list, reassembler: Reassembler | None) -> None:
        conn = stream.hs
        for action in actions:
            if isinstance(action, Reply):
                stream.out.put(frame_bytes(wire.encode(action.kind, "", action.meta)))
            elif isinstance(action, Refused):
                self._log_refusal(stream, action.reason)
            elif isinstance(action, Admitted):
                stream.timer.cancel()
            elif isinstance(action, Left):
                self._declare_lost(action.task, said_goodbye(action.task), action.epoch)
            elif isinstance(action, GaveUp):
                log.warning("%s: %s gave up on its connection: %s", self.task, conn.describe(), action.reason)
                stream.out.put(None)
            elif action is DELIVER:
                raise AssertionError("DATA on an open connection is filed before the state machine is asked")
            # Dropped: a frame after the stream was refused; the reader stops at the refusal anyway.
        if reassembler is not None:
            # What the connection may send next, under which limits: the handshake's, or the transport's.
            reassembler.expect(conn.expects, conn.limits, conn.why)

    def _log_refusal(self, stream: Incoming, reason: str) -> None:
        """Count and log a refusal, then end the stream with an error status (after its REJECT)."""
        with self._stats_lock:
            self.stats["rejected_frames"] += 1
            count = self.stats["rejected_frames"]
        if count <= 20 or count % _LOG_EVERY == 0:
            log.warning("%s: refused a frame from %s and closed its stream: %s", self.task,
                        stream.hs.describe(), reason)
        code = (grpc.StatusCode.UNAUTHENTICATED if "secret" in reason.lower() or "handshake" in reason.lower()
                else grpc.StatusCode.INVALID_ARGUMENT)
        stream.out.put(Abort(code, reason[:1000]))

    def _cut_off(self, action: CutOff) -> None:
        """End a stream still in its handshake to make room for a newer one. RESOURCE_EXHAUSTED, and no
        REJECT, tells a task's transport to try again (see ``GrpcTransport.send_async``)."""
        with self._stats_lock:
            self.stats["cut_off_handshakes"] += 1
            count = self.stats["cut_off_handshakes"]
        stream = action.conn.link
        if count <= 20 or count % _LOG_EVERY == 0:
            log.warning("%s: cut off %s before its handshake completed: %s", self.task, action.conn.describe(),
                        action.reason)
        stream.out.put(Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, action.reason))
