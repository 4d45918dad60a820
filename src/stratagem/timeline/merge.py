"""Merging the tasks' timeline files into one Chrome-trace / Perfetto JSON on one time axis.

Each task's file (:mod:`stratagem.core.timeline`) stamps its events in microseconds since its
own anchor, and records the anchor's wall-clock time and the offset to the reference task's clock
that it measured (:mod:`stratagem.core.timeline_clock`). Merging puts every event on the reference's
clock (``anchor wall time + stamp + offset``), gives each task a process track named after it
(``/job:worker/task:1``, chief first, then workers, then ps tasks) with its threads as sub-tracks,
and lists in ``otherData`` each task's file, offset and its precision. A task whose offset could not
be measured keeps its wall clock (exact on one host; as good as NTP across hosts) and is flagged.

    stratagem timeline merge trace.json worker-0.json worker-1.json ps-0.json

From Python, :func:`merge_files` does the same, and :func:`load` reads and checks one file::

    >>> import json, os, tempfile
    >>> from stratagem.core.cluster import TaskId
    >>> from stratagem.core.timeline import Recorder, now
    >>> folder = tempfile.mkdtemp()
    >>> for index in range(2):
    ...     rec = Recorder(os.path.join(folder, "{task}.json"))
    ...     rec.task = TaskId("worker", index)
    ...     start = now()
    ...     rec.add("step", "step", start, start + 1_000_000)
    ...     _ = rec.flush()
    >>> inputs = [os.path.join(folder, f"worker-{i}.json") for i in range(2)]
    >>> merged = merge_files(os.path.join(folder, "trace.json"), inputs)
    >>> [t["task"] for t in merged["otherData"]["stratagem_timeline"]["tasks"]]
    ['/job:worker/task:0', '/job:worker/task:1']
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from stratagem.core.cluster import REPLICA_JOBS, TaskId
from stratagem.core.errors import ConfigurationError, TimelineError
from stratagem.core.timeline import FORMAT, VERSION

_HINT = "timeline files are written by tasks run with STRATAGEM_TIMELINE=PATH (or stratagem launch --timeline)"


def read_json(path: str) -> dict:
    """The JSON object in ``path``, or a ``TimelineError`` naming the file and the problem."""
    try:
        with open(path, encoding="utf-8") as stream:
            doc = json.load(stream)
    except FileNotFoundError:
        raise TimelineError(f"timeline file {path} does not exist") from None
    except IsADirectoryError:
        raise TimelineError(f"{path} is a directory, not a timeline file") from None
    except OSError as exc:
        raise TimelineError(f"cannot read timeline file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TimelineError(f"{path} is not a text file, so not a timeline ({_HINT})") from None
    except json.JSONDecodeError as exc:
        raise TimelineError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
                            f"a task killed while writing leaves no file rather than half of one, so this is "
                            f"not a timeline ({_HINT})") from None
    if not isinstance(doc, dict):
        raise TimelineError(f"{path} holds a JSON {type(doc).__name__}, not a timeline ({_HINT})")
    return doc


def load(path: str, kind: str | None = None) -> dict:
    """Read and check one timeline file: a task's (``kind="task"``), a merged one (``"merged"``) or
    either (``None``). Returns the document; its ``otherData["stratagem_timeline"]`` says which."""
    doc = read_json(path)
    meta = doc.get("otherData", {}).get(FORMAT) if isinstance(doc.get("otherData"), dict) else None
    if not isinstance(meta, dict):
        raise TimelineError(f"{path} is not a Stratagem timeline (no otherData.{FORMAT}); {_HINT}")
    if meta.get("version") != VERSION:
        raise TimelineError(f"{path} is a Stratagem timeline of version {meta.get('version')!r}; this "
                            f"stratagem reads version {VERSION}")
    if kind is not None and meta.get("kind") != kind:
        if kind == "task" and meta.get("kind") == "merged":
            raise TimelineError(f"{path} is already a merged timeline; give the tasks' own files to merge")
        raise TimelineError(f"{path} is a {meta.get('kind')!r} timeline where a {kind!r} one was expected")
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise TimelineError(f"{path} has no traceEvents list")
    for number, event in enumerate(events):
        if not isinstance(event, dict) or not isinstance(event.get("ph"), str):
            raise TimelineError(f"{path}: traceEvents[{number}] is not a trace event (an object with 'ph')")
        if event["ph"] == "X" and not all(isinstance(event.get(k), (int, float)) for k in ("ts", "dur", "pid", "tid")):
            raise TimelineError(f"{path}: traceEvents[{number}] lacks a numeric ts, dur, pid or tid")
    if meta.get("kind") == "task":
        clock = meta.get("clock")
        if not isinstance(meta.get("task"), str) or not isinstance(clock, dict) \
                or not isinstance(clock.get("wall_ns"), int):
            raise TimelineError(f"{path}: the task or its clock anchor is missing from otherData.{FORMAT}")
    elif meta.get("kind") == "merged":
        if not isinstance(meta.get("tasks"), list):
            raise TimelineError(f"{path}: the merged timeline lists no tasks in otherData.{FORMAT}")
    else:
        raise TimelineError(f"{path}: unknown timeline kind {meta.get('kind')!r}")
    return doc


def _order(task: str) -> tuple:
    try:
        parsed = TaskId.parse(task)
    except ConfigurationError:
        return (3, task, 0)
    rank = REPLICA_JOBS.index(parsed.job) if parsed.job in REPLICA_JOBS else 2
    return (rank, parsed.job, parsed.index)


def merge(documents: Iterable[tuple[str, dict]]) -> dict:
    """One trace from ``(file name, task document)`` pairs (checked by :func:`load`)."""
    tasks: dict[str, tuple[str, dict]] = {}
    for path, doc in documents:
        meta = doc["otherData"][FORMAT]
        if meta["task"] in tasks:
            raise TimelineError(f"two timeline files for {meta['task']}: {tasks[meta['task']][0]} and {path}; "
                                f"give each task's file once")
        tasks[meta["task"]] = (path, doc)
    if not tasks:
        raise TimelineError("no timeline files to merge")
    placed = []
    for task in sorted(tasks, key=_order):
        path, doc = tasks[task]
        meta = doc["otherData"][FORMAT]
        clock = meta["clock"]
        status = clock.get("status")
        offset = int(clock.get("offset_ns", 0)) if status in ("measured", "reference") else 0
        placed.append((task, path, doc, meta, clock, clock["wall_ns"] + offset))
    origin = min(start for *_, start in placed)
    events, listed = [], []
    references = {clock.get("reference") for *_, clock, _ in placed if clock.get("reference")}
    for pid, (task, path, doc, meta, clock, start) in enumerate(placed, start=1):
        shift = (start - origin) / 1000
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for event in doc["traceEvents"]:
            event = dict(event, pid=pid)
            if event["ph"] == "M":
                if event.get("name") == "process_name":
                    event["args"] = {"name": task}
            elif "ts" in event:
                event["ts"] = round(event["ts"] + shift, 3)
            events.append(event)
        status = clock.get("status")
        listed.append({
            "task": task, "pid": pid, "file": os.path.basename(path), "host": meta.get("host"),
            "clock": status if status in ("measured", "reference") else f"wall clock only ({status}"
                     + (f": {clock['error']}" if clock.get("error") else "") + ")",
            "offset_ns": int(clock.get("offset_ns", 0)) if status in ("measured", "reference") else None,
            "uncertainty_ns": clock.get("uncertainty_ns"),
            "ended": meta.get("ended"), "dropped_events": meta.get("dropped_events", 0),
            "strategy": meta.get("strategy"), "transport": meta.get("transport"),
        })
    meta = {"version": VERSION, "kind": "merged", "origin_wall_ns": origin,
            "reference": sorted(references)[0] if len(references) == 1 else sorted(references),
            "tasks": listed}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {FORMAT: meta}}


def write(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically, or raise ``TimelineError`` naming the path."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            json.dump(doc, stream, separators=(",", ":"))
        os.replace(temporary, path)
    except OSError as exc:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise TimelineError(f"cannot write the merged timeline to {path}: {exc.strerror or exc}; "
                            f"name a file in a writable directory") from None


def merge_files(out: str, inputs: Iterable[str]) -> dict:
    """Merge the task files ``inputs`` into ``out``; return the merged document."""
    merged = merge((path, load(path, "task")) for path in inputs)
    write(out, merged)
    return merged


def load_any(paths: list[str]) -> dict:
    """A merged document from one merged file, or from one or more task files (merged in memory)."""
    if len(paths) == 1:
        doc = load(paths[0])
        if doc["otherData"][FORMAT]["kind"] == "merged":
            return doc
        return merge([(paths[0], doc)])
    return merge((path, load(path, "task")) for path in paths)
