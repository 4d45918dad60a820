"""One TCP stream one way, then one each way at once, through an emulated link (issue 22, 5f).

A ring all-reduce keeps both directions of every host's link busy at once; `stratagem advise --hosts`
models each direction at the link's payload rate. This measures what plain sockets get on the
emulated hosts (``Hosts.streams`` of `stratagem.testing.hosts`: each stream timed at its receiver from
its first byte to its last), for each TCP congestion control asked for (set per socket, ``TCP_CONGESTION``; the
namespaces inherit this machine's default), with the token buckets' drop counters::

    python3 benchmarks/link_duplex.py --link 100mbit --size 16M --rounds 3 --cc bbr,reno

Needs what emulated hosts need (root, iproute2); prints one line per round and a summary per
congestion control: each direction as a fraction of the link's payload rate
(``stratagem.advise.hosts.PAYLOAD``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from stratagem.advise.hosts import PAYLOAD
from stratagem.bench.units import parse_size
from stratagem.launch.hosts import parse_rate
from stratagem.testing.hosts import emulated_hosts, why_no_hosts


def drops(hosts) -> list[int]:
    """Packets each host's token bucket (its ``eth0`` egress) dropped so far."""
    out = []
    for host in range(len(hosts.names)):
        text = hosts.run(host, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
        out.append(sum(int(n) for n in re.findall(r"dropped (\d+)", text)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--size", type=parse_size, default="16M", help="bytes per stream (4096, 4K, 16M)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cc", default="bbr,reno", help="TCP congestion controls, comma-separated")
    args = parser.parse_args(argv)
    if why_no_hosts():
        print(why_no_hosts(), file=sys.stderr)
        return 2
    nbytes = args.size
    wire = parse_rate(args.link) * PAYLOAD   # bits/s of payload, as Hosts.streams counts
    with emulated_hosts(2, link=args.link) as hosts:
        cc_default = hosts.run(0, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip()
        print(f"{args.link}, {nbytes} bytes a stream, payload rate {wire / 8e6:.2f} MB/s; "
              f"the hosts' default congestion control: {cc_default}")
        for cc in args.cc.split(","):
            one, slower = [], []
            for r in range(args.rounds):
                before = drops(hosts)
                (a,) = hosts.streams([(0, 1)], nbytes, port=5300, congestion=cc)
                b = hosts.streams([(0, 1), (1, 0)], nbytes, port=5310, congestion=cc)
                after = drops(hosts)
                one.append(a / wire)
                slower.append(min(b) / wire)
                print(f"  {cc} round {r + 1}: one way {a / wire:.3f}; both ways {b[0] / wire:.3f} and "
                      f"{b[1] / wire:.3f}; token-bucket drops {[y - x for x, y in zip(before, after)]}", flush=True)
            print(f"{cc}: one way {statistics.median(one):.3f} of the payload rate, the slower of two ways at once "
                  f"{statistics.median(slower):.3f} (median of {args.rounds}; min {min(slower):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
