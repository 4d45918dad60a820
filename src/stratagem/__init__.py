"""Stratagem: data-parallel training across processes and machines.

Strategies (how replicas stay in sync) and transports (how bytes move) are plugins, combined at run
time under one API::

    import numpy as np, stratagem
    comm = stratagem.communicator(transport="zmq")   # the world from `stratagem launch`, TF_CONFIG or mpiexec
    total = comm.allreduce(np.full(10, comm.rank, np.float32), op="sum")

Importing this package is light: transports' own libraries (grpc, mpi4py, cupy) and the strategies
are imported only when they are used.
"""

from __future__ import annotations

from stratagem.core import transport_factory as _transport_factory
from stratagem.core.cluster import ClusterResolver, ClusterSpec, TaskId
from stratagem.core.errors import (
    AuthenticationError,
    CollectiveMismatchError,
    CommunicationError,
    ConfigurationError,
    IncompatibleError,
    PeerLostError,
    PluginError,
    ProtocolError,
    StratagemError,
    TransportClosed,
    TransportTimeout,
    WorldChangedError,
)

from stratagem._version import __version__
from stratagem.core import user_errors as _user_errors

# A configuration or usage error that ends a script is printed as one line (STRATAGEM_TRACEBACK=1: the
# traceback); see stratagem.core.user_errors.
_user_errors.install()

#: Public names imported at first use (module, attribute), which keeps ``import stratagem`` light.
#: The errors among them are the ones callers catch: a lost ps shard, a failed in_graph replica, a
#: failed scheduled function, an unreadable checkpoint.
_LAZY = {
    "Variable": ("training.variables", "Variable"),
    "IndexedSlices": ("training.sparse", "IndexedSlices"),
    "device": ("ps_service.placement", "device"),
    "replica_device_setter": ("ps_service.placement", "replica_device_setter"),
    "ShardLostError": ("ps_service.protocol", "ShardLostError"),
    "ReplicaError": ("strategies.in_graph.client", "ReplicaError"),
    "ClosureError": ("strategies.ps.coordinator", "ClosureError"),
    "CheckpointError": ("training.checkpoint", "CheckpointError"),
    "CheckpointNotFoundError": ("training.checkpoint", "CheckpointNotFoundError"),
    "ReduceOp": ("strategies.distribute", "ReduceOp"),
    "InputContext": ("strategies.distribute", "InputContext"),
    "PerReplica": ("strategies.distribute", "PerReplica"),
}

__all__ = [
    "AuthenticationError", "ClusterResolver", "ClusterSpec", "CollectiveMismatchError",
    "CommunicationError", "ConfigurationError", "IncompatibleError", "PeerLostError", "PluginError",
    "ProtocolError", "StratagemError", "TaskId", "TransportClosed", "TransportTimeout", "WorldChangedError",
    "communicator", "compressor", "strategy", "transport", "plugin_manager", "__version__", "optimizers", "ray", "nn",
    *_LAZY,
]


def __getattr__(name: str):
    """The names of ``_LAZY``, ``stratagem.optimizers``, ``stratagem.nn``, the adapters ``stratagem.torch`` and
    ``stratagem.jax``, and ``stratagem.ray`` (jobs on a Ray cluster), imported at first use (keeps the
    import light: no torch, jax or ray until then)."""
    import importlib

    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
        globals()[name] = value
        return value
    if name in ("optimizers", "torch", "jax", "nn"):   # torch / jax: the adapters, which import those frameworks
        return importlib.import_module(f"{__name__}.{name}")  # importing sets the attribute
    if name == "ray":
        # stratagem.ray.run(...): jobs on a Ray cluster. Imports stratagem's engine, not Ray itself.
        module = importlib.import_module(f"{__name__}.launch.ray")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def transport(name: str, cluster=None, task=None, **options):
    """Create (not start) the transport plugin ``name`` for ``task`` of ``cluster``.

    Cluster and task default to what the environment says (``ClusterResolver.from_env()``).

    >>> import stratagem
    >>> t = stratagem.transport("local", stratagem.ClusterSpec({"worker": ["local:0"]}), "worker:0",
    ...                         **stratagem.plugin_manager().transport_class("local").world_options())
    >>> t.start(); t.close()
    """
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm().create_transport(name, cluster=cluster, task=task, **options)


