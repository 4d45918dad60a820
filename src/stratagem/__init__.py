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

from .core.cluster import ClusterResolver, ClusterSpec, TaskId
from .core.errors import (
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

__all__ = [
    "AuthenticationError", "ClusterResolver", "ClusterSpec", "CollectiveMismatchError",
    "CommunicationError", "ConfigurationError", "IncompatibleError", "PeerLostError", "PluginError",
    "ProtocolError", "StratagemError", "TaskId", "TransportClosed", "TransportTimeout",
    "communicator", "strategy", "transport", "plugin_manager", "__version__",
    "Variable", "IndexedSlices", "optimizers", "device", "replica_device_setter",
]


def __getattr__(name: str):
    """``stratagem.Variable``, ``stratagem.IndexedSlices``, ``stratagem.optimizers``, ``stratagem.device``
    and ``stratagem.replica_device_setter``, imported at first use (keeps the import light)."""
    if name == "Variable":
        from .core.variables import Variable

        globals()["Variable"] = Variable
        return Variable
    if name == "IndexedSlices":
        from .core.sparse import IndexedSlices

        globals()["IndexedSlices"] = IndexedSlices
        return IndexedSlices
    if name in ("device", "replica_device_setter"):
        from .core import placement

        value = getattr(placement, name)
        globals()[name] = value
        return value
    if name == "optimizers":
        import importlib

        return importlib.import_module(f"{__name__}.optimizers")  # importing sets the attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def transport(name: str, cluster=None, task=None, **options):
    """Create (not start) the transport plugin ``name`` for ``task`` of ``cluster``.

    Cluster and task default to what the environment says (``ClusterResolver.from_env()``).

    >>> import stratagem
    >>> t = stratagem.transport("local", stratagem.ClusterSpec({"worker": ["local:0"]}), "worker:0",
    ...                         **stratagem.plugin_manager().transport_class("local").world_options())
    >>> t.start(); t.close()
    """
    from .plugins.manager import plugin_manager as _pm

    return _pm().create_transport(name, cluster=cluster, task=task, **options)


def communicator(transport: str = "zmq", **options):
    """A started communicator over ``transport`` for this task's world.

    The world is the ``chief`` and ``worker`` tasks of the cluster found in the environment; each
    has a ``rank`` (chief first). See :class:`stratagem.core.communicator.Communicator`.
    """
    from .core.communicator import open_communicator

    return open_communicator(transport, **options)


def strategy(name: str, transport: str = "zmq", **options):
    """Create the strategy plugin ``name`` over ``transport`` (cluster and task from the environment)."""
    from .plugins.manager import plugin_manager as _pm

    return _pm().create_strategy(name, transport=transport, **options)


def plugin_manager():
    """The process's plugin host (built-ins plus entry-point plugins)."""
    from .plugins.manager import plugin_manager as _pm

    return _pm()
