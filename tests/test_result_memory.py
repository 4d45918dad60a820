"""Large all-reduce results reuse the memory of results the caller dropped, never of one still held
(collectives/results.py), over a real two-rank world (ranks as threads, the in-process transport)."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from stratagem.collectives.results import MIN_BYTES, ResultMemory
from stratagem.testing.world import local_world

pytestmark = pytest.mark.timeout(60)

N = 2 * MIN_BYTES // 4   # float32 elements: a result large enough to come from kept memory


@pytest.fixture
def comms():
    world = local_world(2, timeout=20)
    yield world
    for comm in world:
        comm.close()


def both(comms, fn):
    with ThreadPoolExecutor(len(comms)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(fn, c) for c in comms]]


def test_a_dropped_result_is_the_next_results_memory_and_a_held_one_never_is(comms):
    def rank(comm):
        x = np.full(N, comm.rank + 1, np.float32)
        first = comm.allreduce(x)
        block = weakref.ref(first.base)       # the result's memory (a view of a kept block)
        del first
        gc.collect()
        second = comm.allreduce(x * 2)
        reused = second.base is block()       # the dropped result's block, kept and used again
        # Held results (an array, a view, a memoryview, a torch-style buffer export) are never reused.
        view = second[10:20]
        third = comm.allreduce(x * 3)
        exported = memoryview(comm.allreduce(x * 4))
        fourth = comm.allreduce(x * 5)
        held = [second, third, np.frombuffer(exported, np.float32), fourth]
        distinct = not any(np.shares_memory(a, b) for i, a in enumerate(held) for b in held[i + 1:])
        values = [float(a[0]) for a in held] + [float(view[0])]
        return reused, block() is not None, distinct, values, [bool((a == a[0]).all()) for a in held]

    for reused, kept, distinct, values, uniform in both(comms, rank):
        assert reused and kept
        assert distinct
        assert values == [6.0, 9.0, 12.0, 15.0, 6.0] and all(uniform)


def test_small_results_and_the_bytes_kept_are_bounded():
    memory = ResultMemory(max_bytes=3 * MIN_BYTES)
    small = memory.empty(16, np.float64)
    assert small.base is None                 # below MIN_BYTES: a plain new array, nothing kept
    a, b = memory.empty(N, np.float32), memory.empty(N, np.float32)   # 2 x 2 MIN_BYTES > the bound
    kept_a, kept_b = weakref.ref(a), weakref.ref(b)
    del a, b
    gc.collect()
    assert kept_a() is not None and kept_b() is None   # the first was kept; the second not (no room)
    too_large = memory.empty(4 * MIN_BYTES // 4, np.float32)
    kept_large = weakref.ref(too_large)
    del too_large
    gc.collect()
    assert kept_large() is None               # over the bound on its own: never kept
