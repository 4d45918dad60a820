"""The transport contract suite, written once and run against every transport (the contract is stated in
:mod:`stratagem.core.transport`).

A transport plugin passes the contract if this suite passes against it. Third-party packages reuse
it by subclassing::

    from stratagem.testing.contract import TransportContract

    class TestMyTransport(TransportContract):
        transport = "mytransport"      # the registered name

Every test builds fresh endpoints on free ports of 127.0.0.1 and closes them, and every blocking call
has a timeout. Process-based tests (a peer killed with SIGKILL) run only for transports whose
endpoints can live in separate processes (``in_process = False``).
"""

from __future__ import annotations

import contextlib
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from stratagem.core.cluster import TaskId
from stratagem.core.errors import (
    AuthenticationError,
    PeerLostError,
    TransportClosed,
    TransportTimeout,
)
from stratagem.core.transport import Message
from stratagem.testing.peer import spawn_peer
from stratagem.testing.world import local_cluster, run_ranks, transport_world

#: Seconds any single blocking call in the suite may wait.
CALL_TIMEOUT = 30.0
#: How fast a lost peer must be reported (the peer_timeout the suite configures, plus slack).
PEER_TIMEOUT = 3.0


class TransportContract:
    """Subclass and set ``transport`` to the registered name of the transport under test."""

    transport: str = ""
    #: Extra constructor options for the transport under test.
    options: dict = {}

    # -- fixtures ----------------------------------------------------------------------------------
    def world(self, size, **options):
        merged = {"timeout": CALL_TIMEOUT, "peer_timeout": PEER_TIMEOUT, **self.options, **options}
        return transport_world(self.transport, size, **merged)

    def transport_class(self):
        from stratagem.plugins.manager import plugin_manager

        return plugin_manager().transport_class(self.transport)

    # -- delivery ----------------------------------------------------------------------------------
    def test_roundtrip_meta_and_buffers(self):
        with self.world(2) as (a, b):
            arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(7, dtype=np.int64),
                      np.array([True, False]), np.arange(5, dtype=np.float16),
                      np.arange(5, dtype=ml_dtypes.bfloat16), np.zeros((2, 0), np.float64)]
            meta = {"step": 3, "name": "grads", "nested": {"a": [1, 2.5, None, b"x"]}, "flag": True}
            a.send(b.task, "t", Message(meta, arrays))
            got = b.recv(a.task, "t", timeout=CALL_TIMEOUT)
            assert got.src == a.task
            assert got.meta == meta
            assert len(got.buffers) == len(arrays)
            for sent, received in zip(arrays, got.buffers):
                assert received.dtype == sent.dtype and received.shape == sent.shape
                np.testing.assert_array_equal(received, sent)

    def test_ordering_per_tag(self):
        with self.world(2) as (a, b):
            for i in range(300):
                a.send(b.task, "seq", Message({"i": i}, [np.full(i % 7, i, np.int32)]))
            received = [b.recv(a.task, "seq", timeout=CALL_TIMEOUT) for _ in range(300)]
            assert [m.meta["i"] for m in received] == list(range(300))
            assert all((m.buffers[0] == m.meta["i"]).all() for m in received)

    def test_tags_are_independent_mailboxes(self):
        with self.world(2) as (a, b):
            a.send(b.task, "first", Message({"v": 1}))
            a.send(b.task, "second", Message({"v": 2}))
            # The later tag can be taken first: tags are separate mailboxes, not one stream.
            assert b.recv(a.task, "second", timeout=CALL_TIMEOUT).meta == {"v": 2}
            assert b.recv(a.task, "first", timeout=CALL_TIMEOUT).meta == {"v": 1}

    def test_any_source_receive(self):
        with self.world(4) as world:
            sink = world[0]
            for rank in range(1, 4):
                for i in range(20):
                    world[rank].send(sink.task, "any", Message({"rank": rank, "i": i}))
            got = [sink.recv(None, "any", timeout=CALL_TIMEOUT) for _ in range(60)]
            by_source: dict = {}
            for m in got:
                assert m.src == world[m.meta["rank"]].task
                by_source.setdefault(m.meta["rank"], []).append(m.meta["i"])
            assert by_source == {r: list(range(20)) for r in range(1, 4)}  # ordered per source

    def test_traffic_counts_payload_bytes_per_peer(self):
        # Read on one endpoint only (the others may be proxies in another process, as over MPI).
        with self.world(2) as (a, b):
            before = a.traffic.snapshot()
            a.send(b.task, "t", Message({"step": 1}, [np.zeros(1000, np.float32), np.zeros(3, np.int8)]))
            b.recv(a.task, "t", timeout=CALL_TIMEOUT)
            b.send(a.task, "u", Message({}, [np.zeros(10, np.float64)]))
            a.recv(b.task, "u", timeout=CALL_TIMEOUT)
            a.send(a.task, "me", Message({}, [np.zeros(7, np.float64)]))   # to itself: not traffic
            a.recv(a.task, "me", timeout=CALL_TIMEOUT)
            delta = a.traffic.snapshot() - before
            assert delta.peers == {b.task: (4003, 1, 80, 1)}
            assert delta.sent_bytes() == 4003 and delta.received_bytes(jobs={b.task.job}) == 80

    def test_send_to_self(self):
        with self.world(1) as (a,):
            a.send(a.task, "me", Message({"x": 1}, [np.arange(3)]))
            m = a.recv(a.task, "me", timeout=CALL_TIMEOUT)
            assert m.meta == {"x": 1} and m.buffers[0].tolist() == [0, 1, 2]

    def test_buffers_may_be_reused_after_send(self):
        with self.world(2) as (a, b):
            for size in (10, 1 << 20):  # a small (copied) and a large (zero-copy) message
                data = np.arange(size, dtype=np.float64)
                a.send(b.task, "reuse", Message({}, [data]))
                data[:] = -1.0  # overwrite at once: what was sent must not change
                got = b.recv(a.task, "reuse", timeout=CALL_TIMEOUT).buffers[0]
                np.testing.assert_array_equal(got, np.arange(size, dtype=np.float64))

    def test_empty_message_and_many_buffers(self):
        with self.world(2) as (a, b):
            a.send(b.task, "e", Message())
            assert b.recv(a.task, "e", timeout=CALL_TIMEOUT).buffers == []
            parts = [np.full(3, i, np.int16) for i in range(200)]
            a.send(b.task, "many", Message({}, parts))
            got = b.recv(a.task, "many", timeout=CALL_TIMEOUT).buffers
            assert [int(p[0]) for p in got] == list(range(200))

    @pytest.mark.slow
    def test_large_buffer_256mb(self):
        with self.world(2) as (a, b):
            big = np.arange(64 * 2**20, dtype=np.float32)  # 256 MiB
            a.send(b.task, "big", Message({"n": big.size}, [big]))
            got = b.recv(a.task, "big", timeout=120).buffers[0]
            assert got.nbytes == 256 * 2**20
            assert got[0] == 0 and got[-1] == big[-1] and got[123456789 % big.size] == big[123456789 % big.size]
            del big
            np.testing.assert_array_equal(got[:: 4096], np.arange(0, 64 * 2**20, 4096, dtype=np.float32))

    def test_many_concurrent_tags(self):
        with self.world(2) as (a, b):
            tags = [f"tag-{i}" for i in range(8)]
            errors: list = []

            def sender(tag):
                for i in range(50):
                    a.send(b.task, tag, Message({"i": i, "tag": tag}, [np.full(16, i, np.int64)]))

            def receiver(tag):
                try:
                    for i in range(50):
                        m = b.recv(a.task, tag, timeout=CALL_TIMEOUT)
                        if m.meta != {"i": i, "tag": tag} or int(m.buffers[0][0]) != i:
                            errors.append((tag, i, m.meta))
                except Exception as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=f, args=(t,)) for t in tags for f in (sender, receiver)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(CALL_TIMEOUT * 2)
            assert not any(t.is_alive() for t in threads)
            assert errors == []

    def test_ranks_exchange_concurrently(self):
        def exchange(rank, t):
            peers = [p for p in t.cluster.tasks() if p != t.task]
            for p in peers:
                t.send(p, "x", Message({"from": rank}, [np.full(1000, rank, np.float32)]))
            return sorted(int(t.recv(p, "x", timeout=CALL_TIMEOUT).buffers[0][0]) for p in peers)

        with self.world(3) as world:
            assert run_ranks(world, exchange, timeout=CALL_TIMEOUT) == [[1, 2], [0, 2], [0, 1]]

    # -- timeouts and failures ---------------------------------------------------------------------
    def test_recv_timeout(self):
        with self.world(2) as (a, b):
            start = time.monotonic()
            with pytest.raises(TransportTimeout, match="nothing"):
                b.recv(a.task, "nothing", timeout=0.3)
            with pytest.raises(TransportTimeout):
                b.recv(None, "nothing", timeout=0.3)
            assert time.monotonic() - start < 10

    def test_close_wakes_a_blocked_recv(self):
        with self.world(2) as (a, b):
            errors = []

            def wait():
                try:
                    b.recv(a.task, "never", timeout=CALL_TIMEOUT)
                except Exception as exc:
                    errors.append(exc)

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.2)
            b.close()
            waiter.join(CALL_TIMEOUT)
            assert not waiter.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], TransportClosed)

    def test_dead_peer_raises_peer_lost_naming_it(self):
        with self.world(3) as (a, b, c):
            b.send(a.task, "hi", Message())
            a.recv(b.task, "hi", timeout=CALL_TIMEOUT)  # a and b are connected
            waiting_started = time.monotonic()
            errors = []

            def wait():
                try:
                    a.recv(b.task, "never", timeout=CALL_TIMEOUT)
                except Exception as exc:
                    errors.append(exc)

            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.2)
            b.abort()  # dies without a goodbye
            waiter.join(CALL_TIMEOUT)
            assert not waiter.is_alive()
            assert len(errors) == 1 and isinstance(errors[0], PeerLostError), errors
            assert errors[0].task == b.task and str(b.task) in str(errors[0])
            assert time.monotonic() - waiting_started < PEER_TIMEOUT + 5
            with pytest.raises(PeerLostError) as info:
                a.send(b.task, "after", Message())
            assert info.value.task == b.task
            # The others are unaffected.
            c.send(a.task, "still", Message({"ok": 1}))
            assert a.recv(c.task, "still", timeout=CALL_TIMEOUT).meta == {"ok": 1}

    def test_messages_delivered_before_death_are_kept(self):
        with self.world(2) as (a, b):
            b.send(a.task, "last", Message({"n": 1}))
            a.recv(b.task, "last", timeout=CALL_TIMEOUT)
            b.send(a.task, "last", Message({"n": 2}))
            time.sleep(0.3)
            b.abort()
            assert a.recv(b.task, "last", timeout=CALL_TIMEOUT).meta == {"n": 2}
            with pytest.raises(PeerLostError):
                a.recv(b.task, "last", timeout=CALL_TIMEOUT)

    def test_everything_sent_before_a_close_is_delivered(self):
        with self.world(2) as (a, b):
            payload = np.arange(256 * 1024, dtype=np.float32)  # 1 MiB, the zero-copy path
            for i in range(100):
                a.send(b.task, "tail", Message({"i": i}, [payload]))
            a.close()  # a graceful close flushes what was queued
            got = [b.recv(a.task, "tail", timeout=CALL_TIMEOUT).meta["i"] for _ in range(100)]
            assert got == list(range(100))
            with pytest.raises(PeerLostError, match="closed"):
                b.recv(a.task, "tail", timeout=CALL_TIMEOUT)

    def test_close_and_abort_end_a_transport_once(self):
        with self.world(2) as (a, b):
            a.send(b.task, "hi", Message())
            b.recv(a.task, "hi", timeout=CALL_TIMEOUT)
            a.abort()
            a.close()  # after abort(): nothing more to do (no goodbye either)
            a.abort()
            with pytest.raises(TransportClosed):
                a.send(b.task, "hi", Message())
            with pytest.raises(PeerLostError):
                b.recv(a.task, "hi", timeout=CALL_TIMEOUT)
            b.close()
            b.close()

    def test_sigkilled_peer_process_raises_peer_lost(self):
        if self.transport_class().in_process:
            pytest.skip(f"the {self.transport} transport keeps every endpoint in one process")
        with self._endpoint_and_peer_process() as (t, other, proc):
            t.send(other, "echo", Message({"ping": 1}, [np.arange(4)]))
            assert t.recv(other, "echo", timeout=CALL_TIMEOUT).meta == {"ping": 1}
            proc.kill()  # SIGKILL: no goodbye, no cleanup
            start = time.monotonic()
            with pytest.raises(PeerLostError) as info:
                t.recv(other, "echo", timeout=CALL_TIMEOUT)
            assert info.value.task == other
            assert str(other) in str(info.value)
            assert time.monotonic() - start < PEER_TIMEOUT + 5

    @contextlib.contextmanager
    def _endpoint_and_peer_process(self):
        """``(our transport, the peer's task, the peer's process)``: our endpoint in this process, the
        peer's in its own (:func:`~stratagem.testing.peer.spawn_peer`), ready; both ended after the block."""
        cluster = local_cluster(2)
        me, other = cluster.tasks()
        from stratagem.plugins.manager import plugin_manager

        t = plugin_manager().create_transport(self.transport, cluster=cluster, task=me, timeout=CALL_TIMEOUT,
                                              peer_timeout=PEER_TIMEOUT, **self.options)
        t.start()
        try:
            with spawn_peer(self.transport, cluster, other, me, peer_timeout=PEER_TIMEOUT) as proc:
                assert t.recv(other, "ready", timeout=60).meta["pid"] == proc.pid
                yield t, other, proc
        finally:
            t.close()

    def test_a_peer_restarted_at_once_counts_as_lost_once(self):
        """A peer SIGKILLed and started again at once, possibly before its old connection's loss is
        settled, still counts as one loss (``peer_losses``: what an elastic world watches to drop
        the old process's generation), and its new process is served."""
        cls = self.transport_class()
        if cls.in_process or not cls.elastic:
            pytest.skip(f"the {self.transport} transport keeps every endpoint in one process" if cls.in_process
                        else f"the {self.transport} transport does not re-accept a restarted peer (elastic = False)")
        with self._endpoint_and_peer_process() as (t, other, first):
            t.send(other, "echo", Message({"ping": 1}))
            assert t.recv(other, "echo", timeout=CALL_TIMEOUT).meta == {"ping": 1}
            assert t.peer_losses(other) == 0
            first.kill()
            first.wait(timeout=CALL_TIMEOUT)
            with spawn_peer(self.transport, t.cluster, other, t.task, peer_timeout=PEER_TIMEOUT) as second:
                # From any source: a receive from a task declared lost fails until its new process is in.
                ready = t.recv(None, "ready", timeout=60)
                assert (ready.src, ready.meta["pid"]) == (other, second.pid)
                t.send(other, "echo", Message({"ping": 2}))
                assert t.recv(other, "echo", timeout=CALL_TIMEOUT).meta == {"ping": 2}
                assert t.peer_losses(other) == 1, f"{t.peer_losses(other)} losses counted: {t.lost_peers()}"
                assert other not in t.lost_peers()

    def test_secret_mismatch_is_refused(self):
        if self.transport_class().in_process:
            pytest.skip(f"the {self.transport} transport has no connections to authenticate")
        cluster = local_cluster(2)
        from stratagem.plugins.manager import plugin_manager

        pm = plugin_manager()
        a = pm.create_transport(self.transport, cluster=cluster, task=cluster.tasks()[0], secret=b"one",
                                timeout=5.0, peer_timeout=PEER_TIMEOUT, **self.options)
        b = pm.create_transport(self.transport, cluster=cluster, task=cluster.tasks()[1], secret=b"two",
                                timeout=5.0, peer_timeout=PEER_TIMEOUT, **self.options)
        a.start()
        b.start()
        try:
            with pytest.raises(AuthenticationError, match="secret"):
                a.send(b.task, "x", Message({"secret": "data"}))
            with pytest.raises(TransportTimeout):
                b.recv(a.task, "x", timeout=1.0)  # nothing got through
        finally:
            a.close()
            b.close()

    def test_same_secret_is_accepted(self):
        with self.world(2, secret=b"shared-secret") as (a, b):
            a.send(b.task, "x", Message({"ok": True}, [np.arange(3)]))
            assert b.recv(a.task, "x", timeout=CALL_TIMEOUT).meta == {"ok": True}
            b.send(a.task, "y", Message({"back": 1}))
            assert a.recv(b.task, "y", timeout=CALL_TIMEOUT).meta == {"back": 1}

    # -- native collectives ----------------------------------------------------------------------------
    #: Calls that exercise what natives take and decline: (collective, rank -> input, options).
    NATIVE_CALLS = (
        ("allreduce", lambda r: np.arange(10, dtype=np.float32) * (r + 1), {"op": "sum"}),
        ("allreduce", lambda r: np.full(1 << 21, r - 0.5, np.float32), {"op": "max"}),    # 8 MiB
        ("allreduce", lambda r: np.full(1 << 21, r + 1, np.float32), {"op": "sum"}),
        ("allreduce", lambda r: np.arange(6, dtype=np.float16), {"op": "sum"}),
        ("allreduce", lambda r: np.array([r, -r], np.int32), {"op": "min"}),
        ("reduce_scatter", lambda r: np.arange(7, dtype=np.float64), {"op": "sum"}),
        ("allgather", lambda r: np.array([r, r], np.int64), {}),
        ("broadcast", lambda r: np.arange(5, dtype=np.float32) if r == 0 else None, {"root": 0}),
        ("barrier", lambda r: None, {}),
    )

    def _natives_and_sessions(self, world):
        from stratagem.collectives.session import CollectiveSession
        from stratagem.core.transport import NativeCollective

        natives = [dict(t.native_collectives() or {}) for t in world]
        if not any(natives):
            pytest.skip(f"the {self.transport} transport has no native collectives")
        members = [t.task for t in world]
        sessions = [CollectiveSession(t, members, rank, name="contract", timeout=CALL_TIMEOUT,
                                      chunk_bytes=1 << 22, small_bytes=1 << 16) for rank, t in enumerate(world)]
        for table in natives:
            for name, native in table.items():
                assert isinstance(native, NativeCollective), f"native {name!r} is a {type(native).__name__}"
        return natives, sessions

    def test_natives_decide_alike_on_every_rank_before_anything_moves(self):
        with self.world(2, **self.native_options()) as world:
            natives, sessions = self._natives_and_sessions(world)
            for collective, make, options in self.NATIVE_CALLS:
                if collective == "barrier":
                    continue
                decided = []
                for rank in range(2):   # one rank at a time, its peer idle: deciding must not communicate
                    native = natives[rank].get(collective)
                    started = time.monotonic()
                    decided.append(native is not None and native.takes(sessions[rank], make(rank), options))
                    assert time.monotonic() - started < 1.0, f"{collective}: accepts() took a second"
                assert decided[0] == decided[1], f"{collective}{options}: the ranks decide differently: {decided}"

    def test_natives_give_core_results_and_every_call_is_numbered_once(self):
        from stratagem.collectives.communicator import Communicator
        from stratagem.core.errors import CollectiveMismatchError

        with self.world(2, **self.native_options()) as world:
            self._natives_and_sessions(world)
            comms = [Communicator(t, timeout=CALL_TIMEOUT) for t in world]

            def calls(rank, _transport):
                comm = comms[rank]
                out = [getattr(comm, c)(*([] if c == "barrier" else [make(rank)]), **o)
                       for c, make, o in self.NATIVE_CALLS]
                # A mismatch names the call by its number: the same on both ranks, so counted once each.
                with pytest.raises(CollectiveMismatchError) as caught:
                    if rank == 0:
                        comm.allreduce(np.zeros(3, np.int8))
                    else:
                        comm.allgather(np.zeros(3, np.int8))
                return out, str(caught.value)

            results = run_ranks(world, calls, timeout=CALL_TIMEOUT * 2)
            for rank, (out, error) in enumerate(results):
                assert f"#{len(self.NATIVE_CALLS) + 1}" in error, f"rank {rank}: {error}"
                np.testing.assert_array_equal(out[0], np.arange(10, dtype=np.float32) * 3)
                np.testing.assert_array_equal(out[1], np.full(1 << 21, 0.5, np.float32))
                np.testing.assert_array_equal(out[2], np.full(1 << 21, 3, np.float32))
                np.testing.assert_array_equal(out[3], np.arange(6, dtype=np.float16) * 2)
                np.testing.assert_array_equal(out[4], [0, -1])
                np.testing.assert_array_equal(out[5], np.array_split(np.arange(7.0) * 2, 2)[rank])
                np.testing.assert_array_equal(out[6], [[0, 0], [1, 1]])
                np.testing.assert_array_equal(out[7], np.arange(5, dtype=np.float32))

    def native_options(self) -> dict:
        """Options that let the natives take the suite's calls (override: e.g. a lower threshold)."""
        return {}


__all__ = ["TransportContract", "CALL_TIMEOUT", "PEER_TIMEOUT", "TaskId"]
