"""The ``mirrored`` strategy and the Strategy base's training API (scope, variables, distribute_dataset,
save/restore).

Two kinds of test:

- real processes and sockets: ``stratagem.launch.launcher.launch`` runs tests/scripts/mirrored_train.py
  once per replica over ``zmq`` (equivalence with one process, checkpoint across two jobs, a replica
  dying mid-step). The launcher reaps every process it starts, whatever happens.
- replicas as threads of this process over the ``local`` transport, for the broad matrix (fast).

The model is the numpy MLP of tests/scripts/mirrored_model.py; ``model.reference`` trains it in one
process, on whole global batches, without any strategy.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, PeerLostError, StratagemError, TaskId
from stratagem.strategies import base as strategy_module
from stratagem.training.checkpoint import CheckpointNotFoundError
from stratagem.launch.launcher import launch
from stratagem.training.sharding import shard_batch
from stratagem.strategies.base import Strategy
from stratagem.plugins.manager import PluginManager
from stratagem.strategies.mirrored import strategy as mirrored_module
from stratagem.strategies.mirrored.strategy import DEFAULT_BUCKET_BYTES, MirroredStrategy
from stratagem.transports.local import LocalFabric, LocalTransport

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402  (tests/scripts is not a package)

TRAIN = [sys.executable, str(SCRIPTS / "mirrored_train.py")]
STEPS, BATCH = 20, 25            # 25 rows: not divisible by 2 nor by 3
TOLERANCE = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.timeout(60)


# -- harness: replicas as threads over the local transport ------------------------------------------

def local_cluster(n: int) -> ClusterSpec:
    return ClusterSpec({"worker": [f"local:{i}" for i in range(n)]})


def run_replicas(n: int, body, *, timeout: float = 20.0, **options):
    """Run ``body(strategy, rank)`` on ``n`` mirrored replicas, each a thread with its own strategy
    over one local fabric. Returns ``(results, errors)`` by rank. A replica that fails shuts its
    strategy down at once, so its peers see it leave instead of waiting for their timeout."""
    cluster, fabric = local_cluster(n), LocalFabric()
    strategies = [MirroredStrategy("local", cluster=cluster, task=task, transport_options={"fabric": fabric,
                                   "timeout": timeout}, **options) for task in cluster.replicas()]
    results, errors = [None] * n, [None] * n

    def target(rank: int) -> None:
        try:
            results[rank] = body(strategies[rank], rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc
            strategies[rank].shutdown()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        if stuck:
            pytest.fail(f"replicas {stuck} did not finish within {timeout + 5:g} s")
    finally:
        for s in strategies:
            s.shutdown()
    return results, errors


def ok(results_errors):
    results, errors = results_errors
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"replica {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results


def trainer(steps=STEPS, batch=BATCH, optimizer="sgd", *, start=0, ckpt=None, save_at=None, restore=False):
    """A replica body: the MLP trained on its shards; returns (params, fingerprints after every step)."""
    def body(strategy, rank):
        with strategy.scope():
            params, opt = model.create(optimizer, seed=1 if strategy.is_chief else 100 + rank)
        first = start
        if restore:  # only the chief reads the file: the others may pass a path that does not exist
            first = strategy.restore(ckpt if strategy.is_chief else "/nonexistent/elsewhere")
        prints = [strategy.fingerprint()]
        for step, (x, y) in enumerate(strategy.distribute_dataset(model.global_batches(first, steps, batch)),
                                      start=first):
            model.train_step(params, opt, x, y)
            prints.append(strategy.fingerprint())
            if save_at is not None and step + 1 == save_at:
                strategy.save(ckpt)
        return {name: var.numpy() for name, var in params.items()}, prints, opt.iterations
    return body


def assert_replicas_identical(results):
    prints = [r[1] for r in results]
    assert all(p == prints[0] for p in prints), "replicas diverged"
    for params, _, _ in results[1:]:
        for name in params:
            np.testing.assert_array_equal(params[name], results[0][0][name])


def assert_params_close(got, expected, **tolerance):
    for name in model.PARAM_NAMES:
        np.testing.assert_allclose(got[name], expected[name], err_msg=name, **(tolerance or TOLERANCE))


@pytest.fixture(scope="module")
def sgd_reference():
    return model.reference(STEPS, BATCH, "sgd")


# -- equivalence with one process ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_local_replicas_match_one_process_and_stay_identical(n, sgd_reference):
    results = ok(run_replicas(n, trainer()))
    assert_replicas_identical(results)              # after every step (fingerprints), and at the end
    assert_params_close(results[0][0], sgd_reference)
    assert results[0][2] == STEPS


@pytest.mark.parametrize("optimizer, n", [("adam", 3), ("adagrad", 2)])
def test_local_replicas_with_slotted_optimizers(optimizer, n):
    results = ok(run_replicas(n, trainer(optimizer=optimizer)))
    assert_replicas_identical(results)
    assert_params_close(results[0][0], model.reference(STEPS, BATCH, optimizer), rtol=1e-4, atol=1e-5)


def test_chief_initial_values_win():
    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.full(3, float(rank), np.float32), name="w")
            with strategy.scope():  # nested: synced once, when the outermost block ends
                b = stratagem.Variable(np.full(2, 10.0 + rank), name="b")
            before_end = b.numpy().copy()
        return w.numpy(), b.numpy(), before_end
    results = ok(run_replicas(3, body))
    for w, b, before_end in results:
        np.testing.assert_array_equal(w, np.zeros(3, np.float32))
        np.testing.assert_array_equal(b, np.full(2, 10.0))
    assert results[2][2].tolist() == [12.0, 12.0]


def test_weighted_average_with_a_remainder_is_the_whole_batch_mean():
    """7 rows over 3 replicas (3, 2, 2 rows): the update is the mean over all 7, not of the 3 means."""
    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(1), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        for (x,) in strategy.distribute_dataset([(np.arange(7.0),)]):
            opt.apply_gradients([(np.array([-x.mean()]), w)])     # d/dw of -w * mean(x)
            rows = len(x)
        return w.numpy()[0], rows
    results = ok(run_replicas(3, body))
    assert [rows for _, rows in results] == [3, 2, 2]
    for value, _ in results:
        assert value == pytest.approx(3.0, abs=1e-12)               # mean(0..6); 1/3 of the means: 3.33


@pytest.mark.parametrize("rows, size", [(5, 2), (7, 3), (1, 2), (6, 3)])
def test_reduce_mean_of_shard_means_is_the_whole_batch_mean(rows, size):
    """reduce("mean", a replica's mean over its rows) weighs each replica by its rows, as the gradient
    average does: 5 rows over 2 replicas (3 and 2) give the mean of the 5, not the mean of the 2 means.
    An empty shard (1 row over 2) counts for nothing, even though its mean is NaN."""
    x = np.arange(rows, dtype=np.float64) ** 2 + 1.0

    def body(strategy, rank):
        for (shard,) in strategy.distribute_dataset([(x,)]):
            with np.errstate(invalid="ignore"), pytest.warns(RuntimeWarning) if len(shard) == 0 \
                    else contextlib.nullcontext():
                mean = shard.mean()                          # NaN for an empty shard
            return (strategy.reduce("mean", mean), strategy.reduce("mean", np.array([mean, 2 * mean])),
                    strategy.reduce("sum", float(len(shard))))
    results = ok(run_replicas(size, body))
    whole = x.mean()                                       # one process on the whole batch
    for scalar, array, total in results:
        assert isinstance(scalar, float) and scalar == pytest.approx(whole, rel=1e-12)
        np.testing.assert_allclose(array, [whole, 2 * whole], rtol=1e-12)
        assert total == rows                               # other ops are untouched
    assert len({r[0] for r in results}) == 1               # the same bits on every replica
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plain = np.mean([s.mean() for s in np.array_split(x, size)])
    if rows % size:                                        # uneven: the plain mean of the means is not it
        assert not np.isclose(plain, whole)


def test_reduce_mean_without_distribute_dataset_counts_replicas_alike():
    results = ok(run_replicas(3, lambda strategy, rank: strategy.reduce("mean", float(rank))))
    assert results == [1.0, 1.0, 1.0]


def test_an_empty_shard_contributes_nothing(sgd_reference):
    """A global batch of 2 rows over 3 replicas: the last replica's shard is empty."""
    def body(strategy, rank):
        with strategy.scope():
            params, opt = model.create("sgd")
        sizes = []
        for x, y in strategy.distribute_dataset(model.global_batches(0, 5, 2)):
            sizes.append(len(x))
            _, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
            if len(x) == 0:
                grads = {name: np.full_like(g, np.nan) for name, g in grads.items()}  # e.g. a mean of nothing
            opt.apply_gradients([(grads[name], params[name]) for name in model.PARAM_NAMES])
        return {name: var.numpy() for name, var in params.items()}, sizes
    results = ok(run_replicas(3, body))
    assert [r[1][0] for r in results] == [1, 1, 0]
    assert_params_close(results[2][0], model.reference(5, 2, "sgd"))


# -- distribute_dataset ------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, size, expected", [(7, 3, [3, 2, 2]), (6, 3, [2, 2, 2]), (2, 3, [1, 1, 0]),
                                                  (25, 2, [13, 12]), (0, 2, [0, 0])])
