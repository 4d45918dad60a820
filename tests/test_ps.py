"""The parameter-server service (core/ps_*.py) and the placement (ps_service/placement.py), over the ``local``
transport: servers and clients are threads of this process, so these tests are fast.

- placement: round-robin, greedy by bytes (with its load bound), explicit device, device setters,
  partitioning (and the reassembly of a partitioned variable, bit for bit);
- the service: batched and concurrent requests, server-side optimizers with slots, the three modes
  (async, sync with stale gradients dropped, bounded staleness), exact accounting of pushes, the
  errors a server answers, a lost shard named within the timeout, when a server stops;
- replies in parts (each copied in as it arrives) and the double buffering of values that replies
  still send (a reply keeps its version however many updates follow);
- a sync job's replies taking turns (over zmq, real sockets: the server waits for the word
  ``received``, or for its patience, before the next reply; a stop sends the ones still waiting).
"""

from __future__ import annotations

import contextlib
import doctest
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ConfigurationError, PeerLostError, StratagemError, TaskId
from stratagem.ps_service import placement as placement_module
from stratagem.strategies.ps import checkpoint as checkpoint_module
from stratagem.ps_service import client as client_module
from stratagem.ps_service import consistency as consistency_module
from stratagem.ps_service import protocol as protocol_module
from stratagem.ps_service import server as server_module
from stratagem.ps_service import turns as turns_module
from stratagem.strategies.ps import base as ps_strategy_module
from stratagem.ps_service.placement import (
    GreedyByBytes,
    Placer,
    RoundRobin,
    device,
    fixed_size_partitioner,
    min_slice_partitioner,
    replica_device_setter,
)
from stratagem.ps_service.client import PSClient
from stratagem.ps_service.messages import PushRequest
from stratagem.ps_service.protocol import RemoteError, ShardLostError
from stratagem.ps_service.server import ParameterServer
from stratagem.core.transport import Message, SendHandle
from stratagem.transports.local import LocalFabric, LocalTransport

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_harness import cluster_spec, ok, run_cluster, push_grads  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# -- placement --------------------------------------------------------------------------------------------

MIXED = [("emb", (4000, 16)), ("w1", (784, 256)), ("b1", (256,)), ("w2", (256, 256)), ("b2", (256,)),
         ("w3", (256, 10)), ("b3", (10,)), ("scale", ()), ("w4", (512, 64)), ("b4", (64,))]


def test_round_robin_deals_in_turn_and_explicit_device_wins():
    placer = Placer(3, "round_robin")
    got = [placer.place(name, shape, "float32")[0].ps for name, shape in MIXED[:4]]
    assert got == [0, 1, 2, 0]
    with stratagem.device("/job:ps/task:2"):
        assert placer.place("pinned", (5,), "float32")[0].ps == 2
    with stratagem.device("ps:1/device:CPU:0"):           # a TF-style device suffix is ignored
        assert placer.place("pinned2", (5,), "float32")[0].ps == 1
    assert placer.place("next", (5,), "float32")[0].ps == 1   # the explicit ones did not take a turn
    with pytest.raises(ConfigurationError, match=r"pinned to /job:ps/task:3, but the cluster has 3 ps task"):
        with device("/job:ps/task:3"):
            placer.place("too_far", (1,), "float32")


def test_greedy_by_bytes_keeps_loads_within_the_largest_piece():
    """The bound (greedy list scheduling): max load - min load <= the largest piece, and the heaviest
    shard holds at most total / n + the largest piece. Round-robin breaks it on this model."""
    for n in (2, 3, 4):
        greedy, robin = Placer(n, "greedy"), Placer(n, "round_robin")
        pieces = []
        for name, shape in MIXED:
            pieces += greedy.place(name, shape, "float32")
            robin.place(name, shape, "float32")
        largest, total = max(p.nbytes for p in pieces), sum(p.nbytes for p in pieces)
        assert sum(greedy.loads) == total == sum(robin.loads)
        assert max(greedy.loads) - min(greedy.loads) <= largest
        assert max(greedy.loads) <= total / n + largest
        assert max(greedy.loads) <= max(robin.loads)
    # with the big embedding partitioned, the shards come out much more even
    split = Placer(4, "greedy", partition_bytes=64 << 10)
    for name, shape in MIXED:
        split.place(name, shape, "float32")
    largest = max(p.nbytes for name, shape in MIXED for p in Placer(4, "greedy", 64 << 10).place(name, shape, "float32"))
    assert max(split.loads) - min(split.loads) <= largest < 300_000
    assert max(split.loads) / (sum(split.loads) / 4) < 1.3


