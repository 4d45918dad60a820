"""The strategy conformance suite, written once and run against every strategy (as
:mod:`stratagem.testing.contract` is for transports). A strategy plugin conforms if this suite passes.

Third-party packages reuse it::

    from stratagem.testing.strategy_contract import StrategyContract

    class TestMyStrategy(StrategyContract):
        strategy = "my_strategy"
        transport = "zmq"

What every strategy promises, whatever it does inside:

- **the plain script works**: :mod:`stratagem.testing.plain_training` (the five lines a user writes, with
  no ``close()``, ``shutdown()``, ``with`` or ``__main__`` guard) trains on every task of a cluster and
  every task exits 0;
- **a failure is never silent and never hangs**: when one task's script raises in the middle of training,
  that task exits 1 and every other task, within the time limit, either exits non-zero with an error
  that names the failed task or (a strategy whose replicas do not wait for each other) exits 0 having
  finished its own training; a ``sys.exit(3)`` keeps its code and hangs nobody;
- **bad options are refused by name** (with the known ones), before any process is contacted;
- **a transport it cannot use is one clear error** (``IncompatibleError`` naming both plugins);
- **it trains what the user asked**: :mod:`stratagem.testing.conformance_training` (SGD with momentum on
  global batches whose rows do not split evenly over the replicas) ends with the values one process
  reaches on the whole batches, on every task that holds the variables (a strategy that promises it:
  :attr:`StrategyContract.one_process`);
- **a checkpoint resumes the job**: the same script saving halfway, then a fresh job restoring it, ends
  where the uninterrupted job ends (values, and the optimizer's iterations and slots).

The last two depend on the strategy alone, not on the transport: a suite run over several transports
may keep them to one (:attr:`StrategyContract.training_checks`).

The tasks run as independent processes, each with its own ``STRATAGEM_CONFIG`` and the cluster secret,
as a Kubernetes TFJob starts them (not under ``stratagem launch``, which would stop the others itself).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import ClassVar

import numpy as np
import pytest

from stratagem.core.errors import ConfigurationError, IncompatibleError
from stratagem.testing.world import free_ports
from stratagem.training.checkpoint import load as load_checkpoint

#: Seconds every task of a job gets to end, start-up included (generous: tests share 2 cores).
LIMIT = 60
#: The module every task runs.
SCRIPT_MODULE = "stratagem.testing.plain_training"
#: The module every task runs for the training checks.
TRAINING_MODULE = "stratagem.testing.conformance_training"
#: The training checks' learning rate and momentum (those of :data:`TRAINING_MODULE`).
LEARNING_RATE, MOMENTUM = 0.05, 0.9


def clean_env() -> dict:
    """This process's environment without any cluster settings, and one thread per BLAS library."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run_tasks(tasks: list[str], command: list[str], *, limit: float = LIMIT,
              secret: str = "conformance-secret") -> dict[str, tuple[int | None, str, float]]:
    """Run ``command`` once per task of a fresh local cluster of ``tasks`` (``["worker:0", "ps:0"]``), each
    an independent process told its place by ``STRATAGEM_CONFIG``; return ``{task: (exit code, output,
    seconds)}``. A task still running after ``limit`` seconds is killed and gets the code ``None``; every
    process is reaped, whatever happens."""
    ports = iter(free_ports(len(tasks)))
    cluster: dict[str, list[str]] = {}
    for task in tasks:
        cluster.setdefault(task.split(":")[0], []).append(f"127.0.0.1:{next(ports)}")
    env = dict(clean_env(), STRATAGEM_SECRET=secret)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for task in tasks:
            job, index = task.split(":")
            config = {"cluster": cluster, "task": {"type": job, "index": int(index)}}
            procs[task] = subprocess.Popen(command, env=dict(env, STRATAGEM_CONFIG=json.dumps(config)),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started, results = time.monotonic(), {}
        for task, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(0.1, limit - (time.monotonic() - started)))
                results[task] = (proc.returncode, out, time.monotonic() - started)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                results[task] = (None, out, time.monotonic() - started)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def report(results) -> str:
    """Every task's exit code, time and the end of its output, for an assertion message."""
    return "\n".join(f"--- {task}: exit {code} after {secs:.1f}s\n{out[-3000:]}"
                     for task, (code, out, secs) in results.items())


def names(text: str, task: str) -> bool:
    """True if ``text`` names ``task`` (``worker:1`` or ``/job:worker/task:1``)."""
    job, index = task.split(":")
    return f"/job:{job}/task:{index}" in text or re.search(rf"\b{job}:{index}\b", text) is not None


