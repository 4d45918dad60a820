"""Which task failed first: the one the launcher names in its headline and marks ``<- first failure``.

The order in which a job's processes exit does not say it. A task that raises still closes its
transport (its peers hear of the failure from that) and may exit after the peers that fail because
of it; a stopped (``SIGSTOP``) task never exits, its peers fail for it once the peer timeout has
passed. So every task started by ``stratagem launch`` gets a file to report its failure in
(:mod:`stratagem.core.failures`: the time it failed, its error, and the task its error blames), and
:func:`first_failure` reads them:

1. Of the tasks that failed on their own, the earliest: by the time in its report, else by when the
   launcher saw it exit (a task killed by a signal writes nothing).
2. From there, the blamed tasks in turn (a peer that lost ``worker:1`` blames ``worker:1``; a replica
   whose client lost a worker blames the client, which blames the worker), up to a task that blames
   no one: the one that failed first, whether it raised, was killed, or stopped responding.
3. Unless the blame ends at a task that never failed on its own (it is still running, or was stopped
   by the launcher, and wrote no report) or goes round in a circle: then a task cut off from the
   network may be the one, which hears nobody and so fails naming a peer that is alive. The peers
   each task lost decide (every task notes them, failing or not: :func:`stratagem.core.failures.note_lost`):
   a cut-off task lost every peer it had and each of them lost it, a stopped task was lost by each
   of its peers, so the one task that every loss (and every report's blame) involves is the one.
   Where no single task is (one loss alone, or two tasks that lost each other) the blame is not
   *settled*: the launcher waits a moment (:func:`evidence_wait`) for the losses still to come before
   it stops the job, then names the task the blame reached (in a circle, the one the most reports name).

    >>> reports = FailureReports()
    >>> sorted(reports.env(TaskId("worker", 1)))
    ['STRATAGEM_FAILURE_FILE']
    >>> reports.report(TaskId("worker", 1)) is None
    True
    >>> reports.close()
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

from stratagem.core.cluster import TaskId
from stratagem.core.failures import FAILURE_FILE_ENV, LOSSES_SUFFIX, read_losses, read_report
from stratagem.launch.scratch import ScratchDir


class FailureReports:
    """The directory where a job's tasks report their failures (one file each), made for one launch."""

    def __init__(self):
        self._scratch = ScratchDir("failures")
        self.directory = self._scratch.path

    def path(self, task: TaskId) -> str:
        return os.path.join(self.directory, f"{task.job}-{task.index}.json")

    def env(self, task: TaskId) -> dict[str, str]:
        """What to add to ``task``'s environment. A report left by an earlier process of the task (one
        ``--restart-workers`` replaces) is removed: the new process reports its own failure."""
        for old in (self.path(task), self.path(task) + LOSSES_SUFFIX):
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
        return {FAILURE_FILE_ENV: self.path(task)}

    def report(self, task: TaskId) -> dict | None:
        """``task``'s report (``time``, ``error``, ``culprit``, ``peer_timeout``), or None if it wrote none."""
        return read_report(self.path(task))

    def losses(self, task: TaskId) -> list[tuple[float, str]]:
        """The peers ``task`` noted it lost: ``(time, peer)`` each (:func:`~stratagem.core.failures.note_lost`)."""
        return read_losses(self.path(task))

    def close(self) -> None:
        self._scratch.close()


@dataclass(frozen=True)
class Blame:
    """The task that failed first, and how it was found."""

    task: TaskId
    #: The earliest failure seen, which named ``task`` (itself when ``task`` failed on its own first).
    seen: TaskId
    #: The error ``seen`` reported, if it reported one.
    error: str | None
    #: False when the evidence may still change the verdict (see the module doc, 3.): the launcher may
    #: wait a moment for the losses still to come.
    settled: bool = True
    #: True when the losses named ``task`` (the one task every loss involves) where the blame reached
    #: another: a cut-off task, which had named a peer that is alive.
    by_losses: bool = False


#: The least and the most seconds the launcher waits for losses still to come (:func:`evidence_wait`).
EVIDENCE_WAIT = (1.0, 3.0)


