"""tf.distribute's surface on Stratagem (README: "Coming from tf.distribute").

- TF's custom-training-loop tutorial (examples/tf_custom_training.py) under ``stratagem launch``
  against one process; TF's loss idiom under an averaging strategy, refused in one line per task;
  a communicator beside a strategy in one process (real processes over zmq).
- The names one by one (``ReduceOp``, ``reduce(op, value, axis)``, torch tensors through ``reduce``,
  ``experimental_local_results``, ``experimental_distribute_dataset``,
  ``distribute_datasets_from_function``, ``stratagem.nn.compute_average_loss``,
  ``gradient_reduction``) on replicas as threads over the ``local`` transport.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, ReduceOp
from stratagem.core import user_errors
from stratagem.transports.local import LocalFabric
from test_mirrored import run_replicas as mirrored_replicas   # the threads-over-local harness

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLE = ROOT / "examples" / "tf_custom_training.py"

pytestmark = pytest.mark.timeout(90)


def clean_env(**extra) -> dict:
    """This environment without a cluster of its own (a test may run under a launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(extra)
    return env


def launch(workers: int, *command: str, env=None, seconds: float = 75) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout",
                           str(int(seconds - 15)), "--", sys.executable, *command],
                          capture_output=True, text=True, timeout=seconds, env=env or clean_env())


# -- real processes -----------------------------------------------------------------------------------

def test_tf_custom_training_tutorial_matches_one_process(tmp_path):
    # TF's tutorial with its loss idiom, unchanged but for the strategy line (gradient_reduction="sum"):
    # 2 replicas make exactly what one process makes (the last global batch has 52 rows).
    alone = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "3", "--out", str(tmp_path / "one.json")],
                           capture_output=True, text=True, timeout=60, env=clean_env())
    assert alone.returncode == 0, alone.stdout + alone.stderr
    job = launch(2, str(EXAMPLE), "--epochs", "3", "--out", str(tmp_path / "two.json"))
    assert job.returncode == 0, job.stdout + job.stderr
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert (one["replicas"], two["replicas"]) == (1, 2)
    np.testing.assert_allclose(two["history"], one["history"], rtol=0, atol=1e-5)
    for name, values in one["weights"].items():
        np.testing.assert_allclose(two["weights"][name], values, rtol=0, atol=1e-5)
    assert one["history"][-1][0] < one["history"][0][0] * 0.6      # it trained


def test_tf_loss_idiom_under_mean_is_one_line_per_task():
    job = launch(2, str(SCRIPTS / "tf_idiom_mean.py"))
    assert job.returncode == 1, job.stdout + job.stderr
    out = job.stdout + job.stderr
    assert "Traceback" not in out, out
    for task in ("worker:0", "worker:1"):
        lines = [line for line in out.splitlines() if line.startswith(f"[{task}]")]
        assert len(lines) == 1, out
        assert lines[0].startswith(f"[{task}] stratagem: ConfigurationError: stratagem.nn.compute_average_loss"), out
        assert "gradient_reduction='sum'" in lines[0] and "(tf_idiom_mean.py:16; STRATAGEM_TRACEBACK=1" in lines[0]


def test_user_error_traceback_on_request():
    script = [sys.executable, str(SCRIPTS / "tf_idiom_mean.py")]
    short = subprocess.run(script, capture_output=True, text=True, timeout=60, env=clean_env())
    full = subprocess.run(script, capture_output=True, text=True, timeout=60, env=clean_env(STRATAGEM_TRACEBACK="1"))
    assert short.returncode == full.returncode == 1
    assert short.stderr.count("\n") == 1 and short.stderr.startswith("stratagem: ConfigurationError: ")
    assert full.stderr.startswith("Traceback (most recent call last):")
    assert "stratagem.core.errors.ConfigurationError: stratagem.nn.compute_average_loss" in full.stderr


@pytest.mark.parametrize("order", [[], ["--communicator-first"]], ids=["strategy-first", "communicator-first"])
def test_communicator_beside_a_strategy(order):
    # Before: the second of the two bound the task's address again: "Address already in use".
    job = launch(2, str(SCRIPTS / "comm_beside_strategy.py"), *order)
    assert job.returncode == 0, job.stdout + job.stderr
    lines = sorted(line.split("beside: ", 1)[1] for line in job.stdout.splitlines() if "beside: " in line)
    assert lines == ["0 [3.0, 3.0, 3.0] 1.0 [-1.5, -1.5]", "1 [3.0, 3.0, 3.0] 1.0 [-1.5, -1.5]"], job.stdout


# -- replicas as threads over the local transport ------------------------------------------------------

