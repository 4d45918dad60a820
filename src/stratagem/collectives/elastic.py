"""Elastic communicators: collectives whose members may change (``mirrored`` with ``on_failure="shrink"``).

A plain :class:`~stratagem.collectives.communicator.Communicator` is broken for good once a member dies. An
:class:`ElasticCommunicator` numbers its memberships instead: *generation* ``g`` is a list of members
(and the process, the *incarnation*, of each), and ``g`` is part of every collective's fingerprint, so
a message left over from an older generation (the rest of a ring that a dead peer broke, an abort
notice about it) is discarded, never reduced. The membership changes only at well-defined points,
decided by one member, the *coordinator* (the chief):

* **Losing a member.** A collective that meets the transport's ``PeerLostError`` (or a peer's abort
  notice about it) raises :class:`~stratagem.core.errors.WorldChangedError` instead, naming the lost
  task. Every survivor then calls :meth:`ElasticCommunicator.reform` with the number of its last
  *commit* (see below): each sends a report to the coordinator, which waits for a report from every
  member that is not known to be lost, and answers every one of them with the new generation: the
  survivors, plus any restarted task waiting to join, and the commit they all roll back to.
* **Growing.** A process started again for a task (a new incarnation) says *hello* to the
  coordinator (:meth:`join`). The coordinator sees it at the next :meth:`sync_point`, an all-reduce
  every member makes at a commit, which tells every member that the world must change; they call
  ``reform`` at once, and the newcomer receives the new generation together with the committed state
  (``state_for``, from the coordinator's copy) before its first collective.

Commits are the caller's (the strategy's ``commit()``): a commit is ``sync_point()`` and then a
snapshot of the state. A member that took snapshot ``n + 1`` passed the all-reduce of commit ``n + 1``,
which every member entered after taking snapshot ``n``; so the members' latest commits differ by at
most one, every member keeps its last two, and ``reform`` rolls everyone back to the oldest latest
commit reported: no member ever continues from a state another has not got.

A restarted process may come up before the others saw its old one die; the transport then accepts
it as that peer, and a member waiting on the old process would wait forever. So a generation's
receives also watch the transport's count of each member's losses (``Transport.peer_losses``): a
member declared lost since the generation began is lost, whoever took its place; and the coordinator
takes a hello from a member's task, from another process, as that member's loss. The coordinator
cannot be replaced: losing it is a plain ``PeerLostError``, the end of the job, as without shrink.

Three ranks as threads of one process; rank 2 dies, the survivors re-form and go on::

    >>> import numpy as np
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.core.errors import WorldChangedError
    >>> from stratagem.transports.local import LocalFabric, LocalTransport
    >>> cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1", "local:2"]}), LocalFabric()
    >>> def rank(index):
    ...     transport = LocalTransport(cluster, f"worker:{index}", fabric=fabric, timeout=20)
    ...     comm = ElasticCommunicator(transport, owns_transport=True)
    ...     comm.join()
    ...     comm.allreduce(np.ones(1))                       # generation 0: three members
    ...     if index == 2:
    ...         transport.abort()                            # as if killed
    ...         return None
    ...     try:
    ...         comm.allreduce(np.ones(1))
    ...     except WorldChangedError as exc:
    ...         change = comm.reform(commit=0)               # both survivors roll back to commit 0
    ...     total = comm.allreduce(np.ones(1))               # generation 1: two members
    ...     comm.close()
    ...     return change.generation, [t.short for t in change.lost], float(total[0])
    >>> with ThreadPoolExecutor(3) as pool:
    ...     list(pool.map(rank, range(3)))
    [(1, ['worker:2'], 2.0), (1, ['worker:2'], 2.0), None]
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from stratagem.collectives.communicator import Communicator
from stratagem.collectives.session import CollectiveSession
from stratagem.core import job_state
from stratagem.core.cluster import TaskId
from stratagem.core.errors import (
    CommunicationError,
    ConfigurationError,
    PeerLostError,
    TransportTimeout,
    WorldChangedError,
)
from stratagem.core.transport import Message, Transport

log = logging.getLogger(__name__)

#: Seconds the coordinator spends telling a process waiting to join that the job is over (best effort).
NOTICE_TIMEOUT = 2.0
#: How often the coordinator looks again for reports and losses while it re-forms the world.
_REFORM_POLL = 0.05

#: The kinds of message on an elastic communicator's control tag (``elastic/<name>``).
HELLO, FORMED, WELCOME, REPORT, DECISION, FINISHED, DROPPED, PRESENT = (
    "hello", "formed", "welcome", "report", "decision", "finished", "dropped", "present")


@dataclass(frozen=True)
class WorldChange:
    """A new generation of an elastic world, as every member (and newcomer) learns it.

    ``commit`` is the commit every member rolls back to (the newcomers get its state).
    """

    generation: int
    members: tuple[TaskId, ...]
    lost: tuple[TaskId, ...] = ()
    joined: tuple[TaskId, ...] = ()
    commit: int | None = None

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass
class Admission:
    """What :meth:`ElasticCommunicator.join` returns.

    ``joined_late`` is False for a member of the world as first formed; True for a process admitted
    into a running world, which then holds the committed ``state`` (meta) and its ``buffers``.
    """

    change: WorldChange
    joined_late: bool = False
    state: dict | None = None
    buffers: list = field(default_factory=list)


class ElasticCommunicator(Communicator):
    """A :class:`Communicator` whose members may change between generations (see the module doc).

    Args (besides the Communicator's):
        members: every task that may ever be a member, in rank order (default: the cluster's
            replicas); the first world is all of them.
        coordinator: the member that decides every generation (default: the first member). It must
            outlive the job.

    Call :meth:`join` before any collective. Collectives always run core's algorithms (a transport's
    native collectives work on a fixed group).
    """

    def __init__(self, transport: Transport, members: Sequence[TaskId | str] | None = None, *,
                 name: str = "world", coordinator: TaskId | str | None = None, **options):
        super().__init__(transport, members, name=name, **options)
        if self._hosts is not None:
            raise ConfigurationError("an elastic communicator's members change from one generation to the next: "
                                     "it cannot keep a layout of hosts (leave hierarchical off)")
        self._native = {}
        self._world = list(self._session.members)
        self.coordinator = TaskId.parse(coordinator) if coordinator is not None else self._world[0]
        if self.coordinator not in self._world:
            raise ConfigurationError(f"the coordinator {self.coordinator} is not among the members "
                                     f"({', '.join(map(str, self._world))})")
        #: This process's incarnation: a restarted process of the same task has another one.
        self.incarnation = secrets.token_hex(8)
        self._tag = f"elastic/{name}"
        self._formed = False
        self._hellos: dict[TaskId, str] = {}       # coordinator: processes waiting to join
        self._reports: dict[TaskId, dict] = {}     # coordinator: reports filed, not yet used
        self._lost: set[TaskId] = set()            # peers this member saw lost in this generation
        self._incarnations: dict[TaskId, str] = {}

    # -- identity ------------------------------------------------------------------------------------
    @property
    def generation(self) -> int | None:
        """The number of the current membership (None before :meth:`join`)."""
        return self._session.generation

    @property
    def is_coordinator(self) -> bool:
        return self.task == self.coordinator

    def __repr__(self) -> str:
        return (f"<ElasticCommunicator {self.name!r} generation {self.generation} rank {self.rank}/"
                f"{self.size} on {self.transport!r}>")

    # -- forming the world ---------------------------------------------------------------------------
    def join(self) -> Admission:
        """Become a member: of the first world if it is still forming, else of the running one at its
        next commit (then with the committed state). Blocks until then (up to the timeout)."""
        if self._formed:
            raise ConfigurationError(f"communicator {self.name!r} has joined already")
        if self.is_coordinator:
            return self._form()
        # A restarted process whose chief has ended meanwhile waits for no handshake: the job is over.
        job_state.wait_for_peer(
            lambda seconds: self._send(self.coordinator, {"elastic": HELLO, "inc": self.incarnation}, timeout=seconds),
            self.timeout, task=self.task, what=f"the coordinator {self.coordinator} of {self.name!r}")
        while True:
            message = job_state.wait_for_peer(self._from_coordinator, self.timeout, task=self.task,
                                              what=f"the coordinator {self.coordinator} of {self.name!r}")
            kind = message.meta.get("elastic")
            if kind == FINISHED:
                message = (f"stratagem: {self.task}: the job had finished without this task (its coordinator "
                           f"{self.coordinator} ended before the next commit, where it would have joined); "
                           f"exiting with status 0")
                print(message, file=sys.stderr, flush=True)
                raise job_state.JobFinished(message)
            if kind not in (FORMED, WELCOME):
                continue
            change = self._adopt(message.meta)
            if kind == FORMED:
                return Admission(change)
            return Admission(change, True, message.meta.get("state"), list(message.buffers))

    def _form(self) -> Admission:
        """The coordinator: wait for every member's hello, then tell them the first generation."""
        expected = [t for t in self._world if t != self.task]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while any(t not in self._hellos for t in expected):
            if deadline is not None and time.monotonic() > deadline:
                missing = ", ".join(str(t) for t in expected if t not in self._hellos)
                raise TransportTimeout(f"{self.task}: no hello from {missing} within {self.timeout:g} s while "
                                       f"forming the elastic world {self.name!r} (are they running?)")
            self._drain(_REFORM_POLL)
        incarnations = {self.task: self.incarnation, **{t: self._hellos.pop(t) for t in expected}}
        meta = _decision_meta(FORMED, 0, self._world, incarnations)
        for task in expected:
            self._send(task, meta, quiet=True)
        self._start_generation(0, self._world, incarnations)
        return Admission(WorldChange(0, tuple(self._world)))

    # -- commits -----------------------------------------------------------------------------------
    def sync_point(self) -> bool:
        """The all-reduce every member makes at a commit: True if the world must change now (a
        restarted task waits to join). Raises ``WorldChangedError`` if a member is lost."""
        flag = 0
        if self.is_coordinator:
            restarted, waiting = self._look_for_newcomers()
            if restarted:
                self._lost.update(restarted)
                self._abort_generation(restarted)
                raise WorldChangedError(f"{', '.join(map(str, restarted))} started again as a new process: "
                                        f"its old process is gone", lost=restarted)
            flag = int(waiting)
        return bool(self.allreduce(np.array([flag], np.int64), op="max")[0])

    def _look_for_newcomers(self) -> tuple[list[TaskId], bool]:
        """The coordinator: (members whose task said hello from a new process, whether anyone waits)."""
        self._drain(0)
        current = self._incarnations
        restarted = [t for t, inc in self._hellos.items() if t in current and current[t] != inc]
        return restarted, bool(self._hellos)

    def _abort_generation(self, lost: list[TaskId]) -> None:
        """The coordinator: tell every other member to leave this generation (it learned of ``lost``)."""
        s = self._session
        meta = {"abort": "lost", "origin": s.rank, "task": str(lost[0]), "fp": {"gen": s.generation},
                "reason": f"{lost[0]} started again as a new process"}
        for task in s.members:
            if task != self.task and task not in lost:
                self._send(task, meta, tag=s.tag, quiet=True)

    # -- re-forming --------------------------------------------------------------------------------
    def reform(self, commit: int, lost: Sequence[TaskId] = (),
               state_for: Callable[[int], tuple[dict, list]] | None = None) -> WorldChange:
        """Re-form the world after a ``WorldChangedError``: every member of the current generation
        that is still alive calls it, with the number of its latest commit; returns the new
        generation (``commit``: the one to roll back to). On the coordinator, ``state_for(commit)``
        gives the ``(meta, arrays)`` a newcomer receives (without it, nobody is admitted)."""
        if not self._formed:
            raise ConfigurationError(f"communicator {self.name!r} has not joined yet")
        self._lost.update(TaskId.parse(t) for t in lost)
        if self.is_coordinator:
            return self._decide(int(commit), state_for)
        report = {"elastic": REPORT, "gen": self.generation, "commit": int(commit),
                  "lost": sorted(str(t) for t in self._lost), "inc": self.incarnation}
        self._send(self.coordinator, report)
        while True:
            message = self._from_coordinator()
            kind, gen = message.meta.get("elastic"), message.meta.get("gen")
            if kind == DROPPED:
                raise CommunicationError(
                    f"{self.task} was left out of the elastic world {self.name!r} (its coordinator "
                    f"{self.coordinator} had found it lost); start it again to rejoin")
            if kind == DECISION and isinstance(gen, int) and gen > self.generation:
                return self._adopt(message.meta)

    def _decide(self, commit: int, state_for) -> WorldChange:
        """The coordinator's side of :meth:`reform`."""
        s = self._session
        gen, members = s.generation, list(s.members)
        others = [t for t in members if t != self.task]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            self._drain(0)
            restarted, _ = self._look_for_newcomers()
            self._lost.update(restarted)
            self._lost.update(t for t in self.transport.lost_peers() if t in others)
            for task, report in list(self._reports.items()):
                if report.get("gen") == gen and task in others:
                    self._lost.update(_tasks(report.get("lost")))
                elif task not in members:   # a task left out earlier, still trying: tell it
                    self._send(task, {"elastic": DROPPED, "gen": gen}, quiet=True)
                    del self._reports[task]
            self._lost.discard(self.task)
            reported = {t for t, r in self._reports.items() if r.get("gen") == gen and t in others}
            pending = [t for t in others if t not in self._lost and t not in reported]
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TransportTimeout(f"{self.task}: no report from {', '.join(map(str, pending))} within "
                                       f"{self.timeout:g} s while re-forming the elastic world {self.name!r}")
            self._drain(_REFORM_POLL)
        survivors = [t for t in members if t == self.task or (t in reported and t not in self._lost)]
        commits = [commit] + [int(self._reports[t].get("commit", commit)) for t in survivors if t != self.task]
        rollback = min(commits)
        joining = {t: inc for t, inc in self._hellos.items() if t not in survivors} if state_for else {}
        new_members = [t for t in self._world if t in survivors or t in joining]
        incarnations = {t: self._incarnations[t] for t in survivors}
        incarnations.update(joining)
        lost = [t for t in members if t not in survivors]
        meta = _decision_meta(DECISION, gen + 1, new_members, incarnations, rollback, lost, list(joining))
        for task in survivors:
            if task != self.task:
                self._send(task, meta, quiet=True)
        for task in reported - set(survivors):
            self._send(task, {"elastic": DROPPED, "gen": gen + 1}, quiet=True)
        if joining:
            state, buffers = state_for(rollback)
            for task in joining:
                self._send(task, {**meta, "elastic": WELCOME, "state": state}, buffers, quiet=True)
                del self._hellos[task]
        self._reports = {t: r for t, r in self._reports.items() if not isinstance(r.get("gen"), int)
                         or r["gen"] > gen}
        return self._adopt(meta)

    def _adopt(self, meta: dict) -> WorldChange:
        """Start the generation a FORMED, WELCOME or DECISION message describes."""
        try:
            gen = int(meta["gen"])
            pairs = [(TaskId.parse(task), str(inc)) for task, inc in meta["members"]]
            change = WorldChange(gen, tuple(t for t, _ in pairs), tuple(_tasks(meta.get("lost"))),
                                 tuple(_tasks(meta.get("joined"))), meta.get("commit"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CommunicationError(f"{self.task}: malformed membership from {self.coordinator}: {exc}") from None
        incarnations = dict(pairs)
        if incarnations.get(self.task) != self.incarnation:
            raise CommunicationError(f"{self.task}: the coordinator's new world {self.name!r} does not "
                                     f"list this process")
        self._start_generation(gen, list(change.members), incarnations)
        self._meet_newcomers(change)
        return change

    def _meet_newcomers(self, change: WorldChange) -> None:
        """Before the first collective of a generation, every member hears from each newcomer.

        A member's transport may still hold the newcomer's task as lost (its old process died) and
        would refuse to send to it until the new process has connected; a newcomer therefore greets
        every member first, and a member waits for the greeting of each (its transport has accepted
        the new process by then). A newcomer lost meanwhile is left to the first collective to find.
        """
        joined = [t for t in change.joined if t in change.members]
        if self.task in joined:
            for task in change.members:
                if task != self.task:
                    self._send(task, {"elastic": PRESENT, "inc": self.incarnation}, quiet=True)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for task in joined:
            if task == self.task:
                continue
            losses = self.transport.peer_losses(task)
            try:
                while task in self.transport.lost_peers():   # until its new process has connected
                    if self.transport.peer_losses(task) != losses:
                        raise PeerLostError(task, "its new process died too")
                    if deadline is not None and time.monotonic() > deadline:
                        raise TransportTimeout(f"no connection from the new process of {task}")
                    time.sleep(_REFORM_POLL / 5)
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                self.transport.recv(task, self._tag, timeout=remaining)
            except (PeerLostError, TransportTimeout) as exc:
                log.warning("%s: %s did not greet the members of generation %d: %s", self.task, task,
                            change.generation, exc)

    def _start_generation(self, gen: int, members: list[TaskId], incarnations: dict) -> None:
        old = self._session
        self._session = CollectiveSession(
            self.transport, members, members.index(self.task), name=old.name, timeout=old.timeout,
            chunk_bytes=old.chunk_bytes, small_bytes=old.small_bytes, generation=gen)
        self._incarnations = dict(incarnations)   # each member's process, as the coordinator admitted it
        self._lost = set()
        self._formed = True

    # -- collectives: a lost member changes the world ------------------------------------------------
    def _call(self, collective: str, x, **kwargs):
        if not self._formed:
            raise ConfigurationError(f"elastic communicator {self.name!r}: call join() before any collective")
        try:
            return super()._call(collective, x, **kwargs)
        except PeerLostError as exc:
            raise self._changed(exc) from exc

    def _changed(self, exc: PeerLostError) -> Exception:
        task = TaskId.parse(exc.task) if isinstance(exc.task, (str, TaskId)) else None
        if task is None or task == self.coordinator:
            job_state.leave_if_finished(self.task, str(exc))   # its chief ended normally: not a loss
            return PeerLostError(exc.task, f"{exc}; it coordinates the elastic world {self.name!r}, which "
                                           f"cannot go on without it (restart the job, e.g. from a checkpoint)")
        self._lost.add(task)
        return WorldChangedError(f"{task} was lost ({exc}): the members must re-form the world (reform()); "
                                 f"under the mirrored strategy with on_failure='shrink' that happens when the "
                                 f"training loop runs inside strategy.elastic(fn)", lost=[task])

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Also tells the processes still waiting to join that the job is over (coordinator)."""
        if self._formed and self.is_coordinator and not self._closed:
            try:
                self._drain(0)
                for task in list(self._hellos):
                    self._send(task, {"elastic": FINISHED}, quiet=True, timeout=NOTICE_TIMEOUT)
                self._hellos.clear()
            except Exception as exc:  # noqa: BLE001 - closing goes on
                log.debug("%s: could not tell the waiting tasks that the job is over: %s", self.task, exc)
        super().close()

    # -- the control tag ---------------------------------------------------------------------------
    def _send(self, task: TaskId, meta: dict, buffers: Sequence = (), *, tag: str | None = None,
              quiet: bool = False, timeout: float | None = None) -> None:
        """Send on the control tag (or ``tag``); ``quiet``: a peer that is gone now is not an error
        (the next generation's first collective finds it)."""
        try:
            self.transport.send(task, tag or self._tag, Message(meta, list(buffers)),
                                timeout=self.timeout if timeout is None else timeout)
        except (PeerLostError, TransportTimeout) as exc:
            if not quiet:
                if task == self.coordinator and isinstance(exc, PeerLostError):
                    raise self._changed(exc) from exc
                raise
            log.debug("%s: could not send %s to %s: %s", self.task, meta.get("elastic"), task, exc)

    def _from_coordinator(self, timeout: float | None = None) -> Message:
        try:
            return self.transport.recv(self.coordinator, self._tag,
                                       timeout=self.timeout if timeout is None else timeout)
        except PeerLostError as exc:
            raise self._changed(exc) from exc

    def _drain(self, timeout: float) -> None:
        """The coordinator: file every control message that arrives within ``timeout`` seconds."""
        while True:
            try:
                message = self.transport.recv(None, self._tag, timeout=timeout)
            except TransportTimeout:
                return
            timeout = 0
            meta, src = message.meta, message.src
            kind = meta.get("elastic")
            if src not in self._world or not isinstance(meta.get("inc"), str):
                log.warning("%s: ignored a malformed %r message from %s on %s", self.task, kind, src, self._tag)
            elif kind == HELLO:
                self._hellos[src] = meta["inc"]
            elif kind == REPORT:
                self._reports[src] = meta
            elif kind == PRESENT:
                pass   # a newcomer's greeting that _meet_newcomers did not wait for (it had joined already)
            else:
                log.warning("%s: ignored an unexpected %r message from %s on %s", self.task, kind, src, self._tag)


def _decision_meta(kind: str, gen: int, members: list[TaskId], incarnations: dict, commit: int | None = None,
                   lost: Sequence[TaskId] = (), joined: Sequence[TaskId] = ()) -> dict:
    return {"elastic": kind, "gen": gen, "members": [[str(t), incarnations[t]] for t in members],
            "commit": commit, "lost": [str(t) for t in lost], "joined": [str(t) for t in joined]}


def _tasks(names) -> list[TaskId]:
    if not isinstance(names, list):
        return []
    tasks = []
    for name in names:
        try:
            tasks.append(TaskId.parse(name))
        except (TypeError, ValueError, ConfigurationError):
            continue
    return tasks

