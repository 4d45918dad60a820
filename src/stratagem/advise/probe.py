"""The measurements of ``stratagem advise``: one job for the machine, one per transport for its links.

Each job is a local cluster started the way the bench starts its jobs (:func:`stratagem.launch.launcher.launch`,
or :func:`stratagem.launch.mpi.launch_mpi` for a transport that runs as one MPI job), every task
running :mod:`stratagem.advise.probe_task`, with one math thread each (as the bench's tasks):

- the *machine* job (``zmq``, as many tasks as the busiest setup predicted here needs, at least
  cores + 1): the model's parts on one task (a batch, forward and backward, a ps's update, a
  gradient add) and how ``loss_and_grads`` slows down when ``k`` tasks run it at once, free-running
  and in lockstep; fitted to :class:`~stratagem.advise.costmodel.Host` (the cores, the background
  load, the stragglers) and idle-core times (CPU times: :func:`fit_machine`);
- a *link* job per transport, 2 workers and a ps: all-reduce, round trips and a real parameter
  server's push-and-pull at a few sizes around the model's, with the CPU each cost; fitted to the
  alpha-beta :class:`~stratagem.advise.costmodel.Link` of each and its
  :class:`~stratagem.advise.costmodel.CpuCosts` (:func:`fit_transport`);
- a *steps* job per strategy and transport (:data:`STEP_JOBS`, :mod:`stratagem.advise.steps_task`):
  the strategy's real steps on the model's variables, the compute in place but not counted (a
  ``between_graph`` sync round of 2 workers and an async worker alone, a ``parameter_server`` worker
  under its coordinator, the ``in_graph`` client with 2 replicas): the time and CPU a step costs
  beyond the compute (:func:`fit_steps`), of which the cost model charges what the links do not
  explain (:func:`~stratagem.advise.costmodel.step_residuals`).

A transport that cannot run here is reported with the reason (as ``stratagem bench`` does) and left
out of the predictions. A job that fails raises :class:`ProbeError` with its failed task's last
lines. :func:`fit` turns the raw figures (kept in ``Measurements.raw``) into the model's, so a saved
measurement can be refitted.

    >>> sizes_around(1_600_000)
    [4096, 400000, 1600000, 3200000]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from stratagem.advise import costmodel as cm
from stratagem.core.errors import ConfigurationError, StratagemError

_TASK_MODULE = "stratagem.advise.probe_task"
#: The last line of a task's traceback: ``[worker:1] RuntimeError: ...``.
_EXCEPTION = re.compile(r"^\[[\w:]+\] (\w+\.)*\w*(Error|Exception|Exit|Interrupt|Timeout)\b.*:")
#: Math libraries get one thread per task, as in the bench: the tasks share the cores.
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
#: Bytes moved per size, for the iteration count: ``clamp(VOLUME / size, MIN_ITERS, MAX_ITERS)``.
VOLUME, MIN_ITERS, MAX_ITERS = 48 << 20, 5, 40


class ProbeError(StratagemError):
    """A measurement job failed; the message has its reason and last lines."""


@dataclass(frozen=True)
class ProbeSettings:
    """How hard to measure. ``quick``: fewer sizes, rounds, seconds and steps (the jobs' start-up,
    about a second each, stays)."""

    model: str = "mlp"
    transports: tuple = ()
    seed: int = 0
    quick: bool = False
    machine_tasks: int | None = None     # default: max(cores + 2, 4); the probe needs at least cores + 1
    timeout: float = 120.0

    @property
    def rounds(self) -> int:
        return 1 if self.quick else 2

    @property
    def duration(self) -> float:
        return 0.2 if self.quick else 0.35


@dataclass
class Measurements:
    """What the probes measured, and the cost model's figures fitted to it."""

    host: cm.Host
    work: cm.Workload
    transports: dict
    skipped: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    seconds: float = 0.0
    #: Rows to the target loss, sync and async (None: not measured, as in an older measurement).
    convergence: cm.Convergence | None = None

    def as_dict(self) -> dict:
        return {"host": cm.figures_as_dict(self.host), "workload": cm.figures_as_dict(self.work),
                "transports": {k: cm.figures_as_dict(v) for k, v in self.transports.items()},
                "convergence": None if self.convergence is None else cm.figures_as_dict(self.convergence),
                "skipped": dict(self.skipped), "seconds": self.seconds, "raw": self.raw}

    @classmethod
    def from_dict(cls, doc: dict) -> "Measurements":
        """Back from :meth:`as_dict` (``stratagem advise --measured FILE``)."""
        work = dict(doc["workload"])
        work["shards"] = {int(k): tuple(v) for k, v in work.get("shards", {}).items()}
        transports = {name: transport_from_dict(t) for name, t in doc["transports"].items()}
        return cls(host_from_dict(doc["host"]), cm.Workload(**work), transports, dict(doc.get("skipped", {})),
                   doc.get("raw", {}), doc.get("seconds", 0.0), convergence_from_dict(doc.get("convergence")))


