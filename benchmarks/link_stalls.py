"""Slow is not dead, on a real link: two tasks in two network namespaces joined by one veth pair, which a
cell slows (``tc qdisc tbf``) or cuts (``ip link set down``) for a while; is a peer lost, and when?

    sudo python3 benchmarks/link_stalls.py [--transports zmq,grpc] [--peer-timeout 3]

Each cell: both tasks exchange messages (each sends one, then receives the other's, in a loop) for
``--seconds``, the link shaped as the cell says from the start (slow) or cut a second after both
exchanged their first messages. Expected: a
link slowed so much that one message takes longer than the peer timeout to cross is *not* a loss (the
heartbeats still get through between and beside the data); a cut shorter than the peer timeout is not
a loss; a cut longer than it is, on both sides, about a peer timeout after the cut. Needs root (network
namespaces); every namespace and link it makes is named after this process and deleted at the end.
The addresses (10.99.0.1-2) exist only inside those namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
TASK = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from stratagem.core.cluster import ClusterSpec
    from stratagem.core.transport import Message
    from stratagem.plugins.manager import plugin_manager
    transport, me, seconds, size, peer_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    cluster = ClusterSpec({"worker": ["10.99.0.1:23456", "10.99.0.2:23456"]})
    t = plugin_manager().create_transport(transport, cluster=cluster, task=me, timeout=120, peer_timeout=peer_timeout)
    t.start()
    other = [x for x in cluster.tasks() if x != t.task][0]
    buf = np.ones(size // 4, np.float32)
    start = began = time.monotonic(); n = 0; worst = 0.0; stop = False
    try:
        while not stop:
            # worker:0 says when to stop, so both make the same exchanges and neither waits for a last one
            stop = me == "worker:0" and time.monotonic() - start >= seconds
            began = time.monotonic()
            handle = t.send_async(other, "x", Message({"n": n, "stop": stop}, [buf]))
            stop = t.recv(other, "x", timeout=120).meta["stop"] or stop
            handle.wait(120)
            worst = max(worst, time.monotonic() - began); n += 1
            if n == 1:
                print("up", flush=True)
        print(json.dumps({"task": me, "lost": False, "exchanges": n, "slowest": round(worst, 2)}), flush=True)
    except Exception as exc:
        print(json.dumps({"task": me, "lost": True, "at": time.monotonic(), "exchanges": n,
                          "elapsed": round(time.monotonic() - start, 2), "waited": round(time.monotonic() - began, 2),
                          "error": f"{type(exc).__name__}: {exc}"[:200]}), flush=True)
    time.sleep(1.0)   # the other side's last message may still be on its way
    t.abort()
""")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=20)


def cell(transport: str, kind: str, value: str, seconds: float, size: int, peer_timeout: float) -> dict:
    a, b = f"fcA{os.getpid()}", f"fcB{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    env.pop("STRATAGEM_SECRET", None)
    procs = []
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for ns, address in ((a, "10.99.0.1/30"), (b, "10.99.0.2/30")):
            sh("ip", "link", "set", ns, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", address, "dev", ns)
            sh("ip", "-n", ns, "link", "set", ns, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if kind == "slow":
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns, "root", "tbf", "rate", value,
                   "burst", "32kbit", "latency", "200ms")
        for ns, task in ((a, "worker:0"), (b, "worker:1")):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-c", TASK, transport, task, str(seconds), str(size),
                 str(peer_timeout)], stdout=subprocess.PIPE, stderr=open(f"/tmp/link_stalls_{os.getpid()}_{task[-1]}.err", "w") if os.environ.get("LINK_STALLS_LOGS") else subprocess.DEVNULL, text=True, env=env))
        early = {}
        for i, proc in enumerate(procs):   # both connected and exchanging (or already lost)
            line = proc.stdout.readline().strip()
            if line != "up":
                early[i] = line
        if early and kind == "cut":
            raise RuntimeError(f"the {transport} cell's tasks did not come up: {early}")
        cut_at = None
        if kind == "cut":
            time.sleep(1.0)
            cut_at = time.monotonic()
            sh("ip", "-n", a, "link", "set", a, "down")
            time.sleep(float(value))
            sh("ip", "-n", a, "link", "set", a, "up")
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + 150)
            line = (out.strip().splitlines() or [early.get(len(results), "{}")])[-1]
            result = json.loads(line) if line.startswith("{") else {"error": "no result"}
            if cut_at is not None and "at" in result:
                result["after_cut"] = round(result.pop("at") - cut_at, 2)
            result.pop("at", None)
            results.append(result)
        return {"transport": transport, "fault": f"{kind} {value}", "results": results}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for name in (a, b):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="zmq,grpc")
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--cells", default="slow-fast,slow-slow,cut-short,cut-long")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("link_stalls.py needs root (network namespaces)")
    t = args.peer_timeout
    known = {"slow-fast": ("slow", "20mbit", 8 << 20), "slow-slow": ("slow", "2mbit", 1 << 20),
             "cut-short": ("cut", f"{t / 2:g}", 64 << 10), "cut-long": ("cut", f"{3 * t:g}", 64 << 10)}
    cells = [known[name] for name in args.cells.split(",")]
    load = os.getloadavg()
    print(f"peer timeout {t:g} s, {args.seconds:g} s of exchanges per cell; load average {load[0]:.1f}")
    print("| transport | link | message | expected | worker:0 | worker:1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for transport in args.transports.split(","):
        for kind, value, size in cells:
            expected = "lost" if kind == "cut" and float(value) > t else "not lost"
            out = cell(transport, kind, value, args.seconds, size, t)

            def show(r):
                if r.get("lost"):
                    when = (f"{r['after_cut']} s after the cut" if "after_cut" in r else
                            f"{r.get('elapsed')} s in, exchange {r.get('exchanges')} waited {r.get('waited')} s")
                    return f"lost {when}: {r.get('error', '')[:80]}"
                return f"not lost ({r.get('exchanges')} exchanges, slowest {r.get('slowest')} s)" if "exchanges" in r else str(r)

            print(f"| {transport} | {kind} {value} | {size >> 10} KiB | {expected} | "
                  f"{show(out['results'][0])} | {show(out['results'][1])} |", flush=True)


if __name__ == "__main__":
    main()
