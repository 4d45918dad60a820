"""The ``compression`` option of the strategies that move gradients (``mirrored``, and the
parameter-server strategies' pushes): a mixin of :class:`~stratagem.strategies.base.Strategy`.

``compression`` is ``None`` (default), a compressor's registered name with ``compression_options``, or
a :class:`~stratagem.compression.base.Compressor` (see :mod:`stratagem.compression.choice`); the
strategy resolves it while checking its options, before any transport exists, into
``strategy.compressor``, and keeps each variable's compression state (error-feedback residuals,
PowerSGD's ``Q``) in ``strategy.compression_states``. That state is this task's own: a strategy's
``save()`` does not write it, and after ``restore()`` it starts afresh (a residual is at most one step's
compression error; PowerSGD's ``Q`` warms up again within a few steps).
"""

from __future__ import annotations

from stratagem.compression.choice import CompressionStates, check_transport, choose_compressor


class Compressing:
    """``compression`` / ``compression_options`` for a strategy (mixed in before ``Strategy``)."""

    options = {"compression": None, "compression_options": None}

    #: The resolved compressor (``None``: gradients travel as they are).
    compressor = None

    def _choose_compressor(self) -> None:
        """Resolve the option (from ``check_config``, with the strategy's plugin factory)."""
        owner = f"strategy {self.name!r}"
        self.compressor = choose_compressor(self.config["compression"], self.config["compression_options"],
                                            self._plugins, owner=owner)
        #: This task's compression state of each variable (or ps piece), by name.
        self.compression_states = CompressionStates(self.compressor) if self.compressor is not None else None

    def _check_compressor_transport(self) -> None:
        """Once the transport exists: refuse (one ``IncompatibleError``) a compressor that cannot use it."""
        try:
            check_transport(self.compressor, type(self.transport), owner=f"strategy {self.name!r}")
        except BaseException:
            self.shutdown()
            raise
