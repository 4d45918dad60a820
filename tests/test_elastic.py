"""Elastic mirrored training (``on_failure="shrink"``) and the elastic communicator under it.

Two kinds of test:

- real processes under ``stratagem launch`` (tests/scripts/elastic_train.py, the plain script a user
  writes: no main guard, no shutdown): a worker SIGKILLs itself in the middle of a step; the survivors
  finish, or, with ``--restart-workers 1``, the restarted worker rejoins and all finish identical;
  without shrink the survivors still fail naming the lost task.
- replicas as threads of this process over the ``local`` transport (a replica "dies" by aborting its
  transport, as a crash would), for the protocol's corners: older commits, optimizer state, the
  chief's loss, stale messages, refusals.

The model is the numpy MLP of tests/scripts/mirrored_model.py. Its reference is one process trained
on whole global batches: the mirrored replicas weight each shard by its rows, so any world size
makes the same update, and a run that loses and regains replicas must still match it. Batches of 23
rows over 300 examples never line up with an earlier batch, so a replica fed the wrong batch after a
reset would show.
"""

from __future__ import annotations

import doctest
import importlib.util
import io
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, PeerLostError, TaskId
from stratagem.collectives import elastic as elastic_module
from stratagem.collectives.elastic import ElasticCommunicator
from stratagem.core.errors import WorldChangedError
from stratagem.core.transport import Message
from stratagem.launch.launcher import launch
from stratagem.launch.restarts import RESTARTS_ENV
from stratagem.strategies.mirrored import elastic as mirrored_elastic
from stratagem.strategies.mirrored.strategy import MirroredStrategy
from stratagem.transports.local import LocalFabric, LocalTransport

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402  (tests/scripts is not a package)

TRAIN = [sys.executable, str(SCRIPTS / "elastic_train.py")]
STEPS, BATCH = 24, 23
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
#: What the launched tasks get: one BLAS thread each (2 shared cores), no restart count inherited.
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", RESTARTS_ENV: None}

pytestmark = pytest.mark.timeout(90)

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                                reason="grpcio is not installed (pip install 'stratagem[grpc]')")


@pytest.fixture(scope="module")
def reference():
    return {kind: model.reference(STEPS, BATCH, kind) for kind in ("sgd", "adam")}


def assert_close(params, expected):
    for name in model.PARAM_NAMES:
        np.testing.assert_allclose(params[name], expected[name], err_msg=name, **TOLERANCE)


def assert_identical(all_params):
    for params in all_params[1:]:
        for name in model.PARAM_NAMES:
            np.testing.assert_array_equal(params[name], all_params[0][name], err_msg=name)


# -- real processes under stratagem launch -------------------------------------------------------------

def run_job(tmp_path, *args, restart_workers=None, transport="zmq", timeout=60.0):
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    stdout, stderr = io.StringIO(), io.StringIO()
    result = launch([*TRAIN, "--out", str(out), "--transport", transport, *map(str, args)], workers=3,
                    timeout=timeout, output=stdout, error_output=stderr, env=ENV,
                    restart_workers=restart_workers)
    return result, out, stdout.getvalue() + stderr.getvalue()


def read(out: Path, index: int):
    record = json.loads((out / f"worker_{index}.json").read_text())
    with np.load(out / f"worker_{index}.npz", allow_pickle=False) as f:
        return record, {name: f[name] for name in f.files}


def test_processes_kill_9_a_worker_and_the_survivors_finish_alone(tmp_path, reference):
    result, out, log = run_job(tmp_path, "--steps", STEPS, "--batch", BATCH, "--die-at", 7, restart_workers=0)
    assert result.ok, log
    assert result.returncodes == {"worker:0": 0, "worker:1": 0, "worker:2": -9}, log
    assert "worker:2" in result.reason and "left dead" in result.summary()
    records = [read(out, i) for i in (0, 1)]
    for record, params in records:
        assert record["iterations"] == STEPS and record["replicas"] == 2
        assert record["resets"] == [{"lost": ["worker:2"], "joined": [], "size": 2}]
        assert_close(params, reference["sgd"])    # the retried step too: 2 replicas make 3's update
    assert_identical([params for _, params in records])
    assert not (out / "worker_2.json").exists()