def test_pieces_larger_than_the_transport_delivers_whole_are_cut_on_their_shard():
    placer = Placer(2, "round_robin", partition_bytes=2000, piece_bytes=500)
    cut = placer.place("w", (10, 30), "float32")              # 1200 bytes, not partitioned: one shard
    assert [(p.name, p.ps, p.part, p.parts, p.lo, p.hi, p.nbytes) for p in cut] == [
        ("w/part_0", 0, 0, 3, 0, 4, 480), ("w/part_1", 0, 1, 3, 4, 7, 360), ("w/part_2", 0, 2, 3, 7, 10, 360)]
    split = placer.place("emb", (20, 30), "float32")          # 2400 bytes: partitioned, then each slice cut
    assert [(p.ps, p.lo, p.hi) for p in split] == [(1, 0, 4), (1, 4, 7), (1, 7, 10), (0, 10, 14), (0, 14, 17),
                                                  (0, 17, 20)]
    assert [p.part for p in split] == list(range(6)) and {p.parts for p in split} == {6}
    assert max(p.nbytes for p in cut + split) <= 500 and placer.loads == [1200 + 1200, 1200]
    assert [p.name for p in placer.place("small", (4, 30), "float32")] == ["small"]     # 480 bytes: whole
    assert len(placer.place("wide", (2, 1000), "float32")) == 2                       # a row over: one each
    with device("/job:ps/task:1"):
        assert {p.ps for p in placer.place("pinned", (10, 30), "float32")} == {1}
    with pytest.raises(ConfigurationError, match="piece_bytes must be an integer >= 1"):
        Placer(2, piece_bytes=0)


def test_partitioning_rules_and_setters():
    placer = Placer(3, "round_robin", partition_bytes=1000)
    pieces = placer.place("emb", (10, 30), "float32")        # 1200 bytes > 1000: one slice per ps task
    assert [(p.name, p.ps, p.lo, p.hi) for p in pieces] == [
        ("emb/part_0", 0, 0, 4), ("emb/part_1", 1, 4, 7), ("emb/part_2", 2, 7, 10)]
    assert [p.nbytes for p in pieces] == [480, 360, 360]
    assert placer.place("tiny_rows", (2, 200), "float32")[1].hi == 2   # at most one slice per row
    assert len(placer.place("scalar", (), "float64")) == 1
    with replica_device_setter(ps_strategy="greedy", partitioner=fixed_size_partitioner(2)):
        two = placer.place("emb2", (10, 30), "float32")
    assert [p.parts for p in two] == [2, 2]
    with replica_device_setter(ps_tasks=1):                   # only the first ps task
        assert {p.ps for p in placer.place("first_only", (10, 30), "float32")} == {0}
    assert min_slice_partitioner(100, max_partitions=8)((10, 30), np.dtype("float32")) == 8
    with pytest.raises(ConfigurationError, match="unknown placement policy 'best'"):
        Placer(2, "best")

    class Bad:
        def choose(self, nbytes, loads):
            return 7
    with pytest.raises(ConfigurationError, match=r"chose shard 7 for variable 'x'; it must return an index in \[0, 2\)"):
        Placer(2, Bad()).place("x", (1,), "float32")
    with pytest.raises(ConfigurationError, match="at least one 'ps' task"):
        Placer(0)


def test_policy_objects():
    robin, greedy = RoundRobin(), GreedyByBytes()
    assert [robin.choose(1, [0, 0]) for _ in range(3)] == [0, 1, 0]
    assert greedy.choose(5, [10, 3, 3]) == 1


def test_lazy_exports_of_the_package():
    assert stratagem.device is placement_module.device
    assert stratagem.replica_device_setter is placement_module.replica_device_setter


# -- a partitioned variable through the strategy -----------------------------------------------------------------

def test_a_partitioned_variable_reassembles_exactly(tmp_path):
    value = np.random.default_rng(0).standard_normal((1001, 7)).astype(np.float32)
    ckpt = str(tmp_path / "ckpt")

    def body(strategy, rank):
        with strategy.scope():
            emb = stratagem.Variable(value, name="emb")
            small = stratagem.Variable(np.arange(3.0), name="small")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        pieces = [(p.name, p.ps, p.lo, p.hi) for p in strategy.pieces("emb")]
        with pytest.raises(ConfigurationError, match="has no variable 'embedding' on the ps tasks"):
            strategy.pieces("embedding")
        stats = strategy.ps_stats()
        got = emb.numpy()
        grad = np.ones_like(value)
        opt.apply_gradients([(grad, emb), (np.zeros(3), small)])
        path = strategy.save(ckpt)
        emb.assign(np.zeros_like(value))
        zeroed = emb.numpy()
        restored_step = strategy.restore(ckpt)
        return pieces, stats, got, zeroed, emb.numpy(), path, restored_step

    results = ok(run_cluster(3, 1, body, partition_bytes=10_000))
    pieces, stats, got, zeroed, after, path, step = results["worker:0"]
    assert [p[0] for p in pieces] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    assert {p[1] for p in pieces} == {0, 1, 2} and (pieces[0][2], pieces[-1][3]) == (0, 1001)
    assert {i: s["pieces"] for i, s in stats.items()} == {0: ["emb/part_0", "small"], 1: ["emb/part_1"],
                                                          2: ["emb/part_2"]}
    np.testing.assert_array_equal(got, value)                        # bit for bit
    assert not zeroed.any()
    np.testing.assert_array_equal(after, value - 1.0)                 # restored after the zero assign
    assert step == 1
    saved = stratagem.training.checkpoint.load(path)                      # one ordinary, whole array
    np.testing.assert_array_equal(saved.variables["emb"], value - 1.0)
    assert saved.step == 1 and saved.extra["ps_tasks"] == 3


