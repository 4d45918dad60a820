"""Compressed pushes: how a worker's compressed gradients travel in a ``push``, and how the ps task
expands them before applying (the strategies' ``compression=`` option; :mod:`stratagem.compression`).

A push whose dense gradients are compressed has ``compression`` in its metadata: ``{"name": the
compressor's name, "pieces": [one entry per piece of "names"]}``, where an entry is ``None`` (that
gradient travels as it is: one buffer) or ``[meta, count]`` (its ``count`` payload arrays, compressed
with ``meta``). The buffers are each piece's, in order, then the row gradients as in any push. The ps
task decompresses with its own compressor (the strategy's, so every task must be started with the same
``compression``), knowing each piece's shape and dtype: a payload that does not fit them is refused
before anything is allocated.

    >>> import numpy as np
    >>> from stratagem.compression.topk import TopKCompressor
    >>> topk = TopKCompressor(ratio=0.5)
    >>> spec = {"name": "w", "shape": [4], "dtype": "float32", "parts": 1, "lo": 0, "hi": 4}
    >>> wire, arrays = compress_pieces(topk, {"w": {}}, ["w"], [np.array([1, -4, 0.5, 2], np.float32)])
    >>> wire, len(arrays)
    ({'name': 'topk', 'pieces': [[{'k': 2}, 2]]}, 2)
    >>> expand_pieces(topk, "ps:0", wire, [spec], arrays)
    [array([ 0., -4.,  0.,  2.], dtype=float32)]
"""

from __future__ import annotations

from typing import Mapping, Sequence

from stratagem.compression.base import FLOAT_DTYPES, Compressed
from stratagem.core.errors import ProtocolError
from stratagem.ps_service.protocol import RequestRefused, piece_shape, spec_dtype


def compress_pieces(compressor, states: Mapping[str, dict], names: Sequence[str], grads: Sequence) -> tuple[dict, list]:
    """The ``compression`` metadata and the buffers of a push of ``grads`` (numpy, one per piece of
    ``names``); ``states[name]`` is each piece's compression state (updated). Gradients that are not
    floating point travel as they are."""
    entries, buffers = [], []
    for name, grad in zip(names, grads):
        if grad.dtype not in FLOAT_DTYPES:
            entries.append(None)
            buffers.append(grad)
            continue
        packed = compressor.compress(grad, states[name])
        entries.append([packed.meta, len(packed.payload)])
        buffers.extend(packed.payload)
    return {"name": compressor.name, "pieces": entries}, buffers


def expand_pieces(compressor, task, wire, specs: Sequence[dict], buffers: Sequence) -> list:
    """The push's buffers with each piece's payload replaced by its decompressed gradient (the row
    gradients that follow are left as they are). ``specs`` are the pieces' specs, in the push's order;
    ``task`` names this ps task in errors. Raises ``RequestRefused`` naming what does not fit."""
    if not isinstance(wire, dict) or not isinstance(wire.get("pieces"), list):
        raise RequestRefused(f"push: compression must be a dict with 'name' and 'pieces', got {wire!r}")
    name = wire.get("name")
    if compressor is None:
        raise RequestRefused(
            f"the push is compressed with {name!r} but {task} was started without compression: start every "
            f"task (the ps tasks too) with the same compression= option")
    if name != compressor.name:
        raise RequestRefused(
            f"the push is compressed with {name!r} but {task} decompresses {compressor.name!r}: start every "
            f"task with the same compression= option")
    entries = wire["pieces"]
    if len(entries) != len(specs):
        raise RequestRefused(f"push: {len(specs)} piece(s) but {len(entries)} compression entries")
    out, at = [], 0
    for spec, entry in zip(specs, entries):
        if entry is None:
            count, meta = 1, None
        elif (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], dict)
              and isinstance(entry[1], int) and not isinstance(entry[1], bool) and entry[1] >= 0):
            meta, count = entry
        else:
            raise RequestRefused(f"push: bad compression entry {entry!r} for piece {spec['name']!r}")
        if at + count > len(buffers):
            raise RequestRefused(f"push: piece {spec['name']!r} needs {count} buffer(s), "
                                 f"{len(buffers) - at} left")
        arrays = buffers[at:at + count]
        at += count
        if meta is None:
            out.append(arrays[0])
            continue
        try:
            out.append(compressor.decompress(Compressed(tuple(arrays), piece_shape(spec), spec_dtype(spec), meta)))
        except ProtocolError as exc:
            raise RequestRefused(f"push: piece {spec['name']!r}: {exc}") from None
    return out + list(buffers[at:])
