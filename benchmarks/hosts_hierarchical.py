#!/usr/bin/env python3
"""The hierarchical all-reduce across emulated hosts (issue 22, 5b): shared memory inside a host and zmq
between hosts, beside the flat rings, on the same placement and links, side by side in one run.

    python3 benchmarks/hosts_hierarchical.py                         # 2 hosts x 2 tasks, 500mbit, 64M
    python3 benchmarks/hosts_hierarchical.py --link 1gbit --rounds 3 --json out.json
    python3 benchmarks/hosts_hierarchical.py --hosts 2 --tasks-per-host 4 --link 1gbit

``--hosts`` emulated hosts (:mod:`stratagem.launch.hosts`: one network namespace per host, every link
shaped with tc in both directions), ``--tasks-per-host`` tasks on each, packed (tasks 0..k-1 on the
first host, as ``stratagem launch --hosts N --tasks-per-host K`` places them). Every contender runs as
its own job on fresh hosts, the contenders interleaved round by round (their order reversed every other
round); each job times ``--iters`` calls after two warm-up calls, the first one's result checked
(``_hosts_allreduce_worker.py``):

- ``zmq-ring``: the flat ring over zmq (``comm.allreduce(x, algorithm="ring")``): the issue's baseline;
- ``shm-ring``: the same ring over ``shm`` with ``transport_options={"remote": "zmq"}`` (its steps
  inside a host through shared memory): the flat algorithm on the hierarchical transports;
- ``hierarchical``: ``stratagem.communicator(transport="shm", transport_options={"remote": "zmq"},
  hierarchical=True)``, ``comm.allreduce(x)``;
- ``hierarchical-zmq``: ``hierarchical=True`` over zmq alone (inside a host over loopback TCP).

A call's time is the slowest rank's; busbw = 2(n - 1)/n x bytes / time (nccl-tests), the same factor for
every contender, so busbw ratios are time ratios. CPU is each task's process CPU time (all threads) per
call, and as a fraction of the wall time of its timed calls (the link rate is chosen to keep it under
half a core). Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys

from hosts_allreduce import summarize   # benchmarks/ is the script's directory, first on sys.path

from stratagem.bench.environment import describe_environment
from stratagem.bench.units import human_bytes, parse_size
from stratagem.launch.hosts import HostsSpec, format_rate
from stratagem.launch.launcher import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_hosts_allreduce_worker.py")
BACKENDS = ("zmq-ring", "shm-ring", "hierarchical", "hierarchical-zmq")
BASELINE = "zmq-ring"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_job(backend: str, spec: HostsSpec, workers: int, nbytes: int, iters: int, timeout: float) -> list[dict]:
    """One contender's job on fresh hosts; every rank's JSON row."""
    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    result = launch([sys.executable, WORKER, backend, str(nbytes), str(iters)], workers=workers, hosts=spec,
                    env=env, output=out, error_output=err, timeout=timeout)
    if result.interrupted_by is not None:
        raise KeyboardInterrupt
    if not result.ok:
        raise RuntimeError(f"{backend}: {result.reason}\n{err.getvalue()[-3000:]}")
    rows = []
    for line in out.getvalue().splitlines():
        start = line.find('{"rank"')
        if start >= 0:
            rows.append(json.loads(line[start:]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--tasks-per-host", type=int, default=2, help="tasks on each host, packed (default 2)")
    parser.add_argument("--link", default="500mbit", help="every host's link rate (default 500mbit)")
    parser.add_argument("--size", default="64M", help="bytes all-reduced per call (default 64M)")
    parser.add_argument("--iters", type=int, default=4, help="timed calls per job (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per contender, interleaved (default 2)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--json", metavar="PATH", help="every time, CPU figure and the environment")
    args = parser.parse_args(argv)
    nbytes = parse_size(args.size)
    backends = [b for b in args.backends.split(",") if b]
    spec = HostsSpec.parse(args.hosts, link=args.link, tasks_per_host=args.tasks_per_host)
    n = args.hosts * args.tasks_per_host
    results: dict = {}
    loads = []
    for r in range(args.rounds):
        for backend in (backends if r % 2 == 0 else backends[::-1]):
            loads.append(os.getloadavg()[0])
            log(f"{args.hosts} hosts x {args.tasks_per_host} tasks at {format_rate(spec.link)}: {backend}, "
                f"round {r + 1}/{args.rounds} (load {loads[-1]:.1f})")
            try:
                got = summarize(run_job(backend, spec, n, nbytes, args.iters, args.timeout), n, nbytes)
            except (RuntimeError, OSError) as exc:
                log(f"  failed: {exc}")
                results.setdefault(backend, {"error": str(exc)})
                continue
            entry = results.setdefault(backend, {"times_s": [], "cpu_per_call_s": [], "cpu_fraction": []})
            for key, values in got.items():
                entry.setdefault(key, []).extend(values)
    factor = 2 * (n - 1) / n
    base = results.get(BASELINE, {})
    base_bw = factor * nbytes / statistics.median(base["times_s"]) if base.get("times_s") else None
    print(f"\nall-reduce {human_bytes(nbytes)} float32 sum, {args.hosts} emulated hosts x {args.tasks_per_host} "
          f"tasks (packed), links {format_rate(spec.link)}; load average {min(loads):.1f}-{max(loads):.1f} during "
          f"the jobs; {args.rounds} rounds x {args.iters} calls")
    print(f"{'backend':<17} {'median s':>9} {'best s':>8} {'busbw MB/s':>11} {'x link':>7} {'x ' + BASELINE:>11} "
          f"{'CPU s/call':>11} {'CPU mean':>9} {'CPU frac':>9}")
    table = []
    for backend in backends:
        entry = results.get(backend, {})
        if not entry.get("times_s"):
            print(f"{backend:<17} failed: {entry.get('error', '?')[:80]}")
            continue
        median = statistics.median(entry["times_s"])
        busbw = factor * nbytes / median
        row = {"backend": backend, "hosts": args.hosts, "tasks_per_host": args.tasks_per_host,
               "link": format_rate(spec.link), "median_s": median, "best_s": min(entry["times_s"]),
               "busbw_Bps": busbw, "x_link": busbw / (spec.link / 8),
               "x_baseline": busbw / base_bw if base_bw else None,
               "cpu_per_call_s_max": max(entry["cpu_per_call_s"]), "cpu_fraction_max": max(entry["cpu_fraction"]),
               **entry}
        table.append(row)
        print(f"{backend:<17} {median:>9.3f} {row['best_s']:>8.3f} {busbw / 1e6:>11.1f} {row['x_link']:>7.2f} "
              f"{(row['x_baseline'] or 0):>11.2f} {row['cpu_per_call_s_max']:>11.3f} "
              f"{statistics.mean(entry['cpu_per_call_s']):>9.3f} {row['cpu_fraction_max']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "bytes": nbytes, "loadavg_during": loads,
                       "environment": describe_environment(hosts=[args.hosts], link=args.link)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
