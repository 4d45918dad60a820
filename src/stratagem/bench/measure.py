"""From the step records of one bench run to its figures: throughput, step time split, bytes, loss.

**Bytes moved.** Only the tasks that train know when a step starts and ends (ps tasks, and the
workers that serve ``in_graph`` or ``parameter_server`` steps, do not), so each measured section counts
what crossed the network around it, by this rule (:func:`section_bytes`):

- every payload byte the section's task *sent* (to anyone), and
- the bytes it *received* from tasks that do not measure themselves (ps tasks; the replicas an
  ``in_graph`` client drives; the workers, for the ``parameter_server`` coordinator's own traffic).

So each byte is counted once: a ring all-reduce's bytes by their senders, a pull by the worker that
received it. A *step* is one global batch: ``replicas x batch_size`` rows (one synchronous update; for
the asynchronous modes, as many worker steps as there are workers). Payload only: the arrays'
bytes, not headers.

**Time.** Each record carries its wall-clock start and end (``t0``, ``t1``; every task of a local
cluster reads the same clock). The first ``warmup`` steps of each task are left out of the throughput
and step-time figures (first calls pay for imports, connections, page faults), not out of the loss
curve, whose clock starts at the earliest step's start: time to the target loss is what a user waits.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Iterable

#: (strategy, section) -> (jobs whose received bytes count, or "all"; whether sends to them only).
_RECEIVED_FROM = {
    ("mirrored", "step"): (),
    ("between_graph", "step"): ("ps",),
    ("in_graph", "client"): "all",
    ("parameter_server", "step"): ("ps",),
    ("parameter_server", "coordinator"): "all",
}
#: Sections that count only their traffic with these jobs (a parameter_server worker's step: its
#: results go to the coordinator after the step, counted there).
_SENT_TO = {("parameter_server", "step"): ("ps",)}


def section_bytes(strategy: str, section: str, traffic) -> int:
    """Bytes a measured section moved under the rule in the module doc (``traffic``: a
    :class:`~stratagem.core.traffic.TrafficSnapshot` delta). Strategies the table does not know
    (third-party ones) count what their tasks sent plus everything they received."""
    received_from = _RECEIVED_FROM.get((strategy, section), "all")
    sent_to = _SENT_TO.get((strategy, section))
    sent = traffic.sent_bytes() if sent_to is None else traffic.sent_bytes(jobs=sent_to, native=False)
    if received_from == "all":
        received = traffic.received_bytes()
    elif received_from:
        received = traffic.received_bytes(jobs=received_from, native=False)
    else:
        received = 0
    return int(sent + received)


def _busiest_task_cores(by_task: dict, warmup: int) -> float | None:
    """The most CPU any replica used over its timed steps, in cores (process CPU time, every thread,
    over its wall time from the end of its last warm-up step to the end of its last step), from the
    rows' cumulative ``cpu``; None where the rows have none (in_graph, parameter_server)."""
    cores = []
    for steps in by_task.values():
        marks = [r for r in steps[max(0, warmup - 1):] if "cpu" in r]
        if len(marks) > 1 and marks[-1]["t1"] > marks[0]["t1"]:
            cores.append((marks[-1]["cpu"] - marks[0]["cpu"]) / (marks[-1]["t1"] - marks[0]["t1"]))
    return max(cores) if cores else None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _throughput(by_task: dict, warmup: int) -> float:
    """Rows per second while every measuring task was in its timed steps.

    Tasks do not start together (a worker waits for the chief's variables; an asynchronous worker
    never waits for the others), so the clock runs over the window they all share: each step counts
    with the part of it inside that window. When the tasks never overlapped (a run too short for
    them to meet), over the whole span instead."""
    # (A parameter_server worker may have run no more than its warm-up: it has no timed window.)
    spans = [(steps[warmup]["t0"], steps[-1]["t1"]) for steps in by_task.values() if len(steps) > warmup]
    lo, hi = max(s[0] for s in spans), min(s[1] for s in spans)
    timed = [r for steps in by_task.values() for r in steps[warmup:]]
    if hi <= lo:
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    counted = 0.0
    for r in timed:
        length = r["t1"] - r["t0"]
        inside = max(0.0, min(r["t1"], hi) - max(r["t0"], lo))
        counted += r["rows"] * (inside / length if length > 0 else float(lo <= r["t0"] <= hi))
    return counted / (hi - lo) if hi > lo else 0.0


def summarize(records: Iterable[dict], *, replicas: int, batch_size: int, warmup: int,
              target_loss: float | None, extra_bytes: int = 0, smooth: int | None = None) -> dict:
    """The figures of one run from every measured step record (see the module doc).

    Returns samples/s, step time (median, and its compute and other parts), bytes per step, the loss
    curve (``[[seconds since start, smoothed loss], ...]``), the final loss, and the seconds to reach
    ``target_loss`` (None when never reached; the target defaults to half the first losses' mean).
    """
    records = sorted(records, key=lambda r: r["t0"])
    if not records:
        raise ValueError("no step records: the run measured nothing")
    by_task = defaultdict(list)
    for record in records:
        by_task[record["task"]].append(record)
    timed = [r for steps in by_task.values() for r in steps[warmup:]]
    if not timed:
        raise ValueError(f"every step is a warm-up step (warmup={warmup}): run more steps")
    rows = sum(r["rows"] for r in timed)
    global_batch = replicas * batch_size
    global_steps = rows / global_batch
    moved = sum(r["bytes"] for r in timed) + extra_bytes

    # The loss curve: the mean of the last ``smooth`` losses reported (default: one per replica, so a
    # synchronous step's replicas are averaged), stamped with the end of the latest one.
    smooth = smooth or max(1, replicas)
    t_zero = records[0]["t0"]
    by_end = sorted(records, key=lambda r: r["t1"])
    curve = []
    for i in range(len(by_end)):
        window = by_end[max(0, i + 1 - smooth): i + 1]
        curve.append([by_end[i]["t1"] - t_zero, statistics.fmean(r["loss"] for r in window)])
    first = statistics.fmean(r["loss"] for r in records[:smooth])
    if target_loss is None:
        target_loss = first / 2
    reached = next((t for t, loss in curve if loss <= target_loss), None)

    step_s = [r["step_s"] for r in timed]
    compute_s = [r["compute_s"] for r in timed]
    return {
        "samples_per_s": _throughput(by_task, warmup),
        "step_ms": statistics.median(step_s) * 1e3,
        "step_ms_p90": _percentile(step_s, 0.9) * 1e3,
        "compute_ms": statistics.median(compute_s) * 1e3,
        "other_ms": statistics.median(s - c for s, c in zip(step_s, compute_s)) * 1e3,
        "bytes_per_step": moved / global_steps if global_steps else 0.0,
        "global_steps_timed": global_steps,
        "first_loss": first,
        "final_loss": curve[-1][1],
        "target_loss": target_loss,
        "time_to_target_s": reached,
        "loss_curve": curve,
        "train_seconds": by_end[-1]["t1"] - t_zero,
        "task_cores_max": _busiest_task_cores(by_task, warmup),
    }