@pytest.mark.parametrize("transport", ["zmq", pytest.param("grpc", marks=needs_grpc), "shm"])
def test_processes_a_restarted_worker_rejoins_and_all_finish_identical(tmp_path, reference, transport):
    result, out, log = run_job(tmp_path, "--steps", STEPS, "--batch", BATCH, "--die-at", 6, "--optimizer", "adam",
                               "--wait-for", 3, restart_workers=1, transport=transport)
    assert result.ok, log
    assert [r.restarts for r in result.tasks] == [0, 0, 1], log
    assert "worker:2 was killed by SIGKILL; started it again" in log
    records = [read(out, i) for i in range(3)]
    for index, (record, params) in enumerate(records):
        assert record["iterations"] == STEPS and record["replicas"] == 3, (index, record)
        assert_close(params, reference["adam"])
    assert records[2][0]["restarted"] and records[2][0]["resets"] == []
    # worker:2 is lost and rejoins: in two re-formations, or in one when its new process had already
    # connected by the time the survivors re-formed (a fast restart replaces it in a single change).
    assert records[0][0]["resets"] in ([{"lost": ["worker:2"], "joined": [], "size": 2},
                                        {"lost": [], "joined": ["worker:2"], "size": 3}],
                                       [{"lost": ["worker:2"], "joined": ["worker:2"], "size": 3}]), records[0][0]
    assert_identical([params for _, params in records])   # the newcomer got the committed state, bit for bit


def test_processes_without_shrink_the_survivors_fail_naming_the_lost_task(tmp_path):
    # --restart-workers 0 lets the job go on after worker:2's death: the survivors end it themselves,
    # each by the uncaught PeerLostError (the plain script ending by an exception).
    result, out, log = run_job(tmp_path, "--steps", STEPS, "--die-at", 5, "--no-shrink", restart_workers=0)
    assert not result.ok and result.failed_task in (TaskId("worker", 0), TaskId("worker", 1)), log
    assert result.returncodes[result.failed_task.short] == 1
    assert "PeerLostError: lost peer /job:worker/task:2" in log
    assert not list(out.glob("*.json"))


# -- replicas as threads over the local transport ---------------------------------------------------------

class _Died(BaseException):
    """Ends a replica thread that 'died' (its transport aborted, as a crash would leave it)."""


