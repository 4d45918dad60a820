"""Supervising a job's processes: start them, watch their exits, the deadline and the signals sent to
the launcher, stop them (SIGTERM to each task's process group, SIGKILL after a grace period) and reap
every one, so that no process outlives the job.

Shared by every way ``stratagem launch`` runs a job: one process per task on this machine
(:mod:`.launcher`), one ``mpiexec`` for the whole job (:mod:`.mpi`), and tasks in Ray actors
(:mod:`.ray`, whose tasks offer the interface of :class:`RunningTask`). Each starts its tasks inside
a :class:`SignalTrap`, then :func:`run_to_end` watches them until the job is over and stops what is
left; :func:`kill_and_reap` in a ``finally`` makes sure of the rest::

    tasks, pump = [], OutputPump()
    try:
        with SignalTrap() as trap:
            tasks.append(RunningTask(task, start_task(task, command, env)))
            outcome = run_to_end(tasks, pump, trap, timeout=60, ps_grace=30, grace=5, started=time.monotonic())
    finally:
        kill_and_reap(tasks)
        pump.close()

The outcome becomes a :class:`LaunchResult` (every task's :class:`TaskResult`, the exit code, why).
POSIX only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.launch import failures
from stratagem.launch.failures import FailureReports
from stratagem.launch.restarts import Restarts
from stratagem.launch.task_output import OutputPump

#: Jobs whose tasks only serve the others; they may outlive the workers (see ``--ps-grace``).
SERVING_JOBS = ("ps",)

EXIT_OK = 0
EXIT_TASK_FAILED = 1
EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
#: The launcher's exit code when a signal stopped it: 128 + the signal, as a shell reports it.
EXIT_SIGNALLED = {signal.SIGINT: 128 + signal.SIGINT, signal.SIGTERM: 128 + signal.SIGTERM}

#: How often exits, deadlines and signals are checked when no output arrives.
POLL_INTERVAL = 0.05
#: How long to wait for the last output once every task has exited.
DRAIN_SECONDS = 1.0


# -- results ---------------------------------------------------------------------------------------


def describe_signal(number: int) -> str:
    """``SIGKILL`` for 9, ``signal 77`` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class TaskResult:
    """How one task ended: ``returncode`` is the exit code, or ``-N`` if signal N killed it."""

    task: TaskId
    pid: int
    returncode: int
    #: True if the launcher signalled the task (to stop it) while it was still running.
    stopped_by_launcher: bool = False
    #: How many times ``--restart-workers`` started the task again (this is the last process's result).
    restarts: int = 0
    #: True if the task failed and ``--restart-workers`` let the job go on without it.
    tolerated: bool = False

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` and the like if a signal ended the task, else None."""
        return describe_signal(-self.returncode) if self.returncode < 0 else None

    @property
    def status(self) -> str:
        """``exit 3``, ``SIGKILL``, or ``stopped by launcher (SIGTERM)``."""
        ended = self.signal_name or f"exit {self.returncode}"
        status = f"stopped by launcher ({ended})" if self.stopped_by_launcher else ended
        if self.tolerated:
            status += " (left dead: --restart-workers)"
        if self.restarts:
            status += f" (restarted {self.restarts}x)"
        return status


@dataclass(frozen=True)
class LaunchResult:
    """The outcome of a launched job (:func:`~stratagem.launch.launcher.launch`, ``--mpi``, ``--ray``): every
    task's result and the launcher's own exit code."""

    cluster: ClusterSpec
    tasks: tuple[TaskResult, ...]
    #: 0 success, 1 a task failed, 124 timed out, 130/143 stopped by SIGINT/SIGTERM.
    exit_code: int
    #: One line saying why the job ended (``worker:1 exited with code 3``).
    reason: str
    duration: float
    #: The task whose failure stopped the job, if one did.
    failed_task: TaskId | None = None
    timed_out: bool = False
    #: The signal (SIGINT, SIGTERM) that stopped the launcher, if one did.
    interrupted_by: int | None = None

    @classmethod
    def of(cls, outcome: "Outcome", cluster: ClusterSpec, tasks: Sequence["RunningTask"], started: float,
           **fields) -> "LaunchResult":
        """The result of a job that started at ``started`` (``time.monotonic()``) and ended as
        ``outcome`` says; ``fields`` replace or add to what the outcome gives (a subclass's own)."""
        given = {"reason": outcome.reason, "failed_task": outcome.failed_task, "timed_out": outcome.timed_out,
                 "interrupted_by": outcome.interrupted_by, **fields}
        return cls(cluster=cluster, tasks=tuple(t.result() for t in tasks), exit_code=outcome.exit_code,
                   duration=time.monotonic() - started, **given)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def returncodes(self) -> dict[str, int]:
        """``{"worker:0": 0, "ps:0": -15, ...}``: each task's exit code (``-N``: killed by signal N)."""
        return {r.task.short: r.returncode for r in self.tasks}

    def summary(self) -> str:
        """The text the launcher prints to stderr: one line, plus a per-task table unless all was clean."""
        verdict = "" if self.ok else "FAILED: "
        head = f"stratagem launch: {verdict}{self.reason} ({self.duration:.1f}s)"
        if self.ok and not any(r.stopped_by_launcher or r.restarts or r.tolerated for r in self.tasks):
            return head
        rows = [("task", "pid", "status")] + [
            (r.task.short, str(r.pid), r.status + ("  <- first failure" if r.task == self.failed_task else ""))
            for r in self.tasks
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        table = [f"  {t:<{widths[0]}}  {p:>{widths[1]}}  {s}" for t, p, s in rows]
        return "\n".join([head, *table])


# -- processes -------------------------------------------------------------------------------------


def signal_group(pgid: int, sig: int) -> None:
    """Signal a task's whole process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class RunningTask:
    """A started task: its process (the leader of its own process group) and whether we stopped it."""

    def __init__(self, task: TaskId, process: subprocess.Popen):
        self.task = task
        self.process = process
        self.stopped_by_launcher = False
        self.restarts = 0        # --restart-workers: how many times this task was started again
        self.tolerated = False   # --restart-workers: it failed and the job goes on without it
        self.ended_at: float | None = None   # time.time() when its exit was first seen

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def poll(self) -> int | None:
        """Reap the process if it has exited; then kill what it left behind in its group."""
        if not self.running:
            return self.process.returncode
        code = self.process.poll()
        if code is not None:
            self.ended_at = time.time()
            # The task is over. Its group may still hold processes it started (daemons, a forked
            # data loader); they must not outlive it. Signalled now, while the group id cannot
            # yet have been reused by an unrelated process.
            signal_group(self.process.pid, signal.SIGKILL)
        return code

    def send(self, sig: int) -> None:
        """Signal the task's group if the task is still running, and remember that we stopped it."""
        if self.poll() is None:
            self.stopped_by_launcher = True
            signal_group(self.process.pid, sig)

    def result(self) -> TaskResult:
        return TaskResult(self.task, self.process.pid, self.process.returncode, self.stopped_by_launcher,
                          self.restarts, self.tolerated)


#: Run between the fork and the task's own program: ask for SIGKILL when the launcher dies, make
#: sure it has not died already, then exec the task. A tiny Python program (``-S``: no site import)
#: instead of a ``preexec_fn``, because a ``preexec_fn`` makes subprocess use fork() and run Python
#: code in the child, where libraries with fork handlers (gRPC's event engine) abort the child.
_DEATHSIG_SHIM = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the launcher died before prctl took effect\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_launcher(command: Sequence[str]) -> list[str]:
    """``command``, started so that it gets SIGKILL when the launcher dies (Linux only).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits; a launch supervises
    its tasks in that same thread, so that is the launcher's lifetime. It survives ``exec``.
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-S", "-c", _DEATHSIG_SHIM, str(os.getpid()), *command]


def start_task(task: TaskId, command: Sequence[str], env: dict[str, str],
               cwd: str | None = None) -> subprocess.Popen:
    """Start ``task``'s process: its own process group (signalled as a whole), its output piped, its
    death tied to ours (:func:`die_with_launcher`). A program that cannot run is a ``ConfigurationError``."""
    try:
        return subprocess.Popen(
            die_with_launcher(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, cwd=cwd,
        )
    except OSError as exc:
        raise ConfigurationError(
            f"cannot start {task.short}: {command[0]!r} failed to run ({exc}); check the command after '--'"
        ) from None


# -- signals ---------------------------------------------------------------------------------------


class SignalTrap:
    """Records SIGINT/SIGTERM sent to the launcher instead of dying, for the duration of a launch.

    Handlers can only be installed from the main thread; elsewhere this records nothing (signals
    go to the main thread anyway) and the caller's own handling applies.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "SignalTrap":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum, frame) -> None:
        self.received.append(signum)


# -- supervision -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """Why supervision ended, before the tasks are stopped."""

    reason: str
    exit_code: int
    failed_task: TaskId | None = None
    timed_out: bool = False
    interrupted_by: int | None = None
    #: False while the evidence may still change which task failed first (``failures.Blame.settled``).
    settled: bool = True


def first_failure(tasks: list[RunningTask], restarts: Restarts | None = None,
                  reports: FailureReports | None = None, until: float | None = None) -> Outcome | None:
    """The task that failed first, if one failed on its own (non-zero exit or killed by a signal we
    did not send): with the tasks' failure ``reports``, the one the earliest failure blames, which may
    still run (stopped, or still ending); without them, the first seen exiting
    (:mod:`stratagem.launch.failures`).

    A task the ``restarts`` policy covers is never one: the policy restarts or tolerates it when it
    next looks, even if it died just after the policy's last look."""
    failed = []
    for t in tasks:
        if restarts is not None and restarts.covers(t.task):
            continue
        code = t.poll()
        if code and not t.stopped_by_launcher and not t.tolerated:
            failed.append(t)
    if not failed:
        return None
    known = {t.task: t for t in tasks}

    def may_blame(task: TaskId) -> bool:   # a task of this job that did not finish cleanly, nor is restarted
        return task in known and known[task].poll() != 0 and (restarts is None or not restarts.covers(task))

    blame = failures.first_failure(failed, reports, in_job=may_blame, voters=[t.task for t in tasks], until=until)
    code = known[blame.task].poll()
    if known[blame.task].stopped_by_launcher:
        code = None   # judged again after the stop: how it ended is the launcher's doing, not its failure
    own = reports.report(blame.task) if reports is not None and code is None else None
    if code is not None:
        how = f"was killed by {describe_signal(-code)}" if code < 0 else f"exited with code {code}"
    elif own is not None:   # it failed, and is still ending (closing its transport...)
        how = f"failed ({own['error']})"
    else:
        how = f"stopped responding ({blame.seen.short} lost it: {blame.error})"
    if blame.by_losses:
        how += " (cut off: every loss of a peer the tasks noted involves it)"
    return Outcome(f"{blame.task.short} {how}; stopped the other tasks", EXIT_TASK_FAILED, blame.task,
                   settled=blame.settled)


def supervise(tasks: list[RunningTask], pump: OutputPump, trap: SignalTrap, *,
              timeout: float | None, ps_grace: float, started: float,
              restarts: Restarts | None = None, reports: FailureReports | None = None) -> Outcome:
    """Watch the running job until it is over or must be stopped; say why. ``restarts``: the
    ``--restart-workers`` policy, which may start a failed worker again (in place in ``tasks``);
    ``reports``: where the tasks report their failures (to name the one that failed first)."""
    deadline = started + timeout if timeout is not None else None
    ps_deadline = None
    unsettled_until = None   # how long an unsettled blame waits for the losses still to come
    while True:
        pump.pump(POLL_INTERVAL)
        now = time.monotonic()
        if trap.received:
            sig = trap.received[0]
            return Outcome(f"interrupted by {describe_signal(sig)}; stopped every task",
                           EXIT_SIGNALLED[sig], interrupted_by=sig)
        # Which tasks are over, looked at before their exit codes: a task that exits between the two
        # looks is then seen failing, never counted as finished without its code being checked. The
        # restart policy looks after that snapshot, so each covered worker over in it has been
        # restarted (a new process, not in ``over``) or tolerated by the time the job is judged; one
        # that dies later is left to the policy's next look (first_failure skips it).
        over = {id(t) for t in tasks if t.poll() is not None}
        if restarts is not None:
            restarts.handle(tasks)   # may replace a dead worker in ``tasks`` by its new process
        drivers = [t for t in tasks if t.task.job not in SERVING_JOBS]
        failure = first_failure(tasks, restarts, reports)
        if failure:
            if failure.settled or len(over) == len(tasks) or (deadline is not None and now >= deadline):
                return failure
            # Which task failed first is not clear yet (a cut-off task names a live peer): the other
            # tasks' losses are still coming, a heartbeat interval apart. Wait for them, a moment.
            if unsettled_until is None:
                unsettled_until = now + failures.evidence_wait(reports, [t.task for t in tasks])
            if now >= unsettled_until:
                return failure
            continue
        if len(over) == len(tasks):
            what = f"all {len(tasks)} tasks" if len(tasks) > 1 else "the task"
            left = [t.task.short for t in tasks if t.tolerated]
            if left:
                what = f"every task but {', '.join(left)} (left dead: --restart-workers)"
            return Outcome(f"{what} finished successfully", EXIT_OK)
        if all(id(t) in over for t in drivers):
            # Only serving tasks are left; they get a grace period to notice and exit.
            if ps_deadline is None:
                ps_deadline = now + ps_grace
            if now >= ps_deadline or (deadline is not None and now >= deadline):
                left = ", ".join(t.task.short for t in tasks if t.running)
                return Outcome(f"every worker task succeeded; stopped {left}, still serving after the "
                               f"{ps_grace:g}s ps grace period (not a failure)", EXIT_OK)
        elif deadline is not None and now >= deadline:
            return Outcome(f"timed out after {timeout:g}s (--timeout); stopped every task",
                           EXIT_TIMEOUT, timed_out=True)


def stop(tasks: list[RunningTask], pump: OutputPump, trap: SignalTrap, grace: float) -> None:
    """SIGTERM every running task's group; SIGKILL what is left after ``grace`` seconds.

    A signal to the launcher during the grace period (a second Ctrl-C) skips the rest of it.
    """
    signals_before = len(trap.received)
    for t in tasks:
        t.send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(t.poll() is None for t in tasks):
        if time.monotonic() >= deadline or len(trap.received) > signals_before:
            break
        pump.pump(POLL_INTERVAL)
    kill_and_reap(tasks)


def kill_and_reap(tasks: list[RunningTask]) -> None:
    """SIGKILL whatever still runs and wait for every process, so none is left a zombie or orphan."""
    for t in tasks:
        t.send(signal.SIGKILL)  # the whole group: the task and anything it started
    for t in tasks:
        t.process.wait()


def run_to_end(tasks: list[RunningTask], pump: OutputPump, trap: SignalTrap, *, timeout: float | None,
               ps_grace: float, grace: float, started: float, restarts: Restarts | None = None,
               reports: FailureReports | None = None) -> Outcome:
    """Watch the started job until it is over (:func:`supervise`), stop what still runs (:func:`stop`),
    and let the last output arrive; say why the job ended."""
    outcome = supervise(tasks, pump, trap, timeout=timeout, ps_grace=ps_grace, started=started, restarts=restarts,
                        reports=reports)
    stopping = time.time()
    stop(tasks, pump, trap, grace)
    pump.drain(DRAIN_SECONDS, POLL_INTERVAL)
    if outcome.failed_task is not None and reports is not None:
        # Judged again with the reports written while the job was being stopped: when a link is cut,
        # the cut-off task may fail first naming a peer, and its peers' reports naming it come a few
        # tenths of a second later (see failures.first_failure: the most named of a circle of blame).
        # Not with what was written after the stop began: stopped tasks lose each other.
        again = first_failure(tasks, restarts, reports, until=stopping)
        if again is not None:
            outcome = again
    return outcome
