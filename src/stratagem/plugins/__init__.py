"""The plugin host: strategies and transports are plugins found through pluggy hooks (README: "Writing a plugin").

What a plugin author needs is importable from here, cheaply (importing this package loads no plugin
and reads no entry point)::

    from stratagem.plugins import PluginSpec, hookimpl

    @hookimpl
    def stratagem_add_transports():
        return [PluginSpec("loopback", "my_package.loopback:LoopbackTransport", "transport")]

and declare the module in the entry-point group ``stratagem`` of your package. The process's
registry is :func:`plugin_manager` (built-ins plus entry-point plugins); ``stratagem info`` lists it.
"""

from __future__ import annotations

from stratagem.plugins.hookspecs import ENTRY_POINT_GROUP, KINDS, PROJECT_NAME, PluginSpec, hookimpl, hookspec

__all__ = [
    "ENTRY_POINT_GROUP", "KINDS", "PROJECT_NAME", "PluginInfo", "PluginManager", "PluginSpec",
    "hookimpl", "hookspec", "plugin_manager", "reset_plugin_manager",
]

_LAZY = {"PluginInfo", "PluginManager", "plugin_manager", "reset_plugin_manager"}


def __getattr__(name: str):
    if name in _LAZY:
        from stratagem.plugins import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
