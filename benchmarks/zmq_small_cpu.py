"""CPU per 4 KiB all-reduce over the ``zmq`` transport (issue #22, 5g): the calling thread's CPU time per
``comm.allreduce(x, op="sum", out=out)``, back to back, on every rank, and with ``--count-calls`` the Python-level
calls per all-reduce (cProfile's count, rank 0). Run it under ``stratagem launch``, once per tree to compare
(``PYTHONPATH=<tree>/src``):

    stratagem launch --worker 2 -- python3 benchmarks/zmq_small_cpu.py [SIZE] [CALLS] [--count-calls]

``time.thread_time`` does not count the time a rank waits for its peer, so a loaded machine inflates it far
less than the wall time (printed beside it).
"""
import cProfile
import pstats
import sys
import time

import numpy as np

import stratagem
from stratagem.bench.units import parse_size

count_calls = "--count-calls" in sys.argv
args = [a for a in sys.argv[1:] if a != "--count-calls"]
count = parse_size(args[0] if args else "4K") // 4
calls = int(args[1]) if len(args) > 1 else 4000
comm = stratagem.communicator(transport="zmq")
x, out = np.ones(count, np.float32), np.empty(count, np.float32)
for _ in range(300):
    comm.allreduce(x, op="sum", out=out)
comm.barrier()
wall, cpu = time.perf_counter(), time.thread_time()
for _ in range(calls):
    comm.allreduce(x, op="sum", out=out)
wall, cpu = (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls
print(f"rank {comm.rank}: {wall * 1e6:.1f} us per call, {cpu * 1e6:.1f} us of this thread's CPU per call", flush=True)
if count_calls:
    comm.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        comm.allreduce(x, op="sum", out=out)
    profile.disable()
    if comm.rank == 0:
        print(f"Python-level calls per all-reduce: {pstats.Stats(profile).total_calls / 2000:.1f}", flush=True)
comm.barrier()
comm.close()
