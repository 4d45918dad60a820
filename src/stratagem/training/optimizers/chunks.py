"""Running an elementwise optimizer update over cache-sized chunks (used by :mod:`.optimizers`).

An update such as ``w -= lr * g`` written over whole arrays makes numpy allocate a temporary the size
of the variable (40 MB for 10M float32 parameters), fault its pages in, stream it out to memory and
read it back: on a parameter server that was half the cost of a push. Done chunk by chunk, with
temporaries of one chunk that are reused (:func:`scratch`), every operand of a chunk stays in the
CPU cache between the ufunc calls and nothing is allocated per step.

The results are bit-for-bit those of the whole-array update: every built-in rule is elementwise (an
element of the result depends only on the same element of the variable, the gradient and the slots),
and each chunk runs the very same ufuncs, in the same order and dtypes, on its elements.

    >>> import numpy as np
    >>> def sgd(xp, src, w, g, slots, t):
    ...     tmp, = scratch(xp, g, 1)
    ...     np.multiply(g, 0.5, out=tmp)
    ...     np.subtract(src, tmp, out=w)
    >>> w, g = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    >>> update_chunked(sgd, w, w, g, {}, 1, np.dtype(np.float32), chunk=2); w
    array([-0.5,  0.5,  1.5,  2.5,  3.5], dtype=float32)
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

#: Elements per chunk. 128K float32 elements are 512 KiB per operand: large enough that the Python
#: cost of a chunk's handful of ufunc calls is small next to their work, small enough that the
#: operands of a chunk are still in the L2/L3 cache when the next ufunc of the rule reads them
#: (measured on 10M float32: 16K-element chunks paid more in per-call overhead than they saved).
CHUNK = 128 * 1024

#: Variables of at least this many bytes are updated in chunks by a rule of few passes (SGD's
#: default ``chunk_from_bytes``). Below it the whole-array temporaries stay in the L3 cache, and the
#: calls of the chunks cost more than they save: on 10M float32 in pieces of 4 MB and 8 MB, plain SGD
#: was ~10 % faster whole, and with momentum as fast; from 20 MB pieces on, chunks were faster (plain
#: SGD on one 40 MB array: 2.7 ms instead of 4.4; with momentum 4.7 instead of 6.0 from 20 MB).
#: Rules of many passes (Adam, Adagrad) gain from the smallest chunked size on (2 MB: 13 ms
#: instead of 23 for Adam), so they lower it.
CHUNK_FROM_BYTES = 16 << 20

_PAD_BYTES = 64  # between scratch buffers of a block
_MAX_VIEWS = 64  # cached scratch views per thread
_local = threading.local()  # scratch per thread: distinct variables may be updated concurrently


def scratch(xp, like, count: int) -> list:
    """``count`` uninitialised arrays of ``like``'s shape and dtype, private to this thread.

    For numpy arrays of at most :data:`CHUNK` elements they are views into one block kept per
    thread and dtype, so a chunked update allocates nothing per chunk. The caller must be done with
    them before it calls ``scratch`` again (an update uses them within one chunk).
    """
    if xp is not np or like.size > CHUNK:
        return [xp.empty_like(like) for _ in range(count)]
    key = (like.dtype, like.shape, count)
    views = getattr(_local, "views", None)
    if views is None:
        views = _local.views = {}
    found = views.get(key)
    if found is not None:      # the common case: the views of the previous chunk of this size
        return found
    blocks = getattr(_local, "blocks", None)
    if blocks is None:
        blocks = _local.blocks = {}
    # One block, not one allocation per buffer: separately allocated chunk-sized buffers (each its
    # own mmap) made the multi-operand rules 2-3x slower at some chunk sizes on the EPYC we measured;
    # buffers a cache line apart inside one block did not.
    stride = CHUNK + _PAD_BYTES // like.dtype.itemsize
    block = blocks.get(like.dtype)
    if block is None or block.size < count * stride:
        block = blocks[like.dtype] = np.empty(max(count, 2) * stride, like.dtype)
        views.clear()          # views into the old block would no longer be shared with new ones
    if len(views) >= _MAX_VIEWS:
        views.clear()          # many distinct small shapes: start over rather than grow
    found = views[key] = [block[i * stride:i * stride + like.size].reshape(like.shape) for i in range(count)]
    return found


def chunkable(value, out, grad, slots: dict, from_bytes: int | None = None) -> bool:
    """True when a numpy update can run over flat chunks: every array is numpy and C-contiguous, and
    the variable is large enough to gain from it: ``from_bytes`` (default :data:`CHUNK_FROM_BYTES`)
    and two chunks at least."""
    from_bytes = CHUNK_FROM_BYTES if from_bytes is None else from_bytes
    if type(value) is not np.ndarray or value.size < 2 * CHUNK or value.nbytes < from_bytes:
        return False
    arrays = [value, out, grad, *slots.values()]
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


def update_chunked(update_into: Callable, src: np.ndarray, out: np.ndarray, grad: np.ndarray,
                   slots: dict, t: int, work_dtype: np.dtype, chunk: int = CHUNK) -> None:
    """Run ``update_into(np, src_chunk, out_chunk, g_chunk, slot_chunks, t)`` over the flat chunks.

    ``src`` and ``out`` are the variable's storage (the same array for an in-place update); the
    gradient and a 16-bit variable are converted to ``work_dtype`` a chunk at a time, as the
    whole-array update converts them at once, and the result is cast back into ``out``.
    """
    flat_src, flat_out, flat_grad = src.reshape(-1), out.reshape(-1), grad.reshape(-1)
    flat_slots = [(name, array.reshape(-1)) for name, array in slots.items()]
    convert, cast_grad, in_place = flat_src.dtype != work_dtype, flat_grad.dtype != work_dtype, src is out
    for lo in range(0, flat_src.size, chunk):
        hi = lo + chunk
        g = flat_grad[lo:hi].astype(work_dtype) if cast_grad else flat_grad[lo:hi]
        part = {name: array[lo:hi] for name, array in flat_slots}
        if convert:
            w = flat_src[lo:hi].astype(work_dtype)
            update_into(np, w, w, g, part, t)
            np.copyto(flat_out[lo:hi], w, casting="unsafe")
        else:
            w = flat_src[lo:hi]
            update_into(np, w, w if in_place else flat_out[lo:hi], g, part, t)
