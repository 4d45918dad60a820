"""The fault matrix's last cells (issue #23): what each fix of ``benchmarks/fault_matrix.py``'s remaining
cells must keep true, on real transports and real processes.

- A waiting ``recv()`` reads the sockets itself, in the calling (main) thread, so an exception that a
  signal handler raises there (the fault script's SIGUSR1, a user's alarm) may land while a frame is
  being handled. It is the program's, not the peer's: it must end the ``recv()``, not be taken for a
  bad frame and dropped (a serving ``in_graph`` replica then dropped the client's request, and the
  job hung to its limit).
- An ``in_graph`` replica that fails while it sets up a step (an error no check of the client's
  request explains: its copy of a module raising on import, an exception its signal handler raised
  meanwhile) is blamed by the client, whose error carries that culprit to the launcher.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from stratagem.core.transport import Message
from stratagem.testing.world import transport_world

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals"),
              pytest.mark.timeout(60)]


class Alarm(Exception):
    """What the signal handler raises (not a stratagem error, not a frame error)."""


def test_an_exception_a_signal_handler_raises_while_zmq_reads_ends_the_recv(caplog, monkeypatch):
    """The main thread waits in ``recv()`` while a peer streams messages whose metadata takes a while to
    decode; an alarm raises ``Alarm`` from its handler a few milliseconds later, 40 times. Every alarm
    must come out of ``recv()``, none taken for a bad frame (the code before dropped the frame with
    "error while handling a frame: Alarm" and went on waiting, in 1 to 3 alarms of 40).

    (An alarm that lands between two parts of a message leaves the message half read; the next read
    goes on with it, so no message is lost or taken apart: the transport's ``_whole_message``.)"""
    meta = {"v": list(range(30_000))}

    def ring(signum, frame):
        raise Alarm()

    # pyzmq runs pending signal handlers when a received frame is freed (Frame.__dealloc__ checks
    # signals), and Python can only print an exception raised there: such an alarm is lost inside
    # pyzmq, wherever the program drops a frame (ours or the user's). Those are counted apart; every
    # other alarm must come out of recv().
    lost_in_pyzmq = []
    previous_hook = sys.unraisablehook

    def unraisable(info):
        if isinstance(info.exc_value, Alarm) and "Frame.__dealloc__" in repr(info.object):
            lost_in_pyzmq.append(repr(info.object))
        else:
            previous_hook(info)

    monkeypatch.setattr(sys, "unraisablehook", unraisable)
    with transport_world("zmq", 2) as (sender, receiver):
        stop = threading.Event()

        def stream():
            while not stop.is_set():
                try:
                    sender.send(receiver.task, "load", Message(meta), timeout=10.0)
                except Exception:  # noqa: BLE001 - the receiver closes at the end
                    return

        feeder = threading.Thread(target=stream, daemon=True)
        feeder.start()
        previous = signal.signal(signal.SIGALRM, ring)
        outcomes = []
        try:
            receiver.recv(sender.task, "load", timeout=10.0)          # the stream is flowing
            for _ in range(40):
                signal.setitimer(signal.ITIMER_REAL, 0.004)
                deadline = time.monotonic() + 2.0
                try:
                    while time.monotonic() < deadline:
                        receiver.recv(sender.task, "load", timeout=2.0)
                    outcomes.append("not raised within 2 s")
                except Alarm:
                    outcomes.append("raised")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            stop.set()
    feeder.join(10.0)
    assert outcomes.count("raised") + len(lost_in_pyzmq) == len(outcomes) and len(lost_in_pyzmq) <= 2, \
        (outcomes, lost_in_pyzmq)
    swallowed = [r.getMessage()[-200:] for r in caplog.records if "Alarm" in r.getMessage()]
    assert not swallowed, swallowed


#: The plain script of an in_graph job whose step function lives in a module that only worker:1 fails to
#: import (the client imports it after the strategy; a replica imports it to find the step by name).
IN_GRAPH_SCRIPT = """\
import numpy as np
import stratagem

strategy = stratagem.strategy("in_graph")
import steps                      # the client's copy (the replicas serve inside stratagem.strategy())
for _ in range(3):
    strategy.run(steps.rows, args=(np.ones((6, 2), np.float32),))
"""
STEPS_MODULE = """\
import json, os

if json.loads(os.environ["STRATAGEM_CONFIG"])["task"]["index"] == 1:
    raise RuntimeError("this host's copy of steps.py is broken")


def rows(x):
    return x.shape[0]
"""


@pytest.mark.timeout(90)
def test_the_launcher_names_an_in_graph_replica_that_failed_setting_up_a_step(tmp_path):
    """worker:1 fails to import the step's module: the client (worker:0) fails naming worker:1, and so
    does the launcher (it named the client before: the client's error, a ConfigurationError, carried
    no culprit)."""
    (tmp_path / "train.py").write_text(IN_GRAPH_SCRIPT)
    (tmp_path / "steps.py").write_text(STEPS_MODULE)
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--worker", "3", "--grace", "1", "--timeout", "60", "--",
         sys.executable, str(tmp_path / "train.py")],
        capture_output=True, text=True, timeout=80, cwd=tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert re.search(r"stratagem launch: FAILED: worker:1 ", done.stderr), log
    assert re.search(r"\[worker:0\] \S*ReplicaError: replica 1 \(/job:worker/task:1\) could not run the step: "
                     r"RuntimeError: this host's copy of steps.py is broken", log), log


