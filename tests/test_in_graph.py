"""The ``in_graph`` strategy: one client splits each batch over its devices and the worker tasks.

Three kinds of test:

- local devices: replicas as threads of the client's own process (a world of one);
- worker tasks as threads of this process over the ``local`` transport (with a cluster secret, so
  that ``functools.partial`` steps travel serialized), for the broad matrix (fast);
- real processes over ``zmq``, started here with their ``STRATAGEM_CONFIG`` (no launcher, so that a
  test can leave the secret out, or watch the survivors of a death): tests/scripts/in_graph_train.py,
  whose step the replicas find by name. Every process started is reaped, whatever happens.

The model is the numpy MLP of tests/scripts/mirrored_model.py; ``model.reference`` trains it in one
process on whole global batches. Batches of 25 rows split unevenly over 2 and 3 replicas.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, PeerLostError, TaskId
from stratagem.core.transport import Message
from stratagem.plugins.manager import PluginManager
from stratagem.strategies.remote_calls.functions import by_name, name_problem
from stratagem.strategies.in_graph.strategy import InGraphStrategy, PerReplica, ReplicaError
from stratagem.strategies.in_graph.replica import REPLY, REQUEST
from stratagem.testing.world import free_ports
from stratagem.transports.local import LocalFabric, LocalTransport

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402  (tests/scripts is not a package)

STEPS, BATCH = 12, 25            # 25 rows: not divisible by 2 nor by 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
SECRET = "in-graph-test-secret"
THREADS = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sgd_reference():
    return model.reference(STEPS, BATCH, "sgd")


def assert_params_close(got, expected, **tolerance):
    for name in model.PARAM_NAMES:
        np.testing.assert_allclose(got[name], expected[name], err_msg=name, **(tolerance or TOLERANCE))


# -- harness: a world in this process ----------------------------------------------------------------

class World:
    """A client (this thread) and ``workers`` worker tasks serving in threads, over one local fabric."""

    def __init__(self, workers: int, *, secret=SECRET, timeout: float = 20.0, **options):
        self.cluster = ClusterSpec({"worker": [f"local:{i}" for i in range(workers + 1)]})
        self.fabric, self.timeout = LocalFabric(), timeout
        self.errors: dict[int, BaseException] = {}
        transport = {"fabric": self.fabric, "timeout": timeout, **({"secret": secret} if secret else {})}
        self.threads = [threading.Thread(target=self._serve, args=(i, transport), daemon=True)
                        for i in range(1, workers + 1)]
        for thread in self.threads:
            thread.start()
        self.client = InGraphStrategy("local", cluster=self.cluster, task="worker:0",
                                      transport_options=dict(transport), **options)

    def _serve(self, index: int, transport: dict) -> None:
        try:
            InGraphStrategy("local", cluster=self.cluster, task=f"worker:{index}", transport_options=transport,
                            exit_after_serving=False)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.errors[index] = exc

    def close(self) -> None:
        self.client.shutdown()
        for thread in self.threads:
            thread.join(self.timeout + 5)
        assert not [t for t in self.threads if t.is_alive()], "a worker did not stop serving"

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def train(strategy, steps=STEPS, batch=BATCH, optimizer="sgd", *, seed=1):
    """Train the MLP with ``strategy``; returns (params, [PerReplica of every step])."""
    with strategy.scope():
        params, opt = model.create(optimizer, seed=seed)
    step = functools.partial(model.train_step, params, opt)
    outs = [strategy.run(step, args=(x, y)) for x, y in model.global_batches(0, steps, batch)]
    return {name: var.numpy() for name, var in params.items()}, outs, opt


def one_process(**options) -> InGraphStrategy:
    return InGraphStrategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
                           transport_options={"fabric": LocalFabric()}, **options)


# -- equivalence with one process -------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 2, 3])
def test_local_devices_match_one_process(devices, sgd_reference):
    with one_process(devices=devices) as strategy:
        params, outs, opt = train(strategy)
        assert strategy.num_replicas_in_sync == devices
    assert_params_close(params, sgd_reference)
    assert opt.iterations == STEPS
    assert outs[0].rows == {1: (25,), 2: (13, 12), 3: (9, 8, 8)}[devices]


@pytest.mark.parametrize("workers, devices", [(1, 1), (2, 1), (2, 2)])
def test_worker_tasks_match_one_process(workers, devices, sgd_reference):
    with World(workers, devices=devices) as world:
        params, outs, _ = train(world.client)
        assert world.client.num_replicas_in_sync == workers + devices
        assert world.client.replicas[-1] == f"replica {workers + devices - 1} (/job:worker/task:{workers})"
    assert not world.errors
    assert_params_close(params, sgd_reference)
    assert outs[-1].rows == {2: (13, 12), 3: (9, 8, 8), 4: (7, 6, 6, 6)}[workers + devices]


def test_the_merge_is_deterministic():
    """Replicas finish in any order (threads, other processes); the sum is taken in replica order."""
    runs = []
    for _ in range(3):
        with World(2, devices=2) as world:
            runs.append(train(world.client, optimizer="adam")[0])
    for other in runs[1:]:
        for name in model.PARAM_NAMES:
            np.testing.assert_array_equal(other[name], runs[0][name])


def test_slotted_optimizer_and_the_loss_of_the_whole_batch():
    with World(2) as world:
        params, outs, opt = train(world.client, optimizer="adam")
        losses = [world.client.reduce("mean", out) for out in outs]
    assert_params_close(params, model.reference(STEPS, BATCH, "adam"), rtol=1e-4, atol=1e-5)
    assert opt.iterations == STEPS
    # the row-weighted mean of the replicas' losses is the loss of the whole batch
    reference_params, _ = model.create("adam")
    x, y = next(model.global_batches(0, 1, BATCH))
    whole, _ = model.loss_and_grads({n: v.value for n, v in reference_params.items()}, x, y)
    assert losses[0] == pytest.approx(whole, rel=1e-6)


# -- the split rule ----------------------------------------------------------------------------------------

def test_a_batch_not_divisible_is_split_like_array_split_and_weighted_by_rows():
    """7 rows over 3 replicas get 3, 2, 2 rows: the update is the mean over the 7, not of the 3 means."""
    with World(1, devices=2) as world:
        strategy = world.client
        with strategy.scope():
            w = stratagem.Variable(np.zeros(1), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        x = np.arange(7.0)
        out = strategy.run(functools.partial(_mean_step, w, opt), args=(x,), kwargs={"scale": 1.0})
        assert out.rows == (3, 2, 2)
        assert [v.tolist() for v in out.values] == [[0.0, 1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
        assert w.numpy()[0] == pytest.approx(3.0, abs=1e-12)       # mean(0..6); mean of means: 3.33
        out = strategy.run(functools.partial(_mean_step, w, opt), args=(np.arange(2.0),), kwargs={"scale": 1.0})
        assert out.rows == (1, 1) and len(out.replicas) == 2          # the third replica got no rows
        assert w.numpy()[0] == pytest.approx(3.5, abs=1e-12)


def _mean_step(w, opt, x, scale):
    opt.apply_gradients([(np.array([-scale * x.mean()]), w)])         # d/dw of -w * mean(x)
    return x


def test_arguments_without_rows_reach_every_replica_whole():
    with one_process(devices=2) as strategy:
        out = strategy.run(lambda lr, table, name=None: (lr, table.shape, name),
                           args=(0.5, np.zeros(())), kwargs={"name": "x"})
        assert out.values == ((0.5, (), "x"), (0.5, (), "x")) and out.rows is None
        with pytest.raises(ConfigurationError, match=r"different numbers of rows \(args\[0\] has 3, args\[1\] has 4\)"):
            strategy.run(lambda a, b: None, args=(np.zeros(3), np.zeros(4)))
        with pytest.raises(ConfigurationError, match="has no rows"):
            strategy.run(lambda a: None, args=(np.zeros((0, 2)),))


# -- values travel only when they changed -----------------------------------------------------------------

def test_values_are_not_resent_when_unchanged():
    with World(2) as world:
        strategy = world.client
        with strategy.scope():
            w = stratagem.Variable(np.zeros(4, np.float32), name="w")                               # 16 bytes
            frozen = stratagem.Variable(np.ones((1000, 4), np.float32), name="frozen", trainable=False)  # 16000
            opt = stratagem.optimizers.SGD(learning_rate=0.1)
        sent = []
        original = strategy.transport.send_async

        def counting(dst, tag, msg, *args, **kwargs):
            sent[-1] += msg.nbytes
            return original(dst, tag, msg, *args, **kwargs)

        strategy.transport.send_async = counting
        x = np.ones((30, 4), np.float32)                       # 10 rows per replica: 160 bytes each
        train_step = functools.partial(_frozen_step, w, frozen, opt)
        eval_step = functools.partial(_eval_step, w, frozen)

        def step(fn):
            sent.append(0)
            return strategy.run(fn, args=(x,))

        def bytes_of(fn):                                      # the serialized step, sent once per replica
            return 2 * len(strategy._client.sender.describe(fn)[1])

        shards = 2 * 160
        step(train_step)
        assert sent[-1] == 2 * (16 + 16000) + shards + bytes_of(train_step)
        step(train_step)
        assert sent[-1] == 2 * 16 + shards                     # only w changed
        step(eval_step)
        assert sent[-1] == 2 * 16 + shards + bytes_of(eval_step)
        out = step(eval_step)
        assert sent[-1] == shards                              # nothing changed: no values at all
        assert out.values == pytest.approx((4000.0 - 10 * 4 * 0.2,) * 3)    # w is -0.2 after two steps
        frozen.assign(np.full((1000, 4), 2.0, np.float32))
        step(eval_step)
        assert sent[-1] == 2 * 16000 + shards                  # an assign is seen
        _ = frozen.value                                       # a read on the client may write through it
        step(eval_step)
        assert sent[-1] == 2 * 16000 + shards
        assert strategy.fingerprint()                          # reads quietly: nothing to resend
        step(eval_step)
        assert sent[-1] == shards


def _frozen_step(w, frozen, opt, x):
    opt.apply_gradients([(x.mean(axis=0), w)])
    return float(frozen.value.sum())


def _eval_step(w, frozen, x):
    return float(frozen.value.sum() + (x @ w.value).sum())


# -- failures --------------------------------------------------------------------------------------------------

def test_an_error_in_a_replica_step_names_it_with_its_traceback():
    with World(2) as world:
        with pytest.raises(ReplicaError) as info:
            world.client.run(functools.partial(_fail_on, world.client, "worker:2"), args=(np.zeros((6, 2)),))
        assert info.value.replica == "replica 2 (/job:worker/task:2)" and info.value.error_type == "ValueError"
        assert "the step function failed on replica 2 (/job:worker/task:2): ValueError: bad rows" in str(info.value)
        assert "in _fail_on" in info.value.remote_traceback
        out = world.client.run(functools.partial(_fail_on, world.client, "nobody"), args=(np.zeros((6, 2)),))
        assert out.values == (2, 2, 2)                                  # still usable


def _fail_on(strategy, task, x):
    # ``strategy`` reaches a replica as a reference: there it is the replica's own
    if strategy.task.short == task:
        raise ValueError("bad rows")
    return len(x)


def test_replicas_must_make_the_same_apply_calls():
    with World(1) as world:
        with world.client.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
            b = stratagem.Variable(np.zeros(2), name="b")
            opt = stratagem.optimizers.SGD(0.1)
        with pytest.raises(ConfigurationError, match=r"replica 0 .* passed gradients for \[\['b', 'w'\]\], "
                                                      r"replica 1 \(/job:worker/task:1\) for \[\['w'\]\]"):
            world.client.run(functools.partial(_skip_b_remotely, world.client, w, b, opt), args=(np.zeros((4, 2)),))


def _skip_b_remotely(strategy, w, b, opt, x):
    remote = not strategy.is_chief
    opt.apply_gradients([(np.ones(2), w)] + ([] if remote else [(np.ones(2), b)]))


def test_a_replica_lost_in_threads_raises_naming_it():
    with World(2, timeout=10) as world:
        with world.client.scope():
            params, opt = model.create("sgd")
        step = functools.partial(model.train_step, params, opt)
        batches = list(model.global_batches(0, STEPS, BATCH))
        world.client.run(step, args=batches[0])
        world.fabric.leave(TaskId("worker", 2), "/job:worker/task:2 died")       # as a crash does
        with pytest.raises(PeerLostError) as info:
            world.client.run(step, args=batches[1])
        assert info.value.task == TaskId("worker", 2)
        assert "replica 2 (/job:worker/task:2) died during step 2" in str(info.value)
        assert "on_replica_failure='continue'" in str(info.value)


def test_continue_leaves_a_lost_replica_out_and_stays_equivalent(sgd_reference):
    with World(2, on_replica_failure="continue") as world:
        strategy = world.client
        with strategy.scope():
            params, opt = model.create("sgd")
        step = functools.partial(model.train_step, params, opt)
        rows = []
        for i, (x, y) in enumerate(model.global_batches(0, STEPS, BATCH)):
            if i == 4:
                world.fabric.leave(TaskId("worker", 1), "/job:worker/task:1 died")
            rows.append(strategy.run(step, args=(x, y)).rows)
        assert rows[3] == (9, 8, 8) and rows[4] == (13, 12)             # re-split over the two left
        assert strategy.replicas == ["replica 0 (cpu:0 of /job:worker/task:0)", "replica 2 (/job:worker/task:2)"]
        assert list(strategy.lost_replicas) == ["replica 1 (/job:worker/task:1)"]
        assert_params_close({n: v.numpy() for n, v in params.items()}, sgd_reference)


def test_a_silent_replica_times_out_naming_it():
    with World(2, timeout=0.5) as world:
        step = functools.partial(_sleep_on, world.client, "worker:1", 1.5)
        started = time.monotonic()
        with pytest.raises(stratagem.TransportTimeout, match=r"replica 1 \(/job:worker/task:1\) did not answer"):
            world.client.run(step, args=(np.zeros((6, 2)),))
        assert time.monotonic() - started < 1.4
    with World(2, timeout=0.5, on_replica_failure="continue") as world:
        out = world.client.run(functools.partial(_sleep_on, world.client, "worker:1", 1.5), args=(np.zeros((6, 2)),))
        assert out.rows == (3, 3) and list(world.client.lost_replicas) == ["replica 1 (/job:worker/task:1)"]


def _sleep_on(strategy, task, seconds, x):
    if strategy.task.short == task:
        time.sleep(seconds)
    return len(x)


# -- how step functions travel ---------------------------------------------------------------------------------

def test_serialized_steps_need_a_secret_and_the_error_says_how():
    with World(1, secret=None) as world:
        with world.client.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
        with pytest.raises(ConfigurationError) as info:
            world.client.run(lambda x: float(w.value.sum()), args=(np.zeros((4, 2)),))
        message = str(info.value)
        assert "only serialized (cloudpickle)" in message and "STRATAGEM_SECRET" in message
        assert "stratagem launch" in message and "top level of your script" in message
        with one_process() as alone:                                   # local replicas need nothing
            assert alone.run(lambda x: 1, args=(np.zeros(2),)).values == (1,)


def test_a_replica_never_unpickles_from_an_unauthenticated_client():
    """Forged steps sent to a worker of a cluster without a secret: one carrying a pickle, one naming a
    library function, one with malformed arguments. Each is refused, and the worker keeps serving."""
    cluster = ClusterSpec({"worker": ["local:0", "local:1"]})
    fabric = LocalFabric()
    errors = []

    def serve():
        try:
            InGraphStrategy("local", cluster=cluster, task="worker:1", transport_options={"fabric": fabric,
                            "timeout": 10}, exit_after_serving=False)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with LocalTransport(cluster, "worker:0", fabric=fabric, timeout=10) as client:
        client.send(TaskId("worker", 1), REQUEST, Message({"op": "hello", "protocol": 1, "script": None}))
        assert client.recv(TaskId("worker", 1), REPLY).meta["authenticated"] is False
        payload = np.frombuffer(b"cos\nsystem\n(S'echo pwned'\ntR.", np.uint8)
        client.send(TaskId("worker", 1), REQUEST, Message(
            {"op": "step", "step": 1, "values": [], "fn": {"kind": "pickle", "sha": "0" * 64}, "fn_bytes": True,
             "args": {"d": {"args": {"t": []}, "kwargs": {"d": {}}}}}, [payload]))
        reply = client.recv(TaskId("worker", 1), REPLY).meta
        assert reply["op"] == "error" and reply["where"] == "setup"
        assert "not authenticated" in reply["message"] and "unpickles nothing" in reply["message"]
        client.send(TaskId("worker", 1), REQUEST, Message({"op": "step", "step": 2, "values": [],
                    "fn": {"kind": "name", "module": "subprocess", "qualname": "run"}, "fn_bytes": False,
                    "args": {"d": {"args": {"t": ["true"]}, "kwargs": {"d": {}}}}}))
        reply = client.recv(TaskId("worker", 1), REPLY).meta
        assert reply["op"] == "error" and "only in your own code" in reply["message"]
        client.send(TaskId("worker", 1), REQUEST, Message({"op": "step", "step": 3, "values": [],
                    "fn": by_name(model.train_step), "fn_bytes": False,          # a real step, forged arguments
                    "args": {"d": {"args": {"t": [{"a": 99}]}, "kwargs": {"d": {}}}}}))
        reply = client.recv(TaskId("worker", 1), REPLY).meta
        assert reply["op"] == "error" and reply["type"] == "ProtocolError"
        assert "malformed value: args[0] refers to buffer 99, but 0 came with it" in reply["message"]
        client.send(TaskId("worker", 1), REQUEST, Message({"op": "shutdown"}))
        assert client.recv(TaskId("worker", 1), REPLY).meta["op"] == "bye"
    thread.join(10)
    assert not thread.is_alive() and not errors


def test_a_torch_module_viewing_the_variables_travels_by_reference():
    """A serialized step holding a torch module whose parameters are views of the variables: on the
    replica they must view the replica's values (updated every step), not copies frozen when sent."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    sys.path.insert(0, str(ROOT / "examples"))
    import mlp_torch

    torch.set_num_threads(1)

    def train_with(strategy):
        module = mlp_torch.build_module((64, 16, 10), seed=0)
        with strategy.scope():
            pairs = mlp_torch.mirror(module)
            opt = stratagem.optimizers.SGD(learning_rate=0.2)
        step = functools.partial(mlp_torch.train_step, module, pairs, opt)
        for x, y in model.global_batches(0, 8, BATCH):
            strategy.run(step, args=(x, y))
        return {var.name: var.numpy() for _, var in pairs}

    with one_process() as alone:
        expected = train_with(alone)
    with World(2) as world:
        got = train_with(world.client)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_functions_are_named_only_in_the_users_code():
    import subprocess as library

    assert "not in your own code" in name_problem(library.run)           # the standard library
    assert "not in your own code" in name_problem(np.mean)               # an installed package
    assert name_problem(model.train_step) is None
    assert "lambda" in name_problem(lambda: None)
    assert "functools.partial" in name_problem(functools.partial(model.train_step))


