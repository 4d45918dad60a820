"""One job over several machines: a launcher per node, as ``torchrun`` and ``horovodrun`` users expect.

Run the same command on every node, each with its own ``--node-rank``::

    export STRATAGEM_SECRET=...   # the same on every node (or --secret-file FILE); never on a command line
    stratagem launch --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --worker-per-node 4 -- python train.py
    stratagem launch --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --worker-per-node 4 -- python train.py

Node 0 listens on ``--rdzv`` and admits the other nodes once they prove they hold the cluster secret
(:mod:`.rendezvous`); it numbers the tasks node-major (node 0 runs ``worker:0`` .. ``worker:3``, the chief
being ``worker:0``; node 1 runs ``worker:4`` .. ``worker:7``; ``--ps-per-node`` ps tasks likewise) and sends
every node the cluster. Each launcher then starts and supervises its own tasks exactly as a local
``stratagem launch`` does (``STRATAGEM_CONFIG``, the secret, output prefixed ``[worker:5]``); each node's
tasks listen on the address the node reaches node 0 from (``--node-host`` to choose it).

The launchers stay connected for the whole job (heartbeats both ways), so the job ends as one:

- every task on every node exits 0: every launcher exits 0 (ps tasks get ``--ps-grace`` once the
  workers of *every* node are done);
- a task fails on any node: its launcher stops its tasks and tells node 0, which stops every other node;
  every launcher prints the same summary, all tasks of all nodes with the first failure in time marked
  (clocks compared by a round trip at the rendezvous), and exits 1;
- a node's launcher vanishes (its connection drops, or it is silent for ``--node-timeout`` seconds):
  the job ends naming that node; a node that loses node 0 stops its tasks and exits 1;
- ``--timeout`` (node 0's, counted from its start) exits 124 everywhere, Ctrl-C on any node 130.
"""

from __future__ import annotations

import argparse
import ipaddress
import queue
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence, TextIO

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.transport_kit.ports import reserve_ports
from stratagem.launch import rendezvous
from stratagem.launch.job import DEFAULT_GRACE, DEFAULT_PS_GRACE, check_options, check_transport, job_env, task_env
from stratagem.launch.rendezvous import (
    DEFAULT_NODE_TIMEOUT,
    DEFAULT_RDZV_TIMEOUT,
    Channel,
    ChannelClosed,
    RendezvousError,
)
from stratagem.launch.supervisor import (
    EXIT_OK,
    EXIT_SIGNALLED,
    EXIT_TASK_FAILED,
    EXIT_TIMEOUT,
    POLL_INTERVAL,
    SERVING_JOBS,
    LaunchResult,
    RunningTask,
    SignalTrap,
    TaskResult,
    describe_signal,
    kill_and_reap,
    start_task,
    stop,
)
from stratagem.launch.task_output import COLORS, OutputPump, PipeReader, Sink, task_prefix



# -- the result --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiNodeResult(LaunchResult):
    """A multi-node job's outcome, the same on every node: every task's result (``tasks``), the node each
    task ran on (``nodes``: ``{"worker:1": 1}``), and the nodes lost with their tasks (``lost``)."""

    nodes: Mapping[str, int] | None = None
    #: ``{node rank: why}`` for nodes whose launcher vanished before it reported its tasks.
    lost: Mapping[int, str] | None = None
    #: This launcher's node rank.
    node_rank: int = 0

    def summary(self) -> str:
        verdict = "" if self.ok else "FAILED: "
        head = f"stratagem launch: {verdict}{self.reason} ({self.duration:.1f}s)"
        nodes, lost = dict(self.nodes or {}), dict(self.lost or {})
        if self.ok and not any(r.stopped_by_launcher for r in self.tasks) and not lost:
            return head
        known = {r.task: r for r in self.tasks}
        rows = [("task", "node", "pid", "status")]
        for task in self.cluster.tasks():
            node = nodes.get(task.short, "?")
            r = known.get(task)
            if r is None:
                rows.append((task.short, str(node), "?", f"unknown: node {node} lost ({lost.get(node, 'no report')})"))
            else:
                rows.append((task.short, str(node), str(r.pid),
                             r.status + ("  <- first failure" if r.task == self.failed_task else "")))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        table = [f"  {t:<{widths[0]}}  {n:<{widths[1]}}  {p:>{widths[2]}}  {s}" for t, n, p, s in rows]
        return "\n".join([head, *table])


def _result_wire(result: TaskResult, at: float | None, watch: "_ErrorWatch | None" = None) -> dict:
    return {"task": result.task.short, "pid": result.pid, "returncode": result.returncode,
            "stopped": result.stopped_by_launcher, "at": at,
            "blames": watch.blames if watch else None, "failing_at": watch.failing_at if watch else None}


