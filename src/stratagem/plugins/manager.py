"""The plugin registry: which strategies, transports and compressors exist, where each came from, and creating them.

:func:`plugin_manager` is the process's registry, built on first use: the built-ins
(:mod:`stratagem.plugins.builtin`) plus every plugin declared in the entry-point group ``stratagem``,
all registered through the same hooks. It is the only global mutable state of the library.

    >>> pm = PluginManager(autoload=False)           # built-ins only
    >>> {"local", "zmq"} <= set(pm.names("transport"))
    True
    >>> pm.transport_class("local").__name__
    'LocalTransport'
    >>> pm.transport_class("zmqq")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.PluginError: unknown transport 'zmqq'; known: ..., zmq (did you mean 'zmq'?)

Set ``STRATAGEM_DISABLE_PLUGIN_AUTOLOAD=1`` (or pass ``autoload=False``) to skip third-party plugins,
as ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does for pytest.
"""

from __future__ import annotations

import difflib
import os
import threading
import warnings
from typing import Mapping, NamedTuple

import pluggy

from stratagem.core.errors import ConfigurationError, PluginError
from stratagem.core.timeline_process import process_recorder
from stratagem.core.options import (
    DEFAULT_TRANSPORT,
    TRANSPORT_ENV,
    constructor_options,
    reject_unknown_options,
    secret_from_env,
    transport_name_from_env,
)
from stratagem.plugins import hookspecs
from stratagem.plugins.hookspecs import ENTRY_POINT_GROUP, KINDS, PROJECT_NAME, PluginSpec

#: Set to a non-empty value (other than 0/false/no) to load no third-party plugin.
DISABLE_AUTOLOAD_ENV = "STRATAGEM_DISABLE_PLUGIN_AUTOLOAD"
#: The source recorded for the plugins of :mod:`stratagem.plugins.builtin`.
BUILTIN_SOURCE = "builtin"
#: The pluggy name the built-in plugin module is registered under.
BUILTIN_PLUGIN_NAME = "stratagem.builtin"

_HOOKS = {"transport": "stratagem_add_transports", "strategy": "stratagem_add_strategies",
          "compressor": "stratagem_add_compressors"}


class PluginInfo(NamedTuple):
    """One row of :meth:`PluginManager.describe` (and of ``stratagem info``)."""

    kind: str
    name: str
    source: str
    usable: bool
    reason: str | None
    install_hint: str | None
    description: str
    target: str


class _Entry(NamedTuple):
    spec: PluginSpec
    source: str


class _LoadError(NamedTuple):
    name: str
    source: str
    target: str
    message: str


def _dist_label(dist) -> str:
    """``NAME VERSION`` of an importlib.metadata distribution (or pluggy's facade of one)."""
    try:
        name, version = dist.metadata["name"], dist.version
    except Exception:  # a damaged .dist-info (no METADATA): name it by its path
        name, version = None, None
    if not name:
        return f"the distribution at {getattr(dist, '_path', '?')}"
    return f"{name} {version}" if version else str(name)


