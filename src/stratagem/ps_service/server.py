"""The parameter server: what a ``ps`` task runs (README: "Parameter servers").

A :class:`ParameterServer` holds the pieces of the variables placed on its task, the optimizer that
updates them (rebuilt on the server from ``opt.get_config()``, with its slots kept here), and a step
counter: the number of updates applied on this shard (``ps:0``'s is the job's *global step*). It
answers requests (:mod:`stratagem.ps_service.protocol`) one at a time, from one thread, so every update
is atomic; the shards of a job serve in parallel, one process each.

How a push is applied depends on the job's mode:

- ``async``: at once, and acknowledged at once.
- ``sync``: the gradients for the shard's current step are summed (weighted by each replica's share of
  the batch) until ``replicas_to_aggregate`` replicas have pushed; then their weighted mean is applied,
  the step advances and every contributor gets its acknowledgement (replies with values take turns
  on the ps's link, in the order the pushes came: :mod:`stratagem.ps_service.turns`, as do the
  replies to pulls in a sync job). A push for an older step is
  dropped (``status: "dropped"``) and counted. With more replicas than ``replicas_to_aggregate``, the
  slowest ones are *backup workers*: their late gradients are dropped instead of holding the others up.
- ``bounded`` (``staleness=s``): applied at once, but ``ps:0`` keeps every replica's count of pushes (its
  *clock*) and holds the acknowledgement of a replica more than ``s`` pushes ahead of the slowest
  active one, until the slowest catches up.

Replies carry the values by reference and are not waited for. An update is written over the pushed
gradient, which becomes the piece's array, when the optimizer's rule allows it (SGD, Adam, Adagrad:
:func:`~stratagem.ps_service.buffers.takes_over`), so the array a reply sends is never written again;
otherwise an update that finds a piece's array still being sent writes the new version into another
array of the piece (:mod:`stratagem.ps_service.buffers`). Either way a reply carries one version of
every piece, never a torn mix.

Embedding tables move by rows (:mod:`stratagem.ps_service.rows`): ``pull_rows`` answers just the asked
rows (new arrays, gathered), a push may carry row gradients (int64 rows of a piece and their gradient
rows, checked), and a push's reply leaves out the pieces the requester reads by rows (``skip``). A
row gradient updates just those rows when the optimizer is ``sparse_exact`` (plain SGD, Adagrad: the
dense update's result), else it is densified here and the dense update runs. A ``sync`` round sums
row gradients as rows (the dense weighted mean, bit for bit).

A push is applied before it is acknowledged, so an acknowledged push is never lost; the counters
(:meth:`ParameterServer.stats`) let a test check that updates applied equal pushes acknowledged.

The server stops when every replica (the ``chief`` and ``worker`` tasks) has said goodbye or is gone,
or ``linger`` seconds after the chief said goodbye. It raises if the chief disappeared without saying
goodbye, or if a replica left with an error, so that a failed job fails on its ps tasks too. From the
moment a replica leaves with an error (its script raised), the job has failed: every later request,
and every push still waiting for its sync round or staleness bound, gets that error, naming the
replica, so the other replicas stop at once instead of training on without it.

Serving two pieces over the in-process transport (the client side is
:class:`~stratagem.ps_service.client.PSClient`)::

    >>> import threading
    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.ps_service.client import PSClient
    >>> from stratagem.ps_service.messages import PushRequest
    >>> from stratagem.transports.local import LocalFabric, LocalTransport
    >>> cluster, fabric = ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), LocalFabric()
    >>> ps = LocalTransport(cluster, "ps:0", fabric=fabric); ps.start()
    >>> server = ParameterServer(ps, poll=0.05)
    >>> thread = threading.Thread(target=server.serve); thread.start()
    >>> worker = LocalTransport(cluster, "worker:0", fabric=fabric); worker.start()
    >>> client = PSClient(worker, timeout=10)
    >>> specs = [{"name": "w", "var": "w", "shape": [2], "dtype": "float32", "part": 0, "parts": 1, "lo": 0, "hi": 2}]
    >>> _ = client.init({0: specs}, {0: [np.ones(2, np.float32)]}, {"mode": "async", "pushers": ["worker:0"]})
    >>> client.set_optimizer({"name": "SGD", "learning_rate": 0.5})
    >>> request = PushRequest(); request.add("w", np.ones(2, np.float32))
    >>> client.push_all({0: request})[0].status
    'applied'
    >>> client.pull()[0].buffers[0], server.step
    (array([0.5, 0.5], dtype=float32), 1)
    >>> client.bye(); thread.join(5); worker.close(); ps.close()
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from stratagem.core.cluster import TaskId, host_of
from stratagem.core.errors import (
    CommunicationError,
    ConfigurationError,
    JobFailedError,
    TransportClosed,
    TransportTimeout,
)
from stratagem.training.optimizers.rules import from_config
from stratagem.ps_service.compressed import expand_pieces
from stratagem.ps_service.buffers import PieceValues, ReplyBuffers
from stratagem.ps_service.consistency import StalenessGate, SyncRound
from stratagem.ps_service.messages import PushRequest
from stratagem.ps_service.rows import check_real, read_rows, row_gradients
from stratagem.ps_service.turns import PATIENCE_S, ReplyTurns
from stratagem.ps_service.protocol import (
    APPLIED,
    DROPPED,
    REPLY_TAG,
    REQUEST_TAG,
    STOPPED,
    RequestRefused,
    describe_spec,
    piece_shape,
    same_spec,
    spec_dtype,
    split_parts,
    task_key,
)
from stratagem.core.transport import Message, Transport

log = logging.getLogger(__name__)

#: Seconds between checks for replicas that are gone, while no request arrives.
DEFAULT_POLL = 0.1


class ParameterServer:
    """Serve this ps task's pieces of the variables until the job ends (see the module doc).

    Args:
        transport: this ps task's started transport.
        timeout: seconds a reply may take to send (default: the transport's).
        poll: seconds between checks for replicas that are gone.
        linger: seconds the server keeps serving after the chief said goodbye, for the replicas that
            have not (default: ``timeout``, else 60).
        compressor: the compressor that decompresses compressed pushes (the strategies'
            ``compression``); ``None`` refuses them.
        turn_patience: seconds (plus the reply's bytes at 1 MB/s) a sync job's large reply keeps its
            turn when its requester never says it received it (:mod:`stratagem.ps_service.turns`).
    """

    def __init__(self, transport: Transport, *, timeout: float | None = None, poll: float = DEFAULT_POLL,
                 linger: float | None = None, compressor=None, turn_patience: float = PATIENCE_S):
        if transport.task.job != "ps":
            raise ConfigurationError(f"a ParameterServer runs on a 'ps' task, not on {transport.task}")
        self.transport = transport
        self.task = transport.task
        self.cluster = transport.cluster
        self.timeout = timeout
        self.compressor = compressor
        self.poll = poll
        self.linger = linger if linger is not None else (timeout or transport.timeout or 60.0)
        #: Every task that may talk to this server: the replicas (chief and workers).
        self.members = {task_key(t) for t in self.cluster.replicas()}
        self.specs: dict[str, dict] = {}            # piece name -> spec, in creation order
        self.config: dict | None = None             # mode, replicas_to_aggregate, ..., pushers, clock
        self.optimizer = None
        self.optimizer_config: dict | None = None
        self._pending_state: dict | None = None     # optimizer state loaded before the optimizer came
        #: Updates applied on this shard (the global step on ps:0), also the version pulls report.
        self.step = 0
        self.ready = False
        #: The latest of the chief's ``restore()`` calls (counted from 1) loaded here: a non-chief
        #: task's own ``restore()`` waits for the chief's, so it never trains on replaced values.
        self.restores = 0
        self.stopping = False
        self.counters: Counter = Counter()
        self.by_replica: dict[str, Counter] = defaultdict(Counter)
        self._bye: dict[str, str | None] = {}       # replica -> None (clean) or its error
        #: The first replica that left with an error, and that error: the job has failed, and every
        #: later request is refused with it, so the other replicas stop at once, naming the culprit.
        self.failed: tuple[str, str] | None = None
        self._lost: set[str] = set()
        self._idle: set[str] = set()                # pushers with nothing to do (parameter_server)
        self._chief_bye_at: float | None = None
        self._round = SyncRound()
        self._gate: StalenessGate | None = None    # bounded, on the clock shard
        self._serving = False
        #: The value arrays unfinished replies read, and the spare arrays updates write into meanwhile.
        self.replies = ReplyBuffers(timeout if timeout is not None else transport.timeout)
        #: The pieces' arrays (piece name -> array), written only through it.
        self.values = PieceValues(self.replies)
        #: A sync job's replies with values, one at a time on this task's link (:meth:`_takes_turns`).
        self.turns = ReplyTurns(self._send, patience_s=turn_patience)
        here = host_of(self.cluster.address(self.task) or "")
        self._same_host = {task_key(t) for t in self.cluster.tasks() if host_of(self.cluster.address(t) or "") == here}

    # -- the loop ----------------------------------------------------------------------------------
    def serve(self) -> dict:
        """Answer requests until the job ends; return :meth:`stats`. Raises ``JobFailedError`` (a
        ``StratagemError``) naming the task to blame if the chief vanished without saying goodbye or a
        replica left with an error."""
        self._serving = True
        next_check = 0.0
        # The timeline records the time idle until each request as a wait on its sender: a worker
        # waiting on this task in sync mode is then seen waiting on the worker this task waits for.
        recorder = self.transport.recorder
        idle_since = recorder.now()
        try:
            while True:
                try:
                    message = self.transport.recv(None, REQUEST_TAG, timeout=self.poll)
                except TransportTimeout:
                    message = None
                except TransportClosed:
                    break
                if message is not None:
                    started = recorder.now()
                    recorder.wait(message.src, REQUEST_TAG, idle_since, started, idle=True)
                    self.handle(message)
                    recorder.record("serve", str(message.meta.get("op")), started, _describe_request, message)
                    idle_since = recorder.now()
                now = time.monotonic()
                if message is None or now >= next_check:
                    next_check = now + self.poll
                    if self._check_members(now):
                        break
                    self.turns.check(self.transport.lost_peers())
        finally:
            self._serving = False
            self.turns.flush()
            # The last replies may still be going out: let them finish before the transport closes.
            self.replies.wait_all(self.linger)
        failure = self._failure()
        if failure:
            # JobFailedError carries the task to blame to the launcher (core/failures.py), which would
            # otherwise name this ps task: the replica that failed first, or the chief that vanished.
            culprit = TaskId.parse(self.failed[0]) if self.failed is not None else self.cluster.chief
            raise JobFailedError(culprit, f"{self.task}: {failure}")
        return self.stats()

    def handle(self, message: Message) -> None:
        """Answer one request (errors go back to the requester; the server keeps serving)."""
        meta, src = message.meta, message.src
        op, request_id = meta.get("op"), meta.get("id")
        if op == "received":     # a requester has its reply: the next one's turn (no answer)
            self.turns.received(src, request_id)
            return
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        who = task_key(src)
        if who in self._bye and op != "bye":
            del self._bye[who]  # a new incarnation of a replica that had left
        self.replies.prune()
        try:
            if handler is None:
                raise RequestRefused(f"unknown operation {op!r}")
            if self.failed is not None and op not in ("bye", "stats"):
                raise RequestRefused(self._failed_text(), culprit=self.failed[0])
            result = handler(src, request_id, meta, message.buffers)
        except (RequestRefused, ConfigurationError) as exc:
            culprit = getattr(exc, "culprit", None)
            self._send(src, {"id": request_id, "error": str(exc), "error_type": "RemoteError",
                             **({"culprit": culprit} if culprit else {})})
            return
        except Exception as exc:  # noqa: BLE001 - a bad request must never take the server down
            log.exception("%s: error while handling %r from %s", self.task, op, src)
            self._send(src, {"id": request_id, "error": f"{type(exc).__name__}: {exc}", "error_type": "RemoteError"})
            return
        if result is not None:
            reply_meta, buffers = result
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, buffers)

    def _send(self, dst: TaskId, meta: dict, buffers=()) -> list:
        """Send a reply now; one whose buffers are the values of ``meta["names"]`` goes in parts.
        Returns the sends' handles (none if the requester is gone)."""
        buffers = list(buffers)
        names = meta.get("names")
        if not buffers or not isinstance(names, list) or len(names) != len(buffers):
            handle = self._send_part(dst, meta, buffers)
            return [] if handle is None else [handle]
        groups = split_parts([b.nbytes for b in buffers])
        handles = []
        for k, group in enumerate(groups):
            part = {"id": meta.get("id"), "names": [names[i] for i in group], "part": k, "parts": len(groups)}
            if k == len(groups) - 1:
                part = {**meta, **part}
            handle = self._send_part(dst, part, [buffers[i] for i in group])
            if handle is None:
                return []
            handles.append(handle)
        return handles

    def _takes_turns(self, dst: TaskId) -> bool:
        """Whether a reply with values to ``dst`` takes its turn: in a sync job, to a task on another
        host than this one (the same host in the cluster spec: loopback is not the link), when at
        least two pushers are on other hosts (one alone has nobody to take turns with, and the word
        ``received`` would cost it a message a step)."""
        if self.config is None or self.config["mode"] != "sync" or task_key(dst) in self._same_host:
            return False
        return sum(1 for p in self.config.get("pushers") or () if p not in self._same_host) >= 2

    def _reply(self, dst: TaskId, meta: dict, buffers=()) -> None:
        """Send a reply with values: in its turn where :meth:`_takes_turns`
        (:mod:`stratagem.ps_service.turns`), its arrays kept from updates until it is sent; else at
        once."""
        if not self._takes_turns(dst):
            self._send(dst, meta, buffers)
            return
        sent = self.turns.reply(dst, meta, buffers)
        if not isinstance(sent, list):
            self.replies.sent(sent, list(buffers))

    def _send_part(self, dst: TaskId, meta: dict, buffers: list):
        """Send one message of a reply; its handle, or None if the requester is gone."""
        # Not waited for: the server goes on with the next request while the transport still reads
        # the value arrays, and ``self.replies`` keeps the next update out of them. (A blocking send
        # held the server idle for the whole transfer; copying the values into the reply instead
        # cost a full pass over them.)
        try:
            handle = self.transport.send_async(dst, REPLY_TAG, Message(meta, buffers), timeout=self.timeout)
        except CommunicationError as exc:  # the requester is gone: what it asked for stays done
            log.warning("%s: could not answer %s: %s", self.task, dst, exc)
            return None
        self.replies.sent(handle, buffers)
        return handle

    # -- membership --------------------------------------------------------------------------------
    def _check_members(self, now: float) -> bool:
        """Update who is gone; True when the server should stop."""
        lost = {task_key(t) for t in self.transport.lost_peers()} & self.members
        newly = lost - self._lost
        self._lost = lost
        newly -= set(self._bye)
        if newly:
            log.warning("%s: replica(s) %s are gone", self.task, ", ".join(sorted(newly)))
            self._membership_changed()
        finished = set(self._bye) | self._lost
        if self.members <= finished:
            return True
        return self._chief_bye_at is not None and now - self._chief_bye_at >= self.linger

    def _active_pushers(self) -> list[str]:
        pushers = self.config.get("pushers", []) if self.config else []
        return [p for p in pushers if p not in self._bye and p not in self._lost and p not in self._idle]

    def _membership_changed(self) -> None:
        if self.config is None:
            return
        if self.config["mode"] == "sync":
            self._maybe_finish_round()
        elif self.config["mode"] == "bounded":
            self._release_held()

    def _failure(self) -> str | None:
        chief = task_key(self.cluster.chief)
        if self.failed is not None:
            others = sorted(who for who, error in self._bye.items() if error and who != self.failed[0])
            return self._failed_text() + (f" (then {', '.join(others)} stopped too)" if others else "")
        if chief in self._lost and chief not in self._bye:
            return (f"the chief {self.cluster.chief} disappeared before training ended; restart the job "
                    f"(the chief restores the latest checkpoint)")
        return None

    # -- operations ----------------------------------------------------------------------------------
    def _op_hello(self, src, request_id, meta, buffers):
        return self._status(), []

    def _status(self) -> dict:
        return {"ready": self.ready, "step": self.step, "stop": self.stopping, "pieces": len(self.specs),
                "configured": self.config is not None, "restores": self.restores}

    def _op_init(self, src, request_id, meta, buffers):
        specs, config = meta.get("vars") or [], meta.get("config")
        if not isinstance(config, dict) or config.get("mode") not in ("async", "sync", "bounded"):
            raise RequestRefused(f"init needs the consistency settings, got {config!r}")
        if self.config is not None and _settings(self.config) != _settings(config):
            raise RequestRefused(
                f"{src} asks for {_settings(config)} but the job runs with {_settings(self.config)}; "
                f"start every task with the same strategy options"
            )
        if len(buffers) != len(specs):
            raise RequestRefused(f"init: {len(specs)} piece(s) but {len(buffers)} value(s)")
        for spec, value in zip(specs, buffers):
            self._check_value(spec, value, "initial value")
        created, existing = [], []
        for spec, value in zip(specs, buffers):
            name = spec["name"]
            if name in self.specs:
                if not same_spec(self.specs[name], spec):
                    raise RequestRefused(
                        f"piece {name!r} exists on {self.task} as {describe_spec(self.specs[name])}, "
                        f"{src} declares it as {describe_spec(spec)}: every task must create the same "
                        f"variables with the same placement"
                    )
                existing.append(name)
                continue
            self.specs[name] = dict(spec)
            self.values.create(name, value, spec_dtype(spec))
            created.append(name)
        self.config = dict(config)
        return {"created": created, "existing": existing, **self._status()}, []

    def _check_value(self, spec: dict, value, what: str) -> None:
        shape = piece_shape(spec)
        if tuple(value.shape) != shape:
            raise RequestRefused(f"{what} of piece {spec['name']!r} has shape {tuple(value.shape)}, expected {shape}")

    def _op_ready(self, src, request_id, meta, buffers):
        self.ready = True
        return self._status(), []

    def _op_catalog(self, src, request_id, meta, buffers):
        return {"vars": list(self.specs.values()), "config": self.config, **self._status()}, []

    def _op_pull(self, src, request_id, meta, buffers):
        names = self._names(meta.get("names"))
        self.counters["pulls"] += 1
        # In a sync job the pulls of a round come together (a parameter_server worker pulls when its
        # step starts): their replies take turns, as a round's do.
        self._reply(src, {"id": request_id, "ok": True, "names": names, **self._status()},
                    [self.values[n] for n in names])

    def _op_pull_rows(self, src, request_id, meta, buffers):
        """Rows of the named pieces: ``buffers[i]`` are the rows of ``names[i]`` (counted from the
        piece's first row); the reply's arrays are new, so no update waits for them."""
        names = self._names(meta.get("names") or [])
        rows = read_rows(names, buffers, [piece_shape(self.specs[n]) for n in names], [self.values[n] for n in names])
        self.counters["row_pulls"] += 1
        return {"names": names, **self._status()}, rows

    def _names(self, names) -> list[str]:
        if names is None:
            return list(self.specs)
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise RequestRefused(f"{self.task} holds no piece {', '.join(map(repr, unknown))}; it holds "
                                f"{', '.join(map(repr, self.specs)) or 'none'}")
        return list(names)

    def _op_assign(self, src, request_id, meta, buffers):
        names = self._names(meta.get("names") or [])
        if len(names) != len(buffers):
            raise RequestRefused(f"assign: {len(names)} name(s) but {len(buffers)} value(s)")
        for name, value in zip(names, buffers):
            self._check_value(self.specs[name], value, "the assigned value")
        for name, value in zip(names, buffers):
            self.values.assign(name, value)
        return self._status(), []

    def _op_optimizer(self, src, request_id, meta, buffers):
        config = meta.get("config")
        if self.optimizer_config is not None:
            if config != self.optimizer_config:
                raise RequestRefused(
                    f"{src} uses optimizer {config!r} but the job's is {self.optimizer_config!r}; use one "
                    f"optimizer, with the same settings, on every task"
                )
            return self._status(), []
        optimizer = from_config(config)
        if self._pending_state is not None:
            optimizer.load_state_dict(self._pending_state)
            self._pending_state = None
        self.optimizer, self.optimizer_config = optimizer, dict(config)
        return self._status(), []

    def _op_snapshot(self, src, request_id, meta, buffers):
        names = list(self.specs)
        state = self.optimizer.state_dict() if self.optimizer is not None else self._pending_state
        slots = {}
        arrays = [self.values[n] for n in names]
        if state is not None:
            for name in names:
                held = state["slots"].get(name)
                if held:
                    slots[name] = sorted(held)
                    arrays.extend(np.asarray(held[s]) for s in slots[name])
        iterations = int(state["iterations"]) if state is not None else 0
        return {"vars": [self.specs[n] for n in names], "slots": slots, "iterations": iterations,
                "optimizer": self.optimizer_config, **self._status()}, arrays

    def _op_load(self, src, request_id, meta, buffers):
        names = self._names(meta.get("names") or [])
        slots = meta.get("slots") or {}
        expected = len(names) + sum(len(v) for v in slots.values())
        if len(buffers) != expected:
            raise RequestRefused(f"load: expected {expected} array(s), got {len(buffers)}")
        for name, value in zip(names, buffers):
            self._check_value(self.specs[name], value, "the checkpoint value")
        for name, value in zip(names, buffers):
            self.values.assign(name, value)
        rest = iter(buffers[len(names):])
        state_slots = {}
        for name, slot_names in slots.items():
            if name not in self.specs:
                raise RequestRefused(f"load: optimizer state for unknown piece {name!r}")
            state_slots[name] = {s: np.array(next(rest), copy=True) for s in slot_names}
        state = {"iterations": int(meta.get("iterations") or 0), "slots": state_slots}
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state)
        else:
            self._pending_state = state
        self.step = int(meta.get("step") or 0)
        self._drop_round()
        if isinstance(meta.get("restore"), int):
            self.restores = max(self.restores, meta["restore"])
        return self._status(), []

    def _op_stop(self, src, request_id, meta, buffers):
        if not self.stopping:
            self.stopping = True
            self._stop_waiters()
        return self._status(), []

    def _op_bye(self, src, request_id, meta, buffers):
        who = task_key(src)
        error = meta.get("error")
        self._bye[who] = str(error) if error else None
        if error and self.failed is None:
            self.failed = (who, str(error))
            log.error("%s: %s", self.task, self._failed_text())
            self._fail_waiters(self._failed_text(), culprit=who)
        if src == self.cluster.chief:
            self._chief_bye_at = time.monotonic()
        self._membership_changed()
        return self._status(), []

    def _failed_text(self) -> str:
        who, error = self.failed
        return (f"training failed: {who} failed: {error}; the job stops (fix the error and restart it: "
                f"the chief restores the latest checkpoint)")

    def _op_idle(self, src, request_id, meta, buffers):
        """The coordinator says these pushers have no closure to run (``idle``), or have one again: a
        sync round or a staleness bound does not wait for idle pushers."""
        tasks = {str(t) for t in meta.get("tasks") or []}
        if meta.get("idle", True):
            self._idle |= tasks
        else:
            self._idle -= tasks
        self._membership_changed()
        return self._status(), []

    def _op_stats(self, src, request_id, meta, buffers):
        return {"stats": self.stats()}, []

    def stats(self) -> dict:
        """Counters: ``pushes`` received, ``applied`` (pushes whose gradients reached an update),
        ``dropped`` (stale, sync), ``stopped`` (after stop), ``updates`` (optimizer steps), ``pulls``,
        ``row_pulls``;
        ``by_replica`` the same per replica; ``turns`` the reply turns' counters and ``queued`` the
        replies waiting for theirs (:class:`~stratagem.ps_service.turns.ReplyTurns`); ``step``; ``clocks`` and ``max_gap`` (bounded)."""
        counters = {key: 0 for key in ("pushes", APPLIED, DROPPED, STOPPED, "updates", "pulls", "row_pulls")}
        counters.update((k, int(v)) for k, v in self.counters.items())
        return {**counters, "step": self.step, "turns": dict(self.turns.counters), "queued": self.turns.queued,
                "by_replica": {k: dict(v) for k, v in self.by_replica.items()},
                "clocks": dict(self._gate.clocks) if self._gate else {},
                "max_gap": self._gate.max_gap if self._gate else 0, "pieces": list(self.specs)}

    # -- pushes: checks, the consistency modes, the update, the acknowledgements ---------------------
    def _op_push(self, src, request_id, meta, buffers):
        who = task_key(src)
        if who not in self.members:          # an evaluator (or a ps task) never trains
            raise RequestRefused(f"{src} is not a replica ('chief' or 'worker' task): it may read the "
                                 f"variables but not push gradients")
        if self.config is None:
            raise RequestRefused(f"{self.task} has no variables yet: the chief must create them first")
        if self.optimizer is None:
            raise RequestRefused(f"{self.task} has no optimizer: send the optimizer's config first")
        request = PushRequest.parse(meta, buffers)
        names, buffers = self._gradients(request)
        pull = request.skip if request.pull else None   # None: no values back; else the pieces to leave out
        self._idle.discard(who)
        self.counters["pushes"] += 1
        self.by_replica[who]["pushes"] += 1
        if self.stopping:
            return self._count(who, STOPPED, pull)
        mode = self.config["mode"]
        if mode == "sync":
            version = request.version
            if not isinstance(version, int) or version < self.step:
                return self._count(who, DROPPED, pull)
            if version > self.step:
                raise RequestRefused(f"push for step {version}, but {self.task} is at step {self.step}")
            weight = request.weight
            self._round.add(who, names, buffers, weight, (src, request_id, pull))
            self._maybe_finish_round()
            return None  # answered when the round completes
        if mode == "async" and pull is not None and len(set(names)) == len(names):
            self._apply(names, buffers, stream=(src, request_id, pull))
            return None  # answered part by part
        self._apply(names, buffers)
        self.counters["updates"] += 1
        if mode == "bounded" and self.config.get("clock") == task_key(self.task):
            if self._gate is None:
                self._gate = StalenessGate(self.config["staleness"])
            self._gate.pushed(who, (src, request_id, pull))
            self._release_held()
            return None
        return self._count(who, APPLIED, pull)

    def _gradients(self, request: PushRequest) -> tuple[list[str], list]:
        """A push's pieces and gradients, checked: first the dense ones, then the row gradients as
        :class:`~stratagem.training.sparse.IndexedSlices`. Compressed dense gradients are decompressed
        first (:mod:`stratagem.ps_service.compressed`)."""
        names = self._names(request.names)
        rows = self._names(request.row_names)
        dense = request.dense
        if request.compression is not None:
            dense = expand_pieces(self.compressor, self.task, request.compression, [self.specs[n] for n in names],
                                  dense)
        if len(dense) != len(names):
            raise RequestRefused(f"push: {len(names)} name(s) but {len(dense)} gradient(s)")
        for name, grad in zip(names, dense):
            self._check_value(self.specs[name], grad, "the gradient")
            check_real(name, grad)
        sparse = row_gradients(rows, [piece_shape(self.specs[n]) for n in rows], request.row_buffers)
        return names + rows, list(dense) + sparse

    def _reply_pieces(self, want: frozenset | None) -> list[str]:
        return [] if want is None else [n for n in self.specs if n not in want]

    def _count(self, who: str, status: str, pull: frozenset | None, extra: dict | None = None):
        """Count an acknowledgement; its reply. ``pull``: what the reply carries (``None``: no values; else the pieces to leave out)."""
        self.counters[status] += 1
        self.by_replica[who][status] += 1
        names = self._reply_pieces(pull) if status != STOPPED else []
        return ({"status": status, "names": names, **(extra or {}), **self._status()},
                [self.values[n] for n in names])

    def _apply(self, names: list[str], grads: list, stream: tuple | None = None) -> None:
        """One optimizer step over ``names`` (no names: the step still counts, as for every shard).

        ``stream``: ``(src, request_id, want)`` of an ``async`` push that asks for the values back
        (``want``: the pieces it leaves out). Its reply goes in parts, each as soon as its pieces are
        updated, so that the update of the next part overlaps the transfer of this one; no other
        request is handled in between, so every part carries the values of this step, as one reply
        would. Pieces the reply leaves out are updated first."""
        recorder, optimizer, values = self.transport.recorder, self.optimizer, self.values
        started = recorder.now()
        optimizer.iterations += 1
        if stream is None:
            for name, grad in zip(names, grads):
                values.update(optimizer, name, grad)
            self.step += 1
            recorder.record("optimizer", "optimizer", started, _describe_pieces, names)
            return
        src, request_id, want = stream
        pieces = self._reply_pieces(want)
        grad_of = dict(zip(names, grads))
        groups = [[pieces[i] for i in group] for group in split_parts([values[n].nbytes for n in pieces])]
        sent = set(pieces)
        for name, grad in grad_of.items():
            if name not in sent:
                values.update(optimizer, name, grad)
        sending = True
        for k, group in enumerate(groups):
            for name in group:
                if name in grad_of:
                    values.update(optimizer, name, grad_of[name])
            if sending and k < len(groups) - 1:
                # A requester that is gone gets no more parts; the update still completes.
                sending = self._send_part(src, {"id": request_id, "names": group, "part": k, "parts": len(groups)},
                                          [values[n] for n in group]) is not None
        self.step += 1
        self.counters["updates"] += 1
        recorder.record("optimizer", "optimizer (reply streamed)", started, _describe_pieces, names)
        reply_meta, _ = self._count(task_key(src), APPLIED, None)
        if sending:
            last = {"names": groups[-1], "part": len(groups) - 1, "parts": len(groups)}
            self._send_part(src, {"id": request_id, "ok": True, **reply_meta, **last},
                            [values[n] for n in groups[-1]])

    # -- sync rounds
    def _maybe_finish_round(self) -> None:
        round_ = self._round
        if not round_.count:
            return
        needed = min(self.config["replicas_to_aggregate"], max(1, len(self._active_pushers())))
        if round_.count < needed:
            return
        self._round = SyncRound()
        names, grads = round_.mean()
        self._apply(names, grads)
        self.counters["updates"] += 1
        with self.turns.together():
            for (src, request_id, pull), who in round_.waiters:     # in the order the pushes came
                reply_meta, values = self._count(who, APPLIED, pull)
                self._reply(src, {"id": request_id, "ok": True, **reply_meta}, values)

    def _drop_round(self) -> None:
        """A load replaced the values: the pending sync round's pushes were made on the old ones, so
        each is answered ``dropped`` (its replica reads the new values and goes on), none applied."""
        round_, self._round = self._round, SyncRound()
        with self.turns.together():
            for (src, request_id, pull), who in round_.waiters:
                reply_meta, values = self._count(who, DROPPED, pull)
                self._reply(src, {"id": request_id, "ok": True, **reply_meta}, values)

    # -- the staleness bound (bounded)
    def _release_held(self) -> None:
        if self._gate is None or not self._gate.held:
            return
        for (src, request_id, pull), who, clock, floor in self._gate.releasable(self._active_pushers()):
            reply_meta, values = self._count(who, APPLIED, pull, {"clock": clock, "min_clock": floor})
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)

    def _fail_waiters(self, error: str, culprit: str | None = None) -> None:
        """The job failed: every push still waiting (held by the staleness bound, or in a pending sync
        round, whose gradients are discarded) gets ``error`` instead of its acknowledgement."""
        waiting = [waiter for waiter, *_ in self._gate.release_all()] if self._gate is not None else []
        round_, self._round = self._round, SyncRound()
        waiting += [waiter for waiter, _ in round_.waiters]
        for src, request_id, _ in waiting:
            self._send(src, {"id": request_id, "error": error, "error_type": "RemoteError",
                             **({"culprit": culprit} if culprit else {})})
        self.turns.flush()          # the replies still waiting for their turn go now

    def _stop_waiters(self) -> None:
        """On stop: held bounded replies go out (their pushes were applied), and so do replies waiting
        for their turn; a pending sync round is discarded (its pushes were not)."""
        if self._gate is not None:
            for (src, request_id, pull), who, clock in self._gate.release_all():
                reply_meta, values = self._count(who, APPLIED, pull, {"clock": clock})
                self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)
        round_, self._round = self._round, SyncRound()
        for (src, request_id, pull), who in round_.waiters:
            reply_meta, values = self._count(who, STOPPED, pull)
            self._send(src, {"id": request_id, "ok": True, **reply_meta}, values)
        self.turns.flush()


def _settings(config: dict) -> dict[str, Any]:
    keys = ("mode", "replicas_to_aggregate", "total_replicas", "staleness")
    return {k: config.get(k) for k in keys}


def _describe_request(message) -> dict:
    """A request served, on the timeline: who sent it, and its bytes."""
    return {"peer": str(message.src), "bytes_received": message.nbytes}


def _describe_pieces(names: list) -> dict:
    """An update on the timeline: the pieces it changed."""
    return {"pieces": len(names)}
