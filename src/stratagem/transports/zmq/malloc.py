"""Keep the memory of received zmq messages in the process instead of page-faulting it in afresh.

ZeroMQ allocates every message it receives (``malloc`` of the message's size, in its I/O thread), and
the memory is freed when the array made from it goes. With glibc's defaults a block of a few MiB is
``mmap``-ed and given back to the system when freed (or freed into a heap top that is trimmed), so the
next message of that size page-faults every page in again, zero-filled by the kernel: about 2,500
faults, and ~20 % more CPU than gloo's (which receives into buffers it keeps), for a 16 MiB all-reduce
over 3 ranks (benchmarks/README.md). :func:`keep_message_memory` raises glibc's mmap threshold above
the largest part the transport receives and its trim threshold to 64 MiB, so that such blocks are
carved from the heap and reused: the process keeps up to 64 MiB of freed memory for its next messages.

It is a setting of the process's allocator (``mallopt``), so it is left alone where the user chose
otherwise (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment), off glibc
(musl, macOS), and with the transport option ``malloc_tuning=False``. Setting it again is harmless.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("stratagem.transports.zmq.transport")

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Freed heap memory kept for reuse before glibc gives it back.
TRIM_THRESHOLD = 64 << 20
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_message_memory(largest_part: int) -> bool:
    """Let message blocks of up to ``largest_part`` bytes come from (and go back to) the heap.

    Returns True if the allocator was tuned, False where it was left alone (see the module docstring).
    """
    if any(os.environ.get(name) for name in _USER_SETTINGS) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # The mmap threshold with room above the largest part (its head and ZeroMQ's header), at most
    # glibc's own ceiling for it (32 MiB on 64-bit).
    mmap_threshold = min(32 << 20, 2 * largest_part)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the message-memory settings; the allocator keeps its defaults")
    return ok
