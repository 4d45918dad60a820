"""Peers that hold what they should not: a grpc task's server slots, or its memory.

(a) Connections that never complete the handshake (idle gRPC streams, TCP connections that never
speak HTTP/2) must not keep a cluster's tasks out: a task in the handshake budget's way gets a
RESOURCE_EXHAUSTED and its sender tries again within its timeout. (b) An authenticated peer whose
frame header declares gigabytes must not make the receiver take that memory before the bytes come.
Raw gRPC clients (``stratagem.testing.raw_peers.GrpcRawPeer``) play the attacker, over real HTTP/2 on
127.0.0.1; the receiver of (b) is a process of its own, so that its memory is its alone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import msgpack
import numpy as np
import pytest

grpc = pytest.importorskip("grpc", reason="the grpc transport needs grpcio: pip install 'stratagem[grpc]'")

from stratagem.core import wire  # noqa: E402
from stratagem.transport_kit import handshake  # noqa: E402
from stratagem.core.transport import Message  # noqa: E402
from stratagem.core.wire import Kind  # noqa: E402
from stratagem.testing.peer import spawn_peer  # noqa: E402
from stratagem.testing.raw_peers import GrpcRawPeer  # noqa: E402
from stratagem.testing.world import local_cluster, wait_for  # noqa: E402
from stratagem.transports.grpc.transport import GrpcTransport  # noqa: E402
from stratagem.transports.framing import WHOLE_BYTES, Reassembler, chunks  # noqa: E402

TIMEOUT = 20.0
SECRET = b"cluster secret"


def make(cluster, task, **options):
    return GrpcTransport(cluster, task, **{"timeout": TIMEOUT, "peer_timeout": 3.0, "secret": SECRET, **options})


@contextlib.contextmanager
def idle_connections(address: str, streams: int, sockets: int):
    """``streams`` gRPC streams that send nothing, and ``sockets`` TCP connections that never start
    HTTP/2, all held open against ``address``; closed at the end."""
    held: list = []
    try:
        for _ in range(streams):
            held.append(GrpcRawPeer(address))
        host, _, port = address.rpartition(":")
        for _ in range(sockets):
            held.append(socket.create_connection((host, int(port)), timeout=5))
        yield held
    finally:
        for thing in held:
            with contextlib.suppress(Exception):
                thing.close()


# -- (a) idle connections do not keep the tasks out -------------------------------------------------

def test_idle_unauthenticated_connections_do_not_keep_a_cluster_from_forming():
    cluster = local_cluster(3)
    tasks = cluster.tasks()
    target = make(cluster, tasks[1])
    target.start()
    others = []
    try:
        slots = len(cluster) + 8  # the default server budget, which 12 idle streams used to exhaust
        with idle_connections(target.address, streams=2 * slots, sockets=12) as held:
            # Every idle stream reached the server: as many as the budget wait for their handshake,
            # the others were refused or cut off.
            idle = [thing for thing in held if isinstance(thing, GrpcRawPeer)]
            assert wait_for(lambda: sum(stream.call.done() for stream in idle) >= slots)
            assert {s.call.code() for s in idle if s.call.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            others = [make(cluster, task) for task in (tasks[0], tasks[2])]
            for t in others:
                t.start()
            world = [others[0], target, others[1]]
            # Every task sends to every other one (so every task's server accepts every peer's stream).
            for sender in world:
                for receiver in world:
                    if receiver is not sender:
                        sender.send(receiver.task, "hi", Message({"from": sender.task.short}))
            for receiver in world:
                for sender in world:
                    if sender is not receiver:
                        got = receiver.recv(sender.task, "hi", timeout=TIMEOUT)
                        assert got.meta == {"from": sender.task.short}
            assert target.stats["data_frames"] == 2
    finally:
        for t in [target, *others]:
            t.close()


def test_a_task_that_finds_the_server_full_tries_again_within_its_timeout():
    # One slot after the handshake (gRPC then refuses a third stream at once with RESOURCE_EXHAUSTED):
    # the third task's send waits for a slot instead of failing.
    cluster = local_cluster(4)
    server_task, first, second, third = cluster.tasks()
    server = make(cluster, server_task, max_workers=1)
    made = [server] + [make(cluster, task) for task in (first, second, third)]
    for t in made:
        t.start()
    try:
        _, a, b, c = made
        a.send(server.task, "in", Message({"n": 1}))
        b.send(server.task, "in", Message({"n": 2}))
        assert sorted(server.recv(None, "in", timeout=TIMEOUT).meta["n"] for _ in range(2)) == [1, 2]
        sent = []
        sender = threading.Thread(target=lambda: sent.append(c.send(server.task, "in", Message({"n": 3}))),
                                  daemon=True)
        sender.start()
        # The third stream is refused while both slots are held; its sender keeps trying.
        time.sleep(1.0)
        assert sender.is_alive() and not sent
        a.close()  # frees a slot
        sender.join(TIMEOUT)
        assert sent == [None]
        assert server.recv(c.task, "in", timeout=TIMEOUT).meta == {"n": 3}
    finally:
        for t in made:
            t.close()


# -- (b) memory is taken as the bytes arrive -----------------------------------------------------------

def memory_mib(pid: int) -> dict[str, float]:
    """Resident memory and private writable address space (what the kernel commits) of ``pid``."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmData"):
                fields[name] = int(value.split()[0]) / 1024
    return fields


