"""Start a local cluster: one process per task, each told its place by STRATAGEM_CONFIG, output prefixed by task.

``stratagem launch`` runs the same command once per task of a cluster on this machine and supervises
the processes as one job::

    stratagem launch --worker 2 --ps 1 -- python train.py --epochs 3

    [worker:0] step 10 loss 0.42
    [ps:0] serving 2 variables
    [worker:1] step 10 loss 0.43
    stratagem launch: all 3 tasks finished successfully (4.1s)

What each task gets, in its environment:

- ``STRATAGEM_CONFIG``: ``{"cluster": {...}, "task": {"type": "worker", "index": 1}}`` (the shape of
  TensorFlow's ``TF_CONFIG``), every task on ``127.0.0.1`` (``--host``) with a port found free when the
  job starts. ``ClusterResolver.from_env()`` reads it.
- ``STRATAGEM_SECRET``: the cluster secret, so a local cluster is authenticated by default. It is
  ``--secret`` if given, else the launcher's own ``STRATAGEM_SECRET``, else a fresh random one per job.
  Prefer the environment variable to ``--secret``: command lines are visible to every local user.
- ``STRATAGEM_TRANSPORT``: the ``--transport`` value, when given: the transport that
  ``stratagem.strategy()``, ``stratagem.communicator()`` and every strategy use when the script names
  none (else ``zmq``). An unknown or unusable transport is a usage error before anything starts.
- ``PYTHONUNBUFFERED=1``, so lines appear as they are printed.

How the job ends:

- Every task exits 0: the launcher exits 0 and prints a one-line summary to stderr.
- A task exits non-zero or is killed by a signal: the others are stopped (SIGTERM to each task's
  process group, SIGKILL after ``--grace`` seconds) and the launcher exits 1 with a per-task table.
- Tasks that only serve (``ps``) may outlive the workers: once every ``chief``/``worker`` task has
  exited 0 they get ``--ps-grace`` seconds to exit on their own, then they are stopped. Being stopped
  then is *not* a failure (the table says so); a ps task exiting non-zero on its own is.
- ``--restart-workers N``: a worker other than the chief that fails does not stop the job: it is
  started again (``STRATAGEM_RESTARTS=<n>`` in its environment), up to N times, then left dead while
  the others go on (:mod:`stratagem.launch.restarts`; for ``on_failure="shrink"``).
- ``--timeout``: the whole job is stopped after that many seconds; the launcher exits 124. (If the
  workers have all succeeded by then, it only cuts the ps grace period short, and the job succeeds.)
- Ctrl-C or SIGTERM to the launcher stops every task the same way; it exits 130 or 143. A second signal
  while stopping skips the rest of the grace period.

No process outlives the job: each task runs in its own process group, which is signalled as a whole
(so the task's own children go too); a task's leftover children are killed as soon as the task
exits; on Linux each task also dies with the launcher even if the launcher is SIGKILLed
(``PR_SET_PDEATHSIG``; that covers the task's main process, not processes it started itself). POSIX only.

The same from Python (``stratagem bench`` and the tests use it)::

    from stratagem.launch.launcher import launch
    result = launch(["python", "train.py"], workers=2, ps=1, timeout=600)
    result.ok, result.exit_code, result.returncodes   # True, 0, {'worker:0': 0, 'worker:1': 0, 'ps:0': 0}
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence, TextIO

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.core.ports import format_address, reserve_ports
from stratagem.launch.restarts import RESTARTS_ENV, Restarts
from stratagem.launch.task_output import COLORS, OutputPump, PipeReader, Sink, task_prefix

#: Seconds between SIGTERM and SIGKILL when the launcher stops tasks.
DEFAULT_GRACE = 5.0
#: Seconds ps tasks may keep serving after every worker has finished, before they are stopped.
DEFAULT_PS_GRACE = 30.0
#: Jobs whose tasks only serve the others; they may outlive the workers (see ``--ps-grace``).
SERVING_JOBS = ("ps",)

EXIT_OK = 0
EXIT_TASK_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
#: The launcher's exit code when a signal stopped it: 128 + the signal, as a shell reports it.
EXIT_SIGNALLED = {signal.SIGINT: 128 + signal.SIGINT, signal.SIGTERM: 128 + signal.SIGTERM}

_POLL_INTERVAL = 0.05  # how often exits, deadlines and signals are checked when no output arrives
_DRAIN_SECONDS = 1.0  # how long to wait for the last output once every task has exited
_EPILOG = """\
example:
  stratagem launch --worker 2 --ps 1 -- python train.py --epochs 3

