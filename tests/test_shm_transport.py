"""The ``shm`` transport beyond the contract suite (which runs over it in test_transport_contract.py).

- A plain communicator script over ``shm`` under ``stratagem launch``: odd-sized all-reduces and a
  broadcast larger than a ring, every result checked exactly.
- Messages of odd sizes and many buffers stream through a ring far smaller than they are, both ways
  at once, with a cluster secret; a long two-process echo stream keeps its bytes and order.
- A task killed with SIGKILL in the middle of a message: the survivor raises ``PeerLostError`` naming
  it, unmaps both rings it shared with it, and nothing is left in ``/dev/shm`` (no ring ever had a name).
- The native all-reduce (through shared arenas): exact results on every rank for every op and several
  dtypes at 2 and 3 ranks, arenas that grow, ``out=`` and in place, a mismatch reported on every
  rank, a rank killed in the middle named by the survivor (and its memory unmapped).
- A send blocked by a frozen (SIGSTOP) receiver ends with ``PeerLostError`` once its heartbeats
  stop (``peer_timeout``), or with ``TransportClosed`` when the sender's transport closes.
- A hostile peer: a producer counter beyond the ring, a frame header claiming a huge payload, a memfd
  offered by a local process that never authenticated; the receiver drops the offender (or ignores
  the offer) and keeps serving the others.
- A task whose address is not on this host is refused with a pointer to zmq/grpc.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from stratagem.collectives import algorithms as coll
from stratagem.core import wire
from stratagem.core.cluster import ClusterSpec
from stratagem.collectives.communicator import Communicator
from stratagem.core.errors import CollectiveMismatchError, ConfigurationError, PeerLostError, TransportClosed
from stratagem.core.transport import Message
from stratagem.testing.peer import spawn_peer
from stratagem.testing.world import local_cluster, run_ranks, transport_world
from stratagem.transports.shm import rendezvous as shm_rendezvous
from stratagem.transports.shm.transport import ShmTransport, socket_address

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the shm transport is Linux-only")]

SCRIPTS = Path(__file__).parent / "scripts"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
CALL = 30.0


def _maps(pid: int | str = "self") -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _rings_mapped(name_part: str, pid: int | str = "self") -> set[str]:
    """The names of the rings mapped in process ``pid`` whose name contains ``name_part``."""
    return {line.split("memfd:stratagem-shm:")[1].split(" ")[0] for line in _maps(pid).splitlines()
            if "memfd:stratagem-shm:" in line and name_part in line}


def _wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# -- the user's script ----------------------------------------------------------------------------

def test_the_plain_communicator_script_over_shm():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    proc = subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--worker", "3", "--timeout", "90", "--",
         sys.executable, str(SCRIPTS / "shm_collectives.py")],
        capture_output=True, text=True, timeout=110, env=dict(env, PYTHONUNBUFFERED="1"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    for rank in range(3):
        assert f"[worker:{rank}] rank {rank}: ok" in proc.stdout, output


# -- data through small rings ------------------------------------------------------------------------

def _odd_message(i: int) -> Message:
    sizes = [0, 1, 4095, 4097, 65535, 65537, 1_000_003]
    n = sizes[i % len(sizes)]
    return Message({"i": i}, [np.full(n, i % 251, np.uint8), np.arange(i % 5, dtype=np.float64),
                              (np.arange(n // 3 + 1, dtype=np.int32) + i).reshape(-1, 1)])


def _check_odd(got: Message, i: int) -> None:
    expected = _odd_message(i)
    assert got.meta == {"i": i}
    for received, sent in zip(got.buffers, expected.buffers, strict=True):
        assert received.dtype == sent.dtype and received.shape == sent.shape
        np.testing.assert_array_equal(received, sent)


def test_odd_sizes_stream_both_ways_through_a_ring_smaller_than_the_messages():
    options = {"ring_bytes": 64 << 10, "chunk_bytes": 4096, "timeout": CALL, "secret": b"s3cret"}
    with transport_world("shm", 2, **options) as (a, b):
        count = 40
        errors: list = []

        def sender(src, dst):
            try:
                for i in range(count):
                    src.send(dst.task, "odd", _odd_message(i))
            except Exception as exc:  # reported below
                errors.append(exc)

        # Both send more than their ring holds before either receives: each send must keep
        # reading its own incoming ring while it waits for room, or both would block for ever.
        threads = [threading.Thread(target=sender, args=pair) for pair in ((a, b), (b, a))]
        for t in threads:
            t.start()
        for i in range(count):
            _check_odd(b.recv(a.task, "odd", timeout=CALL), i)
            _check_odd(a.recv(b.task, "odd", timeout=CALL), i)
        for t in threads:
            t.join(CALL)
        assert errors == [] and not any(t.is_alive() for t in threads)
        assert a.traffic.snapshot().sent_bytes() == sum(_odd_message(i).nbytes for i in range(count))


def test_a_long_two_process_echo_stream_keeps_bytes_and_order():
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    with ShmTransport(cluster, me, timeout=CALL, peer_timeout=3.0) as t:
        with spawn_peer("shm", cluster, other, me, peer_timeout=3.0):
            t.recv(other, "ready", timeout=60)
            count, sent = 200, 0
            for i in range(count):  # the echo comes back while we keep sending: both rings busy
                size = 1 + (i * 7919) % (3 << 20)
                t.send(other, "echo", Message({"i": i}, [(np.arange(size, dtype=np.uint32) * (i + 1))]))
                sent += 4 * size
            for i in range(count):
                got = t.recv(other, "echo", timeout=CALL)
                size = 1 + (i * 7919) % (3 << 20)
                assert got.meta == {"i": i}
                np.testing.assert_array_equal(got.buffers[0], np.arange(size, dtype=np.uint32) * (i + 1))
            assert t.traffic.snapshot().received_bytes() >= sent


# -- a peer killed in the middle of a message -----------------------------------------------------

def test_kill_9_mid_transfer_names_the_task_and_leaves_no_shared_memory():
    before = set(os.listdir("/dev/shm"))
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    tag = cluster.cluster_id[:8]
    with ShmTransport(cluster, me, timeout=CALL, peer_timeout=3.0) as t:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "shm_streamer.py"), cluster.to_json(),
                                 other.short, me.short], start_new_session=True)
        try:
            for i in range(3):  # it streams 32 MiB messages through an 8 MiB ring
                got = t.recv(other, "stream", timeout=60)
                assert got.meta == {"i": i} and got.buffers[0][-1] == (8 << 20) - 1
            t.send(other, "hello", Message({}, [np.zeros(1000)]))  # a ring our way too
            assert _wait_until(lambda: len(_rings_mapped(tag, proc.pid)) == 2), _maps(proc.pid)
            assert _rings_mapped(f"{tag}:{other.short}->{me.short}") and _rings_mapped(f"{tag}:{me.short}->{other.short}")
            # No ring is a /dev/shm file: nothing there to leak, whatever happens to the process.
            assert "/dev/shm" not in _maps(proc.pid)
            fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
            assert not [path for path in fds if path.startswith("/dev/shm")], fds
            os.kill(proc.pid, signal.SIGKILL)  # the streamer spends nearly all its time inside a send
            start = time.monotonic()
            with pytest.raises(PeerLostError) as info:
                while True:  # messages it completed before dying come first
                    t.recv(other, "stream", timeout=CALL)
            assert info.value.task == other and str(other) in str(info.value)
            assert time.monotonic() - start < 3.0 + 5
            # Both rings we shared with it are unmapped, so their memory is gone.
            assert _wait_until(lambda: not _rings_mapped(tag)), _rings_mapped(tag)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    leaked = [name for name in set(os.listdir("/dev/shm")) - before if "stratagem" in name or name.startswith("psm_")]
    assert leaked == []


# -- the native all-reduce ----------------------------------------------------------------------------

#: The native all-reduce's threshold in these tests (1 MiB, for speed; 8 MiB by default).
NATIVE = 1 << 20


def _communicators(world, **options):
    return [Communicator(t, timeout=CALL, **options) for t in world]


@pytest.mark.parametrize("size", [2, 3])
def test_the_native_allreduce_gives_every_rank_the_same_exact_result(size):
    rng = np.random.default_rng(7)
    cases = [("sum", np.float32, 300_001), ("mean", np.int64, 200_003), ("max", np.float64, 150_001),
             ("min", np.int16, 600_007), ("prod", np.float32, 262_144), ("sum", BFLOAT16, 700_001)]
    inputs = {(i, r): rng.standard_normal(n).astype(dtype) if np.dtype(dtype).kind == "f"
              else rng.integers(-100, 100, n).astype(dtype) for i, (_, dtype, n) in enumerate(cases)
              for r in range(size)}
    with transport_world("shm", size, timeout=CALL, native_allreduce_bytes=NATIVE) as world:
        comms = _communicators(world)

        def body(rank, _):
            return [comms[rank].allreduce(inputs[(i, rank)], op=op) for i, (op, _, _) in enumerate(cases)]

        results = run_ranks(world, body, timeout=60)
        for i, (op, dtype, n) in enumerate(cases):
            work = coll.working_dtype(op, np.dtype(dtype))
            expected = inputs[(i, 0)].astype(work)
            for r in range(1, size):  # in rank order, as the native path reduces
                expected = coll.OPS[op](expected, inputs[(i, r)].astype(work))
            if op == "mean":
                expected = expected / work.type(size)
            for rank in range(size):
                assert results[rank][i].dtype == work and results[rank][i].shape == (n,)
                assert results[rank][i].tobytes() == expected.tobytes(), (op, dtype, rank)
        assert comms[0]._session.seq == len(cases)  # counted once per call
        assert all(len(t._collectives._arenas) == 1 for t in world)  # it was the native path


def test_the_native_allreduce_grows_its_arenas_and_honours_out_and_in_place():
    with transport_world("shm", 2, timeout=CALL, native_allreduce_bytes=NATIVE) as world:
        comms = _communicators(world)

        def body(rank, _):
            results = []
            for n in (300_000, 3_000_000, 500_000):  # 1.2 MB, 12 MB (arenas grow), 2 MB
                x = np.full(n, rank + 1.0, np.float32)
                out = np.empty_like(x)
                assert comms[rank].allreduce(x, out=out) is out
                comms[rank].allreduce(x, out=x)  # in place
                results.append((float(out.min()), float(out.max()), float(x.min()), float(x.max())))
            return results

        assert run_ranks(world, body, timeout=60) == [[(3.0, 3.0, 3.0, 3.0)] * 3] * 2


def test_allreduce_traffic_is_counted_once_on_either_path():
    with transport_world("shm", 2, timeout=CALL, native_allreduce_bytes=NATIVE) as world:
        comms = _communicators(world)

        def body(rank, _):
            before = world[rank].traffic.snapshot()
            comms[rank].allreduce(np.ones(1000, np.float32))      # small: core's algorithm
            small = world[rank].traffic.snapshot() - before
            comms[rank].allreduce(np.ones(1 << 20, np.float32))   # 4 MiB: the native path
            large = world[rank].traffic.snapshot() - small - before
            return small.sent_bytes(), large.sent_bytes()

        for small, large in run_ranks(world, body, timeout=60):
            assert small == 4000  # recursive doubling at 2 ranks: the tensor once, not booked again
            # booked at what a ring moves (2 (n-1)/n of the tensor), plus the 24-byte agreement
            assert large == (4 << 20) + 24


def test_a_native_allreduce_mismatch_is_reported_on_every_rank():
    with transport_world("shm", 3, timeout=CALL, native_allreduce_bytes=NATIVE) as world:
        comms = _communicators(world)

        def body(rank, _):
            shape = 400_000 if rank != 2 else 400_001
            try:
                comms[rank].allreduce(np.ones(shape, np.float32))
            except CollectiveMismatchError as exc:
                return str(exc)
            return None

        errors = run_ranks(world, body, timeout=60)
        assert all(error is not None and "mismatch" in error for error in errors), errors
    with transport_world("shm", 2, timeout=CALL, native_allreduce_bytes=NATIVE) as world:  # native vs ring
        comms = _communicators(world)

        def other_algorithm(rank, _):
            with pytest.raises(CollectiveMismatchError):
                comms[rank].allreduce(np.ones(400_000, np.float32), algorithm="auto" if rank == 0 else "ring")

        run_ranks(world, other_algorithm, timeout=60)


def test_a_rank_killed_during_native_allreduces_is_named():
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    with ShmTransport(cluster, me, timeout=CALL, peer_timeout=3.0) as t:
        comm = Communicator(t, timeout=CALL)
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "shm_allreduce_loop.py"), cluster.to_json(),
                                 other.short], start_new_session=True)
        try:
            x = np.ones(4 << 20, np.float32)
            for _ in range(5):
                assert comm.allreduce(x)[-1] == 2.0
            os.kill(proc.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(PeerLostError) as info:
                for _ in range(1000):
                    comm.allreduce(x)
            assert info.value.task == other and time.monotonic() - start < 3.0 + 5
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert _wait_until(lambda: not _rings_mapped(f"{cluster.cluster_id[:8]}:{other.short}"))


# -- a frozen receiver -------------------------------------------------------------------------------

def test_a_send_blocked_by_a_frozen_receiver_ends_by_loss_or_close():
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    big = np.ones(8 << 20, np.float32)  # 32 MiB: four rings' worth
    with ShmTransport(cluster, me, timeout=CALL, peer_timeout=2.0) as t:
        with spawn_peer("shm", cluster, other, me, peer_timeout=2.0) as proc:
            t.recv(other, "ready", timeout=60)
            # A round trip: rings both ways, and the control connections' handshakes are done.
            t.send(other, "echo", Message({}, [np.zeros(10)]))
            t.recv(other, "echo", timeout=CALL)
            os.kill(proc.pid, signal.SIGSTOP)  # alive, but nobody drains its ring any more
            try:
                start = time.monotonic()
                with pytest.raises(PeerLostError) as info:
                    t.send(other, "big", Message({}, [big]))
                # Its heartbeats stop, so the send gives up after peer_timeout, naming it.
                assert info.value.task == other and time.monotonic() - start < 2.0 + 8
            finally:
                os.kill(proc.pid, signal.SIGCONT)

    cluster = local_cluster(2)
    me, other = cluster.tasks()
    t = ShmTransport(cluster, me, timeout=CALL, peer_timeout=30.0)
    t.start()
    try:
        with spawn_peer("shm", cluster, other, me, peer_timeout=30.0) as proc:
            t.recv(other, "ready", timeout=60)
            t.send(other, "echo", Message({}, [np.zeros(10)]))
            t.recv(other, "echo", timeout=CALL)
            os.kill(proc.pid, signal.SIGSTOP)
            errors: list = []

            def send():
                try:
                    t.send(other, "big", Message({}, [big]))
                except Exception as exc:
                    errors.append(exc)

            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(0.5)
            assert sender.is_alive()  # waiting for room in the ring
            t.close()
            sender.join(10)
            assert not sender.is_alive() and len(errors) == 1 and isinstance(errors[0], TransportClosed), errors
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        t.close()


def test_a_ring_announced_while_the_receiver_is_still_starting_is_read():
    """A peer can finish its handshake and announce a ring the moment our control transport starts,
    before our own start() has returned: that ring must be read (its announcement once came before
    the listener was in place and was dropped, so everything the peer sent was lost: a hang)."""
    cluster = local_cluster(2)
    a, b = ShmTransport(cluster, "worker:0", timeout=CALL), ShmTransport(cluster, "worker:1", timeout=CALL)
    start_control = b.control.start
    sent = []

    def start_control_then_let_a_announce():
        start_control()
        sender = threading.Thread(target=lambda: sent.append(a.send(b.task, "x", Message({"n": 1}))))
        sender.start()
        sender.join(CALL)
        _wait_until(lambda: a.task in b._announced, 5.0)   # b's control reader handles the announcement

    b.control.start = start_control_then_let_a_announce
    a.start()
    try:
        b.start()
        assert sent == [None]
        assert b.recv(a.task, "x", timeout=10).meta == {"n": 1}
    finally:
        a.close()
        b.close()


# -- hostile peers ----------------------------------------------------------------------------------

def test_a_producer_counter_beyond_the_ring_drops_that_peer_only():
    with transport_world("shm", 3, timeout=CALL, ring_bytes=64 << 10, chunk_bytes=4096) as (a, b, c):
        a.send(b.task, "x", Message({"n": 1}))
        assert b.recv(a.task, "x", timeout=CALL).meta == {"n": 1}
        ring = a._out[b.task]
        # Claim more bytes published than the ring can hold: reading them would run past its end.
        ring.region.store(64, ring.writer.written + ring.region.capacity + 1)
        ring.conn.send(b"\1")
        with pytest.raises(PeerLostError, match="broke the shared-memory ring's rules") as info:
            b.recv(a.task, "x", timeout=CALL)
        assert info.value.task == a.task and "outside" in str(info.value)
        c.send(b.task, "still", Message({"ok": 1}, [np.arange(50_000)]))
        got = b.recv(c.task, "still", timeout=CALL)
        assert got.meta == {"ok": 1} and got.buffers[0][-1] == 49_999


def test_a_frame_header_claiming_a_huge_payload_is_refused_before_allocating():
    with transport_world("shm", 3, timeout=CALL) as (a, b, c):
        a.send(b.task, "x", Message({"n": 1}))
        b.recv(a.task, "x", timeout=CALL)
        ring = a._out[b.task]
        header = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(wire.Kind.DATA), 0, 16, 1 << 50)
        ring.writer.write([header], wait=lambda: None)
        with pytest.raises(PeerLostError, match="exceeds the limit"):
            b.recv(a.task, "x", timeout=CALL)
        c.send(b.task, "still", Message({"ok": 1}))
        assert b.recv(c.task, "still", timeout=CALL).meta == {"ok": 1}


def test_memory_offered_by_a_process_that_never_authenticated_is_never_mapped():
    with transport_world("shm", 2, timeout=CALL, secret=b"s3cret") as (a, b):
        fd = os.memfd_create("stratagem-shm:intruder")
        os.ftruncate(fd, 4096 + (64 << 10))
        try:
            conn = shm_rendezvous.offer(socket_address(b.cluster.cluster_id, b.task), b"i" * 16, 64 << 10, fd, 5)
        finally:
            os.close(fd)
        try:
            for i in range(3):  # b handles announcements (and so its socket) meanwhile
                a.send(b.task, "x", Message({"i": i}, [np.arange(10)]))
                assert b.recv(a.task, "x", timeout=CALL).meta == {"i": i}
            assert not [line for line in _maps().splitlines() if "intruder" in line]
            assert a.lost_peers() == {} and b.lost_peers() == {}
        finally:
            conn.close()


# -- configuration ----------------------------------------------------------------------------------

def test_a_task_on_another_host_is_refused_pointing_to_zmq():
    cluster = ClusterSpec({"worker": ["127.0.0.1:23456", "192.0.2.10:23457"]})  # TEST-NET-1: not ours
    with pytest.raises(ConfigurationError, match=r"worker/task:1.*not an address of this machine.*'zmq'"):
        ShmTransport(cluster, "worker:0")


def test_bad_options_and_reserved_metadata_are_refused():
    cluster = local_cluster(1)
    with pytest.raises(ConfigurationError, match="ring_bytes"):
        ShmTransport(cluster, "worker:0", ring_bytes=100)
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        ShmTransport(cluster, "worker:0", ring_bytes=1 << 20, chunk_bytes=1 << 20)
    with pytest.raises(ConfigurationError, match="native_allreduce_bytes"):
        ShmTransport(cluster, "worker:0", native_allreduce_bytes=0)
    with ShmTransport(cluster, "worker:0") as t:
        with pytest.raises(ConfigurationError, match="reserved"):
            t.send(t.task, "x", Message({"__shm__": 1}))


def test_the_ring_socket_is_abstract():
    cluster = local_cluster(1)
    with ShmTransport(cluster, "worker:0") as t:
        address = socket_address(cluster.cluster_id, t.task)
        assert address.startswith(b"\0")  # abstract: no file, freed by the kernel when we die
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(address)
        finally:
            probe.close()


def test_a_transport_refused_for_another_host_ends_with_its_one_error_line(tmp_path):
    """The script ends by the refusal; the exit hook that ends what the script left open must not then
    trip over the half-made transport (it printed an AttributeError after the error)."""
    script = tmp_path / "refused.py"
    script.write_text("import stratagem\nfrom stratagem.core.cluster import ClusterSpec\n"
                      "stratagem.transport('shm', cluster=ClusterSpec({'worker': ['127.0.0.1:1', '10.9.9.9:2']}),"
                      " task='worker:0')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATAGEM_")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and "connects only tasks on one host" in done.stderr, done.stderr
    assert "AttributeError" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