def run_replicas(n: int, body, timeout: float = 20.0, **options):
    """``body(strategy, rank)`` on ``n`` mirrored replicas, each a thread; returns the results by rank
    (test_mirrored's harness, raising the first replica's error as it is)."""
    results, errors = mirrored_replicas(n, body, timeout=timeout, **options)
    for exc in errors:
        if exc is not None:
            raise exc
    return results

def test_reduce_with_reduce_op_axis_and_torch_tensors():
    torch = pytest.importorskip("torch")
    batch = np.arange(10.0).reshape(5, 2)            # 3 rows to replica 0, 2 to replica 1

    def body(strategy, rank):
        (x,) = list(strategy.experimental_distribute_dataset([batch]))
        t = strategy.reduce(ReduceOp.SUM, torch.tensor([1.0, 2.0], dtype=torch.float64))
        return (strategy.reduce(ReduceOp.SUM, float(rank + 1), axis=None),
                strategy.reduce("SUM", x, axis=0), strategy.reduce(ReduceOp.MEAN, x, axis=0),
                strategy.reduce("max", x, axis=0), strategy.reduce(ReduceOp.MEAN, torch.from_numpy(x), axis=0), t)

    for total, sums, means, biggest, torch_mean, t in run_replicas(2, body):
        assert total == 3.0
        np.testing.assert_allclose(sums, batch.sum(axis=0))
        np.testing.assert_allclose(means, batch.mean(axis=0))       # over the global batch, 3 + 2 rows
        np.testing.assert_allclose(biggest, [8.0, 9.0])
        assert isinstance(torch_mean, torch.Tensor) and torch_mean.dtype == torch.float64
        np.testing.assert_allclose(torch_mean.numpy(), batch.mean(axis=0))
        assert isinstance(t, torch.Tensor) and t.tolist() == [2.0, 4.0]


def test_reduce_refuses_bad_ops_and_axes():
    def body(strategy, rank):
        errors = []
        for call in (lambda: strategy.reduce("avg", 1.0), lambda: strategy.reduce("sum", 1.0, axis="rows"),
                     lambda: strategy.reduce("sum", 1.0, axis=0), lambda: strategy.reduce("sum", np.ones(2), axis=3)):
            with pytest.raises(ConfigurationError) as info:
                call()
            errors.append(str(info.value))
        return errors

    (errors,) = run_replicas(1, body)
    assert "unknown reduce op 'avg'" in errors[0] and "axis must be None or an integer" in errors[1]
    assert "got a scalar" in errors[2] and "out of range" in errors[3]


def test_experimental_distribute_dataset_splits_as_tf_and_starts_over_each_epoch():
    batches = [np.arange(7), np.arange(3)]

    def body(strategy, rank):
        dataset = strategy.experimental_distribute_dataset(batches)
        return [[x.tolist() for x in dataset] for _epoch in range(2)], strategy.experimental_local_results(5.0)

    results = run_replicas(3, body)
    assert [epochs[0] for epochs, _ in results] == [[[0, 1, 2], [0]], [[3, 4], [1]], [[5, 6], [2]]]
    assert all(epochs[0] == epochs[1] for epochs, _ in results)
    assert all(local == (5.0,) for _, local in results)


def test_distribute_datasets_from_function_gives_each_replica_its_input_context():
    def dataset_fn(context):
        size = context.get_per_replica_batch_size(8)
        rows = np.arange(32)[context.input_pipeline_id::context.num_input_pipelines]
        return [rows[i:i + size] for i in range(0, len(rows), size)], context

    def body(strategy, rank):
        seen = {}

        def fn(context):
            batches, seen["context"] = dataset_fn(context)
            return batches

        dataset = strategy.distribute_datasets_from_function(fn)
        with pytest.raises(ConfigurationError, match="not divisible by num_replicas_in_sync 2"):
            seen["context"].get_per_replica_batch_size(7)
        return seen["context"], [b.tolist() for b in dataset], len(list(dataset))

    (c0, b0, again0), (c1, b1, _) = run_replicas(2, body)
    assert (c0.num_input_pipelines, c0.input_pipeline_id, c1.input_pipeline_id, c1.num_replicas_in_sync) == (2, 0, 1, 2)
    assert b0[0] == [0, 2, 4, 6] and b1[0] == [1, 3, 5, 7] and again0 == 4


def sgd_step(gradient_reduction: str, loss_idiom: bool):
    """One SGD step (lr 1) of ``w`` on the loss sum over rows of ``w . x`` scaled as the idiom says."""
    batch = np.arange(10.0).reshape(5, 2)

    def body(strategy, rank):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)

        def step(x):
            if loss_idiom:      # TF: d/dw of sum(w . x) / global batch
                stratagem.nn.compute_average_loss(x @ w.value, global_batch_size=5)
                grad = x.sum(axis=0) / 5
            else:               # the per-replica mean loss
                grad = x.mean(axis=0)
            opt.apply_gradients([(grad, w)])

        for x in strategy.experimental_distribute_dataset([batch]):
            strategy.run(step, args=(x,))
        return w.value.copy()

    return run_replicas(2, body, gradient_reduction=gradient_reduction), -batch.mean(axis=0)


