"""The cluster model: jobs, tasks, and where this process sits in them.

A *cluster* is a set of named *jobs* (``chief``, ``worker``, ``ps``, ...), each a list of *tasks*, one
process each, addressed ``/job:worker/task:1``. This is the shape of TensorFlow's ``TF_CONFIG``, so a
Kubernetes TFJob works unchanged, and of what ``stratagem launch`` writes into ``STRATAGEM_CONFIG``.

Example::

    >>> spec = ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]})
    >>> spec.num_tasks("worker")
    2
    >>> str(spec.chief)
    '/job:worker/task:0'
    >>> TaskId.parse("/job:ps/task:0") in spec
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from stratagem.core import slurm
from stratagem.core.errors import ConfigurationError
from stratagem.core.options import secret_from_env

#: Jobs whose tasks compute on replicas of the model, in rank order.
REPLICA_JOBS = ("chief", "worker")
#: TF_CONFIG spells the chief ``master`` in older TFJobs; we accept it as an alias.
JOB_ALIASES = {"master": "chief"}
#: TF's side-car job: it evaluates, never trains (not a replica, pushes nothing). TF_CONFIG may list
#: it in the cluster, or (the usual form) give it only as the task, outside the cluster.
EVALUATOR_JOB = "evaluator"

# \Z, not $ (which also matches before a trailing newline), and [0-9], not \d (which matches every
# Unicode digit): "worker:1\n" and "worker:\u0661" are not task names.
_JOB_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*\Z")
_TASK_PATTERN = re.compile(r"/job:(?P<job>[^/]+)/(?:replica:[0-9]+/)?task:(?P<index>[0-9]+)\Z")
_SHORT_PATTERN = re.compile(r"(?P<job>[A-Za-z_][A-Za-z0-9_\-]*):(?P<index>[0-9]+)\Z")


@dataclass(frozen=True, order=True)
class TaskId:
    """One task of a cluster: a job name and an index, printed as ``/job:worker/task:1``.

    >>> TaskId("worker", 1)
    TaskId('/job:worker/task:1')
    >>> TaskId.parse("worker:1") == TaskId.parse("/job:worker/task:1")
    True
    """

    job: str
    index: int

    def __post_init__(self):
        job = JOB_ALIASES.get(self.job, self.job) if isinstance(self.job, str) else self.job
        if not isinstance(job, str) or not _JOB_NAME.match(job):
            raise ConfigurationError(
                f"invalid job name {self.job!r}: use letters, digits, '_' or '-' (e.g. 'worker')"
            )
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ConfigurationError(
                f"invalid task index {self.index!r} for job {job!r}: it must be an integer >= 0"
            )
        object.__setattr__(self, "job", job)
        # Task ids key every table on the message path: hash once, not per lookup.
        object.__setattr__(self, "_hash", hash((job, self.index)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt from the fields: a hash computed in another process would be wrong in this one.
        return (TaskId, (self.job, self.index))

    @classmethod
    def parse(cls, text: "str | TaskId") -> "TaskId":
        """Parse ``/job:worker/task:1`` (or the short form ``worker:1``)."""
        if isinstance(text, TaskId):
            return text
        if not isinstance(text, str):
            raise ConfigurationError(f"a task must be given as '/job:NAME/task:INDEX', not {text!r}")
        match = _TASK_PATTERN.match(text) or _SHORT_PATTERN.match(text)
        if not match:
            raise ConfigurationError(
                f"cannot parse task {text!r}: write it as '/job:worker/task:1' or 'worker:1'"
            )
        try:
            return cls(match["job"], int(match["index"]))
        except ConfigurationError as exc:  # a job name that is not valid: say which input it came from
            raise ConfigurationError(f"cannot parse task {text!r}: {exc}") from None

    @property
    def short(self) -> str:
        """``worker:1`` -- the form used in log prefixes and on the wire."""
        return f"{self.job}:{self.index}"

    def __str__(self) -> str:
        return f"/job:{self.job}/task:{self.index}"

    def __repr__(self) -> str:
        return f"TaskId({str(self)!r})"


def _is_ascii_digits(text: str) -> bool:
    # str.isdigit() is also true of '²' and of other scripts' digits, which int() refuses or misreads.
    return text.isascii() and text.isdigit()


def _task_indices(job: str, tasks: Mapping) -> list[int]:
    """The indices of a sparse job ``{index: address}``; JSON gives them as strings ("0", "1")."""
    indices = []
    for key in tasks:
        if isinstance(key, int) and not isinstance(key, bool):
            indices.append(key)
        elif isinstance(key, str) and _is_ascii_digits(key) and str(int(key)) == key:
            indices.append(int(key))
        else:
            raise ConfigurationError(
                f"job {job!r}: {key!r} is not a task index; write a sparse job as "
                f"{{0: 'host:port', 1: 'host:port'}} (or with the keys \"0\", \"1\" in JSON)"
            )
    return sorted(indices)


def _check_address(job: str, index: int, address) -> str | None:
    if address is None:
        return None  # clusters derived from an MPI world have no socket addresses
    if not isinstance(address, str):
        raise ConfigurationError(
            f"job {job!r} task {index}: address must be a 'host:port' string, got {address!r}"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not _is_ascii_digits(port) or not 0 <= int(port) <= 65535:
        raise ConfigurationError(
            f"job {job!r} task {index}: address {address!r} is not 'host:port' "
            f"(e.g. '127.0.0.1:2222' or 'worker-1.svc:2222')"
        )
    return address


def host_of(address: str) -> str:
    """The host part of a cluster address, as written, lower case: one rule for every layer that
    groups tasks by host (collectives' ring and hierarchy, ``shm``, ``nccl``).

    >>> host_of("Worker-1.svc:2222"), host_of("[::1]:2222"), host_of("10.0.0.2:1")
    ('worker-1.svc', '::1', '10.0.0.2')
    """
    return address.rpartition(":")[0].strip("[]").lower()


class ClusterSpec:
    """The jobs of a cluster and the address of each task.

    Built from a mapping ``{"job": ["host:port", ...]}`` (TF_CONFIG's ``cluster``), or from a mapping
    ``{"job": {index: "host:port"}}`` for sparse jobs. ``master`` is read as ``chief``.
    """

    __slots__ = ("jobs",)

    def __init__(self, jobs: "Mapping[str, Iterable[str] | Mapping[int, str]] | ClusterSpec"):
        if isinstance(jobs, ClusterSpec):
            jobs = jobs.jobs
        if not isinstance(jobs, Mapping):
            raise ConfigurationError(
                f"a cluster must be a mapping of job name to a list of 'host:port', got {type(jobs).__name__}"
            )
        normalized: dict[str, tuple] = {}
        for raw_job, tasks in jobs.items():
            job = TaskId(raw_job, 0).job  # validates and applies the alias
            if job in normalized:
                raise ConfigurationError(f"job {job!r} is given twice (note: 'master' is an alias of 'chief')")
            if isinstance(tasks, Mapping):
                indices = _task_indices(job, tasks)
                if indices != list(range(len(indices))):
                    raise ConfigurationError(
                        f"job {job!r} has task indices {indices}: they must be 0..N-1 with no gaps"
                    )
                tasks = [tasks[i] if i in tasks else tasks[str(i)] for i in indices]
            if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Iterable):
                raise ConfigurationError(f"job {job!r}: tasks must be a list of 'host:port', got {tasks!r}")
            normalized[job] = tuple(_check_address(job, i, a) for i, a in enumerate(tasks))
            if not normalized[job]:
                raise ConfigurationError(f"job {job!r} has no tasks: remove it or give it at least one")
        if "chief" in normalized and len(normalized["chief"]) != 1:
            raise ConfigurationError(
                f"job 'chief' must have exactly one task, it has {len(normalized['chief'])}"
            )
        if len(normalized.get(EVALUATOR_JOB, ())) > 1:   # TF's rule (multi_worker_util)
            raise ConfigurationError(
                f"job 'evaluator' must have at most one task, it has {len(normalized[EVALUATOR_JOB])}: TensorFlow "
                f"allows one evaluator per cluster; evaluate with one, or run the others as separate jobs"
            )
        seen: dict[str, TaskId] = {}
        for job, addresses in normalized.items():
            for index, address in enumerate(addresses):
                if address is None:
                    continue
                if address in seen and not address.endswith(":0"):
                    raise ConfigurationError(
                        f"{TaskId(job, index)} and {seen[address]} share the address {address}: "
                        f"every task needs its own port"
                    )
                seen[address] = TaskId(job, index)
        object.__setattr__(self, "jobs", normalized)

    def __setattr__(self, name, value):
        raise AttributeError("ClusterSpec is immutable")

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and self.jobs == other.jobs

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    # -- queries ---------------------------------------------------------------------------------
    @property
    def job_names(self) -> list[str]:
        return list(self.jobs)

    def num_tasks(self, job: str) -> int:
        return len(self.jobs.get(JOB_ALIASES.get(job, job), ()))

    def address(self, task: "TaskId | str") -> str | None:
        task = TaskId.parse(task)
        self.check(task)
        return self.jobs[task.job][task.index]

    def check(self, task: "TaskId | str") -> TaskId:
        """Return ``task`` if it is part of this cluster, else raise an error naming what exists."""
        task = TaskId.parse(task)
        if task.job == EVALUATOR_JOB and task.job not in self.jobs:
            raise ConfigurationError(
                f"{task} is not in the cluster (it lists no 'evaluator' job), so it cannot reach the training "
                f"tasks: an evaluator outside the cluster reads the checkpoints the chief writes "
                f"(stratagem.training.checkpoint.latest_checkpoint(dir) and load(path).variables); to read the "
                f"variables from the ps tasks instead, list it in every task's cluster "
                f"(\"evaluator\": [\"host:port\"])"
            )
        if task.job not in self.jobs:
            raise ConfigurationError(
                f"job {task.job!r} is not in the cluster (jobs: {', '.join(self.jobs) or 'none'}); "
                f"fix the task type in your config or add the job to the cluster"
            )
        count = len(self.jobs[task.job])
        if task.index >= count:
            raise ConfigurationError(
                f"task index {task.index} is out of range for job {task.job!r}, which has {count} "
                f"task(s) (indices 0..{count - 1}); fix the task index or add tasks to the job"
            )
        return task

    def __contains__(self, task) -> bool:
        try:
            self.check(task)
        except ConfigurationError:
            return False
        return True

    def tasks(self, job: str | None = None) -> list[TaskId]:
        """Tasks of one job, or of all jobs (replica jobs first, then the others by name)."""
        if job is not None:
            job = JOB_ALIASES.get(job, job)
            return [TaskId(job, i) for i in range(self.num_tasks(job))]
        ordered = [j for j in REPLICA_JOBS if j in self.jobs] + sorted(
            j for j in self.jobs if j not in REPLICA_JOBS
        )
        return [t for j in ordered for t in self.tasks(j)]

    def __iter__(self) -> Iterator[TaskId]:
        return iter(self.tasks())

    def __len__(self) -> int:
        return sum(len(a) for a in self.jobs.values())

    def replicas(self) -> list[TaskId]:
        """The tasks that compute (``chief`` then ``worker``), in rank order."""
        return [t for j in REPLICA_JOBS for t in self.tasks(j)]

    @property
    def chief(self) -> TaskId:
        """``chief:0`` if the cluster has a chief, else ``worker:0``."""
        if "chief" in self.jobs:
            return TaskId("chief", 0)
        if "worker" in self.jobs:
            return TaskId("worker", 0)
        raise ConfigurationError("the cluster has neither a 'chief' nor a 'worker' job, so it has no chief")

    # -- serialisation ---------------------------------------------------------------------------
    def as_dict(self) -> dict[str, list]:
        return {job: list(addresses) for job, addresses in self.jobs.items()}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        try:
            return cls(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"cluster JSON is not valid JSON: {exc}") from None

    @property
    def cluster_id(self) -> str:
        """A stable id of this cluster's shape, so that two clusters never talk to each other by accident."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ResolvedCluster:
    """What ``ClusterResolver`` found: the cluster, this process's task, the secret and the source.

    The secret is never shown (``repr``, ``str``, logs): only whether there is one.

    >>> ResolvedCluster(ClusterSpec({"worker": ["a:1"]}), TaskId("worker", 0), b"hunter2")
    ResolvedCluster(cluster=ClusterSpec({'worker': ['a:1']}), task=TaskId('/job:worker/task:0'), secret=<set>, source='default', rpc_layer=None)
    """

    cluster: ClusterSpec
    task: TaskId
    secret: bytes | None = field(default=None, repr=False)
    source: str = "default"
    rpc_layer: str | None = None

    def __repr__(self) -> str:
        secret = "<set>" if self.secret else "None"
        return (f"ResolvedCluster(cluster={self.cluster!r}, task={self.task!r}, secret={secret}, "
                f"source={self.source!r}, rpc_layer={self.rpc_layer!r})")

    __str__ = __repr__

    @property
    def is_chief(self) -> bool:
        return self.task == self.cluster.chief

    @property
    def is_evaluator(self) -> bool:
        """True for TF's side-car evaluator (listed in the cluster or not): it trains nothing."""
        return is_evaluator(self.task)

    @property
    def in_cluster(self) -> bool:
        """False for an evaluator given only as the task (TF's usual form): it cannot start a
        transport, and reads checkpoints instead."""
        return self.task in self.cluster


def is_evaluator(task: "TaskId | str") -> bool:
    """True if ``task`` is an evaluator: not a replica, pushes no gradients, may read the variables.

    >>> is_evaluator("evaluator:0"), is_evaluator("worker:0")
    (True, False)
    """
    return TaskId.parse(task).job == EVALUATOR_JOB


#: MPI launchers' rank/size variables, in the order we look for them (Slurm's: see ``from_env``).
MPI_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)
#: Slurm's rank/size variables (a job step: ``ClusterResolver.from_slurm``).
SLURM_RANK_VARS = ("SLURM_PROCID", "SLURM_NTASKS")


class ClusterResolver:
    """Finds the cluster and this process's task from the environment.

    In order: ``STRATAGEM_CONFIG`` (written by ``stratagem launch``), ``TF_CONFIG`` (Kubernetes TFJob),
    MPI launch variables (``mpiexec``), then a Slurm step (``srun``: ranks from ``SLURM_PROCID``,
    addresses from the node list and ``STRATAGEM_PORT``, see :mod:`stratagem.core.slurm`); with none of
    them, a one-task cluster (``worker:0``) so a script also runs as a plain ``python train.py``.

    MPI variables that srun set itself (``srun --mpi=pmix`` sets ``PMIX_RANK``, ``--mpi=pmi2``
    ``PMI_RANK``) describe the same world as ``SLURM_PROCID``: inside a job step whose rank and size
    they match, the Slurm step is used, which adds the addresses. Under ``mpiexec`` (ranks that are
    not the step's), the MPI variables win.

    >>> import json
    >>> env = {"TF_CONFIG": json.dumps({"cluster": {"master": ["a:1"], "worker": ["b:2"]},
    ...                                 "task": {"type": "worker", "index": 0}})}
    >>> ClusterResolver.from_env(env).task
    TaskId('/job:worker/task:0')
    """

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> ResolvedCluster:
        env = os.environ if environ is None else environ
        secret_bytes = secret_from_env(env)
        for var in ("STRATAGEM_CONFIG", "TF_CONFIG"):
            if env.get(var) and not (var == "TF_CONFIG" and _empty_config(env[var])):
                return ClusterResolver.from_config(env[var], source=var, secret=secret_bytes)
        mpi = next(((r, _int_var(env, r), _int_var(env, s)) for r, s in MPI_RANK_VARS if r in env and s in env), None)
        if mpi is not None and not _srun_set(env, mpi[1:]):
            rank_var, rank, size = mpi
            return ClusterResolver.from_mpi(rank, size, num_ps=_int_var(env, "STRATAGEM_NUM_PS", default=0),
                                            secret=secret_bytes, source=f"mpi ({rank_var})")
        if slurm.step_world(env) is not None:
            return ClusterResolver.from_slurm(env, num_ps=_int_var(env, "STRATAGEM_NUM_PS", default=0),
                                              secret=secret_bytes)
        cluster = ClusterSpec({"worker": ["127.0.0.1:0"]})
        return ResolvedCluster(cluster, TaskId("worker", 0), secret_bytes, "default (single process)")

    @staticmethod
    def from_config(text: str, *, source: str = "config", secret: bytes | None = None) -> ResolvedCluster:
        """Parse the TF_CONFIG-shaped JSON: ``{"cluster": {...}, "task": {"type": ..., "index": ...}}``."""
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(f"{source} is not valid JSON ({exc}); it must look like "
                                     '{"cluster": {"worker": ["host:port"]}, "task": {"type": "worker", "index": 0}}') from None
        if not isinstance(config, dict) or "cluster" not in config:
            raise ConfigurationError(f"{source} has no 'cluster' entry; it must look like "
                                     '{"cluster": {"worker": ["host:port"]}, "task": {"type": "worker", "index": 0}}')
        cluster = ClusterSpec(config["cluster"])
        task_entry = config.get("task") or {}
        if not isinstance(task_entry, dict) or "type" not in task_entry:
            raise ConfigurationError(f"{source} has no 'task' entry with a 'type' (e.g. "
                                     '"task": {"type": "worker", "index": 0})')
        index = task_entry.get("index", 0)
        if isinstance(index, str) and _is_ascii_digits(index):
            index = int(index)
        task = TaskId(task_entry["type"], index)
        if task.job == EVALUATOR_JOB and task.job not in cluster.jobs:
            # TF's usual evaluator: a side-car outside the cluster that reads checkpoints.
            return ResolvedCluster(cluster, task, secret, source, config.get("rpc_layer"))
        if task.job not in cluster.jobs:
            raise ConfigurationError(
                f"{source}: task type {task_entry['type']!r} is not a job of the cluster "
                f"(jobs: {', '.join(cluster.jobs)}); fix 'task.type'"
            )
        cluster.check(task)
        return ResolvedCluster(cluster, task, secret, source, config.get("rpc_layer"))

    @staticmethod
    def from_mpi(rank: int, size: int, *, num_ps: int = 0, secret: bytes | None = None,
                 source: str = "mpi") -> ResolvedCluster:
        """Map an MPI world onto jobs: ranks ``0..size-num_ps-1`` are workers (rank 0 the chief),
        the last ``num_ps`` ranks are ``ps`` tasks. Tasks have no socket addresses (MPI moves the data)."""
        if not 0 <= rank < size:
            raise ConfigurationError(f"MPI rank {rank} is outside the world of size {size}")
        if not 0 <= num_ps < size:
            raise ConfigurationError(
                f"STRATAGEM_NUM_PS={num_ps} leaves no worker in an MPI world of {size} ranks; "
                f"use fewer ps tasks or more ranks"
            )
        workers = size - num_ps
        jobs = {"worker": [None] * workers}
        if num_ps:
            jobs["ps"] = [None] * num_ps
        task = TaskId("worker", rank) if rank < workers else TaskId("ps", rank - workers)
        return ResolvedCluster(ClusterSpec(jobs), task, secret, source)

    @staticmethod
    def from_slurm(environ: Mapping[str, str], *, num_ps: int = 0, secret: bytes | None = None) -> ResolvedCluster:
        """The cluster of a Slurm job step (``srun``): rank ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS``
        (else ``SLURM_NTASKS``) tasks, mapped onto jobs as :meth:`from_mpi` does. With ``STRATAGEM_PORT``
        set, every task gets the address ``node:STRATAGEM_PORT+local id`` from the step's node list and
        tasks per node (:func:`stratagem.core.slurm.addresses`), so ``transport="zmq"``/``"grpc"`` work;
        without it, the tasks have no addresses (``transport="mpi"`` under ``srun --mpi=pmix``)."""
        step = slurm.step_world(environ)
        if step is None:
            raise ConfigurationError("not in a Slurm job step: SLURM_PROCID and SLURM_NTASKS are not set "
                                     "(start the script with srun)")
        rank, size = step
        if size > 1 and not slurm.is_step(environ):
            raise ConfigurationError(
                f"SLURM_PROCID={rank} and SLURM_NTASKS={size} describe a job of {size} tasks, but this process "
                f"was not started by srun (no SLURM_STEP_ID: a batch script runs once): start it with "
                f"'srun python3 train.py'"
            )
        resolved = ClusterResolver.from_mpi(rank, size, num_ps=num_ps, secret=secret, source="slurm")
        if not environ.get(slurm.PORT_VAR):
            return ResolvedCluster(resolved.cluster, resolved.task, secret,
                                   f"slurm (SLURM_PROCID; no {slurm.PORT_VAR}, so no addresses)")
        where = iter(slurm.addresses(environ, rank, size))
        jobs = {job: [next(where) for _ in tasks] for job, tasks in resolved.cluster.jobs.items()}
        return ResolvedCluster(ClusterSpec(jobs), resolved.task, secret, f"slurm (SLURM_PROCID, {slurm.PORT_VAR})")


def _empty_config(text: str) -> bool:
    """True for a TF_CONFIG that says nothing (``{}``, or empty ``cluster`` and ``task``): TensorFlow
    reads it as no TF_CONFIG at all, so the next source applies (alone: a world of one)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return False          # from_config says what is wrong with it
    return isinstance(config, dict) and not config.get("cluster") and not config.get("task")


def _srun_set(env: Mapping[str, str], world: tuple[int, int]) -> bool:
    """True if the MPI ``world`` (rank, size) is srun's own (``srun --mpi=pmix``): inside a job step whose
    rank and size are the same. Then the Slurm step is used instead, which also gives addresses."""
    if not slurm.is_step(env):
        return False
    try:
        return slurm.step_world(env) == world
    except ConfigurationError:  # unusable Slurm variables: the MPI world stands
        return False


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigurationError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={value!r} is not an integer") from None
