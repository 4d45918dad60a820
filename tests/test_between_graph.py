"""The ``between_graph`` strategy: every worker trains against the ps tasks.

Two kinds of test:

- tasks as threads of this process over the ``local`` transport (tests/scripts/ps_harness.py): sync
  equals mirrored, backup workers, the staleness bound, initialisation by the chief, checkpoints,
  options and errors;
- real processes over ``zmq`` under ``stratagem.launch.launcher.launch`` (2 ps, 3 workers): the example
  converges in the three modes with the ps tasks exiting on their own, every reply holds one version
  of the values (1 ps, 2 workers, replies in parts and double-buffered), exact accounting of pushes, a
  worker killed under async, a ps task killed (every worker names it) and the restart from the
  checkpoint. The launcher reaps every process it starts.
"""

from __future__ import annotations

import doctest
import io
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ConfigurationError
from stratagem.launch.launcher import launch
from stratagem.strategies.ps import between_graph as between_graph_module
from stratagem.strategies.ps.between_graph import BetweenGraphStrategy
from stratagem.strategies.mirrored.strategy import MirroredStrategy
from stratagem.transports.local import LocalFabric

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402
from ps_harness import cluster_spec, ok, run_cluster  # noqa: E402

pytestmark = pytest.mark.timeout(120)

#: One math thread per process: the tasks share the machine's cores (and other tests run beside them).
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# -- sync equals mirrored ------------------------------------------------------------------------------------

STEPS, BATCH = 12, 25            # 25 rows over 3 workers: 9, 8, 8 (a remainder: weights matter)


