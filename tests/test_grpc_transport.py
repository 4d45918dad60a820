"""What the grpc transport does beyond the shared contracts (``stratagem.testing.contract`` and, for
hostile peers and restarts, ``stratagem.testing.byte_stream``, run in tests/test_transport_contract.py):
framing, options, the status a refused stream ends with, gRPC's own limits, keepalive, TLS.

Raw gRPC clients (``stratagem.testing.raw_peers.GrpcRawPeer``) play the attacker: they call the
transport's one method over real HTTP/2 on 127.0.0.1. Certificates are made at run time (with
``cryptography`` if installed, else the ``openssl`` command), never shipped.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import random
import shutil
import signal
import subprocess
import time

import ml_dtypes
import numpy as np
import pytest

grpc = pytest.importorskip("grpc", reason="the grpc transport needs grpcio: pip install 'stratagem[grpc]'")

from stratagem.core import wire  # noqa: E402
from stratagem.transport_kit import handshake  # noqa: E402
from stratagem.core.cluster import TaskId  # noqa: E402
from stratagem.core.errors import ConfigurationError, PeerLostError, ProtocolError, TransportTimeout  # noqa: E402
from stratagem.core.transport import COMPLETED, Message  # noqa: E402
from stratagem.core.wire import Kind  # noqa: E402
from stratagem.testing.byte_stream import MALFORMED  # noqa: E402
from stratagem.testing.peer import spawn_peer  # noqa: E402
from stratagem.testing.raw_peers import GrpcRawPeer  # noqa: E402
from stratagem.testing.world import local_cluster, still_serves  # noqa: E402
from stratagem.transports.grpc.transport import MAX_MESSAGE_BYTES, GrpcTransport  # noqa: E402
from stratagem.transports.grpc.config import MAX_RECEIVE_BYTES  # noqa: E402
from stratagem.transports.framing import CONTROL_LIMITS, HEAD_ROOM, Reassembler, chunks  # noqa: E402

TIMEOUT = 20.0
PEER_TIMEOUT = 3.0  # as the contract suite: keepalive pings every 1.2 s
LOGGER = "stratagem.transports.grpc.transport"


def make(cluster, task, **options):
    options = {"timeout": TIMEOUT, "peer_timeout": PEER_TIMEOUT, **options}
    return GrpcTransport(cluster, task, **options)


@pytest.fixture
def pair():
    cluster = local_cluster(2)
    a, b = make(cluster, "worker:0"), make(cluster, "worker:1")
    a.start()
    b.start()
    yield a, b
    a.close()
    b.close()


def control(kind, meta):
    return wire.encode_bytes(kind, "", meta)


def frames_of(messages, limits=CONTROL_LIMITS):
    got = []
    reassembler = Reassembler(limits)
    for m in messages:
        reassembler.feed(m, got.append)
    return got


# -- framing ---------------------------------------------------------------------------------------

def _sample_frames():
    rng = np.random.default_rng(0)
    return [
        (Kind.DATA, "a", {"i": 1}, [rng.standard_normal(1000).astype(np.float32)]),
        (Kind.DATA, "b", {}, []),
        (Kind.DATA, "c", {"nested": {"x": [1, None, b"z"]}},
         [np.arange(7, dtype=np.int16), np.array(3.5), np.zeros((2, 0)), np.arange(5, dtype=ml_dtypes.bfloat16),
          np.array([True, False, True])]),
        (Kind.DATA, "d", {}, [np.arange(300, dtype=np.uint8) for _ in range(40)]),
        (Kind.GOODBYE, "", {}, []),
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
def test_frames_survive_any_chunking_and_any_resplitting(chunk_bytes):
    sent = _sample_frames()
    stream = b"".join(m for frame in sent for m in chunks(wire.encode(*frame), chunk_bytes))
    # At most a chunk, plus the head of a frame riding with the first piece of a large buffer.
    sizes = [len(m) for frame in sent for m in chunks(wire.encode(*frame), chunk_bytes)]
    assert max(sizes) <= chunk_bytes + HEAD_ROOM
    rng = random.Random(chunk_bytes)
    cuts = sorted(rng.sample(range(1, len(stream)), min(50, len(stream) - 1)))
    pieces = [stream[i:j] for i, j in zip([0, *cuts], [*cuts, len(stream)])]
    got = frames_of(pieces, wire.DEFAULT_LIMITS)
    assert [(f.kind, f.tag, f.meta) for f in got] == [(k, t, m) for k, t, m, _ in sent]
    for frame, (_, _, _, buffers) in zip(got, sent):
        assert len(frame.buffers) == len(buffers)
        for received, original in zip(frame.buffers, buffers):
            assert received.dtype == original.dtype and received.shape == original.shape
            np.testing.assert_array_equal(received, original)
            assert received.flags.writeable and received.flags.aligned


def test_a_buffer_that_fits_a_chunk_is_never_split():
    buffers = [np.zeros(10, np.uint8), np.full(1000, 1, np.uint8), np.full(4000, 2, np.uint8)]
    parts = wire.encode(Kind.DATA, "t", {}, buffers)
    messages = list(chunks(parts, 1000))
    assert any(b"\x01" * 1000 in m for m in messages)  # the 1000-byte buffer arrives whole in one message
    # The larger one is cut at its own boundaries; what came before it (here under HEAD_ROOM) rides
    # with its first piece.
    assert messages[-4:] == [b"\x01" * 1000 + b"\x02" * 1000] + [b"\x02" * 1000] * 3


def test_the_head_of_a_large_frame_rides_with_its_first_piece():
    parts = wire.encode(Kind.DATA, "t", {"k": 1}, [np.arange(4000, dtype=np.uint8)])
    head = len(parts[0])
    assert [len(m) for m in chunks(parts, 1000)] == [head + 1000, 1000, 1000, 1000]  # 4 messages, not 5
    # A head over the room fills what is left of its message instead; nothing exceeds the chunk then.
    messages = list(chunks(parts, 1000, head_room=head - 1))
    assert [len(m) for m in messages] == [1000, 1000, 1000, 1000, head]
    assert frames_of(messages, wire.DEFAULT_LIMITS)[0].buffers[0].tolist() == \
        np.arange(4000, dtype=np.uint8).tolist()
    # The receivers' limit leaves room for the head above the largest chunk.
    assert MAX_RECEIVE_BYTES >= MAX_MESSAGE_BYTES + HEAD_ROOM


def test_header_is_checked_before_anything_is_read_or_allocated():
    huge = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.DATA), 0, 10, 1 << 40)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        Reassembler(wire.DEFAULT_LIMITS).feed(huge, lambda f: None)
    data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.DATA), 0, 10, 0)
    with pytest.raises(ProtocolError, match="unexpected DATA frame before the handshake"):
        Reassembler(CONTROL_LIMITS, (Kind.HELLO,), "before the handshake").feed(data, lambda f: None)
    hello_with_buffer = wire.encode_bytes(Kind.HELLO, "", {}, [np.zeros(4)])
    with pytest.raises(ProtocolError):
        Reassembler(CONTROL_LIMITS, (Kind.HELLO,)).feed(hello_with_buffer, lambda f: None)


# -- options ---------------------------------------------------------------------------------------

def test_options_are_checked(tmp_path):
    cluster = local_cluster(1)
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        GrpcTransport(cluster, "worker:0", chunk_bytes=MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ConfigurationError, match="both tls_cert and tls_key"):
        GrpcTransport(cluster, "worker:0", tls_cert=str(tmp_path / "c.pem"))
    with pytest.raises(ConfigurationError, match="tls_cert and tls_key"):
        GrpcTransport(cluster, "worker:0", tls_ca=str(tmp_path / "ca.pem"))
    with pytest.raises(ConfigurationError, match="cannot be read"):
        GrpcTransport(cluster, "worker:0", tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigurationError, match="needs tls_ca"):
        GrpcTransport(cluster, "worker:0", tls_cert="c", tls_key="k", tls_client_auth=True)
    with pytest.raises(ConfigurationError, match="max_workers must be at least 1"):
        GrpcTransport(cluster, "worker:0", max_workers=-1)

# -- data path ---------------------------------------------------------------------------------------

def test_small_chunks_and_async_sends():
    cluster = local_cluster(2)
    with make(cluster, "worker:0", chunk_bytes=1000) as a, make(cluster, "worker:1", chunk_bytes=1000) as b:
        arrays = [np.arange(5000, dtype=np.float64), np.arange(3, dtype=np.int8), np.ones((30, 40), np.float32)]
        handles = [a.send_async(b.task, "t", Message({"i": i}, arrays)) for i in range(5)]
        for h in handles:
            h.wait(TIMEOUT)
            assert h.done()
        assert a.send_async(b.task, "small", Message({"tiny": 1})) is COMPLETED  # fits a chunk: copied at once
        for i in range(5):
            got = b.recv(a.task, "t", timeout=TIMEOUT)
            assert got.meta == {"i": i}
            for received, sent in zip(got.buffers, arrays):
                np.testing.assert_array_equal(received, sent)
        assert b.recv(a.task, "small", timeout=TIMEOUT).meta == {"tiny": 1}


def test_received_arrays_are_writable(pair):
    a, b = pair
    a.send(b.task, "w", Message({}, [np.arange(1 << 20, dtype=np.float32), np.arange(3)]))
    got = b.recv(a.task, "w", timeout=TIMEOUT).buffers
    for array in got:
        array += 1  # like the zmq transport's: the receiver owns them
    assert got[0][0] == 1 and got[1].tolist() == [1, 2, 3]


# -- what a refused stream is told (the refusals themselves: stratagem.testing.byte_stream) --------

def _hello(cluster_id, secret=None):
    return control(Kind.HELLO, handshake.make_hello(TaskId("worker", 2), cluster_id, secret)[0])


#: What a raw client sends (built from the cluster id), the frames it gets back, and the status that
#: ends its stream with words of the reason: handshake and secret failures are UNAUTHENTICATED,
#: malformed or oversized frames INVALID_ARGUMENT.
REFUSED_STREAMS = {
    "ended-mid-frame": (lambda cid: [b"not a frame"], [Kind.REJECT], "INVALID_ARGUMENT",
                        "ended in the middle of a frame"),
    "garbage": (lambda cid: [MALFORMED["magic"][0]], [Kind.REJECT], "INVALID_ARGUMENT", "bad magic"),
    "unknown-kind": (lambda cid: [MALFORMED["kind"][0]], [Kind.REJECT], "INVALID_ARGUMENT", "unknown frame kind"),
    "hello-fields": (lambda cid: [MALFORMED["hello-fields"][0]], [Kind.REJECT], "UNAUTHENTICATED",
                     "handshake refused"),
    "data-first": (lambda cid: [wire.encode_bytes(Kind.DATA, "ok", {"forged": True}, [np.arange(3)])],
                   [Kind.REJECT], "UNAUTHENTICATED", "before the handshake completed (unauthenticated"),
    "another-cluster": (lambda cid: [_hello("some-other-cluster")], [Kind.REJECT], "UNAUTHENTICATED",
                        "another cluster"),
    "huge-payload": (lambda cid: [_hello(cid), wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.DATA), 0, 16,
                                                                1 << 50)],
                     [Kind.WELCOME, Kind.REJECT], "INVALID_ARGUMENT", "exceeds the limit"),
    "forged-auth": (lambda cid: [_hello(cid, b"guess"), control(Kind.AUTH, {"task": "worker:2", "mac": bytes(32)})],
                    [Kind.CHALLENGE, Kind.REJECT], "UNAUTHENTICATED", "secret"),
}


@pytest.mark.parametrize("case", list(REFUSED_STREAMS))
def test_a_refused_stream_gets_a_reject_then_a_status_that_says_why(case):
    build, kinds, code, words = REFUSED_STREAMS[case]
    cluster = local_cluster(3)  # worker:2 is played by the raw client
    secret = b"k" if case == "forged-auth" else None
    with make(cluster, "worker:1", secret=secret) as b, GrpcRawPeer(b.address) as peer:
        for message in build(cluster.cluster_id):
            peer.send_raw(message)
        peer.end()
        status, details = peer.status(TIMEOUT)
        frames = list(iter(lambda: peer.recv_frame(TIMEOUT), None))
    assert [f.kind for f in frames] == kinds
    assert words in frames[-1].meta["reason"]
    assert status == getattr(grpc.StatusCode, code) and words in details, (status, details)


def test_a_message_over_grpcs_limit_is_refused_by_grpc(pair):
    a, b = pair
    with GrpcRawPeer(b.address) as peer:
        peer.send_raw(b"\x00" * (MAX_MESSAGE_BYTES + (1 << 20)))
        assert peer.status(TIMEOUT)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert still_serves(a, b)


def test_a_stream_without_a_handshake_is_cut_off(caplog):
    cluster = local_cluster(2)
    with make(cluster, "worker:0") as a, make(cluster, "worker:1", handshake_timeout=0.5) as b:
        with caplog.at_level(logging.WARNING, logger=LOGGER), GrpcRawPeer(b.address) as silent:
            status, _ = silent.status(timeout=4)  # None if it was not cut off by then
        assert status in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.CANCELLED)
        assert any("no handshake within" in r.getMessage() for r in caplog.records)
        assert still_serves(a, b)


# -- failures and restarts -------------------------------------------------------------------------

def test_a_silent_peer_is_detected_by_keepalive():
    """A stopped process keeps its connections open: only keepalive pings can tell it is gone."""
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    with make(cluster, me) as t:
        with spawn_peer("grpc", cluster, other, me, peer_timeout=PEER_TIMEOUT) as proc:
            t.recv(other, "ready", timeout=60)
            t.send(other, "echo", Message({"ping": 1}))
            assert t.recv(other, "echo", timeout=TIMEOUT).meta == {"ping": 1}
            os.kill(proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(PeerLostError) as info:
                t.recv(other, "echo", timeout=TIMEOUT)
            assert info.value.task == other
            assert time.monotonic() - start < PEER_TIMEOUT + 5


# -- TLS -------------------------------------------------------------------------------------------

def _certificates_with_cryptography(directory, names):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name, key, cert):
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def build(subject, issuer, public_key, sign_key, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = (builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        return builder.sign(sign_key, hashes.SHA256())

    for ca_name, leaf_name in names:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"stratagem test {ca_name}")])
        write(ca_name, ca_key, build(ca_subject, ca_subject, ca_key.public_key(), ca_key, ca=True))
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, leaf_name)])
        write(leaf_name, key, build(subject, ca_subject, key.public_key(), ca_key, ca=False))


def _certificates_with_openssl(directory, names):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    (directory / "leaf.ext").write_text("basicConstraints=critical,CA:FALSE\n"
                                        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    for ca_name, leaf_name in names:
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
            "-subj", f"/CN=stratagem test {ca_name}", "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={leaf_name}",
            "-keyout", f"{leaf_name}.key", "-out", f"{leaf_name}.csr")
        run("x509", "-req", "-in", f"{leaf_name}.csr", "-CA", f"{ca_name}.pem", "-CAkey", f"{ca_name}.key",
            "-CAcreateserial", "-days", "1", "-extfile", "leaf.ext", "-out", f"{leaf_name}.pem")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and a task certificate for 127.0.0.1, and a second CA with its own certificate."""
    directory = tmp_path_factory.mktemp("certs")
    names = [("ca", "task"), ("other-ca", "stranger")]
    try:
        import cryptography
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("making test certificates needs the cryptography package or the openssl command")
        _certificates_with_openssl(directory, names)
    else:
        del cryptography  # only checked for
        _certificates_with_cryptography(directory, names)
    return {name: str(directory / name) for pair in names for name in pair}


