#!/usr/bin/env python3
"""Plain mpi4py ``Allreduce`` timing, the reference the bench's mpi4py baseline is checked against.

    stratagem launch --mpi --worker 2 python benchmarks/plain_mpi4py.py 64M [ITERS]
"""
import statistics, sys, time
import numpy as np
from mpi4py import MPI
from stratagem.bench.units import parse_size

comm = MPI.COMM_WORLD
count, iters = parse_size(sys.argv[1]) // 4, int(sys.argv[2]) if len(sys.argv) > 2 else 20
x, y = np.full(count, comm.rank + 1, np.float32), np.empty(count, np.float32)
for _ in range(3):
    comm.Allreduce(x, y, op=MPI.SUM)
times = []
for _ in range(iters):
    comm.Barrier()
    t = time.perf_counter()
    comm.Allreduce(x, y, op=MPI.SUM)
    times.append(time.perf_counter() - t)
slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)
if comm.rank == 0:
    print(f"plain mpi4py Allreduce {sys.argv[1]} np={comm.size}: median {slowest * 1e3:.3f} ms")
