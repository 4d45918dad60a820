"""The plugin hooks and the description every hook returns (README: "Writing a plugin").

Stratagem's strategies, transports and gradient compressors are plugins, found through three `pluggy`_
hooks, one per kind. A plugin is any
module (or object) with functions marked :data:`hookimpl`; built-ins are registered by
:mod:`stratagem.plugins.builtin`, third-party packages by an entry point in the group ``stratagem``::

    # pyproject.toml of a third-party package
    [project.entry-points.stratagem]
    my_plugin = "my_package.stratagem_plugin"

    # my_package/stratagem_plugin.py
    from stratagem.plugins import PluginSpec, hookimpl

    @hookimpl
    def stratagem_add_transports():
        return [PluginSpec("ucx", "my_package.ucx:UcxTransport", "transport",
                           requires=("ucp",), install_hint="pip install ucx-py")]

Each hook returns :class:`PluginSpec` descriptions, not classes: the class behind a lazy target
``"package.module:Class"`` is imported only when it is used, so listing plugins (``stratagem info``)
never imports grpc, mpi4py or cupy.

.. _pluggy: https://pluggy.readthedocs.io
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import Union

import pluggy

from stratagem.core.errors import PluginError

#: pluggy project name: the marker of every hook and hook implementation.
PROJECT_NAME = "stratagem"
#: The entry-point group third-party plugins declare.
ENTRY_POINT_GROUP = "stratagem"
#: The kinds of plugin, each with its own hook.
KINDS = ("transport", "strategy", "compressor")

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a plugin's hook implementations: ``@hookimpl def stratagem_add_transports(): ...``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class PluginSpec:
    """One strategy, transport or compressor a plugin provides.

    Args:
        name: the short name users pass (``stratagem.strategy("mirrored", transport="zmq")``).
        target: the class, or a lazy import path ``"package.module:Class"`` imported on first use.
        kind: ``"transport"``, ``"strategy"`` or ``"compressor"``.
        requires: modules that must be importable for the plugin to work (``("mpi4py",)``). They are
            looked up with :func:`importlib.util.find_spec`, never imported, when plugins are listed.
        install_hint: the command that makes the plugin usable (``"pip install 'stratagem[mpi]'"``).
        description: one line for ``stratagem info``.

    >>> spec = PluginSpec("mpi", "stratagem.transports.mpi.transport:MpiTransport", "transport",
    ...                   requires=("definitely_missing_module",), install_hint="pip install 'stratagem[mpi]'")
    >>> spec.missing()
    "No module named 'definitely_missing_module'"
    >>> PluginSpec("local", "stratagem.transports.local:LocalTransport", "transport").load().__name__
    'LocalTransport'
    """

    name: str
    target: Union[str, type]
    kind: str
    requires: tuple = ()
    install_hint: Union[str, None] = None
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise PluginError(
                f"invalid plugin name {self.name!r}: use a letter then letters, digits, '_' or '-' (e.g. 'zmq')"
            )
        if self.kind not in KINDS:
            raise PluginError(f"plugin {self.name!r}: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if isinstance(self.target, str):
            if not _TARGET.match(self.target):
                raise PluginError(
                    f"{self.kind} {self.name!r}: target {self.target!r} is not 'package.module:Class'"
                )
        elif not isinstance(self.target, type):
            raise PluginError(
                f"{self.kind} {self.name!r}: target must be a class or 'package.module:Class', "
                f"not {type(self.target).__name__}"
            )
        requires = (self.requires,) if isinstance(self.requires, str) else tuple(self.requires)
        for module in requires:
            if not isinstance(module, str) or not module:
                raise PluginError(f"{self.kind} {self.name!r}: requires must be module names, got {module!r}")
        object.__setattr__(self, "requires", requires)
        if not isinstance(self.description, str):
            raise PluginError(f"{self.kind} {self.name!r}: description must be a string")

    @property
    def target_path(self) -> str:
        """The target as ``"package.module:Class"``, whether it was given lazily or as a class."""
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    @property
    def is_lazy(self) -> bool:
        """True if the class is imported only on first use."""
        return isinstance(self.target, str)

    def missing(self) -> str | None:
        """Why the plugin cannot be imported here (a missing module), or ``None`` if it can.

        Cheap: modules are looked up with :func:`importlib.util.find_spec`, not imported. A dotted
        name imports its parent packages, so list top-level modules in ``requires``.
        """
        modules = list(self.requires)
        if self.is_lazy:
            modules.append(self.target.partition(":")[0])
        for module in modules:
            try:
                found = importlib.util.find_spec(module)
            except (ImportError, ValueError) as exc:  # a parent package is missing or broken
                return str(exc) or f"No module named {module!r}"
            if found is None:
                return f"No module named {module!r}"
        return None

    def load(self) -> type:
        """Import and return the class (``ImportError`` propagates; the manager words it)."""
        if not self.is_lazy:
            return self.target
        module_name, _, qualname = self.target.partition(":")
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise PluginError(
                    f"{self.kind} {self.name!r}: {module_name} has no {qualname!r} "
                    f"(target {self.target!r}); the plugin's registration is wrong"
                ) from None
        if not isinstance(obj, type):
            raise PluginError(f"{self.kind} {self.name!r}: {self.target} is a {type(obj).__name__}, not a class")
        return obj


@hookspec
def stratagem_add_transports() -> list[PluginSpec]:
    """Return the transports this plugin provides, as ``PluginSpec(..., kind="transport")``.

    Called once per plugin manager, the first time a transport or strategy is looked up or listed
    (``stratagem.transport(...)``, ``stratagem.strategy(...)``, ``stratagem info``), after built-ins
    and entry-point plugins are registered. Return an empty list if the plugin adds none. Targets
    should be lazy (``"package.module:Class"``): the hook runs whenever plugins are listed, and must
    not import heavy libraries. Each class must subclass :class:`stratagem.core.transport.Transport`.
    """


@hookspec
def stratagem_add_strategies() -> list[PluginSpec]:
    """Return the strategies this plugin provides, as ``PluginSpec(..., kind="strategy")``.

    Called once per plugin manager, the first time a strategy or transport is looked up or listed,
    after built-ins and entry-point plugins are registered. Return an empty list if the plugin adds
    none. Each class must subclass :class:`stratagem.strategies.base.Strategy`, and may refuse
    transports it cannot run over with its ``supports(transport_class)`` classmethod.
    """


@hookspec
def stratagem_add_compressors() -> list[PluginSpec]:
    """Return the gradient compressors this plugin provides, as ``PluginSpec(..., kind="compressor")``.

    Called once per plugin manager, the first time any plugin is looked up or listed
    (``stratagem.compressor(...)``, a strategy given ``compression="NAME"``, ``stratagem info``), after
    built-ins and entry-point plugins are registered. Return an empty list if the plugin adds none.
    Targets should be lazy (``"package.module:Class"``); a compressor that needs a library names it in
    ``requires`` with an ``install_hint``, and is listed as unusable (with both) where it is missing.
    Each class must subclass :class:`stratagem.compression.base.Compressor`; check it with
    :class:`stratagem.testing.compressor_contract.CompressorContract`.
    """