def tls_options(certs, leaf="task", ca="ca", **extra):
    return {"tls_cert": certs[leaf] + ".pem", "tls_key": certs[leaf] + ".key", "tls_ca": certs[ca] + ".pem", **extra}


def test_tls_round_trip(certs):
    cluster = local_cluster(2)
    with make(cluster, "worker:0", **tls_options(certs)) as a, make(cluster, "worker:1", **tls_options(certs)) as b:
        a.send(b.task, "x", Message({"over": "tls"}, [np.arange(100000, dtype=np.float32)]))
        got = b.recv(a.task, "x", timeout=TIMEOUT)
        assert got.meta == {"over": "tls"} and got.buffers[0][-1] == 99999
        b.send(a.task, "y", Message({"back": 1}))
        assert a.recv(b.task, "y", timeout=TIMEOUT).meta == {"back": 1}
        # A plain-text client gets nowhere.
        with GrpcRawPeer(b.address, timeout=3) as plain:
            plain.send_raw(b"hello?")
            assert plain.status(TIMEOUT)[0] == grpc.StatusCode.UNAVAILABLE


def test_a_peer_signed_by_another_ca_is_refused(certs):
    cluster = local_cluster(2)
    with make(cluster, "worker:0", **tls_options(certs, leaf="stranger", ca="other-ca"), timeout=2.0) as stranger, \
            make(cluster, "worker:1", **tls_options(certs)) as b:
        with pytest.raises(TransportTimeout, match="TLS"):
            stranger.send(b.task, "x", Message({"forged": True}))
        with pytest.raises(TransportTimeout):
            b.recv(None, "x", timeout=0.5)


