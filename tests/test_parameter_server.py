"""The ``parameter_server`` strategy: a coordinator schedules step functions onto workers.

- tasks as threads of this process over the ``local`` transport: schedule/join/fetch, per-worker
  datasets, what may be sent (by name, cloudpickle only on an authenticated cluster), step errors,
  a dead worker's steps re-run and the worker used again when it comes back, a lost ps task, sync and
  bounded modes with idle workers;
- real processes over ``zmq`` (tests/scripts/ps_coordinator.py under ``launch``): the linear
  regression converges and every task exits on its own; a worker SIGKILLed mid-step: its step re-runs
  on the others; a lambda defined after the strategy travels with cloudpickle (the launcher's secret).

The step functions below are module-level, so they travel by name (every "task" here is this module).
"""

from __future__ import annotations

import doctest
import io
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ConfigurationError, TaskId
from stratagem.strategies.ps import coordinator as coordinator_module
from stratagem.strategies.ps import worker as worker_module
from stratagem.launch.launcher import launch
from stratagem.strategies.ps.coordinator import CancelledError, ClosureError
from stratagem.ps_service.protocol import ShardLostError
from stratagem.strategies.ps import parameter_server as parameter_server_module
from stratagem.strategies.ps.parameter_server import ParameterServerStrategy
from stratagem.transports.local import LocalFabric

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.timeout(120)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# -- step functions (module level: sent by name) ---------------------------------------------------------------

def describe(x, pair, mapping, scalar):
    return {"sum": x.sum(), "pair": pair[::-1], "keys": sorted(mapping), "scalar": scalar * 2, "shape": x.shape}


def sgd_step(w, opt, strategy, gradient=1.0):
    opt.apply_gradients([(np.full(w.shape, gradient, w.dtype), w)])
    return strategy.task.short


def read_next(iterator, strategy):
    return next(iterator), strategy.task.short


def make_dataset(context):
    return iter([(context.worker_index, context.num_workers, i) for i in range(100)])


def fail_on_three(i):
    if i == 3:
        raise ValueError(f"step {i} is bad")
    time.sleep(0.01)
    return i


DEATHS = Counter()


def dying_step(w, opt, strategy, victim, at):
    """On ``victim``, the ``at``-th call kills the worker's transport mid-step (as a crash would)."""
    DEATHS[strategy.task.short] += 1
    if strategy.task.short == victim and DEATHS[victim] == at:
        strategy.transport.abort()
        raise SystemExit("killed")
    time.sleep(0.005)
    opt.apply_gradients([(np.ones(w.shape, w.dtype), w)])
    return strategy.task.short


def slow_step(w, opt, delay):
    time.sleep(delay)
    return opt.apply_gradients([(np.ones(w.shape, w.dtype), w)])


# -- harness -------------------------------------------------------------------------------------------------------

class Cluster:
    """ps tasks and workers serving in threads; the coordinator (chief:0) in the test's thread."""

    def __init__(self, ps=1, workers=2, *, timeout=20.0, secret=None, worker_secret="same", **options):
        jobs = {"chief": ["local:0"], "worker": [f"local:{1 + i}" for i in range(workers)],
                "ps": [f"local:{100 + i}" for i in range(ps)]}
        self.cluster = stratagem.ClusterSpec(jobs)
        self.fabric, self.timeout, self.options = LocalFabric(), timeout, options
        self.secret = secret
        self.worker_secret = secret if worker_secret == "same" else worker_secret
        self.threads, self.outcomes = {}, {}
        for task in [f"ps:{i}" for i in range(ps)] + [f"worker:{i}" for i in range(workers)]:
            self.start(task)
        self.coordinator = self.make("chief:0", secret)

    def make(self, task, secret):
        transport_options = {"fabric": self.fabric, "timeout": self.timeout}
        if secret:
            transport_options["secret"] = secret
        return ParameterServerStrategy("local", cluster=self.cluster, task=task, exit_after_serving=False,
                                       transport_options=transport_options, **self.options)

    def start(self, task):
        def target():
            try:
                self.outcomes[task] = self.make(task, self.worker_secret if task.startswith("worker") else
                                                self.secret).served
            except BaseException as exc:  # noqa: BLE001 - checked by the tests
                self.outcomes[task] = exc
        thread = threading.Thread(target=target, daemon=True, name=f"task-{task}")
        self.threads[task] = thread
        thread.start()

    def close(self):
        if not self.coordinator.closed:
            self.coordinator.shutdown()
        for task, thread in self.threads.items():
            thread.join(self.timeout)
        stuck = [t for t, thread in self.threads.items() if thread.is_alive()]
        assert not stuck, f"tasks {stuck} did not exit"