def test_shard_rows_follow_array_split(rows, size, expected):
    x = np.arange(rows * 2).reshape(rows, 2)
    shards = [shard_batch(x, rank, size)[0] for rank in range(size)]
    assert [len(s) for s in shards] == expected
    for mine, reference in zip(shards, np.array_split(x, size)):
        np.testing.assert_array_equal(mine, reference)
    assert all(np.shares_memory(s, x) for s in shards if s.size)    # views, not copies


def test_shard_batch_structures_and_errors():
    x, y = np.arange(5), np.arange(5) * 10
    assert isinstance(shard_batch((x, y), 0, 2)[0], tuple)
    assert isinstance(shard_batch([x, y], 0, 2)[0], list)
    shard, rows, total = shard_batch({"x": x, "y": y}, 1, 2)
    assert shard["y"].tolist() == [30, 40] and (rows, total) == (2, 5)
    with pytest.raises(ConfigurationError, match=r"different numbers of rows \(5, 4\)"):
        shard_batch((x, y[:4]), 0, 2, what="global batch 3")
    with pytest.raises(ConfigurationError, match="holds a int without rows"):
        shard_batch((x, 3), 0, 2)
    with pytest.raises(ConfigurationError, match="empty tuple"):
        shard_batch((), 0, 2)


def test_distribute_dataset_records_shares_and_checks_input():
    def body(strategy, rank):
        shares = []
        for _ in strategy.distribute_dataset([np.zeros((7, 2)), np.zeros((4, 2))]):
            shares.append(strategy.gradient_weight)
        with pytest.raises(ConfigurationError, match="needs an iterable of global batches"):
            strategy.distribute_dataset(42)
        return shares
    results = ok(run_replicas(3, body))
    assert results == [[3 / 7, 2 / 4], [2 / 7, 1 / 4], [2 / 7, 1 / 4]]


