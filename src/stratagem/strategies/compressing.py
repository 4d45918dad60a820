"""The ``compression`` option of the strategies that move gradients (``mirrored``, and the
parameter-server strategies' pushes).

``compression`` is ``None`` (default), a compressor's registered name with ``compression_options``, or
a :class:`~stratagem.compression.base.Compressor` (see :mod:`stratagem.compression.choice`). Such a
strategy puts :data:`OPTIONS` into its ``options``, resolves them with :func:`resolve` while checking
its options (before any transport exists) into ``strategy.compressor`` and
``strategy.compression_states`` (each variable's error-feedback residuals, PowerSGD's ``Q``), and
calls :func:`check_transport` once its transport exists. That state is this task's own: a strategy's
``save()`` does not write it, and after ``restore()`` it starts afresh (a residual is at most one step's
compression error; PowerSGD's ``Q`` warms up again within a few steps).

    >>> from stratagem.core.transport_factory import default_factory
    >>> config = {"compression": "fp16", "compression_options": None}
    >>> compressor, states = resolve("mirrored", config, default_factory())
    >>> compressor.name, type(states).__name__
    ('fp16', 'CompressionStates')
    >>> resolve("mirrored", OPTIONS, None)
    (None, None)
"""

from __future__ import annotations

from typing import Any, Mapping

from stratagem.compression import choice

#: The options (and their defaults) of a strategy that compresses what it sends.
OPTIONS = {"compression": None, "compression_options": None}


def resolve(strategy_name: str, config: Mapping[str, Any], plugins) -> tuple:
    """``(compressor, compression_states)`` for the strategy's options (``(None, None)``: gradients travel
    as they are); raises ``ConfigurationError`` naming the strategy for a bad choice."""
    compressor = choice.choose_compressor(config["compression"], config["compression_options"], plugins,
                                          owner=f"strategy {strategy_name!r}")
    return compressor, (choice.CompressionStates(compressor) if compressor is not None else None)


def check_transport(strategy) -> None:
    """Once ``strategy``'s transport exists: a compressor that cannot use it is refused with one
    ``IncompatibleError``, and the strategy is shut down first (its transport closed)."""
    try:
        choice.check_transport(strategy.compressor, type(strategy.transport), owner=f"strategy {strategy.name!r}")
    except BaseException:
        strategy.shutdown()
        raise
