"""The per-task recorder of a timeline: events buffered in memory, written once when the process ends.

``STRATAGEM_TIMELINE=PATH`` in a task's environment turns it on (``stratagem launch --timeline``
sets it for every task). The library's hook points then record, on the thread that runs them:

========== ================================================= ========================================
category   what                                              recorded by
========== ================================================= ========================================
step       one ``strategy.run(fn)`` call: the user's step    ``Strategy.run``
sync       ``optimizer.apply_gradients`` / ``reduce_...``    the optimizer's call into the strategy
pack       gradients scaled and flattened into buckets,      ``mirrored``, the parameter-server
           or split into per-shard requests                  strategies
collective one all-reduce, broadcast, ... (bytes, peers)     ``Communicator``
ps         one request round to the ps tasks: push, pull     ``PSClient`` (bytes out and in, shards)
           ...; on a ps task, each request it serves
wait       blocked in a receive from a named task            the transports' mailbox, ``PSClient``,
                                                             the ps task's loop (idle until a request)
optimizer  the update rule                                   the strategies, the ps tasks
========== ================================================= ========================================

Compute is what a step spends outside all of these. Events are kept in a list in memory (at most
``STRATAGEM_TIMELINE_MAX_EVENTS``, default 1,000,000, about 150 MB; later ones are counted as dropped)
and written when the interpreter ends, through :mod:`stratagem.core.lifecycle` (normally, by
``sys.exit`` or by an uncaught exception; on SIGTERM too, e.g. when ``stratagem launch`` stops the
job), so the plain script needs no ``close()``. The file is a Chrome-trace JSON of this one task
(open it in https://ui.perfetto.dev), whose ``otherData`` carries the clock information that
:mod:`stratagem.timeline.merge` uses to put several tasks on one time axis.

``PATH`` may contain ``{task}`` (replaced by ``worker-1``) or name a directory (the file is then
``DIR/worker-1.json``): one setting serves every task of a job started by other means (``mpiexec``,
Kubernetes). Without either, every task writes ``PATH``: give each its own.

How it flows: a transport is made with a recorder (the ``recorder=`` option of every transport,
e.g. ``transport_options={"recorder": rec}`` of a strategy); the transport factory hands it this
process's, :func:`stratagem.core.timeline_process.process_recorder` (the one place that reads
``STRATAGEM_TIMELINE``). Everything that records reaches it through the transport it runs on
(``transport.recorder``): the mailbox, the communicator, the strategy (``strategy.recorder``), the
optimizer, the parameter-server client and server. With the timeline off that is :data:`OFF`, a
:class:`NullRecorder` whose methods do nothing, so the hot paths call the recorder unconditionally,
without a branch; the one idiom::

    started = recorder.now()
    ...                                                  # the work
    recorder.record("pack", "pack", started, describe, bucket)   # describe(bucket): the args, only if on

or ``with recorder.span(category, name, args):`` around a call. Off, an event costs two calls that
do nothing, no allocation (``describe`` is not called), about 0.1 us (``benchmarks/timeline_off.py``);
on, two clock reads and a list append, about a microsecond (``benchmarks/timeline_overhead.py``). The
process's recorder is made once (a process writes one timeline), when the factory makes its first
transport.

A recorder can also be used on its own::

    >>> import tempfile, os, json
    >>> path = os.path.join(tempfile.mkdtemp(), "{task}.json")
    >>> rec = Recorder(path)
    >>> with rec.span("step", "step"):
    ...     start = now()
    ...     rec.wait("/job:worker/task:1", "coll/world", start, now())
    >>> written = rec.flush()
    >>> os.path.basename(written) == f"process-{os.getpid()}.json"    # no task: no transport attached
    True
    >>> doc = json.load(open(written))
    >>> sorted(e["cat"] for e in doc["traceEvents"] if e["ph"] == "X")
    ['step', 'wait']
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time

from stratagem.core.errors import TimelineError

#: Tags of the clock exchange (:mod:`stratagem.core.timeline_clock`): a wait for its reply is recorded
#: as the exchange's, not as a wait on a peer.
CLOCK_TAG_PREFIX = "stratagem.timeline.clock"
#: The environment variable that turns the timeline on: the path of this task's file.
ENV = "STRATAGEM_TIMELINE"
#: The environment variable that caps the events kept in memory.
MAX_EVENTS_ENV = "STRATAGEM_TIMELINE_MAX_EVENTS"
DEFAULT_MAX_EVENTS = 1_000_000
#: ``otherData`` key and version of the files written here.
FORMAT = "stratagem_timeline"
VERSION = 1

#: The clock of every event: CLOCK_MONOTONIC on Linux, shared by the processes of one host and never
#: stepped. Each task ties it to its wall clock once (``anchor``), which is what puts hosts together.
now = time.perf_counter_ns


def anchor(samples: int = 7) -> tuple[int, int, int]:
    """``(wall ns, perf ns, uncertainty ns)``: a wall-clock reading and the performance-counter
    reading taken at the same moment, within the uncertainty (the narrowest of ``samples`` brackets
    ``perf, wall, perf``, so a preemption between the two reads does not skew it)."""
    best = None
    for _ in range(samples):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[2]:
            best = (wall, (before + after) // 2, after - before)
    return best


def task_slug(task) -> str:
    """``worker-1`` for ``/job:worker/task:1``: the task in a file name (no ``/`` or ``:``)."""
    return f"{task.job}-{task.index}" if task is not None else f"process-{os.getpid()}"


def resolve_path(path: str, task) -> str:
    """Where the task writes: ``{task}`` replaced, a directory completed with ``worker-1.json``."""
    slug = task_slug(task)
    if "{task}" in path:
        return path.replace("{task}", slug)
    if path.endswith(os.sep) or os.path.isdir(path):
        return os.path.join(path, slug + ".json")
    return path


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot take a timeline (a missing or read-only directory...), or ``None``."""
    target = path.replace("{task}", "x")
    directory = target if (path.endswith(os.sep) or os.path.isdir(target)) else (os.path.dirname(target) or ".")
    if not os.path.isdir(directory):
        return f"{ENV}={path}: the directory {directory!r} does not exist; create it or name another file"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{ENV}={path}: the directory {directory!r} is not writable; name a file in a writable directory"
    if os.path.isfile(target) and not os.access(target, os.W_OK):
        return f"{ENV}={path}: the file {target!r} exists and is read-only; remove it or name another file"
    return None


