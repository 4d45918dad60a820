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

With ``--hosts N`` (:mod:`stratagem.launch.hosts`) the tasks run on N emulated hosts: each host a
network namespace of its own address (``10.77.0.<i+1>``, only inside them), joined by a bridge in a
namespace of its own, each link shaped to ``--link RATE`` (``--link-of HOST=RATE`` for one host);
tasks are placed round-robin (``--tasks-per-host K``: K per host in turn) and bind their host's address
(``STRATAGEM_CONFIG`` says it), so a script runs unchanged. The namespaces go with the job.

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
import socket
import sys
import time
from typing import Mapping, Sequence, TextIO

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.transport_kit.ports import format_address, reserve_ports
from stratagem.launch.hosts import EmulatedHosts, HostsSpec, add_host_arguments, hosts_spec
from stratagem.launch.hosts import plan_cluster as plan_hosts_cluster
from stratagem.launch import multinode
from stratagem.launch.job import (
    DEFAULT_GRACE,
    DEFAULT_PS_GRACE,
    check_options,
    check_transport,
    job_env,
    job_secret,
    task_env,
)
from stratagem.launch.job_end import JobEndRecord
from stratagem.launch.failures import FailureReports
from stratagem.launch.restarts import RESTARTS_ENV, Restarts
from stratagem.launch.supervisor import (
    EXIT_OK,
    EXIT_SIGNALLED,
    EXIT_TASK_FAILED,
    EXIT_TIMEOUT,
    LaunchResult,
    RunningTask,
    SignalTrap,
    TaskResult,
    kill_and_reap,
    run_to_end,
    start_task,
)
from stratagem.launch.task_output import COLORS, OutputPump, PipeReader, Sink, task_prefix

#: The names this module has always offered (the results of launch(), its exit codes, its defaults).
__all__ = ["launch", "LaunchResult", "TaskResult", "EXIT_OK", "EXIT_TASK_FAILED", "EXIT_USAGE", "EXIT_TIMEOUT",
           "EXIT_SIGNALLED", "DEFAULT_GRACE", "DEFAULT_PS_GRACE", "add_arguments", "run", "main"]