Each task gets STRATAGEM_CONFIG (its cluster and task, TF_CONFIG-shaped), STRATAGEM_SECRET and,
with --transport, STRATAGEM_TRANSPORT (the transport a script gets when it names none). Output
lines are prefixed with the task ([worker:1] ...).
With --ray ADDRESS the same job runs as Ray actors, one per task, on the nodes Ray chooses:
  stratagem launch --ray auto --worker 4 --ps 2 --spread -- python3 train.py
With --timeline trace.json every task records where its steps go; the launcher merges them:
  stratagem launch --timeline trace.json --worker 3 -- python3 train.py
  stratagem timeline summary trace.json        # step breakdown, waits per peer, the straggler
Exit status: 0 all tasks succeeded (ps tasks stopped after --ps-grace count as success), 1 a task
failed, 2 usage error, 124 --timeout expired, 130/143 interrupted by SIGINT/SIGTERM.
"""


# -- results ---------------------------------------------------------------------------------------


def _signal_name(number: int) -> str:
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
        return _signal_name(-self.returncode) if self.returncode < 0 else None

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
    """The outcome of :func:`launch`: every task's result and the launcher's own exit code."""

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


def _signal_group(pgid: int, sig: int) -> None:
    """Signal a task's whole process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _RunningTask:
    """A started task: its process (the leader of its own process group) and whether we stopped it."""

    def __init__(self, task: TaskId, process: subprocess.Popen):
        self.task = task
        self.process = process
        self.stopped_by_launcher = False
        self.restarts = 0        # --restart-workers: how many times this task was started again
        self.tolerated = False   # --restart-workers: it failed and the job goes on without it

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def poll(self) -> int | None:
        """Reap the process if it has exited; then kill what it left behind in its group."""
        if not self.running:
            return self.process.returncode
        code = self.process.poll()
        if code is not None:
            # The task is over. Its group may still hold processes it started (daemons, a forked
            # data loader); they must not outlive it. Signalled now, while the group id cannot
            # yet have been reused by an unrelated process.
            _signal_group(self.process.pid, signal.SIGKILL)
        return code

    def send(self, sig: int) -> None:
        """Signal the task's group if the task is still running, and remember that we stopped it."""
        if self.poll() is None:
            self.stopped_by_launcher = True
            _signal_group(self.process.pid, sig)

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


def _die_with_launcher(command: Sequence[str]) -> list[str]:
    """``command``, started so that it gets SIGKILL when the launcher dies (Linux only).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits; :func:`launch` waits
    for its tasks in that same thread, so that is the launcher's lifetime. It survives ``exec``.
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-S", "-c", _DEATHSIG_SHIM, str(os.getpid()), *command]


def _plan_cluster(workers: int, ps: int, chief: bool, host: str) -> tuple[ClusterSpec, dict[TaskId, socket.socket]]:
    """The cluster to launch, and for each task the socket holding its port until it starts."""
    counts = {"chief": 1 if chief else 0, "worker": workers, "ps": ps}
    ip, held = reserve_ports(host, sum(counts.values()))
    ports = iter(held)
    jobs = {job: [next(ports) for _ in range(n)] for job, n in counts.items() if n}
    cluster = ClusterSpec({job: [format_address(ip, s.getsockname()[1]) for s in socks]
                           for job, socks in jobs.items()})
    holders = {TaskId(job, i): sock for job, socks in jobs.items() for i, sock in enumerate(socks)}
    return cluster, holders


def _task_env(base: Mapping[str, str], cluster: ClusterSpec, task: TaskId, secret: str,
              transport: str | None) -> dict[str, str]:
    env = dict(base)
    env["STRATAGEM_CONFIG"] = json.dumps(
        {"cluster": cluster.as_dict(), "task": {"type": task.job, "index": task.index}}
    )
    env["STRATAGEM_SECRET"] = secret
    if transport:
        env["STRATAGEM_TRANSPORT"] = transport
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_task(task: TaskId, command: Sequence[str], env: dict[str, str],
                cwd: str | None = None) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            _die_with_launcher(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, cwd=cwd,
        )
    except OSError as exc:
        raise ConfigurationError(
            f"cannot start {task.short}: {command[0]!r} failed to run ({exc}); check the command after '--'"
        ) from None


# -- signals ---------------------------------------------------------------------------------------


class _SignalTrap:
    """Records SIGINT/SIGTERM sent to the launcher instead of dying, for the duration of a launch.

    Handlers can only be installed from the main thread; elsewhere this records nothing (signals
    go to the main thread anyway) and the caller's own handling applies.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_SignalTrap":
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
class _Outcome:
    """Why supervision ended, before the tasks are stopped."""

    reason: str
    exit_code: int
    failed_task: TaskId | None = None
    timed_out: bool = False
    interrupted_by: int | None = None


