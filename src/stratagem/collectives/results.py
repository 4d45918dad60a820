"""Memory for the results of a communicator's large all-reduces, used again once the caller drops them.

``comm.allreduce(x)`` returns a new array every call. A large new array is memory fresh from the
kernel (glibc maps blocks over its mmap threshold, at most 32 MiB, afresh each time): the algorithm's
first write page-faults it in, zero-filled, and it is unmapped again when the array goes. For a 64 MiB
all-reduce that cost 0.04-0.09 s of CPU per call on the 2-core test box (``benchmarks/zmq_cpu.py``:
the same all-reduce into a kept ``out`` array took about half the CPU), as much as the transport's
whole share. A training loop all-reduces the same shapes every step and drops each result before, or
soon after, its next call; so :class:`ResultMemory` keeps the blocks it handed out and hands one out
again only once nothing but itself refers to it. A result, any view of it, a torch tensor made from
it or a memoryview of it all hold its block, so a block is never used again while any of them lives
(nor while a transport still holds a zero-copy send of it).

    >>> import numpy as np
    >>> memory = ResultMemory()
    >>> a = memory.empty(1 << 20, np.float32)
    >>> b = memory.empty(1 << 20, np.float32)       # a is still held: other memory
    >>> np.shares_memory(a, b)
    False
    >>> address = a.ctypes.data
    >>> del a
    >>> memory.empty(1 << 20, np.float32).ctypes.data == address   # a's block, free again
    True
"""

from __future__ import annotations

import sys

import numpy as np

#: Results of at least this many bytes come from kept blocks (smaller ones are cheap to allocate).
MIN_BYTES = 1 << 20
#: Blocks kept per (dtype, length): a loop that still holds its last result during the next call needs 2.
PER_SHAPE = 2
#: At most this many bytes are kept in all; a block beyond it is not kept (it is freed as usual).
MAX_BYTES = 256 << 20


def _references(blocks: list, i: int) -> int:
    return sys.getrefcount(blocks[i])


#: What :func:`_references` counts for a block that only the list holds (measured, not assumed: the
#: interpreter's own count of temporaries differs between Python versions).
_UNREFERENCED = _references([object()], 0)


class ResultMemory:
    """Blocks for large all-reduce results, reused once unreferenced (see the module docstring).

    Not thread-safe: a communicator serialises its calls.
    """

    def __init__(self, max_bytes: int = MAX_BYTES):
        self._blocks: dict[tuple, list] = {}
        self._kept = 0
        self._max_bytes = max_bytes

    def empty(self, length: int, dtype) -> np.ndarray:
        """A flat array of ``length`` elements of ``dtype`` that nothing else refers to (contents
        undefined): a kept block free again, else a new one (kept if there is room)."""
        dtype = np.dtype(dtype)
        nbytes = length * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > self._max_bytes:
            return np.empty(length, dtype)
        blocks = self._blocks.setdefault((dtype, length), [])
        for i in range(len(blocks)):
            if _references(blocks, i) == _UNREFERENCED:
                return blocks[i]
        block = np.empty(length, dtype)
        if len(blocks) < PER_SHAPE and self._kept + nbytes <= self._max_bytes:
            blocks.append(block)
            self._kept += nbytes
        return block
