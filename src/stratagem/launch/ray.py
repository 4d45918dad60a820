"""Run a stratagem job on a Ray cluster: one Ray actor per task, placed with a placement group.

The same job as ``stratagem launch``, with Ray choosing the machines::

    stratagem launch --ray auto --worker 4 --ps 2 -- python3 train.py        # the cluster this node is in
    stratagem launch --ray local --worker 2 -- python3 train.py              # a Ray instance of its own

    import stratagem
    result = stratagem.ray.run("train.py", worker=4, ps=2, spread=True)     # a script, on every task
    result = stratagem.ray.run(train, worker=2)                              # a function: result.values

How it runs (``pip install 'stratagem[ray]'``; every node needs stratagem and the script's imports):

1. A placement group of one bundle per task (``cpus_per_task`` CPUs each): ``PACK`` by default,
   ``STRICT_SPREAD`` with ``spread=True`` (``--spread``: every task on a different node). A group the
   cluster cannot place within ``placement_timeout`` seconds is a ``ConfigurationError`` that says
   what was asked and what the cluster has.
2. One actor per bundle (:class:`stratagem.launch.ray_task.TaskRunner`). Each holds a free port of
   its node's Ray address; the addresses make the job's cluster, ``{"worker": ["10.0.0.5:23456", ...]}``.
3. Each actor starts its task as a child process with the environment ``stratagem launch`` gives it:
   ``STRATAGEM_CONFIG`` (cluster and task), ``STRATAGEM_SECRET`` (``secret``, else this process's
   ``STRATAGEM_SECRET``, else a fresh random one: the job is authenticated), ``STRATAGEM_TRANSPORT``
   with ``transport``, and ``PYTHONUNBUFFERED=1``. The secret travels to the actors through Ray, never
   on a command line. A script runs with the node's Python (the actor's), a function in a child
   process of its own (its return value comes back in ``result.values``).
4. This process supervises the job with ``stratagem launch``'s own loop: every output line printed
   here prefixed with its task, a failed task (or a lost actor) stops the others, ``timeout`` and
   SIGINT/SIGTERM likewise, ps tasks get ``ps_grace``; the same summary and exit codes (0, 1 a task
   failed, 124 timed out, 130/143 interrupted). Every actor and the placement group are removed at
   the end, whatever happened.

``address``: ``None`` connects to the Ray instance this process already uses, else the one Ray
finds (``RAY_ADDRESS``, a cluster started on this node), else starts one; ``"local"`` always starts
a Ray instance of its own, bound to 127.0.0.1, without a dashboard, with at least as many CPUs as
the tasks ask for (like ``stratagem launch``, it may run more tasks than cores), and stops it at
the end; an
address (``"10.0.0.5:6379"``, ``"ray://head:10001"``) connects to that cluster. An address on
127.0.0.1 (a cluster of this machine bound to loopback) is reached over loopback: Ray would rewrite
it to this node's outward address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which is set here
when Ray is not yet imported (set it yourself if your program imports Ray first).
"""

from __future__ import annotations

import ipaddress
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TextIO

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.launch.job import DEFAULT_GRACE, DEFAULT_PS_GRACE, check_options, check_transport, job_secret, task_env
from stratagem.launch.supervisor import POLL_INTERVAL, LaunchResult, SignalTrap, TaskResult, run_to_end
from stratagem.launch.task_output import COLORS, PipeReader, Sink, task_prefix

#: Seconds to wait for the cluster to place every task's bundle.
DEFAULT_PLACEMENT_TIMEOUT = 60.0
#: Seconds any one call to an actor may take before the actor counts as lost.
CALL_TIMEOUT = 60.0
#: Seconds to wait for the cluster's address to accept a connection.
_CONNECT_SECONDS = 5.0
#: Seconds a task may take to exit once SIGKILLed before its actor is killed outright.
_REAP_SECONDS = 10.0
#: Seconds the actors' and the placement group's removal may take at the end of a job.
_CLEANUP_SECONDS = 20.0
_INSTALL_HINT = "pip install 'stratagem[ray]'"


