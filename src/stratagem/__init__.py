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
)

__version__ = "0.1.0"

#: Public names imported at first use (module, attribute), which keeps ``import stratagem`` light.
#: The errors among them are the ones callers catch: a lost ps shard, a failed in_graph replica, a
#: failed scheduled function, an unreadable checkpoint.
_LAZY = {
    "Variable": ("training.variables", "Variable"),
    "IndexedSlices": ("training.sparse", "IndexedSlices"),
    "device": ("ps.placement", "device"),
    "replica_device_setter": ("ps.placement", "replica_device_setter"),
    "ShardLostError": ("ps.protocol", "ShardLostError"),
    "ReplicaError": ("strategies.in_graph.client", "ReplicaError"),
    "ClosureError": ("strategies.ps.coordinator", "ClosureError"),
    "CheckpointError": ("training.checkpoint", "CheckpointError"),
    "CheckpointNotFoundError": ("training.checkpoint", "CheckpointNotFoundError"),
}

__all__ = [
    "AuthenticationError", "ClusterResolver", "ClusterSpec", "CollectiveMismatchError",
    "CommunicationError", "ConfigurationError", "IncompatibleError", "PeerLostError", "PluginError",
    "ProtocolError", "StratagemError", "TaskId", "TransportClosed", "TransportTimeout",
    "communicator", "strategy", "transport", "plugin_manager", "__version__", "optimizers", "ray",
    *_LAZY,
]


def __getattr__(name: str):
    """The names of ``_LAZY``, ``stratagem.optimizers``, the adapters ``stratagem.torch`` and
    ``stratagem.jax``, and ``stratagem.ray`` (jobs on a Ray cluster), imported at first use (keeps the
    import light: no torch, jax or ray until then)."""
    import importlib

    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
        globals()[name] = value
        return value
    if name in ("optimizers", "torch", "jax"):   # torch / jax: the adapters, which import those frameworks
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
    """A started communicator over ``transport`` for this task's world.

    ``transport`` defaults to ``STRATAGEM_TRANSPORT`` from the environment (``stratagem launch
    --transport T`` sets it), else ``"zmq"``; a name given here always wins.

    The world is the ``chief`` and ``worker`` tasks of the cluster found in the environment; each
    has a ``rank`` (chief first). See :class:`stratagem.collectives.communicator.Communicator`.
    """
    from stratagem.collectives.communicator import open_communicator

    return open_communicator(transport, **options)


def strategy(name: str, transport: str | None = None, **options):
    """Create the strategy plugin ``name`` over ``transport`` (cluster and task from the environment).

    ``transport`` defaults to ``STRATAGEM_TRANSPORT`` from the environment (``stratagem launch
    --transport T`` sets it), else ``"zmq"``; a name (or ``Transport``) given here always wins.
    """
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm().create_strategy(name, transport=transport, **options)


def plugin_manager():
    """The process's plugin host (built-ins plus entry-point plugins)."""
    from stratagem.plugins.manager import plugin_manager as _pm

    return _pm()
