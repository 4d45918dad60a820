#!/usr/bin/env python3
"""``in_graph`` beside ``mirrored``: steps/s of the MLP with 1, 2 and 3 replicas, in one run.

    python benchmarks/in_graph.py                          # the default run (a minute or two on 2 cores)
    python benchmarks/in_graph.py --np 1 2 --rounds 3 --json out.json

The model is the mirrored benchmark's (benchmarks/mlp_training.py, S-numpy): MLP 784-512-512-10
float32 (2.7 MB of parameters), numpy forward/backward, plain SGD, a fixed synthetic batch of
``--batch`` rows per replica (so a step of N replicas trains N x batch rows: weak scaling). Jobs:

- ``mirrored``: N processes under ``stratagem launch`` over zmq, gradients all-reduced
  (benchmarks/_mlp_training_worker.py);
- ``in_graph``: N processes under ``stratagem launch`` over zmq: the client computes one shard and
  N-1 worker tasks the others; every step the client sends each worker the changed values (all 2.7 MB:
  SGD changes every weight) and its shard, and gets 2.7 MB of gradients back (benchmarks/_in_graph_worker.py);
- ``in_graph-devices``: one process, N CPU replicas (threads) of the client (``devices=N``).

Each job runs in its own processes, one job after another, every round in alternating order; the
figures pool the rounds. steps/s = timed steps / wall time of the timed loop (the client's for
in_graph, the slowest rank's for mirrored). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MIRRORED_WORKER = os.path.join(HERE, "_mlp_training_worker.py")
IN_GRAPH_WORKER = os.path.join(HERE, "_in_graph_worker.py")
BACKENDS = ("mirrored", "in_graph", "in_graph-devices")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def child_env() -> dict:
    """One math thread per process (the replicas share the machine's cores), no inherited cluster."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG", "OMPI_", "PMI"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def run_job(backend: str, n: int, spec: dict, timeout: float) -> dict | None:
    """Run one round of (backend, n); its figures, or None (logged) if it failed."""
    from stratagem.launch.launcher import launch

    label = f"{backend} np={n}"
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        spec = {**spec, "label": label, "timeout": min(timeout, 120)}
        if backend == "mirrored":
            spec.update(model="numpy", stratagem={"transport": "zmq"})
            command, workers = [sys.executable, MIRRORED_WORKER, "stratagem", spec_path, out_path], n
        else:
            spec["devices"] = n if backend == "in_graph-devices" else 1
            command, workers = [sys.executable, IN_GRAPH_WORKER, spec_path, out_path], \
                (1 if backend == "in_graph-devices" else n)
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        started = time.monotonic()
        result = launch(command, workers=workers, output=sys.stderr, error_output=sys.stderr, timeout=timeout,
                        env=child_env())
        if result.interrupted_by is not None:
            raise KeyboardInterrupt
        if not result.ok or not os.path.exists(out_path):
            log(f"[{label}] failed: {result.reason}")
            return None
        with open(out_path) as f:
            run = json.load(f)
    log(f"[{label}] {run['steps'] / run['wall_s']:.1f} steps/s ({time.monotonic() - started:.1f}s)")
    return run


def summarize(runs: list[dict]) -> dict:
    steps = sum(r["steps"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    n, batch = runs[0]["np"], runs[0]["batch"]
    step_ms = statistics.median(s for r in runs for s in r["step_s"]) * 1e3
    sent = [r.get("bytes_sent_per_step") for r in runs if r.get("bytes_sent_per_step") is not None]
    return {"steps_per_s": steps / wall, "samples_per_s": steps * n * batch / wall, "step_ms_median": step_ms,
            "rounds_steps_per_s": [r["steps"] / r["wall_s"] for r in runs],
            "bytes_per_step": statistics.median(sent) if sent else None}


def table(results: dict, args) -> str:
    lines = [f"MLP {'-'.join(map(str, args.sizes))} float32, SGD, {args.batch} rows per replica per step, "
             f"{args.steps} timed steps x {args.rounds} round(s) after {args.warmup} warm-up",
             f"{'replicas':>8}  {'backend':<17}{'steps/s':>9}{'samples/s':>11}{'step ms':>9}{'best round':>12}"
             f"{'scaling':>9}{'sent/step':>11}"]
    for n in args.np:
        for backend in args.backends:
            f = results.get((backend, n))
            if f is None:
                lines.append(f"{n:>8}  {backend:<17}{'failed':>9}")
                continue
            one = results.get((backend, 1))
            scaling = f"{f['samples_per_s'] / one['samples_per_s']:.2f}" if one and n > 1 else ""
            sent = "-" if not f["bytes_per_step"] else f"{f['bytes_per_step'] / 1e6:.2f} MB"
            lines.append(f"{n:>8}  {backend:<17}{f['steps_per_s']:>9.1f}{f['samples_per_s']:>11,.0f}"
                         f"{f['step_ms_median']:>9.1f}{max(f['rounds_steps_per_s']):>12.1f}{scaling:>9}{sent:>11}")
    lines.append("  steps/s: timed steps / wall time, all rounds pooled; samples/s: steps/s x replicas x rows; "
                 "scaling: samples/s over the same backend's with 1 replica; sent/step: payload the client "
                 "(in_graph) or each rank (mirrored) hands its transport per step")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[1, 2, 3], metavar="N", help="replicas (default 1 2 3)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--sizes", default="784,512,512,10", help="layer widths (default 784,512,512,10)")
    p.add_argument("--batch", type=int, default=128, help="rows per replica per step (default 128)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per job and round (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--rounds", type=int, default=2, help="run every job this many times (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    spec = {"sizes": args.sizes, "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "lr": args.lr}
    jobs = [(b, n) for n in args.np for b in args.backends]
    runs: dict = {job: [] for job in jobs}
    interrupted = False
    try:
        for i in range(args.rounds):
            for job in (jobs if i % 2 == 0 else list(reversed(jobs))):
                run = run_job(*job, spec, args.timeout)
                if run is not None:
                    runs[job].append(run)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: reporting what finished")
    results = {job: summarize(r) for job, r in runs.items() if r}
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "in_graph", "spec": spec, "rounds": args.rounds, "loadavg": os.getloadavg(),
                       "cpus": os.cpu_count(), "interrupted": interrupted,
                       "results": [{"backend": b, "np": n, **f} for (b, n), f in results.items()],
                       "runs": [{"backend": b, "np": n, "runs": r} for (b, n), r in runs.items()]}, f, indent=1)
        log(f"wrote {args.json}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