#: How a task's error names the peer it gave up on (in its traceback, or printed by the script): a
#: ``PeerLostError`` (``lost peer /job:worker/task:1``), or a ``TransportTimeout`` waiting for one peer
#: (``no message 'tag' from /job:worker/task:1 within``, ``no handshake with /job:worker/task:1 at``).
_PEER_LOST = re.compile(r"\b(?:lost peer|no handshake with|no message .{0,300}? from) "
                        r"(/job:[A-Za-z0-9_\-]+/task:\d+)\b")
#: The first line Python prints for an uncaught exception: the task is failing from then on, even if
#: the launcher's stop reaches it before it has exited.
_TRACEBACK = "Traceback (most recent call last):"


class _ErrorWatch:
    """A task's stderr on its way to our sink, watched for what its failure says: when it began to fail
    (its first traceback, wall clock) and the peer its error names, if it gave up on one. A task that
    failed because it lost a peer is not the root cause; the peer it names is (README: the culprit)."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.blames: str | None = None
        self.failing_at: float | None = None

    def write(self, text: str) -> None:
        if self.failing_at is None and _TRACEBACK in text:
            self.failing_at = time.time()
        for match in _PEER_LOST.finditer(text):
            try:
                self.blames = TaskId.parse(match.group(1)).short
            except ConfigurationError:
                pass
        self.sink.write(text)


def _status_word(row: dict) -> str:
    code = row["returncode"]
    how = describe_signal(-code) if code < 0 else f"exit {code}"
    return f"stopped by the launcher ({how})" if row["stopped"] else f"ended ({how})"


def _how(returncode: int) -> str:
    return f"was killed by {describe_signal(-returncode)}" if returncode < 0 else f"exited with code {returncode}"


# -- one node's launcher -----------------------------------------------------------------------------


class _Node:
    """A node's launcher once the cluster is assembled: its tasks, and its control channel(s).

    On node 0 ``channels`` holds one channel per other node and this object also coordinates the job
    (the ``_coordinate`` methods); elsewhere it holds the channel to node 0.
    """

    def __init__(self, rank: int, nnodes: int, cluster: ClusterSpec, placement: dict[str, int],
                 channels: dict[int, Channel], offsets: dict[int, float], events: "queue.Queue", *,
                 command: Sequence[str], base_env: dict, secret: str, transport: str | None,
                 out: Sink, err: Sink, timeout: float | None, grace: float, ps_grace: float,
                 node_timeout: float, started: float):
        self.rank, self.nnodes = rank, nnodes
        self.cluster, self.placement = cluster, placement
        self.channels, self.offsets, self.events = channels, offsets, events
        self.command, self.base_env, self.secret, self.transport = command, base_env, secret, transport
        self.out, self.err = out, err
        self.timeout, self.grace, self.ps_grace, self.node_timeout = timeout, grace, ps_grace, node_timeout
        self.started = started
        self.tasks: list[RunningTask] = []
        self.pump = OutputPump()
        self.exit_at: dict[str, float] = {}       # task -> wall time its exit was seen
        self.watches: dict[str, _ErrorWatch] = {}  # task -> what its stderr said of its failure
        self.sent: set[str] = set()               # one-shot notices already given to node 0
        self.stop_reason: str | None = None       # why this node stops its tasks
        self.stopped = False
        self.ps_deadline: float | None = None
        self.summary: dict | None = None          # the job's end, from node 0
        self.lost_node0: str | None = None
        # node 0 only: what the nodes said
        self.reports: dict[int, list] = {}
        self.lost: dict[int, tuple[str, float]] = {}
        self.drivers_done: set[int] = set()
        self.job_stop: dict | None = None         # the first reason to stop the job, and its exit code

    # -- tasks ------------------------------------------------------------------------------------

    def local_tasks(self) -> list[TaskId]:
        return [t for t in self.cluster.tasks() if self.placement[t.short] == self.rank]

    def start(self, holders: dict[TaskId, socket.socket]) -> None:
        for task in self.local_tasks():
            env = task_env(self.base_env, self.cluster, task, self.secret, self.transport)
            holders.pop(task).close()  # free the port as late as possible: see transport_kit.ports
            process = start_task(task, self.command, env)
            color = COLORS[self.cluster.tasks().index(task) % len(COLORS)]
            self.pump.add(process.stdout, PipeReader(task_prefix(task, color, self.out.stream), self.out))
            watch = self.watches[task.short] = _ErrorWatch(self.err)
            self.pump.add(process.stderr, PipeReader(task_prefix(task, color, self.err.stream), watch))
            self.tasks.append(RunningTask(task, process))

    def _observe(self, trap: SignalTrap) -> None:
        """Note exits, and tell node 0 of a failure, an interruption, or that our workers are done."""
        for t in self.tasks:
            if t.poll() is not None and t.task.short not in self.exit_at:
                self.exit_at[t.task.short] = time.time()
        if trap.received and "interrupted" not in self.sent:
            self.sent.add("interrupted")
            self._stop_here(f"interrupted by {describe_signal(trap.received[0])}")
            self._notify("interrupted", {"signal": int(trap.received[0])})
        for t in self.tasks:
            code = t.poll()
            if code and not t.stopped_by_launcher and f"failed {t.task.short}" not in self.sent:
                self.sent.add(f"failed {t.task.short}")
                self._stop_here(f"{t.task.short} {_how(code)}")
                self._notify("failed", {"task": t.task.short, "how": _how(code)})
        drivers = [t for t in self.tasks if t.task.job not in SERVING_JOBS]
        if "drivers_done" not in self.sent and all(t.poll() == 0 for t in drivers):
            self.sent.add("drivers_done")
            self._notify("drivers_done", {})

    def _stop_here(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def _report(self) -> None:
        """All our tasks are over: send their results to node 0 (once)."""
        if "report" in self.sent or any(t.running for t in self.tasks):
            return
        self.sent.add("report")
        self._notify("report", {"tasks": [_result_wire(t.result(), self.exit_at.get(t.task.short),
                                                       self.watches.get(t.task.short)) for t in self.tasks]})

    def _notify(self, tag: str, meta: dict) -> None:
        if self.rank == 0:
            self._coordinate(0, tag, meta)
        elif self.lost_node0 is None and not self.channels[0].try_send(tag, meta):
            self._lose_node0("cannot send to it")

    def _lose_node0(self, why: str) -> None:
        if self.lost_node0 is None and self.summary is None:
            self.lost_node0 = why
            self._stop_here(f"lost node 0 ({why})")

    # -- messages ---------------------------------------------------------------------------------

    def _handle(self) -> None:
        while True:
            try:
                peer, tag, meta = self.events.get_nowait()
            except queue.Empty:
                break
            if self.rank == 0:
                self._coordinate(peer, tag, meta)
            elif tag is None:
                self._lose_node0(meta)
            elif tag == "stop":
                self._stop_here(str(meta.get("reason")))
            elif tag == "workers_done":
                self.ps_deadline = self.ps_deadline or time.monotonic() + self.ps_grace
            elif tag == "summary":
                self.summary = meta
        if self.rank != 0 and self.lost_node0 is None and self.summary is None:
            if self.channels[0].silent_for() > self.node_timeout:
                self._lose_node0(f"silent for {self.node_timeout:g}s, --node-timeout")

    # -- node 0: the job as a whole ----------------------------------------------------------------

    def _coordinate(self, node: int, tag: str | None, meta) -> None:
        if tag is None:  # the node's connection ended
            if node not in self.reports and node not in self.lost:
                self._lose(node, str(meta))
        elif tag == "failed":
            self._stop_job(f"{meta.get('task')} (node {node}) {meta.get('how')}", EXIT_TASK_FAILED)
        elif tag == "interrupted":
            sig = int(meta.get("signal", 2))
            where = "" if node == 0 else f" on node {node}"
            self._stop_job(f"interrupted by {describe_signal(sig)}{where}",
                           EXIT_SIGNALLED.get(sig, 128 + sig))
        elif tag == "drivers_done":
            self.drivers_done.add(node)
            if len(self.drivers_done) == self.nnodes:
                self._broadcast("workers_done", {})
                self.ps_deadline = self.ps_deadline or time.monotonic() + self.ps_grace
        elif tag == "report":
            self.reports[node] = list(meta.get("tasks", []))

    def _lose(self, node: int, why: str) -> None:
        self.lost[node] = (why, time.time())
        self.channels[node].close()
        self._stop_job(f"node {node}'s launcher was lost ({why})", EXIT_TASK_FAILED)

    def _stop_job(self, reason: str, code: int, **extra) -> None:
        if self.job_stop is None:
            self.job_stop = {"reason": reason, "code": code, **extra}
            self._stop_here(reason)
            self._broadcast("stop", {"reason": reason})

    def _broadcast(self, tag: str, meta: dict) -> None:
        for node, channel in self.channels.items():
            if node not in self.lost:
                channel.try_send(tag, meta)

    def _check_nodes(self) -> None:
        now = time.monotonic()
        for node, channel in self.channels.items():
            if node not in self.lost and node not in self.reports and channel.silent_for() > self.node_timeout:
                self._lose(node, f"silent for {self.node_timeout:g}s, --node-timeout")
        if (self.timeout is not None and now >= self.started + self.timeout
                and len(self.drivers_done) < self.nnodes):
            self._stop_job(f"timed out after {self.timeout:g}s (--timeout)", EXIT_TIMEOUT, timed_out=True)

    def _all_reported(self) -> bool:
        return all(node in self.reports or node in self.lost for node in range(self.nnodes))

    def _culprit(self, results: list[dict]) -> tuple[str | None, str | None]:
        """The root cause of a failed job: ``(task or None, what happened)``, or ``(None, None)``.

        The earliest failure in time (each node's clock corrected by its offset; a task fails from its
        first traceback, else its exit) among the tasks that failed on their own, the tasks that were
        failing (a traceback) when their launcher stopped them, and the node launchers lost, leaving out
        tasks whose error named a peer they gave up on (``PeerLostError``, a ``TransportTimeout``
        waiting for it): those failed because of it. If every failed task names a peer, the peer the
        earliest of them names is the culprit (a stopped or hung task its peers gave up on)."""
        def when(row: dict) -> float:
            times = [t for t in (row.get("at"), row.get("failing_at")) if t is not None]
            return min(times) - self.offsets.get(self.placement.get(row["task"], 0), 0.0)

        def where(task: str) -> str:
            return f"{task} (node {self.placement.get(task)})"

        rows = {row["task"]: row for row in results}
        failed = [row for row in results if row["returncode"] and not row["stopped"] and row.get("at") is not None]
        failing = [row for row in results if row["stopped"] and row.get("failing_at") is not None]
        bystander = {row["task"] for row in results if row.get("blames") in rows and row["blames"] != row["task"]}
        roots = [(when(row), f"{where(row['task'])} {_how(row['returncode'])}", row["task"])
                 for row in failed if row["task"] not in bystander]
        roots += [(when(row), f"{where(row['task'])} failed (its traceback is above); it was {_status_word(row)} "
                              f"while ending", row["task"])
                  for row in failing if row["task"] not in bystander]
        roots += [(at, f"node {node}'s launcher was lost ({why})", None) for node, (why, at) in self.lost.items()]
        if roots:
            _, what, task = min(roots, key=lambda c: c[0])
            return task, what
        if failed:
            first = min(failed, key=when)
            named = first["blames"]
            return named, (f"{where(named)} stopped answering: {first['task']} lost it (its error names {named}) "
                           f"and failed; {named} was {_status_word(rows[named])}")
        return None, None

    def _compose(self) -> dict:
        """Node 0: the job's end from every node's report, as sent to every node."""
        results = [row for _, rows in sorted(self.reports.items()) for row in rows]
        failed_task, what = self._culprit(results)
        stopped = self.job_stop or {}
        if stopped.get("timed_out") or (stopped and stopped["code"] != EXIT_TASK_FAILED):
            reason, code = f"{stopped['reason']}; stopped every task on {self.nnodes} nodes", stopped["code"]
            failed_task = None
        elif what:
            reason, code = f"{what}; stopped every task on {self.nnodes} nodes", EXIT_TASK_FAILED
        elif stopped:
            reason, code = f"{stopped['reason']}; stopped every task on {self.nnodes} nodes", stopped["code"]
        else:
            code = EXIT_OK
            left = [row["task"] for row in results if row["stopped"]]
            if left:
                reason = (f"every worker task succeeded; stopped {', '.join(left)}, still serving after the "
                          f"{self.ps_grace:g}s ps grace period (not a failure)")
            else:
                reason = f"all {len(results)} tasks on {self.nnodes} nodes finished successfully"
        return {"reason": reason, "exit_code": code, "failed_task": failed_task, "tasks": results,
                "lost": {str(node): why for node, (why, _) in self.lost.items()},
                "duration": time.monotonic() - self.started, "timed_out": code == EXIT_TIMEOUT,
                "signal": code - 128 if code in EXIT_SIGNALLED.values() else None}

    # -- the whole run ----------------------------------------------------------------------------

    def run(self, holders: dict[TaskId, socket.socket], trap: SignalTrap) -> MultiNodeResult:
        try:
            self.start(holders)
            looked = time.monotonic()
            while True:
                self.pump.pump(POLL_INTERVAL)
                if time.monotonic() - looked > max(1.0, self.node_timeout / 4):
                    # We were not looking (SIGSTOPped, or stopping our tasks): a peer's heartbeats may be
                    # waiting unread. Slow is not dead: start counting its silence again.
                    for channel in self.channels.values():
                        channel.restart_silence()
                looked = time.monotonic()
                self._observe(trap)
                self._handle()
                if self.rank == 0:
                    self._check_nodes()
                if self.stop_reason is not None and not self.stopped:
                    self.stopped = True
                    stop(self.tasks, self.pump, trap, self.grace)
                    self.pump.drain(1.0, POLL_INTERVAL)
                    self._observe(trap)
                elif self.ps_deadline is not None and time.monotonic() >= self.ps_deadline and not self.stopped:
                    self.stopped = True  # only serving tasks are left: stopping them is no failure
                    stop(self.tasks, self.pump, trap, self.grace)
                self._report()
                if self.rank == 0 and "report" in self.sent and self._all_reported():
                    self.summary = self._compose()
                    self._broadcast("summary", self.summary)
                if self.summary is not None:
                    break
                if self.lost_node0 is not None and "report" in self.sent:
                    break
        finally:
            kill_and_reap(self.tasks)
            self.pump.close()
            for node, channel in self.channels.items():
                # node 0 lets every node read the summary before the connection goes
                channel.close(linger=2.0 if self.rank == 0 and node not in self.lost else 0.0)
        return self._result()

    def _result(self) -> MultiNodeResult:
        if self.summary is None:  # we lost node 0: what we know is our own tasks
            failed = next((t for t in self.tasks if t.poll() and not t.stopped_by_launcher), None)
            what = f"{failed.task.short} {_how(failed.poll())}; " if failed else ""
            self.summary = {"reason": f"{what}lost node 0 ({self.lost_node0}); stopped this node's tasks",
                            "exit_code": EXIT_TASK_FAILED, "failed_task": failed.task.short if failed else None,
                            "tasks": [_result_wire(t.result(), None) for t in self.tasks],
                            "lost": {"0": str(self.lost_node0)},
                            "duration": time.monotonic() - self.started, "timed_out": False, "signal": None}
        s = self.summary
        tasks = tuple(TaskResult(TaskId.parse(row["task"]), int(row["pid"]), int(row["returncode"]), bool(row["stopped"]))
                      for row in s["tasks"])
        order = {t: i for i, t in enumerate(self.cluster.tasks())}
        tasks = tuple(sorted(tasks, key=lambda r: order.get(r.task, len(order))))
        return MultiNodeResult(
            cluster=self.cluster, tasks=tasks, exit_code=int(s["exit_code"]), reason=str(s["reason"]),
            duration=float(s["duration"]), failed_task=TaskId.parse(s["failed_task"]) if s["failed_task"] else None,
            timed_out=bool(s["timed_out"]), interrupted_by=s["signal"], nodes=dict(self.placement),
            lost={int(k): v for k, v in s["lost"].items()}, node_rank=self.rank)


# -- rendezvous, then the job ------------------------------------------------------------------------


def launch_node(command: Sequence[str], *, nnodes: int, node_rank: int, rdzv: str, workers: int = 1, ps: int = 0,
                secret: str | None = None, transport: str | None = None, node_host: str | None = None,
                timeout: float | None = None, grace: float = DEFAULT_GRACE, ps_grace: float = DEFAULT_PS_GRACE,
                rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT, node_timeout: float = DEFAULT_NODE_TIMEOUT,
                env: Mapping[str, str | None] | None = None, output: TextIO | None = None,
                error_output: TextIO | None = None) -> MultiNodeResult:
    """Run this node's part of a multi-node job (see the module doc) and return the job's result.

    ``secret``: the cluster secret (default: ``STRATAGEM_SECRET`` of the environment); required, the
    same on every node. Raises ``ConfigurationError`` for bad options and ``RendezvousError`` when the
    nodes cannot assemble; once tasks run, every outcome is a :class:`MultiNodeResult`.
    """
    base_env = job_env(env)
    for name, value, low in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0), ("workers", workers, 0), ("ps", ps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")
    if node_rank >= nnodes:
        raise ConfigurationError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: "
                                 f"give each node a distinct rank from 0 to {nnodes - 1}")
    if workers + ps == 0:
        raise ConfigurationError("this node would run no task: give --worker-per-node K (and/or --ps-per-node M)")
    # The job-wide checks (a command, timeouts; node counts were checked above, per node).
    check_options(command, max(workers, 1), ps, False, secret, timeout, grace, ps_grace, base_env.get("PATH"))
    for name, value in (("rdzv_timeout", rdzv_timeout), ("node_timeout", node_timeout)):
        if not value > 0:
            raise ConfigurationError(f"{name} must be a number of seconds > 0, got {value!r}")
    check_transport(transport)
    secret = secret or base_env.get("STRATAGEM_SECRET")
    if not secret:
        raise ConfigurationError("a multi-node job needs a cluster secret shared by every node: export "
                                 "STRATAGEM_SECRET=... on every node, or give --secret-file FILE")
    host, port = rendezvous.parse_endpoint(rdzv)
    out = Sink(output if output is not None else sys.stdout)
    err = Sink(error_output if error_output is not None else sys.stderr)
    started = time.monotonic()
    key = secret.encode()
    events: queue.Queue = queue.Queue()
    holders: dict[TaskId, socket.socket] = {}
    channels: dict[int, Channel] = {}
    offsets: dict[int, float] = {0: 0.0}
    held: list[socket.socket] = []
    try:
        try:
            if node_rank == 0:
                cluster, placement, held = _assemble(host, port, nnodes, workers, ps, transport, node_host, key,
                                                     started + rdzv_timeout, channels, offsets, err)
            else:
                cluster, placement, held, transport = _join(host, port, nnodes, node_rank, workers, ps, transport,
                                                            node_host, key, rdzv_timeout, channels, err)
        except ChannelClosed as exc:
            where = "a node" if node_rank == 0 else "node 0"
            raise RendezvousError(f"{where} left the rendezvous before the job started ({exc})") from None
        mine = [t for t in cluster.tasks() if placement[t.short] == node_rank]
        holders = dict(zip(mine, held))
        held = []
        heartbeat = min(1.0, node_timeout / 5)
        for channel in channels.values():
            channel.start(events, heartbeat, node_timeout)
        err.write(f"stratagem launch: node {node_rank} of {nnodes}: running {', '.join(t.short for t in mine)} "
                  f"(cluster of {len(cluster.tasks())} tasks)\n")
        node = _Node(node_rank, nnodes, cluster, placement, channels, offsets, events, command=command,
                     base_env=base_env, secret=secret, transport=transport, out=out, err=err, timeout=timeout,
                     grace=grace, ps_grace=ps_grace, node_timeout=node_timeout, started=started)
        with SignalTrap() as trap:
            result = node.run(holders, trap)
    finally:
        for sock in [*held, *holders.values()]:
            sock.close()
        for channel in channels.values():
            channel.close()
    err.write(result.summary() + "\n")
    return result


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _assemble(host, port, nnodes, workers, ps, transport, node_host, key, deadline, channels, offsets, err):
    """Node 0: admit every other node, then send each the cluster. Returns (cluster, placement, our port holders)."""
    listener = rendezvous.listen(host, port)
    held: list[socket.socket] = []
    try:
        address = node_host or listener.getsockname()[0]
        if address in ("0.0.0.0", "::"):
            raise ConfigurationError(f"--rdzv {host}:{port} listens on every address: give --node-host, the address "
                                     f"of node 0 that the other nodes reach")
        _, held = reserve_ports(address, workers + ps)
        joins = {0: {"address": address, "ports": [s.getsockname()[1] for s in held], "workers": workers, "ps": ps}}

        def check(join: dict) -> str | None:
            if join.get("transport") != transport:
                return (f"node {join.get('rank')} was given --transport {join.get('transport')}, node 0 "
                        f"--transport {transport}: give every node the same --transport")
            return None

        found, found_offsets = rendezvous.gather(listener, key, nnodes, joins, deadline, check,
                                                 lambda line: err.write(f"stratagem launch: {line}\n"))
        channels.update(found)
        offsets.update(found_offsets)
        cluster, placement = rendezvous.assemble_cluster(joins)
        reason = None
        if "worker" not in cluster.as_dict():
            reason = "no node runs a worker: give at least one node --worker-per-node K >= 1"
        elif _loopback(address) and any(not _loopback(join["address"]) for join in joins.values()):
            reason = (f"node 0's tasks would listen on {address}, a loopback address the other nodes cannot reach: "
                      f"give --rdzv with node 0's network address (or --node-host ADDR on node 0)")
        if reason:
            for channel in channels.values():
                rendezvous.reject(channel, reason)
            raise ConfigurationError(reason)
        for channel in channels.values():
            channel.send("cluster", {"cluster": cluster.as_dict(), "placement": placement, "transport": transport})
        return cluster, placement, held
    except BaseException:
        for sock in held:
            sock.close()
        raise
    finally:
        listener.close()


def _join(host, port, nnodes, rank, workers, ps, transport, node_host, key, rdzv_timeout, channels, err):
    """Node ``rank`` > 0: join node 0's rendezvous; returns (cluster, placement, our port holders, transport)."""
    deadline = time.monotonic() + rdzv_timeout
    sock = rendezvous.connect(host, port, deadline)
    held: list[socket.socket] = []
    try:
        try:
            channel = rendezvous.introduce(sock, rank, key)
        except ChannelClosed as exc:
            raise RendezvousError(f"node 0 at {host}:{port} did not complete the handshake ({exc}): is it a "
                                  f"stratagem launcher of the same version?") from None
        channels[0] = channel
        address = node_host or sock.getsockname()[0]
        _, held = reserve_ports(address, workers + ps)
        channel.send("join", {"rank": rank, "nnodes": nnodes, "address": address, "workers": workers, "ps": ps,
                              "ports": [s.getsockname()[1] for s in held], "transport": transport,
                              "time": time.time()})
        err.write(f"stratagem launch: node {rank} joined the rendezvous at {host}:{port}; waiting for the other nodes\n")
        try:
            kind, tag, meta = channel.recv(rdzv_timeout)
        except ChannelClosed as exc:
            raise RendezvousError(f"node 0 at {host}:{port} did not send the cluster ({exc})") from None
        if kind == rendezvous.Kind.REJECT:
            raise RendezvousError(f"node 0 ended the rendezvous: {meta.get('reason')}")
        if tag != "cluster":
            raise ProtocolError(f"expected the cluster from node 0, got {tag!r}")
        cluster = ClusterSpec(meta["cluster"])
        placement = {str(k): int(v) for k, v in meta["placement"].items()}
        mine = [t for t in cluster.tasks() if placement.get(t.short) == rank]
        if len(mine) != len(held):
            raise ProtocolError(f"node 0 placed {len(mine)} task(s) on this node, which offered {len(held)}")
        return cluster, placement, held, meta.get("transport") or transport
    except BaseException:
        for s in held:
            s.close()
        if 0 not in channels:
            sock.close()
        raise


