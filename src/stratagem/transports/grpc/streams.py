"""Per-stream state of the ``grpc`` transport (:mod:`stratagem.transports.grpc.transport`).

:class:`Outgoing` is our stream to a peer: the queue of frames its request generator sends, the
handshake's progress and what failed it. :class:`Incoming` is a peer's stream into our server
(its handshake is :mod:`stratagem.transport_kit.acceptor`'s).
:class:`LazySend` is the handle of a large send, done once gRPC's request thread has cut the last
chunk out of the caller's arrays (before that chunk is handed to gRPC: what happens to the bytes
afterwards, the peer's receive and goodbye included, is no longer the send's). Nothing here imports grpc.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

from stratagem.core.cluster import TaskId
from stratagem.core.errors import PeerLostError, TransportTimeout
from stratagem.core.transport import SendHandle
from stratagem.transports.framing import chunks

END = object()  # ends a request stream


class Eager:
    """A small frame, already copied into one message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


class LazySend(SendHandle):
    """A large frame, cut into messages by gRPC's request thread; done when the last one is made."""

    __slots__ = ("parts", "_event", "_error", "_what")

    def __init__(self, parts: list, what: str):
        self.parts = parts
        self._event = threading.Event()
        self._error: Exception | None = None
        self._what = what

    def finish(self, error: Exception | None = None) -> None:
        if not self._event.is_set():
            self._error = error
            self.parts = None  # the caller's memory is no longer referenced
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TransportTimeout(f"{self._what} did not complete within {timeout:g} s")
        if self._error is not None:
            raise fresh(self._error)


class Outgoing:
    """Our stream to one peer: its channel, the call, the queue of frames and its handshake (``hs``, a
    :class:`~stratagem.transport_kit.connector.Connector`)."""

    def __init__(self, task: TaskId, address: str, hs):
        self.task, self.address, self.hs = task, address, hs
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.ready = threading.Event()      # welcomed, or failed (then ``error`` says why)
        self.goodbye = False                # the acceptor said it is closing
        self.busy = False                   # the acceptor had no room for the stream: try a new one
        self.error: Exception | None = None
        self.reported = False               # a pending send has raised ``error`` already
        self.closed = False                 # no more frames are accepted
        self.current: LazySend | None = None
        self.drained = threading.Event()    # the request stream has ended (everything handed to gRPC)
        self.finished = threading.Event()   # the response stream has ended
        self.channel = None
        self.call = None

    @property
    def welcomed(self) -> bool:
        """True once the peer welcomed us, whatever happened since."""
        return self.hs.accepted

    def enqueue(self, item) -> None:
        with self.lock:
            if self.closed:
                raise fresh(self.error) if self.error else PeerLostError(self.task, "connection closed")
            self.queue.put(item)

    def fail(self, error: Exception | None, final: object = None) -> None:
        """Accept no more frames and end the request stream (after ``final``, a last frame such as a
        GOODBYE or a REJECT, if given). With an ``error``, the sends still pending fail with it."""
        with self.lock:
            if self.error is None and error is not None:
                self.error = error
            first, self.closed = not self.closed, True
            current = self.current
            if first:
                if final is not None:
                    self.queue.put(final)
                self.queue.put(END)
        self.ready.set()
        if error is None:
            return
        if current is not None:
            current.finish(error)
            self.reported = True
        keep = []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, LazySend):
                item.finish(error)
                self.reported = True
            elif item is final or item is END:
                keep.append(item)
        for item in keep:
            self.queue.put(item)

    def requests(self, chunk_bytes: int) -> Iterator[bytes]:
        """The request stream (run by gRPC's request thread): the queued frames in order, each large
        frame cut into messages of at most ``chunk_bytes``, small ones coalesced into one message."""
        held = None
        try:
            while True:
                item = held if held is not None else self.queue.get()
                held = None
                if item is END:
                    return
                if isinstance(item, LazySend):
                    with self.lock:
                        if self.error is not None:
                            item.finish(self.error)
                            continue
                        self.current = item
                    pieces = chunks(item.parts, chunk_bytes)
                    message = next(pieces)
                    for following in pieces:
                        yield message
                        message = following
                    # The last message is made: every byte of the caller's arrays is copied, so the send
                    # is complete now, before that message is handed to gRPC. Completing it only when
                    # gRPC asked for the next one let the peer read it, finish and say goodbye first, and
                    # a send that had delivered everything then failed with "closed its transport".
                    with self.lock:
                        self.current = None
                    item.finish()
                    yield message
                    continue
                # Small frames already queued go together, in one message of at most a chunk.
                batch, size = [item.data], len(item.data)
                while size < chunk_bytes:
                    try:
                        held = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(held, Eager) or size + len(held.data) > chunk_bytes:
                        break
                    batch.append(held.data)
                    size += len(held.data)
                    held = None
                yield batch[0] if len(batch) == 1 else b"".join(batch)
        finally:
            self.drained.set()

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.fail(None)


class Incoming:
    """One stream into our server: its requests, the responses queued for it, and its handshake
    (``hs``, a :class:`~stratagem.transport_kit.acceptor.Connection`: who it is from and how far it got)."""

    def __init__(self, requests, context):
        self.requests, self.context = requests, context
        self.out: queue.SimpleQueue = queue.SimpleQueue()   # response messages; None ends the stream
        self.peer = context.peer()
        self.hs = None
        self.ended = threading.Event()
        self.timer: threading.Timer | None = None  # cuts off a stream whose handshake takes too long


class Abort:
    """Ends an incoming stream with an error status (queued after the REJECT that explains it)."""

    __slots__ = ("code", "details")

    def __init__(self, code, details: str):
        self.code, self.details = code, details


def fresh(error: Exception) -> Exception:
    """A new instance of a stored error, so each raise gets its own traceback."""
    if isinstance(error, PeerLostError):
        return PeerLostError(error.task, str(error).split(": ", 1)[-1])
    return type(error)(str(error))