def test_functions_name_refuses_what_cannot_be_named():
    with World(1, functions="name") as world:
        with pytest.raises(ConfigurationError, match="cannot be found by name on the replicas"):
            world.client.run(lambda x: None, args=(np.zeros(2),))


# -- the training API around run --------------------------------------------------------------------------------

def test_reduce_distribute_dataset_and_save_restore(tmp_path):
    with World(1) as world:
        strategy = world.client
        with strategy.scope():
            w = stratagem.Variable(np.arange(3.0), name="w")
            opt = stratagem.optimizers.Adam(0.1)
        batches = [np.ones((5, 3)), np.ones((4, 3))]
        assert [b.shape for b in strategy.distribute_dataset(batches)] == [(5, 3), (4, 3)]   # whole
        step = functools.partial(_sum_step, w, opt)
        out = strategy.run(step, args=(batches[0],))
        assert strategy.reduce("sum", out) == pytest.approx(float(out.values[0] + out.values[1]))
        assert strategy.reduce("max", out) == max(out.values)
        assert strategy.reduce("mean", 4.0) == 4.0
        path = strategy.save(str(tmp_path))
        saved = w.numpy()
        strategy.run(step, args=(batches[1],))
        assert not np.array_equal(w.numpy(), saved)
        assert strategy.restore(str(tmp_path)) == 1 and path.endswith("ckpt-00000001.npz")
        np.testing.assert_array_equal(w.numpy(), saved)
        out = strategy.run(functools.partial(_read, w), args=(np.ones((2, 1)),))
        np.testing.assert_array_equal(out.values[1], saved)              # the replica got the restored values
        assert opt.iterations == 1


