"""Gradient compression, the third kind of plugin: compressors (README: "Gradient compression").

The contract is :class:`~stratagem.compression.base.Compressor`; the built-ins are ``fp16`` and
``bf16`` (:mod:`~stratagem.compression.casts`), ``topk`` (:mod:`~stratagem.compression.topk`) and
``powersgd`` (:mod:`~stratagem.compression.powersgd`), registered like every plugin
(:mod:`stratagem.plugins.builtin`). Get one by name with ``stratagem.compressor("topk", ratio=0.01)``,
or let a strategy do it: ``stratagem.strategy("mirrored", compression="powersgd",
compression_options={"rank": 4})``. :mod:`~stratagem.compression.choice` is how strategies take the
option.
"""

from __future__ import annotations

from stratagem.compression.base import Compressed, Compressor

__all__ = ["Compressed", "Compressor"]