def authenticated_stream(cluster, acceptor, as_task) -> GrpcRawPeer:
    """A raw stream through the whole handshake with the cluster's secret: a peer that passed it."""
    stream = GrpcRawPeer(cluster.address(acceptor))
    hello, nonce = handshake.make_hello(as_task, cluster.cluster_id, SECRET)
    stream.send_raw(wire.encode_bytes(Kind.HELLO, "", hello))
    challenge = stream.recv_frame(TIMEOUT)
    assert challenge.kind == Kind.CHALLENGE
    auth = handshake.answer_challenge(SECRET, cluster.cluster_id, as_task, acceptor, nonce, challenge.meta)
    stream.send_raw(wire.encode_bytes(Kind.AUTH, "", auth))
    assert stream.recv_frame(TIMEOUT).kind == Kind.WELCOME
    return stream


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the receiver's memory from /proc")
def test_a_header_declaring_4_gib_takes_no_memory_until_the_bytes_come():
    cluster = local_cluster(3)
    me, receiver, liar = cluster.tasks()
    declared = wire.DEFAULT_LIMITS.max_payload_bytes  # 4 GiB: the most a frame may declare
    with make(cluster, me, peer_timeout=30.0) as honest:
        with spawn_peer("grpc", cluster, receiver, me, secret=SECRET, peer_timeout=30.0) as proc:
            honest.recv(receiver, "ready", timeout=60)
            honest.send(receiver, "echo", Message({"n": 1}, [np.ones(1 << 20)]))  # its buffers are warm
            honest.recv(receiver, "echo", timeout=TIMEOUT)
            before = memory_mib(proc.pid)
            streams = []
            try:
                # One frame of a single 4 GiB buffer, another of 4096 buffers of 1 MiB; headers only.
                for shape in ([[declared // 4]], [[declared // 4096 // 4]] * 4096):
                    stream = authenticated_stream(cluster, receiver, liar)
                    envelope = msgpack.packb({"t": "x", "m": {}, "b": [["float32", s] for s in shape]})
                    stream.send_raw(wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.DATA), 0, len(envelope),
                                                declared) + envelope)
                    streams.append(stream)
                # Some bytes of a large buffer do come: they take what they are, not what was declared.
                sent = 3 * WHOLE_BYTES // 2
                for _ in range(sent >> 20):
                    streams[0].send_raw(b"\x01" * (1 << 20))
                # The receiver still serves the honest task (which also shows the frames were read).
                time.sleep(0.5)
                honest.send(receiver, "echo", Message({"n": 2}))
                assert honest.recv(receiver, "echo", timeout=TIMEOUT).meta == {"n": 2}
                after = memory_mib(proc.pid)
            finally:
                for stream in streams:
                    stream.close()
            grown = {name: after[name] - before[name] for name in before}
            # Before, the receiver reserved the 8 GiB declared (VmData +8192 MiB) as the headers came.
            assert grown["VmRSS"] < 64 + sent / 2**20, (before, after)
            assert grown["VmData"] < 512, (before, after)
            honest.send(receiver, "echo", Message({"n": 3}))
            assert honest.recv(receiver, "echo", timeout=TIMEOUT).meta == {"n": 3}


def test_large_buffers_arrive_intact_whatever_the_pieces():
    rng = np.random.default_rng(1)
    buffers = [np.zeros(0, np.float32), rng.standard_normal(3 * WHOLE_BYTES // 8 + 5),  # grows twice
               np.arange(10, dtype=np.int16), rng.integers(0, 255, WHOLE_BYTES + 1, dtype=np.uint8),
               np.zeros((0, 3))]
    parts = wire.encode(Kind.DATA, "big", {"k": 1}, buffers)
    stream = b"".join(chunks(parts, 1 << 20))
    cuts = [0, 7, 60, 3 << 20, (3 << 20) + 1, 10 << 20, 33 << 20, len(stream)]
    got = []
    reassembler = Reassembler(wire.DEFAULT_LIMITS)
    for start, stop in zip(cuts, cuts[1:]):
        reassembler.feed(stream[start:stop], got.append)
    (frame,) = got
    assert frame.tag == "big" and frame.meta == {"k": 1} and reassembler.between_frames
    for received, original in zip(frame.buffers, buffers, strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        np.testing.assert_array_equal(received, original)
        assert received.flags.writeable and received.flags.aligned
    frame.buffers[1][:] = 0  # owned by the receiver
