"""All-reduce demo: every task contributes its rank; the sum is checked and the bandwidth measured.

Run it on a local 3-process cluster:

    stratagem launch --worker 3 -- python3 examples/allreduce_demo.py

The same script runs under a Kubernetes TFJob (TF_CONFIG) or alone (`python3 examples/allreduce_demo.py`,
a world of one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import stratagem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=10_000_001, help="float32 elements (any length)")
    parser.add_argument("--iters", type=int, default=5, help="timed all-reduces after the checked one")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    args = parser.parse_args(argv)

    with stratagem.communicator(transport=args.transport) as comm:
        x = np.full(args.length, comm.rank, np.float32)
        total = comm.allreduce(x, op="sum")
        expected = sum(range(comm.size))
        ok = bool(np.all(total == expected)) and total.shape == x.shape
        # Every rank checked its own copy; the job passes only if all did.
        all_ok = bool(comm.allreduce(np.array(ok, np.int32), op="min"))

        times = []
        for _ in range(args.iters):
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(x, op="sum")
            times.append(time.perf_counter() - start)
        # An iteration lasts as long as its slowest rank.
        slowest = comm.allreduce(np.array(times, np.float64), op="max")

        print(f"rank {comm.rank}/{comm.size} ({comm.task}): local check {'ok' if ok else 'WRONG'}")
        if comm.rank == 0:
            median = statistics.median(slowest.tolist()) if args.iters else float("nan")
            nbytes = x.nbytes
            bus = 2 * (comm.size - 1) / comm.size * nbytes / median if comm.size > 1 else float("nan")
            print(f"all-reduce of {args.length:,} float32 ({nbytes / 2**20:.1f} MiB) over {comm.size} "
                  f"ranks via {args.transport}: result check {'PASSED' if all_ok else 'FAILED'} "
                  f"(every element == {expected})")
            print(f"median time {median * 1e3:.1f} ms over {args.iters} runs; algorithm bandwidth "
                  f"{nbytes / median / 1e9:.2f} GB/s, bus bandwidth {bus / 1e9:.2f} GB/s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
