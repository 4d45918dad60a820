"""Where strategies and communicators get a transport from, given its name: a :class:`TransportFactory`.

The runtime does not know the plugin registry: the registry (:mod:`stratagem.plugins`) sits above the
strategies and builds on them, so a strategy that looked transports up in it would close a cycle.
Instead a strategy or communicator is handed a factory (``plugins=`` on every ``Strategy``, the
registry itself when created through ``stratagem.strategy()``), and when none is handed over it asks
:func:`default_factory`, which the top-level package points at the process's plugin registry as it is
imported. Tests and embedders pass their own factory (e.g. a ``PluginManager(autoload=False)``).

    >>> factory = default_factory()           # the plugin registry, once ``import stratagem`` ran
    >>> factory.transport_class("local").__name__
    'LocalTransport'
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from stratagem.core.errors import ConfigurationError


@runtime_checkable
class TransportFactory(Protocol):
    """What a strategy or communicator needs from whoever knows the transports by name."""

    def transport_class(self, name: str) -> type:
        """The transport class registered as ``name`` (a ``PluginError`` listing the known ones if none)."""

    def create_transport(self, name: str, cluster=None, task=None, **options: Any):
        """A new, not yet started transport ``name`` for ``task`` of ``cluster`` (both default to the
        environment's), with the cluster secret from the environment unless ``secret=`` is given."""

    def transport_or_default(self, transport=None):
        """``transport`` if given (a name or a ``Transport``), else the environment's choice
        (``STRATAGEM_TRANSPORT``, else ``zmq``), checked against the registered names."""


# Set once, by ``stratagem/__init__.py`` as the package is imported: a function returning the
# process's plugin registry (looked up at each call, so resetting the registry in a test is seen).
_default: Callable[[], TransportFactory] | None = None


def set_default_factory(provider: Callable[[], TransportFactory]) -> None:
    """Make ``provider()`` the factory used when a strategy or communicator is given none."""
    global _default
    _default = provider


def default_factory() -> TransportFactory:
    """The factory to use when the caller handed none: the process's plugin registry."""
    if _default is None:   # only if stratagem.core was loaded without the package's __init__
        raise ConfigurationError("no transport factory: import stratagem (which installs the plugin registry) "
                                 "or pass plugins=<a PluginManager>")
    return _default()
