"""What the zmq transport does beyond the shared contract: hostile input and reconnection.

Raw ZeroMQ sockets play the attacker: they speak to a real transport's ROUTER over real TCP.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import zmq

from stratagem.core import handshake, wire
from stratagem.core.cluster import TaskId
from stratagem.core.errors import PeerLostError, TransportTimeout
from stratagem.core.transport import Message
from stratagem.core.wire import Kind, Limits
from stratagem.testing.world import local_cluster, still_serves, wait_for
from stratagem.transports.zmq.transport import ZAP_USER, ZmqTransport

TIMEOUT = 20.0


@pytest.fixture
def pair():
    cluster = local_cluster(2)
    a = ZmqTransport(cluster, "worker:0", timeout=TIMEOUT, peer_timeout=3.0)
    b = ZmqTransport(cluster, "worker:1", timeout=TIMEOUT, peer_timeout=3.0)
    a.start()
    b.start()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def raw_socket():
    ctx = zmq.Context()
    sockets = []

    def connect(address: str, token: bytes | None = None) -> zmq.Socket:
        """A bare DEALER; with ``token``, it shows it at the ZMTP handshake (as one sniffed off the
        network would be), so it gets past a secret cluster's connection gate."""
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if token is not None:
            s.plain_username, s.plain_password = ZAP_USER, token
        s.connect(f"tcp://{address}")
        sockets.append(s)
        return s

    yield connect
    for s in sockets:
        s.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("garbage", [
    [b"not a frame at all"],
    [b"STRG" + b"\x00" * 30],
    [wire.HEADER.pack(wire.MAGIC, 99, 1, 0, 0, 0)],                      # another version
    [wire.HEADER.pack(wire.MAGIC, wire.VERSION, 1, 0, 5, 0) + b"\xc1" * 5],  # bad msgpack
    [wire.encode(Kind.DATA, "t", {}, [np.arange(4)])[0], b"short"],       # buffer length lies
])
def test_malformed_frame_is_logged_and_server_keeps_serving(pair, raw_socket, caplog, garbage):
    a, b = pair
    attacker = raw_socket(b.address)
    with caplog.at_level(logging.WARNING, logger="stratagem.transports.zmq.transport"):
        attacker.send_multipart(garbage)
        assert wait_for(lambda: b.stats["rejected_frames"] >= 1)
        assert still_serves(a, b)
    assert any("dropped a frame" in r.getMessage() for r in caplog.records)


def test_data_without_handshake_is_dropped(pair, raw_socket, caplog):
    a, b = pair
    attacker = raw_socket(b.address)
    with caplog.at_level(logging.WARNING, logger="stratagem.transports.zmq.transport"):
        attacker.send_multipart(wire.encode(Kind.DATA, "ok", {"forged": True}, [np.arange(3)]))
        assert wait_for(lambda: b.stats["rejected_frames"] >= 1)
    assert any("handshake" in r.getMessage() for r in caplog.records)
    with pytest.raises(TransportTimeout):
        b.recv(None, "ok", timeout=0.5)  # the forged frame never reached the mailbox
    assert still_serves(a, b)


def test_hello_from_another_cluster_is_refused(pair, raw_socket, caplog):
    a, b = pair
    attacker = raw_socket(b.address)
    hello, _ = handshake.make_hello(TaskId("worker", 0), "some-other-cluster", None)
    with caplog.at_level(logging.WARNING, logger="stratagem.transports.zmq.transport"):
        attacker.send_multipart(wire.encode(Kind.HELLO, "", hello))
        attacker.send_multipart(wire.encode(Kind.DATA, "ok", {"forged": True}))
        assert wait_for(lambda: b.stats["rejected_frames"] >= 2)
    assert any("another cluster" in r.getMessage() for r in caplog.records)
    with pytest.raises(TransportTimeout):
        b.recv(None, "ok", timeout=0.5)
    assert still_serves(a, b)


def test_a_peer_without_the_connection_token_is_refused_before_any_frame(raw_socket, caplog):
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", secret=b"k", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", secret=b"k", timeout=TIMEOUT) as b:
        for token in (None, handshake.connection_token(b"guess", cluster.cluster_id)):
            attacker = raw_socket(b.address, token)
            hello, _ = handshake.make_hello(TaskId("worker", 0), cluster.cluster_id, b"guess")
            attacker.send_multipart(wire.encode(Kind.HELLO, "", hello))
            attacker.send_multipart(wire.encode(Kind.DATA, "ok", {"forged": True}))
        # A wrong token is refused by our ZAP handler (logged, counted); no token at all fails the
        # ZMTP handshake itself. Either way not one frame reaches the transport.
        assert wait_for(lambda: b.stats.get("refused_connections", 0) >= 1)
        with pytest.raises(TransportTimeout):
            b.recv(None, "ok", timeout=0.5)
        assert b.stats["rejected_frames"] == 0
        assert still_serves(a, b)