def transport_from_dict(t: dict) -> cm.TransportFigures:
    def link(value):
        return cm.Link(**value) if value else None
    cpu = t.get("cpu") or {}
    steps = {k: cm.StepCost(**v) for k, v in (t.get("steps") or {}).items() if v}
    return cm.TransportFigures(t["name"], link(t["allreduce"]), link(t["p2p"]), link(t.get("ps")),
                               t.get("idle_burn", 0.0), t.get("one_group", False),
                               cpu=cm.CpuCosts(**{k: link(v) for k, v in cpu.items()}), steps=cm.StepCosts(**steps))


def convergence_from_dict(doc: dict | None) -> cm.Convergence | None:
    """The convergence figures back from JSON (the probe's raw output, or ``Convergence`` as a dict)."""
    if not doc:
        return None
    as_pairs = lambda points: tuple((int(k), None if r is None else int(r)) for k, r in points)  # noqa: E731
    return cm.Convergence(float(doc["target_loss"]), as_pairs(doc.get("sync", ())),
                          as_pairs(doc.get("async_", doc.get("async", ()))))


def host_from_dict(doc: dict) -> cm.Host:
    return cm.Host(doc["cores"], doc.get("background", 0.0), tuple(tuple(p) for p in doc.get("stragglers", ())))


