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
- **a transport it cannot use is one clear error** (``IncompatibleError`` naming both plugins).

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

import pytest

from stratagem.core.errors import ConfigurationError, IncompatibleError
from stratagem.testing.world import free_ports

#: Seconds every task of a job gets to end, start-up included (generous: tests share 2 cores).
LIMIT = 60
#: The module every task runs.
SCRIPT_MODULE = "stratagem.testing.plain_training"


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

    # -- helpers ---------------------------------------------------------------------------------------
    def tasks(self) -> list[str]:
        return [f"worker:{i}" for i in range(self.workers)] + [f"ps:{i}" for i in range(self.ps)]

    def run_job(self, *ending: str) -> dict[str, tuple[int | None, str, float]]:
        name = f"{self.strategy}:{self.mode}" if self.mode else self.strategy
        return run_tasks(self.tasks(), [sys.executable, "-m", SCRIPT_MODULE, name, self.transport, *ending])

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


__all__ = ["StrategyContract", "run_strategy_contract", "run_tasks", "report", "names", "clean_env", "LIMIT"]
