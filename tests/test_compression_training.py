"""Training with compressed gradients, end to end: the plain user script (tests/scripts/compressed_train.py:
no close, no shutdown, no `with`, no `__main__` guard) as every task of a real local cluster over zmq,
each task an independent process (stratagem.testing.strategy_contract.run_tasks); and a ps task's
handling of compressed pushes, in process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem.core.cluster import ClusterSpec
from stratagem.ps_service.client import PSClient
from stratagem.ps_service.compressed import compress_pieces
from stratagem.ps_service.protocol import RemoteError
from stratagem.ps_service.server import ParameterServer
from stratagem.testing.strategy_contract import LIMIT, clean_env, names, report, run_tasks
from stratagem.transports.local import LocalFabric, LocalTransport

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from ps_harness import push_grads  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "compressed_train.py"
#: The script's loss starts near 33 (zero weights); uncompressed it ends near 1e-5.
TARGET_LOSS = 1e-3

pytestmark = pytest.mark.timeout(LIMIT + 60)


def train(strategy: str, compression: str, options: dict, tasks: list[str], *ending: str):
    return run_tasks(tasks, [sys.executable, str(SCRIPT), strategy, compression, json.dumps(options), *ending])


def losses(results) -> dict[str, float]:
    return {task: float(out.strip().splitlines()[-1].split()[-1]) for task, (_, out, _) in results.items()
            if task.startswith("worker")}


@pytest.mark.parametrize("compression, options", [("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.05}),
                                                  ("powersgd", {"rank": 2})])
def test_mirrored_with_each_builtin_reaches_the_target_loss(compression, options):
    results = train("mirrored", compression, options, ["worker:0", "worker:1"])
    assert all(code == 0 for code, _, _ in results.values()), report(results)
    found = losses(results)
    assert found["worker:0"] == found["worker:1"] < TARGET_LOSS, found   # replicas identical, trained


def test_between_graph_with_topk_pushes_reaches_the_target_loss():
    results = train("between_graph", "topk", {"ratio": 0.05}, ["worker:0", "worker:1", "ps:0"])
    assert all(code == 0 for code, _, _ in results.values()), report(results)
    assert all(loss < TARGET_LOSS for loss in losses(results).values()), losses(results)


@pytest.mark.parametrize("strategy, compression, options, tasks", [
    ("mirrored", "powersgd", {"rank": 2}, ["worker:0", "worker:1"]),
    ("between_graph", "topk", {"ratio": 0.05}, ["worker:0", "worker:1", "ps:0"]),
])
def test_the_plain_script_ended_by_an_exception_ends_every_task(strategy, compression, options, tasks):
    results = train(strategy, compression, options, tasks, "worker:1", "raise")
    code, out, _ = results["worker:1"]
    assert code == 1 and "RuntimeError: worker:1 failed on purpose" in out, report(results)
    for task, (code, out, _) in results.items():
        if task != "worker:1":
            assert code not in (0, None) and names(out, "worker:1"), report(results)


def test_the_plain_script_with_an_unknown_compressor_says_which_exist():
    proc = subprocess.run([sys.executable, str(SCRIPT), "mirrored", "top-k", "{}"], capture_output=True, text=True,
                          timeout=LIMIT, env=clean_env())
    assert proc.returncode == 1
    assert ("ConfigurationError: strategy 'mirrored': compression='top-k': unknown compressor 'top-k'; known: "
            "bf16, fp16, powersgd, topk (did you mean 'topk'?)") in proc.stderr


# -- a ps task and compressed pushes, in process -----------------------------------------------------------

@pytest.fixture
def shard():
    """A ps task serving in a thread (with ``compressor`` given by the test) and a worker's client."""
    cluster, fabric = ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), LocalFabric()
    made = []

    def start(compressor):
        ps = LocalTransport(cluster, "ps:0", fabric=fabric, timeout=10)
        ps.start()
        server = ParameterServer(ps, poll=0.05, compressor=compressor)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        worker = LocalTransport(cluster, "worker:0", fabric=fabric, timeout=10)
        worker.start()
        client = PSClient(worker, timeout=10)
        spec = {"name": "w", "var": "w", "shape": [200, 50], "dtype": "float32", "part": 0, "parts": 1,
                "lo": 0, "hi": 200}
        client.init({0: [spec]}, {0: [np.zeros((200, 50), np.float32)]}, {"mode": "async", "pushers": ["worker:0"]})
        client.set_optimizer({"name": "SGD", "learning_rate": 1.0})
        made.append((client, thread, worker, ps))
        return client, worker
    yield start
    for client, thread, worker, ps in made:
        client.bye()
        thread.join(5)
        worker.close()
        ps.close()