def cores_here() -> int:
    """The cores this process may run on (its CPU affinity), which its children inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def sizes_around(param_bytes: int, quick: bool = False) -> list[int]:
    """Message sizes for the link probes: a small one (latency) and the model's scale (bandwidth).

    >>> sizes_around(8_000_000, quick=True)
    [4096, 8000000]
    """
    top = max(4096, min(int(param_bytes), 256 << 20)) // 4 * 4
    if quick:
        return sorted({4096, top})
    return sorted({4096, max(4096, top // 4 // 4 * 4), top, min(2 * top, 512 << 20)})


def schedule(sizes: Sequence[int], quick: bool = False) -> list[dict]:
    """Warm-up and timed iterations per size (fewer for large sizes).

    >>> [(p["bytes"], p["warmup"], p["iters"]) for p in schedule([4096, 1 << 24])]
    [(4096, 3, 40), (16777216, 2, 5)]
    """
    plan = []
    for size in sizes:
        iters = max(MIN_ITERS, min(MAX_ITERS, VOLUME // max(1, size)))
        if quick:
            iters = max(MIN_ITERS, iters // 3)
        plan.append({"bytes": int(size), "warmup": 2 if size > (1 << 20) else 3, "iters": int(iters)})
    return plan


def describe_model(spec: str, seed: int = 0) -> dict:
    """The model's name, batch, parameter bytes (sorted by name, as the bench creates them), the bytes
    of one replica's batch, and where its variables go on 1..4 ps tasks (the strategies' default
    placement). Raises ``ConfigurationError`` for a model that cannot be built or used."""
    import numpy as np

    from stratagem.bench.models import build_model
    from stratagem.ps_service.placement import Placer
    from stratagem.strategies.ps.base import DEFAULT_PARTITION_BYTES

    model = build_model(spec)
    step = "init_params(seed)"
    try:
        params = model.init_params(seed)
        step = "batch(seed, replica=0, step=0, rows=batch_size)"
        batch = model.batch(seed, 0, 0, int(model.batch_size))
        step = "loss_and_grads(params, batch)"
        model.loss_and_grads(params, batch)
    except Exception as exc:
        raise ConfigurationError(f"--model {spec}: {step} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(params, dict) or not params:
        raise ConfigurationError(f"--model {spec}: init_params(seed) must return a non-empty dict of arrays")
    names = sorted(params)
    shards = {}
    for ps in range(1, 5):
        placer = Placer(ps, "round_robin", DEFAULT_PARTITION_BYTES)
        for name in names:
            value = np.asarray(params[name])
            placer.place(name, value.shape, value.dtype)
        shards[ps] = tuple(int(b) for b in placer.loads)
    arrays = batch if isinstance(batch, (tuple, list)) else (batch,)
    return {"name": str(model.name), "batch_size": int(model.batch_size),
            "learning_rate": float(model.learning_rate),
            "param_bytes": int(sum(np.asarray(params[n]).nbytes for n in names)),
            "input_bytes": int(sum(np.asarray(a).nbytes for a in arrays)), "shards": shards}


class _Tail:
    """The job's output: the last lines of each task (``[worker:1] ...``), for a failure's report."""

    def __init__(self):
        self.lines: dict[str, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=8))
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                task = line[1:line.index("]")] if line.startswith("[") and "]" in line else ""
                self.lines[task].append(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def of(self, task: str | None) -> list[str]:
        """The last lines of the task that failed first, by cause: a task whose error is its own (not
        a lost peer: the others lose it when it fails, and one of them may exit first), else the
        task the launcher names, else every task's last line."""
        own = [name for name, lines in self.lines.items()
               if name and lines and _EXCEPTION.search(lines[-1]) and "PeerLostError" not in lines[-1]]
        if own:
            return list(self.lines[own[0]])
        if task and self.lines.get(task):
            return list(self.lines[task])
        return [lines[-1] for name, lines in self.lines.items() if name and lines]


def run_job(spec: dict, tasks: int, transport: str, timeout: float, mpi_job: bool = False, ps: int = 0,
            chief: bool = False, script: str | None = None) -> dict:
    """One job of ``tasks`` worker tasks (and ``ps`` ps tasks, and a ``chief`` task) running the probe
    task with ``spec`` (``script``: a script file instead of the probe task module); the first task's JSON."""
    from stratagem.launch.launcher import launch
    from stratagem.launch.mpi import launch_mpi

    with tempfile.TemporaryDirectory(prefix="stratagem-advise-") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "out.json"), timeout=max(10.0, timeout * 0.8))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        tail = _Tail()
        command = [sys.executable, script, spec_path] if script else [sys.executable, "-m", _TASK_MODULE, spec_path]
        env = {**ONE_THREAD, "PYTHONUNBUFFERED": "1"}
        if mpi_job:
            # (an MPI job's chief is rank 0, worker:0: one more worker)
            result = launch_mpi(command, workers=tasks + chief, ps=ps, transport=transport, env=env,
                                timeout=timeout, output=tail, error_output=tail)
        else:
            result = launch(command, workers=tasks, ps=ps, chief=chief, transport=transport, env=env,
                            timeout=timeout, output=tail, error_output=tail, ps_grace=10.0)
        if result.ok and os.path.exists(spec["out"]):
            with open(spec["out"]) as f:
                doc = json.load(f)
            ps_cpu = os.path.join(tmp, "ps_cpu.json")      # the ps task's CPU per push, by piece
            if os.path.exists(ps_cpu):
                with open(ps_cpu) as f:
                    doc["ps_server_cpu"] = json.load(f)
            others = sorted(n for n in os.listdir(tmp) if n.startswith("out.json.") and not n.endswith(".tmp"))
            for name in others:                             # the other tasks' figures (steps probe)
                with open(os.path.join(tmp, name)) as f:
                    doc.setdefault("tasks", {})[name[len("out.json."):]] = json.load(f)
            return doc
        failed = result.failed_task.short if getattr(result, "failed_task", None) is not None else None
        lines = tail.of(failed)
        why = result.reason if not result.ok else "the job ended without writing its figures"
        raise ProbeError(f"the {spec['mode']} probe over {transport} failed: {why}"
                         + ("\n  " + "\n  ".join(lines) if lines else ""))


