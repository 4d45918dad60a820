#!/usr/bin/env python3
"""Overlap of the gradient all-reduce with the backward pass: stratagem.torch with and without it, next
to PyTorch DDP over gloo, on one rate-limited link.

    python benchmarks/ddp_overlap.py                          # needs root (network namespaces, tc)
    python benchmarks/ddp_overlap.py --rate 1gbit --width 1024 --layers 4 --batch 1280 --rounds 3
    python benchmarks/ddp_overlap.py --before /tmp/base/src   # also main's stratagem, in the same rounds

Two "hosts": two network namespaces (each held by an ``unshare -n`` process) joined by a veth pair
whose both ends are shaped with ``tc qdisc add dev X root tbf rate RATE burst 256kb latency 50ms``
(nothing is created in this machine's own namespace; addresses exist only inside the two). One rank
per host trains the same MLP (``--layers`` layers ``--width`` x ``--width``, 16 MiB of float32
gradients by default, SGD) with the same bucket size (``--bucket-mb``, DDP's ``bucket_cap_mb``):

- ``overlap``: ``stratagem.torch.DistributedOptimizer`` (mirrored, zmq), buckets all-reduced during
  the backward pass;
- ``no-overlap``: the same with ``overlap=False`` (every bucket all-reduced in ``step()``);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo.

With ``--before SRC`` (another checkout's ``src``, put on PYTHONPATH) ``overlap-before`` and
``no-overlap-before`` run that code in the same rounds. The default batch (1280 rows per rank) makes
the backward pass (~135 ms on one core) about as long as the all-reduce of 16 MiB at 1 Gbit/s (134 ms
at line rate), as issue 24 asks.

Each round runs the modes one after another (ranks in their namespaces, a fresh process pair
per mode). Each rank first times forward + backward with no communication (``compute``). The table
gives the median step per mode (the slower rank's), overlap / no-overlap, DDP / overlap (>= 1.0:
stratagem at least as fast), and CPU seconds per step of each rank. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_ddp_overlap_worker.py")
MODES = ("overlap", "no-overlap", "ddp")
#: With --before SRC: stratagem's two modes from another checkout (SRC on PYTHONPATH), in the same rounds.
BEFORE_MODES = ("overlap-before", "no-overlap-before")
#: Addresses inside the two namespaces only.
SUBNET = f"10.231.{os.getpid() % 250}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def nsenter(ns: subprocess.Popen, *command: str) -> list[str]:
    return ["nsenter", "-t", str(ns.pid), "-n", *command]


def run_in(ns, *command: str) -> None:
    subprocess.run(nsenter(ns, *command), check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Two namespaces and a shaped veth pair; ``close()`` kills the holders (the pair goes with them)."""

    def __init__(self, rate: str):
        self.holders = [subprocess.Popen(["unshare", "-n", "--", "sleep", "3600"]) for _ in range(2)]
        ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
        for ns in self.holders:
            while os.readlink(f"/proc/{ns.pid}/ns/net") == ours:     # not made yet: nsenter would enter ours
                if ns.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("unshare -n made no namespace")
                time.sleep(0.01)
        name = f"ddp{os.getpid() % 100000}"
        self.ifnames = [f"{name}a", f"{name}b"]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        run_in(self.holders[0], "ip", "link", "add", self.ifnames[0], "type", "veth", "peer", "name",
               self.ifnames[1], "netns", str(self.holders[1].pid))
        for ns, ifname, address in zip(self.holders, self.ifnames, self.addresses):
            run_in(ns, "ip", "link", "set", "lo", "up")
            run_in(ns, "ip", "addr", "add", f"{address}/24", "dev", ifname)
            run_in(ns, "ip", "link", "set", ifname, "up")
            run_in(ns, "tc", "qdisc", "add", "dev", ifname, "root", "tbf", "rate", rate, "burst", "256kb",
                   "latency", "50ms")

    def close(self) -> None:
        for ns in self.holders:
            ns.kill()
            ns.wait(timeout=30)