@pytest.fixture
def cluster(closing):
    return lambda *args, **kwargs: closing(Cluster(*args, **kwargs))


def model(strategy, size=4):
    with strategy.scope():
        w = stratagem.Variable(np.zeros(size, np.float32), name="w")
        opt = stratagem.optimizers.SGD(learning_rate=0.5)
    return w, opt


# -- scheduling --------------------------------------------------------------------------------------------------

def test_schedule_join_fetch_and_values_round_trip(cluster):
    c = cluster(ps=2, workers=2)
    s = c.coordinator
    remote = s.schedule(describe, args=(np.arange(6.0).reshape(2, 3), (1, "a"), {"k": 1, "j": [2]}, np.float32(1.5)))
    assert s.run(describe, args=(np.ones(2), (), {}, 0)) ["sum"] == 2.0
    got = remote.fetch(timeout=10)
    assert got["sum"] == 15.0 and got["pair"] == ("a", 1) and got["keys"] == ["j", "k"]
    assert got["scalar"] == np.float32(3.0) and got["shape"] == (2, 3)
    assert remote.done() and remote.worker in (TaskId("worker", 0), TaskId("worker", 1))


def test_steps_update_the_variables_on_the_ps_and_spread_over_workers(cluster):
    c = cluster(ps=2, workers=3)
    s = c.coordinator
    w, opt = model(s)
    results = [s.schedule(sgd_step, args=(w, opt, s)) for _ in range(30)]
    s.join()
    ran_on = Counter(r.fetch() for r in results)
    assert sum(ran_on.values()) == 30 and set(ran_on) <= {"worker:0", "worker:1", "worker:2"}
    assert len(ran_on) >= 2
    np.testing.assert_array_equal(w.numpy(), np.full(4, -15.0, np.float32))   # 30 async steps of lr 0.5
    assert s.refresh() == 30 and sum(s.coordinator.executed.values()) == 30


def test_per_worker_datasets(cluster):
    c = cluster(ps=1, workers=2)
    s = c.coordinator
    iterator = iter(s.create_per_worker_dataset(make_dataset))
    results = [s.schedule(read_next, args=(iterator, s)) for _ in range(12)]
    s.join()
    by_worker = {}
    for r in results:
        (index, count, i), task = r.fetch()
        assert count == 2 and task == f"worker:{index}"
        by_worker.setdefault(task, []).append(i)
    for seen in by_worker.values():                                  # each worker reads its own, in order
        assert seen == list(range(len(seen)))


def test_a_failing_step_is_raised_once_by_join_and_cancels_the_queue(cluster):
    c = cluster(ps=1, workers=1)
    s = c.coordinator
    results = [s.schedule(fail_on_three, args=(i,)) for i in range(8)]
    with pytest.raises(ClosureError, match=r"step function fail_on_three failed on /job:worker/task:0: "
                                           r"ValueError: step 3 is bad"):
        s.join()
    assert [r.fetch() for r in results[:3]] == [0, 1, 2]
    with pytest.raises(ClosureError):
        results[3].fetch()
    with pytest.raises(CancelledError, match="cancelled: an earlier step failed"):
        results[7].fetch()
    s.join()                                                         # raised once: the next join is clean
    assert s.schedule(fail_on_three, args=(5,)).fetch(timeout=10) == 5


# -- what may be sent ---------------------------------------------------------------------------------------------