def _fastest(times: Sequence[float]) -> float:
    return min(t for t in times if t == t)   # (NaN-free)


def fit_machine(raw: dict, model: dict) -> tuple[cm.Host, cm.Workload]:
    """Host and idle-core workload figures from the machine job's output.

    Idle-core figures are CPU times: what the work costs a core, whatever else the machine runs (a
    busy machine stretches the wall time, not the CPU time; the fastest wall time of a call is no
    good either, for under heavy load no call runs without being preempted). The background load is
    fitted to the free-running rounds' wall times against that idle-core compute, the stragglers to
    the lockstep rounds."""
    free = [(entry["k"], t) for entry in raw["sharing"] for t in entry["seconds"] if t == t]
    lockstep = [(entry["k"], t) for entry in raw.get("lockstep", []) for t in entry["seconds"] if t == t]
    parts = raw["parts"]
    cpu = [t for entry in raw["sharing"] for t in entry.get("cpu", []) if t == t]
    if cpu:
        idle = _median([parts["compute_cpu_s"]] + cpu) if "compute_cpu_s" in parts else _median(cpu)
    else:   # (figures of an older probe: the fastest call)
        idle = min([parts["compute_fastest_s"]] + [t for e in raw["sharing"] for t in e.get("fastest", []) if t == t])
    host, idle_compute = cm.fit_host(raw["cores"], free, idle_s=idle)
    host = cm.Host(host.cores, host.background, cm.fit_stragglers(free, lockstep))
    S = max(1, model["param_bytes"])

    def alone(name):   # a part's idle-core seconds: its CPU time where measured
        return parts.get(f"{name}_cpu_s", parts[f"{name}_fastest_s"])
    work = cm.Workload(model["name"], model["batch_size"], model["param_bytes"], model["input_bytes"],
                       data_s=alone("data"), compute_s=idle_compute,
                       update_s_per_byte=alone("update") / S, add_s_per_byte=alone("add") / S,
                       shards={int(k): tuple(v) for k, v in model["shards"].items()})
    return host, work


