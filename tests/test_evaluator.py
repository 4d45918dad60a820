"""TF's ``evaluator`` task: not a replica, trains nothing, reads the variables or the checkpoints.

- resolution: TF_CONFIG with the evaluator listed in the cluster, and TF's usual form where it is only
  the task (a side-car outside the cluster);
- strategies on an evaluator: ``apply_gradients`` refused ("evaluators do not train"), ``mirrored`` and
  ``in_graph`` refused pointing to checkpoints, replicas unaffected (threads over ``local``);
- real jobs over zmq (tests/scripts/evaluator_job.py, every task the same script, TF style): under
  ``between_graph`` and ``parameter_server`` in sync mode with an evaluator listed in the cluster,
  every real worker's gradient is applied (the evaluator's pushes are refused by the client and by the
  server), the evaluator reads the trained values from the ps task, and a side-car evaluator outside
  the cluster reads the chief's checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, TaskId
from stratagem.core.cluster import ClusterResolver, is_evaluator
from stratagem.strategies.base import Strategy
from stratagem.strategies.mirrored.strategy import MirroredStrategy
from stratagem.testing.world import local_cluster
from stratagem.transports.local import LocalFabric

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "scripts" / "evaluator_job.py"
TRAINING = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]}

pytestmark = pytest.mark.timeout(120)


def tf_config(cluster: dict, job: str, index=0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def raises(call, *fragments) -> str:
    with pytest.raises(ConfigurationError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# -- resolution ------------------------------------------------------------------------------------------

def test_evaluator_outside_the_cluster_resolves_as_tf_does():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config(TRAINING, "evaluator", "0")})
    assert found.task == TaskId("evaluator", 0) and found.is_evaluator and not found.in_cluster
    assert found.cluster == ClusterSpec(TRAINING) and not found.is_chief
    assert found.cluster.replicas() == [TaskId("chief", 0), TaskId("worker", 0), TaskId("worker", 1)]


def test_evaluator_listed_in_the_cluster_is_no_replica():
    found = ClusterResolver.from_env({"TF_CONFIG": tf_config({**TRAINING, "evaluator": ["e:2222"]}, "evaluator")})
    assert found.is_evaluator and found.in_cluster and not found.is_chief
    assert TaskId("evaluator", 0) not in found.cluster.replicas() and len(found.cluster.replicas()) == 3
    assert found.cluster.chief == TaskId("chief", 0)
    trainer = ClusterResolver.from_env({"TF_CONFIG": tf_config(TRAINING, "worker", 1)})
    assert not trainer.is_evaluator and trainer.in_cluster
    assert is_evaluator("/job:evaluator/task:0") and not is_evaluator("ps:0")
    # other jobs missing from the cluster are still refused
    raises(lambda: ClusterResolver.from_env({"TF_CONFIG": tf_config(TRAINING, "trainer")}), "not a job of the cluster")


def test_a_transport_for_an_evaluator_outside_the_cluster_says_to_read_checkpoints(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["127.0.0.1:1"]}, "evaluator"))
    for name in ("STRATAGEM_CONFIG", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    for strategy in ("mirrored", "between_graph"):
        raises(lambda: stratagem.strategy(strategy, transport="zmq"), "/job:evaluator/task:0 is not in the cluster",
               "checkpoint", "latest_checkpoint", '"evaluator": ["host:port"]')


# -- strategies on an evaluator (threads over the local transport) ------------------------------------

LISTED = ClusterSpec({"worker": ["local:0", "local:1"], "evaluator": ["local:9"]})


def test_mirrored_and_in_graph_refuse_an_evaluator_pointing_to_checkpoints():
    fabric = LocalFabric()
    raises(lambda: MirroredStrategy("local", cluster=LISTED, task="evaluator:0", transport_options={"fabric": fabric}),
           "/job:evaluator/task:0 is an evaluator, not a replica", "'mirrored'", "all-reduce", "checkpoints",
           "latest_checkpoint(dir)")
    from stratagem.strategies.in_graph.strategy import InGraphStrategy

    raises(lambda: InGraphStrategy("local", cluster=LISTED, task="evaluator:0", transport_options={"fabric": fabric}),
           "is an evaluator", "'in_graph'", "checkpoints")


def test_an_evaluator_does_not_train():
    with Strategy("local", cluster=LISTED, task="evaluator:0", transport_options={"fabric": LocalFabric()}) as s:
        assert s.is_evaluator and s.num_replicas_in_sync == 2
        with s.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        raises(lambda: opt.apply_gradients([(np.ones(2), w)]), "is an evaluator: evaluators do not train",
               "apply_gradients()")
        np.testing.assert_array_equal(w.numpy(), np.zeros(2))
        raises(lambda: s.reduce("sum", 1.0), "is an evaluator", "reduce()")
        raises(lambda: s.distribute_dataset([np.zeros(2)]), "is an evaluator", "distribute_dataset()")


def test_mirrored_replicas_train_as_usual_with_an_evaluator_listed():
    fabric, results = LocalFabric(), {}

    def replica(index):
        with MirroredStrategy("local", cluster=LISTED, task=f"worker:{index}",
                              transport_options={"fabric": fabric, "timeout": 20}) as strategy:
            with strategy.scope():
                w = stratagem.Variable(np.zeros(2), name="w")
                opt = stratagem.optimizers.SGD(learning_rate=1.0)
            opt.apply_gradients([(np.full(2, index + 1.0), w)])
            results[index] = (strategy.num_replicas_in_sync, w.numpy().tolist())
    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: (2, [-1.5, -1.5]), 1: (2, [-1.5, -1.5])}


# -- real jobs over zmq -----------------------------------------------------------------------------------

STEPS = 3
EXPECTED = -0.1 * 1.5 * sum(range(1, STEPS + 1))     # SGD 0.1 on the mean gradient 1.5 * (step + 1)


def run_job(tmp_path, kind: str, jobs: dict) -> tuple[Path, list[str]]:
    """Every task of ``jobs`` (the evaluator listed in the cluster) plus a side-car evaluator outside it,
    each a process running the script with its TF_CONFIG; every process is reaped."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    cluster = local_cluster(jobs).as_dict()
    training = {job: tasks for job, tasks in cluster.items() if job != "evaluator"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "OMPI_", "PMI", "MV2_", "STRATAGEM_", "TF_CONFIG"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    configs = [tf_config(cluster, job, i) for job, tasks in cluster.items() for i in range(len(tasks))]
    configs.append(tf_config(training, "evaluator"))           # TF's usual form: not in the cluster
    procs = []
    try:
        for config in configs:
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(ckpt), str(STEPS), kind],
                                          env={**env, "TF_CONFIG": config}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        logs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for proc, config, log in zip(procs, configs, logs):
        assert proc.returncode == 0, f"{config}: exit {proc.returncode}\n{log}"
    return out, logs


