"""Where a 4 KiB all-reduce's time goes over the ``mpi`` transport (issue #22, 5g): the CPU time of the
calling thread per call (``time.thread_time``, so a busy machine's preemptions do not count) of plain mpi4py
and of each layer of ``comm.allreduce``, in **one rank** (an MPI world of 1: MPI's own work is a local copy, so
what is left is the Python and mpi4py cost that a 2-rank call pays on top of MPI's latency).

    stratagem launch --mpi --worker 1 python3 benchmarks/small_call_cpu.py [SIZE] [CALLS] [--communicator-only]

``--communicator-only``: the last row alone (it runs on any revision, to compare trees with ``PYTHONPATH``).

Each row is the minimum over 15 rounds of CALLS calls (default 5000) of the mean CPU time per call.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import stratagem
from stratagem.collectives import algorithms as coll
from stratagem.bench.units import parse_size

only = "--communicator-only" in sys.argv
args = [a for a in sys.argv[1:] if a != "--communicator-only"]
count = parse_size(args[0] if args else "4K") // 4
calls = int(args[1]) if len(args) > 1 else 5000
comm = stratagem.communicator(transport="mpi")
plain = MPI.COMM_WORLD
x, out = np.ones(count, np.float32), np.empty(count, np.float32)
mine, agreed = np.zeros(3, np.int64), np.zeros(3, np.int64)
native = comm.transport.native_collectives()["allreduce"]
session = comm._session      # a benchmark of the layers: it calls them one by one


def cpu_per_call(fn) -> float:
    best = float("inf")
    for _ in range(15):
        started = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - started) / calls)
    return best * 1e6


def native_run():
    session.seq += 1          # what the communicator does before a native call
    native.run(session, x, op="sum", algorithm="auto", out=out)


rows = [
    ("mpi4py Allreduce(x, out)", lambda: plain.Allreduce(x, out, op=MPI.SUM)),
    ("mpi4py Allreduce([x, FLOAT], [out, FLOAT])", lambda: plain.Allreduce([x, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)),
    ("the agreement's Allreduce (3 int64, MAX)",
     lambda: plain.Allreduce([mine, MPI.INT64_T], [agreed, MPI.INT64_T], op=MPI.MAX)),
    ("the communicator's argument checks", lambda: coll.check_allreduce(x, "sum", "auto", out)),
    ("native accepts (the plan's lookup)", lambda: native.takes(session, x, {"op": "sum", "out": out})),
    ("native run (agreement + data, guard, plan)", native_run),
    ("comm.allreduce(x, out=out)", lambda: comm.allreduce(x, op="sum", out=out)),
]
for name, fn in rows[-1:] if only else rows:
    fn()
    print(f"{name:46} {cpu_per_call(fn):6.2f} us CPU per call")
comm.close()