def fit_transport(raw: dict, one_group: bool = False) -> cm.TransportFigures:
    """A transport's idle-core links from its link job, each fitted to the fastest time per size (as
    for the machine's figures): all-reduce to the ring formula, the slowest pair's round trips to the
    one-way p2p link, the parameter server's push-and-pull (its update included) to the ps link; and
    the CPU each cost the task that measured it (per all-reduce call, per round trip, per exchange on
    the worker, per push on the ps), fitted the same way to the mean CPU per call."""
    n = len({p["a"] for p in raw["pairs"]} | {p["b"] for p in raw["pairs"]}) or 2
    ring = cm.fit_allreduce([(e["data_bytes"], _fastest(e["times_s"])) for e in raw["allreduce"]], n)
    ring_cpu = _cpu(raw["allreduce"], "data_bytes", lambda pts: cm.fit_allreduce(pts, n))
    pairs = [(cm.fit_round_trip([(e["bytes"], _fastest(e["times_s"])) for e in pair["sizes"]]), pair)
             for pair in raw["pairs"]]
    slowest, pair = min(pairs, key=lambda lp: lp[0].bandwidth_Bps) if pairs else (ring, None)
    p2p_cpu = _cpu(pair["sizes"], "bytes", _per_call) if pair else None
    ps = exchange_cpu = serve_cpu = None
    if raw.get("ps_exchange"):
        ps = cm.fit_round_trip([(e["bytes"], _fastest(e["times_s"])) for e in raw["ps_exchange"]])
        exchange_cpu = _cpu(raw["ps_exchange"], "bytes", _per_call)
        server = raw.get("ps_server_cpu") or {}
        served = [{"bytes": e["bytes"], "cpu_s": _median(server.get(f"piece{i}", []))}
                  for i, e in enumerate(raw["ps_exchange"])]
        serve_cpu = _cpu(served, "bytes", _per_call) if all(e["cpu_s"] for e in served) else None
    burn = min(1.0, float(raw.get("idle_burn", {}).get("collective", 0.0)))
    return cm.TransportFigures(raw["transport"], ring, slowest, ps, burn, one_group,
                               cpu=cm.CpuCosts(ring_cpu, p2p_cpu, exchange_cpu, serve_cpu))


def _per_call(points) -> cm.Link:
    a, b = cm.fit_line(points)
    return cm.Link(a, 1.0 / b if b > 0 else float("inf"))


def _cpu(entries: Sequence[dict], size_key: str, fit) -> cm.Link | None:
    points = [(e[size_key], e["cpu_s"]) for e in entries if e.get("cpu_s")]
    return fit(points) if len(points) >= 1 else None


