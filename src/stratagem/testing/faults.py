"""One fault in one real job: the plain training script (:mod:`stratagem.testing.fault_script`) under
``stratagem launch`` (its :func:`~stratagem.launch.launcher.launch`), a fault struck on one task from
outside while training runs, and what came of it: the launcher's verdict and culprit, the culprit each
task's error names, when each noticed, and when the job was over. The fault-matrix benchmark
(``benchmarks/fault_matrix.py``) and tests/test_stall_detection.py run on it.

    outcome = run_fault("mirrored", "zmq", "worker:1", "sigstop_long", peer_timeout=3.0)
    outcome.exit_code, outcome.launcher_culprit, outcome.named     # 1, 'worker:1', {'worker:0': ['worker:1'], ...}

Faults (struck when the chief, worker:0, starts its step 3):

- ``sigkill``: SIGKILL; ``exception``: an uncaught ``RuntimeError`` in its main thread (SIGUSR1 to the
  script); ``exit``: ``sys.exit(3)`` (SIGUSR2);
- ``sigstop_short``: SIGSTOP, SIGCONT half a peer timeout later (a GC pause, a swapped-out process);
- ``sigstop_long``: SIGSTOP, SIGCONT two peer timeouts later (a stall that must count as a loss).

Link faults run the job on emulated hosts (:mod:`stratagem.launch.hosts`: one task per host, links of
``link``, 100 Mbit/s by default; root or ``unshare -r``) and strike the culprit's host link
(:meth:`~stratagem.launch.hosts.EmulatedHosts.set_link`, both directions):

- ``link_slow``: slowed to a hundredth of its rate for 20 s, then restored;
- ``link_cut_short``: cut (its ``eth0`` down) for 10 s, then restored;
- ``link_cut``: cut for good.

``link_for`` changes how long the slowed or short-cut link lasts (a test's short cut).

Over ``transport="mpi"`` the job is one ``mpiexec`` (``stratagem launch --mpi``: every rank in one
private network namespace, ULFM where the Open MPI has it); the launcher supervises mpiexec alone, so
its ``returncodes`` hold ``mpiexec:0``, and the culprit it names is the rank that failed first, from
the ranks' failure reports (:mod:`stratagem.launch.mpi_rank` reports an exit no hook saw). Link
faults do not apply to it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.launch.hosts import EmulatedHosts, HostsSpec, parse_rate, plan_cluster
from stratagem.launch.launcher import launch
from stratagem.launch.mpi import launch_mpi
from stratagem.testing.strategy_contract import clean_env

FAULTS = ("sigkill", "sigstop_short", "sigstop_long", "exception", "exit")
#: Faults of the culprit's host link (the job on emulated hosts), and how long each lasts by default
#: (seconds; None: for good).
LINK_FAULTS = {"link_slow": 20.0, "link_cut_short": 10.0, "link_cut": None}
#: A slowed link's rate: its own divided by this.
SLOWDOWN = 100
#: The tasks of each strategy's job: the chief (worker:0: mirrored's rank 0, in_graph's client,
#: parameter_server's coordinator, between_graph's chief) and the others.
JOBS = {"mirrored": (3, 0), "in_graph": (3, 0), "between_graph": (3, 1), "parameter_server": (3, 1)}
#: Words of a line that says a task was left out of the job (see ``FaultOutcome.says_left_out``).
_LEFT_OUT = ("are gone", "finished without this task", "leaving out")
_LINE = re.compile(r"^\[(\w+:\d+)\] (.*)$")
_TASK = re.compile(r"/job:(\w+)/task:(\d+)|\b(worker|ps|chief):(\d+)\b")


@dataclasses.dataclass
class FaultOutcome:
    """What one job with one fault came to (times are seconds after the fault was struck)."""

    strategy: str
    transport: str
    culprit: str
    fault: str
    peer_timeout: float
    #: Seconds a link fault lasted (None: for good, or not a link fault).
    link_for: float | None
    exit_code: int
    #: The task the launcher blamed (``LaunchResult.failed_task``), or None.
    launcher_culprit: str | None
    reason: str
    returncodes: dict
    #: task -> the tasks its error names (its ``task`` attribute first, then those its message mentions,
    #: itself left out); only the tasks that printed an error.
    named: dict
    #: task -> seconds after the fault at which its error was raised.
    noticed: dict
    #: Seconds after the fault at which the last task had exited (None: the fault was never struck).
    ended: float | None
    #: task -> its ``trained: w = [...]`` line, for the tasks that finished training.
    trained: dict
    output: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def says_left_out(self) -> bool:
        """Whether the job's output says the culprit was left out: a line (of any task, the culprit's
        own included) that names it and says it was gone (the ps's "replica(s) worker:1 are gone", the
        culprit's "the job had finished without this task")."""
        job, _, index = self.culprit.partition(":")
        names = (self.culprit, f"/job:{job}/task:{index}")
        for line in self.output.splitlines():
            match = _LINE.match(line)
            text = match.group(2) if match else line      # the text, not the task that printed it
            if any(name in text for name in names) and any(word in text for word in _LEFT_OUT):
                return True
        return False


class _Watch(io.TextIOBase):
    """The launcher's output stream: keeps every line, and strikes the fault when the chief starts step 3."""

    def __init__(self, strike):
        self.lines: list[tuple[float, str, str]] = []
        self.pids: dict[str, int] = {}
        self._strike = strike
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._partial += text
            *complete, self._partial = self._partial.split("\n")
            for line in complete:
                self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        now = time.monotonic()
        match = _LINE.match(line)
        if not match:
            self.lines.append((now, "", line))
            return
        task, text = match.groups()
        self.lines.append((now, task, text))
        if text.startswith("pid "):
            self.pids[task] = int(text.split()[1])
        elif task == "worker:0" and text == "step 3":
            self._strike(self.pids)


def _named(error: dict, me: str) -> list[str]:
    """The tasks an error line names, its own task left out: its ``task`` attribute (a
    ``PeerLostError``'s) first, then every task its message mentions, in order."""
    found = []
    for text in (error.get("task") or "", error.get("message", "")):
        for match in _TASK.finditer(text):
            job, index = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
            task = f"{job}:{index}"
            if task not in found and task != me:
                found.append(task)
    return found


def run_fault(strategy: str, transport: str, culprit: str | None, fault: str | None, *,
              peer_timeout: float = 3.0, limit: float = 90.0, steps: int = 40, grace: float = 2.0,
              compute: str = "", link: str = "100mbit", link_for: float | None = None) -> FaultOutcome:
    """Run the job of ``strategy`` over ``transport`` (peer timeout ``peer_timeout``), strike ``fault``
    on ``culprit`` (None: no fault) and return what came of it. Every process is reaped whatever happens;
    the job is stopped after ``limit`` seconds (exit 124). A link fault runs the job on emulated hosts
    with links of ``link``; ``link_for`` overrides how long a slowed or short-cut link lasts."""
    if fault is not None and fault not in FAULTS and fault not in LINK_FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS + tuple(LINK_FAULTS))}")
    workers, ps = JOBS[strategy.partition(":")[0]]
    if transport == "mpi" and fault in LINK_FAULTS:
        raise ValueError("link faults need emulated hosts, which an MPI job (one private namespace) has not")
    network = None
    if fault in LINK_FAULTS:
        spec = HostsSpec.parse(workers + ps, link=link)
        culprit_host = plan_cluster({"worker": workers, "ps": ps}, spec)[1].get(TaskId.parse(culprit))
        if culprit_host is None:
            raise ValueError(f"culprit {culprit!r} is not a task of the {strategy} job")
        link_for = LINK_FAULTS[fault] if link_for is None and fault != "link_cut" else link_for
        slowed = max(8000, parse_rate(link) // SLOWDOWN)
    struck: list[float] = []
    unstruck: list[BaseException] = []
    timers: list[threading.Timer] = []

    def signal_later(pid: int, sig: int, delay: float) -> None:
        timer = threading.Timer(delay, _signal, args=(pid, sig))
        timer.daemon = True
        timer.start()
        timers.append(timer)

    def strike(pids: dict) -> None:
        if struck or fault is None or culprit not in pids:
            return
        pid = pids[culprit]
        struck.append(time.monotonic())
        if fault == "sigkill":
            _signal(pid, signal.SIGKILL)
        elif fault == "exception":
            _signal(pid, signal.SIGUSR1)
        elif fault == "exit":
            _signal(pid, signal.SIGUSR2)
        elif fault in LINK_FAULTS:
            try:
                network.set_link(culprit_host, slowed if fault == "link_slow" else "down")
            except (ConfigurationError, OSError, subprocess.SubprocessError) as exc:
                unstruck.append(exc)     # raised once the job is over, not in the launcher's reader thread
                return
            if fault != "link_cut":
                timer = threading.Timer(link_for, _restore, args=(network, culprit_host))
                timer.daemon = True
                timer.start()
                timers.append(timer)
        else:
            _signal(pid, signal.SIGSTOP)
            signal_later(pid, signal.SIGCONT, peer_timeout * (0.5 if fault == "sigstop_short" else 2.0))

    watch = _Watch(strike)
    # The environment of clean_env() (no cluster settings of ours, one BLAS thread), and the peer timeout.
    env: dict = {k: None for k in os.environ if k not in clean_env()}
    env.update(clean_env(), STRATAGEM_PEER_TIMEOUT=str(peer_timeout))
    command = [sys.executable, "-m", "stratagem.testing.fault_script", strategy, "--steps", str(steps)]
    if compute:
        command += ["--compute", compute]
    try:
        if fault in LINK_FAULTS:
            network = EmulatedHosts(spec).start()    # here, in the thread that outlives the job
        if transport == "mpi":      # one mpiexec job (stratagem launch --mpi), in a private network namespace
            result = launch_mpi(command, workers=workers, ps=ps, transport="mpi", env=env, timeout=limit,
                                output=watch, error_output=watch, grace=grace)
        else:
            result = launch(command, workers=workers, ps=ps, transport=transport, env=env, timeout=limit,
                            output=watch, error_output=watch, grace=grace, ps_grace=10.0, hosts=network)
    finally:
        for timer in timers:
            timer.cancel()
            timer.join(30.0)     # a restore under way ends before the hosts go
        if network is not None:
            network.close()
    finished = time.monotonic()
    if unstruck:
        raise RuntimeError(f"could not strike {fault} on {culprit}'s host link: {unstruck[0]}") from unstruck[0]
    start = struck[0] if struck else None
    named, noticed, trained = {}, {}, {}
    for _, task, text in watch.lines:
        if text.startswith("error {") and task not in named:
            error = json.loads(text[len("error "):])
            named[task] = _named(error, task)
            noticed[task] = round(error["at"] - start, 2) if start is not None else None
        elif text.startswith("trained: w = "):
            trained[task] = text
    return FaultOutcome(
        strategy=strategy, transport=transport, culprit=culprit or "", fault=fault or "none",
        peer_timeout=peer_timeout, link_for=link_for if fault in LINK_FAULTS else None, exit_code=result.exit_code,
        launcher_culprit=result.failed_task.short if result.failed_task is not None else None,
        reason=result.reason, returncodes=result.returncodes, named=named, noticed=noticed,
        ended=round(finished - start, 2) if start is not None else None, trained=trained,
        output="\n".join(f"[{task}] {text}" if task else text for _, task, text in watch.lines))


def _restore(network: EmulatedHosts, host: int) -> None:
    """Put a host's link back as it was built (the job may be over: then there is nothing to restore)."""
    try:
        network.set_link(host, None)
    except (ConfigurationError, RuntimeError, OSError, subprocess.SubprocessError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


__all__ = ["FAULTS", "JOBS", "LINK_FAULTS", "SLOWDOWN", "FaultOutcome", "run_fault"]