EXIT_USAGE = 2
_EPILOG = """\
example:
  stratagem launch --worker 2 --ps 1 -- python train.py --epochs 3

Each task gets STRATAGEM_CONFIG (its cluster and task, TF_CONFIG-shaped), STRATAGEM_SECRET and,
with --transport, STRATAGEM_TRANSPORT (the transport a script gets when it names none). Output
lines are prefixed with the task ([worker:1] ...).
With --ray ADDRESS the same job runs as Ray actors, one per task, on the nodes Ray chooses:
  stratagem launch --ray auto --worker 4 --ps 2 --spread -- python3 train.py
With --hosts N every task runs on one of N emulated hosts (network namespaces, links shaped with tc):
  stratagem launch --hosts 4 --link 1gbit --link-of host3=100mbit --worker 4 -- python3 train.py
With --timeline trace.json every task records where its steps go; the launcher merges them:
  stratagem launch --timeline trace.json --worker 3 -- python3 train.py
  stratagem timeline summary trace.json        # step breakdown, waits per peer, the straggler
Exit status: 0 all tasks succeeded (ps tasks stopped after --ps-grace count as success), 1 a task
failed, 2 usage error, 124 --timeout expired, 130/143 interrupted by SIGINT/SIGTERM.
"""


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
    hosts: HostsSpec | EmulatedHosts | None = None,
) -> LaunchResult:
    """Run ``command`` once per task of a local cluster and supervise the job; see the module doc.

    ``env`` adds variables to the launcher's environment for every task (a value of None removes
    one). Tasks' stdout lines go to ``output`` (default ``sys.stdout``); their stderr lines and the
    final summary go to ``error_output`` (default ``sys.stderr``). Raises ``ConfigurationError`` for
    bad options before anything starts; once tasks run, every outcome is a :class:`LaunchResult`.
    A SIGINT/SIGTERM received during the call stops the job and is reported in the result
    (``interrupted_by``) rather than raised: a caller running several jobs should check it.
    ``restart_workers``: see ``--restart-workers`` in the module doc (None: a failed task stops the job).
    ``hosts``: run the tasks on emulated hosts (``--hosts``: :mod:`stratagem.launch.hosts`), each task
    bound to its host's address; ``host`` must then stay the default. Given started
    :class:`~stratagem.launch.hosts.EmulatedHosts`, the job runs on them and leaves them to the caller
    (who can change a link while it runs: ``set_link``, the fault matrix's link faults).
    """
    base_env = job_env(env)
    check_options(command, workers, ps, chief, secret, timeout, grace, ps_grace, base_env.get("PATH"))
    if restart_workers is not None and (isinstance(restart_workers, bool) or not isinstance(restart_workers, int)
                                        or restart_workers < 0):
        raise ConfigurationError(f"restart_workers must be an integer >= 0, got {restart_workers!r}")
    check_transport(transport)
    if hosts is not None and host != "127.0.0.1":
        raise ConfigurationError("--host and --hosts cannot be combined: with --hosts every task binds its "
                                 "emulated host's address")
    secret = job_secret(secret, base_env)
    out = Sink(output if output is not None else sys.stdout)
    err = Sink(error_output if error_output is not None else sys.stderr)

    own_network = hosts is not None and not isinstance(hosts, EmulatedHosts)   # else the caller's, started
    if hosts is None:
        cluster, port_holders = _plan_cluster(workers, ps, chief, host)
        network, placement = None, {}
    else:
        network = hosts if isinstance(hosts, EmulatedHosts) else EmulatedHosts(hosts)
        hosts, port_holders = network.spec, {}
        cluster, placement = plan_hosts_cluster({"chief": 1 if chief else 0, "worker": workers, "ps": ps}, hosts)
    tasks: list[RunningTask] = []
    pump = OutputPump()
    started = time.monotonic()
    colors = {task: COLORS[i % len(COLORS)] for i, task in enumerate(cluster.tasks())}
    job_end = JobEndRecord()   # tells a task that wakes (or restarts) after the chief's normal end

    reports = FailureReports()   # where a failing task says when it failed and whom it blames

    def start(task: TaskId, restarts: int = 0) -> RunningTask:
        env = task_env(base_env, cluster, task, secret, transport)
        env.update(job_end.env())
        env.update(reports.env(task))
        if restarts:
            env[RESTARTS_ENV] = str(restarts)
        process = start_task(task, command if network is None else network.command(placement[task], command), env)
        pump.add(process.stdout, PipeReader(task_prefix(task, colors[task], out.stream), out))
        pump.add(process.stderr, PipeReader(task_prefix(task, colors[task], err.stream), err))
        if task == cluster.chief:
            job_end.watch(process)
        return RunningTask(task, process)

    restarts = None if restart_workers is None else Restarts(restart_workers, cluster, start,
                                                             lambda line: err.write(line + "\n"))
    try:
        with SignalTrap() as trap:
            if network is not None:
                if own_network:
                    network.start()
                err.write(f"stratagem launch: {hosts.describe()}: " + ", ".join(
                    f"{task.short} on {network.names[placement[task]]}" for task in cluster.tasks()) + "\n")
            for task in cluster.tasks():
                if task in port_holders:  # (emulated hosts hold no port: nothing else listens there)
                    port_holders.pop(task).close()  # free the port as late as possible: see transport_kit.ports
                tasks.append(start(task))
            outcome = run_to_end(tasks, pump, trap, timeout=timeout, ps_grace=ps_grace, grace=grace,
                                 started=started, restarts=restarts, reports=reports)
    finally:
        # Every path, including errors and KeyboardInterrupt from a caller's handler: nothing survives.
        kill_and_reap(tasks)
        if own_network:
            network.close()  # after the tasks: the namespaces go with their last process
        pump.close()
        job_end.close()
        reports.close()
        for sock in port_holders.values():
            sock.close()

    result = LaunchResult.of(outcome, cluster, tasks, started)
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
    add_host_arguments(parser)  # --hosts, --link, --link-of, --tasks-per-host, --latency
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
    multinode.add_arguments(parser)  # --nnodes/--node-rank/--rdzv, --hostfile: their own group
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every task runs, after '--'")
    parser.set_defaults(launch_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Run ``stratagem launch`` with parsed ``args``; return the launcher's exit status."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        if multinode.wants_multinode(args):
            return multinode.run(args, command)
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
        hosts = hosts_spec(args)
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
                restart_workers=restart_workers, hosts=hosts,
            )
        if session is not None:
            session.finish(result.cluster.tasks())
    except ConfigurationError as exc:
        parser = getattr(args, "launch_parser", None)
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
