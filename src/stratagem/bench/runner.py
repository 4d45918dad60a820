"""Run each combination of a training bench as its own local cluster, one after another.

Each combination is one job of :func:`stratagem.launch.launcher.launch` (or, for the ``mpi`` transport,
:func:`stratagem.launch.mpi.launch_mpi`), every task running :mod:`stratagem.bench.train_task`
with the run's spec. The job's output is captured, not shown: its ``@bench`` lines feed the live
progress display, and the last lines are kept for the report when a job fails. A job that fails or
outlives ``timeout`` is stopped (the launcher reaps every process) and reported; the next one runs.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from stratagem.core.errors import ConfigurationError
from stratagem.bench import measure
from stratagem.bench.plan import Combination

TRAIN_TASK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_task.py")
#: Lines of a failed job's output kept for its report, and exception lines kept for the table.
TAIL_LINES, ERROR_LINES = 40, 5
#: ``[worker:1] stratagem.core.errors.PeerLostError: ...``: the last line of a task's traceback.
_EXCEPTION_LINE = re.compile(r"^\[[\w:]+\] (\w+\.)*\w*(Error|Exception|Exit|Interrupt|Timeout)\b.*:")
#: Math libraries get one thread per task: the tasks share the cores, and oversubscribed BLAS
#: threads would measure contention, not the strategy.
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


@dataclass
class RunSettings:
    model: str
    steps: int
    warmup: int
    seed: int
    timeout: float
    target_loss: float | None
    batch_size: int
    param_bytes: int
    hosts: object = None      # a launch.hosts.HostsSpec: run every combination on emulated hosts


@dataclass
class Outcome:
    """What one combination gave: ``status`` is ok, skipped, failed, timeout or interrupted (``signal``,
    SIGINT or SIGTERM, stopped the job: the bench stops after it)."""

    combination: Combination
    status: str
    reason: str | None = None
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0
    output_tail: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    signal: int | None = None

    def as_dict(self) -> dict:
        c = self.combination
        record = {"label": c.label, "strategy": c.strategy.name, "mode": c.strategy.mode,
                  "transport": c.transport, "compression": c.compression, "status": self.status, "reason": self.reason,
                  "cluster": c.cluster.as_dict() if c.cluster else None, "seconds": round(self.seconds, 3)}
        record.update(self.figures)
        if self.output_tail:
            record["output_tail"] = self.output_tail
            record["errors"] = self.errors
        return record


class _Capture(io.TextIOBase):
    """A text stream for the launcher's output: ``@bench`` progress lines go to ``on_progress``, the
    rest is kept (the last lines only) for a failure's report."""

    def __init__(self, on_progress: Callable[[dict], None]):
        self._on_progress = on_progress
        self._partial = ""
        self._lock = threading.Lock()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.exceptions: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                marker = line.find("@bench ")
                if marker >= 0:
                    try:
                        self._on_progress(json.loads(line[marker + len("@bench "):]))
                        continue
                    except ValueError:
                        pass
                if line.strip():
                    self.tail.append(line)
                    if len(self.exceptions) < ERROR_LINES and _EXCEPTION_LINE.match(line):
                        self.exceptions.append(line)
        return len(text)


def _launch(combination: Combination, spec_path: str, settings: RunSettings, capture: _Capture):
    cluster = combination.cluster
    env = {"STRATAGEM_BENCH_SPEC": spec_path, **ONE_THREAD}
    command = [sys.executable, TRAIN_TASK]
    if combination.mpi_job:
        from stratagem.launch.mpi import launch_mpi

        return launch_mpi(command, workers=cluster.workers, ps=cluster.ps, transport="mpi", env=env,
                          timeout=settings.timeout, output=capture, error_output=capture)
    from stratagem.launch.launcher import launch

    return launch(command, workers=cluster.workers, ps=cluster.ps, chief=cluster.chief,
                  transport=combination.transport, env=env, timeout=settings.timeout, output=capture,
                  error_output=capture, ps_grace=10.0, hosts=settings.hosts)


def run_combination(combination: Combination, settings: RunSettings,
                    on_progress: Callable[[dict], None] = lambda update: None) -> Outcome:
    """Run one combination as a job of its own; its figures, or why there are none."""
    if combination.skipped:
        return Outcome(combination, "skipped", combination.skipped)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as out:
        spec = {"strategy": combination.strategy.name, "mode": combination.strategy.mode,
                "options": combination.strategy.options(), "transport": combination.transport,
                "compression": combination.compression,
                "model": settings.model, "steps": settings.steps, "seed": settings.seed,
                # Blocking calls wait as long as the whole job may: a hang is stopped by --timeout and
                # reported as one (a dead peer is still an error at once, whatever the timeout).
                "timeout": settings.timeout, "out": out}
        spec_path = os.path.join(out, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        capture = _Capture(on_progress)
        try:
            result = _launch(combination, spec_path, settings, capture)
        except ConfigurationError as exc:
            return Outcome(combination, "skipped", str(exc), seconds=time.monotonic() - started)
        seconds = time.monotonic() - started
        if result.interrupted_by:   # Ctrl-C or SIGTERM to the bench: the job was stopped, the bench stops
            return Outcome(combination, "interrupted", result.reason, seconds=seconds,
                           signal=int(result.interrupted_by))
        if result.timed_out:
            return Outcome(combination, "timeout", f"stopped after {settings.timeout:g} s (--timeout)",
                           seconds=seconds, output_tail=list(capture.tail), errors=capture.exceptions)
        if not result.ok:
            return Outcome(combination, "failed", result.reason, seconds=seconds,
                           output_tail=list(capture.tail), errors=capture.exceptions)
        records = [_read(path) for path in sorted(glob.glob(os.path.join(out, "*-*.json")))]
    if not records:
        return Outcome(combination, "failed", "the job succeeded but no task wrote its figures",
                       seconds=seconds, output_tail=list(capture.tail), errors=capture.exceptions)
    try:
        figures = measure.summarize(
            [step for record in records for step in record["steps"]],
            replicas=records[0]["replicas"], batch_size=settings.batch_size, warmup=settings.warmup,
            target_loss=settings.target_loss, extra_bytes=sum(r.get("extra_bytes", 0) for r in records))
    except ValueError as exc:
        return Outcome(combination, "failed", str(exc), seconds=seconds)
    figures["replicas"] = records[0]["replicas"]
    # the model's accuracy on its test set after the last step (mean over the replicas that measured it)
    accuracies = [r["test_accuracy"] for r in records if r.get("test_accuracy") is not None]
    figures["test_accuracy"] = sum(accuracies) / len(accuracies) if accuracies else None
    # where each task that wrote figures ran (its hostname: host0, host1... on emulated hosts)
    figures["task_hosts"] = {r["task"]: r["host"] for r in records if "task" in r and "host" in r}
    return Outcome(combination, "ok", figures=figures, seconds=seconds)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
