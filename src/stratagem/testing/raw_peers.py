"""Raw peers of the built-in byte-stream transports: a connection that sends whatever bytes a test
gives it, as an attacker or a broken program would (:class:`~stratagem.testing.byte_stream.RawPeer`).

- :class:`ZmqRawPeer`: a bare ZeroMQ DEALER connected to a ``zmq`` task's ROUTER;
- :class:`GrpcRawPeer`: one call of a ``grpc`` task's one method, from a plain gRPC client.

And the other way round, a *raw acceptor*: a server at a task's address that answers whoever
connects with the frames a test scripts, as a misconfigured or hostile task would (the connecting
side of the handshake must refuse it: :mod:`stratagem.transport_kit.connector`):

- :class:`ZmqRawAcceptor`: a bare ROUTER (it lets any ZMTP PLAIN credentials through its gate);
- :class:`GrpcRawAcceptor`: a plain gRPC server of the one method.

pyzmq and grpcio are imported when a peer is made, not with this module. Each has ``to(target)``,
which opens one to a started transport, as :meth:`ByteStreamContract.open_raw
<stratagem.testing.byte_stream.ByteStreamContract.open_raw>` wants:

    >>> from stratagem.core import wire
    >>> from stratagem.transport_kit import handshake
    >>> from stratagem.testing.world import local_cluster
    >>> from stratagem.transports.zmq.transport import ZmqTransport
    >>> cluster = local_cluster(2)
    >>> with ZmqTransport(cluster, "worker:1") as target, ZmqRawPeer.to(target) as peer:
    ...     hello, _ = handshake.make_hello(cluster.tasks()[0], cluster.cluster_id, None)
    ...     peer.send_frame(wire.encode(wire.Kind.HELLO, "", hello))
    ...     print(peer.recv_frame(timeout=10).kind.name)
    WELCOME
"""

from __future__ import annotations

import queue
import threading
from typing import Sequence

from stratagem.core import wire
from stratagem.transport_kit import handshake
from stratagem.core.errors import ProtocolError
from stratagem.testing.byte_stream import RawPeer
from stratagem.transports.framing import Reassembler, chunks, frame_bytes


class ZmqRawPeer(RawPeer):
    """A bare DEALER connected to ``address``; with ``token`` it shows it at the ZMTP handshake (the
    connection token of a secret cluster travels in clear, so a sniffer has it), which gets it past
    the transport's connection gate, not its handshake."""

    def __init__(self, address: str, token: bytes | None = None, send_timeout: float = 10.0):
        import zmq

        from stratagem.transports.zmq.transport import ZAP_USER

        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A DEALER whose connection was refused has nowhere to queue while ZeroMQ waits to connect
        # again: a send would block for ever. It gives up after ``send_timeout`` seconds instead.
        self._send_timeout = send_timeout
        self.socket.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        if token is not None:
            self.socket.plain_username, self.socket.plain_password = ZAP_USER, token
        self.socket.connect(f"tcp://{address}")

    @classmethod
    def to(cls, target) -> "ZmqRawPeer":
        """A raw peer of the started zmq transport ``target``, with its cluster's token if it has a secret."""
        token = None if target.secret is None else handshake.connection_token(target.secret,
                                                                                target.cluster.cluster_id)
        return cls(target.address, token)

    def send_frame(self, parts: Sequence) -> None:
        """Queue ``parts`` as one message; :class:`ConnectionRefusedError` when there is no connection
        to queue it on (ZeroMQ drops the queue of a connection the server refused, then retries)."""
        self._sending(self.socket.send_multipart, list(parts))

    def send_raw(self, data: bytes) -> None:
        self._sending(self.socket.send, data)

    def _sending(self, send, what) -> None:
        import zmq

        try:
            send(what)
        except zmq.Again:
            raise ConnectionRefusedError(
                f"this DEALER had no connection to queue on for {self._send_timeout:g} s: "
                "the server refused its connection") from None

    def recv_frame(self, timeout: float) -> wire.Frame | None:
        if not self.socket.poll(timeout * 1000):
            return None
        return wire.decode_parts(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)
        self._ctx.term()


_END = object()