def test_lambdas_need_an_authenticated_cluster(cluster):
    c = cluster(ps=1, workers=1)
    s = c.coordinator
    w, opt = model(s)
    with pytest.raises(ConfigurationError) as info:
        s.schedule(lambda: 1)
    message = str(info.value)
    assert "cannot be sent by name (test_lambdas_need_an_authenticated_cluster.<locals>.<lambda> is a lambda)" in message
    assert "not authenticated" in message and "STRATAGEM_SECRET" in message and "cloudpickle" in message

    def nested():
        return 1
    with pytest.raises(ConfigurationError, match="is defined inside another function"):
        s.schedule(nested)
    with pytest.raises(ConfigurationError, match=r"an argument of describe: args\[0\] is a object, which cannot be sent"):
        s.schedule(describe, args=(object(), (), {}, 0))
    with pytest.raises(ConfigurationError, match="pass iter\\(per_worker_dataset\\)"):
        s.schedule(read_next, args=(s.create_per_worker_dataset(make_dataset), s))


def test_closures_travel_with_cloudpickle_when_authenticated(cluster):
    c = cluster(ps=2, workers=2, secret=b"s3cret")
    s = c.coordinator
    w, opt = model(s)
    scale = 3.0
    remote = s.schedule(lambda: (opt.apply_gradients([(np.full(4, scale, np.float32), w)]), s.task.short)[1])
    assert remote.fetch(timeout=10) in ("worker:0", "worker:1")       # the strategy is the worker's
    np.testing.assert_array_equal(w.numpy(), np.full(4, -1.5, np.float32))


def test_workers_without_a_secret_refuse_pickled_functions(cluster):
    c = cluster(ps=1, workers=1, secret=b"s3cret", worker_secret=None)
    s = c.coordinator
    with pytest.raises(ClosureError, match="refuses a pickled function: its cluster is not authenticated"):
        s.schedule(lambda: 1).fetch(timeout=10)


def test_functions_of_installed_packages_go_by_value_or_are_refused_at_schedule(cluster):
    """np.mean is not the user's code: a worker would refuse its name, so it is never sent by name."""
    c = cluster(ps=1, workers=1)
    with pytest.raises(ConfigurationError, match=r"'mean' cannot be sent by name.*not authenticated"):
        c.coordinator.schedule(np.mean, args=(np.arange(4.0),))
    with pytest.raises(ConfigurationError, match=r"cannot be found by name on the workers"):
        cluster(ps=1, workers=1, functions="name").coordinator.schedule(np.mean, args=(np.arange(4.0),))
    authenticated = cluster(ps=1, workers=1, secret=b"s3cret").coordinator
    assert authenticated.schedule(np.mean, args=(np.arange(4.0),)).fetch(timeout=10) == 1.5


# -- failures -----------------------------------------------------------------------------------------------------

def test_a_dead_workers_steps_rerun_and_it_is_used_again_when_back(cluster):
    DEATHS.clear()
    c = cluster(ps=1, workers=2)
    s = c.coordinator
    w, opt = model(s)
    results = [s.schedule(dying_step, args=(w, opt, s, "worker:1", 3)) for _ in range(20)]
    s.join()
    assert all(r.done() for r in results)
    assert Counter(r.fetch() for r in results)["worker:0"] >= 1 and s.coordinator.retried >= 1
    assert isinstance(c.outcomes.get("worker:1"), BaseException)   # that worker's thread ended
    np.testing.assert_array_equal(w.numpy(), np.full(4, -10.0, np.float32))   # each of the 20 applied once
    c.threads["worker:1"].join(5)
    c.start("worker:1")                                              # a new process of the same task
    more = [s.schedule(slow_step, args=(w, opt, 0.02)) for _ in range(20)]
    s.join()
    assert all(r.done() for r in more)
    assert s.coordinator.executed[TaskId("worker", 1)] >= 3          # it is used again


def test_a_lost_ps_task_fails_join_and_the_workers_naming_it(cluster):
    c = cluster(ps=2, workers=2, timeout=10)
    s = c.coordinator
    w, opt = model(s, size=8)
    with stratagem.device("/job:ps/task:1"):
        with s.scope():
            stratagem.Variable(np.zeros(2), name="other")
    s.schedule(slow_step, args=(w, opt, 0.0)).fetch(timeout=10)
    began = time.monotonic()
    c.fabric.leave(TaskId("ps", 1), "/job:ps/task:1 died")            # as a killed process would
    results = [s.schedule(slow_step, args=(w, opt, 0.05)) for _ in range(10)]
    with pytest.raises(ShardLostError) as info:
        s.join()
    assert info.value.task == TaskId("ps", 1) and "parameter-server shard /job:ps/task:1" in str(info.value)
    assert time.monotonic() - began < 8
    for task in ("worker:0", "worker:1"):
        c.threads[task].join(10)
        outcome = c.outcomes[task]
        assert isinstance(outcome, ShardLostError) and outcome.task == TaskId("ps", 1), outcome
    assert any(r.done() for r in results)