def mirrored_run(n: int, optimizer: str):
    """The same training under ``mirrored``, replicas as threads; returns the chief's parameters."""
    cluster = stratagem.ClusterSpec({"worker": [f"local:{i}" for i in range(n)]})
    fabric, out = LocalFabric(), {}

    def replica(index):
        with MirroredStrategy("local", cluster=cluster, task=f"worker:{index}",
                              transport_options={"fabric": fabric, "timeout": 30}) as strategy:
            with strategy.scope():
                params, opt = model.create(optimizer)
            for x, y in strategy.distribute_dataset(model.global_batches(0, STEPS, BATCH)):
                model.train_step(params, opt, x, y)
            out[index] = {name: var.numpy() for name, var in params.items()}
    threads = [threading.Thread(target=replica, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sync_with_every_worker_aggregated_equals_mirrored(optimizer):
    def body(strategy, rank):
        with strategy.scope():
            params, opt = model.create(optimizer, seed=1 if strategy.is_chief else 50 + rank)
        for x, y in strategy.distribute_dataset(model.global_batches(0, STEPS, BATCH)):
            model.train_step(params, opt, x, y)
        return {name: var.numpy() for name, var in params.items()}, strategy.global_step, strategy.acks

    # w1 (64 x 32 float32, 8 KiB) is partitioned over the two shards
    results = ok(run_cluster(2, 3, body, mode="sync", partition_bytes=4096, placement="greedy"))
    expected = mirrored_run(3, optimizer)
    reference = model.reference(STEPS, BATCH, optimizer)
    for task in ("worker:0", "worker:1", "worker:2"):
        params, step, acks = results[task]
        assert step == STEPS and acks == {0: {"applied": STEPS}, 1: {"applied": STEPS}}
        for name in model.PARAM_NAMES:
            np.testing.assert_allclose(params[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(params[name], reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert results["ps:0"]["updates"] == results["ps:1"]["updates"] == STEPS


# -- backup workers and staleness ------------------------------------------------------------------------------

def timed_sync(slow: float, aggregate: int, steps: int):
    """3 workers, ``worker:2`` sleeping ``slow`` s per step, the others 0.01 s; returns (steps/s, results)."""
    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(8, np.float32), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=0.01)
        began = time.monotonic()
        local = 0
        while not strategy.should_stop():
            time.sleep(slow if strategy.task.index == 2 else 0.01)
            opt.apply_gradients([(np.ones(8, np.float32), w)])
            local += 1
            if strategy.is_chief and strategy.global_step >= steps:
                strategy.request_stop()
        return strategy.global_step / (time.monotonic() - began), local, strategy.acks
    results = ok(run_cluster(1, 3, body, mode="sync", replicas_to_aggregate=aggregate, timeout=30))
    return results["worker:0"][0], results


def test_backup_workers_keep_the_pace_and_count_dropped_gradients():
    baseline, _ = timed_sync(0.01, 2, 60)
    # 60 fast steps outlast several of the straggler's 0.2 s steps, so it does push (stale) gradients.
    straggling, results = timed_sync(0.2, 2, 60)
    no_backup, _ = timed_sync(0.2, 3, 4)
    assert straggling >= 0.5 * baseline, (straggling, baseline)      # close to the no-straggler rate
    assert straggling >= 4 * no_backup, (straggling, no_backup)      # ...where without backups it crawls
    stats = results["ps:0"]
    dropped_acks = sum(results[f"worker:{i}"][2][0].get("dropped", 0) for i in range(3))
    assert stats["dropped"] == dropped_acks > 0
    assert results["worker:2"][2][0].get("dropped", 0) > 0              # the straggler's gradients
    applied_acks = sum(results[f"worker:{i}"][2][0].get("applied", 0) for i in range(3))
    assert stats["applied"] == applied_acks == 2 * stats["updates"]    # 2 gradients in every update


def test_bounded_staleness_holds_and_is_reached():
    bound, shared, lock, samples = 2, {0: 0, 1: 0, 2: 0}, threading.Lock(), []

    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(4, np.float32), name="w")
            b = stratagem.Variable(np.zeros(4, np.float32), name="b")
            opt = stratagem.optimizers.SGD(learning_rate=0.01)
        clocks = []
        while not strategy.should_stop():
            with lock:      # steps this worker completed vs the slowest's, when it starts a step
                samples.append((rank, shared[rank] - min(shared.values())))
            time.sleep(0.03 if rank == 2 else 0.0)
            opt.apply_gradients([(np.ones(4, np.float32), w), (np.ones(4, np.float32), b)])
            with lock:
                shared[rank] += 1
            clocks.append(strategy.last_clock)
            if strategy.is_chief and strategy.global_step >= 60:
                strategy.request_stop()
        return clocks
    results = ok(run_cluster(2, 3, body, mode="bounded", staleness=bound, timeout=30))
    assert results["ps:0"]["max_gap"] == bound                        # the fast workers reached the bound
    for task in ("worker:0", "worker:1", "worker:2"):
        for clock, slowest in results[task]:
            assert slowest is None or clock - slowest <= bound
    # seen from the workers: the slowest's push counts on ps:0 a moment before its own counter moves
    assert max(gap for _, gap in samples) <= bound + 1
    assert results["ps:1"]["clocks"] == {}                            # only ps:0 keeps the clocks


# -- initialisation, placement, reads --------------------------------------------------------------------------

def test_non_chief_workers_wait_for_the_chief_and_take_its_values():
    def body(strategy, rank):
        if strategy.is_chief:
            time.sleep(0.5)
        began = time.monotonic()
        with strategy.scope():
            with stratagem.device("/job:ps/task:1"):
                w = stratagem.Variable(np.full(3, 10.0 + rank, np.float32), name="w")
            b = stratagem.Variable(np.full(2, 20.0 + rank), name="b")
        return w.numpy(), b.numpy(), time.monotonic() - began, strategy.ps_stats()
    results = ok(run_cluster(2, 2, body))
    for task in ("worker:0", "worker:1"):
        w, b, _, stats = results[task]
        assert w.tolist() == [10.0] * 3 and b.tolist() == [20.0] * 2
        assert stats[1]["pieces"] == ["w"] and stats[0]["pieces"] == ["b"]   # pinned, then round-robin
    assert results["worker:1"][2] > 0.3                                   # it waited for the chief


def test_a_worker_declaring_other_variables_is_told_which():
    def body(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros(4 if rank == 1 else 3, np.float32), name="w")
        return True
    results, errors = run_cluster(1, 2, body, timeout=10)
    assert isinstance(errors["worker:1"], ConfigurationError)
    message = str(errors["worker:1"])
    assert "declared its variables differently from the chief: 'w' is shape (3,), float32 on /job:ps/task:0 " \
           "but shape (4,), float32 on /job:ps/task:0 here" in message
    assert "ps:0" in errors and "worker:1 failed: ConfigurationError" in str(errors["ps:0"])   # ps reports it


def test_reads_pull_fresh_values_only_after_an_update():
    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(2, np.float32), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        view = w.value
        pulls = [strategy.ps_stats()[0]["pulls"]]
        w.numpy(); w.numpy()
        pulls.append(strategy.ps_stats()[0]["pulls"])
        opt.apply_gradients([(np.ones(2, np.float32), w)])
        w.numpy(); w.numpy()
        pulls.append(strategy.ps_stats()[0]["pulls"])
        return pulls, view, w.value is view
    results = ok(run_cluster(1, 1, body, pull_with_push=False))
    pulls, view, same = results["worker:0"]
    assert pulls[1] == pulls[0] and pulls[2] == pulls[1] + 1          # one pull, after the update
    assert view.tolist() == [-1.0, -1.0] and same                      # the same buffer, refreshed in place


def test_a_pulled_value_becomes_the_copy_when_nobody_holds_it_and_is_copied_in_place_otherwise():
    torch = pytest.importorskip("torch")

    def body(strategy, rank):
        with strategy.scope():
            free = stratagem.Variable(np.zeros(3, np.float32), name="free")
            held = stratagem.Variable(np.zeros(3, np.float32), name="held")
            viewed = stratagem.Variable(np.zeros(3, np.float32), name="viewed")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        before = free.value.ctypes.data            # an address, not a reference to the array
        mine, tensor = held.value, torch.from_numpy(viewed.value)
        ones = np.ones(3, np.float32)
        opt.apply_gradients([(ones, free), (2 * ones, held), (3 * ones, viewed)])   # replies carry the values
        return (free.value.ctypes.data != before, free.numpy().tolist(), held.value is mine, mine.tolist(),
                tensor.tolist(), free.value.flags.writeable)
    moved, free, same, mine, tensor, writable = ok(run_cluster(1, 1, body))["worker:0"]
    assert moved and free == [-1.0] * 3 and writable       # the received buffer, kept: no copy
    assert same and mine == [-2.0] * 3                     # held by the caller: refreshed in place
    assert tensor == [-3.0] * 3                            # a torch view sees the new values


def gpu_worker_steps(xp, device_array):
    """Dense, assign and row steps on variables made with ``xp`` (numpy, or the stand-in cupy)."""
    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(xp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2)), name="w")
            table = stratagem.Variable(xp.asarray(np.ones((8, 2), np.float32)), name="table")
            opt = stratagem.optimizers.SGD(learning_rate=0.5)
        seen = []
        for step in range(3):
            rows = table.gather(np.array([step, 5, step]))
            seen.append(device_array(rows) and device_array(w.value))
            grad_rows = stratagem.IndexedSlices(xp.asarray(np.full((3, 2), step + 1.0, np.float32)),
                                                np.array([step, 5, step]), dense_shape=(8, 2))
            opt.apply_gradients([(xp.asarray(np.full((3, 2), 0.25, np.float32)), w), (grad_rows, table)])
        w.assign(w.value * 2)
        return seen, w.value.get() if hasattr(w.value, "get") else w.value, np.asarray(table.numpy())
    return ok(run_cluster(2, 1, body, partition_bytes=16))["worker:0"]


def test_a_gpu_worker_keeps_its_variables_on_the_device_and_trains_as_on_the_host(fake_cupy):
    from stratagem.training.variables import is_device_array
    seen, w_gpu, table_gpu = gpu_worker_steps(fake_cupy, is_device_array)
    fake_cupy.calls.clear()
    _, w_host, table_host = gpu_worker_steps(np, lambda a: True)
    assert all(seen)                          # gathered rows and var.value stay cupy arrays
    np.testing.assert_array_equal(w_gpu, w_host)      # the same steps, the same values, bit for bit
    np.testing.assert_array_equal(table_gpu, table_host)
    assert not np.array_equal(table_host, np.ones((8, 2), np.float32))


# -- checkpoints --------------------------------------------------------------------------------------------------

def test_checkpoint_dir_restores_before_anyone_starts(tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def first(strategy, rank):
        with strategy.scope():
            params, opt = model.create("adam")
        for step, (x, y) in enumerate(model.global_batches(0, 5, BATCH)):
            model.train_step(params, opt, x, y)
        strategy.save(ckpt)
        return {n: v.numpy() for n, v in params.items()}

    def second(strategy, rank):
        with strategy.scope():
            params, opt = model.create("adam", seed=7)                  # other initial values: restored over
        start = strategy.global_step
        values = {n: v.numpy() for n, v in params.items()}
        for x, y in model.global_batches(start, 10, BATCH):
            model.train_step(params, opt, x, y)
        return start, values, {n: v.numpy() for n, v in params.items()}

    saved = ok(run_cluster(2, 1, first))["worker:0"]
    start, restored, final = ok(run_cluster(3, 1, second, checkpoint_dir=ckpt))["worker:0"]   # 3 ps now
    assert start == 5
    for name in model.PARAM_NAMES:
        np.testing.assert_array_equal(restored[name], saved[name])
    reference = model.reference(10, BATCH, "adam")                       # Adam's slots came back too
    for name in model.PARAM_NAMES:
        np.testing.assert_allclose(final[name], reference[name], rtol=1e-5, atol=1e-6)


def test_a_mirrored_checkpoint_restores_under_between_graph(tmp_path):
    ckpt = str(tmp_path / "mirrored")
    with MirroredStrategy("local", cluster=stratagem.ClusterSpec({"worker": ["local:0"]}), task="worker:0",
                          transport_options={"fabric": LocalFabric()}) as strategy:
        with strategy.scope():
            params, opt = model.create("sgd")
        for x, y in model.global_batches(0, 3, BATCH):
            model.train_step(params, opt, x, y)
        strategy.save(ckpt)
        expected = {n: v.numpy() for n, v in params.items()}

    def body(strategy, rank):
        with strategy.scope():
            params, _ = model.create("sgd", seed=9)
        return strategy.restore(ckpt), {n: v.numpy() for n, v in params.items()}
    step, values = ok(run_cluster(2, 1, body))["worker:0"]
    assert step == 3
    for name in model.PARAM_NAMES:
        np.testing.assert_array_equal(values[name], expected[name])


# -- options --------------------------------------------------------------------------------------------------------

def test_options_and_clusters_are_checked():
    common = dict(transport_options={"fabric": LocalFabric()})
    with pytest.raises(ConfigurationError, match="keeps the variables on 'ps' tasks, and this cluster has none"):
        BetweenGraphStrategy("local", cluster=stratagem.ClusterSpec({"worker": ["local:0"]}), task="worker:0",
                             **common)
    cluster = cluster_spec(1, 3)
    for bad, message in [({"mode": "eventually"}, "unknown mode 'eventually'"),
                         ({"mode": "sync", "replicas_to_aggregate": 4}, "replicas_to_aggregate=4 is more than the 3"),
                         ({"mode": "bounded"}, "needs staleness=S"),
                         ({"staleness": 2}, "staleness applies to mode='bounded' only"),
                         ({"partition_bytes": 0}, "partition_bytes must be an integer >= 1"),
                         ({"placement": "best"}, "unknown placement policy 'best'"),
                         ({"mode_": "sync"}, r"does not accept option\(s\) 'mode_' \(did you mean 'mode'\?\)")]:
        with pytest.raises(ConfigurationError, match=message):
            BetweenGraphStrategy("local", cluster=cluster, task="worker:0", **bad,
                                 transport_options={"fabric": LocalFabric()})
    from stratagem.plugins.manager import PluginManager
    assert PluginManager(autoload=False).strategy_class("between_graph") is BetweenGraphStrategy


def test_docstring_examples():
    result = doctest.testmod(between_graph_module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


# -- real processes over zmq: 2 ps, 3 workers -------------------------------------------------------------------

def run_job(command, *, ps=2, workers=3, timeout=90, grace=5.0):
    stdout, stderr = io.StringIO(), io.StringIO()
    result = launch([sys.executable, *map(str, command)], workers=workers, ps=ps, timeout=timeout,
                    output=stdout, error_output=stderr, grace=grace, env=THREADS)
    return result, stdout.getvalue() + stderr.getvalue()


@pytest.mark.parametrize("mode", ["async", "sync", "bounded"])
def test_the_example_converges_over_zmq_and_the_ps_tasks_exit_on_their_own(mode):
    result, log = run_job([ROOT / "examples" / "linear_regression_ps.py", "--mode", mode, "--steps", 600])
    assert result.ok, log
    assert not any(r.stopped_by_launcher for r in result.tasks), log     # the ps tasks exited by themselves
    match = re.search(r"final W = (\S+), b = (\S+) ", log)
    assert match, log
    w, b = float(match.group(1)), float(match.group(2))
    assert abs(w - 0.1) < 2e-3 and abs(b - 0.3) < 2e-3, (w, b)
    assert "2 ps, 3 worker(s), mode " + mode in log


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_embedding_example_learns_and_moves_rows_not_tables(mode):
    result, log = run_job([ROOT / "examples" / "embedding_ps.py", "--mode", mode, "--steps", 300], workers=2)
    assert result.ok, log
    first, last = map(float, re.search(r"first loss (\S+), last loss (\S+);", log).groups())
    assert last < 0.6 * first, log
    shares = [float(s) for s in re.findall(r"\(([\d.]+)% of the tables\)", log)]
    assert shares and max(shares) < 1.0, log          # kilobytes per step against 4.5 MB of tables


def read(out: Path, name: str):
    return json.loads((out / f"{name}.json").read_text())


def test_every_reply_holds_one_version_over_zmq(tmp_path):
    """22 MB of values per reply: parts, streamed as updated, written over the pushed gradients while
    the other worker's reply may still be sending the previous values; a 6 MB variable held as two
    pieces, so that every buffer travels whole (tests/scripts/ps_versions.py)."""
    result, log = run_job([SCRIPTS / "ps_versions.py", tmp_path, 25], ps=1, workers=2)
    assert result.ok, log
    workers = [read(tmp_path, f"worker_{i}") for i in range(2)]
    assert [w["wrong"] for w in workers] == [[], []]
    assert workers[0]["pieces"]["big"] == ["big/part_0", "big/part_1"] and workers[0]["pieces"]["v0"] == ["v0"]
    for w in workers:
        assert w["seen"] == sorted(set(w["seen"]))                 # each push adds at least one step
    assert max(w["seen"][-1] for w in workers) == 50                # every push applied once


def test_exact_accounting_over_zmq(tmp_path):
    result, log = run_job([SCRIPTS / "ps_train.py", "--out", tmp_path, "--mode", "async", "--steps", 300])
    assert result.ok, log
    workers = [read(tmp_path, f"worker_{i}") for i in range(3)]
    for shard in (0, 1):
        stats = read(tmp_path, f"ps_{shard}")
        # (On a loaded machine a worker may start only after the chief reached the last step: it then
        # pushed nothing, and has no entry on either side.)
        acked = sum(w["acks"].get(str(shard), {}).get("applied", 0) for w in workers)
        assert stats["applied"] == stats["updates"] == acked, (stats, [w["acks"] for w in workers])
        assert stats["pushes"] == stats["applied"] + stats["stopped"]
        for i, w in enumerate(workers):
            assert (stats["by_replica"].get(f"worker:{i}", {}).get("applied", 0)
                    == w["acks"].get(str(shard), {}).get("applied", 0))
    assert abs(workers[0]["W"] - 0.1) < 5e-3 and abs(workers[0]["b"] - 0.3) < 5e-3


def test_a_worker_killed_under_async_does_not_stop_the_others(tmp_path):
    result, log = run_job([SCRIPTS / "ps_train.py", "--out", tmp_path, "--mode", "async", "--steps", 600,
                           "--die-task", "worker:2", "--die-at", 20, "--peer-timeout", 2], grace=60)
    assert result.returncodes["worker:2"] == -9, log
    assert result.returncodes["worker:0"] == result.returncodes["worker:1"] == 0, log
    assert result.returncodes["ps:0"] == result.returncodes["ps:1"] == 0, log
    chief = read(tmp_path, "worker_0")
    assert chief["global_step"] >= 600
    assert abs(chief["W"] - 0.1) < 2e-3 and abs(chief["b"] - 0.3) < 2e-3, chief
    assert not (tmp_path / "worker_2.json").exists()
    stats = read(tmp_path, "ps_0")
    assert stats["by_replica"]["worker:2"]["applied"] <= 21                  # its last push may be unacknowledged


def test_a_killed_ps_task_is_named_by_every_worker_and_the_job_restarts_from_the_checkpoint(tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    timeout = 20
    result, log = run_job([SCRIPTS / "ps_train.py", "--out", first, "--mode", "async", "--steps", 100_000,
                           "--ckpt", ckpt, "--save-every", 100, "--ps-die-after-ckpt", "ps:1",
                           "--timeout", timeout, "--peer-timeout", 2], grace=timeout + 10)
    assert result.returncodes["ps:1"] == -9, log
    for i in range(3):
        error = json.loads((first / f"worker_{i}.error.json").read_text())
        assert error["type"] == "ShardLostError" and error["task"] == "/job:ps/task:1", error
        assert "parameter-server shard /job:ps/task:1 (holding b) is gone" in error["message"]
        assert error["seconds"] < timeout
        assert result.returncodes[f"worker:{i}"] == 3
    ps0 = json.loads((first / "ps_0.error.json").read_text())
    assert "/job:ps/task:1" in ps0["message"] and result.returncodes["ps:0"] == 4
    saved = stratagem.training.checkpoint.load(str(ckpt)).step
    assert saved >= 100

    result, log = run_job([SCRIPTS / "ps_train.py", "--out", second, "--mode", "async", "--steps", saved + 300,
                           "--ckpt", ckpt, "--save-every", 100])
    assert result.ok, log
    chief = read(second, "worker_0")
    assert chief["start"] == saved                                         # continued from the saved step
    assert chief["global_step"] >= saved + 300
    assert abs(chief["W"] - 0.1) < 2e-3 and abs(chief["b"] - 0.3) < 2e-3