class GrpcRawPeer(RawPeer):
    """One stream on a ``grpc`` task's method (``/stratagem.Transport/Stream``) from a plain gRPC
    client, insecure or with ``credentials``. Nothing is sent until asked; a thread reads the
    responses. When the server ends the stream, :meth:`status` says how."""

    def __init__(self, address: str, credentials=None, timeout: float = 60.0):
        import grpc

        from stratagem.transports.grpc.config import FULL_METHOD

        self._grpc = grpc
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self.channel = (grpc.insecure_channel(address) if credentials is None
                        else grpc.secure_channel(address, credentials))
        self.call = self.channel.stream_stream(FULL_METHOD)(self._messages(), timeout=timeout)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"raw-grpc-peer-{address}")
        self._reader.start()

    @classmethod
    def to(cls, target) -> "GrpcRawPeer":
        """A raw peer of the started grpc transport ``target`` (without TLS)."""
        return cls(target.address)

    def _messages(self):
        while (item := self._requests.get()) is not _END:
            yield item

    def _read(self) -> None:
        reassembler = Reassembler(wire.DEFAULT_LIMITS)
        try:
            for message in self.call:
                reassembler.feed(message, self._frames.put)
        except (self._grpc.RpcError, ProtocolError):
            pass  # the stream ended with an error status (see status()) or sent garbage
        finally:
            self._frames.put(None)

    def send_frame(self, parts: Sequence) -> None:
        for message in chunks(parts, 1 << 20):
            self._requests.put(message)

    def send_raw(self, data: bytes) -> None:
        self._requests.put(bytes(data))

    def end(self) -> None:
        """End our side of the stream (what a client does when it has nothing more to say)."""
        self._requests.put(_END)

    def recv_frame(self, timeout: float) -> wire.Frame | None:
        try:
            frame = self._frames.get(timeout=timeout)
        except queue.Empty:
            return None
        if frame is None:
            self._frames.put(None)  # the stream is over: so say all later calls
        return frame

    def status(self, timeout: float = 20.0) -> tuple:
        """``(grpc.StatusCode, details)`` of the stream once the server has ended it (``(None, None)``
        if it has not within ``timeout``)."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            return None, None
        return self.call.code(), self.call.details()

    def close(self) -> None:
        self._requests.put(_END)
        self.call.cancel()
        self.channel.close()
        self._reader.join(10)


class RawAcceptor:
    """A server at ``address`` that answers each frame that comes in with what ``respond(kind, meta)``
    returns, a list of ``(kind, meta)`` frames; :attr:`received` lists the frames that came in, as
    ``(kind, meta)``. Close it (or use it as a context manager) to stop it."""

    def __init__(self, respond):
        self.respond = respond
        self.received: list[tuple[wire.Kind, dict]] = []
        self._arrived = threading.Condition()

    def _on_frame(self, frame: wire.Frame) -> list[bytes]:
        """The encoded answers to ``frame`` (each a list of parts)."""
        with self._arrived:
            self.received.append((frame.kind, frame.meta))
            self._arrived.notify_all()
        return [wire.encode(kind, "", meta) for kind, meta in self.respond(frame.kind, frame.meta)]

    def wait_for(self, kind: wire.Kind, timeout: float) -> dict | None:
        """The metadata of the first frame of ``kind`` that came in, waiting up to ``timeout`` (None if none)."""
        with self._arrived:
            self._arrived.wait_for(lambda: any(k == kind for k, _ in self.received), timeout)
            return next((meta for k, meta in self.received if k == kind), None)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "RawAcceptor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ZmqRawAcceptor(RawAcceptor):
    """A bare ROUTER bound at ``address`` (a ``zmq`` task's): it answers on the connection a frame came
    in on, and lets any connection through (with a secret, a task shows ZMTP PLAIN credentials)."""

    def __init__(self, address: str, respond, plain: bool = False):
        import zmq

        super().__init__(respond)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._zap = None
        if plain:  # the connecting task shows its token: let it in whatever it is
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.bind("inproc://zeromq.zap.01")
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if plain:
            self.socket.plain_server = True
        self.socket.bind(f"tcp://{address}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"raw-zmq-acceptor-{address}")
        self._thread.start()

    def _serve(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self._zap is not None and self._zap in ready:
                request = self._zap.recv_multipart()
                self._zap.send_multipart([b"1.0", request[1], b"200", b"OK", b"", b""])
            if self.socket in ready:
                routing_id, *parts = self.socket.recv_multipart()
                for answer in self._on_frame(wire.decode_parts(parts)):
                    self.socket.send_multipart([routing_id, *answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.socket.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)
        self._ctx.term()


class GrpcRawAcceptor(RawAcceptor):
    """A plain gRPC server of a ``grpc`` task's one method at ``address`` (without TLS)."""

    def __init__(self, address: str, respond):
        import concurrent.futures

        import grpc

        from stratagem.transports.grpc.config import METHOD, SERVICE

        super().__init__(respond)
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            METHOD: grpc.stream_stream_rpc_method_handler(self._serve)})
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"raw-grpc-acceptor-{address}")
        self.server = grpc.server(self._pool, handlers=[handler])
        if not self.server.add_insecure_port(address):
            raise RuntimeError(f"the raw gRPC acceptor cannot bind {address}")
        self.server.start()

    def _serve(self, requests, context):
        reassembler = Reassembler(wire.DEFAULT_LIMITS)
        for message in requests:
            frames: list = []
            reassembler.feed(message, frames.append)
            for frame in frames:
                for answer in self._on_frame(frame):
                    yield frame_bytes(answer)

    def close(self) -> None:
        self.server.stop(0).wait(10)
        self._pool.shutdown(wait=False)


__all__ = ["ZmqRawPeer", "GrpcRawPeer", "RawAcceptor", "ZmqRawAcceptor", "GrpcRawAcceptor"]
