"""``stratagem launch --restart-workers N``: a worker that dies does not end the job (elastic training).

Without the option, a task that fails stops the whole job. With it, a ``worker`` task other than the
chief that exits non-zero or is killed (by a signal the launcher did not send) is started again, with
the same ``STRATAGEM_CONFIG`` (so the same address) plus ``STRATAGEM_RESTARTS=<n>``, up to ``N`` times
per task while the chief runs; after that (and with ``N = 0``) it is left dead and the job goes on with
the others. That is what ``stratagem.strategy("mirrored", on_failure="shrink")`` needs: the survivors
carry on, and a restarted worker rejoins them at their next commit. The chief (``chief:0``, else
``worker:0``) coordinates them, so its failure still ends the job, as does any ``ps`` task's.

The job succeeds when every task still counted exits 0; the summary table lists the restarts and the
workers left dead.
"""

from __future__ import annotations

from typing import Callable

from stratagem.core.cluster import ClusterSpec, TaskId

#: The variable a restarted task finds in its environment: how many times it was restarted (1, 2, ...).
RESTARTS_ENV = "STRATAGEM_RESTARTS"


class Restarts:
    """The restart policy of one launch (see the module doc).

    ``start(task, restarts)`` starts the task again and returns its new running task;
    ``report(line)`` tells the user what happened.
    """

    def __init__(self, limit: int, cluster: ClusterSpec, start: Callable, report: Callable[[str], None]):
        self.limit = limit
        self.chief = cluster.chief
        self._start = start
        self._report = report

    def covers(self, task: TaskId) -> bool:
        """Whether a failure of ``task`` is the policy's to handle (a worker that is not the chief)."""
        return task.job == "worker" and task != self.chief

    def handle(self, tasks: list) -> None:
        """Restart (in place in ``tasks``) or tolerate every covered task that failed on its own."""
        chief_running = any(t.task == self.chief and t.poll() is None for t in tasks)
        for index, running in enumerate(tasks):
            code = running.poll()
            if not code or running.stopped_by_launcher or running.tolerated or not self.covers(running.task):
                continue
            how = f"was killed by {running.result().signal_name}" if code < 0 else f"exited with code {code}"
            if running.restarts < self.limit and chief_running:
                restarted = self._start(running.task, running.restarts + 1)
                restarted.restarts = running.restarts + 1
                tasks[index] = restarted
                self._report(f"stratagem launch: {running.task.short} {how}; started it again "
                             f"({restarted.restarts} of {self.limit}, --restart-workers)")
            else:
                running.tolerated = True
                why = "the chief has finished" if not chief_running else f"restarted {running.restarts} time(s) already"
                self._report(f"stratagem launch: {running.task.short} {how}; the others go on without it "
                             f"(--restart-workers {self.limit}: {why})")