def _failure(tasks: list[_RunningTask]) -> _Outcome | None:
    """The first task that failed on its own (non-zero exit or killed by a signal we did not send)."""
    for t in tasks:
        code = t.poll()
        if code and not t.stopped_by_launcher and not t.tolerated:
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            return _Outcome(f"{t.task.short} {how}; stopped the other tasks", EXIT_TASK_FAILED, t.task)
    return None


def _supervise(tasks: list[_RunningTask], pump: OutputPump, trap: _SignalTrap, *,
               timeout: float | None, ps_grace: float, started: float,
               restarts: Restarts | None = None) -> _Outcome:
    """Watch the running job until it is over or must be stopped; say why."""
    deadline = started + timeout if timeout is not None else None
    ps_deadline = None
    while True:
        pump.pump(_POLL_INTERVAL)
        if restarts is not None:
            restarts.handle(tasks)   # may replace a dead worker in ``tasks`` by its new process
        drivers = [t for t in tasks if t.task.job not in SERVING_JOBS]
        now = time.monotonic()
        if trap.received:
            sig = trap.received[0]
            return _Outcome(f"interrupted by {_signal_name(sig)}; stopped every task",
                            EXIT_SIGNALLED[sig], interrupted_by=sig)
        # Which tasks are over, looked at before their exit codes: a task that exits between the two
        # looks is then seen failing, never counted as finished without its code being checked.
        over = {id(t) for t in tasks if t.poll() is not None}
        failure = _failure(tasks)
        if failure:
            return failure
        if len(over) == len(tasks):
            what = f"all {len(tasks)} tasks" if len(tasks) > 1 else "the task"
            left = [t.task.short for t in tasks if t.tolerated]
            if left:
                what = f"every task but {', '.join(left)} (left dead: --restart-workers)"
            return _Outcome(f"{what} finished successfully", EXIT_OK)
        if all(id(t) in over for t in drivers):
            # Only serving tasks are left; they get a grace period to notice and exit.
            if ps_deadline is None:
                ps_deadline = now + ps_grace
            if now >= ps_deadline or (deadline is not None and now >= deadline):
                left = ", ".join(t.task.short for t in tasks if t.running)
                return _Outcome(f"every worker task succeeded; stopped {left}, still serving after the "
                                f"{ps_grace:g}s ps grace period (not a failure)", EXIT_OK)
        elif deadline is not None and now >= deadline:
            return _Outcome(f"timed out after {timeout:g}s (--timeout); stopped every task",
                            EXIT_TIMEOUT, timed_out=True)


def _stop(tasks: list[_RunningTask], pump: OutputPump, trap: _SignalTrap, grace: float) -> None:
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
        pump.pump(_POLL_INTERVAL)
    _kill_and_reap(tasks)


def _kill_and_reap(tasks: list[_RunningTask]) -> None:
    """SIGKILL whatever still runs and wait for every process, so none is left a zombie or orphan."""
    for t in tasks:
        t.send(signal.SIGKILL)  # the whole group: the task and anything it started
    for t in tasks:
        t.process.wait()


