#!/usr/bin/env python3
"""Where the mpi transport's all-reduce time goes: several ways of all-reducing in ONE mpiexec job.

    python benchmarks/mpi_paths.py --np 2 --sizes 4K,64K,1M,16M,64M        # starts its own mpiexec job
    python benchmarks/mpi_paths.py --np 4 --sizes 4K-256Mx4 --methods Allreduce,stratagem --repeat 3

Every method runs in the same ranks, call by call in turn (A, B, A, B...: the machine's load hits them
alike), each call after a barrier, timed per rank and max-reduced over the ranks; the figure is the
median over all calls (with ``--repeat``, the median over jobs of those medians). Methods:

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
        from stratagem.transports.mpi.progress import _EAGER, _Backoff

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
        # Methods alternate call by call (A, B, A, B...), each call after a barrier, so the machine's
        # load hits them alike; ``phase_rounds`` blocks of ``iters`` calls of each.
        for nbytes in sizes:
            count = nbytes // 4
            src = np.full(count, rank + 1, np.float32)
            dst = np.empty_like(src)
            iters = max(3, min(200, (64 << 20) // max(nbytes, 1)))
            for name in names:
                table[name](src, dst)  # warm-up
            for r in range(phase_rounds):
                times = np.empty((len(names), iters))
                for i in range(iters):
                    for k, name in enumerate(names):
                        fn = table[name]
                        world.Barrier()
                        t0 = time.perf_counter()
                        fn(src, dst)
                        times[k, i] = time.perf_counter() - t0
                        assert dst[0] == size * (size + 1) / 2, (name, dst[0])
                slow = np.empty_like(times)
                world.Allreduce(times, slow, op=MPI.MAX)
                for k, name in enumerate(names):
                    results.setdefault(name, {}).setdefault(nbytes, []).extend(slow[k].tolist())

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


def _one_job(args, sizes) -> dict:
    import tempfile

    from stratagem.launch.mpi import run_mpi_job

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        load = os.getloadavg()[0]
        job = run_mpi_job(args.np, [sys.executable, os.path.abspath(__file__), "--rank", "--np", str(args.np),
                                    "--sizes", args.sizes, "--rounds", str(args.rounds), "--methods", args.methods,
                                    "--out", out], timeout=900, env=env, ulfm=not args.no_ulfm)
        if job.returncode != 0 or not os.path.exists(out):
            print(job.output, file=sys.stderr)
            raise SystemExit(1)
        with open(out) as f:
            doc = json.load(f)
    doc["loadavg_start"] = load
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per job")
    p.add_argument("--repeat", type=int, default=1, help="jobs; the table shows the median of their medians")
    p.add_argument("--methods", default="Allreduce,Iallreduce+Test,Iallreduce+backoff,stratagem")
    p.add_argument("--no-ulfm", action="store_true", help="run without --with-ft ulfm (the transport then polls)")
    p.add_argument("--json", default=None, help="write every job's medians here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from stratagem.bench.units import parse_sizes

    sizes = parse_sizes(args.sizes)
    methods = args.methods.split(",")
    if args.rank:
        _rank_main(sizes, args.rounds, methods, args.out)
        return 0
    docs = [_one_job(args, sizes) for _ in range(args.repeat)]
    names = list(docs[0]["medians_s"])
    table = {n: {s: statistics.median(d["medians_s"][n][str(s)] for d in docs) for s in sizes} for n in names}
    loads = [round(d["loadavg_start"], 2) for d in docs] + [round(docs[-1]["loadavg"][0], 2)]
    print(f"np={docs[0]['np']}  {docs[0]['library']}  ulfm={not args.no_ulfm}  {args.repeat} job(s) x "
          f"{args.rounds} interleaved rounds; us per call (slowest rank), median over jobs of each job's median; "
          f"1-min load average at each job's start, then at the end: {loads}")
    # Speed relative to plain mpi4py (its time / ours): the ">= 0.9x" at >= 1M, ">= 0.5x" = "<= 2x its latency".
    ratios = [("speed vs plain", "Allreduce (transport up)"), ("vs plain (no transport)", "Allreduce")]
    ratios = [(label, ref) for label, ref in ratios if ref in table and "stratagem" in table]
    print(f"{'size':>6} " + " ".join(f"{n:>24}" for n in names) + "".join(f"{label:>26}" for label, _ in ratios))
    for s in sizes:
        cells = " ".join(f"{table[n][s] * 1e6:>24.1f}" for n in names)
        extra = "".join(f"{table[ref][s] / table['stratagem'][s]:>25.2f}x" for _, ref in ratios)
        print(f"{_human(s):>6} {cells}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "jobs": docs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
