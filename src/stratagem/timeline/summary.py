"""Reading a merged timeline: where each task's steps go, whom it waits on, and who the straggler is.

``stratagem timeline summary trace.json`` prints, per task:

- the **step time breakdown**: a step is one ``strategy.run`` call (or, in a loop that calls
  ``apply_gradients`` itself, the time from one ``apply_gradients`` to the next); its time is split by
  what the task was doing, each event counted without the events nested in it: ``wait`` (blocked in
  a receive from a peer), ``collective`` and ``ps`` (the rest of the communication: sending,
  reducing, protocol), ``pack``, ``optimizer``, ``other`` (the library's own work around them) and
  ``compute`` (the rest: the user's step function);
- the time it spent **waiting on each peer**, as recorded;
- the same waits **traced to their cause**: a task waiting on a peer that was itself waiting on a
  third task during that time was really waiting on the third one (in a ring all-reduce everyone
  waits on its left neighbour, and only the one that started late is the cause; a worker waiting on
  a ps task in ``sync`` mode waits on the workers the ps task is still waiting for);

and names the **straggler**: the task the others' waits are charged to most, with the share of
their step time it cost them. Waits of a task that only serves (a ps task idle until the next
request) are followed in those chains, but are not counted as anyone being slowed down.

From Python::

    >>> import os, tempfile
    >>> from stratagem.core.cluster import TaskId
    >>> from stratagem.core.timeline import Recorder
    >>> from stratagem.timeline.merge import merge_files
    >>> folder = tempfile.mkdtemp()
    >>> def task_file(index, events):
    ...     rec = Recorder(os.path.join(folder, "{task}.json"))
    ...     rec.task, rec.clock = TaskId("worker", index), {"status": "reference", "offset_ns": 0}
    ...     rec.wall_ns = rec.perf_ns = 0                      # one clock for the example
    ...     for args in events:
    ...         rec.add(*args)
    ...     return rec.flush()
    >>> ms = 1_000_000
    >>> a = task_file(0, [("step", "step", 0, 100 * ms), ("collective", "allreduce", 10 * ms, 100 * ms),
    ...                   ("wait", "wait worker:1", 11 * ms, 99 * ms, {"peer": "/job:worker/task:1"})])
    >>> b = task_file(1, [("step", "step", 0, 100 * ms), ("collective", "allreduce", 98 * ms, 100 * ms)])
    >>> report = summarize(merge_files(os.path.join(folder, "trace.json"), [a, b]))
    >>> report["straggler"]["task"], round(report["straggler"]["share"], 2)
    ('/job:worker/task:1', 0.88)
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from stratagem.core.cluster import REPLICA_JOBS, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.core.timeline import FORMAT

#: Categories of the breakdown, in the order printed; ``compute`` is the time no event covers.
PARTS = ("compute", "pack", "collective", "ps", "wait", "optimizer", "other")
#: A task that makes the others wait less than this share of their step time is no straggler.
STRAGGLER_SHARE = 0.02


def _short(task: str) -> str:
    try:
        return TaskId.parse(task).short
    except ConfigurationError:
        return task


def _serves(task: str) -> bool:
    try:
        return TaskId.parse(task).job not in REPLICA_JOBS
    except ConfigurationError:
        return False


class _Task:
    """One task's events (microseconds on the merged axis), indexed for the analysis."""

    def __init__(self, name: str):
        self.name = name
        self.events: list[dict] = []
        self.waits: list[tuple[float, float, str, bool]] = []   # start, end, peer, idle

    def exclusive(self, events: list[dict]) -> list[tuple[dict, float]]:
        """Each event with its own time: its duration less that of the events nested in it (same thread)."""
        result = []
        stack: list[list] = []     # [event, end, children's time]
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            end = event["ts"] + event["dur"]
            while stack and event["ts"] >= stack[-1][1] - 1e-6:
                done = stack.pop()
                result.append((done[0], max(0.0, done[0]["dur"] - done[2])))
            if stack:
                stack[-1][2] += event["dur"]
            stack.append([event, end, 0.0])
        result += [(done[0], max(0.0, done[0]["dur"] - done[2])) for done in reversed(stack)]
        return result


