"""What the zmq transport does beyond the shared contracts (``stratagem.testing.contract`` and, for
hostile peers and restarts, ``stratagem.testing.byte_stream``, run in tests/test_transport_contract.py):
the connection gate of a secret cluster (ZMTP PLAIN credentials checked by our ZAP handler), and the
multipart shape of a frame.

Raw DEALER sockets (``stratagem.testing.raw_peers.ZmqRawPeer``) play the attacker: they speak to a
real transport's ROUTER over real TCP.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from stratagem.core import wire
from stratagem.transport_kit import handshake
from stratagem.core.cluster import TaskId
from stratagem.core.errors import TransportTimeout
from stratagem.core.wire import Kind
from stratagem.testing.raw_peers import ZmqRawPeer
from stratagem.testing.world import local_cluster, still_serves, wait_for
from stratagem.transports.zmq.transport import ZmqTransport

TIMEOUT = 20.0
LOGGER = "stratagem.transports.zmq.transport"


def _attack(attacker: ZmqRawPeer, cluster) -> None:
    """A forged HELLO, then data. After its connection was refused, a DEALER has nothing to queue on
    until ZeroMQ connects it again: a send that finds no connection is a refusal too."""
    hello, _ = handshake.make_hello(TaskId("worker", 0), cluster.cluster_id, b"guess")
    for frame in (wire.encode(Kind.HELLO, "", hello), wire.encode(Kind.DATA, "ok", {"forged": True})):
        try:
            attacker.send_frame(frame)
        except ConnectionRefusedError:
            return


def test_a_peer_without_the_connection_token_is_refused_before_any_frame():
    """Without a token (the ZMTP handshake fails) or with a guessed one (our ZAP handler refuses it),
    not one frame reaches the transport: neither frames sent at once, queued before the refusal, nor
    frames sent after it, while ZeroMQ keeps trying to connect."""
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", secret=b"k", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", secret=b"k", timeout=TIMEOUT) as b:
        attackers = [ZmqRawPeer(b.address, token, send_timeout=1.0)
                     for token in (None, handshake.connection_token(b"guess", cluster.cluster_id))]
        try:
            for attacker in attackers:
                _attack(attacker, cluster)
            assert wait_for(lambda: b.stats.get("refused_connections", 0) >= 1)
            for attacker in attackers:
                _attack(attacker, cluster)
            with pytest.raises(TransportTimeout):
                b.recv(None, "ok", timeout=0.5)
            assert b.stats["rejected_frames"] == 0
            assert still_serves(a, b)
        finally:
            for attacker in attackers:
                attacker.close()


def test_a_buffer_part_shorter_than_its_description_is_refused(caplog):
    """A frame's buffers travel as parts of one message, each with a length of its own: a part that
    does not match what the envelope describes is refused (a byte stream has no such boundary)."""
    cluster = local_cluster(3)  # worker:2 is played by a raw DEALER
    with ZmqTransport(cluster, "worker:0", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", timeout=TIMEOUT) as b, \
            caplog.at_level(logging.WARNING, logger=LOGGER), ZmqRawPeer.to(b) as attacker:
        hello, _ = handshake.make_hello(TaskId("worker", 2), cluster.cluster_id, None)
        attacker.send_frame(wire.encode(Kind.HELLO, "", hello))
        assert attacker.recv_frame(TIMEOUT).kind == Kind.WELCOME
        head = wire.encode(Kind.DATA, "forged", {}, [np.arange(4)])[0]
        attacker.send_frame([head, b"short"])
        assert wait_for(lambda: any("buffer is 5 bytes" in r.getMessage() for r in caplog.records))
        with pytest.raises(TransportTimeout):
            b.recv(None, "forged", timeout=0.5)
        assert still_serves(a, b)