@dataclass(frozen=True)
class RayResult(LaunchResult):
    """A :class:`~stratagem.launch.supervisor.LaunchResult`, plus the Ray node each task ran on
    (``{"worker:0": node id, ...}``; its address is in ``cluster``) and, for a function, what it
    returned (``{"worker:0": value, ...}``, tasks that exited 0)."""

    nodes: Mapping[str, str] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)


# -- connecting ------------------------------------------------------------------------------------


def _is_loopback(address: str | None) -> bool:
    if address is None or address == "local":
        return address == "local"
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_ray(address: str | None):
    if _is_loopback(address) and "ray" not in sys.modules:
        # Ray rewrites a loopback address to this node's outward address (and then cannot reach a
        # cluster bound to loopback) unless its "single machine" mode is on; it reads this at import.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ConfigurationError(f"Ray is not installed; install it with: {_INSTALL_HINT}") from None
    return ray


def _check_reachable(address: str) -> None:
    """Refuse a ``host:port`` where nothing listens, at once: Ray itself keeps retrying for minutes."""
    if "://" in address or address in ("auto", "local"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigurationError(f"--ray {address!r}: give HOST:PORT of the cluster's head (e.g. 10.0.0.5:6379), "
                                 f"'auto' or 'local'")
    import socket

    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_SECONDS).close()
    except OSError as exc:
        raise ConfigurationError(f"nothing answers at the Ray address {address} ({exc}); is the cluster up "
                                 f"('ray status' on its head) and the address its GCS address?") from None


def _connect(address: str | None, cpus_needed: float = 1.0):
    """``(ray, whether we started the connection and so must shut it down)``. A local instance
    offers at least ``cpus_needed`` CPUs: like ``stratagem launch``, it may run more tasks than cores."""
    ray = _import_ray(address)
    if ray.is_initialized():
        return ray, False
    if address is not None:
        _check_reachable(address)
    options: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
    if address == "local":
        options.update(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                       num_cpus=max(os.cpu_count() or 1, math.ceil(cpus_needed)))
    else:
        options["address"] = address
        if _is_loopback(address):
            options["_node_ip_address"] = "127.0.0.1"
    try:
        ray.init(**options)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = ("start a local Ray instance" if address == "local"
                 else f"connect to the Ray cluster {address or '(auto)'}")
        raise ConfigurationError(f"cannot {where}: {exc}") from None
    return ray, True


# -- the tasks, as the launcher's supervision loop sees them ---------------------------------------


class _RayTask:
    """One task's actor, with the interface of :class:`~stratagem.launch.supervisor.RunningTask` (``poll``,
    ``send``, ``running``, ``result``, ``process.wait``): the launch supervisor drives it.
    Exit statuses are those the last :meth:`_RayPump.pump` fetched."""

    def __init__(self, task: TaskId, actor, pump: "_RayPump"):
        self.task = task
        self.actor = actor
        self.pid = 0
        self.returncode: int | None = None
        self.ended = False  # the task has exited and its output has all arrived (or its actor is lost)
        self.stopped_by_launcher = False
        self.restarts = 0          # (--restart-workers is for the local launcher only)
        self.tolerated = False
        self._pump = pump

    @property
    def process(self) -> "_RayTask":
        return self  # the supervisor reaps ``task.process.wait()``

    @property
    def running(self) -> bool:
        return self.returncode is None

    def poll(self) -> int | None:
        return self.returncode

    def send(self, sig: int) -> None:
        """Signal the task if it still runs (asked of its actor, which knows: a task that has just
        exited on its own is not counted as stopped by the launcher)."""
        if self.returncode is not None or self.ended:
            return
        try:
            signalled = self._pump.ray.get(self.actor.signal.remote(int(sig)), timeout=CALL_TIMEOUT)
        except self._pump.ray.exceptions.RayError as exc:
            self._pump.lose(self, f"could not be signalled ({type(exc).__name__})")
            return
        self.stopped_by_launcher = self.stopped_by_launcher or signalled

    def wait(self) -> int:
        deadline = time.monotonic() + _REAP_SECONDS
        while self.returncode is None and time.monotonic() < deadline:
            self._pump.pump(POLL_INTERVAL)
        if self.returncode is None:
            self._pump.lose(self, f"did not exit {_REAP_SECONDS:g}s after SIGKILL")
        return self.returncode

    def result(self) -> TaskResult:
        return TaskResult(self.task, self.pid, self.returncode, self.stopped_by_launcher)