def write_training_data(path, *, batches: int = 6, rows: int = 7, seed: int = 0) -> None:
    """Write the training checks' data to ``path`` (an ``.npz``): initial ``w`` (5x3) and ``b`` (3), and
    ``batches`` global batches of ``rows`` rows (``x``, ``y``: one row per batch) of a noisy linear map."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches, rows, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 3)) + 0.5 + 0.1 * rng.normal(size=(batches, rows, 3))).astype(np.float32)
    np.savez(path, w=rng.normal(size=(5, 3)).astype(np.float32), b=np.zeros(3, np.float32), x=x, y=y)


def one_process_values(path) -> dict[str, np.ndarray]:
    """What one process reaches on the whole of each global batch of ``path``, in plain numpy (float64):
    the SGD-with-momentum rule (``v = m v - lr g; w += v``) on the mean squared error."""
    with np.load(path) as data:
        params = {"w": data["w"].astype(np.float64), "b": data["b"].astype(np.float64)}
        batches = list(zip(data["x"].astype(np.float64), data["y"].astype(np.float64)))
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    for x, y in batches:
        err = x @ params["w"] + params["b"] - y
        grads = {"w": 2 * x.T @ err / len(x), "b": 2 * err.mean(axis=0)}
        for k in params:
            velocity[k] = MOMENTUM * velocity[k] - LEARNING_RATE * grads[k]
            params[k] += velocity[k]
    return {**params, "iterations": len(batches)}


class StrategyContract:
    """The conformance tests; subclass and set :attr:`strategy` (and what else differs)."""

    #: The strategy's registered name.
    strategy: ClassVar[str] = ""
    #: Its mode, for strategies with several (``"sync"`` for ``between_graph``); ``""`` for the default.
    mode: ClassVar[str] = ""
    #: The transport the jobs run over.
    transport: ClassVar[str] = "zmq"
    #: The cluster: worker tasks, and ps tasks for strategies that keep variables on them.
    workers: ClassVar[int] = 3
    ps: ClassVar[int] = 0
    #: Tasks that run the training loop and may fail in it (under ``in_graph`` and ``parameter_server``
    #: only the chief, worker:0, does: the others serve it).
    culprits: ClassVar[tuple[str, ...]] = ("worker:0",)
    #: The strategy promises the update one process makes on the whole global batch (a synchronous
    #: strategy); the training checks then compare with :func:`one_process_values`.
    one_process: ClassVar[bool] = False
    #: Run the training checks (they depend on the strategy, not on the transport).
    training_checks: ClassVar[bool] = True

    # -- helpers ---------------------------------------------------------------------------------------
    def tasks(self) -> list[str]:
        return [f"worker:{i}" for i in range(self.workers)] + [f"ps:{i}" for i in range(self.ps)]

    def run_job(self, *ending: str) -> dict[str, tuple[int | None, str, float]]:
        name = f"{self.strategy}:{self.mode}" if self.mode else self.strategy
        return run_tasks(self.tasks(), [sys.executable, "-m", SCRIPT_MODULE, name, self.transport, *ending])

    def run_training(self, tmp_path, *phase: str) -> tuple[dict[str, np.ndarray], dict]:
        """Run the training script as every task (``phase``: ``CKPT save|restore``); return the chief's
        trained values and the job's results."""
        if not self.training_checks:
            pytest.skip(f"the training checks of {self.strategy} run over another transport of this suite")
        data, out = tmp_path / "data.npz", tmp_path / f"out{'-' + phase[-1] if phase else ''}.npz"
        if not data.exists():
            write_training_data(data)
        name = f"{self.strategy}:{self.mode}" if self.mode else self.strategy
        results = run_tasks(self.tasks(), [sys.executable, "-m", TRAINING_MODULE, name, self.transport,
                                           str(data), str(out), *phase])
        assert all(code == 0 for code, _, _ in results.values()), report(results)
        with np.load(out) as values:
            return {k: values[k] for k in values.files}, results

    def strategy_class(self) -> type:
        from stratagem.plugins.manager import plugin_manager

        return plugin_manager().strategy_class(self.strategy)

    # -- the contract ----------------------------------------------------------------------------------
    def test_the_plain_script_ends_normally_on_every_task(self):
        results = self.run_job()
        assert all(code == 0 for code, _, _ in results.values()), report(results)
        trained = [out for out in (results[t][1] for t in self.culprits) if "trained: w = [-" in out]
        assert trained, "no training task printed trained weights that moved against the gradient\n" + report(results)

    def test_an_exception_on_one_task_ends_every_task_naming_it(self):
        for culprit in self.culprits:
            results = self.run_job(culprit, "raise")
            code, out, _ = results[culprit]
            assert code == 1 and f"RuntimeError: {culprit} failed on purpose" in out, report(results)
            for task, (code, out, _) in results.items():
                if task == culprit or (code == 0 and "trained: w" in out):
                    continue   # a replica that does not wait for the others may finish its own training
                assert code not in (0, None), f"{task} should fail, naming {culprit}\n" + report(results)
                assert names(out, culprit), f"{task} does not name {culprit}\n" + report(results)

    def test_sys_exit_on_one_task_keeps_its_code_and_hangs_nobody(self):
        culprit = self.culprits[-1]
        results = self.run_job(culprit, "exit")
        assert results[culprit][0] == 3, report(results)
        assert all(code is not None for code, _, _ in results.values()), report(results)

    def test_it_trains_as_one_process_on_the_whole_batch(self, tmp_path):
        if not self.one_process:
            pytest.skip(f"{self.strategy} {self.mode} does not promise the update of one process")
        trained, results = self.run_training(tmp_path)
        expected = one_process_values(tmp_path / "data.npz")
        assert int(trained["iterations"]) == expected["iterations"], report(results)
        for key in ("w", "b"):
            np.testing.assert_allclose(trained[key], expected[key], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{key} differs from one process on the whole batch")

    def test_a_checkpoint_resumes_the_job_where_it_was_saved(self, tmp_path):
        ckpt = tmp_path / "ckpt"
        halfway, _ = self.run_training(tmp_path, str(ckpt), "save")
        saved = load_checkpoint(ckpt)
        assert sorted(saved.variables) == ["b", "w"] and saved.optimizer_state["iterations"] > 0, saved
        if self.one_process:   # else other replicas may still push after the chief saved
            for key in ("w", "b"):
                np.testing.assert_array_equal(saved.variables[key], halfway[key], err_msg=f"checkpointed {key}")
        resumed, results = self.run_training(tmp_path, str(ckpt), "restore")
        assert int(resumed["iterations"]) > int(halfway["iterations"]), report(results)
        if self.one_process:
            uninterrupted, _ = self.run_training(tmp_path)
            assert int(resumed["iterations"]) == int(uninterrupted["iterations"]), report(results)
            for key in ("w", "b"):   # the momentum slots travelled too, or the second half would differ
                np.testing.assert_allclose(resumed[key], uninterrupted[key], rtol=1e-6, atol=1e-6,
                                           err_msg=f"{key} after the restore differs from the uninterrupted job")

    def test_an_unknown_option_is_refused_with_the_known_ones(self):
        import stratagem

        declared = sorted(self.strategy_class().option_defaults())
        with pytest.raises(ConfigurationError, match=r"does not accept option\(s\) 'no_such_option'") as caught:
            stratagem.strategy(self.strategy, transport=self.transport, no_such_option=1)
        for option in declared:
            assert option in str(caught.value), f"the refusal does not list the declared option {option!r}"

    def test_a_transport_it_cannot_use_is_one_clear_error(self):
        import stratagem
        from stratagem.plugins.manager import plugin_manager

        manager = plugin_manager()
        refused = []
        for name in manager.names("transport"):
            if manager.usable("transport", name) is not None:
                continue
            if self.strategy_class().supports(manager.transport_class(name)) is not None:
                refused.append(name)
        if not refused:
            pytest.skip(f"{self.strategy} runs over every transport usable here")
        for name in refused:
            with pytest.raises(IncompatibleError) as caught:
                stratagem.strategy(self.strategy, transport=name)
            assert self.strategy in str(caught.value) and name in str(caught.value), str(caught.value)


def run_strategy_contract(strategy: str, transport: str = "zmq", **attributes) -> type:
    """A :class:`StrategyContract` test class for ``strategy`` over ``transport`` (for generating one per
    registered strategy); ``attributes`` override the class attributes (``mode``, ``ps``, ``culprits``)."""
    name = f"TestStrategyContract_{strategy}_{attributes.get('mode') or 'default'}_{transport}"
    return type(name, (StrategyContract,), {"strategy": strategy, "transport": transport, **attributes})


__all__ = ["StrategyContract", "run_strategy_contract", "run_tasks", "report", "names", "clean_env", "LIMIT",
           "write_training_data", "one_process_values"]
