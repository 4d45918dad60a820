"""The launcher names a task cut off from the network, not the live peer it blames (issue #23, the link
cells of the fault matrix; :mod:`stratagem.launch.failures`, rule 3).

A cut-off task hears nobody: it fails naming a peer that is alive, and under ``parameter_server`` the
peers that lost it go on without it (the coordinator reruns its closures) and report nothing. Its
report alone reads like one from a task whose peer stopped. What tells them apart is the peers each
task lost, which every task notes (:func:`stratagem.core.failures.note_lost`, from the transports'
mailboxes): the cut-off task lost all of its peers and they lost it; a stopped task was lost by all of
its peers. The reports and notes here are real files, written by the functions the tasks call.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from stratagem.core import failures as task_side
from stratagem.core.cluster import TaskId
from stratagem.core.failures import FAILURE_FILE_ENV
from stratagem.core.transport import Message
from stratagem.launch.failures import FailureReports, first_failure
from stratagem.testing.world import transport_world

pytestmark = pytest.mark.timeout(30)

W0, W1, W2, PS0 = TaskId("worker", 0), TaskId("worker", 1), TaskId("worker", 2), TaskId("ps", 0)
JOB = (W0, W1, W2, PS0)


@pytest.fixture
def reports():
    made = FailureReports()
    yield made
    made.close()


def as_task(monkeypatch, reports: FailureReports, task: TaskId) -> None:
    """From here on this process writes what ``task`` would: its report and its losses."""
    monkeypatch.setenv(FAILURE_FILE_ENV, reports.path(task))


def lose(monkeypatch, reports, task: TaskId, *peers: TaskId) -> None:
    as_task(monkeypatch, reports, task)
    for peer in peers:
        task_side.note_lost(peer, f"connection to {peer} was lost (the process died, or the network failed)")


def fail(monkeypatch, reports, task: TaskId, culprit: TaskId | None) -> None:
    as_task(monkeypatch, reports, task)
    task_side.report_failure(f"lost peer {culprit}" if culprit else "RuntimeError: my own", culprit)


def judge(reports, *failed: TaskId, until: float | None = None):
    return first_failure([SimpleNamespace(task=t, ended_at=None) for t in failed], reports,
                         in_job=lambda t: t in JOB, voters=JOB, until=until)


def test_a_cut_off_worker_that_names_a_live_peer_is_named_from_the_losses(monkeypatch, reports):
    """The parameter_server cell: worker:1's link is cut. ps:0 and the coordinator lose it and go on;
    worker:1 loses both and fails blaming the coordinator. The launcher used to name worker:0."""
    lose(monkeypatch, reports, PS0, W1)
    lose(monkeypatch, reports, W0, W1)
    lose(monkeypatch, reports, W1, PS0, W0)
    fail(monkeypatch, reports, W1, W0)
    blame = judge(reports, W1)
    assert (blame.task, blame.seen, blame.settled, blame.by_losses) == (W1, W1, True, True)
    # The cut-off task's own losses are enough: it lost two peers that lost nobody else.
    for task in (PS0, W0):
        os.unlink(reports.path(task) + task_side.LOSSES_SUFFIX)
    assert judge(reports, W1).task == W1


def test_a_stopped_task_is_still_the_one_its_peers_lost(monkeypatch, reports):
    """worker:0 stopped (SIGSTOP): worker:1 fails naming it, the others lost it and go on."""
    fail(monkeypatch, reports, W1, W0)
    lose(monkeypatch, reports, W1, W0)
    lose(monkeypatch, reports, PS0, W0)
    lose(monkeypatch, reports, W2, W0)
    blame = judge(reports, W1)
    assert (blame.task, blame.settled, blame.by_losses) == (W0, True, False)


def test_one_loss_alone_is_not_settled_and_a_goodbye_is_no_loss(monkeypatch, reports):
    """worker:1 lost the coordinator and nothing else is known: it was cut off, or the coordinator
    stopped. The blame stays where it reached (the coordinator) and is not settled: the launcher waits
    for the other tasks' losses. A peer that said goodbye (it ended) is not noted as lost, so it does
    not make the task that heard it look cut off."""
    fail(monkeypatch, reports, W1, W0)
    lose(monkeypatch, reports, W1, W0)
    as_task(monkeypatch, reports, W1)
    task_side.note_lost(W2, f"{W2} closed its transport")
    assert reports.losses(W1) and all(peer == str(W0) for _, peer in reports.losses(W1))
    blame = judge(reports, W1)
    assert (blame.task, blame.settled) == (W0, False)
    # Then ps:0's loss of worker:1 arrives: worker:1 is the one every loss involves.
    lose(monkeypatch, reports, PS0, W1)
    assert judge(reports, W1).task == W1
    # ...unless it came after the launcher began stopping the job (stopped tasks lose each other).
    assert judge(reports, W1, until=time.time() - 60).task == W0


def test_a_task_that_failed_on_its_own_is_named_whatever_was_lost(monkeypatch, reports):
    fail(monkeypatch, reports, W2, None)          # raised: blames nobody
    fail(monkeypatch, reports, W0, W2)
    lose(monkeypatch, reports, W0, W1, PS0)      # even a task that looks cut off
    blame = judge(reports, W2, W0)
    assert (blame.task, blame.settled, blame.by_losses) == (W2, True, False)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_peer_that_closes_its_transport_is_not_noted_lost_one_that_aborts_is(monkeypatch, reports, transport, end):
    """The transport's reason for a goodbye is the one note_lost leaves out; a peer that vanishes
    without one (``abort``: as a crash) is noted, once (a real pair of each transport)."""
    as_task(monkeypatch, reports, W0)
    with transport_world(transport, 2) as (a, b):
        b.send(a.task, "t", _message())
        a.recv(b.task, "t", timeout=10)
        a.send(b.task, "t", _message())
        b.recv(a.task, "t", timeout=10)
        getattr(b, end)()
        deadline = time.monotonic() + 10
        while b.task not in a.lost_peers() and time.monotonic() < deadline:
            time.sleep(0.01)
        said_goodbye = task_side.SAID_GOODBYE in a.lost_peers()[b.task]
        assert said_goodbye == (end == "close"), a.lost_peers()[b.task]
    assert [peer for _, peer in reports.losses(W0)] == ([] if end == "close" else [str(b.task)])


def _message():
    return Message({"k": 1}, [])