# -- buckets, compression -----------------------------------------------------------------------------

def spy_allreduce(strategy):
    """Record every all-reduce of the strategy's communicator: (dtype, size, id of the out buffer)."""
    comm = strategy.communicator
    calls = []
    original = comm.allreduce

    def allreduce(x, op="sum", algorithm="auto", out=None):
        calls.append((np.dtype(x.dtype).name, int(x.size), id(out), op))
        return original(x, op=op, algorithm=algorithm, out=out)
    comm.allreduce = allreduce
    return calls


def fifty_variables(steps=3, dtypes=("float32",)):
    def body(strategy, rank):
        with strategy.scope():
            variables = [stratagem.Variable(np.zeros(40, dtypes[i % len(dtypes)]), name=f"v{i:02d}")
                         for i in range(50)]
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        calls = spy_allreduce(strategy)
        per_step = []
        for step in range(steps):
            before = len(calls)
            opt.apply_gradients([(np.full(40, rank + step + i, v.dtype), v) for i, v in enumerate(variables)])
            per_step.append(calls[before:])
        return per_step, [v.numpy() for v in variables]
    return body


def test_fifty_small_gradients_are_fused_into_one_allreduce_per_step():
    results = ok(run_replicas(2, fifty_variables()))
    for per_step, values in results:
        assert [len(calls) for calls in per_step] == [1, 1, 1]
        assert per_step[0][0][:2] == ("float32", 50 * 40) and per_step[0][0][3] == "sum"
        assert len({calls[0][2] for calls in per_step}) == 1          # the same out buffer every step
        # every step subtracts the mean gradient over the 2 replicas: sum over steps of (0.5 + step + i)
        for i, v in enumerate(values):
            np.testing.assert_array_equal(v, np.full(40, -(1.5 + 3 + 3 * i), np.float32))