def test_default_partitioning_spreads_every_large_variable_over_every_shard():
    """Under the strategy's defaults (round-robin, no partition_bytes given) the bytes of a model of a
    few large matrices come out even over 4 ps tasks: every matrix over 512 KiB split into one slice
    per shard, so the shards differ by at most the whole variables (0.4 MB here). The old default (16 MiB)
    placed each matrix whole: 2.4 + 0.01 + 1.6 + 0.01 MB, the busiest shard 60% of the model."""
    shapes = {"w1": (500, 1000), "b1": (1000,), "w2": (400, 1000), "b2": (1000,), "w3": (100, 1000), "b3": (1000,)}

    def body(strategy, rank):
        with strategy.scope():
            variables = [stratagem.Variable(np.ones(shape, np.float32), name=n) for n, shape in shapes.items()]
            opt = stratagem.optimizers.SGD(learning_rate=0.5)
        opt.apply_gradients([(np.ones(v.shape, np.float32), v) for v in variables])
        return {n: [(p.ps, p.nbytes) for p in strategy.pieces(n)] for n in shapes}, [v.numpy() for v in variables]

    pieces, values = ok(run_cluster(4, 1, body))["worker:0"]
    loads = [0] * 4
    for placed in pieces.values():
        for ps, nbytes in placed:
            loads[ps] += nbytes
    assert {ps for ps, _ in pieces["w1"]} == {0, 1, 2, 3} and {ps for ps, _ in pieces["w2"]} == {0, 1, 2, 3}
    assert len(pieces["w3"]) == 1 and all(len(pieces[b]) == 1 for b in ("b1", "b2", "b3"))   # 400 KB, 4 KB: whole
    assert max(loads) - min(loads) <= 400_000 + 4_000, loads
    assert max(loads) <= 1.4 * sum(loads) / 4, loads
    assert all(np.array_equal(v, np.full(v.shape, 0.5, np.float32)) for v in values)       # reassembled, updated

# -- the service, driven by a client ------------------------------------------------------------------------

