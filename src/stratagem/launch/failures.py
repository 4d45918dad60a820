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

    >>> reports = FailureReports()
    >>> sorted(reports.env(TaskId("worker", 1)))
    ['STRATAGEM_FAILURE_FILE']
    >>> reports.report(TaskId("worker", 1)) is None
    True
    >>> reports.close()
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

from stratagem.core.cluster import TaskId
from stratagem.core.failures import FAILURE_FILE_ENV, read_report


class FailureReports:
    """The directory where a job's tasks report their failures (one file each), made for one launch."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="stratagem-failures-")

    def path(self, task: TaskId) -> str:
        return os.path.join(self.directory, f"{task.job}-{task.index}.json")

    def env(self, task: TaskId) -> dict[str, str]:
        """What to add to ``task``'s environment. A report left by an earlier process of the task (one
        ``--restart-workers`` replaces) is removed: the new process reports its own failure."""
        try:
            os.unlink(self.path(task))
        except FileNotFoundError:
            pass
        return {FAILURE_FILE_ENV: self.path(task)}

    def report(self, task: TaskId) -> dict | None:
        """``task``'s report (``time``, ``error``, ``culprit``), or None if it wrote none."""
        return read_report(self.path(task))

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass(frozen=True)
class Blame:
    """The task that failed first, and how it was found."""

    task: TaskId
    #: The earliest failure seen, which named ``task`` (itself when ``task`` failed on its own first).
    seen: TaskId
    #: The error ``seen`` reported, if it reported one.
    error: str | None


def first_failure(failed: Sequence, reports: FailureReports | None, *, in_job: Callable[[TaskId], bool],
                  voters: Sequence[TaskId] = ()) -> Blame:
    """Of ``failed`` (running tasks that failed on their own: ``task``, ``ended_at``), the task that
    failed first (see the module doc). ``in_job(task)``: whether a blamed task may be named (a task
    of this job, not one a restart policy looks after).

    When the blame goes round in a circle (a task cut off from the network hears nobody and names a
    peer at the moment its peers name it), the task of the circle that the most reports name is the
    one, counting the reports of ``voters`` (every task of the job) and of ``failed``: the cut-off task
    names one peer, its peers all name it. A tie keeps the task the blame reached last."""
    def report(task: TaskId) -> dict | None:
        return reports.report(task) if reports is not None else None

    def when(t) -> float:
        r = report(t.task)
        return r["time"] if r is not None else getattr(t, "ended_at", None) or float("inf")

    earliest = min(failed, key=when)   # ties: the first in the job's order, as before
    first = report(earliest.task)
    task, seen = earliest.task, {earliest.task}
    r = first
    chain = [task]
    while r is not None and r["culprit"] is not None:
        try:
            blamed = TaskId.parse(r["culprit"])
        except ValueError:
            break
        if blamed in seen and in_job(blamed):
            task = _most_named(chain[chain.index(blamed):], task, [*voters, *(t.task for t in failed)], report)
            break
        if blamed in seen or not in_job(blamed):
            break
        task = blamed
        seen.add(blamed)
        chain.append(blamed)
        r = report(blamed)
    return Blame(task, earliest.task, first["error"] if first is not None else None)


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
