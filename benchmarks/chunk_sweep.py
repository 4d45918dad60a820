#!/usr/bin/env python3
"""Sweep stratagem's all-reduce tuning knobs at one size, to guide their defaults.

    python benchmarks/chunk_sweep.py                       # 64M, 2 processes, zmq (about 2 minutes)
    python benchmarks/chunk_sweep.py --chunks 512K,1M,2M --zero-copy 256K,off --io-threads 1 2
    python benchmarks/chunk_sweep.py --size 16M --np 3 --json sweep.json

Knobs: the communicator's ``chunk_bytes`` (largest message of the pipelined ring) and the zmq
transport's ``zero_copy_bytes`` (messages of at least that many buffer bytes are handed to ZeroMQ by
reference and ``send`` waits until ZeroMQ releases them; smaller ones are copied and ``send`` returns
at once), optionally ``io_threads``. A ring message carries one chunk, so a cell is in zero-copy mode
(Z) when chunk >= zero_copy, else in copy mode (C): cells of the same mode in a row measure the same
thing, which shows the run-to-run noise. Same timing method as ``stratagem bench collectives`` (whose
job runner it uses).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

from stratagem.bench.collectives import make_console
from stratagem.bench.collectives_jobs import run_job, transport_contender
from stratagem.bench.environment import describe_environment
from stratagem.bench.units import human_bytes, parse_size

OFF = 1 << 62  # zero_copy_bytes that no message reaches: always copy


def parse_list(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if item:
            out.append(OFF if item.lower() in ("off", "never", "inf") else parse_size(item))
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def label(v: int) -> str:
    return "off" if v == OFF else human_bytes(v)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes (default 64M)")
    p.add_argument("--np", type=int, default=2, help="processes (default 2)")
    p.add_argument("--transport", default="zmq")
    p.add_argument("--chunks", type=parse_list, default=parse_list("256K,1M,4M,16M"),
                   help="chunk_bytes values (default 256K,1M,4M,16M)")
    p.add_argument("--zero-copy", type=parse_list, default=parse_list("64K,256K,1M,4M,off"),
                   help="zero_copy_bytes values; 'off' = never (default 64K,256K,1M,4M,off)")
    p.add_argument("--io-threads", type=int, nargs="+", default=[1], help="zmq io_threads values (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed iterations (default: 1G/size, 5..200)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2,
                   help="run the grid R times, alternating the order, and pool the iterations (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)

    repeats = args.repeats or max(5, min(200, (1 << 30) // args.size))
    plan = [{"bytes": args.size, "warmup": args.warmup, "iters": repeats}]
    combos = [(io, c, z) for io in args.io_threads for c in args.chunks for z in args.zero_copy]
    log(f"sweep: {human_bytes(args.size)}, np={args.np}, {len(combos)} combinations x {args.rounds} round(s), "
           f"{args.warmup}+{repeats} iterations each")
    env = describe_environment(np=args.np, transport=args.transport, size=args.size)
    contender = transport_contender(args.transport)
    times: dict[tuple, list[float]] = {k: [] for k in combos}
    medians: dict[tuple, list[float]] = {k: [] for k in combos}
    failed: dict[tuple, str] = {}
    interrupted = False
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            for combo in (combos if r % 2 == 0 else combos[::-1]):
                io, chunk, zc = combo
                log(f"-- io_threads={io} chunk_bytes={label(chunk)} zero_copy_bytes={label(zc)}")
                opts = {"chunk_bytes": chunk, "transport_options": {"zero_copy_bytes": zc, "io_threads": io}}
                res = run_job(contender, args.np, plan, options=opts, timeout=args.timeout)
                if res.status == "interrupted":
                    raise KeyboardInterrupt
                e = res.by_size().get(args.size)
                if res.status != "ok" or not e or not e["correct"]:
                    failed[combo] = f"{res.status}: {res.reason}" if res.status != "ok" else "wrong result"
                    continue
                times[combo] += e["times_s"]
                medians[combo].append(statistics.median(e["times_s"]))
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: every child process has been stopped; reporting what finished")
    env["loadavg_at_end"] = os.getloadavg()
    env["total_seconds"] = round(time.monotonic() - started, 1)

    from rich.table import Table

    console = make_console()
    factor = 2 * (args.np - 1) / args.np
    best = None
    rows = []
    for io in args.io_threads:
        table = Table(title=f"stratagem-{args.transport} all-reduce, {human_bytes(args.size)}, {args.np} processes, "
                            f"io_threads={io}: busbw GB/s from the median (and from the min); "
                            f"Z = zero-copy sends, C = copied", title_justify="left")
        table.add_column("chunk_bytes \\ zero_copy_bytes", justify="right")
        for z in args.zero_copy:
            table.add_column(label(z), justify="right")
        for c in args.chunks:
            cells = [label(c)]
            for z in args.zero_copy:
                key = (io, c, z)
                t = times[key]
                if not t:
                    cells.append("failed" if key in failed else "-")
                    continue
                med, lo = statistics.median(t), min(t)
                bw, bw_best = factor * args.size / med / 1e9, factor * args.size / lo / 1e9
                mode = "Z" if c >= z else "C"
                cells.append(f"{bw:.3f} ({bw_best:.2f}) {mode}")
                rows.append({"io_threads": io, "chunk_bytes": c, "zero_copy_bytes": None if z == OFF else z,
                             "mode": "zero-copy" if mode == "Z" else "copy", "median_us": med * 1e6,
                             "min_us": lo * 1e6, "busbw_GBps": bw, "busbw_best_GBps": bw_best,
                             "round_medians_us": [m * 1e6 for m in medians[key]], "times_s": t})
                if best is None or bw > best[0]:
                    best = (bw, key)
            table.add_row(*cells)
        console.print(table)
    if best:
        io, c, z = best[1]
        console.print(f"best median busbw: {best[0]:.3f} GB/s at chunk_bytes={label(c)}, zero_copy_bytes={label(z)}, "
                      f"io_threads={io}", markup=False, highlight=False)
    for key, why in failed.items():
        console.print(f"io_threads={key[0]} chunk={label(key[1])} zero_copy={label(key[2])}: {why}",
                      markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "chunk_sweep", "size": args.size, "np": args.np, "transport": args.transport,
                       "plan": plan, "rounds": args.rounds, "environment": env, "interrupted": interrupted,
                       "results": rows,
                       "failed": [{"io_threads": k[0], "chunk_bytes": k[1],
                                   "zero_copy_bytes": None if k[2] == OFF else k[2], "why": v}
                                  for k, v in failed.items()]}, f, indent=1)
        log(f"wrote {args.json}")
    log(f"total {env['total_seconds']}s")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
