"""One rank of benchmarks/ddp_overlap.py (started by it inside a network namespace; not run by hand).

    _ddp_overlap_worker.py MODE --width W --layers L --batch B --bucket-mb M --steps N --warmup K
                           [--master ADDR:PORT --rank R --ifname IF]     (ddp)

MODE: ``overlap`` / ``no-overlap`` (stratagem ``mirrored`` over zmq, ``STRATAGEM_CONFIG`` from the
environment; ``DistributedOptimizer(overlap=...)``) or ``ddp`` (torch DDP over gloo). Every mode trains
the same MLP (``L`` layers ``W x W``, SGD) on synthetic data with the same bucket size; first it
times ``--steps`` forward + backward passes with no communication (the compute alone). Prints one
JSON line: median step seconds, median compute seconds, the CPU seconds per timed step of this
process, and for stratagem the median time inside ``opt.step()`` (waiting for the last buckets, the
SGD update).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def model_and_data(args):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return model, x, y


def timed(step, steps: int, warmup: int) -> tuple[list[float], float]:
    for _ in range(warmup):
        step()
    times, cpu = [], time.process_time()
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("overlap", "no-overlap", "ddp"))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--bucket-mb", type=float, default=4)
    parser.add_argument("--chunk-mb", type=float)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--master")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ifname")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x, y = model_and_data(args)

    def compute():
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()

    compute_times, _ = timed(compute, args.steps, args.warmup)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    if args.mode == "ddp":
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=2)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step():
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    else:
        import stratagem
        import stratagem.torch

        options = {"chunk_bytes": int(args.chunk_mb * (1 << 20))} if args.chunk_mb else {}
        strategy = stratagem.strategy("mirrored", transport="zmq", timeout=120, **options)
        opt = stratagem.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                                   model.named_parameters(), strategy=strategy,
                                                   overlap=args.mode == "overlap", bucket_bytes=bucket_bytes)

        def step():
            F.cross_entropy(model(x), y).backward()
            started = time.perf_counter()
            opt.step()
            waits.append(time.perf_counter() - started)
            opt.zero_grad()

    waits: list[float] = []
    times, cpu = timed(step, args.steps, args.warmup)
    print(json.dumps({"mode": args.mode, "step_s": statistics.median(times), "compute_s": statistics.median(compute_times),
                      "cpu_s": cpu, "step_call_s": statistics.median(waits) if waits else None, "buckets": len(opt.bucket_members or []) if args.mode != "ddp" else None}),
          flush=True)
    if args.mode == "ddp":
        dist.destroy_process_group()


main()
