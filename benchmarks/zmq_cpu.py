#!/usr/bin/env python3
"""CPU per large all-reduce on loopback (issue 22, 5a; issue 24): stratagem over zmq beside the plain TCP
ring (``plain_tcp_ring.py``) and the plain pyzmq ring (``plain_pyzmq_ring.py``).

    python3 benchmarks/zmq_cpu.py --np 2 4 --size 64M --iters 4 --rounds 2
    python3 benchmarks/zmq_cpu.py --np 4 --strace /tmp/sc      # + the system calls of every rank
    python3 benchmarks/zmq_cpu.py --np 4 --link 1gbit           # one emulated host per rank instead
    python3 benchmarks/zmq_cpu.py --backends stratagem,before --before /tmp/base/src   # before/after

On one machine's loopback the wall time says little on a loaded box, but each rank's CPU time (user +
system, all threads, ``getrusage``) per call moves much less with the load: it is what 4 or 8 tasks on
2 cores compete for. Every contender runs as its own ``stratagem launch --worker N`` job (the ranks are
``_hosts_allreduce_worker.py``), interleaved round by round. Printed per world size and contender: the
median call, and user, system and total CPU seconds per call (mean over ranks, and the busiest rank).
With ``--strace DIR`` each rank runs under ``strace -f -c`` (slower: only the counts mean anything) and
the calls per timed all-reduce of the busiest system calls are printed, averaged over the ranks (the
warm-up call and the start are in the counts too: use many ``--iters``). With ``--link RATE`` every rank
runs on an emulated host of its own behind a link of that rate (``stratagem launch --hosts``), as in
``hosts_allreduce.py``: a call then waits on the links, and what a rank spends while it waits shows.
"""

from __future__ import annotations

import argparse
import collections
import glob
import io
import json
import os
import shutil
import statistics
import sys

from stratagem.bench.units import parse_size
from stratagem.launch.hosts import HostsSpec
from stratagem.launch.launcher import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_hosts_allreduce_worker.py")
BACKENDS = ("stratagem", "ring", "pyzmq")   # also: stratagem-out (into a kept out=), before, before-out


def run(backend: str, n: int, nbytes: int, iters: int, strace_dir: str | None, timeout: float,
        link: str | None = None, before: str | None = None) -> list[dict]:
    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env.update(STRATAGEM_TRANSPORT="zmq", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    name = backend
    if backend.startswith("before"):  # before, before-out: stratagem(-out) from the --before checkout
        backend, env["PYTHONPATH"] = "stratagem" + backend[len("before"):], before
    cmd = [sys.executable, WORKER, backend, str(nbytes), str(iters)]
    if strace_dir:
        prefix = os.path.join(strace_dir, f"{name}-{n}")
        cmd = ["/bin/sh", "-c", f'exec strace -f -c -o "{prefix}-$$" "$@"', "sh", *cmd]
    hosts = HostsSpec.parse(n, link=link) if link else None
    result = launch(cmd, workers=n, hosts=hosts, env=env, output=out, error_output=err, timeout=timeout)
    if not result.ok:
        raise RuntimeError(f"{backend}: {result.reason}\n{err.getvalue()[-3000:]}")
    rows = [json.loads(line[line.find('{"rank"'):]) for line in out.getvalue().splitlines() if '{"rank"' in line]
    if len(rows) != n:
        raise RuntimeError(f"{backend}: {len(rows)} of {n} ranks reported")
    return rows


def syscalls(prefix: str) -> collections.Counter:
    """Calls per system call, summed over the ``strace -c`` files of one job's ranks."""
    counts: collections.Counter = collections.Counter()
    for path in glob.glob(prefix + "-*"):
        with open(path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                    counts[fields[-1]] += int(fields[3])
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes")
    parser.add_argument("--size", default="64M", help="bytes all-reduced per call (default 64M)")
    parser.add_argument("--iters", type=int, default=4, help="timed calls per job (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per contender, interleaved (default 2)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--strace", metavar="DIR", help="run every rank under strace -f -c, its files in DIR")
    parser.add_argument("--link", help="run each rank on an emulated host with a link of this rate (e.g. 1gbit)")
    parser.add_argument("--before", metavar="SRC", help="contenders 'before' and 'before-out' (with --backends): "
                        "stratagem imported from this source directory (another checkout's src/)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    args = parser.parse_args(argv)
    nbytes = parse_size(args.size)
    backends = [b for b in args.backends.split(",") if b]
    if any(b.startswith("before") for b in backends) and not args.before:
        raise SystemExit("the before contenders need --before SRC")
    if args.strace:
        if shutil.which("strace") is None:
            raise SystemExit("--strace needs strace on the PATH")
        os.makedirs(args.strace, exist_ok=True)
    loads = []
    results: dict = {}
    for n in args.np:
        for r in range(args.rounds):
            for backend in (backends if r % 2 == 0 else backends[::-1]):
                loads.append(os.getloadavg()[0])
                print(f"np={n} {backend} round {r + 1} (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
                rows = run(backend, n, nbytes, args.iters, args.strace, args.timeout, args.link, args.before)
                entry = results.setdefault((n, backend), collections.defaultdict(list))
                entry["times"] += [max(row["times"][i] for row in rows) for i in range(args.iters)]
                for key in ("user", "sys", "cpu", "minflt", "nvcsw", "nivcsw"):
                    entry[key].append([row[key] / args.iters for row in rows])
    where = f"emulated hosts, {args.link} links" if args.link else "loopback"
    print(f"\nall-reduce {args.size} float32 sum on {where}; load average {min(loads):.1f}-{max(loads):.1f}; "
          f"{args.rounds} rounds x {args.iters} calls; CPU s per call: mean over ranks (busiest rank)")
    print(f"{'np':>3} {'backend':<10} {'median s':>9} {'user':>13} {'sys':>13} {'user+sys':>13} "
          f"{'faults':>7} {'vol cs':>7} {'invol cs':>8}")
    for n in args.np:
        for backend in backends:
            entry = results[(n, backend)]
            cells = []
            for key in ("user", "sys", "cpu"):
                per_rank = [statistics.mean(job[i] for job in entry[key]) for i in range(n)]
                cells.append(f"{statistics.mean(per_rank):.3f} ({max(per_rank):.3f})")
            counts = [statistics.mean(statistics.mean(job) for job in entry[key]) for key in ("minflt", "nvcsw", "nivcsw")]
            print(f"{n:>3} {backend:<10} {statistics.median(entry['times']):>9.3f} "
                  + " ".join(f"{c:>13}" for c in cells) + f" {counts[0]:>7,.0f} {counts[1]:>7,.0f} {counts[2]:>8,.0f}")
    if args.strace:
        print(f"\nsystem calls per timed call, mean over ranks (strace -f -c; {args.rounds} jobs x "
              f"{args.iters} calls + warm-up and start)")
        for n in args.np:
            for backend in backends:
                counts = syscalls(os.path.join(args.strace, f"{backend}-{n}"))
                per = args.rounds * args.iters * n
                top = ", ".join(f"{name} {count / per:,.0f}" for name, count in counts.most_common(8))
                print(f"{n:>3} {backend:<10} {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
