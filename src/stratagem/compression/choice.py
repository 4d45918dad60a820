"""How a strategy takes its ``compression`` option, and the per-variable state it keeps for it.

``compression`` is ``None`` (the default: gradients travel as they are), a registered compressor's name
with its options in ``compression_options``, or a :class:`~stratagem.compression.base.Compressor`
(``stratagem.compressor("topk", ratio=0.01)``), which carries its own options. Names are looked up in
the ``plugins=`` factory the strategy was given (the plugin registry by default), never imported here.

    >>> from stratagem.compression.topk import TopKCompressor
    >>> choose_compressor(TopKCompressor(ratio=0.1), None, None, owner="strategy 'mirrored'").config
    {'error_feedback': True, 'ratio': 0.1}
    >>> choose_compressor(TopKCompressor(), {"ratio": 0.1}, None, owner="strategy 'mirrored'")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: strategy 'mirrored': compression_options apply when compression is a name; pass the options to the compressor instead: stratagem.compressor('topk', ...)
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from stratagem.compression.base import Compressor
from stratagem.core.errors import ConfigurationError, IncompatibleError, PluginError


def choose_compressor(compression: Any, options: Mapping[str, Any] | None, factory, *, owner: str) -> Compressor | None:
    """The compressor a strategy's ``compression`` and ``compression_options`` name, or ``None``.

    ``factory`` creates compressors by name (``create_compressor(name, **options)``: the plugin
    registry). Every mistake is one ``ConfigurationError`` starting with ``owner``: an unknown name
    (listing the registered compressors), an option the compressor does not take (listing those it
    does), a value of the wrong kind.
    """
    if options is not None and not isinstance(options, Mapping):
        raise ConfigurationError(f"{owner}: compression_options must be a dict of the compressor's options, "
                                 f"got {type(options).__name__}")
    if compression is None:
        if options:
            raise ConfigurationError(f"{owner}: compression_options={dict(options)!r} given without "
                                     f"compression=; name the compressor too")
        return None
    if isinstance(compression, Compressor):
        if options:
            raise ConfigurationError(f"{owner}: compression_options apply when compression is a name; pass the "
                                     f"options to the compressor instead: stratagem.compressor({compression.name!r}, ...)")
        return compression
    if isinstance(compression, str):
        create = getattr(factory, "create_compressor", None)
        if create is None:
            raise ConfigurationError(f"{owner}: the plugins= factory ({type(factory).__name__}) cannot create "
                                     f"compressors by name; pass a Compressor: stratagem.compressor({compression!r})")
        try:
            return create(compression, **dict(options or {}))
        except (PluginError, ConfigurationError) as exc:
            raise ConfigurationError(f"{owner}: compression={compression!r}: {exc}") from None
    raise ConfigurationError(f"{owner}: compression must be None, a compressor's name ('fp16', 'bf16', 'topk', "
                             f"'powersgd', or another registered one) or a Compressor "
                             f"(stratagem.compressor(...)), not {type(compression).__name__}")


def check_transport(compressor: Compressor | None, transport_class: type, *, owner: str) -> None:
    """Raise one ``IncompatibleError`` if ``compressor``'s payloads cannot be reduced over the transport."""
    if compressor is None:
        return
    reason = compressor.supports(transport_class)
    if reason:
        raise IncompatibleError(f"{owner} cannot use compression {compressor.name!r} over transport "
                                f"{getattr(transport_class, 'name', transport_class.__name__)!r}: {reason}")


class CompressionStates:
    """The compressor's state of each variable (or piece of one), made on first use and remade when
    the variable's gradient changes shape or dtype.

    >>> from stratagem.compression.topk import TopKCompressor
    >>> states = CompressionStates(TopKCompressor())
    >>> sorted(states.get("w", (2, 3), np.float32))
    ['residual']
    >>> states.get("w", (2, 3), np.float32) is states.get("w", (2, 3), np.float32), len(states)
    (True, 1)
    """

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self._states: dict[str, tuple[tuple, np.dtype, dict]] = {}

    def get(self, key: str, shape, dtype) -> dict:
        shape, dtype = tuple(shape), np.dtype(dtype)
        held = self._states.get(key)
        if held is None or held[0] != shape or held[1] != dtype:
            held = self._states[key] = (shape, dtype, self.compressor.init_state(shape, dtype))
        return held[2]

    def __len__(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        """Forget every state (the next step starts each variable afresh)."""
        self._states.clear()

    def as_dict(self) -> dict[str, dict]:
        """Every state by key (the arrays themselves, not copies): what a caller checkpoints."""
        return {key: state for key, (_, _, state) in self._states.items()}
