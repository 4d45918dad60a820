#!/usr/bin/env python3
"""Where the mpi transport's all-reduce time goes: several ways of all-reducing in ONE mpiexec job.

    python benchmarks/mpi_paths.py --np 2 --sizes 4K,64K,1M,16M,64M        # starts its own mpiexec job

Every method runs in the same ranks, interleaved round by round (so the machine's load hits them all
alike), each iteration after a barrier, timed per rank and max-reduced over the ranks; the figure is the
median over all rounds. Methods:

* ``Allreduce``: plain mpi4py ``comm.Allreduce(src, dst, op=MPI.SUM)`` (Open MPI's tuned blocking one);
* ``Iallreduce+Test``: ``comm.Iallreduce`` then ``req.Test()`` in a tight loop (libnbc's algorithms);
* ``Iallreduce+backoff``: the same, polled the way the transport did (spin 2 ms, then sleeps);
* ``stratagem``: ``stratagem.communicator(transport="mpi").allreduce(x, op="sum", out=buffer)``;
* ``Allreduce (transport up)``: the plain call again while the stratagem transport is started.

Run under the launcher's mpiexec (``unshare -n``, ``--mca pml ob1 --mca btl self,sm``, ``--with-ft ulfm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _rank_main(sizes: list[int], rounds: int, methods: list[str], out_path: str | None) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    dup = world.Dup()

    def plain(src, dst):
        world.Allreduce(src, dst, op=MPI.SUM)

    def spin(src, dst):
        req = dup.Iallreduce(src, dst, op=MPI.SUM)
        while not req.Test():
            pass

    def backoff(src, dst):
        from stratagem.transports.mpi_progress import _EAGER, _Backoff

        req = dup.Iallreduce(src, dst, op=MPI.SUM)
        b = _Backoff(*_EAGER)
        while not req.Test():
            b.pause()

    comm = None

    def ours(src, dst):
        comm.allreduce(src, op="sum", out=dst)

    table = {"Allreduce": plain, "Iallreduce+Test": spin, "Iallreduce+backoff": backoff}
    results: dict = {}

    def run(names, phase_rounds):
        for nbytes in sizes:
            count = nbytes // 4
            src = np.full(count, rank + 1, np.float32)
            dst = np.empty_like(src)
            iters = max(3, min(50, (64 << 20) // max(nbytes, 1)))
            for r in range(phase_rounds):
                for name in names:
                    fn = table[name]
                    fn(src, dst)  # warm-up
                    times = np.empty(iters)
                    for i in range(iters):
                        world.Barrier()
                        t0 = time.perf_counter()
                        fn(src, dst)
                        times[i] = time.perf_counter() - t0
                    slow = np.empty_like(times)
                    world.Allreduce(times, slow, op=MPI.MAX)
                    assert dst[0] == size * (size + 1) / 2, (name, dst[0])
                    results.setdefault(name, {}).setdefault(nbytes, []).extend(slow.tolist())

    plain_names = [m for m in methods if m in table]
    run(plain_names, rounds)
    if "stratagem" in methods:
        import stratagem

        comm = stratagem.communicator(transport="mpi", timeout=120)
        table["stratagem"] = ours
        table["Allreduce (transport up)"] = plain
        run(["stratagem", "Allreduce (transport up)"], rounds)
        comm.close()
    if rank == 0:
        summary = {name: {str(n): statistics.median(v) for n, v in per.items()} for name, per in results.items()}
        doc = {"np": size, "library": MPI.Get_library_version().splitlines()[0], "medians_s": summary,
               "loadavg": os.getloadavg()}
        if out_path:
            with open(out_path, "w") as f:
                json.dump(doc, f)
        print(json.dumps(doc))


def _human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="Allreduce,Iallreduce+Test,Iallreduce+backoff,stratagem")
    p.add_argument("--no-ulfm", action="store_true")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from stratagem.bench.units import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    methods = args.methods.split(",")
    if args.rank:
        _rank_main(sizes, args.rounds, methods, args.out)
        return 0
    import tempfile

    from stratagem.core.mpi_launch import run_mpi_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        job = run_mpi_job(args.np, [sys.executable, os.path.abspath(__file__), "--rank", "--np", str(args.np),
                                    "--sizes", args.sizes, "--rounds", str(args.rounds), "--methods", args.methods,
                                    "--out", out], timeout=900, env=env, ulfm=not args.no_ulfm)
        if job.returncode != 0 or not os.path.exists(out):
            print(job.output, file=sys.stderr)
            return 1
        with open(out) as f:
            doc = json.load(f)
    names = list(doc["medians_s"])
    print(f"np={doc['np']}  {doc['library']}  loadavg at end {doc['loadavg'][0]:.2f}  "
          f"(median over {args.rounds} rounds, us per call, max over ranks)")
    print(f"{'size':>6} " + " ".join(f"{n:>24}" for n in names))
    for s in sizes:
        cells = []
        for n in names:
            v = doc["medians_s"][n].get(str(s))
            cells.append(f"{v * 1e6:>24.0f}" if v is not None else f"{'-':>24}")
        print(f"{_human(s):>6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