def run_world(n: int, body, *, restart=(), timeout: float = 30.0, **options):
    """Run ``body(strategy, index, restarted)`` on ``n`` elastic mirrored replicas, each a thread with its own
    strategy over one local fabric. A replica that raises ``_Died`` is gone; if its index is in
    ``restart`` a new strategy for its task runs ``body`` again (a restarted worker). Returns
    ``{index or 'index+': result or exception}``."""
    cluster, fabric = ClusterSpec({"worker": [f"local:{i}" for i in range(n)]}), LocalFabric()
    results: dict = {}
    made = []

    def make(index):
        strategy = MirroredStrategy("local", cluster=cluster, task=f"worker:{index}", on_failure="shrink",
                                    transport_options={"fabric": fabric, "timeout": timeout}, **options)
        made.append(strategy)
        return strategy

    def target(index, key):
        strategy = None
        try:
            strategy = make(index)
            results[key] = body(strategy, index, key != index)
            strategy.shutdown()
        except _Died:
            if index in restart and key == index:
                target(index, f"{index}+")
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[key] = exc
            if strategy is not None:
                strategy.shutdown()

    threads = [threading.Thread(target=target, args=(i, i), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout + 10
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"replicas did not finish: {results}"
    finally:
        for strategy in made:
            strategy.shutdown()
    return results


def trainer(optimizer="sgd", *, die=None, steps=STEPS, manual_commits=None, wait_for=0):
    """A replica body: the MLP in strategy.elastic; replica ``die[0]`` aborts its transport at step
    ``die[1]`` (in its first life). Returns (params, iterations, resets, replicas at the end)."""
    def body(strategy, index, restarted):
        with strategy.scope():
            params, opt = model.create(optimizer, seed=1 if strategy.is_chief else 50 + index)
        resets = []
        strategy.on_reset(resets.append)

        @strategy.elastic
        def train():
            for x, y in strategy.distribute_dataset(model.global_batches(0, steps, BATCH)):
                if manual_commits and opt.iterations % manual_commits == 0:
                    strategy.commit()
                loss, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
                if die and die[0] == index and opt.iterations == die[1] and not restarted:
                    strategy.transport.abort()
                    raise _Died
                if strategy.num_replicas_in_sync < wait_for:
                    time.sleep(0.02)
                opt.apply_gradients([(grads[n], params[n]) for n in model.PARAM_NAMES])

        train()
        return {n: v.numpy() for n, v in params.items()}, opt.iterations, resets, strategy.num_replicas_in_sync
    return body


def ok(results):
    for key, value in results.items():
        if isinstance(value, BaseException):
            raise AssertionError(f"replica {key} failed: {type(value).__name__}: {value}") from value
    return results


def test_local_shrink_with_adam_matches_one_process(reference):
    results = ok(run_world(3, trainer("adam", die=(1, 9))))
    assert sorted(results) == [0, 2]
    for params, iterations, resets, size in results.values():
        assert iterations == STEPS and size == 2
        [change] = resets
        assert change.lost == (TaskId("worker", 1),) and change.members == (TaskId("worker", 0), TaskId("worker", 2))
        assert change.generation == 1 and change.commit is not None
        assert_close(params, reference["adam"])
    assert_identical([r[0] for r in results.values()])


def test_local_restarted_replica_rejoins_with_the_optimizer_state(reference):
    results = ok(run_world(3, trainer("adam", die=(2, 5), wait_for=3), restart=(2,)))
    assert sorted(results, key=str) == [0, 1, "2+"]
    for params, iterations, _, size in results.values():
        assert iterations == STEPS and size == 3
        assert_close(params, reference["adam"])
    assert_identical([r[0] for r in results.values()])
    joined = results[0][2][-1]   # in one process the restart is instant: lost and joined may be one reset
    assert joined.joined == (TaskId("worker", 2),) and joined.size == 3 and joined.generation >= 1


@pytest.mark.parametrize("every", [None, 4])
def test_local_rollback_to_an_older_commit_replays_the_steps_since(every, reference):
    # Commits every 5 steps (by hand) or every 4 batches (commit_every=4); the loss at step 13 rolls
    # the survivors back to the commit before it, and the steps since are run again.
    body = trainer("adam", die=(2, 13), manual_commits=5 if every is None else None)
    results = ok(run_world(3, body, commit_every=every))
    for params, iterations, resets, _ in results.values():
        assert iterations == STEPS
        assert_close(params, reference["adam"])
    assert_identical([r[0] for r in results.values()])


def test_local_losing_the_chief_ends_the_job_naming_it():
    results = run_world(3, trainer(die=(0, 4)), timeout=15)
    for index in (1, 2):
        error = results[index]
        assert isinstance(error, PeerLostError) and not isinstance(error, WorldChangedError), error
        assert error.task == TaskId("worker", 0) and "coordinates the elastic world" in str(error)


def test_local_world_changed_outside_strategy_elastic_says_what_to_do():
    def body(strategy, index, restarted):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(3, np.float32), name="w")
            opt = stratagem.optimizers.SGD(0.1)
        opt.apply_gradients([(np.ones(3, np.float32), w)])
        if index == 2:
            strategy.transport.abort()
            raise _Died
        opt.apply_gradients([(np.ones(3, np.float32), w)])   # not inside strategy.elastic(fn)

    results = run_world(3, body, timeout=15)
    for index in (0, 1):
        assert isinstance(results[index], WorldChangedError), results[index]
        assert "strategy.elastic" in str(results[index]) and results[index].lost == (TaskId("worker", 2),)


def test_local_a_shared_one_shot_iterator_cannot_be_replayed():
    def body(strategy, index, restarted):
        with strategy.scope():
            params, opt = model.create("sgd", seed=1)
        batches = model.global_batches(0, STEPS, BATCH)    # made once, outside the function: one pass only

        @strategy.elastic
        def train():
            for x, y in strategy.distribute_dataset(batches):
                if index == 2 and opt.iterations == 3:
                    strategy.transport.abort()
                    raise _Died
                model.train_step(params, opt, x, y)
        train()

    results = run_world(3, body, timeout=15)
    for index in (0, 1):
        assert isinstance(results[index], ConfigurationError), results[index]
        assert "same iterator again" in str(results[index])


def test_stale_messages_of_an_old_generation_are_discarded_never_reduced():
    cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1", "local:2"]}), LocalFabric()
    comms = [ElasticCommunicator(LocalTransport(cluster, f"worker:{i}", fabric=fabric, timeout=10),
                                 owns_transport=True) for i in range(3)]
    out: dict = {}

    def rank(i):
        comm = comms[i]
        try:
            comm.join()
            if i == 2:
                comm.transport.abort()
                return
            try:
                comm.allreduce(np.ones(4))
            except WorldChangedError:
                comm.reform(commit=0)
            if i == 0:   # leftovers of generation 0, on the collectives' tag, ahead of the real data
                for data in (np.full(4, 1e6), np.full(4, -7.0)):
                    comm.transport.send(TaskId("worker", 1), "coll/world",
                                        Message({"fp": {"seq": 1, "coll": "allreduce", "gen": 0}}, [data]))
            out[i] = (comm.generation, comm.allreduce(np.full(4, i + 1.0)))
        except BaseException as exc:  # noqa: BLE001
            out[i] = exc
        finally:
            comm.close()

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in (0, 1):
        generation, total = out[i]
        assert generation == 1
        np.testing.assert_array_equal(total, np.full(4, 3.0))


def test_options_are_checked_and_fixed_worlds_refuse_shrink():
    cluster = ClusterSpec({"worker": ["local:0"]})
    local = {"fabric": LocalFabric()}
    with pytest.raises(ConfigurationError, match="unknown on_failure 'grow'.*'raise'.*'shrink'"):
        MirroredStrategy("local", cluster=cluster, task="worker:0", on_failure="grow", transport_options=local)
    with pytest.raises(ConfigurationError, match="commit_every must be an integer >= 1"):
        MirroredStrategy("local", cluster=cluster, task="worker:0", on_failure="shrink", commit_every=0,
                         transport_options=local)
    if importlib.util.find_spec("mpi4py") is not None:
        with pytest.raises(ConfigurationError, match="not supported over transport 'mpi': an MPI world is fixed"):
            MirroredStrategy("mpi", cluster=cluster, task="worker:0", on_failure="shrink")
    # a second scope() block may not create variables: a restarted worker gets them at the first one
    with MirroredStrategy("local", cluster=cluster, task="worker:0", on_failure="shrink",
                          transport_options={"fabric": LocalFabric()}) as strategy:
        with strategy.scope():
            stratagem.Variable(np.zeros(2), name="a")
        with pytest.raises(ConfigurationError, match="create every variable in the first scope.. block.*'b'"):
            with strategy.scope():
                stratagem.Variable(np.zeros(2), name="b")
    # without shrink, the elastic API is there and does nothing special
    with MirroredStrategy("local", cluster=cluster, task="worker:0", transport_options={"fabric": LocalFabric()}) as s:
        s.commit()
        s.on_reset(print)
        assert s.elastic(lambda: 42)() == 42 and s.last_reset is None


def test_docstring_examples():
    for module in (elastic_module, mirrored_elastic):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest example(s) failed"
