"""Raw peers of the built-in byte-stream transports: a connection that sends whatever bytes a test
gives it, as an attacker or a broken program would (:class:`~stratagem.testing.byte_stream.RawPeer`).

- :class:`ZmqRawPeer`: a bare ZeroMQ DEALER connected to a ``zmq`` task's ROUTER;
- :class:`GrpcRawPeer`: one call of a ``grpc`` task's one method, from a plain gRPC client.

pyzmq and grpcio are imported when a peer is made, not with this module. Each has ``to(target)``,
which opens one to a started transport, as :meth:`ByteStreamContract.open_raw
<stratagem.testing.byte_stream.ByteStreamContract.open_raw>` wants:

    >>> from stratagem.core import handshake, wire
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

from stratagem.core import handshake, wire
from stratagem.core.errors import ProtocolError
from stratagem.testing.byte_stream import RawPeer
from stratagem.transports.framing import Reassembler, chunks


class ZmqRawPeer(RawPeer):
    """A bare DEALER connected to ``address``; with ``token`` it shows it at the ZMTP handshake (the
    connection token of a secret cluster travels in clear, so a sniffer has it), which gets it past
    the transport's connection gate, not its handshake."""

    def __init__(self, address: str, token: bytes | None = None):
        import zmq

        from stratagem.transports.zmq.transport import ZAP_USER

        self._ctx = zmq.Context()
        self.socket = self._ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A DEALER whose connection was refused has nowhere to queue: a send would block for ever.
        self.socket.setsockopt(zmq.SNDTIMEO, 10_000)
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
        self.socket.send_multipart(list(parts))

    def send_raw(self, data: bytes) -> None:
        self.socket.send(data)

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


__all__ = ["ZmqRawPeer", "GrpcRawPeer"]