def test_a_ps_task_applies_decompressed_pushes_and_they_are_smaller(shard):
    topk = stratagem.compressor("topk", ratio=0.01)
    client, worker = shard(topk)
    grad = np.random.default_rng(0).normal(size=(200, 50)).astype(np.float32)
    wire, payload = compress_pieces(topk, {"w": topk.init_state(grad.shape, grad.dtype)}, ["w"], [grad])
    before = worker.traffic.snapshot()
    push_grads(client, {0: (["w"], payload)}, compression={0: wire})
    sent = (worker.traffic.snapshot() - before).sent_bytes()
    assert sent < grad.nbytes * 0.03           # 100 of 10,000 entries, 8 bytes each, plus the metadata
    value = client.pull()[0].buffers[0]
    kept = np.argsort(np.abs(grad).ravel())[-100:]
    expected = np.zeros(grad.size, np.float32)
    expected[kept] = -grad.ravel()[kept]      # SGD with learning rate 1 on what was sent
    np.testing.assert_array_equal(value.ravel(), expected)


def test_a_ps_task_refuses_compressed_pushes_it_cannot_decompress(shard):
    client, _ = shard(None)
    topk = stratagem.compressor("topk")
    grad = np.ones((200, 50), np.float32)
    wire, payload = compress_pieces(topk, {"w": topk.init_state(grad.shape, grad.dtype)}, ["w"], [grad])
    with pytest.raises(RemoteError, match="the push is compressed with 'topk' but /job:ps/task:0 was started "
                                          "without compression: start every task"):
        push_grads(client, {0: (["w"], payload)}, compression={0: wire})


def test_a_ps_task_refuses_a_payload_that_does_not_fit_and_serves_on(shard):
    topk = stratagem.compressor("topk", ratio=0.01)
    client, _ = shard(topk)
    grad = np.ones((200, 50), np.float32)
    wire, payload = compress_pieces(topk, {"w": topk.init_state(grad.shape, grad.dtype)}, ["w"], [grad])
    with pytest.raises(RemoteError, match=r"piece 'w': compressor 'topk': payload array 1 is \(99,\) float32, "
                                          r"expected \(100,\) float32"):
        push_grads(client, {0: (["w"], [payload[0], payload[1][:-1]])}, compression={0: wire})
    with pytest.raises(RemoteError, match="bad compression entry"):
        push_grads(client, {0: (["w"], payload)}, compression={0: {"name": "topk", "pieces": [["k", 2]]}})
    assert push_grads(client, {0: (["w"], payload)}, compression={0: wire})[0].meta["status"] == "applied"


def test_parameter_server_workers_push_compressed_with_their_own_error_feedback():
    from stratagem.strategies.ps.parameter_server import ParameterServerStrategy

    cluster = ClusterSpec({"chief": ["local:0"], "worker": ["local:1"], "ps": ["local:2"]})
    fabric = LocalFabric()

    def start(task):
        return ParameterServerStrategy("local", cluster=cluster, task=task, exit_after_serving=False,
                                       transport_options={"fabric": fabric, "timeout": 30, "secret": b"s"},
                                       compression="topk", compression_options={"ratio": 0.25})

    servers = [threading.Thread(target=start, args=(t,), daemon=True) for t in ("ps:0", "worker:0")]
    for thread in servers:
        thread.start()
    coordinator = start("chief:0")
    try:
        with coordinator.scope():
            w = stratagem.Variable(np.zeros(4, np.float32), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        descend = lambda w, opt: opt.apply_gradients([(np.array([1.0, 2.0, 3.0, 4.0], np.float32), w)])  # noqa: E731
        for _ in range(4):
            coordinator.schedule(descend, args=(w, opt))
        coordinator.join()
        # one entry of four per push, the rest waiting on the worker: 4 (entry 3), 3+3 (entry 2),
        # 4+4 (entry 3), 2+2+2+2 (entry 1)
        np.testing.assert_array_equal(w.numpy(), [0.0, -8.0, -6.0, -12.0])
    finally:
        coordinator.shutdown()
        for thread in servers:
            thread.join(10)