@pytest.mark.timeout(90)
def test_a_ps_task_that_loses_the_chief_names_it_to_the_launcher():
    """``between_graph``: the chief (worker:0) stopped for two peer timeouts. ps:0 fails naming it, and
    its error carries that culprit, so the launcher names worker:0 (it named ps:0 before: the ps's
    error, "the chief ... disappeared before training ended", blamed no task)."""
    from stratagem.testing.faults import run_fault

    outcome = run_fault("between_graph", "zmq", "worker:0", "sigstop_long", peer_timeout=3.0, limit=60.0)
    assert outcome.exit_code == 1, outcome.reason + outcome.output[-3000:]
    assert outcome.named.get("ps:0") == ["worker:0"], outcome.output[-3000:]
    assert outcome.launcher_culprit == "worker:0", outcome.reason + outcome.output[-3000:]


@pytest.mark.timeout(90)
def test_an_async_between_graph_job_finishes_without_a_stalled_worker_and_says_so():
    """``between_graph`` (async): worker:1 stopped for two peer timeouts. Nobody waits for it: the chief
    ends training while it is stopped, the job succeeds (its remaining steps come after the end and
    are not applied), and the output says that worker:1 was left out."""
    from stratagem.testing.faults import run_fault

    outcome = run_fault("between_graph", "zmq", "worker:1", "sigstop_long", peer_timeout=3.0, limit=60.0)
    assert outcome.exit_code == 0, outcome.reason + outcome.output[-3000:]
    assert {"worker:0", "worker:2"} <= set(outcome.trained), outcome.output[-3000:]
    assert outcome.says_left_out(), outcome.output[-3000:]


def _no_mpi() -> str | None:
    import importlib.util

    from stratagem.launch import mpi as mpi_launch

    if importlib.util.find_spec("mpi4py") is None or mpi_launch.find_mpiexec() is None:
        return "no mpi4py or mpiexec"
    return None if mpi_launch.private_netns()[0] is not None else "no private network namespace for MPI"


@pytest.mark.skipif(_no_mpi() is not None, reason=_no_mpi() or "")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["exception", "sigkill"])
def test_stratagem_launch_mpi_names_the_rank_that_failed(fault):
    """``mirrored`` over the mpi transport under ``stratagem launch --mpi``: worker:1 raises (it reports
    its own failure) or is killed outright (it reports nothing; the ranks that lose it name it). Its
    peers name worker:1, and so does the launcher (it named mpiexec:0 before: it supervises mpiexec
    only, and the ranks had nowhere to report)."""
    from stratagem.testing.faults import run_fault

    outcome = run_fault("mirrored", "mpi", "worker:1", fault, peer_timeout=3.0, limit=60.0)
    assert outcome.exit_code == 1, outcome.reason + outcome.output[-3000:]
    assert outcome.launcher_culprit == "worker:1", outcome.reason + outcome.output[-3000:]
    assert "worker:1" in outcome.reason.split(";")[0], outcome.reason
    peers = {task: named for task, named in outcome.named.items() if task != "worker:1"}
    assert peers and all(named[:1] == ["worker:1"] for named in peers.values()), outcome.output[-3000:]


def test_a_circle_of_blame_names_the_task_most_reports_name():
    """A link cut: the cut-off worker:1 hears nobody and fails naming worker:0 at the moment worker:0 and
    worker:2 fail naming it, and its report may be the earliest. The launcher follows the blame from
    there (worker:1 -> worker:0 -> worker:1, a circle) and names the task of the circle that most
    reports name: worker:1 (it named worker:0 before, where the circle closed). Real report files, as
    the tasks write them."""
    import json
    import os

    from stratagem.core.cluster import TaskId
    from stratagem.launch.failures import FailureReports, first_failure

    w0, w1, w2 = (TaskId("worker", i) for i in range(3))
    reports = FailureReports()
    try:
        for task, at, culprit in ((w1, 100.0, w0), (w0, 100.01, w1), (w2, 100.02, w1)):
            with open(reports.path(task), "w") as f:
                json.dump({"time": at, "pid": os.getpid(), "error": f"lost peer {culprit}", "culprit": str(culprit)}, f)
        failed = [type("Failed", (), {"task": t, "ended_at": None})() for t in (w1, w2)]
        blame = first_failure(failed, reports, in_job=lambda t: True, voters=[w0, w1, w2])
        assert (blame.task, blame.seen) == (w1, w1)
        # Two tasks naming each other, nobody else: a tie keeps the task the blame reached last.
        os.unlink(reports.path(w2))
        assert first_failure(failed[:1], reports, in_job=lambda t: True, voters=[w0, w1]).task == w0
    finally:
        reports.close()