def run_mode(hosts: Hosts, mode: str, port: int, worker_args: list[str], timeout: float,
             before: str | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if mode.endswith("-before"):
        mode, env["PYTHONPATH"] = mode[:-len("-before")], before
    cluster = {"worker": [f"{hosts.addresses[0]}:{port}", f"{hosts.addresses[1]}:{port + 1}"]}
    procs = []
    try:
        for rank, ns in enumerate(hosts.holders):
            extra = []
            if mode == "ddp":
                extra = ["--master", f"{hosts.addresses[0]}:{port + 2}", "--rank", str(rank),
                         "--ifname", hosts.ifnames[rank]]
            rank_env = dict(env, STRATAGEM_CONFIG=json.dumps({"cluster": cluster,
                                                             "task": {"type": "worker", "index": rank}}))
            procs.append(subprocess.Popen(nsenter(ns, sys.executable, WORKER, mode, *worker_args, *extra),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env))
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode}: a rank failed ({proc.returncode}):\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1280)
    parser.add_argument("--bucket-mb", type=float, default=4)
    parser.add_argument("--chunk-mb", type=float, help="stratagem's chunk_bytes (default: the strategy's)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="a subset of " + ",".join(MODES + BEFORE_MODES) + " (the -before ones need --before)")
    parser.add_argument("--before", metavar="SRC", help="also run stratagem's modes from this checkout's src "
                        "(PYTHONPATH), as overlap-before and no-overlap-before, in the same rounds")
    parser.add_argument("--json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("ddp_overlap.py makes network namespaces and shapes a veth pair: run it as root")
    worker_args = ["--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
                   "--bucket-mb", str(args.bucket_mb), "--steps", str(args.steps)]
    if args.chunk_mb:
        worker_args += ["--chunk-mb", str(args.chunk_mb)]
    wanted = args.modes.split(",") + (list(BEFORE_MODES) if args.before else [])
    modes = [m for m in MODES + BEFORE_MODES if m in wanted]
    if any(m in BEFORE_MODES for m in modes) and not args.before:
        raise SystemExit("the -before modes need --before SRC")
    hosts = Hosts(args.rate)
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    load = []
    try:
        port = 21000
        for round_ in range(args.rounds):
            for mode in modes:
                load.append(os.getloadavg()[0])
                log(f"round {round_ + 1}/{args.rounds}: {mode} (load {load[-1]:.1f})")
                runs[mode].append(run_mode(hosts, mode, port, worker_args, args.timeout, args.before))
                port += 10
    finally:
        hosts.close()
    rows = {}
    for mode in modes:
        steps = [max(r["step_s"] for r in ranks) for ranks in runs[mode]]    # the slower rank's, per round
        rows[mode] = {"step_s": statistics.median(steps), "rounds": steps,
                      "compute_s": statistics.median(r["compute_s"] for ranks in runs[mode] for r in ranks),
                      "cpu_s": [statistics.median(ranks[i]["cpu_s"] for ranks in runs[mode]) for i in range(2)],
                      "buckets": runs[mode][0][0].get("buckets"),
                      "step_call_s": [ranks[0].get("step_call_s") for ranks in runs[mode]]}
    grads_mb = (args.layers * (args.width * args.width + args.width) + args.width * 10 + 10) * 4 / (1 << 20)
    print(f"# ddp_overlap: MLP {args.layers} x {args.width}^2 ({grads_mb:.1f} MiB of gradients), batch {args.batch}, "
          f"buckets {args.bucket_mb} MiB, link {args.rate} (tbf) between 2 namespaces, 1 rank each, "
          f"{args.steps} timed steps x {args.rounds} rounds; load average {min(load):.1f}-{max(load):.1f} "
          f"on {os.cpu_count()} cores")
    print("| mode | step (ms, median) | per round (ms) | compute alone (ms) | in opt.step() (ms, rank 0) "
          "| CPU s/step rank 0, 1 | buckets |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        row = rows[mode]
        inside = ", ".join("-" if s is None else f"{s * 1e3:.0f}" for s in row["step_call_s"])
        print(f"| {mode} | {row['step_s'] * 1e3:.0f} | {', '.join(f'{s * 1e3:.0f}' for s in row['rounds'])} | "
              f"{row['compute_s'] * 1e3:.0f} | {inside} | {row['cpu_s'][0]:.2f}, {row['cpu_s'][1]:.2f} | "
              f"{row['buckets'] or '-'} |")
    for suffix in ("", "-before"):
        names = ("overlap" + suffix, "no-overlap" + suffix, "ddp")
        if not all(name in rows for name in names):
            continue
        overlap, plain, ddp = (rows[name] for name in names)
        by_round = ", ".join(f"{a / b:.2f}" for a, b in zip(overlap["rounds"], plain["rounds"]))
        print(f"\n{names[0]} / {names[1]} = {overlap['step_s'] / plain['step_s']:.2f} (target <= 0.75; by round "
              f"{by_round}); DDP / {names[0]} = {ddp['step_s'] / overlap['step_s']:.2f} (target >= 1.0; by round "
              f"{', '.join(f'{a / b:.2f}' for a, b in zip(ddp['rounds'], overlap['rounds']))})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
