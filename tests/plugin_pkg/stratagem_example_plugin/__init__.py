"""An example third-party Stratagem plugin.

Declared in its pyproject.toml as ``[project.entry-points.stratagem] example = "stratagem_example_plugin"``,
so ``stratagem info`` lists what these hooks return, and::

    import stratagem
    strategy = stratagem.strategy("solo", transport="loopback")

works once the package is installed, and so does ``compression="sign"`` (a compressor). Targets are lazy: listing plugins imports neither module below.
"""

from stratagem.plugins import PluginSpec, hookimpl

__version__ = "0.1.0"


@hookimpl
def stratagem_add_transports():
    return [
        PluginSpec(
            "loopback", "stratagem_example_plugin.loopback:LoopbackTransport", "transport",
            description="in-process transport that needs no shared fabric (example plugin)",
        ),
    ]


@hookimpl
def stratagem_add_strategies():
    return [
        PluginSpec(
            "solo", "stratagem_example_plugin.solo:SoloStrategy", "strategy",
            description="runs each step as is on in-process transports (example plugin)",
        ),
    ]


@hookimpl
def stratagem_add_compressors():
    return [
        PluginSpec(
            "sign", "stratagem_example_plugin.sign:SignCompressor", "compressor",
            description="signs and one scale per gradient, with error feedback (example plugin)",
        ),
    ]
