"""The MPI cells of the fault matrix (issue #23): the plain training script under ``stratagem launch
--mpi`` (one ``mpiexec`` in a private network namespace, ULFM where the Open MPI has it), one fault
struck on one rank, and the job must end as ``benchmarks/fault_matrix.py`` expects it to, naming the
culprit in the launcher and in every task that failed.

Each cell was a miss before:

- ``sys.exit(3)`` on the ``in_graph`` client: no exception hook sees a ``SystemExit``, so no rank
  reported a failure and the launcher named ``mpiexec:0``. Each rank now runs under
  :mod:`stratagem.launch.mpi_rank`, which reports a rank that exits non-zero without a report.
- SIGKILL of a ``parameter_server`` worker: under ULFM the others went on without it and mpiexec exited
  0, so the job succeeded although a task died. The ranks that are done now wait for their peers
  before ``MPI_Finalize`` and end without it (status 1) naming a peer lost (transports/mpi).
- ``sys.exit(3)`` of a ``parameter_server`` worker: the coordinator's error, the first report, named
  nobody (a ps task's refusal lost the culprit on its way), so the launcher named the coordinator.
  The refusal now carries the culprit to the coordinator's error.
- A ``between_graph`` worker stopped past the peer timeout while the others finished: they spun in
  ``MPI_Finalize`` waiting for it until ``--timeout`` ended the job. They now hear that it is lost and
  end naming it.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest


def _no_mpi() -> str | None:
    if not sys.platform.startswith("linux"):
        return "signals and PR_SET_PDEATHSIG"
    from stratagem.launch import mpi as mpi_launch

    if importlib.util.find_spec("mpi4py") is None or mpi_launch.find_mpiexec() is None:
        return "no mpi4py or mpiexec"
    if not mpi_launch.ulfm_available(mpi_launch.find_mpiexec()):
        return "no ULFM in this Open MPI (without it mpiexec ends the whole job when a rank dies)"
    return None if mpi_launch.private_netns()[0] is not None else "no private network namespace for MPI"


pytestmark = [pytest.mark.skipif(_no_mpi() is not None, reason=_no_mpi() or ""), pytest.mark.timeout(90)]


@pytest.mark.parametrize("strategy, culprit, fault", [
    ("in_graph", "worker:0", "exit"),
    ("parameter_server", "worker:1", "sigkill"),
    ("parameter_server", "worker:1", "exit"),
    ("between_graph", "worker:1", "sigstop_long"),
])
def test_an_mpi_job_fails_naming_the_rank_that_failed(strategy, culprit, fault):
    from stratagem.testing.faults import run_fault

    peer_timeout = 2.0
    outcome = run_fault(strategy, "mpi", culprit, fault, peer_timeout=peer_timeout, limit=60.0, steps=10)
    assert outcome.exit_code == 1, outcome.reason + outcome.output[-3000:]     # not 0, nor 124 (--timeout)
    assert outcome.launcher_culprit == culprit, outcome.reason + outcome.output[-3000:]
    wrong = {task: named for task, named in outcome.named.items() if task != culprit and culprit not in named}
    assert not wrong, outcome.output[-3000:]


def test_the_ranks_that_end_first_wait_for_a_slow_one_and_the_job_succeeds():
    """Slow is not dead at the end of a job either: worker:0 ends its script two peer timeouts after
    the others. They wait for it before ``MPI_Finalize`` (hearing its heartbeats), rather than take it
    for lost, and the job succeeds."""
    import io
    import os
    from pathlib import Path

    from stratagem.launch.mpi import launch_mpi
    from stratagem.testing.strategy_contract import clean_env

    env: dict = {k: None for k in os.environ if k not in clean_env()}
    env.update(clean_env(), STRATAGEM_PEER_TIMEOUT="1")
    output = io.StringIO()
    script = Path(__file__).parent / "scripts" / "mpi_slow_end.py"
    result = launch_mpi([sys.executable, str(script)], workers=3, env=env, timeout=60, output=output,
                        error_output=output)
    text = output.getvalue()
    assert result.exit_code == 0, result.reason + text[-3000:]
    assert all(f"[worker:{i}] done worker:{i} [3.0, 3.0, 3.0, 3.0]" in text for i in range(3)), text[-3000:]
    assert "would wait for ever" not in text, text[-3000:]