def test_gradient_reduction_sum_with_tf_loss_idiom_equals_one_process():
    results, expected = sgd_step("sum", loss_idiom=True)
    for w in results:
        np.testing.assert_allclose(w, expected)


def test_gradient_reduction_mean_with_per_replica_mean_equals_one_process():
    results, expected = sgd_step("mean", loss_idiom=False)
    for w in results:
        np.testing.assert_allclose(w, expected)


def test_tf_loss_idiom_under_mean_is_refused():
    with pytest.raises(ConfigurationError, match=r"gradient_reduction='sum'.*per_example_loss.mean\(\)"):
        sgd_step("mean", loss_idiom=True)


def test_sum_without_the_loss_idiom_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, _ = sgd_step("sum", loss_idiom=False)
    batch = np.arange(10.0).reshape(5, 2)                       # the replicas' mean gradients summed
    np.testing.assert_allclose(results[0], -(batch[:3].mean(axis=0) + batch[3:].mean(axis=0)))
    messages = [str(w.message) for w in caught if "never called stratagem.nn.compute_average_loss" in str(w.message)]
    assert len(messages) == 2, messages                         # once per replica


def test_compute_average_loss():
    loss = np.array([1.0, 2.0, 3.0, 4.0])
    assert stratagem.nn.compute_average_loss(loss) == 2.5                     # alone: the rows are the batch
    assert stratagem.nn.compute_average_loss(loss, global_batch_size=8) == 1.25
    assert stratagem.nn.compute_average_loss(loss, sample_weight=np.array([1, 0, 0, 1]), global_batch_size=5) == 1.0
    with pytest.raises(ConfigurationError, match="global_batch_size must be a number > 0"):
        stratagem.nn.compute_average_loss(loss, global_batch_size=0)

    def body(strategy, rank):     # default global batch: the rows of the batch this replica's part came from
        for x in strategy.experimental_distribute_dataset([np.ones(5)]):
            return strategy.run(stratagem.nn.compute_average_loss, args=(x,))

    assert run_replicas(2, body, gradient_reduction="sum") == [3 / 5, 2 / 5]


def test_gradient_reduction_option_is_checked():
    with pytest.raises(ConfigurationError, match="unknown gradient_reduction 'avg'"):
        stratagem.strategy("mirrored", transport="local", gradient_reduction="avg")
    with pytest.raises(ConfigurationError, match="SyncReplicasOptimizer"):
        stratagem.strategy("between_graph", transport="local", mode="sync", gradient_reduction="sum",
                           cluster=ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), task="worker:0")


def test_user_error_line():
    try:
        stratagem.strategy("mirrored", transport="local", buket_bytes=1)
    except ConfigurationError as exc:
        line = user_errors.one_line(exc, exc.__traceback__)
    assert line.startswith("stratagem: ConfigurationError: strategy 'mirrored' does not accept option(s) 'buket_bytes'")
    assert "(did you mean 'bucket_bytes'?)" in line and "\n" not in line
    assert re.search(r"\(test_tf_distribute\.py:\d+; STRATAGEM_TRACEBACK=1 shows the traceback\)$", line), line


@pytest.mark.parametrize("gradient_reduction", ["mean", "sum"])
def test_in_graph_merges_as_gradient_reduction_says(gradient_reduction):
    # in_graph's client merges its devices' gradients: weighted by rows (mean), or summed (TF's idiom).
    from stratagem.strategies.in_graph.strategy import InGraphStrategy

    batch = np.arange(10.0).reshape(5, 2)
    with InGraphStrategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0", devices=2,
                         transport_options={"fabric": LocalFabric()}, gradient_reduction=gradient_reduction) as strategy:
        with strategy.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)

        def step(x):
            opt.apply_gradients([(x.sum(axis=0) / 5 if gradient_reduction == "sum" else x.mean(axis=0), w)])
            return x.sum(axis=0)

        per_replica = strategy.run(step, args=(batch,))
        assert isinstance(per_replica, stratagem.PerReplica)
        local = strategy.experimental_local_results(per_replica)
        assert len(local) == 2 and [v.tolist() for v in local] == [[6.0, 9.0], [14.0, 16.0]]
        np.testing.assert_allclose(strategy.reduce(ReduceOp.SUM, per_replica), batch.sum(axis=0))
        np.testing.assert_allclose(w.value, -batch.mean(axis=0))