def test_buckets_respect_bucket_bytes_and_dtypes():
    # 40 float32 = 160 bytes per gradient; 1000-byte buckets hold 6 -> 25 float32 gradients: 5 buckets
    results = ok(run_replicas(2, fifty_variables(steps=1, dtypes=("float32", "float64")), bucket_bytes=1000))
    for per_step, _ in results:
        calls = per_step[0]
        by_dtype = {d: sorted(size for dt, size, _, _ in calls if dt == d) for d in ("float32", "float64")}
        assert by_dtype["float32"] == [40, 240, 240, 240, 240]      # 25 gradients of 160 bytes
        assert by_dtype["float64"] == [40, 120, 120, 120, 120, 120, 120, 120, 120]  # 320 bytes: 3 each
    # a gradient larger than a bucket gets a bucket of its own
    def body(strategy, rank):
        with strategy.scope():
            big, small = stratagem.Variable(np.zeros(1000), name="big"), stratagem.Variable(np.zeros(2), name="small")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        calls = spy_allreduce(strategy)
        opt.apply_gradients([(np.ones(1000), big), (np.ones(2), small)])
        return sorted(size for _, size, _, _ in calls)
    assert ok(run_replicas(2, body, bucket_bytes=64)) == [[2, 1000], [2, 1000]]


def test_compressed_gradients_of_a_bucket_share_one_collective_per_payload_dtype():
    def body(strategy, rank):
        with strategy.scope():
            variables = [stratagem.Variable(np.zeros((10, 8), np.float32), name=f"v{i:02d}") for i in range(20)]
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        gathers = []
        comm = strategy.communicator
        original = comm.allgather
        comm.allgather = lambda x: gathers.append((np.dtype(x.dtype).name, int(x.size))) or original(x)
        opt.apply_gradients([(np.full((10, 8), rank + i, np.float32), v) for i, v in enumerate(variables)])
        return sorted(gathers), strategy.fingerprint()
    results = ok(run_replicas(2, body, compression="topk", compression_options={"ratio": 0.05}))
    # 20 gradients x 4 entries, one gather per payload dtype (besides the first step's checks, in bytes)
    assert [g for g in results[0][0] if g[0] in ("float32", "int32")] == [("float32", 80), ("int32", 80)]
    assert results[0][1] == results[1][1]


