"""The contract of a transport that reads bytes from the network, written once: what it promises a
peer that does not play by the rules (README: "Security").

A transport that accepts connections and decodes the wire format (``core/wire.py``) after the
handshake (``transport_kit/handshake.py``) makes promises that an in-process transport cannot: a malformed
frame is refused, logged and costs nobody else anything; no data gets in before the handshake; a
HELLO from another cluster, or a HELLO and AUTH without the secret, are refused on the connection
they came in on; an oversized frame is refused and the others are still served; a restarted peer is
accepted again; a taken port is a clear error. :class:`ByteStreamContract` adds these tests to the
transport contract (:class:`~stratagem.testing.contract.TransportContract`). Its tests play the bad
peer with a :class:`RawPeer`, a connection to a started transport that sends whatever bytes it is
given; the subclass says how to open one::

    from stratagem.testing.byte_stream import ByteStreamContract
    from my_transport.testing import RawSocketPeer

    class TestMyTransport(ByteStreamContract):
        transport = "mytransport"

        def open_raw(self, target):
            return RawSocketPeer(target.address)

The raw peers of the built-in ``zmq`` and ``grpc`` transports are in :mod:`stratagem.testing.raw_peers`.

What the suite reads of a transport besides the :class:`~stratagem.core.transport.Transport` API:
``address`` (where it listens), ``stats["rejected_frames"]`` (the frames it refused, counted), and a
WARNING naming the reason of each refusal, logged under the transport class's module name.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Sequence

import numpy as np
import pytest

from stratagem.core import wire
from stratagem.transport_kit import handshake
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError, PeerLostError, ProtocolError, TransportTimeout
from stratagem.core.transport import Message
from stratagem.core.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, Kind, Limits
from stratagem.testing.contract import CALL_TIMEOUT, PEER_TIMEOUT, TransportContract
from stratagem.testing.world import local_cluster, still_serves, wait_for

#: How long the suite waits to be sure that something did *not* arrive.
NOTHING_WAIT = 0.5


class RawPeer:
    """One connection to a transport's listening address that sends whatever it is given: the bad
    peer of :class:`ByteStreamContract`. A subclass implements the four methods for one transport."""

    def send_frame(self, parts: Sequence) -> None:
        """Send one encoded frame (``wire.encode``'s ``[head, buffer...]``) the way the transport
        carries a frame (zmq: one multipart message; a byte stream: the parts one after the other)."""
        raise NotImplementedError

    def send_raw(self, data: bytes) -> None:
        """Send ``data`` as one message of the transport (one zmq part, one gRPC message), frame or not."""
        raise NotImplementedError

    def recv_frame(self, timeout: float) -> wire.Frame | None:
        """The next frame the transport sent back on this connection (CHALLENGE, WELCOME, REJECT...),
        or ``None`` if none came within ``timeout`` seconds or the connection was closed."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "RawPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(kind: int, envelope_len: int, payload_len: int, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, kind, 0, envelope_len, payload_len)


#: Messages that are not a valid first frame, each with what the refusal must say.
MALFORMED = {
    "magic": (b"not a frame at all, not even close", "bad magic"),
    "zeros": (b"STRG" + b"\x00" * 30, "protocol version 0"),
    "version": (_header(int(Kind.HELLO), 0, 0, version=99), "protocol version 99"),
    "msgpack": (_header(int(Kind.HELLO), 5, 0) + b"\xc1" * 5, "not valid msgpack"),
    "kind": (_header(77, 0, 0), "unknown frame kind 77"),
    "hello-fields": (wire.encode_bytes(Kind.HELLO, "", {"v": VERSION}), "no valid 'task'"),
}


def _buffers_that_do_not_add_up() -> list:
    """A DATA frame whose envelope describes 32 bytes of buffer and whose header says 5."""
    head = wire.encode(Kind.DATA, "forged", {}, [np.zeros(32, np.uint8)])[0]
    envelope = head[HEADER_SIZE:]
    return [_header(int(Kind.DATA), len(envelope), 5) + envelope, b"short"]


#: Frames from a peer that passed the handshake, each with what the refusal must say.
MALFORMED_AFTER_HANDSHAKE = {
    "buffers-vs-header": (_buffers_that_do_not_add_up(), "buffers add up to 32 bytes"),
    "huge-payload": ([_header(int(Kind.DATA), 16, 1 << 50)], "exceeds the limit"),
}


class ByteStreamContract(TransportContract):
    """Subclass, set ``transport`` and implement :meth:`open_raw` (see the module docstring)."""

    #: True if the sender of a frame the receiver refused learns why: a ``ProtocolError`` naming
    #: the reason, raised by that send or the next one (gRPC sends it back on the stream).
    tells_the_sender_of_a_refusal: bool = False

    def open_raw(self, target) -> RawPeer:
        """A :class:`RawPeer` connected to ``target`` (a started endpoint of the transport under
        test). It may use what anybody on the network can learn (zmq's connection token travels in
        clear), never the cluster secret."""
        raise NotImplementedError(f"{type(self).__name__} must say how to open a raw peer (open_raw)")

    # -- helpers -----------------------------------------------------------------------------------
    def make(self, cluster: ClusterSpec, task, **options):
        """An endpoint of the transport under test for ``task`` (not started)."""
        from stratagem.plugins.manager import plugin_manager

        merged = {"timeout": CALL_TIMEOUT, "peer_timeout": PEER_TIMEOUT, **self.options, **options}
        return plugin_manager().create_transport(self.transport, cluster=cluster, task=TaskId.parse(task),
                                                 **merged)

    @contextlib.contextmanager
    def endpoints(self, cluster: ClusterSpec, tasks: Sequence, **options) -> Iterator[list]:
        """Started endpoints for ``tasks`` of ``cluster`` (the others are left to raw peers); closed at exit."""
        started = []
        try:
            for task in tasks:
                started.append(self.make(cluster, task, **options))
                started[-1].start()
            yield started
        finally:
            for endpoint in started:
                with contextlib.suppress(Exception):
                    endpoint.close()

    def logger(self) -> str:
        return self.transport_class().__module__

    def logged(self, caplog, words: str) -> bool:
        """True once the transport has logged a warning containing ``words``."""
        return any(r.levelno >= logging.WARNING and r.name.startswith(self.logger()) and words in r.getMessage()
                   for r in list(caplog.records))

    @contextlib.contextmanager
    def attacked_pair(self, caplog) -> Iterator[tuple]:
        """``(a, b, raw)``: two started endpoints of a fresh cluster and a raw peer connected to ``b``,
        with the transport's warnings captured."""
        with self.endpoints(local_cluster(2), ["worker:0", "worker:1"]) as (a, b), \
                caplog.at_level(logging.WARNING, logger=self.logger()), self.open_raw(b) as raw:
            yield a, b, raw

    def admitted(self, target, as_task: TaskId) -> RawPeer:
        """A raw peer that said HELLO as ``as_task`` (a task of the cluster that is not running) and
        was welcomed (no secret)."""
        peer = self.open_raw(target)
        hello, _ = handshake.make_hello(as_task, target.cluster.cluster_id, None)
        peer.send_frame(wire.encode(Kind.HELLO, "", hello))
        welcome = peer.recv_frame(CALL_TIMEOUT)
        if welcome is None or welcome.kind != Kind.WELCOME:
            peer.close()
            pytest.fail(f"a raw peer's HELLO as {as_task} was not welcomed: {welcome}")
        return peer

    def assert_nothing_delivered(self, receiver, tag: str = "forged") -> None:
        with pytest.raises(TransportTimeout):
            receiver.recv(None, tag, timeout=NOTHING_WAIT)

    # -- hostile input -----------------------------------------------------------------------------
    @pytest.mark.parametrize("case", sorted(MALFORMED))
    def test_a_malformed_first_frame_is_refused_and_the_server_keeps_serving(self, caplog, case):
        data, reason = MALFORMED[case]
        with self.attacked_pair(caplog) as (a, b, attacker):
            attacker.send_raw(data)
            assert wait_for(lambda: self.logged(caplog, reason)), [r.getMessage() for r in caplog.records]
            assert b.stats["rejected_frames"] >= 1
            assert still_serves(a, b)

    @pytest.mark.parametrize("case", sorted(MALFORMED_AFTER_HANDSHAKE))
    def test_a_malformed_frame_from_an_admitted_peer_is_refused(self, caplog, case):
        parts, reason = MALFORMED_AFTER_HANDSHAKE[case]
        cluster = local_cluster(3)  # worker:2 is played by the raw peer
        with self.endpoints(cluster, ["worker:0", "worker:1"]) as (a, b), \
                caplog.at_level(logging.WARNING, logger=self.logger()), \
                self.admitted(b, TaskId("worker", 2)) as attacker:
            attacker.send_frame(parts)
            assert wait_for(lambda: self.logged(caplog, reason)), [r.getMessage() for r in caplog.records]
            assert b.stats["rejected_frames"] >= 1
            self.assert_nothing_delivered(b)
            assert still_serves(a, b)

    def test_data_without_a_handshake_is_refused(self, caplog):
        with self.attacked_pair(caplog) as (a, b, attacker):
            attacker.send_frame(wire.encode(Kind.DATA, "forged", {"forged": True}, [np.arange(3)]))
            assert wait_for(lambda: self.logged(caplog, "before the handshake")), \
                [r.getMessage() for r in caplog.records]
            assert b.stats["rejected_frames"] >= 1
            self.assert_nothing_delivered(b)
            assert still_serves(a, b)

    def test_a_hello_from_another_cluster_is_refused_on_its_connection(self, caplog):
        with self.attacked_pair(caplog) as (a, b, attacker):
            hello, nonce = handshake.make_hello(a.task, "some-other-cluster", None)
            attacker.send_frame(wire.encode(Kind.HELLO, "", hello))
            attacker.send_frame(wire.encode(Kind.DATA, "forged", {"forged": True}))
            reject = attacker.recv_frame(CALL_TIMEOUT)
            assert reject is not None and reject.kind == Kind.REJECT, reject
            assert "another cluster" in reject.meta["reason"] and reject.meta["nonce"] == nonce
            assert wait_for(lambda: self.logged(caplog, "another cluster"))
            assert b.stats["rejected_frames"] >= 1
            self.assert_nothing_delivered(b)
            assert still_serves(a, b)

    def test_a_forged_hello_and_auth_without_the_secret_get_nothing_in(self, caplog):
        """A peer without the secret claims to be ``named``: the CHALLENGE (answering its own nonce)
        and the REJECT of its guessed AUTH come back on its own connection; no frame of it is
        delivered, the target goes on serving, and the task it named hears nothing."""
        cluster = local_cluster(3)
        with self.endpoints(cluster, cluster.tasks(), secret=b"k") as (named, target, honest):
            with caplog.at_level(logging.DEBUG, logger=self.logger()), self.open_raw(target) as forger:
                hello, nonce = handshake.make_hello(named.task, cluster.cluster_id, b"not the secret")
                forger.send_frame(wire.encode(Kind.HELLO, "", hello))
                challenge = forger.recv_frame(CALL_TIMEOUT)
                assert challenge is not None and challenge.kind == Kind.CHALLENGE, challenge
                assert challenge.meta["for"] == nonce
                forger.send_frame(wire.encode(Kind.AUTH, "", {"task": named.task.short, "mac": bytes(32)}))
                forger.send_frame(wire.encode(Kind.DATA, "forged", {"forged": True}))
                reject = forger.recv_frame(CALL_TIMEOUT)
                assert reject is not None and reject.kind == Kind.REJECT, reject
                assert "secret" in reject.meta["reason"]
                assert wait_for(lambda: self.logged(caplog, "secret"))
                assert target.stats["rejected_frames"] >= 1
                self.assert_nothing_delivered(target)
                assert still_serves(honest, target)
                time.sleep(NOTHING_WAIT)  # anything on its way to the named task lands
            heard = [r.getMessage() for r in caplog.records if r.getMessage().startswith(str(named.task))]
            assert heard == [] and named.stats["rejected_frames"] == 0, heard
            assert named.lost_peers() == {}
            assert still_serves(named, target)  # and its own connection works

    def test_an_oversized_frame_is_refused_and_others_are_served(self, caplog):
        cluster = local_cluster(3)
        with self.endpoints(cluster, ["worker:0"]) as (big_sender,), \
                self.endpoints(cluster, ["worker:1"], limits=Limits(max_payload_bytes=64 * 1024)) as (server,), \
                self.endpoints(cluster, ["worker:2"]) as (honest,), \
                caplog.at_level(logging.WARNING, logger=self.logger()):
            told = []
            try:
                big_sender.send(server.task, "big", Message({}, [np.zeros(1 << 20, np.uint8)]))
            except ProtocolError as exc:  # the refusal may come back while the frame is still going out
                told.append(str(exc))
            assert wait_for(lambda: self.logged(caplog, "exceeds the limit"))
            assert server.stats["rejected_frames"] >= 1
            with pytest.raises((TransportTimeout, PeerLostError)):
                server.recv(big_sender.task, "big", timeout=1.0)
            assert still_serves(honest, server)
            # The sender can still send (a transport that tells it of the refusal does that first).
            for attempt in range(10):
                try:
                    big_sender.send(server.task, "small", Message({"attempt": attempt}))
                except ProtocolError as exc:
                    told.append(str(exc))
                    continue
                with contextlib.suppress(TransportTimeout):
                    got = server.recv(big_sender.task, "small", timeout=2.0)
                    break
            else:
                pytest.fail(f"{big_sender.task} could not send again after its oversized frame was refused")
            assert "attempt" in got.meta
            assert all("exceeds the limit" in reason for reason in told), told
            if self.tells_the_sender_of_a_refusal:
                assert told, "the sender was not told that its frame was refused"

    # -- restarts and addresses --------------------------------------------------------------------
    def test_a_restarted_peer_is_accepted_again(self):
        cluster = local_cluster(2)
        with self.endpoints(cluster, ["worker:0"]) as (a,):
            b = self.make(cluster, "worker:1")
            b.start()
            b.send(a.task, "hi", Message({"life": 1}))
            assert a.recv(b.task, "hi", timeout=CALL_TIMEOUT).meta == {"life": 1}
            a.send(b.task, "hi", Message())
            b.recv(a.task, "hi", timeout=CALL_TIMEOUT)
            b.abort()
            with pytest.raises(PeerLostError):
                a.recv(b.task, "hi", timeout=CALL_TIMEOUT)
            # The same task comes back as a new process (here: a new endpoint on the same port).
            with self.endpoints(cluster, ["worker:1"]) as (b2,):
                b2.send(a.task, "hi", Message({"life": 2}))
                # Until its HELLO arrives the task may count as lost (fail fast); then it is back.
                assert wait_for(lambda: b2.task not in a.lost_peers())
                assert a.recv(b2.task, "hi", timeout=CALL_TIMEOUT).meta == {"life": 2}
                a.send(b2.task, "back", Message({"ok": 1}))
                assert b2.recv(a.task, "back", timeout=CALL_TIMEOUT).meta == {"ok": 1}

    @pytest.mark.parametrize("noticed", [True, False], ids=["after-its-death-is-noticed", "at-once"])
    def test_a_peer_restarted_many_times_is_accepted_every_time(self, noticed):
        """Each new incarnation is admitted, however soon it comes back: at once (a connection to the
        old process may still be open, and must be replaced, not kept, or the old one's loss is
        blamed on the new one), or after its loss was noticed (what was kept for the old connection
        must not get in the new one's way). No frame of any of them is refused."""
        cluster = local_cluster(2)
        with self.endpoints(cluster, ["worker:0"]) as (a,):
            for life in range(20):
                b = self.make(cluster, "worker:1")
                b.start()
                try:
                    b.send(a.task, "hi", Message({"life": life}))
                    assert wait_for(lambda: b.task not in a.lost_peers())
                    assert a.recv(b.task, "hi", timeout=CALL_TIMEOUT).meta == {"life": life}
                    a.send(b.task, "back", Message({"life": life}))
                    assert b.recv(a.task, "back", timeout=CALL_TIMEOUT).meta == {"life": life}
                finally:
                    b.abort()
                if noticed:
                    assert wait_for(lambda: b.task in a.lost_peers())
            assert a.stats["rejected_frames"] == 0

    def test_recv_from_a_task_that_never_started_times_out_naming_it(self):
        with self.endpoints(local_cluster(2), ["worker:0"]) as (a,):
            with pytest.raises(TransportTimeout, match="worker/task:1"):
                a.recv(TaskId("worker", 1), "x", timeout=NOTHING_WAIT)

    def test_a_taken_address_is_a_clear_error(self):
        cluster = local_cluster(1)
        with self.endpoints(cluster, ["worker:0"]) as (a,):
            clash = self.make(cluster, "worker:0")
            try:
                with pytest.raises(ConfigurationError, match="cannot bind"):
                    clash.start()
            finally:
                clash.close()
            assert a.address  # the endpoint that holds the address is unharmed


__all__ = ["ByteStreamContract", "RawPeer", "MALFORMED", "MALFORMED_AFTER_HANDSHAKE"]