def _sum_step(w, opt, x):
    opt.apply_gradients([(x.mean(axis=0), w)])
    return float(w.value.sum())


def _read(w, x):
    return w.value.copy()


def test_a_step_may_not_assign_variables():
    with one_process() as strategy:
        with strategy.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
        with pytest.raises(ConfigurationError, match="assigned inside a step"):
            strategy.run(lambda x: w.assign(x[0]), args=(np.ones((1, 2)),))


def test_options_registration_and_roles():
    assert PluginManager(autoload=False).strategy_class("in_graph") is InGraphStrategy
    common = dict(cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
                  transport_options={"fabric": LocalFabric()})
    for bad, message in [({"devices": 0}, "devices must be >= 1"), ({"devices": ["tpu:0"]}, "unknown device 'tpu:0'"),
                         ({"on_replica_failure": "ignore"}, "on_replica_failure must be"),
                         ({"functions": "json"}, "functions must be one of"), ({"timeout": 0}, "timeout must be")]:
        with pytest.raises(ConfigurationError, match=message):
            InGraphStrategy("local", **bad, **common)
    with pytest.raises(ConfigurationError, match="is not a replica: the in_graph strategy runs on"):
        InGraphStrategy("local", cluster=ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), task="ps:0",
                        transport_options={"fabric": LocalFabric()})
    with stratagem.strategy("in_graph", transport="local", **common) as strategy:
        assert strategy.is_chief and strategy.num_replicas_in_sync == 1
        assert isinstance(strategy.run(lambda: 3), PerReplica)