# -- command line ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the multi-node options of ``stratagem launch`` (their own group)."""
    group = parser.add_argument_group(
        "multi-node (one launcher per node, as torchrun / horovodrun)",
        "run on every node: stratagem launch --nnodes N --node-rank I --rdzv NODE0:PORT --worker-per-node K -- CMD "
        "(the secret from $STRATAGEM_SECRET or --secret-file); or once: stratagem launch --hostfile FILE -- CMD")
    group.add_argument("--nnodes", type=int, metavar="N", help="number of nodes (machines) in the job")
    group.add_argument("--node-rank", type=int, metavar="I", help="this node's rank, 0 .. N-1; node 0 hosts the rendezvous")
    group.add_argument("--rdzv", "--rdzv-endpoint", dest="rdzv", metavar="HOST:PORT",
                       help="node 0's address and a free port on it, where the nodes meet")
    group.add_argument("--worker-per-node", "--workers-per-node", "--nproc-per-node", dest="worker_per_node",
                       type=int, metavar="K", help="worker tasks on this node (default: 1)")
    group.add_argument("--ps-per-node", type=int, metavar="M", help="ps tasks on this node (default: 0)")
    group.add_argument("--node-host", metavar="ADDR",
                       help="the address this node's tasks listen on and are reached at (default: the address "
                            "this node reaches node 0 from; on node 0, the --rdzv host)")
    group.add_argument("--secret-file", metavar="FILE",
                       help="read the cluster secret from FILE ('-': standard input) instead of $STRATAGEM_SECRET")
    group.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT, metavar="SECONDS",
                       help=f"how long the nodes may take to join (default: {DEFAULT_RDZV_TIMEOUT:g})")
    group.add_argument("--node-timeout", type=float, default=DEFAULT_NODE_TIMEOUT, metavar="SECONDS",
                       help="a node launcher silent this long ends the job, named "
                            f"(default: {DEFAULT_NODE_TIMEOUT:g})")
    group.add_argument("--hostfile", metavar="FILE",
                       help="start a launcher on every host of FILE ('host slots=K' lines, as Open MPI and Horovod; "
                            "K workers each) through --remote-command; host 1 is node 0")
    group.add_argument("--remote-command", metavar="CMD", default=None,
                       help="with --hostfile: how to run a command on a host, called as CMD HOST 'SHELL COMMAND' "
                            "(default: ssh -o BatchMode=yes); the secret goes through its standard input")
    group.add_argument("--rdzv-port", type=int, metavar="PORT", default=None,
                       help="with --hostfile: the rendezvous port on the first host (default: 29400)")
    group.add_argument("--env", dest="forward_env", action="append", metavar="NAME", default=None,
                       help="with --hostfile: pass this environment variable to every remote launcher (repeatable)")