def _tasks(doc: dict) -> dict[str, _Task]:
    names = {entry["pid"]: entry["task"] for entry in doc["otherData"][FORMAT]["tasks"]}
    tasks = {name: _Task(name) for name in names.values()}
    for event in doc["traceEvents"]:
        if event.get("ph") != "X" or event.get("pid") not in names:
            continue
        task = tasks[names[event["pid"]]]
        task.events.append(event)
        if event.get("cat") == "wait":
            args = event.get("args") or {}
            task.waits.append((event["ts"], event["ts"] + event["dur"], str(args.get("peer")), bool(args.get("idle"))))
    for task in tasks.values():
        task.waits.sort()
    return tasks


def _windows(task: _Task) -> tuple[list[tuple[float, float]], int | None, str]:
    """The task's steps as ``(start, end)`` on its training thread, that thread, and how they were found."""
    by_thread: dict[int, list[dict]] = defaultdict(list)
    for event in task.events:
        if event.get("cat") in ("step", "sync"):
            by_thread[event["tid"]].append(event)
    if not by_thread:
        return [], None, "none"
    tid = max(by_thread, key=lambda t: len(by_thread[t]))
    marks = sorted(by_thread[tid], key=lambda e: e["ts"])
    steps = [e for e in marks if e["cat"] == "step"]
    if steps:
        windows, last_end = [], float("-inf")
        for event in steps:               # outermost steps only (a step inside a step is one step)
            if event["ts"] >= last_end:
                windows.append((event["ts"], event["ts"] + event["dur"]))
                last_end = event["ts"] + event["dur"]
        return windows, tid, "strategy.run"
    syncs = [(e["ts"], e["ts"] + e["dur"]) for e in marks]
    return [(syncs[i - 1][1], syncs[i][1]) for i in range(1, len(syncs))], tid, "apply_gradients to apply_gradients"


def _breakdown(task: _Task, windows, tid) -> dict[str, float]:
    parts = dict.fromkeys(PARTS, 0.0)
    if not windows:
        return parts
    starts = [w[0] for w in windows]
    events = [e for e in task.events if e["tid"] == tid]
    for event, own in task.exclusive(events):
        middle = event["ts"] + event["dur"] / 2
        index = bisect.bisect_right(starts, middle) - 1
        if index < 0 or middle > windows[index][1]:
            continue
        category = event.get("cat")
        if category == "step":
            parts["compute"] += own
        else:
            parts[category if category in PARTS else "other"] += own
    covered = sum(parts.values())
    total = sum(end - start for start, end in windows)
    parts["compute"] += max(0.0, total - covered)   # steps found between apply_gradients calls
    return parts


def _segments(waits) -> tuple[list[float], list[tuple[float, float, str]]]:
    """A task's waits as non-overlapping segments sorted by time (threads may overlap: the earlier wins)."""
    segments, cursor = [], float("-inf")
    for start, end, peer, _ in waits:
        start = max(start, cursor)
        if end > start:
            segments.append((start, end, peer))
            cursor = end
    return [s[1] for s in segments], segments


def _charge(peer: str, start: float, end: float, chain: frozenset, timelines: dict, out: dict) -> None:
    """Charge the wait ``[start, end]`` on ``peer``: to whomever ``peer`` was waiting on meanwhile
    (recursively, never back into ``chain``), the rest to ``peer`` itself."""
    timeline = timelines.get(peer)
    cursor = start
    if timeline is not None:
        ends, segments = timeline
        index = bisect.bisect_right(ends, start)
        while index < len(segments) and segments[index][0] < end:
            seg_start, seg_end, next_peer = segments[index]
            a, b = max(seg_start, cursor), min(seg_end, end)
            index += 1
            if b <= a:
                continue
            out[peer] += a - cursor
            if next_peer in chain or next_peer == peer:
                out[peer] += b - a
            else:
                _charge(next_peer, a, b, chain | {peer}, timelines, out)
            cursor = b
    if end > cursor:
        out[peer] += end - cursor