def evidence_wait(reports: FailureReports | None, tasks: Sequence[TaskId]) -> float:
    """How long to wait for the losses still to come when the blame is not settled: a cut-off task's
    connections are each lost a peer timeout after the cut, and at most a tenth of it later (the
    heartbeat interval), on both sides. Half the peer timeout the reports give, within
    :data:`EVIDENCE_WAIT` (its most when no report gives one)."""
    given = [r["peer_timeout"] for r in (reports.report(t) for t in tasks) if r is not None and r["peer_timeout"]]
    least, most = EVIDENCE_WAIT
    return min(max(max(given) / 2, least), most) if given else most


def first_failure(failed: Sequence, reports: FailureReports | None, *, in_job: Callable[[TaskId], bool],
                  voters: Sequence[TaskId] = (), until: float | None = None) -> Blame:
    """Of ``failed`` (running tasks that failed on their own: ``task``, ``ended_at``), the task that
    failed first (see the module doc). ``in_job(task)``: whether a blamed task may be named (a task
    of this job, not one a restart policy looks after). ``voters``: every task of the job, whose
    reports and losses are evidence; ``until``: the time (``time.time()``) after which losses and
    reports are not (the launcher stopping the job makes its tasks lose each other).

    When the blame goes round in a circle and the losses name no single task, the task of the circle
    that the most reports name is the one, counting the reports of ``voters`` and of ``failed``: the
    cut-off task names one peer, its peers all name it. A tie keeps the task the blame reached last.
    ``reports`` without ``losses(task)`` give reports only."""
    def report(task: TaskId) -> dict | None:
        return reports.report(task) if reports is not None else None

    def when(t) -> float:
        r = report(t.task)
        return r["time"] if r is not None else getattr(t, "ended_at", None) or float("inf")

    earliest = min(failed, key=when)   # ties: the first in the job's order, as before
    first = report(earliest.task)
    task, seen = earliest.task, {earliest.task}
    r = first
    chain, circle = [task], None
    while r is not None and r["culprit"] is not None:
        try:
            blamed = TaskId.parse(r["culprit"])
        except ValueError:
            break
        if blamed in seen and in_job(blamed):
            circle = chain[chain.index(blamed):]
            break
        if blamed in seen or not in_job(blamed):
            break
        task = blamed
        seen.add(blamed)
        chain.append(blamed)
        r = report(blamed)
    error = first["error"] if first is not None else None
    if circle is None and (r is not None or task in {t.task for t in failed}):
        return Blame(task, earliest.task, error)    # it failed on its own: raised, exited or was killed
    everyone = list(dict.fromkeys([*voters, *(t.task for t in failed)]))
    cut = _in_every_loss(everyone, reports, in_job, until)
    if cut is not None and cut in (circle or chain):
        return Blame(cut, earliest.task, error, settled=True, by_losses=cut != task)
    if circle is not None:
        task = _most_named(circle, task, everyone, report)
    return Blame(task, earliest.task, error, settled=False)


def _in_every_loss(tasks: Sequence[TaskId], reports, in_job, until: float | None) -> TaskId | None:
    """The one task that each loss ``tasks`` noted (and each report's blame) involves, as the task
    that lost or as the one lost, if exactly one does; None without losses, or with several such
    tasks (one loss alone; two tasks that lost each other) or none (losses of unrelated tasks)."""
    losses = getattr(reports, "losses", None)
    involved: set[TaskId] | None = None
    for task in tasks:
        r = reports.report(task) if reports is not None else None
        named = [(r["time"], r["culprit"])] if r is not None and r["culprit"] is not None else []
        named += losses(task) if losses is not None else []
        for at, peer in named:
            if until is not None and at > until:
                continue
            try:
                lost = TaskId.parse(peer)
            except ValueError:
                continue
            if lost == task or not in_job(lost):
                continue    # a task that finished cleanly, or one a restart policy looks after
            involved = {task, lost} if involved is None else involved & {task, lost}
            if not involved:
                return None
    return next(iter(involved)) if involved is not None and len(involved) == 1 else None


def _most_named(circle: list[TaskId], last: TaskId, voters, report) -> TaskId:
    """The task of ``circle`` that the most of ``voters``' reports blame (``last`` on a tie)."""
    votes = {t: 0 for t in circle}
    for voter in dict.fromkeys(voters):
        r = report(voter)
        try:
            named = TaskId.parse(r["culprit"]) if r is not None and r["culprit"] is not None else None
        except ValueError:
            named = None
        if named in votes:
            votes[named] += 1
    best = max(votes.values())
    leaders = [t for t, n in votes.items() if n == best]
    return last if last in leaders else leaders[0]
