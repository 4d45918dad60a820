"""The base class of every strategy (README: "Training with a strategy").

A strategy decides how replicas stay in sync; it moves data only through its transport and core's
collectives, never by importing a transport module. This base class owns what every strategy shares:
finding the cluster and this task, creating and starting the transport through the plugin registry,
``run``, ``reduce`` across the replicas, and shutting down. Strategies extend it (``mirrored``,
``parameter_server``, ...) and are registered as plugins (:mod:`stratagem.plugins`).

A one-task world over the in-process transport::

    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.transports.local import LocalFabric
    >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
    ...               transport_options={"fabric": LocalFabric()}) as strategy:
    ...     with strategy.scope():
    ...         pass                                  # stratagem.Variable(...)s are created here
    ...     loss = strategy.run(lambda x: float(np.mean(x ** 2)), args=(np.arange(4.0),))
    ...     strategy.reduce("mean", loss), strategy.num_replicas_in_sync, strategy.is_chief
    (3.5, 1, True)

The base also owns what every strategy shares around variables: ``scope()`` makes the strategy the
one that new variables (``stratagem.Variable``) and optimizers belong to (the context variable read
by ``current_strategy()``), ``variables`` lists them, ``distribute_dataset`` shards global batches
over the replicas, and ``save``/``restore`` write and read checkpoints
(:mod:`stratagem.training.checkpoint`) on the chief and share them with the other replicas.

Without ``cluster``/``task`` the cluster comes from the environment (``stratagem launch``,
``TF_CONFIG`` or ``mpiexec``); with several replicas ``reduce`` all-reduces over them with
:class:`stratagem.collectives.communicator.Communicator`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping

import numpy as np

from stratagem.core.cluster import ClusterResolver, ClusterSpec, TaskId, is_evaluator
from stratagem.core.errors import ConfigurationError, IncompatibleError, StratagemError
from stratagem.core import endpoints
from stratagem.core.lifecycle import end_at_exit
from stratagem.core.transport import Transport
from stratagem.core.options import declared_options, reject_unknown_options
from stratagem.core.transport_factory import default_factory
from stratagem.training.replica_sync import broadcast_arrays, broadcast_json, dtype_key, flatten_state, rebuild_state
from stratagem.training.sharding import shard_batch
from stratagem.strategies.checkpoints import DEFAULT_MAX_TO_KEEP, check_restorable, optimizer_name
from stratagem.strategies.training_state import TrainingState
from stratagem.training.variables import array_module, is_device_array, strategy_scope
from stratagem.strategies.distribute import (
    DistributedDataset,
    InputContext,
    LossScaling,
    ReduceOp,
    as_host,
    check_axis,
    finish_reduction,
    like_input,
    local_reduction,
    local_results,
    replica_context,
)

#: The reductions ``Strategy.reduce`` (and the collectives) know.
REDUCE_OPS = ("sum", "mean", "min", "max", "prod")
#: Keyword arguments every strategy takes besides its own ``options``.
BASE_KEYWORDS = ("cluster", "task", "transport_options", "plugins")


def check_compatible(strategy_cls: type, transport_cls: type, *, strategy_name: str | None = None,
                     transport_name: str | None = None) -> None:
    """Raise one ``IncompatibleError`` naming both plugins if the strategy cannot run over the transport.

    >>> from stratagem.transports.local import LocalTransport
    >>> class NeedsSockets(Strategy):
    ...     name = "needs_sockets"
    ...     @classmethod
    ...     def supports(cls, transport_class):
    ...         if transport_class.in_process:
    ...             return "it needs one process per task; use transport='zmq'"
    >>> check_compatible(NeedsSockets, LocalTransport)
    Traceback (most recent call last):
    ...
    stratagem.core.errors.IncompatibleError: strategy 'needs_sockets' cannot run over transport 'local': it needs one process per task; use transport='zmq'
    """
    reason = strategy_cls.supports(transport_cls)
    if reason:
        strategy_name = strategy_name or strategy_cls.name
        transport_name = transport_name or transport_cls.name
        raise IncompatibleError(
            f"strategy {strategy_name!r} cannot run over transport {transport_name!r}: {reason}"
        )


class Strategy:
    """Base class of every strategy plugin.

    Args:
        transport: the transport plugin's name (``"zmq"``, ``"local"``...), or a ``Transport`` instance
            the caller created (and keeps: ``shutdown`` does not close it). Default: the environment's
            ``STRATAGEM_TRANSPORT`` (``stratagem launch --transport``), else ``"zmq"``.
        cluster, task: this task's cluster and task; default: ``ClusterResolver.from_env()``.
        transport_options: options for the transport's constructor (``{"fabric": ...}`` for ``local``,
            ``{"timeout": 60}``...).
        plugins: where the transport named by ``transport`` comes from: a ``TransportFactory``
            (:mod:`stratagem.core.transport_factory`; default: the process's plugin registry).
        **options: the strategy's own options: the keys of its class attribute ``options``, whose
            values are the defaults. Others are refused with the list of known ones. The resolved
            values are in ``self.config``.

    **Writing a strategy** (the extension API; README: "Writing a plugin"). The user's API (``run``,
    ``reduce``, ``scope``, ``distribute_dataset``, ``save``...) and the collaborators' API (what
    variables, optimizers and adapters call: ``on_variable``, ``on_apply_gradients``, ``communicator``...)
    are final: each public method checks the strategy is open, validates its arguments once, records
    the timeline once, then calls one ``_<name>_impl`` hook. A subclass sets the class attributes
    ``name``, ``options`` (its own options and their defaults) and ``compression_refusal``, may override
    the classmethods ``supports`` and ``check_usable``, and overrides only these hooks (listed in
    ``EXTENSION_HOOKS``; tests/test_layout.py refuses a built-in strategy that overrides a public
    method), each called by the base at one point and nowhere else:

    - ``supports(transport_class)`` (classmethod): ``None``, or why this strategy cannot run over that
      transport (one ``IncompatibleError`` names both, before anything is created);
    - ``_check_config_impl()``: validate ``self.config`` (raise ``ConfigurationError``);
    - ``_run_impl(fn, args, kwargs)``: one step, arguments checked (``args`` a tuple, ``kwargs`` a
      dict), inside the timeline's step span; the base runs it here (``in_graph``, ``parameter_server``:
      elsewhere);
    - ``_reduce_impl(op, value, axis)``: ``reduce`` of a checked op and axis; the base's reduces along
      ``axis`` and combines the replicas' parts with ``_reduce_host_impl(op, value)`` (a host value
      across the replicas; ``in_graph``: of a ``PerReplica``);
    - ``_reduce_gradients_impl(pairs)``: the reduced gradients of checked ``(gradient, Variable)`` pairs
      (the base counts the step);
    - ``_distribute_dataset_impl(batches)``: this task's batches from an iterator of global batches,
      usually ``_shard_batches_impl(batches, rank, size)``: this replica's part of each;
    - ``_input_pipeline_impl()``: ``(num_input_pipelines, input_pipeline_id)`` of this task
      (``distribute_datasets_from_function``);
    - ``_scope_context_impl()``: a context manager entered by ``scope()`` around the user's block;
      ``_on_scope_end_impl(created, first=...)``: the outermost ``scope()`` block ended, with the
      variables it created (``first``: the first such block), e.g. to make the replicas agree on them;
    - ``_on_variable_impl(variable)``: a ``stratagem.Variable`` created inside ``scope()`` (checked and
      recorded by the base after it): decide where it lives;
    - ``_on_optimizer_impl(optimizer)``: an optimizer the strategy sees for the first time;
    - ``_on_apply_gradients_impl(optimizer, pairs)``: the sync point of ``optimizer.apply_gradients``:
      reduce and apply ``[(gradient, variable), ...]`` as the strategy does;
    - ``_num_replicas_impl()``: ``num_replicas_in_sync``; ``_communicator_options_impl()``: options of
      the replicas' communicator (``chunk_bytes``...);
    - ``_save_impl(path, max_to_keep)``, ``_restore_impl(path)``, ``_fingerprint_impl()``;
    - ``_shutdown_impl()``: the normal end (once); ``_leave_with_error_impl(error)``: the script is
      ending with an uncaught error: tell the peers, then ``_abandon()`` (the base's: the transport
      ends as after a failure).

    Subclasses use ``self.config``, ``self.transport``, ``self.cluster``, ``self.task``,
    ``self.training_state`` and the replicas' ``communicator`` (created on first use).
    ``stratagem.testing.strategy_contract`` is the conformance suite a new strategy should pass.
    """

    #: The strategy's registered short name.
    name: ClassVar[str] = "base"
    #: The strategy's own options and their defaults (merged with those of its base classes). Every
    #: strategy takes ``gradient_reduction``: ``"mean"`` (the replicas' gradients averaged, weighted by
    #: their rows) or ``"sum"`` (summed, TF's convention; see :mod:`stratagem.strategies.distribute`).
    options: ClassVar[Mapping[str, Any]] = {"gradient_reduction": "mean"}
    #: Why ``compression=`` is refused, for a strategy without that option (one ``IncompatibleError``).
    compression_refusal: ClassVar[str] = ("it takes no compression= option (the strategies that all-reduce or "
                                          "push gradients do: mirrored, between_graph, parameter_server)")
    #: The public names a subclass may override: its declarations. Every other public method is final.
    OVERRIDABLE: ClassVar[tuple[str, ...]] = ("name", "options", "compression_refusal", "supports", "check_usable")
    #: The hooks a subclass overrides instead of the public methods (see the class doc).
    EXTENSION_HOOKS: ClassVar[tuple[str, ...]] = (
        "_check_config_impl", "_run_impl", "_reduce_impl", "_reduce_host_impl", "_reduce_gradients_impl",
        "_distribute_dataset_impl", "_shard_batches_impl", "_input_pipeline_impl", "_scope_context_impl",
        "_on_scope_end_impl", "_on_variable_impl", "_on_optimizer_impl", "_on_apply_gradients_impl",
        "_num_replicas_impl", "_communicator_options_impl", "_make_communicator_impl", "_save_impl", "_restore_impl", "_fingerprint_impl",
        "_shutdown_impl", "_leave_with_error_impl",
    )

    def __init__(self, transport: "str | Transport | None" = None, *, cluster=None, task=None,
                 transport_options: Mapping[str, Any] | None = None, plugins=None, **options):
        defaults = self.option_defaults()
        if "compression" not in defaults and {"compression", "compression_options"} & set(options):
            raise IncompatibleError(f"strategy {self.name!r} cannot compress gradients: {self.compression_refusal}")
        reject_unknown_options(f"strategy {self.name!r}", options, [*defaults, *BASE_KEYWORDS])
        #: The strategy's options: defaults updated with what the caller passed.
        self.config: dict[str, Any] = {**defaults, **options}
        factory = plugins if plugins is not None else default_factory()
        self._plugins = factory     # where named plugins come from (transports; compressors: check_config)
        #: TF's loss idiom against this strategy's gradient reduction (stratagem.nn.compute_average_loss).
        self.loss_scaling = LossScaling(self.config["gradient_reduction"])
        #: The replica's variables, optimizers, step and batch share (handed to helpers that roll back).
        self.training_state = TrainingState()
        self._variables = self.training_state.variables     # name -> Variable, in creation order
        self._optimizers = self.training_state.optimizers   # optimizers seen (registered or applied)
        self._check_config_impl()
        self._communicator = None
        self._closed = False
        self._unsynced: list = []                 # created since the last outermost scope() block ended
        self._scope_depth = 0
        self._scopes_ended = 0
        self._pending_optimizer_state: dict | None = None  # restored before its optimizer was known
        transport = factory.transport_or_default(transport)   # None: STRATAGEM_TRANSPORT, else zmq
        if isinstance(transport, Transport):
            self._adopt(transport, cluster, task, transport_options)
        elif isinstance(transport, str):
            check_compatible(type(self), factory.transport_class(transport), transport_name=transport)
            # A communicator of this process already serves this task: share its transport.
            running = endpoints.shared(transport, *_where(cluster, task), transport_options,
                                       who=f"strategy {self.name!r}")
            if running is not None:
                self._transport, self._transport_name, self._owns_transport = running, transport, False
            else:
                created = factory.create_transport(transport, cluster, task, **dict(transport_options or {}))
                try:
                    created.start()
                except BaseException:
                    created.close()
                    raise
                endpoints.hold(created)
                self._transport, self._transport_name, self._owns_transport = created, transport, True
            self._transport_options = dict(transport_options or {})   # a worker may make it anew after a stall
        else:
            raise ConfigurationError(
                f"transport must be a transport name (e.g. 'zmq') or a Transport instance, "
                f"not {type(transport).__name__}"
            )
        # The plain script never calls shutdown(): end this strategy as the script ends
        # (stratagem.core.lifecycle): shut down after a normal end, leave with the error otherwise.
        end_at_exit(self)
        self.recorder.attach(self._transport, strategy=self.name)

    def _adopt(self, transport: Transport, cluster, task, transport_options) -> None:
        if transport_options:
            raise ConfigurationError(
                "transport_options apply only when the strategy creates its transport; "
                "pass them to the transport you created instead"
            )
        if cluster is not None and ClusterSpec(cluster) != transport.cluster:
            raise ConfigurationError(
                f"cluster {ClusterSpec(cluster)!r} differs from the transport's {transport.cluster!r}; "
                f"leave cluster= out when passing a transport"
            )
        if task is not None and TaskId.parse(task) != transport.task:
            raise ConfigurationError(
                f"task {TaskId.parse(task)} differs from the transport's {transport.task}; "
                f"leave task= out when passing a transport"
            )
        check_compatible(type(self), type(transport), transport_name=transport.name)
        transport.start()
        self._transport, self._transport_name, self._owns_transport = transport, transport.name, False

    # -- the training state (strategy.training_state), as the subclasses have always named it ----------
    @property
    def _step(self) -> int:
        """Updates applied through the strategy (``training_state.step``)."""
        return self.training_state.step

    @_step.setter
    def _step(self, value: int) -> None:
        self.training_state.step = value

    @property
    def _batch_share(self) -> float | None:
        """This replica's share of the last global batch (``training_state.batch_share``)."""
        return self.training_state.batch_share

    @_batch_share.setter
    def _batch_share(self, value: float | None) -> None:
        self.training_state.batch_share = value

    # -- class-level declarations ----------------------------------------------------------------
    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The strategy's options and their defaults, from ``options`` of this class and its bases."""
        return declared_options(cls)

    def _check_config_impl(self) -> None:
        """Hook: validate ``self.config`` (the options) before any transport exists; raise
        ``ConfigurationError``. The base has nothing to check."""

    @classmethod
    def supports(cls, transport_class: type) -> str | None:
        """``None`` if the strategy can run over ``transport_class``, else the reason it cannot
        (e.g. ``"it needs native all-reduce; use transport='nccl'"``). The base runs over any."""
        return None

    @classmethod
    def check_usable(cls) -> None:
        """Raise ``PluginError`` with the reason and the install hint if the strategy cannot run here."""

    # -- where this process sits -----------------------------------------------------------------
    @property
    def cluster(self) -> ClusterSpec:
        """The cluster this task belongs to."""
        return self._transport.cluster

    @property
    def task(self) -> TaskId:
        """This process's task."""
        return self._transport.task

    @property
    def is_chief(self) -> bool:
        """True on the chief (``chief:0``, else ``worker:0``): it initialises variables and saves."""
        return self.task == self.cluster.chief

    @property
    def is_evaluator(self) -> bool:
        """True on TF's side-car ``evaluator`` task: not a replica; it trains nothing."""
        return is_evaluator(self.task)

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas compute each step (the ``chief`` and ``worker`` tasks; ``in_graph``: the
        client's devices too; under ``mirrored``'s shrink: the current world)."""
        return self._num_replicas_impl()

    def _num_replicas_impl(self) -> int:
        """Hook: ``num_replicas_in_sync``; the base's: the ``chief`` and ``worker`` tasks."""
        return len(self.cluster.replicas())

    @property
    def gradient_reduction(self) -> str:
        """How the replicas' gradients combine: ``"mean"`` (default; weighted by rows) or ``"sum"`` (TF's)."""
        return self.loss_scaling.reduction

    @property
    def transport(self) -> Transport:
        """The started transport this strategy moves data with."""
        return self._transport

    @property
    def recorder(self):
        """This task's timeline recorder, the transport's (:mod:`stratagem.core.timeline`): what runs
        under the strategy records there, unconditionally (off, it does nothing)."""
        return self._transport.recorder

    @property
    def transport_name(self) -> str:
        """The transport plugin's name (``"zmq"``...)."""
        return self._transport_name

    @property
    def variables(self) -> list:
        """The variables created in this strategy's ``scope()``, in creation order (a new list)."""
        return list(self._variables.values())

    # -- the user's API ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Context in which variables and optimizers are created by (and belong to) this strategy.

        Inside it, ``current_strategy()`` is this strategy, so ``stratagem.Variable(...)`` registers
        with it and an optimizer remembers it. Blocks may nest; when the outermost block ends without
        an error, the strategy finishes the variables created in it (``mirrored``: checks that every
        replica created the same ones, then copies the chief's initial values to all).

        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.training.variables import current_strategy
        >>> from stratagem.transports.local import LocalFabric
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     with strategy.scope():
        ...         inside = current_strategy() is strategy
        ...     inside, current_strategy() is None
        (True, True)
        """
        self._check_open()
        outermost = self._scope_depth == 0
        self._scope_depth += 1
        try:
            with strategy_scope(self), self._scope_context_impl():
                yield self
        finally:
            self._scope_depth -= 1
        if outermost:
            created, self._unsynced = self._unsynced, []
            first = self._scopes_ended == 0
            self._scopes_ended += 1
            self._on_scope_end_impl(created, first=first)

    def _scope_context_impl(self):
        """Hook: the context ``scope()`` enters around the user's block (the base's does nothing)."""
        return contextlib.nullcontext()

    def _on_scope_end_impl(self, created: list, *, first: bool) -> None:
        """Hook: the outermost ``scope()`` block ended without an error, having created the variables
        ``created`` (``first``: it is the first block to end). The base does nothing."""

    # -- the collaborators' API: what variables, optimizers and adapters call ----------------------------
    def on_variable(self, variable) -> None:
        """Called by ``Variable(...)`` inside ``scope()``: make ``variable`` this strategy's.

        Names are unique per strategy. The strategy decides where the variable lives
        (``_on_variable_impl``: the base and ``mirrored`` keep the variable's own local value), then
        records it.
        """
        self._check_open()
        name = variable.name
        existing = self._variables.get(name)
        if existing is not None and existing is not variable:
            raise ConfigurationError(
                f"strategy {self.name!r} already has a variable named {name!r}; give each variable a "
                f"distinct name= (or leave name= out to get a unique default)"
            )
        self._on_variable_impl(variable)
        self._variables[name] = variable
        self._unsynced.append(variable)

    def _on_variable_impl(self, variable) -> None:
        """Hook: decide where a new variable of this strategy lives (the base: its own local value)."""

    def on_optimizer(self, optimizer) -> None:
        """Record ``optimizer`` as one of this strategy's, so that ``save``/``restore`` include its state.

        An optimizer created in ``scope()`` may call it; every optimizer is also recorded at its first
        ``apply_gradients``. Optimizer state restored before the optimizer was known is loaded now.
        """
        if any(known is optimizer for known in self._optimizers):
            return
        self._optimizers.append(optimizer)
        if self._pending_optimizer_state is not None:
            state, self._pending_optimizer_state = self._pending_optimizer_state, None
            optimizer.load_state_dict(state)
        self._on_optimizer_impl(optimizer)

    def _on_optimizer_impl(self, optimizer) -> None:
        """Hook: ``optimizer`` was recorded, the first time this strategy sees it. The base does nothing."""

    def on_apply_gradients(self, optimizer, pairs: list):
        """The sync point of ``optimizer.apply_gradients``; ``pairs`` is a list of ``(grad, Variable)``.

        The base applies them locally (``optimizer.apply_dense``); ``mirrored`` all-reduces them
        first; a parameter-server strategy pushes them to the shards; ``in_graph`` records them in a
        step and applies them on the client.
        """
        self._check_open()
        return self._on_apply_gradients_impl(optimizer, list(pairs))

    def _on_apply_gradients_impl(self, optimizer, pairs: list):
        """Hook: reduce and apply ``pairs`` as the strategy does; the base applies them locally."""
        self._check_trains()
        self.on_optimizer(optimizer)
        result = optimizer.apply_dense(pairs)
        self._step += 1
        return result

    def _check_trains(self) -> None:
        """Refuse to apply gradients on an evaluator (TF's semantics: it evaluates, never trains)."""
        if self.is_evaluator:
            raise ConfigurationError(
                f"{self.task} is an evaluator: evaluators do not train, so it cannot apply_gradients(); "
                f"it reads the variables (from the ps tasks under between_graph/parameter_server) or the "
                f"checkpoints the chief writes. Train on 'chief' and 'worker' tasks"
            )

    def reduce_gradients(self, grads_and_vars) -> list:
        """The replicas' gradients, reduced as ``apply_gradients`` would reduce them, but not applied.

        ``grads_and_vars`` is a list of ``(gradient, Variable)`` pairs (numpy or cupy gradients of the
        variables' shapes). Returns the reduced gradients, in order, for an update rule that runs
        outside stratagem (``stratagem.torch.DistributedOptimizer`` hands them to a ``torch.optim``
        optimizer); the call counts as a step for ``save``. Every replica must call it with gradients
        for the same variables. The returned arrays may be views into buffers reused by the next call.

        The base (a strategy that applies gradients locally) and a world of one return them as they are;
        ``mirrored`` returns their weighted mean over the replicas. Strategies that reduce gradients
        elsewhere (on parameter servers) refuse it.

        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.training.variables import Variable
        >>> from stratagem.transports.local import LocalFabric
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     with strategy.scope():
        ...         w = Variable(np.zeros(2), name="w")
        ...     strategy.reduce_gradients([(np.ones(2), w)])
        [array([1., 1.])]
        """
        self._check_open()
        self._check_trains()
        pairs = list(grads_and_vars)
        for index, pair in enumerate(pairs):
            grad, var = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
            if grad is None or getattr(var, "strategy", None) is not self:
                raise ConfigurationError(
                    f"reduce_gradients() item {index}: pass (gradient, Variable) pairs of variables created "
                    f"in this strategy's scope(), without None gradients"
                )
        if not pairs:
            reduced = self._reduce_gradients_impl(pairs)
        else:
            with self.recorder.span("sync", "reduce_gradients", {"gradients": len(pairs)}):
                reduced = self._reduce_gradients_impl(pairs)
        self._step += 1
        return reduced

    def _reduce_gradients_impl(self, pairs: list) -> list:
        """Hook: the reduced gradients of checked ``pairs``, in order (the caller counts the step). The
        base applies gradients locally: it returns them as they are, in a world of one."""
        if self.num_replicas_in_sync > 1:
            raise ConfigurationError(
                f"strategy {self.name!r} does not reduce gradients apart from applying them; use "
                f"optimizer.apply_gradients (or the 'mirrored' strategy)"
            )
        return [grad for grad, _ in pairs]

    def distribute_dataset(self, dataset: Iterable) -> Iterator:
        """Yield this replica's shard of every global batch of ``dataset``.

        A batch is an array, or a tuple, list or dict of arrays with the same number of rows (numpy,
        cupy, PyTorch: anything with ``shape`` that slices). Rows are split like ``np.array_split``:
        with ``n`` rows and ``N`` replicas the first ``n % N`` replicas get ``n // N + 1`` rows, the
        others ``n // N``; shards are views, not copies. Every replica must iterate the same global
        batches (same data, same order: seed any shuffling alike). The strategy records each shard's
        share of its global batch so that the gradient average weighs each replica by its rows: N
        replicas then make the update one process would make on the whole batch.

        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.transports.local import LocalFabric
        >>> cluster = ClusterSpec({"worker": ["local:0", "local:1"]})
        >>> with Strategy("local", cluster=cluster, task="worker:1",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     batches = [(np.arange(5), np.arange(5) * 10)]          # one global batch of 5 rows
        ...     [(x.tolist(), y.tolist()) for x, y in strategy.distribute_dataset(batches)]
        [([3, 4], [30, 40])]
        """
        self._check_open()
        return self._distribute_dataset_impl(global_batches(dataset))

    def _distribute_dataset_impl(self, batches: Iterator) -> Iterator:
        """Hook: this task's batches from the iterator of global ``batches``; the base's: this
        replica's shard of each (:meth:`_shard_batches_impl`)."""
        rank, size = self._replica_rank("distribute_dataset()"), self.num_replicas_in_sync
        return self._shard_batches_impl(batches, rank, size)

    def experimental_distribute_dataset(self, dataset: Iterable, options=None) -> DistributedDataset:
        """TF's ``experimental_distribute_dataset``: :meth:`distribute_dataset` (each replica's part of every
        global batch), as an iterable that starts over each time it is iterated (``for epoch in ...: for
        x in dist_dataset``), when ``dataset`` can (a list). The split is TF's: a global batch of ``B``
        rows gives each of ``N`` replicas ``B // N`` rows, the first ``B % N`` one more. ``options`` is
        there for TF's signature and must be ``None``."""
        self._check_open()
        if options is not None:
            raise ConfigurationError("experimental_distribute_dataset() takes no options here; leave options out")
        global_batches(dataset)          # not iterable: say so now
        return DistributedDataset(lambda: self.distribute_dataset(dataset))

    def distribute_datasets_from_function(self, dataset_fn: Callable, options=None) -> DistributedDataset:
        """This replica's batches from ``dataset_fn(input_context)`` (TF's
        ``distribute_datasets_from_function``): ``input_context`` is an :class:`InputContext` saying
        which input pipeline this replica runs (``input_pipeline_id`` of ``num_input_pipelines``) and
        ``get_per_replica_batch_size(global_batch_size)``; ``dataset_fn`` returns an iterable of this
        replica's batches, already per replica, which is iterated as it is (again at each ``for``, if
        it can be). Every replica's batches count the same in the gradient mean."""
        self._check_open()
        if options is not None:
            raise ConfigurationError("distribute_datasets_from_function() takes no options here; leave options out")
        if not callable(dataset_fn):
            raise ConfigurationError(f"distribute_datasets_from_function() needs a function of an InputContext, "
                                     f"got {type(dataset_fn).__name__}")
        count, index = self._input_pipeline_impl()
        dataset = dataset_fn(InputContext(count, index, self.num_replicas_in_sync))
        global_batches(dataset)          # not iterable: say so now
        return DistributedDataset(lambda: self._per_replica_batches(global_batches(dataset)))

    def _per_replica_batches(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self._batch_share = None          # batches made per replica: every replica counts the same
            yield batch

    def _input_pipeline_impl(self) -> tuple[int, int]:
        """Hook: ``(num_input_pipelines, input_pipeline_id)`` of this task for ``distribute_datasets_from_function``:
        one pipeline per replica, this one's rank (``in_graph``: the client's one pipeline)."""
        return self.num_replicas_in_sync, self._replica_rank("distribute_datasets_from_function()")

    def _shard_batches_impl(self, batches: Iterator, rank: int, size: int) -> Iterator:
        """Hook: replica ``rank``'s part of each global batch of ``batches``, of ``size`` replicas,
        recording its share of the batch (the gradient weight)."""
        for index, batch in enumerate(batches):
            shard, rows, total = shard_batch(batch, rank, size, what=f"global batch {index}")
            self._batch_share = rows / total if total else 1.0 / size
            yield shard

    def _gradient_weight(self) -> float:
        """This replica's weight in the gradient average: its share of the last global batch that
        ``distribute_dataset`` yielded, else ``1 / num_replicas_in_sync``; under
        ``gradient_reduction="sum"``, 1 (the replicas' gradients are summed, as TF's strategies do)."""
        if self.gradient_reduction == "sum":
            self.loss_scaling.gradients_summed(self.num_replicas_in_sync, self.name)
            return 1.0
        if self._batch_share is None:
            return 1.0 / self.num_replicas_in_sync
        return self._batch_share

    @property
    def gradient_weight(self) -> float:
        """This replica's weight in the gradient average (its share of the last global batch that
        ``distribute_dataset`` yielded, else ``1 / num_replicas_in_sync``): what a gradient reduced
        outside ``reduce_gradients`` (``stratagem.torch``'s overlap with the backward pass) is scaled by."""
        return self._gradient_weight()

    def fingerprint(self) -> str:
        """A hex SHA-256 of every variable's name, dtype, shape and bytes (in name order).

        Replicas holding identical variables have identical fingerprints (tests compare them after
        every step). It reads only this replica's values: no communication.

        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.transports.local import LocalFabric
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     len(strategy.fingerprint())
        64
        """
        return self._fingerprint_impl()

    def _fingerprint_impl(self) -> str:
        """Hook: the fingerprint of this replica's variables (``in_graph`` reads them quietly)."""
        digest = hashlib.sha256()
        for name in sorted(self._variables):
            value = np.ascontiguousarray(self._variables[name].numpy())
            digest.update(json.dumps([name, value.dtype.str, list(value.shape)]).encode())
            digest.update(value.tobytes())
        return digest.hexdigest()

    def run(self, fn: Callable, args: tuple = (), kwargs: Mapping[str, Any] | None = None):
        """Run one step, ``fn(*args, **kwargs)``, and return its result.

        The base runs it on this replica; strategies change where it runs (``in_graph``: split over
        the replicas, returning a ``PerReplica``; ``parameter_server``: scheduled onto a worker).
        """
        self._check_open()
        if not callable(fn):
            raise TypeError(f"run() needs a callable step function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments, e.g. args=(x,), got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict) and not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a dict of keyword arguments, e.g. kwargs={{'x': x}}, "
                            f"got {type(kwargs).__name__}")
        args, kwargs = args if type(args) is tuple else tuple(args), dict(kwargs) if kwargs else {}
        with self.recorder.span("step", "step", {"step": self._step}):
            return self._run_impl(fn, args, kwargs)

    def _run_impl(self, fn: Callable, args: tuple, kwargs: dict):
        """Hook: run the step (arguments checked); the base runs it here, in this replica's context."""
        with replica_context(self):
            return fn(*args, **kwargs)

    def reduce(self, op: "str | ReduceOp", value, axis: int | None = None):
        """Combine ``value`` across the replicas with ``op`` (``ReduceOp.SUM``/``MEAN``, or the strings
        sum, mean, min, max, prod).

        Every replica must call it, in the same order. Returns the same kind of value it was given:
        an array for an array, a Python number for a number, a torch tensor for a torch tensor.

        After ``distribute_dataset``, ``mean`` weighs each replica by its share of the last global
        batch (its rows over the batch's), as the gradient average does: for a per-row mean such as a
        loss, the result is the whole batch's mean, what one process computes on the whole batch,
        also when the rows do not split evenly (an empty shard counts for nothing). Without it, every
        replica counts the same.

        With ``axis=k`` (TF's ``axis``), each replica first reduces its value along axis ``k``, then
        the replicas' results are combined: ``sum`` sums every element along that axis of the global
        batch, ``mean`` is their mean over the whole global batch (the replicas' sums over their total
        count), whatever the split.

        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.transports.local import LocalFabric
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     strategy.reduce(ReduceOp.MEAN, np.array([[1.0, 2.0], [3.0, 6.0]]), axis=0).tolist()
        [2.0, 4.0]
        """
        self._check_open()
        return self._reduce_impl(_check_op(op), value, check_axis(axis))

    def _reduce_impl(self, op: str, value, axis: int | None):
        """Hook: ``reduce`` of a checked ``op`` and ``axis``. The base's moves the value to the host,
        reduces it along ``axis`` and combines the replicas' parts with :meth:`_reduce_host_impl`."""
        host = as_host(value)
        if axis is None:
            return like_input(self._reduce_host_impl(op, host), value)
        parts = [local_reduction(op, v, axis) for v in local_results(host)]
        reduced = self._reduce_host_impl("sum" if op == "mean" else op, _combine_local(op, [p[0] for p in parts]))
        count = sum(p[1] for p in parts)
        if op == "mean":
            count = int(self._reduce_host_impl("sum", count))
        return like_input(finish_reduction(op, reduced, count), value)

    def _reduce_host_impl(self, op: str, value):
        """Hook: ``value`` (on the host) reduced with ``op`` across the replicas (``in_graph`` reduces
        a :class:`PerReplica`)."""
        self._replica_rank("reduce()")
        if self.num_replicas_in_sync == 1:
            return np.array(value, copy=True) if isinstance(value, np.ndarray) else value
        # np.asarray, not np.ascontiguousarray: that one turns a number into a 1-element array
        array = value if is_device_array(value) else np.asarray(value, order="C")
        if op == "mean" and self._batch_share is not None:
            result = self._comm().allreduce(_weighted(array, self._batch_share), op="sum")
        else:
            result = self._comm().allreduce(array, op=op)
        if isinstance(value, np.ndarray) or np.ndim(result) != 0:
            return result
        return np.asarray(result).item()

    def note_average_loss(self) -> None:
        """``stratagem.nn.compute_average_loss`` ran in this strategy's step: a ``ConfigurationError``
        under ``gradient_reduction="mean"``, which averages the gradients (see
        :class:`~stratagem.strategies.distribute.LossScaling`)."""
        self.loss_scaling.average_loss(self.name)

    def global_batch_rows(self, rows: int) -> int:
        """The rows of the global batch a replica batch of ``rows`` rows came from: from the last
        ``distribute_dataset`` batch's share when known, else ``rows * num_replicas_in_sync`` (TF's rule)."""
        share = self._batch_share
        if share:
            return int(round(rows / share))
        return rows * self.num_replicas_in_sync

    def experimental_local_results(self, value) -> tuple:
        """The values of ``value`` that this task holds, as a tuple (TF's ``experimental_local_results``):
        a ``PerReplica``'s values (``in_graph``), else ``(value,)``: one replica per task."""
        self._check_open()
        return local_results(value)

    @property
    def communicator(self):
        """The replicas' communicator (a :class:`~stratagem.collectives.communicator.Communicator`;
        under ``mirrored``'s shrink an elastic one), created on first use: what adapters all-reduce
        and broadcast with besides the gradients (``stratagem.torch``, ``stratagem.jax``)."""
        self._check_open()
        return self._comm()

    def _comm(self):
        """The replicas' communicator, made on first use by :meth:`_make_communicator_impl`."""
        if self._communicator is None:
            self._communicator = self._make_communicator_impl()
        return self._communicator

    def _make_communicator_impl(self):
        """A new communicator of the replicas, with :meth:`communicator_options` (``shutdown`` closes it)."""
        from stratagem.collectives.communicator import Communicator

        return Communicator(self._transport, name=f"strategy.{self.name}", **self.communicator_options())

    def communicator_options(self) -> dict[str, Any]:
        """Keyword arguments for the replicas' Communicator (``timeout``, ``chunk_bytes``...), for a
        communicator made besides the strategy's (``stratagem.torch``'s overlap with the backward pass)."""
        return dict(self._communicator_options_impl())

    def _communicator_options_impl(self) -> dict[str, Any]:
        """Hook: the options of the replicas' Communicator; the base's: none (the communicator's defaults)."""
        return {}

    def _replica_rank(self, what: str) -> int:
        """This task's rank among the replicas (chief first), or a ``ConfigurationError`` naming ``what``."""
        replicas = self.cluster.replicas()
        if self.task not in replicas:
            raise self._not_a_replica(what)
        return replicas.index(self.task)

    def _not_a_replica(self, what: str, instead: str | None = None) -> ConfigurationError:
        """The error for this task, which is no replica, taking part in ``what``: an evaluator is told
        what evaluators do; another task (``ps``) that the strategy runs on replicas only, and
        ``instead`` (what to do) if given."""
        if self.is_evaluator:
            return ConfigurationError(evaluator_refusal(self.task, self.name, what))
        if instead is None:
            return ConfigurationError(
                f"{self.task} is not a replica (a 'chief' or 'worker' task) and cannot take part in {what}")
        return ConfigurationError(f"{self.task} is not a replica: the {self.name} strategy runs on 'chief' and "
                                  f"'worker' tasks only ({instead})")

    def _chief_rank(self) -> int:
        return self.cluster.replicas().index(self.cluster.chief)

    # -- sharing with the other replicas ---------------------------------------------------------------
    def _share_from_chief(self, obj):
        """The chief's ``obj`` (plain JSON data) on every replica; the others pass ``None``."""
        if self.num_replicas_in_sync == 1:
            return obj
        return broadcast_json(self._comm(), obj, root=self._chief_rank())

    def _share_arrays_from_chief(self, specs: list[tuple], arrays: list) -> list:
        """The chief's ``arrays`` (of shapes and dtypes ``specs``: ``(shape, dtype)`` each) on every
        replica, sent as one broadcast per dtype. The others pass ``arrays=[]``."""
        if self.num_replicas_in_sync == 1:
            return list(arrays)
        return broadcast_arrays(self._comm(), specs, arrays if self.is_chief else None, root=self._chief_rank())

    # -- checkpoints: the chief writes and reads the files, the others get the outcome from it -------
    def save(self, path, *, max_to_keep: int = DEFAULT_MAX_TO_KEEP) -> str:
        """Write a checkpoint of the variables, the optimizer's state and the step into directory ``path``.

        Every replica calls it, at the same point of the program: the chief writes
        ``path/ckpt-<step>.npz`` and then the ``latest`` pointer, each atomically (a crash never leaves
        a corrupt checkpoint), keeping the newest ``max_to_keep``; the others wait for it. Returns the
        checkpoint file's path on every replica. If the chief cannot write it, every replica raises.
        The step is the number of updates applied through the strategy (restored by ``restore``).
        ``in_graph``: the client alone calls it. ``between_graph``/``parameter_server``: the chief
        reads every ps shard and writes the checkpoint; the other tasks need not call it (``None``).

        >>> import tempfile
        >>> from stratagem.core.cluster import ClusterSpec
        >>> from stratagem.training.variables import Variable
        >>> from stratagem.transports.local import LocalFabric
        >>> directory = tempfile.mkdtemp()
        >>> from stratagem.strategies.base import Strategy
        >>> with Strategy("local", cluster=ClusterSpec({"worker": ["local:0"]}), task="worker:0",
        ...               transport_options={"fabric": LocalFabric()}) as strategy:
        ...     with strategy.scope():
        ...         w = Variable(np.arange(3.0), name="w")
        ...     path = strategy.save(directory)
        ...     _ = w.assign(np.zeros(3))
        ...     step = strategy.restore(directory)
        ...     w.numpy(), step, path.endswith("ckpt-00000000.npz")
        (array([0., 1., 2.]), 0, True)
        """
        self._check_open()
        return self._save_impl(path, max_to_keep)

    def _save_impl(self, path, max_to_keep):
        """Hook: write the checkpoint (every replica calls it; the base: the chief writes, the others wait)."""
        self._replica_rank("save()")
        self._check_one_optimizer()
        status, failure = None, None
        if self.is_chief:
            status, failure = self._write_checkpoint(path, self._optimizer_state(), max_to_keep)
        status = self._share_from_chief(status)
        if "error" in status:
            if failure is not None:
                raise failure
            raise StratagemError(f"the chief ({self.cluster.chief}) could not save a checkpoint in {path}: "
                                 f"{status['error']}")
        return status["path"]

    def _check_one_optimizer(self) -> None:
        if len(self._optimizers) > 1:
            names = ", ".join(repr(optimizer_name(o)) for o in self._optimizers)
            raise ConfigurationError(
                f"save()/restore() keep one optimizer's state, but strategy {self.name!r} has "
                f"{len(self._optimizers)} optimizers ({names}); use a single optimizer per strategy"
            )

    def _optimizer_state(self) -> dict | None:
        """The state ``save`` stores: the one optimizer's ``state_dict()`` (or state restored for it)."""
        self._check_one_optimizer()
        if self._optimizers:
            return self._optimizers[0].state_dict()
        return self._pending_optimizer_state

    def _write_checkpoint(self, path, state, max_to_keep) -> tuple[dict, Exception | None]:
        """On the chief: write the checkpoint; return ``({"path": ...}, None)`` or ``({"error": ...}, exc)``."""
        from stratagem.training import checkpoint

        try:
            values = {name: var.numpy() for name, var in self._variables.items()}
            extra = {"strategy": self.name, "replicas": self.num_replicas_in_sync}
            written = checkpoint.save(path, values, state, self._step, extra=extra, max_to_keep=max_to_keep)
        except Exception as exc:  # noqa: BLE001 - told to every replica, then re-raised here
            return {"error": f"{type(exc).__name__}: {exc}"}, exc
        return {"path": str(written)}, None

    def restore(self, path) -> int:
        """Load the checkpoint ``path`` (a file, or a directory: its latest) into the variables and the
        optimizer; return its step.

        Every replica calls it; only the chief reads the file, then it sends the values and the
        optimizer state to the others, so every replica ends identical even without a shared
        filesystem. Call it after creating the variables (and the optimizer) in ``scope()``; the
        checkpoint must hold exactly those variables, with the same shapes and dtypes. An optimizer
        the strategy has not seen yet gets its state at its first ``apply_gradients``. See ``save``.
        ``between_graph``/``parameter_server``: the chief loads it onto the ps shards; the others
        refresh their values and get the global step.
        """
        self._check_open()
        return self._restore_impl(path)

    def _restore_impl(self, path) -> int:
        """Hook: load checkpoint ``path`` and return its step (the base: the chief reads, then shares it)."""
        self._replica_rank("restore()")
        arrays, failure, plan = [], None, None
        if self.is_chief:
            try:
                plan, arrays = self._read_checkpoint(path)
            except Exception as exc:  # noqa: BLE001 - told to every replica, then re-raised here
                plan, failure = {"error": f"{type(exc).__name__}: {exc}"}, exc
        plan = self._share_from_chief(plan)
        if "error" in plan:
            if failure is not None:
                raise failure
            raise StratagemError(f"the chief ({self.cluster.chief}) could not restore {path}: {plan['error']}")
        arrays = self._share_arrays_from_chief([tuple(spec) for spec in plan["arrays"]], arrays)
        names = plan["variables"]
        missing = [name for name in names if name not in self._variables]
        if missing:
            raise ConfigurationError(
                f"cannot restore {path} on {self.task}: the chief restored variable(s) "
                f"{', '.join(map(repr, missing))} that this replica did not create; create the same "
                f"variables on every replica"
            )
        for name, value in zip(names, arrays):
            self._variables[name].assign(value)
        if plan["optimizer"] is not None:
            self._load_optimizer_state(rebuild_state(plan["optimizer"], arrays[len(names):]))
        self._step = int(plan["step"])
        return self._step

    def _read_checkpoint(self, path) -> tuple[dict, list]:
        """On the chief: load and check the checkpoint; return the plan every replica follows and its arrays."""
        from stratagem.training import checkpoint

        loaded = checkpoint.load(path)
        check_restorable(self._variables, loaded.variables, path)
        names = list(self._variables)
        arrays = [np.asarray(loaded.variables[name]) for name in names]
        skeleton = None
        if loaded.optimizer_state is not None:
            skeleton, optimizer_arrays = flatten_state(loaded.optimizer_state)
            arrays += optimizer_arrays
        plan = {"step": int(loaded.step), "variables": names, "optimizer": skeleton,
                "arrays": [[list(a.shape), dtype_key(a.dtype)] for a in arrays]}
        return plan, arrays

    def _load_optimizer_state(self, state: dict) -> None:
        self._check_one_optimizer()
        if self._optimizers:
            self._optimizers[0].load_state_dict(state)
        else:
            self._pending_optimizer_state = state

    # -- lifecycle ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the communicator and close the transport (unless the caller passed it). Idempotent."""
        if self._closed:
            return
        self._shutdown_impl()

    def _shutdown_impl(self) -> None:
        """Hook: end normally, once (strategies first tell their peers; the base's releases the
        communicator and closes an owned transport, and marks the strategy closed)."""
        if self._closed:
            return
        self._closed = True
        communicator, self._communicator = self._communicator, None
        try:
            close = getattr(communicator, "close", None)
            if close is not None:
                close()
        finally:
            if self._owns_transport:
                self._transport.recorder.settle(self._transport)
                self._transport.close()

    def end_with_script(self, error: str | None) -> None:
        """End the way the script ended (:mod:`stratagem.core.lifecycle` calls it once at interpreter
        exit if the script did not shut the strategy down): ``shutdown()`` after a normal end; after an
        uncaught exception (``error``), :meth:`leave_with_error`."""
        if self._closed:
            return
        if error is None:
            self.shutdown()
        else:
            self.leave_with_error(error)

    def leave_with_error(self, error: str) -> None:
        """Leave after this task failed with ``error``: peers must learn at once that this task is gone
        rather than wait for it, so an owned transport ends as after a failure (with its goodbye; the
        mpi transport also ends the process). Unlike ``shutdown()`` nothing is said to peers as if
        training were over (an ``in_graph`` client does not release its replicas normally). Strategies
        whose peers can be told why (the parameter servers) do that first."""
        if self._closed:
            return
        self._leave_with_error_impl(error)

    def _leave_with_error_impl(self, error: str) -> None:
        """Hook: leave after the failure ``error``, once; the base's abandons the transport (:meth:`_abandon`)."""
        self._abandon(error)

    def _abandon(self, error: str) -> None:
        """Close as after a failure: no goodbye as if training were over; an owned transport ends as
        at a failed script's exit (peers learn at once that this task is gone)."""
        if self._closed:
            return
        self._closed = True
        self._communicator = None
        if self._owns_transport:
            self._transport.end_with_script(error)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StratagemError(f"{self!r} was shut down; create a new strategy")

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = " (shut down)" if self._closed else ""
        return (f"<{type(self).__name__} {self.name!r} over {self._transport_name!r} on {self.task}, "
                f"{self.num_replicas_in_sync} replica(s){state}>")


def _where(cluster, task) -> tuple[ClusterSpec, TaskId]:
    """The cluster and task a strategy runs on: those given, else the environment's."""
    if cluster is None or task is None:
        resolved = ClusterResolver.from_env()
        cluster = resolved.cluster if cluster is None else cluster
        task = resolved.task if task is None else task
    return ClusterSpec(cluster), TaskId.parse(task)


def global_batches(dataset) -> Iterator:
    """An iterator over what ``distribute_dataset()`` was given, or the error that says what it takes."""
    try:
        return iter(dataset)
    except TypeError:
        raise ConfigurationError(
            f"distribute_dataset() needs an iterable of global batches (a list, a generator...), "
            f"got {type(dataset).__name__}"
        ) from None


def evaluator_refusal(task, strategy_name: str, what: str) -> str:
    """Why evaluator ``task`` cannot take part in ``what`` under ``strategy_name``, and what it does instead."""
    return (
        f"{task} is an evaluator, not a replica, so it cannot take part in {what} under {strategy_name!r}: "
        f"an evaluator trains nothing and joins no all-reduce. Evaluate from the checkpoints the chief writes "
        f"(strategy.save(dir) on the replicas; on the evaluator stratagem.training.checkpoint.latest_checkpoint(dir) "
        f"and load(path).variables), or, with 'ps' tasks, read the variables from them under "
        f"between_graph/parameter_server"
    )


def _weighted(array, share: float):
    """``array`` times this replica's ``share`` of the batch, in a floating dtype; an empty shard's
    (share 0) is zeros, whatever its value (the mean over no rows is NaN)."""
    xp = array_module(array)
    dtype = array.dtype if np.issubdtype(array.dtype, np.floating) else np.dtype(np.float64)
    if share == 0:
        return xp.zeros(array.shape, dtype)
    weighted = xp.multiply(array, dtype.type(share), dtype=dtype)
    return np.asarray(weighted) if xp is np else weighted  # numpy makes a 0-d product a scalar


def _combine_local(op: str, values: list):
    """This task's replicas' parts of an axis reduction, combined (one replica per task: its part)."""
    if len(values) == 1:
        return values[0]
    stacked = np.stack([np.asarray(v) for v in values])
    return getattr(np, "sum" if op == "mean" else op)(stacked, axis=0)


def _check_op(op) -> str:
    if isinstance(op, ReduceOp):
        return op.value
    name = op.lower() if isinstance(op, str) else None
    if name not in REDUCE_OPS:
        raise ConfigurationError(f"unknown reduce op {op!r}; use one of: {', '.join(REDUCE_OPS)}")
    return name
