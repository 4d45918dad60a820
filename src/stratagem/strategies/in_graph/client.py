"""The ``in_graph`` client's step engine: its replicas, and one step over them.

A step attempt (:meth:`Client.step`): split the batch over the live replicas (``np.array_split``'s
rule), send each remote replica the changed values, the function and its shard (asynchronously),
run the local replicas (the first device in the calling thread, the others in a pool), collect the
remote answers, then merge the recorded gradients in replica order, weighted by rows, and apply them
with the client's optimizers. A replica lost (or silent) during the attempt either fails the step
(``on_replica_failure="raise"``) or is left out, and the step is tried again on the others.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from stratagem.collectives.algorithms import split_bounds
from stratagem.strategies.remote_calls import values
from stratagem.strategies.remote_calls.functions import main_script
from stratagem.core.errors import ConfigurationError, PeerLostError, StratagemError, TransportClosed, TransportTimeout
from stratagem.core.transport import Message
from stratagem.training.variables import to_module
from stratagem.strategies.in_graph.devices import Device, gather, parse_devices, placed_like
from stratagem.strategies.in_graph.functions import FunctionSender, remember
from stratagem.strategies.in_graph.replica import PROTOCOL, REPLY, REQUEST, StepContext, run_step
from stratagem.strategies.in_graph.batches import PerReplica, map_leaves, split_tree

log = logging.getLogger(__name__)

#: Seconds the client waits for each worker's goodbye when it shuts down.
GOODBYE_TIMEOUT = 5.0
#: Errors of a replica whose message says it all (no remote traceback with them).
_EXPLAINED = ("ConfigurationError", "FunctionNotFound", "ProtocolError")
#: Seconds the client looks for an answer that has arrived once the step's deadline has passed.
_LATE_LOOK = 0.05


class ReplicaError(StratagemError):
    """A step function raised on a remote replica, or the replica failed otherwise while it handled the
    step (an error no check of the request explains); ``replica``, ``task``, ``error_type`` (the
    exception's class name there) and ``remote_traceback`` say where and what. ``culprit`` is ``task``:
    the launcher names that task as the one that failed (:mod:`stratagem.core.failures`)."""

    def __init__(self, message: str, *, replica: str, task, error_type: str, remote_traceback: str = ""):
        super().__init__(message)
        self.replica, self.task, self.error_type, self.remote_traceback = replica, task, error_type, remote_traceback
        self.culprit = task


@dataclass(eq=False)
class Replica:
    label: str
    device: Device | None = None            # a local replica's device
    task: Any = None                        # a remote replica's task
    alive: bool = True
    sent: dict = field(default_factory=dict)          # variable name -> version it holds
    functions: OrderedDict = field(default_factory=OrderedDict)  # serialized functions it holds (its LRU)

    @property
    def remote(self) -> bool:
        return self.task is not None


@dataclass(eq=False)
class _Outcome:
    """One replica's part of a step attempt."""

    replica: Replica
    rows: int | None
    result: Any = None
    calls: list | None = None               # [(optimizer or None, [(name, grad, variable or None), ...])]
    error: BaseException | None = None      # the step raised (re-raised once every replica is collected)
    failure: BaseException | None = None    # the replica is lost or silent


class Client:
    """The replicas of an ``in_graph`` client strategy and the steps over them."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.transport = strategy.transport
        self.timeout = strategy.config["timeout"] or self.transport.timeout
        devices = [Device(name) for name in parse_devices(strategy.config["devices"])]
        me = strategy.task
        self.replicas = [Replica(f"replica {i} ({d} of {me})", device=d) for i, d in enumerate(devices)]
        self.replicas += [Replica(f"replica {len(devices) + i} ({task})", task=task)
                          for i, task in enumerate(t for t in strategy.cluster.replicas() if t != me)]
        self.lost: dict[str, str] = {}
        self.sender = FunctionSender(strategy, strategy.config["functions"])
        self._pool: ThreadPoolExecutor | None = None
        self._attempts = 0
        #: The remote replica whose failure the last step raised, and that error (None: none did).
        self.blamed: tuple[Any, BaseException] | None = None

    def remote(self) -> list[Replica]:
        return [r for r in self.replicas if r.remote and r.alive]

    # -- start and end -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Greet every worker task and wait until each is ready (its failures follow the policy)."""
        hello = {"op": "hello", "protocol": PROTOCOL, "script": main_script()[1]}
        failures = []
        for replica in self.remote():
            try:
                self.transport.send(replica.task, REQUEST, Message(dict(hello)), timeout=self.timeout)
            except (PeerLostError, TransportTimeout) as exc:
                failures.append((replica, exc))
        deadline = time.monotonic() + self.timeout
        for replica in self.remote():
            if any(replica is r for r, _ in failures):
                continue
            try:
                ready = self._receive(replica, deadline, lambda meta: meta.get("op") == "ready")
            except (PeerLostError, TransportTimeout) as exc:
                failures.append((replica, exc))
                continue
            if ready.meta.get("protocol") != PROTOCOL:
                raise ConfigurationError(f"{replica.label} speaks in_graph protocol {ready.meta.get('protocol')!r}, "
                                         f"the client {PROTOCOL}: run the same stratagem version on every task")
        self._handle_failures(failures, "at start-up")

    def release(self) -> None:
        """Tell every worker still in to stop serving, and wait briefly for their goodbyes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        remote = self.remote()
        for replica in remote:
            with contextlib.suppress(Exception):
                self.transport.send(replica.task, REQUEST, Message({"op": "shutdown"}), timeout=GOODBYE_TIMEOUT)
        deadline = time.monotonic() + GOODBYE_TIMEOUT
        for replica in remote:
            with contextlib.suppress(Exception):
                self._receive(replica, deadline, lambda meta: meta.get("op") == "bye")

    def abort(self, culprit, error: str) -> None:
        """The client leaves because the job failed (``culprit``: the task that failed, ``error``: why):
        tell every worker still in, so that each stops serving naming it (best effort, briefly)."""
        notice = Message({"op": "abort", "culprit": str(culprit), "error": error[:2000]})
        for replica in self.remote():
            with contextlib.suppress(Exception):
                self.transport.send(replica.task, REQUEST, notice, timeout=1.0)

    def _receive(self, replica: Replica, deadline: float, wanted: Callable[[dict], bool]) -> Message:
        """The next reply of ``replica`` that ``wanted`` accepts (late answers to earlier steps are dropped)."""
        while True:
            # Past the deadline (spent waiting for another replica), what has arrived is still taken.
            remaining = max(deadline - time.monotonic(), _LATE_LOOK)
            try:
                message = self.transport.recv(replica.task, REPLY, timeout=remaining)
            except TransportTimeout:
                raise TransportTimeout(f"{replica.label} did not answer within {self.timeout:g} s") from None
            if wanted(message.meta):
                return message

    def _handle_failures(self, failures: list, when: str) -> None:
        if not failures:
            return
        replica, exc = failures[0]
        detail = f"{replica.label} {'died' if isinstance(exc, PeerLostError) else 'did not answer'} {when}: {exc}"
        if self.strategy.config["on_replica_failure"] == "raise":
            hint = "; pass on_replica_failure='continue' to go on with the other replicas"
            error = (PeerLostError(replica.task, detail + hint) if isinstance(exc, PeerLostError)
                     else TransportTimeout(detail + hint))
            self.blamed = (replica.task, error)
            raise error from exc
        for replica, exc in failures:
            replica.alive = False
            self.lost[replica.label] = str(exc)
            log.warning("in_graph: leaving out %s (%s); going on with %d replica(s)", replica.label, exc,
                        sum(r.alive for r in self.replicas))
            with contextlib.suppress(Exception):   # a silent replica may still hear it, and exit
                self.transport.send(replica.task, REQUEST, Message({"op": "shutdown"}), timeout=1.0)

    # -- one step ----------------------------------------------------------------------------------------
    def step(self, fn: Callable, tree, rows: int | None) -> PerReplica:
        """Run ``fn`` on ``tree``'s rows (``rows``; ``None``: no batch) over the replicas; apply the update."""
        while True:
            result = self._attempt(fn, tree, rows)
            if result is not None:
                return result

    def _attempt(self, fn: Callable, tree, rows: int | None) -> PerReplica | None:
        """One try over the live replicas; ``None`` if some were lost and left out."""
        self._attempts += 1
        attempt = self._attempts
        self.blamed = None
        replicas = [r for r in self.replicas if r.alive]
        bounds = split_bounds(rows, len(replicas)) if rows is not None else None
        planned = []                                       # (outcome, lo, hi): replicas that get rows
        for i, replica in enumerate(replicas):
            lo, hi = (bounds[i], bounds[i + 1]) if bounds is not None else (None, None)
            if rows is None or hi > lo:
                planned.append((_Outcome(replica, None if rows is None else hi - lo), lo, hi))
        remote = [item for item in planned if item[0].replica.remote]
        handles = self._send(fn, tree, remote, attempt) if remote else []
        self._run_local(fn, tree, [item for item in planned if not item[0].replica.remote])
        deadline = time.monotonic() + self.timeout
        for outcome, _, _ in remote:
            if outcome.failure is None:
                self._collect(outcome, attempt, deadline)
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.wait(1.0)
        outcomes = [outcome for outcome, _, _ in planned]
        failures = [(o.replica, o.failure) for o in outcomes if o.failure is not None]
        self._handle_failures(failures, f"during step {self.strategy.training_state.step + 1}")
        if failures:
            return None
        for outcome in outcomes:
            if outcome.error is not None:
                if isinstance(outcome.error, ReplicaError):   # the step raised there (not a setup error)
                    self.blamed = (outcome.replica.task, outcome.error)
                raise outcome.error
        self._merge_and_apply(outcomes, rows)
        return PerReplica([o.result for o in outcomes], None if rows is None else [o.rows for o in outcomes],
                          [o.replica.label for o in outcomes])

    def _send(self, fn, tree, remote: list, attempt: int) -> list:
        fn_meta, fn_data = self.sender.describe(fn)
        stores = {name: var.store for name, var in self.strategy.training_state.variables.items()}
        host: dict[str, np.ndarray] = {}        # each value copied off a GPU at most once per step
        handles = []
        for outcome, lo, hi in remote:
            replica = outcome.replica
            changed = [name for name, store in stores.items() if replica.sent.get(name) != store.version]
            buffers = [host[name] if name in host else host.setdefault(name, to_module(stores[name].array, np))
                       for name in changed]
            pickled = fn_meta["kind"] == "pickle"
            send_function = pickled and fn_meta["sha"] not in replica.functions
            if pickled:
                remember(replica.functions, fn_meta["sha"], True)
            if send_function:
                buffers.append(np.frombuffer(fn_data, np.uint8))
            skeleton, arrays = values.encode_call(*(tree if lo is None else split_tree(tree, lo, hi)),
                                                  what="an argument of the step")
            meta = {"op": "step", "step": attempt, "values": [[n, stores[n].version] for n in changed],
                    "fn": fn_meta, "fn_bytes": send_function, "args": skeleton}
            try:
                handles.append(self.transport.send_async(replica.task, REQUEST, Message(meta, buffers + arrays),
                                                         timeout=self.timeout))
            except (PeerLostError, TransportTimeout) as exc:
                outcome.failure = exc
                continue
            for name in changed:
                replica.sent[name] = stores[name].version
        return handles

    def _run_local(self, fn, tree, local: list) -> None:
        def work(outcome: _Outcome, lo, hi) -> None:
            device = outcome.replica.device
            shard = tree if lo is None else split_tree(tree, lo, hi)
            if device.gpu is not None:
                shard = map_leaves(shard, lambda leaf, path: device.place_leaf(leaf))
            context = StepContext(device)
            try:
                with device.context():
                    outcome.result = run_step(fn, shard[0], shard[1], context)
                outcome.calls = context.calls
            except Exception as exc:  # noqa: BLE001 - re-raised by the step once the others are collected
                outcome.error = exc

        if len(local) > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="in_graph-replica")
        futures = [self._pool.submit(work, *item) for item in local[1:]] if len(local) > 1 else []
        if local:
            work(*local[0])
        for future in futures:
            future.result()

    def _collect(self, outcome: _Outcome, attempt: int, deadline: float) -> None:
        replica = outcome.replica
        try:
            message = self._receive(replica, deadline, lambda meta: meta.get("step") == attempt)
        except (PeerLostError, TransportTimeout) as exc:
            outcome.failure = exc
            return
        except TransportClosed as exc:
            outcome.error = exc
            return
        meta = message.meta
        if meta.get("op") == "error":
            outcome.error = self._remote_error(replica, meta)
            return
        buffers = list(message.buffers)
        outcome.calls = []
        for names in meta.get("calls") or []:
            outcome.calls.append((None, [(name, buffers.pop(0), None) for name in names]))
        outcome.result = values.decode(meta.get("result"), buffers)

    @staticmethod
    def _remote_error(replica: Replica, meta: dict) -> Exception:
        kind, message, where = meta.get("type", "Exception"), meta.get("message", ""), meta.get("where")
        traceback = meta.get("traceback", "")
        if where != "step":
            replica.functions.clear()   # it may not hold what the client thinks it sent: send again
            what = "send the step's result back" if where == "reply" else "run the step"
            if kind in _EXPLAINED:      # the request (the script, the step's arguments) is at fault
                return ConfigurationError(f"{replica.label} could not {what}: {kind}: {message}")
            # The replica failed: an exception its signal handler raised meanwhile, MemoryError...
            return ReplicaError(f"{replica.label} could not {what}: {kind}: {message}\n\nremote traceback:\n"
                                f"{traceback}", replica=replica.label, task=replica.task, error_type=kind,
                                remote_traceback=traceback)
        return ReplicaError(f"the step function failed on {replica.label}: {kind}: {message}\n\nremote "
                            f"traceback:\n{traceback}", replica=replica.label, task=replica.task, error_type=kind,
                            remote_traceback=traceback)

    def _merge_and_apply(self, outcomes: list[_Outcome], rows: int | None) -> None:
        """Sum each gradient over the replicas in order, weighted by rows (under ``gradient_reduction="sum"``:
        not weighted); apply with the client's optimizers."""
        reference = outcomes[0]               # the client's first device: it knows the optimizers
        for other in outcomes[1:]:
            _check_same_calls(reference, other)
        strategy = self.strategy
        total = sum(o.rows for o in outcomes) if rows is not None else None
        weights = [o.rows / total if total else 1.0 / len(outcomes) for o in outcomes]
        if strategy.gradient_reduction == "sum":   # TF's convention: the replicas' gradients summed
            weights = [1.0] * len(outcomes)
        for k, (optimizer, entries) in enumerate(reference.calls):
            theirs = [{name: grad for name, grad, _ in other.calls[k][1]} for other in outcomes[1:]]
            pairs = []
            for name, grad, variable in entries:
                target = variable.store.array
                with placed_like(target):
                    acc = gather(grad, target)          # replica 0's recorded copy: summed into in place
                    if len(outcomes) > 1:
                        acc *= acc.dtype.type(weights[0])
                    for other, grads, weight in zip(outcomes[1:], theirs, weights[1:]):
                        if tuple(grads[name].shape) != tuple(variable.shape):
                            raise ConfigurationError(f"{other.replica.label} sent a gradient of shape "
                                                     f"{tuple(grads[name].shape)} for variable {name!r} of shape "
                                                     f"{variable.shape}")
                        acc += gather(grads[name], target) * acc.dtype.type(weight)
                pairs.append((acc, variable))
            strategy.on_optimizer(optimizer)
            optimizer.apply_dense(pairs)
            strategy.training_state.step += 1


def _check_same_calls(reference: _Outcome, other: _Outcome) -> None:
    mine = [sorted(name for name, _, _ in entries) for _, entries in reference.calls]
    theirs = [sorted(name for name, _, _ in entries) for _, entries in other.calls]
    if mine != theirs:
        raise ConfigurationError(
            f"the replicas made different apply_gradients() calls in one step: {reference.replica.label} "
            f"passed gradients for {mine}, {other.replica.label} for {theirs}. Every replica must make the "
            f"same calls, for the same variables (do not skip one on some data)"
        )