def autoload_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """True if ``STRATAGEM_DISABLE_PLUGIN_AUTOLOAD`` asks to skip third-party plugins."""
    value = (os.environ if environ is None else environ).get(DISABLE_AUTOLOAD_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _base_class(kind: str) -> type:
    if kind == "transport":
        from stratagem.core.transport import Transport

        return Transport
    if kind == "compressor":
        from stratagem.compression.base import Compressor

        return Compressor
    from stratagem.strategies.base import Strategy

    return Strategy


class PluginManager:
    """A registry of strategy, transport and compressor plugins, on top of a :class:`pluggy.PluginManager`.

    Args:
        autoload: load third-party plugins from the entry-point group ``stratagem``. Default: yes,
            unless ``STRATAGEM_DISABLE_PLUGIN_AUTOLOAD`` is set.
        builtins: register the built-in plugins (:mod:`stratagem.plugins.builtin`).

    Plugins can also be registered at run time (a module or any object with :data:`hookimpl`
    functions), e.g. in tests::

        >>> from stratagem.plugins import PluginSpec, hookimpl
        >>> class Extra:
        ...     @hookimpl
        ...     def stratagem_add_transports(self):
        ...         return [PluginSpec("pigeon", "stratagem_pigeon:PigeonTransport", "transport",
        ...                            requires=("definitely_missing_module",),
        ...                            install_hint="pip install stratagem-pigeon")]
        >>> pm = PluginManager(autoload=False)
        >>> pm.register(Extra(), "extra", source="my tests")
        'extra'
        >>> pm.transport_class("pigeon")
        Traceback (most recent call last):
        ...
        stratagem.core.errors.PluginError: transport 'pigeon' is not usable here: No module named 'definitely_missing_module'. Install it with: pip install stratagem-pigeon
    """

    def __init__(self, *, autoload: bool | None = None, builtins: bool = True):
        self.autoload = (not autoload_disabled()) if autoload is None else bool(autoload)
        #: The underlying pluggy manager (``.hook`` calls the hooks).
        self.hooks = pluggy.PluginManager(PROJECT_NAME)
        self.hooks.add_hookspecs(hookspecs)
        self._lock = threading.RLock()
        self._sources: dict[str, str] = {}
        self._catalog: dict[str, dict[str, _Entry]] | None = None
        self._classes: dict[tuple[str, str], type] = {}
        #: Entry-point plugins that could not be loaded: (entry-point name, source) -> what went wrong.
        self.load_errors: dict[tuple[str, str], _LoadError] = {}
        if builtins:
            from stratagem.plugins import builtin

            self.register(builtin, name=BUILTIN_PLUGIN_NAME, source=BUILTIN_SOURCE)
        if self.autoload:
            self._load_entry_points()

    # -- registration ------------------------------------------------------------------------------
    def register(self, plugin: object, name: str | None = None, *, source: str | None = None) -> str:
        """Register a plugin object (a module, class or instance with :data:`hookimpl` functions).

        ``source`` is what ``stratagem info`` shows as its origin (default: ``"runtime (NAME)"``).
        Returns the name it was registered under.
        """
        try:
            registered = self.hooks.register(plugin, name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"cannot register plugin {name or plugin!r}: {exc}") from exc
        if registered is None:
            raise PluginError(f"plugin {name!r} is blocked and was not registered")
        with self._lock:
            self._sources[registered] = source or f"runtime ({registered})"
            self._invalidate()
        return registered

    def unregister(self, name: str) -> None:
        """Remove the plugin registered as ``name`` (its strategies, transports and compressors disappear)."""
        if self.hooks.get_plugin(name) is None:
            raise PluginError(f"no plugin registered as {name!r}; registered: {', '.join(self.sources())}")
        self.hooks.unregister(name=name)
        with self._lock:
            self._sources.pop(name, None)
            self._invalidate()

    def sources(self) -> dict[str, str]:
        """Registered plugins: pluggy name -> where it came from (``builtin``, ``DIST VERSION``)."""
        with self._lock:
            return dict(self._sources)

    def _invalidate(self) -> None:
        self._catalog = None
        self._classes.clear()

    def _load_entry_points(self) -> None:
        """Load every plugin of the entry-point group, one at a time with pluggy's loader.

        A plugin that fails to import (or whose name another distribution already declares) does not
        take the others down: it is recorded in :attr:`load_errors`, shown by ``stratagem info`` and
        named in lookup errors, and a ``RuntimeWarning`` says so.
        """
        import importlib.metadata

        declared: dict[str, tuple[str, str]] = {}  # entry-point name -> (source, target)
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                source = _dist_label(dist)
                if ep.name not in declared:
                    declared[ep.name] = (source, ep.value)
                elif declared[ep.name] != (source, ep.value):
                    self._load_error(ep.name, source, ep.value,
                                     f"the entry point {ep.name!r} is also declared by {declared[ep.name][0]}, "
                                     f"which takes precedence; uninstall one of them")
        for name, (source, target) in declared.items():
            if self.hooks.is_blocked(name):
                continue
            if self.hooks.get_plugin(name) is not None:
                self._load_error(name, source, target, f"the plugin name {name!r} is already taken by "
                                 f"{self._sources.get(name, 'another plugin')}; rename the entry point")
                continue
            try:
                self.hooks.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
            except Exception as exc:
                self._load_error(name, source, target, f"{type(exc).__name__}: {exc}")
        with self._lock:
            for plugin, dist in self.hooks.list_plugin_distinfo():
                name = self.hooks.get_name(plugin)
                if name is not None:
                    self._sources[name] = _dist_label(dist)
            self._invalidate()

    def _load_error(self, name: str, source: str, target: str, reason: str) -> None:
        message = f"plugin {name!r} of {source} failed to load: {reason}"
        self.load_errors[(name, source)] = _LoadError(name, source, target, message)
        warnings.warn(
            f"stratagem: {message}. Its plugins are unavailable; fix or uninstall it, "
            f"or set {DISABLE_AUTOLOAD_ENV}=1 to use the built-in plugins only",
            RuntimeWarning, stacklevel=4,
        )

    # -- the catalog -------------------------------------------------------------------------------
    def _collect(self) -> dict[str, dict[str, _Entry]]:
        with self._lock:
            if self._catalog is not None:
                return self._catalog
            try:
                self.hooks.check_pending()
            except pluggy.PluginValidationError as exc:
                source = self._sources.get(exc.plugin and self.hooks.get_name(exc.plugin), "a plugin")
                raise PluginError(f"{source}: {exc} (a misspelt hook name?)") from exc
            catalog: dict[str, dict[str, _Entry]] = {kind: {} for kind in KINDS}
            for kind in KINDS:
                hook_name = _HOOKS[kind]
                for impl in getattr(self.hooks.hook, hook_name).get_hookimpls():
                    if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
                        continue
                    source = self._sources.get(impl.plugin_name, impl.plugin_name)
                    for spec in self._call(impl, hook_name, source):
                        if spec.kind != kind:
                            raise PluginError(
                                f"{hook_name}() of {source} returned the {spec.kind} {spec.name!r}; "
                                f"return it from {_HOOKS[spec.kind]}() instead"
                            )
                        previous = catalog[kind].get(spec.name)
                        if previous is not None:
                            raise PluginError(
                                f"{kind} {spec.name!r} is provided twice: by {previous.source} "
                                f"({previous.spec.target_path}) and by {source} ({spec.target_path}). "
                                f"Uninstall one of them, or set {DISABLE_AUTOLOAD_ENV}=1 to use the "
                                f"built-in plugins only"
                            )
                        catalog[kind][spec.name] = _Entry(spec, source)
            self._catalog = catalog
            return catalog

    @staticmethod
    def _call(impl, hook_name: str, source: str) -> list[PluginSpec]:
        try:
            specs = impl.function()
        except Exception as exc:
            raise PluginError(f"{hook_name}() of {source} failed: {type(exc).__name__}: {exc}") from exc
        if specs is None:
            return []
        if isinstance(specs, (PluginSpec, str)) or not isinstance(specs, (list, tuple)):
            raise PluginError(f"{hook_name}() of {source} must return a list of PluginSpec, not {specs!r}")
        for spec in specs:
            if not isinstance(spec, PluginSpec):
                raise PluginError(
                    f"{hook_name}() of {source} returned {spec!r}; each item must be a "
                    f"stratagem.plugins.PluginSpec"
                )
        return list(specs)

    def names(self, kind: str) -> list[str]:
        """The names of every registered plugin of ``kind`` (``"transport"``, ``"strategy"`` or
        ``"compressor"``), sorted."""
        return sorted(self._catalog_of(kind))

    def _catalog_of(self, kind: str) -> dict[str, _Entry]:
        if kind not in KINDS:
            raise ConfigurationError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        return self._collect()[kind]

    def _entry(self, kind: str, name: str) -> _Entry:
        entries = self._catalog_of(kind)
        if isinstance(name, str) and name in entries:
            return entries[name]
        known = sorted(entries)
        message = f"unknown {kind} {name!r}; known: {', '.join(known) or 'none'}"
        other = next((k for k in KINDS if k != kind and isinstance(name, str) and name in self._collect()[k]), None)
        if other is not None:
            message += f" ({name!r} is a {other}, not a {kind})"
        elif isinstance(name, str):
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        if not known:
            message += f"; install a package that provides {kind} plugins"
        if self.load_errors:
            message += "; note: " + "; ".join(e.message for e in self.load_errors.values())
        raise PluginError(message)

    def spec(self, kind: str, name: str) -> PluginSpec:
        """The description registered for ``name`` (unknown names raise ``PluginError``)."""
        return self._entry(kind, name).spec

    def source(self, kind: str, name: str) -> str:
        """Where the plugin ``name`` came from: ``builtin`` or ``DISTRIBUTION VERSION``."""
        return self._entry(kind, name).source

    # -- classes -----------------------------------------------------------------------------------
    def plugin_class(self, kind: str, name: str) -> type:
        """The class of plugin ``name``, imported on first use.

        Raises ``PluginError`` for an unknown name (listing the known ones) and for a plugin that
        cannot be used here (with the reason and the install hint).
        """
        entry = self._entry(kind, name)
        with self._lock:
            cached = self._classes.get((kind, name))
        if cached is not None:
            return cached
        cls, reason = self._load(entry)
        if cls is None:
            raise self._unusable(entry, reason)
        with self._lock:
            self._classes[(kind, name)] = cls
        return cls

    def transport_class(self, name: str) -> type:
        """The transport class registered as ``name`` (see :meth:`plugin_class`)."""
        return self.plugin_class("transport", name)

    def strategy_class(self, name: str) -> type:
        """The strategy class registered as ``name`` (see :meth:`plugin_class`)."""
        return self.plugin_class("strategy", name)

    def compressor_class(self, name: str) -> type:
        """The compressor class registered as ``name`` (see :meth:`plugin_class`)."""
        return self.plugin_class("compressor", name)

    def _load(self, entry: _Entry) -> tuple[type | None, str | None]:
        spec = entry.spec
        reason = spec.missing()
        if reason:
            return None, reason
        try:
            cls = spec.load()
        except PluginError:
            raise
        except ImportError as exc:
            return None, str(exc) or type(exc).__name__
        except Exception as exc:
            raise PluginError(
                f"importing {spec.kind} {spec.name!r} ({spec.target_path}) from {entry.source} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        base = _base_class(spec.kind)
        if not issubclass(cls, base):
            raise PluginError(
                f"{spec.kind} {spec.name!r} from {entry.source} is {spec.target_path}, which is not a "
                f"subclass of {base.__module__}.{base.__qualname__}"
            )
        return cls, None

    @staticmethod
    def _unusable(entry: _Entry, reason: str) -> PluginError:
        spec = entry.spec
        message = f"{spec.kind} {spec.name!r} is not usable here: {reason}."
        if spec.install_hint:
            message += f" Install it with: {spec.install_hint}"
        else:
            message += f" (provided by {entry.source})"
        return PluginError(message)

    def usable(self, kind: str, name: str, *, check: bool = False) -> str | None:
        """Why plugin ``name`` cannot be used here, or ``None`` if it can.

        Without ``check`` only the required modules are looked up (nothing is imported); with it the
        class is imported and its ``check_usable()`` run.
        """
        return self._why_unusable(self._entry(kind, name), check)

    def _why_unusable(self, entry: _Entry, check: bool) -> str | None:
        if not check:
            return entry.spec.missing()
        try:
            cls, reason = self._load(entry)
            if cls is None:
                return reason
            cls.check_usable()
        except PluginError as exc:
            return str(exc)
        return None

    def describe(self, *, check: bool = False) -> list[PluginInfo]:
        """Every plugin: kind, name, source, whether it is usable here (and why not), the install hint.

        Cheap by default (required modules are looked up, not imported); ``check=True`` also imports
        each plugin and runs its own ``check_usable()``.
        """
        rows = []
        for kind in KINDS:
            for name, entry in sorted(self._collect()[kind].items()):
                reason = self._why_unusable(entry, check)
                spec = entry.spec
                rows.append(PluginInfo(kind, name, entry.source, reason is None, reason,
                                       spec.install_hint if reason else None, spec.description,
                                       spec.target_path))
        for error in self.load_errors.values():
            rows.append(PluginInfo("plugin", error.name, error.source, False, error.message,
                                   None, "entry point that failed to load", error.target))
        return rows

    # -- creating plugins --------------------------------------------------------------------------
    def create_transport(self, name: str, cluster=None, task=None, **options):
        """Create (not start) transport ``name`` for ``task`` of ``cluster``.

        ``cluster`` and ``task`` default to what ``ClusterResolver.from_env()`` finds; ``secret``
        defaults to ``STRATAGEM_SECRET``, ``recorder`` to the process's timeline recorder
        (``STRATAGEM_TIMELINE``: :mod:`stratagem.core.timeline_process`). Options the transport does not accept are refused with the
        list of those it does.

        >>> from stratagem.core.cluster import ClusterSpec
        >>> pm = PluginManager(autoload=False)
        >>> t = pm.create_transport("local", ClusterSpec({"worker": ["local:0"]}), "worker:0",
        ...                         **pm.transport_class("local").world_options())
        >>> t.start(); t.close()
        >>> pm.create_transport("local", ClusterSpec({"worker": ["local:0"]}), "worker:0", fabrik=1)
        Traceback (most recent call last):
        ...
        stratagem.core.errors.ConfigurationError: transport 'local' does not accept option(s) 'fabrik' (did you mean 'fabric'?); it accepts: fabric, limits, peer_timeout, recorder, secret, timeout
        """
        cls = self.transport_class(name)
        accepted = constructor_options(cls)
        if accepted is not None:
            reject_unknown_options(f"transport {name!r}", options, accepted)
        secret = None
        if cluster is None or task is None:
            from stratagem.core.cluster import ClusterResolver

            resolved = ClusterResolver.from_env()
            cluster = resolved.cluster if cluster is None else cluster
            task = resolved.task if task is None else task
            secret = resolved.secret
        else:
            secret = secret_from_env()
        if secret is not None and "secret" not in options and (accepted is None or "secret" in accepted):
            options["secret"] = secret
        if "recorder" not in options and (accepted is None or "recorder" in accepted):
            options["recorder"] = process_recorder()
        cls.check_usable()
        return cls(cluster, task, **options)

    def create_compressor(self, name: str, **options):
        """A new compressor ``name`` with ``options``. An unknown name is a ``PluginError`` listing the
        registered compressors; an option it does not take, a ``ConfigurationError`` listing those it does.

        >>> pm = PluginManager(autoload=False)
        >>> pm.create_compressor("topk", ratio=0.05).config
        {'error_feedback': True, 'ratio': 0.05}
        >>> pm.create_compressor("top_k")
        Traceback (most recent call last):
        ...
        stratagem.core.errors.PluginError: unknown compressor 'top_k'; known: bf16, fp16, powersgd, topk (did you mean 'topk'?)
        >>> pm.create_compressor("topk", rank=4)
        Traceback (most recent call last):
        ...
        stratagem.core.errors.ConfigurationError: compressor 'topk' does not accept option(s) 'rank'; it accepts: error_feedback, ratio
        """
        cls = self.compressor_class(name)
        cls.check_usable()
        return cls(**options)

    def transport_or_default(self, transport=None):
        """``transport`` if the caller named one (a name or a ``Transport``), else the environment's choice.

        The one place the default transport is decided, for ``stratagem.strategy()``,
        ``stratagem.communicator()`` and every ``Strategy(...)``: ``STRATAGEM_TRANSPORT`` (set by
        ``stratagem launch --transport T``), else ``zmq``. A name in the environment that is not a
        registered transport is refused with the known ones, saying where it came from.
        """
        if transport is not None:
            return transport
        name = transport_name_from_env()
        if name is None:
            return DEFAULT_TRANSPORT
        try:
            self.spec("transport", name)
        except PluginError as exc:
            raise ConfigurationError(
                f"{TRANSPORT_ENV}={name!r} in the environment (stratagem launch --transport sets it) names no "
                f"transport: {exc}. Fix or unset it, or pass transport= explicitly"
            ) from None
        return name

    def create_strategy(self, name: str, transport=None, **options):
        """Create strategy ``name`` over ``transport`` (a transport name, or a ``Transport`` instance;
        default: :func:`transport_or_default`, i.e. ``STRATAGEM_TRANSPORT``, else ``zmq``).

        The strategy resolves the cluster and creates and starts its transport; see
        :class:`stratagem.strategies.base.Strategy` for the options every strategy takes. A strategy that
        cannot run over the transport raises one ``IncompatibleError`` naming both, before anything
        is created.
        """
        from stratagem.strategies.base import check_compatible

        cls = self.strategy_class(name)
        transport = self.transport_or_default(transport)
        if isinstance(transport, str):
            check_compatible(cls, self.transport_class(transport), strategy_name=name, transport_name=transport)
        options.setdefault("plugins", self)
        return cls(transport, **options)

    def __repr__(self) -> str:
        try:
            counts = ", ".join(f"{len(v)} {k}(s)" for k, v in self._collect().items())
        except PluginError as exc:
            counts = f"broken: {exc}"
        return f"<PluginManager {counts}; plugins: {', '.join(self.sources())}>"


def transport_or_default(transport=None, manager: PluginManager | None = None):
    """``transport`` if the caller named one, else the environment's choice, checked against ``manager``
    (default: the process's registry). See :meth:`PluginManager.transport_or_default`.

    >>> transport_or_default("grpc")    # an explicit choice always wins
    'grpc'
    """
    return (plugin_manager() if manager is None else manager).transport_or_default(transport)


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def plugin_manager() -> PluginManager:
    """The process's plugin registry, created on first use (built-ins plus entry-point plugins)."""
    global _manager
    manager = _manager
    if manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = PluginManager()
            manager = _manager
    return manager


def reset_plugin_manager(manager: PluginManager | None = None) -> PluginManager | None:
    """Forget the process's registry (the next :func:`plugin_manager` call builds a fresh one), or
    replace it with ``manager``. Returns the previous one. For tests."""
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
    return previous