def test_fp16_compression_keeps_replicas_identical_and_close(sgd_reference):
    def body(strategy, rank):
        reduced = spy_allreduce(strategy)
        gathered = []
        comm = strategy.communicator
        original = comm.allgather
        comm.allgather = lambda x: gathered.append(np.dtype(x.dtype).name) or original(x)
        return trainer()(strategy, rank), (reduced, gathered)
    results = ok(run_replicas(3, body, compression="fp16"))
    for _, (reduced, gathered) in results:
        # on the host the float16 payloads are all-gathered (then summed widened): no float goes uncompressed
        assert {d for d in gathered if d.startswith("float")} == {"float16"}
        assert not [call for call in reduced if call[0].startswith("float")]
    trained = [r for r, _ in results]
    assert_replicas_identical(trained)
    assert_params_close(trained[0][0], sgd_reference, rtol=0, atol=5e-3)
    assert any(not np.array_equal(trained[0][0][n], sgd_reference[n]) for n in model.PARAM_NAMES)


# -- options and the registry ----------------------------------------------------------------------------

def test_unknown_and_bad_options_are_rejected_before_the_transport_starts():
    fabric = LocalFabric()
    common = dict(cluster=local_cluster(1), task="worker:0", transport_options={"fabric": fabric})
    with pytest.raises(ConfigurationError) as info:
        MirroredStrategy("local", bucket_byte=1024, **common)
    assert "does not accept option(s) 'bucket_byte' (did you mean 'bucket_bytes'?)" in str(info.value)
    assert ("bucket_bytes, chunk_bytes, cluster, commit_every, compression, compression_options, gradient_reduction, "
            "on_failure, plugins, small_bytes, task, timeout") in str(info.value)
    for bad, message in [({"compression": "int8"}, "compression='int8': unknown compressor 'int8'; known: bf16, "
                                                   "fp16, powersgd, topk"),
                         ({"compression": "topk", "compression_options": {"rank": 2}},
                          r"compressor 'topk' does not accept option\(s\) 'rank'"),
                         ({"compression": 16}, "compression must be None, a compressor's name"),
                         ({"bucket_bytes": 0}, "bucket_bytes must be an integer >= 1"),
                         ({"chunk_bytes": "1M"}, "chunk_bytes must be an integer >= 1"),
                         ({"timeout": -1}, "timeout must be a number of seconds > 0")]:
        with pytest.raises(ConfigurationError, match=message):
            MirroredStrategy("local", **bad, **common)
    assert fabric.gone(TaskId("worker", 0)) is None             # no transport was started (and closed)
    LocalTransport(local_cluster(1), "worker:0", fabric=fabric).start()   # nor left running


def test_registered_as_a_builtin_and_created_by_name():
    manager = PluginManager(autoload=False)
    assert manager.strategy_class("mirrored") is MirroredStrategy
    assert MirroredStrategy.option_defaults()["bucket_bytes"] == DEFAULT_BUCKET_BYTES == 25 << 20
    with stratagem.strategy("mirrored", transport="local", cluster=local_cluster(1), task="worker:0",
                            transport_options={"fabric": LocalFabric()}, compression="fp16") as strategy:
        assert isinstance(strategy, MirroredStrategy) and strategy.config["compression"] == "fp16"
        with strategy.scope():
            w = stratagem.Variable(np.ones(2), name="w")
            opt = stratagem.optimizers.SGD(0.5)
        opt.apply_gradients([(np.ones(2), w)])
        assert strategy.variables == [w] and w.numpy().tolist() == [0.5, 0.5]
        assert strategy.run(lambda a: a * 2, args=(3,)) == 6 and strategy.reduce("sum", 2.0) == 2.0


def test_a_ps_task_cannot_be_a_mirrored_replica():
    cluster = ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]})
    fabric = LocalFabric()
    with pytest.raises(ConfigurationError, match="ps/task:0 is not a replica: the mirrored strategy runs on"):
        MirroredStrategy("local", cluster=cluster, task="ps:0", transport_options={"fabric": fabric})
    assert fabric.gone(TaskId("ps", 0))  # its transport was closed again


# -- replicas that disagree ------------------------------------------------------------------------------