#: Seconds a normal shutdown waits for the clock exchange to finish (``Recorder.settle``).
SETTLE_SECONDS = 10.0


class Recorder:
    """One task's events, kept in memory until :meth:`flush` writes them (see the module doc).

    Args:
        path: the file to write (``{task}`` and directories as in the module doc).
        max_events: events kept; later ones are counted in ``dropped``.
        clock_exchange: ``f(recorder, transport)`` that starts measuring this task's clock offset
            to the reference over the transport first attached, returning its thread
            (:func:`stratagem.core.timeline_clock.synchronise`, which the process's recorder uses);
            ``None``: no exchange, the files are put together by the wall clocks alone.
    """

    def __init__(self, path: str, *, max_events: int = DEFAULT_MAX_EVENTS, clock_exchange=None):
        self.path = path
        self.clock_exchange = clock_exchange
        self.max_events = int(max_events)
        self.events: list[tuple] = []     # (category, name, start ns, end ns, thread ident, args)
        self.dropped = 0
        self.task = None                  # the TaskId, from the first transport attached
        self.info: dict = {"host": socket.gethostname(), "pid": os.getpid(), "argv": list(sys.argv[:1])}
        self.wall_ns, self.perf_ns, self.anchor_ns = anchor()
        #: The offset to the reference task's clock, once measured (:mod:`stratagem.core.timeline_clock`).
        self.clock: dict = {"status": "not measured"}
        self.problem = path_problem(path)
        self.written: str | None = None
        self._threads: dict[int, str] = {}
        self._peer_names: dict = {}       # peer -> (its name, the name of a wait on it)
        self._lock = threading.RLock()
        self._synced = False
        self._sync_thread: threading.Thread | None = None

    #: The events' clock (``now()``), at hand where a hot path holds the recorder.
    now = staticmethod(now)

    #: True: events are kept (:class:`NullRecorder`: False).
    enabled = True

    # -- recording (the hot paths call these unconditionally: off, they are NullRecorder's no-ops) ----
    def add(self, category: str, name: str, start: int, end: int, args: dict | None = None) -> None:
        """Record one event from ``start`` to ``end`` (``now()`` readings) on the calling thread."""
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        ident = threading.get_ident()
        if ident not in self._threads:
            self._threads[ident] = threading.current_thread().name
        self.events.append((category, name, start, end, ident, args))

    def record(self, category: str, name: str, start: int, describe=None, *parts) -> None:
        """Record one event from ``start`` until now; its args are ``describe(*parts)`` (a dict),
        worked out only here, so that a hot path pays nothing for them when the timeline is off."""
        end = now()
        self.add(category, name, start, end, None if describe is None else describe(*parts))

    def wait(self, peer, tag: str, start: int, end: int, **args) -> None:
        """Record time blocked in a receive from ``peer`` (a task) under ``tag``."""
        names = self._peer_names.get(peer)
        if names is None:   # worked out once per peer: this runs on every receive that waited
            text = str(peer)
            names = self._peer_names[peer] = (text, f"wait {text.replace('/job:', '').replace('/task:', ':')}")
        if tag.startswith(CLOCK_TAG_PREFIX):  # the clock exchange's own replies
            self.add("clock", "clock exchange", start, end, {"peer": names[0]})
            return
        self.add("wait", names[1], start, end, {"peer": names[0], "tag": tag, **args} if args else
                 {"peer": names[0], "tag": tag})

    def wait_until_now(self, peer, tag: str, start: int) -> int:
        """Record a wait on ``peer`` from ``start`` until now; return now (where the next one starts)."""
        end = now()
        self.wait(peer, tag, start, end)
        return end

    @contextlib.contextmanager
    def span(self, category: str, name: str, args: dict | None = None):
        """Record the ``with`` block as one event; ``args`` (a dict) may be filled in inside it."""
        start = now()
        try:
            yield args
        finally:
            self.add(category, name, start, now(), args)

    def clock_now(self) -> int:
        """This task's timeline clock in ns: its wall clock at the anchor, advanced by ``now()``."""
        return self.wall_ns + (now() - self.perf_ns)

    # -- hooks -------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ``TimelineError`` if the file cannot be written (called before a strategy or a
        communicator starts, so that a bad path fails at once rather than after training)."""
        if self.problem:
            raise TimelineError(self.problem)

    def attach(self, transport, **info) -> None:
        """A strategy or communicator of this task started on ``transport``: name the task after it
        and measure the clock offset to the reference task over it (once per process)."""
        with self._lock:
            if self.task is None:
                self.task = transport.task
                self.info["reference"] = str(transport.cluster.chief)
            self.info.update({key: value for key, value in info.items() if value is not None})
            self.info.setdefault("transport", getattr(transport, "name", None))
            if self._synced or transport.task != self.task or getattr(transport, "in_process", False):
                return
            self._synced = True
        if self.clock_exchange is not None:
            self._sync_thread = self.clock_exchange(self, transport)

    def settle(self, transport, timeout: float = SETTLE_SECONDS) -> None:
        """Let the clock exchange over ``transport`` finish before it closes (a strategy's or
        communicator's normal shutdown calls this): a short job would otherwise close the transport
        under its own pings, or under the pings of the tasks the reference still answers, and the
        files would fall back to the wall clocks. Bounded by ``timeout`` seconds; returns at once if
        the exchange ran elsewhere or is over."""
        thread = self._sync_thread
        if thread is not None and transport.task == self.task and thread is not threading.current_thread():
            thread.join(timeout)

    # -- writing -----------------------------------------------------------------------------------
    def document(self, ended: str | None = None) -> dict:
        """This task's timeline as a Chrome-trace JSON object (pid 1; ``ts`` in microseconds since
        the anchor)."""
        with self._lock:
            events = list(self.events)
            threads = dict(self._threads)
        main = threading.main_thread().ident
        order = sorted(threads, key=lambda ident: (ident != main, ident))
        tids = {ident: number for number, ident in enumerate(order, start=1)}
        task = str(self.task) if self.task is not None else f"process {os.getpid()}"
        trace = [{"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": task}}]
        trace += [{"ph": "M", "pid": 1, "tid": tids[ident], "name": "thread_name",
                   "args": {"name": threads[ident]}} for ident in order]
        origin = self.perf_ns
        for category, name, start, end, ident, args in events:
            event = {"ph": "X", "cat": category, "name": name, "pid": 1, "tid": tids[ident],
                     "ts": round((start - origin) / 1000, 3), "dur": round((end - start) / 1000, 3)}
            if args:
                event["args"] = args
            trace.append(event)
        meta = {
            "version": VERSION, "kind": "task", "task": task, **self.info,
            "ended": ended, "dropped_events": self.dropped,
            "clock": {"wall_ns": self.wall_ns, "perf_ns": self.perf_ns, "anchor_uncertainty_ns": self.anchor_ns,
                      **self.clock},
        }
        return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {FORMAT: meta}}

    def flush(self, ended: str | None = None) -> str:
        """Write the file now (atomically: a reader never sees half of it); return its path. May be
        called again: each call writes every event so far. Raises ``TimelineError`` if it cannot."""
        with self._lock:
            path = resolve_path(self.path, self.task)
            temporary = f"{path}.{os.getpid()}.tmp"
            try:
                with open(temporary, "w", encoding="utf-8") as stream:
                    json.dump(self.document(ended), stream, separators=(",", ":"))
                os.replace(temporary, path)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise TimelineError(f"cannot write the timeline of {self.task or 'this process'} to {path}: "
                                    f"{exc.strerror or exc}; set {ENV} to a file in a writable directory") from None
            self.written = path
            return path

    def flush_now(self, ended: str) -> None:
        """Write the file before the process ends without running exit callbacks (``os._exit``, a
        fatal signal). Never raises."""
        with contextlib.suppress(Exception):
            self.flush(ended=ended)

    def end_with_script(self, error: str | None) -> None:
        """Write the file as the interpreter ends (:mod:`stratagem.core.lifecycle`: the process's
        recorder is registered as its first transport is made, before that transport and any
        strategy, so it runs after they ended and their last events are in). A process that recorded
        nothing and is no task (``stratagem launch`` itself) writes nothing."""
        if self.task is None and not self.events:
            return
        try:
            self.flush(ended=error)
        except TimelineError as exc:
            print(f"stratagem: {exc}", file=sys.stderr)


class NullRecorder:
    """The recorder of a process without a timeline: every method of :class:`Recorder` that the
    library calls, doing nothing. The hot paths hold one of the two and call it without checking
    which (see the module doc).

    >>> with OFF.span("step", "step"):
    ...     OFF.record("pack", "pack", OFF.now(), dict, [("bytes", 4096)])
    >>> OFF.enabled, OFF.now(), OFF.flush_now("done")
    (False, 0, None)
    """

    enabled = False

    def now(self) -> int:
        """0: nothing is timed (cheaper than reading the clock)."""
        return 0

    def add(self, category: str, name: str, start: int, end: int, args: dict | None = None) -> None:
        """Nothing (:meth:`Recorder.add`)."""

    def record(self, category: str, name: str, start: int, describe=None, *parts) -> None:
        """Nothing; ``describe`` is not called (:meth:`Recorder.record`)."""

    def wait(self, peer, tag: str, start: int, end: int, **args) -> None:
        """Nothing (:meth:`Recorder.wait`)."""

    def wait_until_now(self, peer, tag: str, start: int) -> int:
        """0, this recorder's ``now()`` (:meth:`Recorder.wait_until_now`)."""
        return 0

    def span(self, category: str, name: str, args: dict | None = None):
        """A ``with`` block that records nothing; it gives ``None``, not ``args`` (:meth:`Recorder.span`)."""
        return _NO_SPAN

    def check(self) -> None:
        """Nothing to check: no file is written."""

    def attach(self, transport, **info) -> None:
        """Nothing: no task to name, no clock to measure."""

    def settle(self, transport, timeout: float = SETTLE_SECONDS) -> None:
        """Nothing to wait for."""

    def flush_now(self, ended: str) -> None:
        """Nothing to write."""


_NO_SPAN = contextlib.nullcontext()
#: The recorder of everything that runs without a timeline.
OFF = NullRecorder()