def wants_multinode(args: argparse.Namespace) -> bool:
    """Whether ``stratagem launch`` was asked for a multi-node job (``--nnodes`` or ``--hostfile``)."""
    return getattr(args, "nnodes", None) is not None or getattr(args, "hostfile", None) is not None


def read_secret_file(path: str) -> str:
    """The secret in ``path`` (``-``: standard input), its first line without the line ending."""
    try:
        if path == "-":
            text = sys.stdin.readline()
        else:
            with open(path) as f:
                text = f.readline()
    except OSError as exc:
        raise ConfigurationError(f"--secret-file {path}: cannot read it ({exc.strerror})") from None
    secret = text.rstrip("\r\n")
    if not secret:
        raise ConfigurationError(f"--secret-file {path}: the file holds no secret (its first line is empty)")
    return secret


def run(args: argparse.Namespace, command: Sequence[str]) -> int:
    """``stratagem launch --nnodes ...`` or ``--hostfile ...`` with parsed ``args``; the exit status.
    Raises ``ConfigurationError`` for bad options (the caller reports it as a usage error)."""
    conflicts = {"--mpi": getattr(args, "mpi", False), "--ray": getattr(args, "ray", None),
                 "--chief": getattr(args, "chief", False), "--timeline": getattr(args, "timeline", None),
                 "--restart-workers": getattr(args, "restart_workers", None),
                 "--ps": getattr(args, "ps", 0) or None,
                 "--worker": None if getattr(args, "worker", 1) == 1 else args.worker,
                 "--secret": getattr(args, "secret", None),
                 "--hosts": getattr(args, "hosts", None)}  # emulated hosts (launch/hosts.py), where present
    given = [flag for flag, value in conflicts.items() if value is not None and value is not False]
    if given:
        hint = {"--ps": "; give --ps-per-node M", "--worker": "; give --worker-per-node K (with --hostfile: slots=K)",
                "--secret": "; command lines are visible to every user: export STRATAGEM_SECRET or give --secret-file"}
        raise ConfigurationError(f"{', '.join(given)}: not with a multi-node launch (--nnodes/--hostfile)"
                                 + "".join(hint.get(flag, "") for flag in given))
    secret = read_secret_file(args.secret_file) if args.secret_file else None
    if args.hostfile is not None:
        from stratagem.launch.hostfile import launch_hostfile

        if args.nnodes is not None or args.node_rank is not None or args.rdzv is not None:
            raise ConfigurationError("--hostfile starts every node itself: leave out --nnodes, --node-rank and --rdzv")
        return launch_hostfile(command, hostfile=args.hostfile, secret=secret, remote_command=args.remote_command,
                               rdzv_port=args.rdzv_port, forward_env=args.forward_env or [],
                               ps_per_node=args.ps_per_node or 0, transport=args.transport, timeout=args.timeout,
                               grace=args.grace, ps_grace=args.ps_grace, rdzv_timeout=args.rdzv_timeout,
                               node_timeout=args.node_timeout)
    hostfile_only = {"--remote-command": args.remote_command, "--rdzv-port": args.rdzv_port,
                     "--env": args.forward_env}
    given = [flag for flag, value in hostfile_only.items() if value is not None]
    if given:
        raise ConfigurationError(f"{', '.join(given)}: only with --hostfile FILE")
    if args.node_rank is None or args.rdzv is None:
        raise ConfigurationError("--nnodes needs --node-rank I (this node's rank) and --rdzv HOST:PORT (node 0's "
                                 "address and port), the same --rdzv on every node")
    try:
        result = launch_node(command, nnodes=args.nnodes, node_rank=args.node_rank, rdzv=args.rdzv,
                             workers=1 if args.worker_per_node is None else args.worker_per_node,
                             ps=args.ps_per_node or 0, secret=secret, transport=args.transport,
                             node_host=args.node_host, timeout=args.timeout, grace=args.grace,
                             ps_grace=args.ps_grace, rdzv_timeout=args.rdzv_timeout, node_timeout=args.node_timeout)
    except (RendezvousError, ProtocolError) as exc:
        print(f"stratagem launch: error: {exc}", file=sys.stderr)
        return EXIT_TASK_FAILED
    except KeyboardInterrupt:  # Ctrl-C before any task started (during the rendezvous)
        print("stratagem launch: interrupted during the rendezvous; no task was started", file=sys.stderr)
        return EXIT_SIGNALLED[signal.SIGINT]
    return result.exit_code