def test_a_replica_with_an_extra_variable_fails_every_replica_naming_it():
    def body(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros((2, 3), np.float32), name="w")
            if rank == 1:
                stratagem.Variable(np.zeros(3, np.float32), name="extra")
    _, errors = run_replicas(3, body)
    for exc in errors:
        assert isinstance(exc, ConfigurationError)
        assert ("/job:worker/task:1 created variable 'extra' (shape (3,), float32) but the chief "
                "/job:worker/task:0 did not") in str(exc)
        assert "task:2" not in str(exc)


def test_replicas_with_different_shapes_or_missing_variables_fail():
    def body(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros(4 if rank == 2 else 3), name="w")
            if rank != 1:
                stratagem.Variable(np.zeros(1), name="b")
    _, errors = run_replicas(3, body)
    message = str(errors[0])
    assert all(str(e) == message for e in errors)
    assert "/job:worker/task:1 did not create variable 'b' (shape (1,), float64) but the chief" in message
    assert "variable 'w' is (shape (4,), float64) on /job:worker/task:2 but (shape (3,), float64)" in message


def test_replicas_passing_gradients_for_different_variables_fail():
    def body(strategy, rank):
        with strategy.scope():
            w, b = stratagem.Variable(np.zeros(2), name="w"), stratagem.Variable(np.zeros(2), name="b")
            opt = stratagem.optimizers.SGD(0.1)
        opt.apply_gradients([(np.ones(2), w), (None if rank == 1 else np.ones(2), b)])
    _, errors = run_replicas(2, body)
    for exc in errors:
        assert isinstance(exc, ConfigurationError)
        assert "/job:worker/task:1 has no gradient for variable 'b' (shape (2,), float64)" in str(exc)


# -- checkpoints -----------------------------------------------------------------------------------------

def test_local_save_kill_restore_continues_exactly(tmp_path):
    ckpt, k, m = str(tmp_path / "ckpt"), 6, 12
    ok(run_replicas(2, trainer(steps=k, optimizer="adam", ckpt=ckpt, save_at=k)))   # ends: world gone
    resumed = ok(run_replicas(2, trainer(steps=m, optimizer="adam", ckpt=ckpt, restore=True)))
    straight = ok(run_replicas(2, trainer(steps=m, optimizer="adam")))
    assert_replicas_identical(resumed)
    assert resumed[0][2] == m                                   # Adam's iterations came back too
    for name in model.PARAM_NAMES:
        np.testing.assert_array_equal(resumed[0][0][name], straight[0][0][name])
    # a different number of replicas may continue it: the same model, up to rounding
    three = ok(run_replicas(3, trainer(steps=m, optimizer="adam", ckpt=ckpt, restore=True)))
    assert_replicas_identical(three)
    assert_params_close(three[0][0], straight[0][0], rtol=1e-4, atol=1e-5)


def test_restore_failures_reach_every_replica(tmp_path):
    def body(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros(2), name="w")
        strategy.restore(str(tmp_path / "empty"))
    _, errors = run_replicas(2, body)
    assert isinstance(errors[0], CheckpointNotFoundError)
    assert isinstance(errors[1], StratagemError)
    assert "the chief (/job:worker/task:0) could not restore" in str(errors[1]) and "no such" in str(errors[1])

    def other_model(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros(2), name="w")
            stratagem.Variable(np.zeros(3), name="extra")
        strategy.save(str(tmp_path / "other"))

    def this_model(strategy, rank):
        with strategy.scope():
            stratagem.Variable(np.zeros(4), name="w")
        strategy.restore(str(tmp_path / "other"))
    ok(run_replicas(2, other_model))
    _, errors = run_replicas(2, this_model)
    assert "it holds variable(s) this program did not create: 'extra'" in str(errors[0])
    assert "variable 'w' has shape (2,) there, (4,) here" in str(errors[0])
    assert "could not restore" in str(errors[1])


# -- real processes over zmq ------------------------------------------------------------------------------