def communicator(transport: str | None = None, **options):
    """A started communicator over ``transport`` for this task's world: collectives without a strategy.

    ``transport`` defaults to ``STRATAGEM_TRANSPORT`` from the environment (``stratagem launch
    --transport T`` sets it), else ``"zmq"``; a name given here always wins. The registered transports
    are listed by ``stratagem info`` (built in: ``zmq``, ``grpc``, ``mpi``, ``shm``, ``nccl``, ``local``).

    The world is the ``chief`` and ``worker`` tasks of the cluster found in the environment
    (``stratagem launch``, ``TF_CONFIG``, ``mpiexec``, Slurm; one process alone is a world of one); each
    has a ``rank`` (chief first). Options:

    - ``timeout``: seconds any one collective may wait for a peer (default: the transport's);
    - ``chunk_bytes``, ``small_bytes``: the pipeline chunk and the size below which a latency-optimal
      algorithm is used;
    - ``name``, ``members``: a named sub-communicator of some tasks only;
    - ``hierarchical=True``: large all-reduces inside each host first, then between hosts (hosts from
      the members' addresses; or ``[[0, 1], [2, 3]]``, each host's ranks): with ``transport="shm"`` and
      ``transport_options={"remote": "zmq"}``, shared memory inside a host and zmq between hosts;
    - ``transport_options={...}``: options of the transport's constructor.

    Run as ``stratagem launch --worker 2 -- python script.py`` to get two ranks; alone it is a world of one:

    >>> import numpy as np, stratagem
    >>> comm = stratagem.communicator(transport="local",
    ...                               transport_options=stratagem.plugin_manager().transport_class("local").world_options())
    >>> comm.rank, comm.size
    (0, 1)
    >>> comm.allreduce(np.arange(3, dtype=np.float32), op="sum")
    array([0., 1., 2.], dtype=float32)
    >>> comm.close()

    See :class:`stratagem.collectives.communicator.Communicator` for the collectives.
    """
    from stratagem.collectives.communicator import open_communicator

    return open_communicator(transport, **options)


def strategy(name: str, transport: str | None = None, **options):
    """Create the strategy plugin ``name`` over ``transport`` (cluster and task from the environment).

    ``transport`` defaults to ``STRATAGEM_TRANSPORT`` from the environment (``stratagem launch
    --transport T`` sets it), else ``"zmq"``; a name (or ``Transport``) given here always wins. A
    strategy that cannot run over the transport raises one ``IncompatibleError`` naming both.

    The built-in strategies and their main options (``stratagem info`` lists every registered one;
    an unknown option is refused with the list of known ones):

    - ``"mirrored"``: every replica holds every variable; gradients are all-reduced each step.
      ``bucket_bytes`` (gradient fusion), ``compression``, ``chunk_bytes``, ``small_bytes``, ``timeout``,
      ``on_failure`` (``"shrink"``: elastic training, the survivors of a lost replica go on) and
      ``commit_every``.
    - ``"between_graph"``: variables on ``ps`` tasks; each worker runs its own loop. ``mode``
      (``"async"``, ``"sync"``, ``"bounded"``), ``replicas_to_aggregate``, ``total_replicas``,
      ``staleness``, ``placement``, ``partition_bytes``, ``checkpoint_dir``, ``compression`` (of the
      pushes), ``timeout``.
    - ``"parameter_server"``: variables on ``ps`` tasks; the chief schedules step functions on the
      workers. The options of ``between_graph``, plus ``functions`` (how functions travel).
    - ``"in_graph"``: the chief splits each batch over its devices and the workers. ``devices``,
      ``on_replica_failure``, ``functions``, ``timeout``.

    ``compression`` is a compressor's name with ``compression_options={...}``, or one made by
    :func:`compressor` (see there). Every strategy also takes ``cluster=``, ``task=`` (default: the environment's),
    ``transport_options={...}`` and ``plugins=`` (where transports come from).

    >>> import numpy as np, stratagem
    >>> strategy = stratagem.strategy("mirrored", transport="local",
    ...     transport_options=stratagem.plugin_manager().transport_class("local").world_options())
    >>> with strategy.scope():
    ...     w = stratagem.Variable(np.zeros(2, np.float32))
    ...     opt = stratagem.optimizers.SGD(learning_rate=0.1)
    >>> def step(grad):
    ...     opt.apply_gradients([(grad, w)])
    >>> strategy.run(step, args=(np.ones(2, np.float32),))
    >>> w.value
    array([-0.1, -0.1], dtype=float32)
    >>> strategy.shutdown()
    """
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm().create_strategy(name, transport=transport, **options)


def compressor(name: str, **options):
    """A gradient compressor: the plugin ``name`` with ``options``, for a strategy's ``compression=``.

    Built in (``stratagem info`` lists every registered one): ``"fp16"`` and ``"bf16"`` (16-bit
    gradients, half the bytes; ``scale`` for fp16), ``"topk"`` (the ``ratio`` largest entries of each
    gradient, default 0.01) and ``"powersgd"`` (rank-``rank`` factors, default 1); each also takes
    ``error_feedback`` (on for topk and powersgd: what is not sent is added to the next step). An
    unknown name or option is an error listing the known ones.

    >>> import numpy as np, stratagem
    >>> topk = stratagem.compressor("topk", ratio=0.5)
    >>> state = topk.init_state((4,), np.float32)
    >>> topk.decompress(topk.compress(np.array([1.0, -4.0, 0.5, 2.0], np.float32), state))
    array([ 0., -4.,  0.,  2.], dtype=float32)
    >>> strategy = stratagem.strategy("mirrored", transport="local", compression=topk,
    ...     transport_options=stratagem.plugin_manager().transport_class("local").world_options())
    >>> strategy.compressor is topk
    True
    >>> strategy.shutdown()

    See :mod:`stratagem.compression.base` for the contract a compressor of your own implements.
    """
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm().create_compressor(name, **options)


def plugin_manager():
    """The process's plugin host (built-ins plus entry-point plugins)."""
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm()


# Strategies and communicators created without a factory (``MirroredStrategy("zmq")``) get their
# transports from the plugin registry: the runtime itself does not import the registry, which sits
# above it (see stratagem.core.transport_factory).
_transport_factory.set_default_factory(plugin_manager)
