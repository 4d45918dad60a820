"""A worker's copies of the variables that live on the parameter servers (the caches of
:class:`~stratagem.strategies.ps.remote.RemoteStore`): how received values get into them.

A value is written into the cache in place, so that whatever holds the cache (``w = var.value``, a
numpy view, a ``torch.from_numpy`` tensor) sees it; when nothing but the store holds the cache, the
received array becomes the cache instead (no copy: :func:`adoptable`). A cupy cache (a GPU worker)
gets values copied from the host (:func:`write_into`); its pieces go to the host with
``variables.to_module(piece, numpy)``.
"""

from __future__ import annotations

import sys

import numpy as np

from stratagem.training.variables import array_module, is_device_array, to_module


def write_into(cache, value) -> None:
    """Copy ``value`` into ``cache`` (or a piece of it) in place: host to device for a cupy cache."""
    if is_device_array(cache):
        cache[...] = array_module(cache).asarray(value)
    else:
        np.copyto(cache, to_module(value, np), casting="same_kind")


def _holders(store) -> int:
    """References to ``store.cache`` (counted the same way for the probe below and for a store)."""
    return sys.getrefcount(store.cache)


class _Probe:
    def __init__(self):
        self.cache = np.empty(0)


#: What :func:`_holders` says of a cache nobody else holds (3 on CPython 3.11; measured, not assumed).
_UNSHARED = _holders(_Probe())


def adoptable(value, store) -> bool:
    """True when the received ``value`` may replace ``store.cache`` as a variable's copy instead of
    being copied into it: nobody but the store holds the cache (no ``w = var.value``, no numpy view
    of it, no ``torch.from_numpy`` tensor: each holds a reference, and those must keep seeing the
    values refreshed in place), and ``value`` is a writable, aligned, C-contiguous numpy array of the
    same shape and dtype. The received buffers belong to this task (the transport contract), so
    keeping one costs nothing; the copy it saves was an eighth of the CPU of a 40 MB push + pull on
    2 cores."""
    cache = store.cache
    if not (type(value) is np.ndarray and type(cache) is np.ndarray and value.dtype == cache.dtype
            and value.shape == cache.shape and value.flags.writeable and value.flags.c_contiguous
            and value.flags.aligned):
        return False
    del cache   # not counted as a holder
    return _holders(store) <= _UNSHARED
