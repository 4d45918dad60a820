"""The ``parameter_server`` strategy: a coordinator schedules step functions onto workers (TF2's
``ParameterServerStrategy``; README: "Parameter servers").

Every task runs the same script. Inside ``stratagem.strategy("parameter_server", ...)``:

- ``ps`` tasks serve the variables until training ends, then exit (see ``between_graph``);
- ``worker`` tasks serve *closures*: they run the step functions the coordinator sends them against
  their own remote copies of the variables, and exit when the coordinator is done;
- an ``evaluator`` task listed in the cluster runs its own script: it creates the coordinator's
  variables in ``scope()`` (same names, shapes, order) and reads them from the ps tasks; it trains
  nothing and runs no steps;
- the chief (``chief:0``, else ``worker:0``) is the *coordinator*: the call returns, and the script goes
  on to create the variables in ``scope()`` (placed on the ps tasks) and to schedule steps:

  - ``strategy.schedule(fn, args=(...))`` returns a :class:`~stratagem.strategies.ps.coordinator.RemoteValue`
    at once; a free worker runs ``fn(*args)`` (``remote.fetch()`` waits for its result);
  - ``strategy.join()`` waits until every scheduled step has run, and raises the first error of a step
    (the steps still queued are cancelled);
  - ``strategy.create_per_worker_dataset(dataset_fn)``: each worker builds its own dataset with
    ``dataset_fn(context)`` (``context.worker_index``, ``context.num_workers``); pass
    ``iter(dataset)`` to the steps and each worker reads its own.

Arguments and results are numbers, strings, arrays, lists, tuples, dicts, and references to the
strategy's variables, its optimizer and per-worker iterators (resolved on the worker): nothing is
pickled. Step functions go *by name* (a module-level function, defined before the
``stratagem.strategy(...)`` call in the script, or in a module of your own code) — or, only when the
cluster is authenticated by a secret (``STRATAGEM_SECRET``, which ``stratagem launch`` sets), *by value*
with cloudpickle (lambdas, closures, functions of installed packages). See
:mod:`stratagem.strategies.remote_calls.functions` for the rules and why.

When a worker dies, the steps it was running run again on the others, and it is used again as soon
as a new process of that task is back (steps run at least once). A lost ps task makes ``join()``, and
every worker, raise :class:`~stratagem.ps_service.protocol.ShardLostError` naming it.

Options: those of :class:`~stratagem.strategies.ps.base.PSStrategyBase` (``pull_with_push`` is off:
each step pulls when it starts; ``mode``: ``async`` by default; under ``sync`` and ``bounded`` a
worker without a step to run does not hold the others up),
plus ``functions``: ``"auto"`` (by name when possible, else cloudpickle on an authenticated cluster),
``"name"`` or ``"cloudpickle"``.

One ps task, one worker and the coordinator as threads of one process; the step is a lambda, so it
travels with cloudpickle, which needs the cluster secret::

    >>> import threading
    >>> import numpy as np
    >>> import stratagem
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.transports.local import LocalFabric
    >>> cluster = ClusterSpec({"chief": ["local:0"], "worker": ["local:1"], "ps": ["local:2"]})
    >>> fabric = LocalFabric()
    >>> def start(task):
    ...     return ParameterServerStrategy("local", cluster=cluster, task=task, exit_after_serving=False,
    ...                                    transport_options={"fabric": fabric, "timeout": 30,
    ...                                                       "secret": b"example-secret"})
    >>> servers = [threading.Thread(target=start, args=(t,)) for t in ("ps:0", "worker:0")]
    >>> for t in servers: t.start()
    >>> coordinator = start("chief:0")
    >>> with coordinator.scope():
    ...     w = stratagem.Variable(np.zeros(2, np.float32), name="w")
    ...     opt = stratagem.optimizers.SGD(learning_rate=0.5)
    >>> descend = lambda w, opt, g: opt.apply_gradients([(np.full(w.shape, g, w.dtype), w)])
    >>> results = [coordinator.schedule(descend, args=(w, opt, 1.0)) for _ in range(3)]
    >>> coordinator.join()
    >>> [r.fetch() for r in results], w.numpy()
    ([1, 2, 3], array([-1.5, -1.5], dtype=float32))
    >>> coordinator.shutdown()
    >>> for t in servers: t.join()
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from stratagem.core import endpoints
from stratagem.core.errors import ConfigurationError
from stratagem.core.job_state import JobFinished
from stratagem.ps_service.client import PSClient
from stratagem.strategies.ps.adopt import Adoption
from stratagem.strategies.ps.coordinator import FUNCTION_MODES, Coordinator, PerWorkerDataset, RemoteValue
from stratagem.ps_service.protocol import task_key
from stratagem.strategies.ps.base import READY_POLL, PSStrategyBase
from stratagem.strategies.ps.stall import Stalled, StallWatch
from stratagem.strategies.ps.worker import Worker

log = logging.getLogger(__name__)

#: What ``functions=`` may be.
FUNCTIONS = tuple(FUNCTION_MODES)


class ParameterServerStrategy(PSStrategyBase):
    """A coordinator schedules steps onto workers; variables on ps tasks (see the module doc)."""

    name = "parameter_server"
    # A worker pulls fresh values when each step starts (it may have been idle, others pushed since),
    # so values riding back on the push reply would be thrown away: a third of a step's bytes.
    options = {"functions": "auto", "pull_with_push": False}

    def __init__(self, transport=None, **kwargs):
        self._coordinator: Coordinator | None = None
        self._adoption: Adoption | None = None
        super().__init__(transport, **kwargs)
        if self.task.job == "ps":
            return                                   # served (exit_after_serving=False)
        self._adoption = Adoption(self, self._remote, timeout=self._timeout)
        if self.is_chief:
            self._remote.always_pull = True   # the workers update the variables: read them fresh every time
            self._coordinator = Coordinator(self, self._worker_tasks(), functions=self.config["functions"],
                                            client=self._client, variables=self._remote, timeout=self._timeout,
                                            mode=self.consistency["mode"])
        elif not self.is_evaluator:          # an evaluator runs its own script, reading the variables
            self._serve_closures()

    def _check_config_impl(self) -> None:
        super()._check_config_impl()
        if self.config["functions"] not in FUNCTIONS:
            raise ConfigurationError(f"functions must be one of {', '.join(map(repr, FUNCTIONS))}, "
                                     f"got {self.config['functions']!r}")

    def _setup(self) -> None:
        if not self._worker_tasks():
            raise ConfigurationError(
                f"the parameter_server strategy needs worker tasks besides the coordinator "
                f"({self.cluster.chief}): launch with --chief --worker N, or --worker N+1"
            )
        super()._setup()

    def _worker_tasks(self) -> list:
        """The tasks that run closures: every replica except the coordinator."""
        return [t for t in self.cluster.replicas() if t != self.cluster.chief]

    def _pushers(self) -> list:
        return [task_key(t) for t in self._worker_tasks()]

    # -- the coordinator's API ------------------------------------------------------------------------
    def _require_coordinator(self, what: str) -> Coordinator:
        self._check_open()
        if self._coordinator is None:
            raise ConfigurationError(f"{what} is called on the coordinator ({self.cluster.chief}), not on {self.task}")
        return self._coordinator

    def schedule(self, fn: Callable, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on a free worker; return its :class:`RemoteValue`.

        Raises at once if the function or an argument cannot be sent (and says how to fix it), or if a
        step scheduled earlier failed (that error is raised once).
        """
        return self._require_coordinator("schedule()").schedule(fn, args, kwargs)

    def join(self, timeout: float | None = None) -> None:
        """Wait until every scheduled step has run; raise the first step error (once), or
        ``ShardLostError`` if a ps task is gone."""
        self._require_coordinator("join()").join(timeout)

    def _distribute_dataset_impl(self, batches):
        """On the coordinator: the global batches as they are. Each step the coordinator runs
        (``run``, ``schedule``) computes on the whole batch it is given, on one worker, so the
        coordinator's loop is the loop of one process (to give each worker data of its own, use
        :meth:`create_per_worker_dataset`)."""
        self._check_trains()
        self._require_coordinator("distribute_dataset()")
        return batches

    def _run_impl(self, fn: Callable, args: tuple, kwargs: dict):
        """On the coordinator: schedule ``fn`` and wait for its result."""
        return self.schedule(fn, args, kwargs).fetch()

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """A dataset each worker builds itself with ``dataset_fn(context)``; pass ``iter()`` of it to steps."""
        return self._require_coordinator("create_per_worker_dataset()").create_per_worker_dataset(dataset_fn)

    @property
    def coordinator(self) -> Coordinator | None:
        """The scheduling machinery (counters ``executed``, ``retried``), on the coordinator."""
        return self._coordinator

    # -- workers ---------------------------------------------------------------------------------------
    def _serve_closures(self) -> None:
        # A worker stopped longer than its peers wait is declared lost by them; it comes back as a new
        # process would (only over a transport that takes a new process of a task as that task).
        renewable = self._owns_transport and type(self.transport).elastic
        watch = StallWatch(self.transport.peer_timeout / 2) if renewable else None
        if watch is not None:
            self._client.interrupt = watch.check
        ran = 0
        try:
            while True:
                worker = Worker(self, self._worker_tasks(), client=self._client, variables=self._adoption,
                                timeout=self._timeout, watch=watch)
                try:
                    ran += worker.serve()
                    break
                except Stalled as stall:
                    ran += worker.ran
                    self._come_back(stall, watch)
        except JobFinished:
            self.shutdown()       # the job ended normally without this worker: no failure to report
            raise
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            if watch is not None:
                watch.close()
        self.shutdown()
        #: On a worker (``exit_after_serving=False``): how many closures it ran.
        self.served = ran
        if self.config["exit_after_serving"]:
            raise SystemExit(0)

    def _come_back(self, stall: Stalled, watch: StallWatch) -> None:
        """After a stall (:mod:`~stratagem.strategies.ps.stall`): the peers took this worker for lost, and
        refuse its old connections; leave them, and join again as a new process of this task would, on
        a new transport at the same address (the closure it was running was scheduled again elsewhere)."""
        log.warning("%s: %s, longer than half the peer timeout (%g s): its peers may have taken it for lost; "
                    "joining again with a new transport", self.task, stall, self.transport.peer_timeout)
        old = self._transport
        old.abort()
        deadline = time.monotonic() + self._timeout
        while True:
            new = self._plugins.create_transport(self._transport_name, old.cluster, old.task,
                                                 **self._transport_options)
            try:
                new.start()
                break
            except ConfigurationError:        # the old one's port not released yet
                new.abort()
                if time.monotonic() > deadline:
                    raise
                time.sleep(READY_POLL)
        endpoints.hold(new)               # a communicator made later shares the new one
        self._transport = new
        self._client = PSClient(new, timeout=self._timeout, pieces=self._client.pieces, interrupt=watch.check)
        self._client.hello()
        self._remote.client = self._client
        self._remote.mark_stale()

    def _place(self, variable) -> list:
        adopted = self._adoption.take(variable.name) if self._adoption is not None else None
        if adopted is not None:
            return adopted
        if not self.is_chief and not self.is_evaluator:   # an evaluator declares them to read them
            raise ConfigurationError(
                f"under parameter_server only the coordinator ({self.cluster.chief}) creates variables; "
                f"{self.task} serves the steps it sends"
            )
        return super()._place(variable)

    def _leave_with_error_impl(self, error: str) -> None:
        if getattr(self, "_coordinator", None) is None or self._closed:
            super()._leave_with_error_impl(error)
            return
        # The coordinator failed: the shards learn why, and the workers must not take the end for
        # a normal one (which tells them to exit 0): they are told the job failed, naming the task it
        # failed because of (a worker whose step raised, a lost shard, else this coordinator).
        self._exit_error = error
        blamed = self._coordinator.blamed
        culprit = blamed[0] if blamed is not None and str(blamed[1]) in error else self.task
        self._coordinator.abort(culprit, error)
        self._say_goodbye()
        # Not PSStrategyBase's fail(), whose shutdown() would tell the workers to exit normally.
        self._abandon(error)

    def _shutdown_impl(self) -> None:
        """On the coordinator: cancel what is queued, tell the workers to exit; then leave the shards."""
        coordinator = getattr(self, "_coordinator", None)
        if coordinator is not None:
            coordinator.shutdown()
        super()._shutdown_impl()
