"""What a 4 KiB all-reduce over MPI costs at the least, in plain mpi4py, beside the ``mpi`` transport (issue 22, 5g).

    unshare -n stratagem launch --mpi --worker 2 -- python3 benchmarks/mpi_small_floor.py [SIZE] [CALLS] [ROUNDS]

Rows, each run back to back CALLS times (after 200 warm-up calls and a barrier), the rows alternating round
by round:

* ``mpi4py Allreduce``: the plain call (the issue's baseline).
* ``agreement + data``: the work the ``mpi`` transport does per call, in plain mpi4py: a blocking
  ``Allreduce`` of three int64s (max) -- the per-call agreement that makes every rank raise
  ``CollectiveMismatchError`` on unequal calls -- then the data's ``Allreduce``.
* ``Iallreduce pair + Waitall``: the agreement overlapped with the data call (the issue's suggestion):
  both posted nonblocking, then waited on together.
* ``stratagem comm.allreduce``: the transport's call, ``comm.allreduce(x, op="sum", out=out)``.

Printed per row and round: microseconds per call (the slowest rank's mean) and the calling thread's CPU
microseconds per call (rank 0, ``time.thread_time``).
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import stratagem
from stratagem.bench.units import parse_size

args = sys.argv[1:]
nbytes = parse_size(args[0] if args else "4K")
count = nbytes // 4
calls = int(args[1]) if len(args) > 1 else 3000
rounds = int(args[2]) if len(args) > 2 else 5
plain = MPI.COMM_WORLD
x, out = np.full(count, plain.rank + 1, np.float32), np.empty(count, np.float32)
mine, agreed = np.zeros(3, np.int64), np.zeros(3, np.int64)
comm = stratagem.communicator(transport="mpi")


def one_call():
    plain.Allreduce(x, out, op=MPI.SUM)


def agreement_and_data():
    plain.Allreduce([mine, MPI.INT64_T], [agreed, MPI.INT64_T], op=MPI.MAX)
    plain.Allreduce(x, out, op=MPI.SUM)


def overlapped():
    agreement = plain.Iallreduce([mine, MPI.INT64_T], [agreed, MPI.INT64_T], op=MPI.MAX)
    data = plain.Iallreduce(x, out, op=MPI.SUM)
    MPI.Request.Waitall([agreement, data])


def ours():
    comm.allreduce(x, op="sum", out=out)


rows = [("mpi4py Allreduce", one_call), ("agreement + data (2 Allreduce)", agreement_and_data),
        ("Iallreduce pair + Waitall", overlapped), ("stratagem comm.allreduce", ours)]
results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in rows}
expected = plain.size * (plain.size + 1) / 2
for _ in range(rounds):
    for name, fn in rows:
        for _ in range(200):
            fn()
        plain.Barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        wall, cpu = (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls
        if not np.all(out == expected):
            raise SystemExit(f"{name}: wrong sum {out[:4]}, expected {expected}")
        results[name].append((plain.allreduce(wall, op=MPI.MAX) * 1e6, cpu * 1e6))
if plain.rank == 0:
    print(f"{nbytes} bytes, np={plain.size}, {calls} calls per round; "
          f"us per call (slowest rank) / rank 0's CPU us per call, round by round")
    for name, values in results.items():
        print(f"{name:32s} " + ", ".join(f"{w:.1f}/{c:.1f}" for w, c in values), flush=True)