def run_job(tmp_path, workers: int, *args, timeout: float = 60, grace: float = 5.0):
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    stdout, stderr = io.StringIO(), io.StringIO()
    result = launch([*TRAIN, "--out", str(out), *map(str, args)], workers=workers, timeout=timeout,
                    output=stdout, error_output=stderr, grace=grace)
    return result, out, stdout.getvalue() + stderr.getvalue()


def read_replicas(out: Path, workers: int):
    records = [json.loads((out / f"worker_{i}.json").read_text()) for i in range(workers)]
    params = []
    for i in range(workers):
        with np.load(out / f"worker_{i}.npz", allow_pickle=False) as f:
            params.append({name: f[name] for name in f.files})
    return records, params


@pytest.mark.parametrize("workers", [2, 3])
def test_processes_over_zmq_match_one_process(tmp_path, workers, sgd_reference):
    result, out, log = run_job(tmp_path, workers, "--steps", STEPS, "--batch", BATCH)
    assert result.ok, log
    records, params = read_replicas(out, workers)
    assert all(r["fingerprints"] == records[0]["fingerprints"] for r in records)   # after every step
    assert len(records[0]["fingerprints"]) == STEPS + 1
    for p in params:
        assert_params_close(p, sgd_reference)
    assert records[0]["losses"][-1] < records[0]["losses"][0]
    # reduce("mean", each replica's loss over its rows) is the loss of one process on the whole batch
    # (25 rows do not split evenly over 2 or 3 replicas), on every replica
    for record in records:
        np.testing.assert_allclose(record["losses"], reference_losses(STEPS, BATCH), rtol=1e-5)


def reference_losses(steps: int, batch: int, optimizer: str = "sgd") -> list[float]:
    """The loss before every step of one process trained on whole global batches."""
    params, opt = model.create(optimizer)
    return [model.train_step(params, opt, x, y) for x, y in model.global_batches(0, steps, batch)]


def test_processes_save_crash_and_a_new_cluster_resumes(tmp_path):
    ckpt, k, m = tmp_path / "ckpt", 5, 10
    crashed, _, log = run_job(tmp_path / "a", 2, "--steps", m, "--optimizer", "adam", "--ckpt", ckpt,
                              "--save-at", k, "--crash-after-save")
    assert not crashed.ok and crashed.failed_task == TaskId("worker", 1), log
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000005.npz", "latest"]
    resumed, out, log = run_job(tmp_path / "b", 2, "--steps", m, "--optimizer", "adam", "--ckpt", ckpt,
                                "--restore")
    assert resumed.ok, log
    records, params = read_replicas(out, 2)
    assert [r["start"] for r in records] == [k, k] and records[0]["iterations"] == m
    assert records[0]["fingerprints"] == records[1]["fingerprints"]
    straight = ok(run_replicas(2, trainer(steps=m, optimizer="adam")))[0][0]   # same split, in threads
    for name in model.PARAM_NAMES:
        np.testing.assert_array_equal(params[0][name], straight[name])


def test_a_replica_dying_mid_step_fails_the_others_with_peer_lost(tmp_path):
    timeout = 10.0
    result, out, log = run_job(tmp_path, 3, "--steps", STEPS, "--die-at", 3, "--die-task", "worker:1",
                               "--timeout", timeout, "--peer-timeout", 2, grace=timeout + 5)
    assert result.exit_code != 0 and result.failed_task == TaskId("worker", 1), log
    assert result.returncodes["worker:1"] == -9
    assert "worker:1" in result.summary() and "SIGKILL" in result.summary()
    for survivor in (0, 2):
        error = json.loads((out / f"worker_{survivor}.error.json").read_text())
        assert error["type"] == "PeerLostError" and error["task"] == "/job:worker/task:1", error
        # step 2 happens too: worker:1 may die before ZeroMQ's I/O thread sent its last step-2 message
        assert error["step"] in (2, 3) and error["seconds"] < timeout
        assert result.returncodes[f"worker:{survivor}"] == 3


# -- docs -------------------------------------------------------------------------------------------------

def test_docstring_examples():
    for module in (strategy_module, mirrored_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest example(s) failed"