# -- real processes over zmq --------------------------------------------------------------------------------------

TRAIN = SCRIPTS / "in_graph_train.py"


def run_tasks(tmp_path, workers: int, *args, secret: str | None = None, timeout: float = 60,
              script: Path = TRAIN) -> dict:
    """Run ``script`` as ``workers`` tasks of one cluster (worker:0 is the client); returns
    ``{"codes": [...], "errs": [...], "seconds": [...], "out": dir}`` once every task has exited."""
    out = tmp_path / "out"
    ports = free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(THREADS, PYTHONUNBUFFERED="1")
    if secret:
        env["STRATAGEM_SECRET"] = secret
    procs = []
    try:
        for i in range(workers):
            task_env = dict(env, STRATAGEM_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker",
                                                                                           "index": i}}))
            procs.append(subprocess.Popen([sys.executable, str(script), "--out", str(out), *map(str, args)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=task_env))
        started, errs, seconds = time.monotonic(), [], []
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
            errs.append(err)
            seconds.append(time.monotonic() - started)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return {"codes": [p.returncode for p in procs], "errs": errs, "seconds": seconds, "out": out}


def read_client(out: Path):
    with np.load(out / "params.npz", allow_pickle=False) as f:
        params = {name: f[name] for name in f.files}
    return params, json.loads((out / "record.json").read_text())


@pytest.mark.parametrize("workers, mode, secret", [(2, "auto", None), (3, "auto", None), (3, "pickle", SECRET)],
                         ids=["2-by-name", "3-by-name", "3-serialized"])
def test_processes_match_one_process(tmp_path, workers, mode, secret, sgd_reference):
    job = run_tasks(tmp_path, workers, "--steps", STEPS, "--batch", BATCH, "--functions", mode, secret=secret)
    assert job["codes"] == [0] * workers, job["errs"]
    params, record = read_client(job["out"])
    assert_params_close(params, sgd_reference)
    assert record["rows"][0] == {2: [13, 12], 3: [9, 8, 8]}[workers] and record["iterations"] == STEPS
    assert record["replicas"][1:] == [f"replica {i} (/job:worker/task:{i})" for i in range(1, workers)]
    assert record["losses"][-1] < record["losses"][0]


def test_processes_replica_death_raises_naming_it(tmp_path):
    timeout = 10.0
    job = run_tasks(tmp_path, 3, "--steps", STEPS, "--die-at", 3, "--die-task", "worker:2",
                    "--timeout", timeout, "--peer-timeout", 2)
    assert job["codes"] == [3, 0, -9], job["errs"]
    error = json.loads((job["out"] / "error.json").read_text())
    assert error["type"] == "PeerLostError" and error["task"] == "/job:worker/task:2", error
    assert error["step"] == 3 and error["seconds"] < timeout
    assert "replica 2 (/job:worker/task:2) died" in error["message"]


def test_processes_continue_without_a_dead_replica(tmp_path, sgd_reference):
    job = run_tasks(tmp_path, 3, "--steps", STEPS, "--die-at", 3, "--die-task", "worker:2", "--on-failure",
                    "continue", "--timeout", 10, "--peer-timeout", 2)
    assert job["codes"] == [0, 0, -9], job["errs"]
    params, record = read_client(job["out"])
    assert record["rows"][2] == [9, 8, 8] and record["rows"][3:] == [[13, 12]] * (STEPS - 3)
    assert list(record["lost"]) == ["replica 2 (/job:worker/task:2)"]
    assert "leaving out replica 2 (/job:worker/task:2)" in job["errs"][0]
    assert_params_close(params, sgd_reference)


def test_processes_workers_exit_when_the_client_crashes_or_forgets_shutdown(tmp_path):
    job = run_tasks(tmp_path / "crash", 3, "--steps", STEPS, "--crash-client-at", 2, "--peer-timeout", 2)
    assert job["codes"] == [-9, 1, 1], job["errs"]
    for err in job["errs"][1:]:
        assert "stopped serving: lost peer /job:worker/task:0" in err
    job = run_tasks(tmp_path / "forgot", 2, "--steps", 2, "--no-shutdown")
    assert job["codes"] == [0, 0], job["errs"]


def test_processes_unguarded_script_gets_a_clear_error(tmp_path):
    job = run_tasks(tmp_path, 2, secret=None, script=SCRIPTS / "in_graph_unguarded.py", timeout=30)
    # The client's script ended by that exception: its replica stops too, naming the client (the
    # client told it so before leaving).
    assert job["codes"] == [1, 1], job["errs"]
    assert "stopped serving: the job failed because the in_graph client /job:worker/task:0 failed" in job["errs"][1]
    assert "strategy.run() was called while a replica (/job:worker/task:1) imported your script" in job["errs"][0]
    assert 'if __name__ == "__main__":' in job["errs"][0]


# -- the example ---------------------------------------------------------------------------------------------------

def run_example(*args: str, workers: int | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(THREADS)
    command = [sys.executable, str(ROOT / "examples" / "mlp_in_graph.py"), *args]
    if workers is not None:
        command = [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", "150",
                   "--", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def figures(stdout: str) -> list[float]:
    """The accuracies and losses the client printed, in order."""
    return [float(v) for v in re.findall(r"(?:test accuracy|loss) (\d+\.\d+)", stdout)]


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed")
@pytest.mark.timeout(240)
def test_example_under_launch_trains_as_alone():
    launched = run_example("--epochs", "3", workers=3)
    alone = run_example("--epochs", "3", "--devices", "2", workers=None)
    assert "3 replica(s) over zmq" in launched and "2 replica(s) over zmq" in alone
    assert not [line for line in launched.splitlines() if line.startswith("[worker:") and
                not line.startswith("[worker:0]")], "a worker task printed"
    final = re.search(r"final test accuracy (\d\.\d+)", launched)
    assert final and float(final.group(1)) > 0.9, launched
    # the same updates whatever the replicas: the same figures, to float rounding
    assert len(figures(launched)) == len(figures(alone)) > 5
    np.testing.assert_allclose(figures(launched), figures(alone), atol=3e-3)