class _RayPump:
    """Fetches every task's new output and exit status from its actor; prints the lines prefixed
    (the launcher's ``OutputPump`` for pipes of this machine, here for actors')."""

    def __init__(self, ray, out: Sink, err: Sink):
        self.ray = ray
        self.tasks: list[_RayTask] = []
        self._out, self._err = out, err
        self._readers: dict[int, tuple[PipeReader, PipeReader]] = {}

    def add(self, task: _RayTask, color: str) -> None:
        self.tasks.append(task)
        self._readers[id(task)] = (PipeReader(task_prefix(task.task, color, self._out.stream), self._out),
                                   PipeReader(task_prefix(task.task, color, self._err.stream), self._err))

    def lose(self, task: _RayTask, why: str) -> None:
        """The actor is gone or stuck: the task counts as killed (SIGKILL), and says why."""
        if task.returncode is None:
            task.returncode = -9
        task.ended = True
        out, err = self._readers[id(task)]
        out.finish()
        err.finish()
        err.feed(f"stratagem: the Ray actor of {task.task.short} {why}\n".encode())
        try:
            self.ray.kill(task.actor)
        except Exception:  # noqa: BLE001  (already dead)
            pass

    def pump(self, timeout: float) -> None:
        started = time.monotonic()
        live = [t for t in self.tasks if not t.ended]
        refs = [t.actor.poll.remote() for t in live]
        arrived = False
        for task, ref in zip(live, refs):
            try:
                out, err, code, ended = self.ray.get(ref, timeout=CALL_TIMEOUT)
            except self.ray.exceptions.GetTimeoutError:
                self.lose(task, f"did not answer within {CALL_TIMEOUT:g}s")
                continue
            except self.ray.exceptions.RayError as exc:
                self.lose(task, f"died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
                continue
            readers = self._readers[id(task)]
            for reader, data in zip(readers, (out, err)):
                if data:
                    arrived = True
                    reader.feed(data)
            if code is not None:
                task.returncode = code
            if ended:
                task.ended = True
                for reader in readers:
                    reader.finish()
        if not arrived:
            time.sleep(max(0.0, timeout - (time.monotonic() - started)))

    def drain(self, seconds: float, poll_interval: float = POLL_INTERVAL) -> None:
        deadline = time.monotonic() + seconds
        while any(not t.ended for t in self.tasks) and time.monotonic() < deadline:
            self.pump(poll_interval)


# -- running a job ---------------------------------------------------------------------------------


def _tasks(workers: int, ps: int, chief: bool) -> list[TaskId]:
    """The job's tasks, in the launcher's order (chief, workers, ps)."""
    counts = {"chief": 1 if chief else 0, "worker": workers, "ps": ps}
    return [TaskId(job, i) for job, n in counts.items() for i in range(n)]


def _place(ray, n: int, cpus: float, spread: bool, timeout: float):
    from ray.util.placement_group import placement_group, remove_placement_group

    strategy = "STRICT_SPREAD" if spread else "PACK"
    group = placement_group([{"CPU": cpus}] * n, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        cpus_by_node = ", ".join(f"{node.get('Resources', {}).get('CPU', 0):g}" for node in nodes)
        need = f"{n} different nodes with {cpus:g} CPU(s) free each" if spread else f"{n * cpus:g} CPUs free"
        raise ConfigurationError(
            f"the Ray cluster could not place {n} tasks ({strategy}, {cpus:g} CPU(s) per task) within "
            f"{timeout:g}s: that needs {need}; the cluster has {len(nodes)} node(s) with {cpus_by_node or 'no'} "
            f"CPUs. Use fewer tasks, a smaller cpus_per_task (--cpus-per-task)"
            + (", or leave out spread (--spread)" if spread else "")
        ) from None
    return group


def _remote_error(ray, exc: BaseException, what: str) -> ConfigurationError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ConfigurationError):
        return ConfigurationError(str(cause))
    last_line = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    return ConfigurationError(f"{what}: {type(exc).__name__}: {last_line}")


def _run(command: Sequence[str] | None, function: Callable[[], Any] | None, *, script: bool, workers: int,
         ps: int, chief: bool, transport: str | None, secret: str | None, env: Mapping[str, str | None] | None,
         timeout: float | None, output: TextIO | None, error_output: TextIO | None, address: str | None,
         spread: bool, cpus_per_task: float, grace: float, ps_grace: float, placement_timeout: float,
         runtime_env: Mapping[str, Any] | None) -> RayResult:
    check_options(list(command) if command is not None else ["<function>"], workers, ps, chief, secret,
                     timeout, grace, ps_grace, None, check_program=False)
    if not (isinstance(cpus_per_task, (int, float)) and cpus_per_task > 0):
        raise ConfigurationError(f"cpus_per_task must be a number of CPUs > 0, got {cpus_per_task!r}")
    if not placement_timeout > 0:
        raise ConfigurationError(f"placement_timeout must be a number of seconds > 0, got {placement_timeout!r}")
    check_transport(transport)
    secret = job_secret(secret, os.environ)
    payload = None
    if function is not None:
        import cloudpickle

        payload = cloudpickle.dumps(function)
    out = Sink(output if output is not None else sys.stdout)
    err = Sink(error_output if error_output is not None else sys.stderr)

    tasks_ids = _tasks(workers, ps, chief)
    ray, started_ray = _connect(address, len(tasks_ids) * float(cpus_per_task))
    from stratagem.launch.ray_task import TaskRunner

    runner = ray.remote(TaskRunner)
    pump = _RayPump(ray, out, err)
    group = None
    actors: list = []
    try:
        group = _place(ray, len(tasks_ids), float(cpus_per_task), spread, placement_timeout)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {"num_cpus": float(cpus_per_task), "max_restarts": 0}
        if runtime_env:
            options["runtime_env"] = dict(runtime_env)
        for i, task in enumerate(tasks_ids):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            actors.append(runner.options(scheduling_strategy=strategy, **options).remote(task.short))
        try:
            addresses = ray.get([a.reserve.remote() for a in actors], timeout=CALL_TIMEOUT)
            nodes = ray.get([a.node.remote() for a in actors], timeout=CALL_TIMEOUT)
        except ray.exceptions.RayError as exc:
            raise _remote_error(ray, exc, "the Ray actors could not start") from None
        cluster = ClusterSpec({job: [addresses[i] for i, t in enumerate(tasks_ids) if t.job == job]
                               for job in dict.fromkeys(t.job for t in tasks_ids)})
        cwd = os.getcwd()
        running = [_RayTask(task, actor, pump) for task, actor in zip(tasks_ids, actors)]
        started = time.monotonic()
        with SignalTrap() as trap:
            starts = []
            for i, t in enumerate(running):
                variables = task_env({}, cluster, t.task, secret, transport)
                variables.update(env or {})
                starts.append(t.actor.start.remote(list(command or ()), variables, cwd=cwd, function=payload,
                                                   script=script))
                pump.add(t, COLORS[i % len(COLORS)])
            try:
                for t, pid in zip(running, ray.get(starts, timeout=CALL_TIMEOUT)):
                    t.pid = pid
            except ray.exceptions.RayError as exc:
                raise _remote_error(ray, exc, "a task could not start") from None
            outcome = run_to_end(running, pump, trap, timeout=timeout, ps_grace=ps_grace, grace=grace,
                                 started=started)
        values = {}
        if function is not None:
            import cloudpickle

            for t in running:
                if t.returncode == 0:
                    data = ray.get(t.actor.value.remote(), timeout=CALL_TIMEOUT)
                    if data is not None:
                        values[t.task.short] = cloudpickle.loads(data)  # from our own actor, through Ray
        result = RayResult.of(outcome, cluster, running, started,
                              nodes={t.short: node for t, node in zip(tasks_ids, nodes)}, values=values)
    finally:
        _clean_up(ray, actors, None if started_ray else group, err)  # our own instance: shutdown removes it
        if started_ray:
            ray.shutdown()
    err.write(result.summary() + "\n")
    return result


def _clean_up(ray, actors: list, group, err: Sink) -> None:
    """Kill every task that still runs, then the actors and the placement group: nothing outlives the job.

    Done in a thread given ``_CLEANUP_SECONDS``: Ray's calls wait for its processes without a time
    limit, and a Ctrl-C in a terminal also reaches the processes of a Ray instance started here (they
    share our process group), which then never answer. Tasks die with their actors in any case
    (``PR_SET_PDEATHSIG``).
    """
    def clean() -> None:
        closing = [a.close.remote() for a in actors]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=_REAP_SECONDS)
        except Exception:  # noqa: BLE001  (a dead actor: its task died with it)
            pass
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass

    thread = threading.Thread(target=clean, daemon=True, name="stratagem-ray-cleanup")
    thread.start()
    thread.join(_CLEANUP_SECONDS)
    if thread.is_alive():
        err.write(f"stratagem launch: the Ray cluster did not confirm within {_CLEANUP_SECONDS:g}s that the "
                  f"job's actors and placement group are gone; check with 'ray list actors'\n")


