"""What ``stratagem.horovod``'s negotiation costs: ``hvd.allreduce`` (a descriptor all-gather, then the
all-reduce) next to the communicator's plain ``allreduce`` on the same communicator, interleaved call by
call, 2 processes over zmq by default.

    python3 benchmarks/horovod_overhead.py [--workers 2] [--transport zmq] [--reps 50]

Prints, per size, the median time of each and the difference (the negotiation's round trip).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

SIZES = {"4 KiB": 4 << 10, "256 KiB": 256 << 10, "4 MiB": 4 << 20, "32 MiB": 32 << 20}


def task(reps: int, out: str) -> None:
    import stratagem
    from stratagem.adapters.horovod_world import HorovodWorld

    comm = stratagem.communicator(name="horovod")
    world = HorovodWorld(comm)
    rows = {}
    for label, nbytes in SIZES.items():
        x = np.ones(nbytes // 4, np.float32)
        plain, hvd = [], []
        for _ in range(3):      # warm-up
            comm.allreduce(x, op="sum")
            world.allreduce(x, "sum")
        for _ in range(reps):
            started = time.perf_counter()
            comm.allreduce(x, op="sum")
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            world.allreduce(x, "sum")
            hvd.append(time.perf_counter() - started)
        rows[label] = {"plain_ms": 1e3 * float(np.median(plain)), "hvd_ms": 1e3 * float(np.median(hvd))}
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    comm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--transport", default="zmq")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--task", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        task(args.reps, args.task)
        return
    from stratagem.launch.launcher import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        result = launch([sys.executable, os.path.abspath(__file__), "--reps", str(args.reps), "--task", out],
                        workers=args.workers, transport=args.transport, timeout=600)
        if not result.ok:
            sys.exit(result.summary())
        with open(out) as f:
            rows = json.load(f)
    print(f"{args.workers} processes over {args.transport}, median of {args.reps} interleaved calls; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'size':>8} | {'comm.allreduce':>14} | {'hvd.allreduce':>13} | {'difference':>10}")
    for label, row in rows.items():
        print(f"{label:>8} | {row['plain_ms']:>11.3f} ms | {row['hvd_ms']:>10.3f} ms | "
              f"{row['hvd_ms'] - row['plain_ms']:>7.3f} ms")


if __name__ == "__main__":
    main()