@pytest.mark.parametrize("mode, options", [("sync", {}), ("bounded", {"staleness": 0})])
def test_sync_and_bounded_do_not_wait_for_idle_workers(cluster, mode, options):
    c = cluster(ps=2, workers=3, mode=mode, **options)
    s = c.coordinator
    w, opt = model(s)
    for count in (5, 1, 4):                                          # not multiples of the 3 workers
        results = [s.schedule(slow_step, args=(w, opt, 0.01)) for _ in range(count)]
        s.join(timeout=20)
        assert all(r.done() for r in results)
    stats = s.ps_stats()[0]
    assert stats["pushes"] == 10 and stats["dropped"] == 0


def test_options_and_roles():
    cluster = stratagem.ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]})
    with pytest.raises(ConfigurationError, match="needs worker tasks besides the coordinator"):
        ParameterServerStrategy("local", cluster=cluster, task="worker:0", transport_options={"fabric": LocalFabric()})
    cluster = stratagem.ClusterSpec({"worker": ["local:0", "local:2"], "ps": ["local:1"]})
    with pytest.raises(ConfigurationError, match="functions must be one of 'auto', 'name', 'cloudpickle'"):
        ParameterServerStrategy("local", cluster=cluster, task="worker:0", functions="pickle",
                                transport_options={"fabric": LocalFabric()})


def test_docstring_examples():
    for module in (parameter_server_module, coordinator_module, worker_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} failed"


# -- real processes over zmq ------------------------------------------------------------------------------------------

def run_job(tmp_path, *args, grace=5.0):
    stdout, stderr = io.StringIO(), io.StringIO()
    result = launch([sys.executable, str(SCRIPTS / "ps_coordinator.py"), "--out", str(tmp_path), *map(str, args)],
                    workers=3, ps=2, chief=True, timeout=90, output=stdout, error_output=stderr, grace=grace,
                    env=THREADS)
    return result, stdout.getvalue() + stderr.getvalue()


def test_the_coordinator_trains_over_zmq_and_every_task_exits_on_its_own(tmp_path):
    result, log = run_job(tmp_path, "--steps", 700)
    assert result.ok and not any(r.stopped_by_launcher for r in result.tasks), log
    record = json.loads((tmp_path / "chief_0.json").read_text())
    assert record["results"] == 700 and record["global_step"] == 700
    # Which workers got steps depends on when each process came up (on a loaded machine a late one
    # may get none); that every result came from a real worker is what must hold.
    assert record["workers_in_results"] and set(record["workers_in_results"]) <= {0, 1, 2}, record
    assert abs(record["W"] - 0.1) < 2e-3 and abs(record["b"] - 0.3) < 2e-3, record


def test_a_killed_workers_step_reruns_on_the_others_over_zmq(tmp_path):
    result, log = run_job(tmp_path, "--steps", 700, "--die-task", "worker:1", "--die-at", 5, grace=60)
    assert result.returncodes["worker:1"] == -9, log
    assert result.returncodes["chief:0"] == 0, log
    record = json.loads((tmp_path / "chief_0.json").read_text())
    assert record["results"] == 700 and record["retried"] >= 1
    assert record["executed"]["/job:worker/task:1"] == 4                  # it died in its 5th
    assert abs(record["W"] - 0.1) < 2e-3 and abs(record["b"] - 0.3) < 2e-3, record


def test_a_lambda_travels_with_cloudpickle_on_the_launchers_authenticated_cluster(tmp_path):
    result, log = run_job(tmp_path, "--steps", 60, "--lambda")
    assert result.ok, log
    assert json.loads((tmp_path / "chief_0.json").read_text())["results"] == 60