def test_unauthenticated_peer_cannot_inject_into_a_secret_cluster(raw_socket):
    """Even with the connection token (which travels in clear), a peer without the secret gets
    nothing in: the challenge-response refuses it."""
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", secret=b"k", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", secret=b"k", timeout=TIMEOUT) as b:
        attacker = raw_socket(b.address, handshake.connection_token(b"k", cluster.cluster_id))
        hello, _ = handshake.make_hello(TaskId("worker", 0), cluster.cluster_id, b"guess")
        attacker.send_multipart(wire.encode(Kind.HELLO, "", hello))
        attacker.send_multipart(wire.encode(Kind.AUTH, "", {"task": "worker:0", "mac": b"\x00" * 32}))
        attacker.send_multipart(wire.encode(Kind.DATA, "ok", {"forged": True}))
        assert wait_for(lambda: b.stats["rejected_frames"] >= 2)
        with pytest.raises(TransportTimeout):
            b.recv(None, "ok", timeout=0.5)
        assert still_serves(a, b)


def test_oversized_frame_is_refused_and_others_are_served():
    cluster = local_cluster(3)
    small = Limits(max_payload_bytes=64 * 1024)
    with ZmqTransport(cluster, "worker:0", timeout=TIMEOUT) as big_sender, \
            ZmqTransport(cluster, "worker:1", timeout=TIMEOUT, limits=small) as server, \
            ZmqTransport(cluster, "worker:2", timeout=TIMEOUT) as honest:
        big_sender.send(server.task, "ok", Message({}, [np.zeros(1 << 20, np.uint8)]))
        with pytest.raises((TransportTimeout, PeerLostError)):
            server.recv(big_sender.task, "ok", timeout=1.0)
        assert still_serves(honest, server)


def test_a_restarted_peer_is_accepted_again():
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", timeout=TIMEOUT, peer_timeout=3.0) as a:
        b = ZmqTransport(cluster, "worker:1", timeout=TIMEOUT, peer_timeout=3.0)
        b.start()
        b.send(a.task, "hi", Message({"life": 1}))
        assert a.recv(b.task, "hi", timeout=TIMEOUT).meta == {"life": 1}
        a.send(b.task, "hi", Message())
        b.recv(a.task, "hi", timeout=TIMEOUT)
        b.abort()
        with pytest.raises(PeerLostError):
            a.recv(b.task, "hi", timeout=TIMEOUT)
        # The same task comes back as a new process (here: a new endpoint on the same port).
        b2 = ZmqTransport(cluster, "worker:1", timeout=TIMEOUT, peer_timeout=3.0)
        b2.start()
        try:
            b2.send(a.task, "hi", Message({"life": 2}))
            # Until its HELLO arrives the task counts as lost (fail fast); then it is back.
            assert wait_for(lambda: b2.task not in a.lost_peers())
            assert a.recv(b2.task, "hi", timeout=TIMEOUT).meta == {"life": 2}
            a.send(b2.task, "back", Message({"ok": 1}))
            assert b2.recv(a.task, "back", timeout=TIMEOUT).meta == {"ok": 1}
        finally:
            b2.close()


@pytest.mark.parametrize("noticed", [True, False], ids=["after-its-death-is-noticed", "at-once"])
def test_a_peer_restarted_many_times_is_accepted_every_time(caplog, noticed):
    """Each new incarnation must be admitted, however soon it comes back. At once: our connection to
    the old process is still open (and reconnects to the new one without a handshake): it must be
    replaced, not kept, or the old one's loss is blamed on the new one. After the loss: the new
    connection's monitor must not clash with an old one's name (pyzmq names a monitor after the
    socket's file descriptor, which the OS reuses; the HELLO was then dropped with 'Address already
    in use')."""
    cluster = local_cluster(2)
    with caplog.at_level(logging.WARNING, logger="stratagem.transports.zmq.transport"), \
            ZmqTransport(cluster, "worker:0", timeout=TIMEOUT, peer_timeout=3.0) as a:
        for life in range(20):
            b = ZmqTransport(cluster, "worker:1", timeout=TIMEOUT, peer_timeout=3.0)
            b.start()
            try:
                b.send(a.task, "hi", Message({"life": life}))
                assert wait_for(lambda: b.task not in a.lost_peers())
                assert a.recv(b.task, "hi", timeout=TIMEOUT).meta == {"life": life}
                a.send(b.task, "back", Message({"life": life}))
                assert b.recv(a.task, "back", timeout=TIMEOUT).meta == {"life": life}
            finally:
                b.abort()
            if noticed:
                assert wait_for(lambda: b.task in a.lost_peers())
    dropped = [r.getMessage() for r in caplog.records if "dropped a frame" in r.getMessage()]
    assert dropped == [] and a.stats["rejected_frames"] == 0


def test_recv_from_a_task_that_never_started_times_out():
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", timeout=TIMEOUT) as a:
        with pytest.raises(TransportTimeout, match="worker/task:1"):
            a.recv(TaskId("worker", 1), "x", timeout=0.5)


def test_bind_conflict_is_a_clear_error():
    cluster = local_cluster(1)
    with ZmqTransport(cluster, "worker:0") as a:
        clash = ZmqTransport(cluster, "worker:0")
        with pytest.raises(Exception, match="cannot bind"):
            clash.start()
        assert a.address