def run(script_or_fn: "str | os.PathLike | Sequence[str] | Callable[[], Any]", worker: int = 1, ps: int = 0,
        transport: str | None = None, *, chief: bool = False, args: Sequence[str] = (),
        address: str | None = None, spread: bool = False, cpus_per_task: float = 1.0,
        secret: str | None = None, env: Mapping[str, str | None] | None = None,
        timeout: float | None = None, output: TextIO | None = None, error_output: TextIO | None = None,
        grace: float = DEFAULT_GRACE, ps_grace: float = DEFAULT_PS_GRACE,
        placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT,
        runtime_env: Mapping[str, Any] | None = None) -> RayResult:
    """Run a stratagem job on Ray, one actor per task; see the module doc.

    ``script_or_fn``: a script's path (run with the node's Python, ``args`` after it), a command
    (a list: ``["python3", "train.py", "--epochs", "3"]``), or a function of no arguments (run in a
    child process of each task's actor; ``result.values`` holds what each task returned). A script
    path is made absolute here: every node needs the file there (a shared file system), or give
    ``runtime_env={"working_dir": "."}`` and a relative path. ``env`` adds variables to every task
    (None removes one). Raises ``ConfigurationError`` before anything starts for bad options, no
    Ray, or a cluster that cannot place the tasks; once the tasks run, every outcome is a
    :class:`RayResult` (``result.ok``, ``result.exit_code``, ``result.returncodes``).
    """
    if callable(script_or_fn):
        return _run(None, script_or_fn, script=False, workers=worker, ps=ps, chief=chief, transport=transport,
                    secret=secret, env=env, timeout=timeout, output=output, error_output=error_output,
                    address=address, spread=spread, cpus_per_task=cpus_per_task, grace=grace, ps_grace=ps_grace,
                    placement_timeout=placement_timeout, runtime_env=runtime_env)
    if isinstance(script_or_fn, (str, os.PathLike)):
        path = os.fspath(script_or_fn)
        if not (runtime_env and "working_dir" in runtime_env):
            path = os.path.abspath(path)
            if not os.path.isfile(path):
                raise ConfigurationError(f"no such script: {path}; give the path of the script every task runs")
        command, script = [path, *args], True
    else:
        command, script = [*script_or_fn, *args], False
    return _run(command, None, script=script, workers=worker, ps=ps, chief=chief, transport=transport,
                secret=secret, env=env, timeout=timeout, output=output, error_output=error_output, address=address,
                spread=spread, cpus_per_task=cpus_per_task, grace=grace, ps_grace=ps_grace,
                placement_timeout=placement_timeout, runtime_env=runtime_env)


def launch_ray(command: Sequence[str], workers: int = 1, ps: int = 0, chief: bool = False,
               transport: str | None = None, secret: str | None = None, timeout: float | None = None, *,
               address: str | None = None, spread: bool = False, cpus_per_task: float = 1.0,
               grace: float = DEFAULT_GRACE, ps_grace: float = DEFAULT_PS_GRACE,
               placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT, output: TextIO | None = None,
               error_output: TextIO | None = None) -> RayResult:
    """``stratagem launch --ray ADDRESS``: ``command`` once per task, each in a Ray actor's child process."""
    return _run(list(command), None, script=False, workers=workers, ps=ps, chief=chief, transport=transport,
                secret=secret, env=None, timeout=timeout, output=output, error_output=error_output,
                address=address, spread=spread, cpus_per_task=cpus_per_task, grace=grace, ps_grace=ps_grace,
                placement_timeout=placement_timeout, runtime_env=None)
