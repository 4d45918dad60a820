"""The base class of every strategy (DESIGN §6).

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
    ...         pass                                  # variables are created here (next issues)
    ...     loss = strategy.run(lambda x: float(np.mean(x ** 2)), args=(np.arange(4.0),))
    ...     strategy.reduce("mean", loss), strategy.num_replicas_in_sync, strategy.is_chief
    (3.5, 1, True)

Without ``cluster``/``task`` the cluster comes from the environment (``stratagem launch``,
``TF_CONFIG`` or ``mpiexec``); with several replicas ``reduce`` all-reduces over them with
:class:`stratagem.core.communicator.Communicator`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Mapping

from .cluster import ClusterSpec, TaskId
from .errors import ConfigurationError, IncompatibleError, StratagemError
from .transport import Transport

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
            the caller created (and keeps: ``shutdown`` does not close it).
        cluster, task: this task's cluster and task; default: ``ClusterResolver.from_env()``.
        transport_options: options for the transport's constructor (``{"fabric": ...}`` for ``local``,
            ``{"timeout": 60}``...).
        plugins: the plugin registry to create the transport with (default: the process's).
        **options: the strategy's own options: the keys of its class attribute ``options``, whose
            values are the defaults. Others are refused with the list of known ones. The resolved
            values are in ``self.config``.

    Subclasses set ``name``, ``options``, override ``supports`` to refuse transports they cannot run
    over, ``_scope`` to create variables their way, and ``run``.
    """

    #: The strategy's registered short name.
    name: ClassVar[str] = "base"
    #: The strategy's own options and their defaults (merged with those of its base classes).
    options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, transport: "str | Transport" = "zmq", *, cluster=None, task=None,
                 transport_options: Mapping[str, Any] | None = None, plugins=None, **options):
        from ..plugins.manager import plugin_manager, reject_unknown_options

        defaults = self.option_defaults()
        reject_unknown_options(f"strategy {self.name!r}", options, [*defaults, *BASE_KEYWORDS])
        #: The strategy's options: defaults updated with what the caller passed.
        self.config: dict[str, Any] = {**defaults, **options}
        self._communicator = None
        self._closed = False
        if isinstance(transport, Transport):
            self._adopt(transport, cluster, task, transport_options)
        elif isinstance(transport, str):
            manager = plugins if plugins is not None else plugin_manager()
            check_compatible(type(self), manager.transport_class(transport), transport_name=transport)
            created = manager.create_transport(transport, cluster, task, **dict(transport_options or {}))
            try:
                created.start()
            except BaseException:
                created.close()
                raise
            self._transport, self._transport_name, self._owns_transport = created, transport, True
        else:
            raise ConfigurationError(
                f"transport must be a transport name (e.g. 'zmq') or a Transport instance, "
                f"not {type(transport).__name__}"
            )

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

    # -- class-level declarations ----------------------------------------------------------------
    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The strategy's options and their defaults, from ``options`` of this class and its bases."""
        merged: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            merged.update(klass.__dict__.get("options", {}))
        return merged

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
    def num_replicas_in_sync(self) -> int:
        """How many replicas compute each step (the ``chief`` and ``worker`` tasks)."""
        return len(self.cluster.replicas())

    @property
    def transport(self) -> Transport:
        """The started transport this strategy moves data with."""
        return self._transport

    @property
    def transport_name(self) -> str:
        """The transport plugin's name (``"zmq"``...)."""
        return self._transport_name

    # -- the user's API ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Context in which variables (and optimizers) are created by the strategy.

        The base strategy creates nothing itself; subclasses override :meth:`_scope`.
        """
        self._check_open()
        with self._scope():
            yield self

    def _scope(self):
        """The context ``scope()`` enters; a subclass's hook (the base's does nothing)."""
        return contextlib.nullcontext()

    def run(self, fn: Callable, args: tuple = (), kwargs: Mapping[str, Any] | None = None):
        """Run one step, ``fn(*args, **kwargs)``, on this replica and return its result.

        Subclasses change where it runs (split over devices, scheduled onto workers).
        """
        self._check_open()
        if not callable(fn):
            raise TypeError(f"run() needs a callable step function, got {type(fn).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of positional arguments, e.g. args=(x,), got {type(args).__name__}")
        return fn(*args, **dict(kwargs or {}))

    def reduce(self, op: str, value):
        """Combine ``value`` across the replicas with ``op`` (sum, mean, min, max, prod).

        Every replica must call it, in the same order. Returns the same kind of value it was given:
        an array for an array, a Python number for a number.
        """
        self._check_open()
        op = _check_op(op)
        import numpy as np

        if self.task not in self.cluster.replicas():
            raise ConfigurationError(
                f"{self.task} is not a replica (a 'chief' or 'worker' task) and cannot take part in reduce()"
            )
        if self.num_replicas_in_sync == 1:
            return np.array(value, copy=True) if isinstance(value, np.ndarray) else value
        array = np.ascontiguousarray(value)
        result = self._comm().allreduce(array, op=op)
        if isinstance(value, np.ndarray) or np.ndim(result) != 0:
            return result
        return np.asarray(result).item()

    def _comm(self):
        if self._communicator is None:
            from .communicator import Communicator

            self._communicator = Communicator(self._transport, name=f"strategy.{self.name}")
        return self._communicator

    # -- lifecycle ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the communicator and close the transport (unless the caller passed it). Idempotent."""
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
                self._transport.close()

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


def _check_op(op) -> str:
    name = op.lower() if isinstance(op, str) else None
    if name not in REDUCE_OPS:
        raise ConfigurationError(f"unknown reduce op {op!r}; use one of: {', '.join(REDUCE_OPS)}")
    return name
