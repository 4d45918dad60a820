"""The ``in_graph`` strategy: one client drives every replica (README: "In-graph replication").

The client (the chief task) holds the variables and the data. ``strategy.run(step, args=(x, y))``
splits ``x, y`` over the replicas, runs ``step`` on each with the current variable values, gathers the
gradients that each replica passed to ``apply_gradients``, and applies one update at the client:
synchronous by construction. The replicas are

- the client's own devices (option ``devices``: one CPU replica by default; ``devices=3`` for three
  CPU threads, ``["gpu:0", "gpu:1"]`` for two GPUs with cupy), computing in the client's process, and
- every other ``chief``/``worker`` task of the cluster, each one replica, computing in its process.

Each step:

1. every array argument (any leaf with rows, in tuples, lists, dicts) is split along its first axis
   like ``np.array_split``: with ``n`` rows and ``N`` replicas, in replica order (the client's devices,
   then the worker tasks in cluster order), the first ``n % N`` replicas get ``n // N + 1`` rows, the
   others ``n // N``; a replica with no rows does not run; other arguments go to every replica whole;
2. each remote replica gets the values of the variables that changed since it last saw them (each
   variable carries a version: it changes with every update through the strategy, every ``assign``,
   and every read of ``var.value`` or ``var.numpy()`` on the client outside ``run``, since the reader
   may write through the buffer it got), the step function (by name, or serialized: see below) and
   its shard;
3. the replicas run the step at once (the client's devices in threads: a step must not keep state of
   its own in objects the devices share, such as a PyTorch module's ``.grad``, when there are several);
   inside it ``apply_gradients`` records the gradients (a copy) instead of applying them, and a
   variable reads as its value on the replica's device;
4. the client adds the gradients up in replica order, each weighted by its shard's share of the rows,
   so the update is the one a single process makes on the whole batch (to float rounding, and
   deterministic), and applies it with the optimizer; ``run`` returns a :class:`PerReplica` of the
   step's return values, which ``strategy.reduce("mean", ...)`` combines (weighting by rows).

A step must not assign variables: the client applies the gradients after every replica is done. When
a step calls ``apply_gradients`` several times, every call's gradients come from the values at the
start of the step; the client applies them in order.

**Writing a script.** Every task runs the same script. On a worker task, the constructor
``stratagem.strategy("in_graph", ...)`` does not return: the task serves the client's steps there, and
exits (``SystemExit(0)``) when the client shuts the strategy down (``strategy.shutdown()``, the end of a
``with`` block, or the client's exit); a worker that loses the client exits with status 1 and a message.
In an authenticated cluster (a cluster secret: ``stratagem launch`` always sets one) the step functions
of the script travel serialized, so the plain TF1-style script works as written, training loop at the
top level. Without a secret they reach the replicas by name: the replica then imports a fresh copy of
the script (like ``multiprocessing``), whose top level creates the strategy (there it returns the
serving one), the variables and the functions; so put the training loop under
``if __name__ == "__main__":`` (which works either way)::

    strategy = stratagem.strategy("in_graph")             # worker tasks serve here, then exit
    with strategy.scope():
        w = stratagem.Variable(np.zeros((784, 10), np.float32), name="w")
        opt = stratagem.optimizers.Adam(1e-3)

    def step(x, y):                                       # top level: found by name on the replicas
        loss, grad = my_loss_and_gradient(w.value, x, y)
        opt.apply_gradients([(grad, w)])
        return loss

    if __name__ == "__main__":                            # the client only
        for x, y in global_batches:
            loss = strategy.reduce("mean", strategy.run(step, args=(x, y)))
        strategy.shutdown()

and run it with ``stratagem launch --worker 3 -- python train.py`` (3 replicas: the client's and two
worker tasks). Lambdas, closures and ``functools.partial`` objects travel serialized with cloudpickle,
only in an authenticated cluster (``STRATAGEM_SECRET``; ``stratagem launch`` sets one): see
:mod:`stratagem.strategies.in_graph.functions`. The worker tasks compute with numpy; the client's
devices may be GPUs.

**Failures.** An error in a step on a remote replica raises :class:`ReplicaError` naming it, with its
traceback. A replica that dies (or does not answer within ``timeout``) makes ``run`` raise
``PeerLostError`` (``TransportTimeout``) naming it; with ``on_replica_failure="continue"`` the client
logs it, leaves that replica out, and runs the step again on the others with the batch split over
them (so every update stays the whole batch's).

Two CPU replicas in one process::

    >>> import numpy as np
    >>> import stratagem
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.transports.local import LocalFabric
    >>> strategy = InGraphStrategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
    ...                            transport_options={"fabric": LocalFabric()}, devices=2)
    >>> with strategy.scope():
    ...     w = stratagem.Variable(np.zeros(2), name="w")
    ...     opt = stratagem.optimizers.SGD(learning_rate=1.0)
    >>> def step(x):
    ...     opt.apply_gradients([(x.mean(axis=0), w)])      # this shard's mean gradient
    ...     return float(x.sum())
    >>> out = strategy.run(step, args=(np.arange(10.0).reshape(5, 2),))
    >>> out.rows, out.values, w.numpy()                     # 3 + 2 rows; the mean over all 5 rows applied
    ((3, 2), (15.0, 30.0), array([-4., -5.]))
    >>> strategy.reduce("sum", out)
    45.0
    >>> strategy.shutdown()
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Any, Callable

import numpy as np

from stratagem.core.errors import ConfigurationError, JobFailedError, PeerLostError, TransportTimeout
from stratagem.core.failures import culprit_of
from stratagem.core.lifecycle import note_failure
from stratagem.strategies.base import Strategy
from stratagem.strategies.in_graph.client import Client, ReplicaError
from stratagem.strategies.in_graph.devices import CURRENT_STEP, ClientStore, parse_devices
from stratagem.strategies.in_graph.functions import MODES
from stratagem.strategies.in_graph.replica import ReplicaServer, StepContext
from stratagem.strategies.in_graph.batches import PerReplica, batch_rows, reduce_per_replica

__all__ = ["InGraphStrategy", "PerReplica", "ReplicaError"]

#: What ``on_replica_failure`` may be.
FAILURE_POLICIES = ("raise", "continue")

#: The worker strategy whose replica is importing the user's script (see ``InGraphStrategy.__new__``).
_SERVING: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_in_graph_serving", default=None)


class InGraphStrategy(Strategy):
    """One client splits each batch over its devices and the worker tasks (see the module doc).

    Options:
        devices: the client's own replicas: ``None`` (one CPU replica), a number of CPU replicas
            (threads), or a list of ``"cpu"`` / ``"gpu:N"`` (cupy). Worker tasks are one replica each.
        on_replica_failure: ``"raise"`` (default): a lost replica fails ``run``; ``"continue"``: leave
            it out and go on with the others.
        timeout: seconds ``run`` waits for a remote replica's answer after the client's own replicas
            finished, the client for the workers at start-up, and a worker for the client's first
            message (default: the transport's timeout).
        functions: how step functions reach remote replicas: ``"auto"`` (by name when defined at the
            top level of your code, else serialized if the cluster is authenticated), ``"name"``, or
            ``"pickle"`` (always serialized; needs a cluster secret).
        idle_timeout: on a worker task, seconds without a request after which it stops serving
            (default ``None``: as long as the client is alive).
        exit_after_serving: on a worker task, exit the process when serving ends (default). With
            ``False`` the constructor returns the shut-down strategy instead (or raises the
            ``PeerLostError`` that ended the serving): for embedding and tests.

    Plus every strategy's keywords (``cluster``, ``task``, ``transport_options``, ``plugins``).
    """

    name = "in_graph"
    compression_refusal = ("the replicas hand their gradients to the client, which merges them: there is no "
                           "all-reduce or push to compress. Use 'mirrored' (a compressed all-reduce) or "
                           "'between_graph'/'parameter_server' (compressed pushes to the ps tasks)")
    options = {
        "devices": None,
        "on_replica_failure": "raise",
        "timeout": None,
        "functions": "auto",
        "idle_timeout": None,
        "exit_after_serving": True,
    }

    def __new__(cls, *args, **kwargs):
        serving = _SERVING.get()
        if serving is not None and isinstance(serving, cls):
            return serving                   # the replica importing the script: its serving strategy
        return super().__new__(cls)

    def __init__(self, transport=None, **kwargs):
        if _SERVING.get() is self:
            return
        super().__init__(transport, **kwargs)
        self._role = ("client" if self.task == self.cluster.chief
                      else "worker" if self.task in self.cluster.replicas() else None)
        self._client: Client | None = None
        self._server: ReplicaServer | None = None
        self._versions = itertools.count(1)
        if self._role is None:
            refusal = self._not_a_replica("in-graph replication", "start no strategy on 'ps' tasks")
            self.shutdown()
            raise refusal
        if self._role == "worker":
            self._serve()
            return
        try:
            self._client = Client(self)
            self._client.start()
        except BaseException:
            self.shutdown()
            raise

    # -- options -----------------------------------------------------------------------------------
    def _check_config_impl(self) -> None:
        config = self.config
        parse_devices(config["devices"])
        if config["on_replica_failure"] not in FAILURE_POLICIES:
            raise ConfigurationError(f"on_replica_failure must be 'raise' or 'continue', not "
                                     f"{config['on_replica_failure']!r}")
        if config["functions"] not in MODES:
            raise ConfigurationError(f"functions must be one of {', '.join(map(repr, MODES))}, not "
                                     f"{config['functions']!r}")
        for option in ("timeout", "idle_timeout"):
            value = config[option]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigurationError(f"{option} must be a number of seconds > 0 (or None), got {value!r}")
        if not isinstance(config["exit_after_serving"], bool):
            raise ConfigurationError(f"exit_after_serving must be True or False, not {config['exit_after_serving']!r}")

    # -- the worker: serve, then leave -------------------------------------------------------------------
    def _serve(self) -> None:
        lost = None
        try:
            self._server = ReplicaServer(self, self._importing_script)
            self._server.serve(first_timeout=self.config["timeout"] or self.transport.timeout,
                               idle_timeout=self.config["idle_timeout"])
        except (PeerLostError, TransportTimeout, JobFailedError) as exc:
            lost = exc
        finally:
            self.shutdown()
        if self.config["exit_after_serving"]:
            if lost is None:
                raise SystemExit(0)
            message = f"stratagem in_graph: {self.task} stopped serving: {lost}"
            note_failure(message, culprit_of(lost))
            raise SystemExit(message)
        if lost is not None:
            raise lost

    @contextlib.contextmanager
    def _importing_script(self):
        """The context in which the replica imports the user's script (or unpickles a step)."""
        token = _SERVING.set(self)
        try:
            yield
        finally:
            _SERVING.reset(token)

    # -- where this process sits ----------------------------------------------------------------------
    def _num_replicas_impl(self) -> int:
        """How many replicas split each batch (the client's devices and the workers still in)."""
        if getattr(self, "_client", None) is None:
            return super()._num_replicas_impl()
        return sum(1 for r in self._client.replicas if r.alive)

    @property
    def replicas(self) -> list[str]:
        """The replicas that split each batch, in the order the rows are dealt."""
        return [r.label for r in self._client.replicas if r.alive] if self._client else []

    @property
    def lost_replicas(self) -> dict[str, str]:
        """The replicas left out after a failure (``on_replica_failure="continue"``), with the reason."""
        return dict(self._client.lost) if self._client else {}

    # -- variables ---------------------------------------------------------------------------------------
    def _on_variable_impl(self, variable) -> None:
        if self._role == "client":
            variable.store = ClientStore(variable.name, variable.store.read(), self._changed)
        elif self._server is not None:
            self._server.adopt(variable)

    def _changed(self, name: str) -> int:
        return next(self._versions)

    def _on_apply_gradients_impl(self, optimizer, pairs: list):
        context = CURRENT_STEP.get()
        if context is not None:
            context.record(optimizer, pairs)   # applied by the client once every replica is done
            return None
        if self._role != "client":
            raise ConfigurationError("under in_graph, apply_gradients() runs inside a step function, which "
                                     "the client runs through strategy.run()")
        return super()._on_apply_gradients_impl(optimizer, pairs)

    def _fingerprint_impl(self) -> str:
        with self._quiet_reads():
            return super()._fingerprint_impl()

    @contextlib.contextmanager
    def _quiet_reads(self):
        """Read the client's values without marking them changed (nothing writes meanwhile)."""
        token = CURRENT_STEP.set(StepContext())
        try:
            yield
        finally:
            CURRENT_STEP.reset(token)

    # -- the user's API -------------------------------------------------------------------------------------
    def _check_client(self, what: str) -> None:
        self._check_open()
        if _SERVING.get() is self:
            raise ConfigurationError(
                f"{what} was called while a replica ({self.task}) imported your script to find its step "
                f"functions: a replica runs the script's top level (to create the variables and define the "
                f"functions), so the training loop must not run there: put it under "
                f"`if __name__ == \"__main__\":` (as for multiprocessing). Or run with a cluster secret "
                f"(STRATAGEM_SECRET) and functions='pickle' to send step functions serialized"
            )
        if CURRENT_STEP.get() is not None:
            raise ConfigurationError(f"{what} cannot be called inside a step function")
        if self._role != "client":
            raise ConfigurationError(f"{what} is for the in_graph client ({self.cluster.chief}), not {self.task}")

    def _run_impl(self, fn: Callable, args: tuple, kwargs: dict) -> PerReplica:
        """Split the arguments' rows over the replicas, run ``fn`` on each, apply the merged gradients.

        Returns a :class:`PerReplica` of the replicas' return values (see the module doc).
        """
        self._check_client("strategy.run()")
        rows = batch_rows(("args", args), ("kwargs", kwargs))
        if rows == 0:
            raise ConfigurationError("the batch passed to run() has no rows")
        return self._client.step(fn, (args, kwargs), rows)

    def _reduce_impl(self, op: str, value, axis: int | None):
        """Combine a :class:`PerReplica` over the replicas with ``op`` (``ReduceOp.SUM``/``MEAN``, or
        sum, mean, min, max, prod; ``axis`` as in ``Strategy.reduce``).

        ``mean`` weighs each replica by its rows of the batch (for a per-row mean such as a loss, the
        whole batch's mean). Any other value is already the client's, and comes back as it is.
        """
        self._check_client("strategy.reduce()")
        return super()._reduce_impl(op, value, axis)

    def _reduce_host_impl(self, op: str, value):
        if isinstance(value, PerReplica):
            return reduce_per_replica(op, value)
        return np.array(value, copy=True) if isinstance(value, np.ndarray) else value

    def _input_pipeline_impl(self) -> tuple[int, int]:
        """The client reads the whole data in one pipeline (``run`` splits each batch over the replicas)."""
        self._check_client("strategy.distribute_datasets_from_function()")
        return 1, 0

    def _distribute_dataset_impl(self, batches):
        """Yield the global batches of ``dataset`` whole: under in_graph, ``run`` splits them.

        So a loop written for ``mirrored`` (``for x, y in strategy.distribute_dataset(batches):
        strategy.run(step, args=(x, y))``) runs unchanged.
        """
        self._check_client("strategy.distribute_dataset()")
        return self._whole(batches)

    @staticmethod
    def _whole(batches):
        for index, batch in enumerate(batches):
            batch_rows((f"global batch {index}", batch))
            yield batch

    def _save_impl(self, path, max_to_keep) -> str:
        self._check_client("strategy.save()")
        return super()._save_impl(path, max_to_keep)

    def _restore_impl(self, path) -> int:
        self._check_client("strategy.restore()")
        return super()._restore_impl(path)

    def _share_from_chief(self, obj):
        return obj                            # the client alone holds the variables

    def _share_arrays_from_chief(self, specs, arrays):
        return list(arrays)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _shutdown_impl(self) -> None:
        """Tell every worker task to stop serving (they exit), then close the transport."""
        if _SERVING.get() is self:
            return                            # a replica's script import: the replica keeps serving
        try:
            if getattr(self, "_client", None) is not None:
                self._client.release()
        finally:
            super()._shutdown_impl()

    def _leave_with_error_impl(self, error: str) -> None:
        """The script failed: on the client, first tell the replicas which task the job failed because
        of (a replica whose failure the last step raised, else this client), so that each names it."""
        client = getattr(self, "_client", None)
        if client is not None:
            blamed = client.blamed
            culprit = blamed[0] if blamed is not None and str(blamed[1]) in error else self.task
            client.abort(culprit, error)
        super()._leave_with_error_impl(error)

    def __repr__(self) -> str:
        if getattr(self, "_role", None) == "worker":
            return f"<{type(self).__name__} 'in_graph' replica {self.task}{' (shut down)' if self.closed else ''}>"
        return super().__repr__()