def _median(values: Sequence[float]) -> float | None:
    values = sorted(v for v in values if v == v)
    return values[len(values) // 2] if values else None


def autogroup() -> bool:
    """Whether the kernel shares the CPU between sessions first (Linux's ``sched_autogroup``): then
    the ranks of one ``mpiexec`` job, one session, get one share between them."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def measure(settings: ProbeSettings, on_progress: Callable[[str], None] = lambda text: None) -> Measurements:
    """Run the probes (about 40 s on 2 cores with 4 transports, 30 s ``quick``) and fit the cost model's figures."""
    from stratagem.bench.availability import check_transport
    from stratagem.core.errors import PluginError

    started = time.monotonic()
    model = describe_model(settings.model, settings.seed)
    checks = {}
    for name in settings.transports:
        try:
            checks[name] = check_transport(name)
        except PluginError as exc:
            raise ConfigurationError(f"--transports: {exc}") from None
    runnable = [name for name, check in checks.items() if check.skip is None and check.max_np is None]
    skipped = {name: check.skip or "one GPU per task: not predicted by advise"
               for name, check in checks.items() if name not in runnable}

    cores = cores_here()
    tasks = settings.machine_tasks or max(cores + 2, 4)
    ks = sorted({1, 2, max(1, cores // 2), cores, cores + 1, tasks} - {0})
    on_progress(f"machine: {tasks} tasks, the model's parts and CPU sharing (k = {', '.join(map(str, ks))})")
    machine = run_job({"mode": "machine", "model": settings.model, "seed": settings.seed, "ks": ks,
                       "rounds": settings.rounds, "duration": settings.duration,
                       "repeats": 5 if settings.quick else 9}, tasks, "zmq", settings.timeout)
    host, work = fit_machine(machine, model)
    on_progress(f"machine: {cores} cores, background {host.background:.1f} busy processes, "
                f"compute {work.compute_s * 1e3:.2f} ms on an idle core")
    on_progress("convergence: rows to the target loss, sync and async, 1-8 replicas (this process)")
    convergence = measure_convergence(settings)

    plan = schedule(sizes_around(model["param_bytes"], settings.quick), settings.quick)
    grouped = autogroup()
    links = {}
    for name in runnable:
        on_progress(f"link: {name}")
        links[name] = run_job({"mode": "link", "transport": name, "sizes": plan,
                               "learning_rate": model["learning_rate"],
                               "idle_probe": 0.15 if settings.quick else 0.25}, 2, name,
                              settings.timeout, mpi_job=checks[name].mpi_job, ps=1)
        links[name]["one_group"] = bool(checks[name].mpi_job and grouped)
        links[name]["steps"] = measure_steps(settings, name, checks[name].mpi_job, on_progress)
    raw = {"model": model, "machine": machine, "links": links, "plan": plan, "convergence": convergence,
           "loadavg_at_end": list(os.getloadavg())}
    return fit(raw, skipped, time.monotonic() - started)


#: The steps probe's jobs: (strategy, mode, workers that step, ps tasks, a coordinator task). Two
#: workers for a sync round; two async workers, the first alone and then both at once (what a
#: second worker adds: the cores, the ps and the wake-ups shared); one and two workers under a
#: coordinator (its dispatch, alone and shared); two in_graph replicas (the client's work per replica).
STEP_JOBS = (("between_graph", "sync", 2, 1, False), ("between_graph", "async", 2, 1, False),
             ("parameter_server", "async", 1, 1, True), ("parameter_server", "async", 2, 1, True),
             ("in_graph", None, 2, 0, False))
_STEPS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "steps_task.py")


def measure_steps(settings: ProbeSettings, transport: str, mpi_job: bool,
                  on_progress: Callable[[str], None] = lambda text: None) -> list[dict]:
    """The strategies' steps with no compute over ``transport`` (:mod:`stratagem.advise.steps_task`):
    one job per :data:`STEP_JOBS` entry; each entry's raw figures, with its shape."""
    out = []
    for strategy, mode, workers, ps, coordinator in STEP_JOBS:
        label = f"{strategy}:{mode}" if mode else strategy
        on_progress(f"steps: {label} over {transport}, {workers} worker{'s' * (workers != 1)}")
        spec = {"mode": "steps", "strategy": strategy, "consistency": mode, "transport": transport,
                "model": settings.model, "seed": settings.seed, "warmup": 3, "steps": 20 if settings.quick else 40}
        doc = run_job(spec, workers, transport, settings.timeout, mpi_job=mpi_job, ps=ps, chief=coordinator,
                      script=_STEPS_SCRIPT)
        doc.update(workers=workers, ps=ps)
        out.append(doc)
    return out


def fit_steps(docs: Sequence[dict] | None) -> cm.StepCosts:
    """The steps probe's figures as measured (:class:`~stratagem.advise.costmodel.StepCosts`): per
    step, the median wall and CPU seconds beyond the compute, after the warm-up steps.

    A sync round's wall is the last worker's to arrive (each step's least over the workers): the
    others also wait for its compute, which the model charges as stragglers. A closure's dispatch is
    the coordinator's wall per closure less the mean closure on its worker (its step and compute);
    its CPU, the coordinator's per closure and the worker's beyond its step."""
    found = {}
    for doc in docs or ():
        strategy, mode = doc["strategy"], doc.get("consistency")
        skip = 0 if strategy == "parameter_server" else int(doc.get("warmup", 0))
        wall, cpu = doc["wall_s"][skip:], doc["cpu_s"][skip:]
        workers = int(doc["workers"])
        tasks = doc.get("tasks") or {}
        ps_clock = next((t["cpu_clock"] for name, t in tasks.items() if name.startswith("ps-")), None)
        steppers = [doc] + [t for name, t in tasks.items() if not name.startswith("ps-")]

        def served(runs: Sequence[dict]) -> float:   # the ps's CPU per step of these runs
            return _cpu_per_step(ps_clock, [t for run in runs for t in (run.get("ended") or [])[skip:]])
        if strategy == "between_graph" and mode == "sync":
            for other in steppers[1:]:
                wall = [min(a, b) for a, b in zip(wall, other["wall_s"][skip:])]
            found["ps_sync"] = cm.StepCost(workers, _median(wall), _median(cpu), serve_cpu_s=served(steppers))
        elif strategy == "between_graph":
            if doc.get("alone"):    # the chief alone first, then every worker at once
                alone = doc["alone"]
                found["ps_async"] = cm.StepCost(1, _median(alone["wall_s"][skip:]), _median(alone["cpu_s"][skip:]),
                                                serve_cpu_s=served([alone]))
                found["ps_async_crowded"] = cm.StepCost(
                    workers, _median([t for d in steppers for t in d["wall_s"][skip:]]),
                    _median([t for d in steppers for t in d["cpu_s"][skip:]]), serve_cpu_s=served(steppers))
            else:
                found["ps_async" if workers == 1 else "ps_async_crowded"] = cm.StepCost(
                    workers, _median(wall), _median(cpu), serve_cpu_s=served(steppers))
        elif strategy == "parameter_server":
            closures = max(1, int(doc["closures"]))
            on_worker = [w + c for w, c in zip(wall, doc["compute_s"])]
            # the coordinator's wall per closure on each worker (they run side by side)
            dispatch = max(0.0, doc["coordinator_wall_s"] * workers / closures - sum(on_worker) / len(on_worker))
            by_worker = collections.defaultdict(list)
            for task, clock in zip(doc.get("workers_of") or [], doc.get("clock_s") or []):
                by_worker[task].append(clock)
            spent = [b - a for clocks in by_worker.values() for a, b in zip(clocks, clocks[1:])]
            stepped = [c + k for c, k in zip(cpu, doc.get("compute_cpu_s") or [])]
            beside = max(0.0, _median(spent) - _median(stepped)) if spent and stepped else 0.0
            figure = cm.StepCost(workers, _median(wall), _median(cpu), dispatch,
                                 doc["coordinator_cpu_s"] / closures + beside, served([doc]))
            found["coordinator" if workers == 1 else "coordinator_crowded"] = figure
        elif strategy == "in_graph":
            found["in_graph"] = cm.StepCost(int(doc.get("replicas", doc["workers"])), _median(wall), _median(cpu))
    return cm.StepCosts(**found)


def _cpu_per_step(clock: Sequence | None, ended: Sequence[float]) -> float:
    """A task's CPU seconds per step, from its CPU clock (``[(wall time, CPU seconds), ...]``) between
    the first and the last of the steps' end times (the steps that ended in between); 0 without."""
    ended = sorted(ended)
    if not clock or len(ended) < 2:
        return 0.0

    def cpu_at(when: float) -> float:
        for (t0, c0), (t1, c1) in zip(clock, clock[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1
        return clock[0][1] if when < clock[0][0] else clock[-1][1]
    return max(0.0, cpu_at(ended[-1]) - cpu_at(ended[0])) / (len(ended) - 1)


def measure_convergence(settings: ProbeSettings) -> dict:
    """Rows to the target loss (:mod:`stratagem.advise.convergence`), in this process: the model
    trained with 1, 2, 4 and 8 replicas, sync and async, for at most a few seconds."""
    from stratagem.advise import convergence
    from stratagem.bench.models import build_model

    return convergence.measure(build_model(settings.model), settings.seed, budget_s=2.0 if settings.quick else 5.0)


def fit(raw: dict, skipped: dict | None = None, seconds: float = 0.0) -> Measurements:
    """The cost model's figures from the probes' raw output (``Measurements.raw``): refitting a
    saved measurement gives the same figures as when it was measured."""
    host, work = fit_machine(raw["machine"], raw["model"])
    figures = {}
    for name, link in raw["links"].items():
        figures[name] = t = fit_transport(link, one_group=link.get("one_group", False))
        if link.get("steps"):   # the strategies' own work, beyond what these links explain
            figures[name] = dataclasses.replace(t, steps=cm.step_residuals(fit_steps(link["steps"]), work, t))
    return Measurements(host, work, figures, dict(skipped or {}), raw, seconds,
                        convergence_from_dict(raw.get("convergence")))