def test_mutual_tls_refuses_a_client_without_a_certificate(certs):
    cluster = local_cluster(3)  # worker:2 is played by raw clients
    options = tls_options(certs, tls_client_auth=True)
    with make(cluster, "worker:0", **options) as a, make(cluster, "worker:1", **options) as b:
        a.send(b.task, "x", Message({"mutual": True}))
        assert b.recv(a.task, "x", timeout=TIMEOUT).meta == {"mutual": True}
        ca = open(certs["ca"] + ".pem", "rb").read()
        hello, _ = handshake.make_hello(TaskId("worker", 2), cluster.cluster_id, None)
        # Server authentication alone is not enough: the server wants our certificate.
        with GrpcRawPeer(b.address, grpc.ssl_channel_credentials(root_certificates=ca), timeout=3) as client:
            client.send_raw(control(Kind.HELLO, hello))
            assert client.status(TIMEOUT)[0] == grpc.StatusCode.UNAVAILABLE
        # With the task certificate the same raw client gets through the TLS handshake.
        key, cert = (open(certs["task"] + ext, "rb").read() for ext in (".key", ".pem"))
        with GrpcRawPeer(b.address, grpc.ssl_channel_credentials(ca, key, cert), timeout=3) as client:
            client.send_raw(control(Kind.HELLO, hello))
            assert client.recv_frame(TIMEOUT).kind == Kind.WELCOME
        assert still_serves(a, b)


def test_openssl_certificates_work_too(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    _certificates_with_openssl(tmp_path, [("ca", "task")])
    certs = {name: str(tmp_path / name) for name in ("ca", "task")}
    cluster = local_cluster(2)
    options = tls_options(certs, tls_client_auth=True)
    with make(cluster, "worker:0", **options) as a, make(cluster, "worker:1", **options) as b:
        assert still_serves(a, b)