def read(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def check_evaluators(out: Path) -> None:
    evaluator = read(out, "evaluator_0")
    assert "evaluators do not train" in evaluator["apply"]
    assert "reads the variables on the ps tasks but does not write them" in evaluator["assign"]
    assert "evaluators do not train" in evaluator["dataset"]
    assert evaluator["raw_push"].startswith("RemoteError") and "is not a replica" in evaluator["raw_push"]
    assert evaluator["step"] == STEPS
    assert evaluator["restore"] == STEPS
    np.testing.assert_allclose(evaluator["w"], [EXPECTED] * 4, rtol=1e-6)     # read from the ps task
    sidecar = read(out, "sidecar")
    assert "is not in the cluster" in sidecar["refused"] and "checkpoint" in sidecar["refused"]
    assert sidecar["step"] == STEPS
    np.testing.assert_allclose(sidecar["w"], [EXPECTED] * 4, rtol=1e-6)       # read from the checkpoint


def test_between_graph_sync_applies_every_real_workers_gradient_with_an_evaluator(tmp_path):
    out, _ = run_job(tmp_path, "between_graph", {"worker": 2, "ps": 1, "evaluator": 1})
    workers = [read(out, f"worker_{i}") for i in range(2)]
    for worker in workers:
        assert worker["replicas"] == 2 and worker["step"] == STEPS
        np.testing.assert_allclose(worker["w"], [EXPECTED] * 4, rtol=1e-6)
    stats = workers[0]["stats"]
    assert stats["updates"] == STEPS and stats["step"] == STEPS
    assert stats["pushes"] == stats["applied"] == 2 * STEPS and stats["dropped"] == 0
    assert sorted(stats["by_replica"]) == ["worker:0", "worker:1"]   # nothing from the evaluator
    assert read(out, "evaluator_0")["replicas"] == 2                  # it is not counted in a round
    check_evaluators(out)


def test_parameter_server_with_an_evaluator(tmp_path):
    out, _ = run_job(tmp_path, "parameter_server", {"worker": 2, "ps": 1, "evaluator": 1})
    coordinator = read(out, "worker_0")
    np.testing.assert_allclose(coordinator["w"], [EXPECTED] * 4, rtol=1e-6)
    stats = coordinator["stats"]
    assert stats["updates"] == STEPS and stats["pushes"] == stats["applied"] == STEPS and stats["dropped"] == 0
    assert sorted(stats["by_replica"]) == ["worker:1"]
    check_evaluators(out)