def _check_options(command: Sequence[str], workers: int, ps: int, chief: bool, secret: str | None,
                   timeout: float | None, grace: float, ps_grace: float, path: str | None,
                   check_program: bool = True) -> None:
    if not command:
        raise ConfigurationError(
            "no command to launch: put it after '--', e.g. stratagem launch --worker 2 -- python train.py"
        )
    for name, value in (("workers", workers), ("ps", ps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
    if workers + (1 if chief else 0) == 0:
        raise ConfigurationError("nothing would compute: give at least one worker (--worker N) or --chief")
    if secret is not None and not secret:
        raise ConfigurationError("the secret is empty: give a non-empty --secret, or leave it out to get a random one")
    if timeout is not None and not timeout > 0:
        raise ConfigurationError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    for name, value in (("grace", grace), ("ps_grace", ps_grace)):
        if not value >= 0:
            raise ConfigurationError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if check_program and shutil.which(command[0], path=path) is None:
        raise ConfigurationError(
            f"cannot find the program {command[0]!r} to launch: check the command after '--' "
            f"(is it installed and on PATH?)"
        )


def job_secret(secret: str | None, env: Mapping[str, str]) -> str:
    """The cluster secret of a job (``launch`` and ``launch --mpi`` alike): ``secret`` if given, else
    ``STRATAGEM_SECRET`` of ``env``, else a fresh random one, so a launched job is authenticated."""
    return secret or env.get("STRATAGEM_SECRET") or secrets.token_hex(32)


def check_transport(transport: str | None) -> None:
    """Refuse a ``--transport`` that names no registered transport (with a did-you-mean) or one whose
    libraries are missing here (with the install hint): a usage error before any task starts, rather
    than every task failing the same way. Looks modules up; imports no plugin."""
    if transport is None:
        return
    from stratagem.plugins.manager import plugin_manager
    from stratagem.core.errors import PluginError

    manager = plugin_manager()
    try:
        why = manager.usable("transport", transport)
    except PluginError as exc:
        raise ConfigurationError(f"--transport: {exc}") from None
    if why is not None:
        hint = manager.spec("transport", transport).install_hint
        raise ConfigurationError(f"--transport {transport}: not usable here: {why}"
                                 + (f"; install it with: {hint}" if hint else ""))


def launch(
    command: Sequence[str],
    workers: int = 1,
    ps: int = 0,
    chief: bool = False,
    transport: str | None = None,
    secret: str | None = None,
    env: Mapping[str, str | None] | None = None,
    timeout: float | None = None,
    output: TextIO | None = None,
    *,
    error_output: TextIO | None = None,
    host: str = "127.0.0.1",
    grace: float = DEFAULT_GRACE,
    ps_grace: float = DEFAULT_PS_GRACE,
    restart_workers: int | None = None,
) -> LaunchResult:
    """Run ``command`` once per task of a local cluster and supervise the job; see the module doc.

    ``env`` adds variables to the launcher's environment for every task (a value of None removes
    one). Tasks' stdout lines go to ``output`` (default ``sys.stdout``); their stderr lines and the
    final summary go to ``error_output`` (default ``sys.stderr``). Raises ``ConfigurationError`` for
    bad options before anything starts; once tasks run, every outcome is a :class:`LaunchResult`.
    A SIGINT/SIGTERM received during the call stops the job and is reported in the result
    (``interrupted_by``) rather than raised: a caller running several jobs should check it.
    ``restart_workers``: see ``--restart-workers`` in the module doc (None: a failed task stops the job).
    """
    base_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            base_env.pop(key, None)
        else:
            base_env[key] = value
    _check_options(command, workers, ps, chief, secret, timeout, grace, ps_grace, base_env.get("PATH"))
    if restart_workers is not None and (isinstance(restart_workers, bool) or not isinstance(restart_workers, int)
                                        or restart_workers < 0):
        raise ConfigurationError(f"restart_workers must be an integer >= 0, got {restart_workers!r}")
    check_transport(transport)
    secret = job_secret(secret, base_env)
    out = Sink(output if output is not None else sys.stdout)
    err = Sink(error_output if error_output is not None else sys.stderr)

    cluster, port_holders = _plan_cluster(workers, ps, chief, host)
    tasks: list[_RunningTask] = []
    pump = OutputPump()
    started = time.monotonic()
    colors = {task: COLORS[i % len(COLORS)] for i, task in enumerate(cluster.tasks())}

    def start(task: TaskId, restarts: int = 0) -> _RunningTask:
        env = _task_env(base_env, cluster, task, secret, transport)
        if restarts:
            env[RESTARTS_ENV] = str(restarts)
        process = _start_task(task, command, env)
        pump.add(process.stdout, PipeReader(task_prefix(task, colors[task], out.stream), out))
        pump.add(process.stderr, PipeReader(task_prefix(task, colors[task], err.stream), err))
        return _RunningTask(task, process)

    restarts = None if restart_workers is None else Restarts(restart_workers, cluster, start,
                                                             lambda line: err.write(line + "\n"))
    try:
        with _SignalTrap() as trap:
            for task in cluster.tasks():
                port_holders.pop(task).close()  # free the port as late as possible: see core.ports
                tasks.append(start(task))
            outcome = _supervise(tasks, pump, trap, timeout=timeout, ps_grace=ps_grace, started=started,
                                 restarts=restarts)
            _stop(tasks, pump, trap, grace)
            pump.drain(_DRAIN_SECONDS, _POLL_INTERVAL)
    finally:
        # Every path, including errors and KeyboardInterrupt from a caller's handler: nothing survives.
        _kill_and_reap(tasks)
        pump.close()
        for sock in port_holders.values():
            sock.close()

    result = LaunchResult(
        cluster=cluster,
        tasks=tuple(t.result() for t in tasks),
        exit_code=outcome.exit_code,
        reason=outcome.reason,
        duration=time.monotonic() - started,
        failed_task=outcome.failed_task,
        timed_out=outcome.timed_out,
        interrupted_by=outcome.interrupted_by,
    )
    err.write(result.summary() + "\n")
    return result


# -- command line ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``stratagem launch``'s options on ``parser`` (cli.py creates it)."""
    parser.usage = "%(prog)s [--worker N] [--ps M] [--chief] [options] -- COMMAND [ARG ...]"
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--worker", "--workers", dest="worker", type=int, default=1, metavar="N",
                        help="number of worker tasks (default: 1)")
    parser.add_argument("--ps", type=int, default=0, metavar="M", help="number of ps (parameter server) tasks (default: 0)")
    parser.add_argument("--chief", action="store_true", help="also start a chief task (chief:0)")
    parser.add_argument("--transport", metavar="T",
                        help="the transport scripts get when they name none (sets STRATAGEM_TRANSPORT=T "
                             "for every task; default: zmq, with --mpi: mpi)")
    parser.add_argument("--secret", metavar="S",
                        help="cluster secret (default: $STRATAGEM_SECRET, else a random one per job); "
                             "prefer the environment variable: command lines are visible to other users")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="stop the whole job after this long (exit 124)")
    parser.add_argument("--host", default="127.0.0.1", help="address the tasks listen on (default: 127.0.0.1)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE, metavar="SECONDS",
                        help=f"time between SIGTERM and SIGKILL when stopping tasks (default: {DEFAULT_GRACE:g})")
    parser.add_argument("--ps-grace", type=float, default=DEFAULT_PS_GRACE, metavar="SECONDS",
                        help="time ps tasks may keep serving after every worker succeeded, before they are "
                             f"stopped without failing the job (default: {DEFAULT_PS_GRACE:g})")
    parser.add_argument("--timeline", metavar="TRACE.json",
                        help="record every task's step phases (compute, pack, collectives, ps push/pull, waits "
                             "on each peer, optimizer) and merge them into one Chrome-trace/Perfetto file, "
                             "clocks aligned; then: stratagem timeline summary TRACE.json")
    parser.add_argument("--restart-workers", type=int, metavar="N",
                        help="a worker (not the chief) that fails does not stop the job: start it again, up to "
                             "N times, then go on without it; for mirrored with on_failure='shrink' "
                             "(sets STRATAGEM_RESTARTS in a restarted task)")
    parser.add_argument("--mpi", action="store_true",
                        help="run the command once, as an MPI job: mpiexec -n WORKERS+PS in a private network "
                             "namespace (rank 0 is worker:0, the last PS ranks are ps tasks; "
                             "STRATAGEM_TRANSPORT defaults to mpi)")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="run every task in a Ray actor of the cluster at ADDRESS ('auto': the one this "
                             "node is in; 'local': a Ray instance of its own on 127.0.0.1), placed with a "
                             "placement group; needs pip install 'stratagem[ray]'")
    parser.add_argument("--spread", action="store_true",
                        help="with --ray: every task on a different node (placement strategy STRICT_SPREAD)")
    parser.add_argument("--cpus-per-task", type=float, metavar="C",
                        help="with --ray: CPUs each task's placement bundle reserves (default: 1)")
    parser.add_argument("--placement-timeout", type=float, metavar="SECONDS",
                        help="with --ray: how long the cluster may take to place every task (default: 60)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every task runs, after '--'")
    parser.set_defaults(_launch_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Run ``stratagem launch`` with parsed ``args``; return the launcher's exit status."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        if getattr(args, "mpi", False) and getattr(args, "ray", None):
            raise ConfigurationError("--mpi and --ray cannot be combined: give one of them")
        restart_workers = getattr(args, "restart_workers", None)
        if restart_workers is not None and (getattr(args, "mpi", False) or getattr(args, "ray", None)):
            raise ConfigurationError("--restart-workers works with the local launcher only, not with --mpi "
                                     "(an MPI world is fixed) or --ray")
        ray_only = {"--spread": getattr(args, "spread", False) or None,
                    "--cpus-per-task": getattr(args, "cpus_per_task", None),
                    "--placement-timeout": getattr(args, "placement_timeout", None)}
        if getattr(args, "ray", None) is None and any(v is not None for v in ray_only.values()):
            given = ", ".join(flag for flag, value in ray_only.items() if value is not None)
            raise ConfigurationError(f"{given}: only with --ray ADDRESS")
        session = None
        if getattr(args, "timeline", None):
            if getattr(args, "ray", None):
                raise ConfigurationError("--timeline does not work with --ray yet (the tasks' files stay on "
                                         "their nodes): set STRATAGEM_TIMELINE=/shared/dir/{task}.json and run "
                                         "stratagem timeline merge")
            from stratagem.timeline.session import TimelineSession

            session = TimelineSession(args.timeline)
        if getattr(args, "ray", None):
            from stratagem.launch.ray import DEFAULT_PLACEMENT_TIMEOUT, launch_ray

            result = launch_ray(
                command, workers=args.worker, ps=args.ps, chief=args.chief, transport=args.transport,
                secret=args.secret, timeout=args.timeout, address=args.ray, spread=args.spread,
                cpus_per_task=1.0 if args.cpus_per_task is None else args.cpus_per_task,
                grace=args.grace, ps_grace=args.ps_grace,
                placement_timeout=(DEFAULT_PLACEMENT_TIMEOUT if args.placement_timeout is None
                                   else args.placement_timeout),
            )
        elif getattr(args, "mpi", False):
            from stratagem.launch.mpi import launch_mpi

            result = launch_mpi(command, workers=args.worker, ps=args.ps, chief=args.chief,
                                transport=args.transport, secret=args.secret, timeout=args.timeout,
                                grace=args.grace, env=session.env if session else None)
        else:
            result = launch(
                command, workers=args.worker, ps=args.ps, chief=args.chief, transport=args.transport,
                secret=args.secret, timeout=args.timeout, host=args.host, grace=args.grace,
                ps_grace=args.ps_grace, env=session.env if session else None,
                restart_workers=restart_workers,
            )
        if session is not None:
            session.finish(result.cluster.tasks())
    except ConfigurationError as exc:
        parser = getattr(args, "_launch_parser", None)
        if parser is not None:
            parser.error(str(exc))  # prints the usage line too; exits 2
        print(f"stratagem launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stratagem.launch.launcher ...``: the same as ``stratagem launch ...``."""
    parser = argparse.ArgumentParser(prog="stratagem launch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