class Service:
    """``ps`` servers as threads and client endpoints, over one local fabric."""

    def __init__(self, ps: int = 2, workers: int = 1, *, timeout: float = 10.0, poll: float = 0.02):
        self.cluster = cluster_spec(ps, workers)
        self.fabric = LocalFabric()
        self.servers, self.threads, self.outcomes = [], [], {}
        for index in range(ps):
            transport = LocalTransport(self.cluster, f"ps:{index}", fabric=self.fabric, timeout=timeout)
            transport.start()
            server = ParameterServer(transport, poll=poll, linger=timeout)
            self.servers.append(server)
            thread = threading.Thread(target=self._serve, args=(index, server), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.clients = []
        for index in range(workers):
            transport = LocalTransport(self.cluster, f"worker:{index}", fabric=self.fabric, timeout=timeout)
            transport.start()
            self.clients.append(PSClient(transport, timeout=timeout))

    def _serve(self, index, server):
        try:
            self.outcomes[index] = server.serve()
        except BaseException as exc:  # noqa: BLE001 - checked by the tests
            self.outcomes[index] = exc

    def init(self, config, values=None, optimizer=None):
        """One float32 piece 'w<i>' of 4 values per shard (or ``values``: {shard: {name: array}})."""
        values = values or {i: {f"w{i}": np.zeros(4, np.float32)} for i in range(len(self.servers))}
        specs = {i: [spec(name, v) for name, v in vs.items()] for i, vs in values.items()}
        arrays = {i: list(vs.values()) for i, vs in values.items()}
        self.clients[0].init(specs, arrays, {"pushers": [f"worker:{i}" for i in range(len(self.clients))],
                                             "clock": "ps:0", **config})
        self.clients[0].ready()
        if optimizer is not None:
            self.clients[0].set_optimizer(optimizer)

    def close(self, join: float = 10.0):
        for client in self.clients:
            if any(t.is_alive() for t in self.threads):
                client.bye(timeout=2)
            client.transport.close()
        for thread in self.threads:
            thread.join(join)
        for server in self.servers:
            server.transport.close()
        assert not any(t.is_alive() for t in self.threads), "a server did not stop"


def spec(name, value):
    return {"name": name, "var": name, "shape": list(value.shape), "dtype": str(value.dtype), "part": 0,
            "parts": 1, "lo": 0, "hi": value.shape[0] if value.ndim else 0}


ASYNC = {"mode": "async", "replicas_to_aggregate": None, "total_replicas": None, "staleness": None}
SGD1 = {"name": "SGD", "learning_rate": 1.0, "momentum": 0.0, "nesterov": False}


@pytest.fixture
def service(closing):
    return lambda *args, **kwargs: closing(Service(*args, **kwargs))


def test_requests_are_batched_per_shard_and_sent_to_all_shards_before_any_reply(service):
    svc = service(ps=3)
    values = {i: {f"a{i}": np.zeros(4, np.float32), f"b{i}": np.zeros(2, np.float32)} for i in range(3)}
    svc.init(ASYNC, values, SGD1)
    client = svc.clients[0]
    events = []
    send, recv = client.transport.send, client.transport.recv
    client.transport.send = lambda dst, tag, msg, timeout=None: (events.append(("send", dst.index, len(msg.buffers))),
                                                                 send(dst, tag, msg, timeout))[1]

    def spy_recv(src, tag, timeout=None):
        reply = recv(src, tag, timeout)
        events.append(("reply", reply.src.index))
        return reply
    client.transport.recv = spy_recv
    grads = {i: ([f"a{i}", f"b{i}"], [np.ones(4, np.float32), np.ones(2, np.float32)]) for i in range(3)}
    push_grads(client, grads)
    sends = [e for e in events if e[0] == "send"]
    assert sorted(sends) == [("send", 0, 2), ("send", 1, 2), ("send", 2, 2)]   # one message per shard
    assert [e[0] for e in events[:3]] == ["send"] * 3                          # all sent before any reply
    replies = client.pull()
    assert [r.buffers[0].tolist() for _, r in sorted(replies.items())] == [[-1.0] * 4] * 3


def test_server_side_optimizer_with_slots_matches_a_local_one(service):
    svc = service(ps=2)
    config = stratagem.optimizers.Adam(learning_rate=0.05).get_config()
    init = np.linspace(-1, 1, 8, dtype=np.float32)
    svc.init(ASYNC, {0: {"w/part_0": init[:4].copy()}, 1: {"w/part_1": init[4:].copy()}}, config)
    local = stratagem.Variable(init.copy(), name="adam_local")
    opt = stratagem.optimizers.from_config(config)
    rng = np.random.default_rng(3)
    for _ in range(5):
        g = rng.standard_normal(8).astype(np.float32)
        push_grads(svc.clients[0], {0: (["w/part_0"], [g[:4]]), 1: (["w/part_1"], [g[4:]])})
        opt.apply_gradients([(g, local)])
    got = np.concatenate([r.buffers[0] for _, r in sorted(svc.clients[0].pull().items())])
    np.testing.assert_array_equal(got, local.numpy())                   # bit for bit
    snapshot = svc.clients[0].snapshot()
    assert snapshot[0].meta["iterations"] == 5 and snapshot[0].meta["slots"] == {"w/part_0": ["m", "v"]}


def test_async_pushes_from_many_workers_exact_accounting(service):
    svc = service(ps=2, workers=3)
    svc.init(ASYNC, optimizer=SGD1)

    def worker(client, n):
        for _ in range(n):
            push_grads(client, {0: (["w0"], [np.ones(4, np.float32)]), 1: (["w1"], [np.ones(4, np.float32)])}, pull=True)
    threads = [threading.Thread(target=worker, args=(c, 20 + 5 * i)) for i, c in enumerate(svc.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stats = svc.clients[0].stats()
    total = 20 + 25 + 30
    for shard in (0, 1):
        acked = sum(c.acks[shard]["applied"] for c in svc.clients)
        assert acked == stats[shard]["applied"] == stats[shard]["updates"] == stats[shard]["step"] == total
        for i, c in enumerate(svc.clients):
            assert stats[shard]["by_replica"][f"worker:{i}"]["applied"] == c.acks[shard]["applied"]
    assert svc.clients[0].pull()[0].buffers[0].tolist() == [-float(total)] * 4


def test_sync_aggregates_weighted_means_and_drops_stale_gradients(service):
    svc = service(ps=1, workers=3)
    svc.init({"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 3, "staleness": None}, optimizer=SGD1)
    results = {}

    def push(index, value, weight, version):
        reply = push_grads(svc.clients[index], {0: (["w0"], [np.full(4, value, np.float32)])}, versions={0: version},
                                        weight=weight, pull=True)
        results[index] = reply[0].meta["status"], reply[0].meta["step"], reply[0].buffers[0].tolist()

    first = threading.Thread(target=push, args=(0, 1.0, 3.0, 0))
    first.start()
    time.sleep(0.2)
    assert first.is_alive() and 0 not in results           # waits for the round to fill
    push(1, 5.0, 1.0, 0)                                     # the second: the round applies
    first.join(5)
    expected = -(1.0 * 3 + 5.0 * 1) / 4                      # the weighted mean, lr 1
    assert results[0] == results[1] == ("applied", 1, [expected] * 4)
    push(2, 100.0, 1.0, 0)                                   # the straggler, still at step 0: dropped
    assert results[2] == ("dropped", 1, [expected] * 4)      # ...and told the current values
    stats = svc.clients[0].stats()[0]
    assert (stats["applied"], stats["dropped"], stats["updates"], stats["step"]) == (2, 1, 1, 1)
    assert svc.clients[2].acks[0]["dropped"] == 1


def test_sync_round_completes_when_a_pusher_leaves(service):
    svc = service(ps=1, workers=2)
    svc.init({"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 2, "staleness": None}, optimizer=SGD1)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault(0, push_grads(svc.clients[0], 
        {0: (["w0"], [np.ones(4, np.float32)])}, versions={0: 0})[0].meta["status"]))
    t.start()
    time.sleep(0.1)
    svc.clients[1].bye()                                     # only one pusher left: the round needs one
    t.join(5)
    assert results == {0: "applied"}


def test_a_load_drops_the_pending_round_and_counts_the_chiefs_restore(service):
    """A push waiting in a sync round was made on the values a checkpoint load replaces: the load
    answers it ``dropped`` (it used to discard the round and leave the pusher waiting forever), and
    the shards count the chief's restore for the other tasks' ``restore()`` to wait on."""
    svc = service(ps=1, workers=2)
    svc.init({"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 2, "staleness": None}, optimizer=SGD1)
    results = {}

    def push():
        reply = push_grads(svc.clients[1], {0: (["w0"], [np.ones(4, np.float32)])}, versions={0: 0}, pull=True)
        results[1] = reply[0].meta["status"], reply[0].meta["step"], reply[0].buffers[0].tolist()

    waiting = threading.Thread(target=push)
    waiting.start()
    time.sleep(0.2)
    assert waiting.is_alive() and svc.clients[0].hello()[0]["restores"] == 0
    svc.clients[0].load({0: ({"names": ["w0"], "slots": {}, "iterations": 7, "step": 7, "restore": 1},
                             [np.full(4, 3.0, np.float32)])})
    waiting.join(5)
    assert results == {1: ("dropped", 7, [3.0] * 4)}
    assert svc.clients[1].hello()[0]["restores"] == 1
    stats = svc.clients[0].stats()[0]
    assert (stats["applied"], stats["dropped"], stats["updates"], stats["step"]) == (0, 1, 0, 7)


def test_bounded_staleness_holds_the_fast_worker(service):
    svc = service(ps=2, workers=2)
    svc.init({"mode": "bounded", "replicas_to_aggregate": None, "total_replicas": None, "staleness": 1},
             optimizer=SGD1)
    fast, slow = svc.clients
    grads = {0: (["w0"], [np.ones(4, np.float32)]), 1: (["w1"], [np.ones(4, np.float32)])}
    assert push_grads(fast, grads)[0].meta["clock"] == 1            # 1 ahead of the slow worker: allowed
    done = threading.Event()
    replies = {}
    t = threading.Thread(target=lambda: (replies.setdefault("r", push_grads(fast, grads)), done.set()))
    t.start()
    assert not done.wait(0.3)                                # 2 ahead: held
    assert fast.acks[1]["applied"] == 2                      # the other shard does not hold: its ack is in
    push_grads(slow, grads)
    assert done.wait(5)
    meta = replies["r"][0].meta
    assert (meta["clock"], meta["min_clock"]) == (2, 1)
    assert svc.clients[0].stats()[0]["max_gap"] == 1
    assert svc.clients[0].stats()[0]["applied"] == 3          # applied on arrival, acknowledged later


def test_stop_releases_waiters_and_refuses_further_pushes(service):
    svc = service(ps=1, workers=2)
    svc.init({"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 2, "staleness": None}, optimizer=SGD1)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", push_grads(svc.clients[0], 
        {0: (["w0"], [np.ones(4, np.float32)])}, versions={0: 0})[0].meta))
    t.start()
    time.sleep(0.1)
    svc.clients[1].stop()
    t.join(5)
    assert got["r"]["status"] == "stopped" and got["r"]["stop"] is True
    assert push_grads(svc.clients[1], {0: (["w0"], [np.ones(4, np.float32)])}, versions={0: 0})[0].meta["status"] == "stopped"
    stats = svc.clients[0].stats()[0]
    assert (stats["updates"], stats["stopped"], stats.get("applied", 0)) == (0, 2, 0)


def test_servers_answer_errors_and_keep_serving(service):
    svc = service(ps=1, workers=2)
    client = svc.clients[0]
    with pytest.raises(RemoteError, match="no variables yet: the chief must create them first"):
        push_grads(client, {0: (["w0"], [np.ones(4, np.float32)])})
    svc.init(ASYNC)
    with pytest.raises(RemoteError, match="has no optimizer: send the optimizer's config first"):
        push_grads(client, {0: (["w0"], [np.ones(4, np.float32)])})
    client.set_optimizer(SGD1)
    with pytest.raises(RemoteError, match=r"uses optimizer .*Adam.* but the job's is .*SGD"):
        svc.clients[1].set_optimizer(stratagem.optimizers.Adam().get_config())
    with pytest.raises(RemoteError, match="holds no piece 'nope'; it holds 'w0'"):
        client.pull({0: ["nope"]})
    with pytest.raises(RemoteError, match=r"the gradient of piece 'w0' has shape \(3,\), expected \(4,\)"):
        push_grads(client, {0: (["w0"], [np.ones(3, np.float32)])})
    with pytest.raises(RemoteError, match=r"piece 'w0' exists on /job:ps/task:0 as shape \(4,\), float32, "
                                          r"/job:worker/task:1 declares it as shape \(5,\)"):
        svc.clients[1].init({0: [spec("w0", np.zeros(5, np.float32))]}, {0: [np.zeros(5, np.float32)]},
                            {"pushers": [], **ASYNC})
    with pytest.raises(RemoteError, match="asks for .*'sync'.* but the job runs with .*'async'"):
        svc.clients[1].init({}, {}, {**ASYNC, "mode": "sync", "pushers": []})
    with pytest.raises(RemoteError, match="unknown operation 'explode'"):
        client.broadcast({"op": "explode"})
    assert push_grads(client, {0: (["w0"], [np.ones(4, np.float32)])})[0].meta["status"] == "applied"


def test_a_lost_shard_is_named_within_the_timeout(service):
    svc = service(ps=2, workers=1, timeout=30)
    svc.init(ASYNC, optimizer=SGD1)
    client = svc.clients[0]
    client.pieces = {0: ["w0"], 1: ["w1"]}
    svc.servers[1].transport.abort()                          # the shard dies (no goodbye)
    began = time.monotonic()
    with pytest.raises(ShardLostError) as info:
        push_grads(client, {0: (["w0"], [np.ones(4, np.float32)]), 1: (["w1"], [np.ones(4, np.float32)])})
    assert time.monotonic() - began < 5
    assert isinstance(info.value, PeerLostError) and info.value.task == TaskId("ps", 1)
    assert "parameter-server shard /job:ps/task:1 (holding w1) is gone" in str(info.value)
    assert "restore" in str(info.value)


def test_a_silent_shard_times_out_naming_it():
    cluster = cluster_spec(1, 1)
    fabric = LocalFabric()
    ps = LocalTransport(cluster, "ps:0", fabric=fabric)
    ps.start()                                                # started, but nobody serves
    worker = LocalTransport(cluster, "worker:0", fabric=fabric)
    worker.start()
    try:
        with pytest.raises(stratagem.TransportTimeout, match=r"no reply from parameter-server shard\(s\) /job:ps/task:0 within 0.3 s"):
            PSClient(worker, timeout=0.3).hello()
    finally:
        worker.close()
        ps.close()


def test_server_stops_when_every_replica_left_and_reports_failures(service):
    svc = service(ps=1, workers=2)
    svc.init(ASYNC, optimizer=SGD1)
    svc.clients[1].bye("ValueError: boom")
    svc.clients[0].bye()
    svc.threads[0].join(5)
    outcome = svc.outcomes[0]
    assert isinstance(outcome, StratagemError)
    assert "training failed: worker:1 failed: ValueError: boom" in str(outcome)

    svc2 = service(ps=1, workers=2)
    svc2.init(ASYNC)
    svc2.clients[1].bye()
    svc2.clients[0].transport.abort()                          # the chief dies
    svc2.threads[0].join(5)
    assert "the chief /job:worker/task:0 disappeared before training ended" in str(svc2.outcomes[0])

    svc3 = service(ps=1, workers=2)
    svc3.init(ASYNC)
    svc3.clients[0].bye()
    svc3.clients[1].transport.abort()                          # a non-chief worker dies: not a failure
    svc3.threads[0].join(5)
    assert isinstance(svc3.outcomes[0], dict) and not svc3.threads[0].is_alive()


# -- replies in parts; replies still being sent ---------------------------------------------------------------

def test_large_replies_come_in_parts_each_handed_over_as_it_arrives(service, monkeypatch):
    monkeypatch.setattr(protocol_module, "REPLY_PART_BYTES", 32)         # two 16-byte pieces a part
    svc = service(ps=1)
    names = [f"p{i}" for i in range(5)]
    svc.init(ASYNC, {0: {n: np.full(4, i, np.float32) for i, n in enumerate(names)}}, SGD1)
    client = svc.clients[0]
    reply = client.pull()[0]
    assert reply.meta["names"] == names and "part" not in reply.meta
    assert [b.tolist() for b in reply.buffers] == [[float(i)] * 4 for i in range(5)]
    request = PushRequest(pull=True)
    request.add("p1", np.ones(4, np.float32))
    request.add("p3", np.ones(4, np.float32))
    seen = [(index, part.meta["names"], [b[0] for b in part.buffers], last, part.meta.get("status"))
            for index, part, last in client.push({0: request})]              # each part as it arrives
    assert seen == [(0, ["p0", "p1"], [0.0, 0.0], False, None), (0, ["p2", "p3"], [2.0, 2.0], False, None),
                    (0, ["p4"], [4.0], True, "applied")]   # p1 and p3 updated; only the last part has the status
    assert svc.servers[0].step == 1 and client.acks[0]["applied"] == 1


class _Unfinished(SendHandle):
    """A send the transport has not finished reading: the server must leave its arrays alone."""

    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished

    def wait(self, timeout=None):
        self.finished = True


def _unfinished_replies(server) -> list:
    """Make every reply of ``server`` look unfinished until a test says otherwise; returns the list of
    ``(handle, the arrays the reply sends, by reference)``, one per reply."""
    sends = []
    deliver = server.transport.send_async

    def unfinished_send(dst, tag, msg, timeout=None):
        deliver(dst, tag, msg, timeout)              # the local transport hands the requester a copy
        sends.append((_Unfinished(), list(msg.buffers)))
        return sends[-1][0]
    server.transport.send_async = unfinished_send
    return sends


def test_a_reply_still_being_sent_keeps_its_version(service):
    # TorchSGD's rule (an _update in place) may not write over the gradient: the server updates its
    # own arrays, into a spare while a reply reads the current one.
    svc = service(ps=1)
    svc.init(ASYNC, optimizer=stratagem.optimizers.TorchSGD(learning_rate=1.0).get_config())
    server, client = svc.servers[0], svc.clients[0]
    sends = _unfinished_replies(server)

    def push():
        return push_grads(client, {0: (["w0"], [np.ones(4, np.float32)])}, pull=True)[0].buffers[0][0]

    assert push() == -1.0
    first = sends[-1][1][0]
    assert push() == -2.0                            # written into a second array
    assert server.values["w0"] is not first and first.tolist() == [-1.0] * 4
    assert push() == -3.0 and server.replies.allocated == 2
    second = sends[-2][1][0]
    assert first.tolist() == [-1.0] * 4 and second.tolist() == [-2.0] * 4
    assert push() == -4.0                            # 3 arrays, all being read: waits for the oldest
    assert server.replies.allocated == 2 and sends[0][0].finished and server.values["w0"] is first
    assert second.tolist() == [-2.0] * 4
    for handle, _ in sends:
        handle.finished = True
    current = server.values["w0"]
    assert push() == -5.0 and server.values["w0"] is current    # nothing reads it: in place


def test_an_update_over_the_received_gradient_leaves_sent_versions_alone(service):
    # SGD writes its result over the pushed gradient, which becomes the piece's array: every version
    # a reply sent stays as it was, without a spare array and without waiting for any reply.
    svc = service(ps=1)
    svc.init(ASYNC, optimizer=SGD1)
    server, client = svc.servers[0], svc.clients[0]
    sends = _unfinished_replies(server)
    arrays = []
    for step in range(1, 5):
        got = push_grads(client, {0: (["w0"], [np.full(4, 0.5, np.float32)])}, pull=True)[0].buffers[0]
        assert got.tolist() == [-0.5 * step] * 4
        arrays.append(server.values["w0"])
    assert [a.tolist() for _, (a,) in sends] == [[-0.5 * step] * 4 for step in range(1, 5)]
    assert [sent is held for (_, (sent,)), held in zip(sends, arrays)] == [True] * 4   # sent by reference
    assert len({id(a) for a in arrays}) == 4 and server.replies.allocated == 0
    assert not any(handle.finished for handle, _ in sends)                            # nothing waited


def test_mode_options_are_checked():
    check = protocol_module.check_mode
    assert check("bounded", None, None, 2, 3)["staleness"] == 2
    for args, message in [(("sometimes", None, None, None, 3), "unknown mode 'sometimes'"),
                          (("async", 2, None, None, 3), "apply to mode='sync' only"),
                          (("sync", None, None, 1, 3), "staleness applies to mode='bounded' only"),
                          (("bounded", None, None, None, 3), "needs staleness=S"),
                          (("sync", None, 4, None, 3), "total_replicas=4 but 3 replica"),
                          (("sync", 0, None, None, 3), "replicas_to_aggregate must be an integer >= 1")]:
        with pytest.raises(ConfigurationError, match=message):
            check(*args)


def test_docstring_examples():
    for module in (placement_module, client_module, protocol_module, server_module, ps_strategy_module,
                   consistency_module, checkpoint_module, turns_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest example(s) failed"


# -- a sync job's replies take turns on the ps's link (ps_service/turns.py) ---------------------------------

class ZmqService:
    """One ps server (a thread) and two workers over the zmq transport, real sockets on loopback, each
    worker at an address of its own (127.0.0.2, 127.0.0.3: another host than the ps's 127.0.0.1, whose
    replies take turns; a task on the ps's host gets its reply at once): ``worker:0`` speaks the protocol by hand through its transport (``raw``) and never says it received
    a reply unless the test does; ``worker:1`` is a :class:`PSClient`. A sync job of 2 pushers, one
    float32 piece ``w`` of 128 KiB (a reply large enough to take a turn)."""

    SIZE = 32 << 10

    def __init__(self, turn_patience: float):
        from stratagem.core.cluster import ClusterSpec
        from stratagem.testing.world import free_ports
        from stratagem.transports.zmq.transport import ZmqTransport

        hosts = {"ps": "127.0.0.1", "worker:0": "127.0.0.2", "worker:1": "127.0.0.3"}
        port = {name: free_ports(1, host)[0] for name, host in hosts.items()}
        self.cluster = ClusterSpec({"ps": [f"127.0.0.1:{port['ps']}"],
                                    "worker": [f"{hosts[w]}:{port[w]}" for w in ("worker:0", "worker:1")]})
        self.transports = []
        self.ps = self._transport(ZmqTransport, "ps:0")
        self.server = ParameterServer(self.ps, poll=0.02, linger=10, turn_patience=turn_patience)
        self.outcome = {}
        self.thread = threading.Thread(target=lambda: self.outcome.setdefault("stats", self.server.serve()),
                                       daemon=True)
        self.thread.start()
        self.raw = self._transport(ZmqTransport, "worker:0")
        self.chief = PSClient(self.raw, timeout=10)      # worker:0's client, for the set-up and the stats
        self.client = PSClient(self._transport(ZmqTransport, "worker:1"), timeout=20)
        self.shard = TaskId("ps", 0)
        value = np.zeros(self.SIZE, np.float32)
        self.chief.init({0: [spec("w", value)]}, {0: [value]},
                        {"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 2, "staleness": None,
                         "pushers": ["worker:0", "worker:1"]})
        self.chief.ready()
        self.chief.set_optimizer(SGD1)

    def _transport(self, cls, task):
        transport = cls(self.cluster, task, timeout=10)
        self.transports.append(transport)
        transport.start()
        return transport

    def raw_push(self, request_id: int) -> None:
        """worker:0 pushes a gradient of ones for step 0, asking for the values back; returns once the
        server has it (a request sent after it was answered)."""
        request = PushRequest(weight=1.0, pull=True, version=0)
        request.add("w", np.ones(self.SIZE, np.float32))
        message = request.to_message()
        message.meta["id"] = request_id
        self.raw.send(self.shard, protocol_module.REQUEST_TAG, message, timeout=10)
        self.chief.hello(timeout=10)                   # served after the push: the push is in its round

    def raw_reply(self):
        """worker:0's reply, whole (one part: 128 KiB is less than a part)."""
        return self.raw.recv(self.shard, protocol_module.REPLY_TAG, timeout=10)

    def close(self):
        if self.thread.is_alive():
            for client in (self.chief, self.client):
                with contextlib.suppress(Exception):
                    client.bye(timeout=2)
        for transport in reversed(self.transports[1:]):
            transport.close()
        self.thread.join(10)
        self.ps.close()
        assert not self.thread.is_alive(), "the server did not stop"


def _push_in_thread(svc) -> tuple[threading.Thread, dict]:
    """worker:1's push (ones, step 0, values back) in a thread; its outcome lands in the dict."""
    got = {}

    def push():
        try:
            reply = push_grads(svc.client, {0: (["w"], [np.ones(svc.SIZE, np.float32)])}, versions={0: 0}, pull=True)[0]
            got["reply"] = reply.meta["status"], reply.meta.get("turn"), float(reply.buffers[0][0])
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            got["error"] = exc
    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    return thread, got


def test_a_sync_rounds_replies_go_one_after_another_in_push_order(closing):
    """The round's second reply starts only once the first requester said it received its own: until
    then it waits on the server, its requester still waiting (on the old code both went at once)."""
    svc = closing(ZmqService(turn_patience=60.0))    # only the word 'received' ends the first turn here
    svc.raw_push(1000)                                # worker:0 pushes first
    thread, got = _push_in_thread(svc)                # worker:1 completes the round
    first = svc.raw_reply()
    thread.join(1.0)
    assert thread.is_alive() and not got, "the second reply went before the first was received"
    assert first.meta["id"] == 1000 and first.meta["status"] == "applied" and first.meta.get("turn") is True
    assert float(first.buffers[0][0]) == -1.0         # the mean of two gradients of ones, lr 1
    stats = svc.chief.stats()[0]
    assert stats["queued"] == 1 and stats["turns"] == {"turns": 1}
    svc.raw.send(svc.shard, protocol_module.REQUEST_TAG, Message({"op": "received", "id": 1000}), timeout=10)
    thread.join(15)
    assert got == {"reply": ("applied", None, -1.0)}   # the round's last: nothing behind it, no word asked
    stats = svc.chief.stats()[0]
    assert stats["queued"] == 0 and stats["turns"] == {"turns": 1, "received": 1, "last": 1}
    assert stats["applied"] == 2 and stats["updates"] == 1


def test_a_requester_that_never_says_received_holds_the_next_reply_only_for_its_patience(closing):
    svc = closing(ZmqService(turn_patience=0.2))      # 0.2 s + 128 KiB at 1 MB/s
    svc.raw_push(2000)
    thread, got = _push_in_thread(svc)
    assert svc.raw_reply().meta.get("turn") is True   # ...and worker:0 never says it received it
    thread.join(15)
    assert got == {"reply": ("applied", None, -1.0)}
    turns = svc.chief.stats()[0].get("turns")
    assert turns == {"turns": 1, "waited_out": 1, "last": 1}


def test_a_stop_sends_the_replies_still_waiting_for_their_turn(closing):
    svc = closing(ZmqService(turn_patience=60.0))
    svc.raw_push(3000)
    thread, got = _push_in_thread(svc)
    reply = svc.raw_reply()
    thread.join(0.5)
    assert thread.is_alive() and reply.meta.get("turn") is True
    svc.chief.stop()                                  # the job ends: nothing waits for a turn any more
    thread.join(15)
    assert got == {"reply": ("applied", None, -1.0)}
    assert svc.chief.stats()[0]["turns"]["out_of_turn"] == 1


def test_replies_to_the_ps_host_go_at_once_without_a_turn(service):
    """Every task at the ps's host ('local' here): loopback is not the link, so a sync round's large
    replies go at once, asking for no word; the stats say no turn was taken."""
    svc = service(ps=1, workers=2)
    size = 32 << 10                                    # 128 KiB: a reply that would take a turn across hosts
    svc.init({"mode": "sync", "replicas_to_aggregate": 2, "total_replicas": 2, "staleness": None},
             {0: {"w": np.zeros(size, np.float32)}}, SGD1)
    got = {}

    def push(index):
        reply = push_grads(svc.clients[index], {0: (["w"], [np.ones(size, np.float32)])}, versions={0: 0}, pull=True)[0]
        got[index] = reply.meta["status"], reply.meta.get("turn"), float(reply.buffers[0][0])
    threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {0: ("applied", None, -1.0), 1: ("applied", None, -1.0)}
    stats = svc.clients[0].stats()[0]
    assert stats.get("turns") == {} and stats.get("queued") == 0
