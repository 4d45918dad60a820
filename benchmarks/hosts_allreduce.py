#!/usr/bin/env python3
"""All-reduce across emulated hosts with shaped links (issue 22, 5a): stratagem beside a plain TCP ring,
torch.distributed/gloo and Open MPI over TCP, side by side in one run.

    python3 benchmarks/hosts_allreduce.py                                # 2, 4, 8 hosts, 1gbit, 64M
    python3 benchmarks/hosts_allreduce.py --hosts 8 --link 500mbit --rounds 3 --json out.json
    python3 benchmarks/hosts_allreduce.py --link 1gbit --link-for 8=500mbit   # a lower rate for 8 hosts
    python3 benchmarks/hosts_allreduce.py --before /tmp/base/src   # + stratagem from another checkout

Each world size is a set of emulated hosts (:mod:`stratagem.launch.hosts`: one network namespace per
host, links shaped with tc in both directions), one task per host. Every contender runs as its own job on
fresh hosts, the contenders interleaved round by round (their order reversed every other round), and
each job times ``--iters`` calls after a warm-up call whose result is checked:

- ``stratagem``: ``stratagem.communicator()`` over ``--transport`` (zmq), under ``stratagem launch --hosts``;
- ``ring``: the plain TCP ring of ``plain_tcp_ring.py`` (no stratagem code), under the same launcher;
- ``gloo``: ``torch.distributed`` over gloo on the hosts' ``eth0``;
- ``mpi4py``: ``MPI.COMM_WORLD.Allreduce`` with Open MPI's ``tcp`` BTL (``--mca btl tcp,self``,
  ``btl_tcp_if_include eth0``): ``mpiexec`` runs inside host 0 with a hostfile of the hosts' addresses
  and starts its daemons on the other hosts through an ``ssh`` agent that enters their namespaces, so
  Open MPI sees only the namespaces' addresses.

A call's time is the slowest rank's (each rank times its own call after the backend's barrier); busbw =
2(n - 1)/n x bytes / time (nccl-tests). CPU is each task's process CPU time (all threads) over its timed
calls: per call, and as a fraction of the wall time (under half a core is what the link rate is chosen
for). Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from stratagem.bench.environment import describe_environment
from stratagem.bench.units import human_bytes, parse_size
from stratagem.launch.hosts import EmulatedHosts, HostsSpec, format_rate
from stratagem.launch.launcher import launch
from stratagem.launch.mpi import find_mpiexec
from stratagem.launch.supervisor import die_with_launcher
from stratagem.testing.hosts import Hosts

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_hosts_allreduce_worker.py")
BACKENDS = ("stratagem", "ring", "gloo", "mpi4py")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMIX_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _rows(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        start = line.find('{"rank"')
        if start >= 0:
            rows.append(json.loads(line[start:]))
    return rows


def run_launched(backend: str, spec: HostsSpec, nbytes: int, iters: int, transport: str, timeout: float,
                 before: str | None = None) -> list[dict]:
    """stratagem, ring or gloo: one job under ``launch(hosts=spec)``; every rank's JSON row. ``before``:
    the ``before`` contender, stratagem imported from that source directory."""
    out, err = io.StringIO(), io.StringIO()
    env = {**_env(), "STRATAGEM_TRANSPORT": transport}
    if backend == "before":
        backend, env["PYTHONPATH"] = "stratagem", before
    result = launch([sys.executable, WORKER, backend, str(nbytes), str(iters)], workers=spec.count, hosts=spec,
                    env=env, output=out, error_output=err, timeout=timeout)
    if result.interrupted_by is not None:
        raise KeyboardInterrupt
    if not result.ok:
        raise RuntimeError(f"{backend}: {result.reason}\n{err.getvalue()[-3000:]}")
    return _rows(out.getvalue())


_SSH_AGENT = """#!{python} -S
# Open MPI's "ssh" into an emulated host: run the command inside the host at that address.
import os, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[1:]
inside = {inside!r}[args[0]] + ["/bin/sh", "-c", " ".join(args[1:])]
os.execv(inside[0], inside)
"""


def run_mpi(spec: HostsSpec, nbytes: int, iters: int, timeout: float) -> list[dict]:
    """mpi4py: one mpiexec job started inside host 0 (see the module doc); every rank's JSON row."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("no mpiexec (pip install 'stratagem[mpi]')")
    network = EmulatedHosts(spec).start()
    hosts = Hosts(network)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inside = {address: hosts.command(i, []) for i, address in enumerate(hosts.addresses)}
            agent, hostfile = os.path.join(tmp, "ssh-agent"), os.path.join(tmp, "hostfile")
            with open(agent, "w") as f:
                f.write(_SSH_AGENT.format(python=sys.executable, inside=inside))
            os.chmod(agent, 0o755)
            with open(hostfile, "w") as f:
                f.write("".join(f"{address} slots=1\n" for address in hosts.addresses))
            cmd = [mpiexec, "--hostfile", hostfile, "-n", str(spec.count), "--map-by", "node", "--bind-to", "none",
                   "--allow-run-as-root", "--prtemca", "plm_ssh_agent", agent,
                   "--prtemca", "oob_tcp_if_include", "eth0", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                   "--mca", "btl_tcp_if_include", "eth0", sys.executable, WORKER, "mpi4py", str(nbytes), str(iters)]
            done = hosts.popen(0, die_with_launcher(cmd), stdout=-1, stderr=-1, text=True, env=_env())
            try:
                stdout, stderr = done.communicate(timeout=timeout)
            except Exception:
                os.killpg(done.pid, signal.SIGKILL)
                raise
            if done.returncode != 0:
                raise RuntimeError(f"mpi4py: mpiexec exited {done.returncode}\n{stderr[-3000:]}")
            return _rows(stdout)
    finally:
        _kill_in_hosts(network)
        hosts.stop_processes()
        network.close()


