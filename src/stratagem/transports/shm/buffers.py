"""Receive buffers the ``shm`` transport reuses once their owner has dropped them.

A received message's buffers belong to the receiver, so each large frame needs memory of its own.
Fresh memory costs a page fault per 4 KiB page on first touch, which on a virtual machine is slower
than the copy out of the ring itself (a fresh 4 MiB buffer: ~0.8 ms; a reused one: ~0.06 ms). So
large buffers are kept here and handed out again once nothing refers to them any more: CPython
counts references, and every array made from a buffer (views, reshapes, ``np.frombuffer``,
``torch.from_numpy``) holds one on it, so a count of "just us" means its owner is done with it.
Memory kept is bounded (``max_bytes``); beyond that, buffers are plain fresh arrays.

    >>> pool = BufferPool(max_bytes=8 << 20, min_bytes=1 << 20)
    >>> a = pool.take(2 << 20); a_id = id(a)
    >>> view = a.view(np.float32); del a
    >>> id(pool.take(2 << 20)) == a_id          # still referred to by `view`: a new buffer
    False
    >>> del view
    >>> id(pool.take(2 << 20)) == a_id          # dropped: reused
    True
"""

from __future__ import annotations

import sys

import numpy as np


class BufferPool:
    """Large uint8 buffers reused by size (one reader thread at a time calls :meth:`take`)."""

    def __init__(self, max_bytes: int, min_bytes: int = 256 << 10):
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._blocks: list[np.ndarray] = []
        self._kept = 0

    def _free(self, i: int) -> bool:
        # References: the list's, and getrefcount's own argument. Any array made from the block
        # (the message's buffer, the user's views of it) adds one.
        return sys.getrefcount(self._blocks[i]) == 2

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` that nobody else refers to."""
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return np.empty(nbytes, dtype=np.uint8)
        other_size = None
        for i in range(len(self._blocks)):
            if self._free(i):
                if self._blocks[i].size == nbytes:
                    return self._blocks[i]
                other_size = i if other_size is None else other_size
        if self._kept + nbytes > self.max_bytes and other_size is not None:
            self._kept -= self._blocks.pop(other_size).size  # make room: sizes in use change over time
        block = np.empty(nbytes, dtype=np.uint8)
        if self._kept + nbytes <= self.max_bytes:
            self._blocks.append(block)
            self._kept += nbytes
        return block

    def clear(self) -> None:
        self._blocks, self._kept = [], 0