def summarize(doc: dict) -> dict:
    """The analysis of a merged timeline (see the module doc) as plain data; times in seconds."""
    meta = doc["otherData"][FORMAT]
    tasks = _tasks(doc)
    timelines = {name: _segments(task.waits) for name, task in tasks.items()}
    report: dict = {"tasks": {}, "clock": meta["tasks"], "reference": meta.get("reference")}
    charged_to: dict[str, float] = defaultdict(float)
    charged_by: dict[str, dict[str, float]] = defaultdict(dict)
    step_time: dict[str, float] = {}
    for name, task in tasks.items():
        windows, tid, how = _windows(task)
        parts = _breakdown(task, windows, tid)
        durations = sorted(end - start for start, end in windows)
        step_time[name] = sum(durations)
        direct: dict[str, list] = defaultdict(lambda: [0.0, 0])
        idle: dict[str, float] = defaultdict(float)
        causes: dict[str, float] = defaultdict(float)
        starts = [w[0] for w in windows]
        outside = 0.0
        for start, end, peer, is_idle in task.waits:
            if is_idle:
                idle[peer] += end - start
                continue
            if windows:   # the waits of the steps: not those of the start (a peer still starting up)
                index = bisect.bisect_right(starts, (start + end) / 2) - 1
                if index < 0 or (start + end) / 2 > windows[index][1]:
                    outside += end - start
                    continue
            direct[peer][0] += end - start
            direct[peer][1] += 1
            _charge(peer, start, end, frozenset({name}), timelines, causes)
        served = [e for e in task.events if e.get("cat") == "serve"]
        report["tasks"][name] = {
            "steps": len(windows), "steps_from": how,
            "step_median_s": durations[len(durations) // 2] / 1e6 if durations else None,
            "step_total_s": step_time[name] / 1e6,
            "breakdown_s": {part: value / 1e6 for part, value in parts.items()},
            "waits_s": {peer: {"seconds": s / 1e6, "count": n} for peer, (s, n) in
                        sorted(direct.items(), key=lambda kv: -kv[1][0])},
            "idle_s": {peer: s / 1e6 for peer, s in sorted(idle.items(), key=lambda kv: -kv[1])},
            "waits_by_cause_s": {peer: s / 1e6 for peer, s in sorted(causes.items(), key=lambda kv: -kv[1])},
            "waits_outside_steps_s": outside / 1e6,
            "served": {"requests": len(served), "seconds": sum(e["dur"] for e in served) / 1e6} if served else None,
        }
        if not _serves(name):
            for peer, seconds in causes.items():
                if peer != name:
                    charged_to[peer] += seconds
                    charged_by[peer][name] = seconds / 1e6
    report["straggler"] = _straggler(report, charged_to, charged_by, step_time)
    return report


def _straggler(report: dict, charged_to: dict, charged_by: dict, step_time: dict) -> dict:
    replicas = [name for name in report["tasks"] if not _serves(name)]
    if not charged_to:
        return {"task": None, "share": 0.0, "explanation": "no wait on a peer was recorded during the steps (a "
                "native collective, under mpi or nccl, waits inside its library, out of sight)"
                + _slowest(report, replicas)}
    task = max(charged_to, key=charged_to.get)
    others = sum(step_time[name] for name in charged_by[task] if name in step_time)
    share = charged_to[task] / others if others else 0.0
    detail = ", ".join(f"{_short(name)} {seconds:.3f} s" for name, seconds in
                       sorted(charged_by[task].items(), key=lambda kv: -kv[1]))
    if share < STRAGGLER_SHARE:
        return {"task": None, "share": share, "most_waited_on": task,
                "explanation": f"no straggler: the task waited on most, {task}, cost the others "
                               f"{100 * share:.1f}% of their step time (under {100 * STRAGGLER_SHARE:.0f}%)"
                               + _slowest(report, replicas)}
    mine = report["tasks"].get(task)
    own = ""
    if mine and mine["step_total_s"]:
        parts = mine["breakdown_s"]
        biggest = max(parts, key=parts.get)
        own = (f"; its own steps went {100 * parts[biggest] / mine['step_total_s']:.0f}% to {biggest}"
               f" (median step {1000 * mine['step_median_s']:.1f} ms)")
    elif _serves(task):
        own = "; it is a serving task: it was busy answering (or held the answers for other tasks)"
    return {"task": task, "share": share, "waited_s": charged_to[task] / 1e6, "by": charged_by[task],
            "explanation": f"straggler: {task}: the other tasks spent {charged_to[task] / 1e6:.3f} s "
                           f"({100 * share:.0f}% of their step time) waiting on it, directly or through "
                           f"tasks that were waiting on it ({detail}){own}"}


def _slowest(report: dict, replicas: list[str]) -> str:
    """The replica that computes longest per step: the likely straggler when the waits do not tell."""
    per_step = sorted((report["tasks"][name]["breakdown_s"]["compute"] / report["tasks"][name]["steps"], name)
                      for name in replicas if report["tasks"][name]["steps"])
    if not per_step:
        return ""
    seconds, name = per_step[-1]
    others = [value for value, other in per_step if other != name]
    typical = f" against {1000 * others[len(others) // 2]:.1f} ms on the others" if others else ""
    return f"; the longest compute per step is {name}'s ({1000 * seconds:.1f} ms{typical})"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def format_summary(report: dict, source: str = "") -> str:
    """The report of :func:`summarize` as the text ``stratagem timeline summary`` prints."""
    lines = []
    clocks = report["clock"]
    measured = [c["uncertainty_ns"] for c in clocks if c.get("clock") == "measured" and c.get("uncertainty_ns") is not None]
    unmeasured = [c["task"] for c in clocks if c.get("clock") not in ("measured", "reference")]
    clock_line = f"clocks aligned to {report['reference']}"
    if measured:
        clock_line += f", each within +/-{max(measured) / 1e6:.3f} ms"
    if unmeasured:
        clock_line += f"; on wall clocks only: {', '.join(_short(t) for t in unmeasured)}"
    lines.append(f"Timeline{' ' + source if source else ''}: {len(report['tasks'])} task(s); {clock_line}.")
    for entry in clocks:
        if entry.get("ended"):
            lines.append(f"  note: {entry['task']} ended by {entry['ended']}")
        if entry.get("dropped_events"):
            lines.append(f"  note: {entry['task']} dropped {entry['dropped_events']} events (raise "
                         f"STRATAGEM_TIMELINE_MAX_EVENTS)")
    width = max([len(name) for name in report["tasks"]] + [4])
    lines += ["", "Step time: median step, and the share of all step time spent in each part:",
              f"{'task':<{width}}  {'steps':>5}  {'median':>10}  " + "  ".join(f"{p:>10}" for p in PARTS)]
    for name, task in report["tasks"].items():
        if task["steps"] == 0:
            if task["served"] or task["idle_s"]:
                served = task["served"] or {"requests": 0, "seconds": 0.0}
                lines.append(f"{name:<{width}}  serving: {served['requests']} requests in {served['seconds']:.3f} s, "
                             f"{sum(task['idle_s'].values()):.3f} s idle between them")
            else:
                lines.append(f"{name:<{width}}  no steps recorded")
            continue
        total = task["step_total_s"] or 1.0
        shares = "  ".join(f"{100 * task['breakdown_s'][p] / total:>9.1f}%" for p in PARTS)
        lines.append(f"{name:<{width}}  {task['steps']:>5}  {_ms(task['step_median_s']):>10}  {shares}")
    lines += ["", "Waiting on peers during the steps (blocked in a receive from that task), and the same waits "
                  "traced to their cause:"]
    for name, task in report["tasks"].items():
        if not task["waits_s"]:
            continue
        direct = ", ".join(f"{_short(p)} {w['seconds']:.3f} s ({w['count']} waits)" for p, w in task["waits_s"].items())
        cause = ", ".join(f"{_short(p)} {s:.3f} s" for p, s in task["waits_by_cause_s"].items())
        lines.append(f"{name:<{width}}  waited on: {direct}")
        lines.append(f"{'':<{width}}  by cause:  {cause}")
        if task["waits_outside_steps_s"] >= 0.0005:
            lines.append(f"{'':<{width}}  (and {task['waits_outside_steps_s']:.3f} s outside the steps: start-up, "
                         f"checkpoints...)")
    lines += ["", report["straggler"]["explanation"] + "."]
    return "\n".join(lines)
