"""The coordinator of the ``parameter_server`` strategy: schedules step functions onto the workers.

``schedule(fn, args)`` puts a *closure* in a queue and returns a :class:`RemoteValue` at once. One
dispatcher thread per worker takes closures from the queue, sends each to its worker (tag
``ps.closure``) and waits for the result (tag ``ps.result``), so every worker runs one closure at a
time and a fast worker takes more of them. ``join()`` waits until every scheduled closure has run.

When a worker dies (the transport reports it lost), the closure it was running goes back to the front
of the queue and runs on another worker: closures run *at least once* (one that had pushed its
gradients before its worker died may have updated the variables already). The dead worker's
dispatcher waits; when a new process of that task comes back, it is used again. When no worker is
left, the closures wait for one to come back, up to the strategy's timeout; then ``join()`` raises
``PeerLostError`` naming the lost workers and why each was lost.

A closure that raises fails its ``RemoteValue``; ``join()`` (or the next ``schedule()``) raises the
first such error once, and the closures still queued are cancelled. A shard (ps task) that is lost
makes ``join()`` raise :class:`~stratagem.ps_service.protocol.ShardLostError` naming it.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

import numpy as np

from stratagem.strategies.remote_calls import functions as remote_code
from stratagem.strategies.remote_calls import values
from stratagem.core.cluster import TaskId
from stratagem.core.errors import CommunicationError, ConfigurationError, PeerLostError, StratagemError, TransportTimeout
from stratagem.training.optimizers.rules import Optimizer
from stratagem.ps_service.protocol import ShardLostError, task_key
from stratagem.core.transport import Message
from stratagem.training.variables import Variable

log = logging.getLogger(__name__)

CLOSURE_TAG, RESULT_TAG = "ps.closure", "ps.result"
#: The ``functions`` option's values, as :mod:`stratagem.strategies.remote_calls.functions` calls them.
FUNCTION_MODES = {"auto": "auto", "name": "name", "cloudpickle": "value"}
#: Where else a function sent by name must be defined (the workers serve inside the strategy's constructor).
_WHERE = (", before the call to stratagem.strategy(...) (workers serve inside that call, so what comes "
          "after it does not exist there)")
#: What may be an argument of a step.
_SENDABLE = ("pass numbers, strings, arrays, lists, tuples, dicts, stratagem Variables, the optimizer or a "
             "per-worker iterator")
#: Seconds a waiting dispatcher or join() sleeps between checks.
POLL = 0.1


class ClosureError(StratagemError):
    """A scheduled step function raised on its worker; the message names the function and the worker."""


class CancelledError(StratagemError):
    """A scheduled closure did not run: an earlier one failed, or the strategy was shut down."""


class RemoteValue:
    """The result of a scheduled step function, available once a worker has run it.

    ``fetch()`` waits for it and returns it (or raises what the function raised, as a
    :class:`ClosureError`); ``done()`` says whether it is there.
    """

    def __init__(self, name: str):
        #: The step function's name.
        self.name = name
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        #: The task that ran it (``None`` until then).
        self.worker: TaskId | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def fetch(self, timeout: float | None = None):
        """The function's return value; waits up to ``timeout`` seconds (forever when ``None``)."""
        if not self._event.wait(timeout):
            raise TransportTimeout(f"step function {self.name} did not finish within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch

    def set_result(self, value, worker) -> None:
        """For the coordinator: ``worker`` ran the function, which returned ``value``."""
        self._value, self.worker = value, worker
        self._event.set()

    def set_error(self, error: BaseException, worker=None) -> None:
        """For the coordinator: the function raised ``error`` on ``worker``, or did not run (``None``)."""
        self._error, self.worker = error, worker
        self._event.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<RemoteValue of {self.name} ({state})>"


class PerWorkerDataset:
    """``strategy.create_per_worker_dataset(dataset_fn)``: every worker calls ``dataset_fn(context)``
    once and iterates its own dataset. Pass ``iter(per_worker_dataset)`` to the scheduled functions;
    on each worker it is that worker's iterator."""

    def __init__(self, dataset_id: int, fn: Callable, ref: dict):
        self.id, self.fn, self.ref = dataset_id, fn, ref

    def __iter__(self) -> "PerWorkerIterator":
        return PerWorkerIterator(self)

    def __repr__(self) -> str:
        return f"<PerWorkerDataset {self.id} of {getattr(self.fn, '__qualname__', self.fn)!r}>"


class PerWorkerIterator:
    """A reference to each worker's iterator over its per-worker dataset."""

    def __init__(self, dataset: PerWorkerDataset):
        self.dataset = dataset

    def __next__(self):
        raise StratagemError("a per-worker iterator is read on the workers: pass it to strategy.schedule(fn, args=(it,))")

    def __repr__(self) -> str:
        return f"<PerWorkerIterator of dataset {self.dataset.id}>"


class _Closure:
    def __init__(self, fn: Callable, args: tuple, kwargs: dict, remote: RemoteValue, pickled: bool, number: int):
        self.fn, self.args, self.kwargs, self.remote, self.pickled = fn, args, kwargs, remote, pickled
        self.number = number
        self.message: Message | None = None   # encoded once (again if it must go by value)


class Coordinator:
    """Closures, dispatchers and results for one ``parameter_server`` strategy (its chief).

    Args:
        strategy: the strategy (its transport; what references to it, its variables and optimizers name).
        workers: the tasks that run closures.
        functions: how step functions travel (``FUNCTION_MODES``).
        client: the strategy's :class:`~stratagem.ps_service.client.PSClient` (lost shards, idle workers).
        variables: its :class:`~stratagem.strategies.ps.remote.RemoteVariables` (the results' references).
        timeout: seconds a send may take, and how long closures wait for a worker to come back.
        mode: the consistency mode (``sync`` and ``bounded`` shards are told which workers are idle).
    """

    def __init__(self, strategy, workers: list[TaskId], *, functions: str = "auto", client, variables,
                 timeout: float, mode: str = "async"):
        self.strategy = strategy
        self.client, self.variables, self.timeout, self.mode = client, variables, timeout, mode
        self.transport = strategy.transport
        self.workers = list(workers)
        self.functions = functions
        self.authenticated = self.transport.secret is not None
        self._policy = remote_code.Policy(FUNCTION_MODES[functions], authenticated=self.authenticated,
                                          peers="the workers", option=f"functions={functions!r}", hint=_WHERE)
        self._cond = threading.Condition()
        self._queue: deque[_Closure] = deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)
        self._datasets: dict[int, PerWorkerDataset] = {}
        self._dead: set[TaskId] = set()
        self._why_lost: dict[TaskId, str] = {}     # why each worker in _dead was declared lost
        self._losses_at: dict[TaskId, int] = {}    # its transport's count of its losses before that
        self._declared: dict[TaskId, bool] = {}    # whether its transport had declared it lost then
        self._idle: set[TaskId] = set()
        self._pickled_fns: set = set()             # functions a worker could not find by name
        #: Closures each worker has run to completion (including failed ones), by task.
        self.executed: Counter = Counter()
        #: Closures sent again after their worker was lost.
        self.retried = 0
        #: The task the last step error is the fault of (None: not known, e.g. a shard refused the
        #: step because the job had failed elsewhere), and that error; None before any.
        self.blamed: tuple[TaskId | None, BaseException] | None = None

    # -- the user's calls ----------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> RemoteValue:
        if not callable(fn):
            raise TypeError(f"schedule() needs a callable step function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments, e.g. args=(x,), got {type(args).__name__}")
        self._raise_pending()
        pickled = self._how(fn, "step function") == "value"
        remote = RemoteValue(getattr(fn, "__qualname__", repr(fn)))
        closure = _Closure(fn, tuple(args), dict(kwargs or {}), remote, pickled, next(self._ids))
        closure.message = self._encode(closure)  # refuse what cannot be sent now, not on a worker later
        with self._cond:
            if self._closing:
                raise StratagemError("the strategy was shut down; create a new one")
            self._queue.append(closure)
            self._cond.notify_all()
        self._start()
        return remote

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        no_worker_since = None
        while True:
            with self._cond:
                if self._error is None and not self._queue and not self._inflight:
                    return
                if self._error is None:
                    self._cond.wait(POLL)
            self._raise_pending()
            self.client.check_shards()
            alive = [w for w in self.workers if w not in self._dead]
            now = time.monotonic()
            if alive:
                no_worker_since = None
            else:
                no_worker_since = no_worker_since or now
                if now - no_worker_since > self.timeout:
                    raise self._no_worker_left()
            if deadline is not None and now > deadline:
                raise TransportTimeout(f"join() did not finish within {timeout:g} s")

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        if not callable(dataset_fn):
            raise TypeError(f"create_per_worker_dataset() needs a function, got {type(dataset_fn).__name__}")
        how = self._how(dataset_fn, "dataset function")
        ref = remote_code.by_name(dataset_fn) if how == "name" else None
        dataset = PerWorkerDataset(len(self._datasets) + 1, dataset_fn, ref)
        self._datasets[dataset.id] = dataset
        return dataset

    def shutdown(self) -> None:
        self._cancel_queued("the strategy shut down")
        for thread in self._threads:
            thread.join(POLL * 20)
        self._tell_workers(Message({"op": "shutdown"}), timeout=5)

    def abort(self, culprit, error: str) -> None:
        """The coordinator leaves because the job failed (``culprit``: the task that failed, None when
        not known; ``error``: why): cancel what is queued and tell every worker still in, so that each
        stops naming it rather than the coordinator (best effort, briefly)."""
        self._cancel_queued("the job failed")
        self._tell_workers(Message({"op": "abort", "culprit": None if culprit is None else str(culprit),
                                    "error": error[:2000]}), timeout=1.0)

    def _cancel_queued(self, why: str) -> None:
        """Take nothing more, and fail every closure still queued (``why``: the reason they name)."""
        with self._cond:
            self._closing = True
            pending, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for closure in pending:
            closure.remote.set_error(CancelledError(f"{closure.remote.name} was cancelled: {why}"))

    def _tell_workers(self, message: Message, timeout: float) -> None:
        """Send ``message`` to every worker not known to be lost (best effort: one that cannot be
        reached is left out)."""
        lost = self.transport.lost_peers()
        for worker in self.workers:
            if worker not in lost:
                try:
                    self.transport.send(worker, CLOSURE_TAG, message, timeout=timeout)
                except CommunicationError:
                    pass

    # -- encoding ------------------------------------------------------------------------------------
    def _how(self, fn: Callable, what: str) -> str:
        """``"name"`` or ``"value"`` (the rules: :mod:`stratagem.strategies.remote_calls.functions`)."""
        return self._policy.how(fn, f"the {what} {remote_code.describe(fn)!r}")

    def _reference(self, obj):
        strategy = self.strategy
        if isinstance(obj, Variable) and obj.strategy is strategy:
            return {"__var__": obj.name}
        if isinstance(obj, Optimizer) and obj.strategy is strategy:
            return {"__opt__": json.dumps(obj.get_config(), sort_keys=True)}
        if isinstance(obj, PerWorkerIterator):
            return {"__iter__": obj.dataset.id}
        if isinstance(obj, PerWorkerDataset):
            raise ConfigurationError("pass iter(per_worker_dataset) to the step function, not the dataset itself")
        if obj is strategy:
            return {"__strategy__": True}
        return None

    def _persistent_id(self, obj):
        ref = self._reference(obj) if isinstance(obj, (Variable, Optimizer, PerWorkerIterator, PerWorkerDataset)) \
            or obj is self.strategy else None
        return None if ref is None else json.dumps(ref, sort_keys=True)

    def _encode(self, closure: _Closure) -> Message:
        """The closure's message: the functions serialized by value first (``blobs`` of them), then the
        arguments' arrays."""
        name = remote_code.describe(closure.fn)
        refs: list = []

        def reference(obj):
            ref = self._reference(obj)
            if ref is not None:
                refs.append(ref)
            return ref

        skeleton, arrays = values.encode_call(closure.args, closure.kwargs, reference=reference,
                                              what=f"an argument of {name}", sendable=_SENDABLE)
        blobs: list = []
        datasets = {}
        for ref in refs:
            if "__iter__" in ref:
                dataset = self._datasets[ref["__iter__"]]
                datasets[str(dataset.id)] = self._function_meta(dataset.fn, dataset.ref, blobs)
        fn_meta = self._function_meta(closure.fn, None if closure.pickled else remote_code.by_name(closure.fn), blobs)
        meta = {"op": "run", "id": closure.number, "fn": fn_meta, "values": skeleton, "datasets": datasets,
                "variables": len(self.variables.variables), "blobs": len(blobs)}
        return Message(meta, blobs + arrays)

    def _function_meta(self, fn: Callable, ref: dict | None, blobs: list) -> dict:
        if ref is not None and fn not in self._pickled_fns:
            return ref
        data = remote_code.dumps_function(fn, what=f"the function {remote_code.describe(fn)!r}",
                                          persistent_id=self._persistent_id)
        blobs.append(np.frombuffer(data, np.uint8))
        return {"kind": "pickle", "blob": len(blobs) - 1}

    # -- dispatching ---------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._threads:
            return
        for worker in self.workers:
            thread = threading.Thread(target=self._dispatch, args=(worker,), daemon=True,
                                      name=f"stratagem-dispatch-{worker.short}")
            self._threads.append(thread)
            thread.start()

    def _next(self, worker: TaskId) -> tuple[_Closure | None, bool]:
        """The next closure for ``worker`` (None when closing) and whether the worker was idle; waits
        while it is dead or has nothing to do."""
        tell_idle = False
        while True:
            with self._cond:
                if self._closing:
                    return None, False
                if worker in self._dead and self._back(worker):
                    self._dead.discard(worker)
                    log.warning("%s is back: scheduling onto it again", worker)
                if worker not in self._dead and self._queue:
                    closure = self._queue.popleft()
                    self._inflight += 1
                    was_idle = worker in self._idle
                    self._idle.discard(worker)
                    return closure, was_idle
                if worker not in self._dead and worker not in self._idle and not self._queue:
                    self._idle.add(worker)
                    tell_idle = True
                else:
                    self._cond.wait(POLL)
            if tell_idle:
                tell_idle = False
                self._tell_idle(worker, True)

    def _dispatch(self, worker: TaskId) -> None:
        while True:
            closure, was_idle = self._next(worker)
            if closure is None:
                return
            if was_idle:  # counted again by sync rounds and staleness bounds, before it can push
                self._tell_idle(worker, False)
            outcome = self._run_on(worker, closure)
            with self._cond:
                self._inflight -= 1
                if outcome == "retry":
                    self._queue.appendleft(closure)
                    self.retried += 1
                else:
                    self.executed[worker] += 1
                self._cond.notify_all()

    def _run_on(self, worker: TaskId, closure: _Closure) -> str:
        """Run one closure on ``worker``: ``"done"``, or ``"retry"`` when it must run elsewhere."""
        losses = self.transport.peer_losses(worker)
        try:
            if closure.message is None:
                closure.message = self._encode(closure)
            self.transport.send(worker, CLOSURE_TAG, closure.message, timeout=self.timeout)
            reply = self._await(worker, closure.number, losses)
        except (PeerLostError, TransportTimeout) as exc:
            return self._lost(worker, exc, losses)
        except Exception as exc:  # noqa: BLE001 - e.g. an argument that cannot be encoded
            self._failed(closure, exc, worker)
            return "done"
        if reply is None:
            return "retry"
        meta = reply.meta
        if "error" in meta:
            if meta.get("not_found") and self.authenticated and self.functions == "auto" and not closure.pickled:
                self._pickled_fns.add(closure.fn)    # this worker lacks it by name: send it by value
                closure.pickled, closure.message = True, None
                return "retry"
            self._failed(closure, self._error_from(meta, worker, closure), worker)
            return "done"
        try:
            value = values.decode(meta["value"], list(reply.buffers), resolve=self._resolve_result)
        except Exception as exc:  # noqa: BLE001
            self._failed(closure, exc, worker)
            return "done"
        closure.remote.set_result(value, worker)
        return "done"

    def _await(self, worker: TaskId, number: int, losses: int) -> Message | None:
        """The result of closure ``number`` from ``worker``; ``PeerLostError`` when the process it was sent
        to is gone, even if a new process of the task (or the same one, back from a stall, as a new
        transport) took its place in the meantime: that one never heard of it (``losses``: the task's
        count of losses when it was sent)."""
        while True:
            if self._closing:
                return None
            try:
                reply = self.transport.recv(worker, RESULT_TAG, timeout=POLL)
            except TransportTimeout:
                if self.transport.peer_losses(worker) != losses:
                    raise PeerLostError(worker, "a new process of it took its place while it ran the closure")
                continue
            if reply.meta.get("id") == number:
                return reply

    def _tell_idle(self, worker: TaskId, idle: bool) -> None:
        """The coordinator has nothing for ``worker`` (``idle``), or has again: sync rounds and staleness
        bounds skip idle workers."""
        if self.mode != "async" and not self.strategy.closed:
            try:
                self.client.idle([task_key(worker)], idle)
            except Exception:  # noqa: BLE001 - the next join()/push reports a real failure
                pass

    def _resolve_result(self, ref: dict):
        """The variable a step's result names (``{"__var__": name}``)."""
        if "__var__" in ref and ref["__var__"] in self.variables.variables:
            return self.variables.variables[ref["__var__"]]
        raise StratagemError(f"a step returned a reference {ref!r} the coordinator does not know")

    def _lost(self, worker: TaskId, exc: Exception, losses: int) -> str:
        """``worker`` is taken for lost (``losses``: its transport's count of its losses before)."""
        with self._cond:
            self._dead.add(worker)
            self._idle.discard(worker)
            self._losses_at[worker] = losses
            self._declared[worker] = worker in self.transport.lost_peers()
            # "lost peer worker:1: <reason>": the reason alone, the worker is named beside it
            self._why_lost[worker] = str(exc).split(": ", 1)[-1] if isinstance(exc, PeerLostError) else str(exc)
            others = [w for w in self.workers if w not in self._dead]
        if others:
            log.warning("%s was lost (%s); its closure runs on another worker", worker, exc)
        else:
            log.warning("%s was lost (%s); no other worker is left: its closure waits for a worker to come "
                        "back (up to %g s, then join() fails)", worker, exc, self.timeout)
        return "retry"

    def _back(self, worker: TaskId) -> bool:
        """Whether a worker taken for lost is back: its transport no longer reports it lost, and either it
        did when the worker was taken for lost, or a new process of it was accepted since (one that did
        not answer in time, and still does not, is not back: it may be stopped)."""
        if worker in self.transport.lost_peers():
            return False
        return self._declared.get(worker, True) or self.transport.peer_losses(worker) > self._losses_at.get(worker, 0)

    def _no_worker_left(self) -> PeerLostError:
        """What ``join()`` raises once no worker has been left for the strategy's timeout: the lost ones, named."""
        with self._cond:
            lost = [w for w in self.workers if w in self._dead]
            why = {w: self._why_lost.get(w, "lost") for w in lost}
        named = "; ".join(f"{w} ({why[w]})" for w in lost)
        return PeerLostError(
            lost[0] if lost else None,
            f"no worker left to run the pending closures: {named}; none came back within "
            f"{self.timeout:g} s (restart the lost worker(s): a worker that comes back is used again; "
            f"the strategy's timeout= sets how long to wait)")

    def _error_from(self, meta: dict, worker: TaskId, closure: _Closure) -> BaseException:
        name = getattr(closure.fn, "__qualname__", repr(closure.fn))
        if meta.get("lost_task"):
            task = TaskId.parse(meta["lost_task"])
            error = ShardLostError(task, self.client.pieces.get(task.index, []),
                                   f"seen by {worker} while it ran {name}")
            self.blamed = (task, error)
            return error
        error = ClosureError(f"step function {name} failed on {worker}: {meta.get('error_type')}: {meta['error']}")
        # A shard's refusal (the job failed elsewhere) is not this worker's fault: it names the task
        # that failed, which the error carries to the launcher (core/failures.py) and the workers.
        try:
            culprit = TaskId.parse(str(meta["culprit"])) if meta.get("culprit") else None
        except ValueError:
            culprit = None
        if culprit is not None:
            error.culprit = culprit
        self.blamed = (culprit if culprit is not None or meta.get("error_type") == "RemoteError" else worker, error)
        return error

    def _failed(self, closure: _Closure, error: BaseException, worker) -> None:
        closure.remote.set_error(error, worker)
        with self._cond:
            if self._error is None:
                self._error = error
                pending, self._queue = list(self._queue), deque()
            else:
                pending = []
            self._cond.notify_all()
        for other in pending:
            other.remote.set_error(CancelledError(f"{other.remote.name} was cancelled: an earlier step failed: {error}"))

    def _raise_pending(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error