def _kill_in_hosts(network: EmulatedHosts) -> None:
    """SIGKILL every process left in the hosts' namespaces (Open MPI's daemons, if mpiexec left any)."""
    holders = set(network.holder_pids())
    spaces = {os.stat(f"/proc/{pid}/ns/net").st_ino for pid in holders}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in holders:
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in spaces:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


def summarize(rows: list[dict], n: int, nbytes: int) -> dict:
    rows = sorted(rows, key=lambda r: r["rank"])
    if len(rows) != n:
        raise RuntimeError(f"{len(rows)} of {n} ranks reported")
    calls = [max(r["times"][i] for r in rows) for i in range(len(rows[0]["times"]))]
    return {"times_s": calls, "cpu_per_call_s": [r["cpu"] / len(r["times"]) for r in rows],
            "cpu_fraction": [r["cpu"] / r["wall"] for r in rows]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8], help="world sizes (one task per host)")
    parser.add_argument("--link", default="1gbit", help="every host's link rate (default 1gbit)")
    parser.add_argument("--link-for", action="append", default=[], metavar="N=RATE",
                        help="the link rate for world size N (e.g. 8=500mbit)")
    parser.add_argument("--size", default="64M", help="bytes all-reduced per call (default 64M)")
    parser.add_argument("--iters", type=int, default=4, help="timed calls per job (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per contender and size, interleaved (default 2)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    parser.add_argument("--transport", default="zmq", help="stratagem's transport (default zmq)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--json", metavar="PATH", help="every time, CPU figure and the environment")
    parser.add_argument("--before", metavar="SRC", help="one more contender, 'before': stratagem imported "
                        "from this source directory (another checkout's src/), for before/after in one run")
    args = parser.parse_args(argv)
    nbytes = parse_size(args.size)
    backends = [b for b in args.backends.split(",") if b]
    if args.before:
        backends.insert(1, "before")
    rates = {int(k): v for k, _, v in (item.partition("=") for item in args.link_for)}
    results: dict = {}
    loads = []
    for n in args.hosts:
        spec = HostsSpec.parse(n, link=rates.get(n, args.link))
        for r in range(args.rounds):
            for backend in (backends if r % 2 == 0 else backends[::-1]):
                log(f"{n} hosts at {format_rate(spec.link)}: {backend}, round {r + 1}/{args.rounds} "
                    f"(load {os.getloadavg()[0]:.1f})")
                loads.append(os.getloadavg()[0])
                try:
                    rows = (run_mpi(spec, nbytes, args.iters, args.timeout) if backend == "mpi4py" else
                            run_launched(backend, spec, nbytes, args.iters, args.transport, args.timeout,
                                         args.before))
                    got = summarize(rows, n, nbytes)
                except (RuntimeError, OSError) as exc:
                    log(f"  failed: {exc}")
                    results.setdefault((n, backend), {"error": str(exc)})
                    continue
                entry = results.setdefault((n, backend), {"times_s": [], "cpu_per_call_s": [], "cpu_fraction": []})
                for key, values in got.items():
                    entry.setdefault(key, []).extend(values)
    factor = lambda n: 2 * (n - 1) / n  # noqa: E731
    print(f"\nall-reduce {human_bytes(nbytes)} float32 sum, one task per emulated host; load average "
          f"{min(loads):.1f}-{max(loads):.1f} during the jobs; {args.rounds} rounds x {args.iters} calls")
    print(f"{'hosts':>5} {'link':>8} {'backend':<10} {'median s':>9} {'busbw MB/s':>11} {'x link':>7} "
          f"{'x ring':>7} {'CPU s/call':>11} {'CPU mean':>9} {'CPU frac':>9}")
    table = []
    for n in args.hosts:
        link = HostsSpec.parse(n, link=rates.get(n, args.link)).link
        ring = results.get((n, "ring"), {})
        ring_bw = (factor(n) * nbytes / statistics.median(ring["times_s"])) if ring.get("times_s") else None
        for backend in backends:
            entry = results.get((n, backend), {})
            if not entry.get("times_s"):
                print(f"{n:>5} {format_rate(link):>8} {backend:<10} failed: {entry.get('error', '?')[:60]}")
                continue
            median = statistics.median(entry["times_s"])
            busbw = factor(n) * nbytes / median
            row = {"hosts": n, "link": format_rate(link), "backend": backend, "median_s": median, "busbw_Bps": busbw,
                   "x_link": busbw / (link / 8), "x_ring": busbw / ring_bw if ring_bw else None,
                   "cpu_per_call_s_max": max(entry["cpu_per_call_s"]), "cpu_fraction_max": max(entry["cpu_fraction"]),
                   **entry}
            table.append(row)
            print(f"{n:>5} {row['link']:>8} {backend:<10} {median:>9.3f} {busbw / 1e6:>11.1f} {row['x_link']:>7.2f} "
                  f"{(row['x_ring'] or 0):>7.2f} {row['cpu_per_call_s_max']:>11.3f} "
                  f"{statistics.mean(entry['cpu_per_call_s']):>9.3f} {row['cpu_fraction_max']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "bytes": nbytes, "loadavg_during": loads,
                       "environment": describe_environment(hosts=args.hosts, link=args.link)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
