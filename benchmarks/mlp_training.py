#!/usr/bin/env python3
"""MLP training benchmark: the ``mirrored`` strategy over zmq next to PyTorch DistributedDataParallel (gloo).

    python benchmarks/mlp_training.py                       # the default run (a few minutes on 2 cores)
    python benchmarks/mlp_training.py --np 2 --rounds 3 --json out.json
    python benchmarks/mlp_training.py --backends S-torch --buckets 1,256K,1M,2M,4M,25M

An MLP 784-512-512-10 (670K float32 parameters, 2.7 MB of gradients per step), batch 128 per worker,
synthetic data, plain SGD, a fixed number of timed steps after a warm-up, with 1, 2 and 3 workers:

- ``S-numpy``: stratagem ``mirrored`` over zmq, forward/backward in float32 numpy;
- ``S-torch``: the same strategy, the model in PyTorch (its parameters are views of the mirrored
  variables, gradients from autograd): same compute as DDP, so the comparison isolates communication;
- ``DDP``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, the reference to beat.

Then a sweep of the strategy's fusion bucket size (``bucket_bytes``) at 2 workers (S-torch). Each
(backend, workers, bucket) job runs in its own processes, one job after another. See
benchmarks/README.md for how to read the tables; the timing method is described in
benchmarks/_mlp_training_worker.py. Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from allreduce import (  # noqa: E402  (the all-reduce benchmark's process and environment helpers)
    child_env, environment, human, in_netns, log, make_console, parse_bytes, private_netns, run_process_job,
)

WORKER = os.path.join(HERE, "_mlp_training_worker.py")
BACKENDS = ("S-numpy", "S-torch", "DDP")
#: The target: at this many workers, stratagem's samples/s >= this times DDP's.
TARGET_NP, TARGET_RATIO = 2, 1.0


@dataclass
class Job:
    backend: str
    np: int
    bucket: int | None = None          # bucket_bytes for a sweep job (None: the strategy's default)
    runs: list[dict] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0
    loadavg: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return self.backend, self.np, self.bucket


def torch_missing() -> str | None:
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            return "torch.distributed with gloo is not available in this build"
    except ImportError as exc:
        return f"torch not importable ({exc})"
    return None


def run_job(job: Job, spec: dict, timeout: float) -> None:
    """Run one round of ``job`` (its own processes); append its figures, or record why there are none."""
    label = f"{job.backend} np={job.np}" + (f" bucket={human(job.bucket)}" if job.bucket else "")
    if job.backend != "S-numpy":
        why = torch_missing()
        if why:
            job.skipped = f"skipped: {why}"
            log(f"[{label}] {job.skipped}")
            return
    log(f"[{label}] starting")
    started = time.monotonic()
    job.loadavg.append(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        spec = {**spec, "label": label, "timeout": min(timeout, 300), "job_timeout": timeout}
        if job.backend.startswith("S-"):
            spec["model"] = job.backend[2:]
            spec["stratagem"] = {"transport": "zmq", **({"bucket_bytes": job.bucket} if job.bucket else {})}
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        if job.backend.startswith("S-"):
            from stratagem.launch.launcher import launch

            result = launch([sys.executable, WORKER, "stratagem", spec_path, out_path], workers=job.np,
                            output=sys.stderr, error_output=sys.stderr, timeout=timeout, env=child_env())
            if result.interrupted_by is not None:
                raise KeyboardInterrupt
            rc, why = result.exit_code, "" if result.ok else result.reason
        else:
            ok, _ = private_netns()
            # torch's TCPStore listens on every address; inside a private network namespace "every" is
            # loopback only. Without unshare, rendezvous through a file (no listening socket at all).
            env = child_env({"GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR",
                             "BENCH_GLOO_RENDEZVOUS": "tcp" if ok else "file", "BENCH_NETNS": "1" if ok else "0"})
            cmd = [sys.executable, WORKER, "ddp-spawn", spec_path, out_path, str(job.np)]
            rc, why = run_process_job(in_netns(cmd) if ok else cmd, env, timeout)
        if rc == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                job.runs.append(json.load(f))
        else:
            job.skipped = f"failed: {why or 'no results written'}"
    job.seconds += time.monotonic() - started
    log(f"[{label}] {'done' if rc == 0 else job.skipped} in {time.monotonic() - started:.1f}s")


# -- figures ----------------------------------------------------------------------------------------

def figures(job: Job) -> dict | None:
    """The job's figures, every round pooled: samples/s from summed walls, medians over all steps."""
    if not job.runs:
        return None
    runs = job.runs

    def per_step(fn) -> list[float]:
        """``fn(run, i)`` for every timed step of every round."""
        return [fn(r, i) for r in runs for i in range(len(r["step_s"]))]

    def med(fn) -> float:
        return statistics.median(per_step(fn))

    samples = sum(r["np"] * r["batch"] * r["steps"] for r in runs)
    n, batch = runs[0]["np"], runs[0]["batch"]
    step = med(lambda r, i: r["step_s"][i])
    mean_step = med(lambda r, i: r["mean_step_s"][i])
    f = {"samples_per_s": samples / sum(r["wall_s"] for r in runs),
         "samples_per_s_median_step": n * batch / step,
         "round_samples_per_s": [r["np"] * r["batch"] * r["steps"] / r["wall_s"] for r in runs],
         "step_ms": step * 1e3, "step_p90_ms": _quantile(per_step(lambda r, i: r["step_s"][i]), 0.9) * 1e3,
         "mean_step_ms": mean_step * 1e3, "compute_ms": med(lambda r, i: r["mean_compute_s"][i]) * 1e3,
         "grad_bytes": runs[0]["grad_bytes"], "rounds": len(runs)}
    sent = [r["bytes_sent_per_step"] for r in runs if r.get("bytes_sent_per_step") is not None]
    f["bytes_per_step"] = statistics.median(sent) if sent else None
    if job.backend == "DDP":
        # DDP overlaps the all-reduce with backward: what shows is the step time beyond no_sync's.
        f["comm_ms"] = med(lambda r, i: r["pair_step_s"][i] - r["mean_compute_s"][i]) * 1e3
        f["comm_share"] = med(lambda r, i: (r["pair_step_s"][i] - r["mean_compute_s"][i]) / r["pair_step_s"][i])
        f["comm_kind"] = "exposed"
        f["other_ms"] = f["calls"] = None
    else:
        f["comm_ms"] = med(lambda r, i: r["mean_allreduce_s"][i]) * 1e3
        f["comm_min_ms"] = med(lambda r, i: r["allreduce_min_s"][i]) * 1e3
        # The least disturbed steps: 10th percentiles (outside load only ever adds time).
        f["comm_p10_ms"] = _quantile(per_step(lambda r, i: r["mean_allreduce_s"][i]), 0.1) * 1e3
        f["step_p10_ms"] = _quantile(per_step(lambda r, i: r["mean_step_s"][i]), 0.1) * 1e3
        f["comm_share_p10"] = f["comm_p10_ms"] / f["step_p10_ms"]
        f["pack_ms"] = med(lambda r, i: r["mean_sync_s"][i] - r["mean_allreduce_s"][i]) * 1e3
        f["update_ms"] = med(lambda r, i: r["mean_apply_s"][i] - r["mean_sync_s"][i]) * 1e3
        f["other_ms"] = f["pack_ms"] + f["update_ms"]
        f["comm_share"] = med(lambda r, i: r["mean_allreduce_s"][i] / r["mean_step_s"][i])
        f["comm_kind"] = "inside"
        f["calls"] = statistics.median(r["allreduce_calls_per_step"] for r in runs)
    return f


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))]


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.2f} MB"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def build_tables(jobs: list[Job], args, console) -> list[dict]:
    from rich.table import Table

    main_jobs = [j for j in jobs if j.bucket is None]
    one = {j.backend: figures(j) for j in main_jobs if j.np == 1}
    table = Table(title=f"MLP {'-'.join(map(str, args.sizes))} float32, SGD, batch {args.batch} per worker, "
                        f"{args.steps} timed steps x {args.rounds} round(s) after {args.warmup} warm-up",
                  title_justify="left")
    for name in ("workers", "backend", "samples/s", "samples/s\n@median", "samples/s\nbest round", "scaling\nvs 1",
                 "step ms\nmedian",
                 "step ms\np90", "compute\nms", "comm\nms", "comm\nshare", "pack+upd\nms", "all-red.\n/step",
                 "sent/step\n/worker"):
        table.add_column(name, justify="left" if name == "backend" else "right")
    rows = []
    for n in args.np:
        for j in [j for j in main_jobs if j.np == n]:
            f = figures(j)
            if f is None:
                table.add_row(str(n), j.backend, j.skipped or "-", *[""] * 11)
                continue
            base = one.get(j.backend)
            scaling = f"{f['samples_per_s'] / (n * base['samples_per_s']):.2f}" if base and n > 1 else ""
            ddp = j.backend == "DDP"
            table.add_row(
                str(n), j.backend, f"{f['samples_per_s']:,.0f}", f"{f['samples_per_s_median_step']:,.0f}",
                f"{max(f['round_samples_per_s']):,.0f}", scaling,
                _ms(f["step_ms"]), _ms(f["step_p90_ms"]), _ms(f["compute_ms"]) + ("**" if ddp else ""),
                (_ms(f["comm_ms"]) + ("*" if ddp else "")) if n > 1 else "-",
                f"{f['comm_share']:.0%}" if n > 1 else "-", _ms(f["other_ms"]),
                "-" if f["calls"] is None else f"{f['calls']:g}", _mb(f["bytes_per_step"]) if n > 1 else "-")
            rows.append((n, j.backend, f))
    console.print(table)
    console.print(
        "  samples/s: workers x batch x steps / wall time of the slowest worker (every round); @median: workers x "
        "batch / median step; best round: the round with the most samples/s (the least disturbed by outside load). step: the slowest worker's. compute, comm, pack+upd: median over steps of the mean "
        "over workers. S-*: comm = time inside the strategy's bucket all-reduces (includes waiting for the slower "
        "worker); pack+upd = packing gradients into buckets + the SGD update; comm share = comm / step (mean over "
        "workers). DDP: compute** = step time under ddp.no_sync() (forward, backward, update), comm* = synced step "
        "- no_sync step = the communication DDP did not hide behind backward (from a second loop alternating the "
        "two), comm share = comm* / synced step. sent/step: S-* payload handed to the transport, DDP bytes "
        "on the job's loopback / workers.", markup=False, highlight=False)
    by = {(n, b): f for n, b, f in rows}
    verdicts = []
    for n in args.np:
        ddp = by.get((n, "DDP"))
        for backend in ("S-numpy", "S-torch"):
            ours = by.get((n, backend))
            if ours and ddp and n > 1:
                ratio = ours["samples_per_s"] / ddp["samples_per_s"]
                verdict = {"np": n, "backend": backend, "ratio": ratio,
                           "ratio_median_step": ours["samples_per_s_median_step"] / ddp["samples_per_s_median_step"],
                           "ratio_best_round": max(ours["round_samples_per_s"]) / max(ddp["round_samples_per_s"]),
                           "ours_samples_per_s": ours["samples_per_s"], "ddp_samples_per_s": ddp["samples_per_s"]}
                if n == TARGET_NP:
                    verdict["met"] = ratio >= TARGET_RATIO
                verdicts.append(verdict)
    for v in verdicts:
        line = (f"{v['np']} workers: {v['backend']} {v['ours_samples_per_s']:,.0f} samples/s vs DDP-gloo "
                f"{v['ddp_samples_per_s']:,.0f} = {v['ratio']:.2f}x (at the median step: {v['ratio_median_step']:.2f}x, "
                f"best rounds: {v['ratio_best_round']:.2f}x)")
        if "met" in v:
            line = f"target [{'MET' if v['met'] else 'MISSED'}]: {line}; target >= {TARGET_RATIO:.1f}x"
        console.print(line, markup=False, highlight=False)
    console.print()

    sweep = [j for j in jobs if j.bucket is not None]
    if sweep:
        st = Table(title=f"fusion bucket size sweep: {sweep[0].backend}, {sweep[0].np} workers (bucket_bytes; "
                         f"a gradient larger than a bucket gets one of its own)", title_justify="left")
        for name in ("bucket_bytes", "all-red.\n/step", "samples/s", "samples/s\n@median", "step ms\nmedian",
                     "step ms\np10", "compute\nms", "comm ms\nmedian", "comm ms\np10", "comm share\nmedian",
                     "comm share\np10", "pack+upd\nms", "sent/step\n/worker"):
            st.add_column(name, justify="right")
        for j in sorted(sweep, key=lambda j: j.bucket):
            f = figures(j)
            if f is None:
                st.add_row(human(j.bucket), j.skipped or "-", *[""] * 11)
                continue
            st.add_row(human(j.bucket), f"{f['calls']:g}", f"{f['samples_per_s']:,.0f}",
                       f"{f['samples_per_s_median_step']:,.0f}", _ms(f["step_ms"]), _ms(f["step_p10_ms"]),
                       _ms(f["compute_ms"]), f"{f['comm_ms']:.2f}", f"{f['comm_p10_ms']:.2f}", f"{f['comm_share']:.0%}",
                       f"{f['comm_share_p10']:.0%}", _ms(f["other_ms"]), _mb(f["bytes_per_step"]))
        console.print(st)
        console.print("  p10: 10th percentile over steps (of the mean over workers): the least disturbed steps; comm share "
                      "p10 = comm p10 / step p10. Buckets never split a gradient: with this model 4M and 25M are the "
                      "same layout (one bucket).", markup=False, highlight=False)
        console.print()
    for j in jobs:
        if j.skipped and not j.runs:
            console.print(f"  {j.backend} np={j.np}: {j.skipped}", markup=False, highlight=False)
    return verdicts


# -- main ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Tables go to stdout, progress to stderr. See benchmarks/README.md.")
    p.add_argument("--np", type=int, nargs="+", default=[1, 2, 3], metavar="N", help="workers (default: 1 2 3)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)} (default: all)")
    p.add_argument("--sizes", default="784,512,512,10", help="layer widths (default 784,512,512,10)")
    p.add_argument("--batch", type=int, default=128, help="rows per worker per step (default 128)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per job and round (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--buckets", default="1,1M,2M,4M,25M",
                   help="bucket_bytes values of the sweep (default 1,1M,2M,4M,25M; '' for no sweep)")
    p.add_argument("--sweep-np", type=int, default=2, help="workers in the sweep (default 2)")
    p.add_argument("--sweep-backend", default="S-torch", choices=["S-torch", "S-numpy"],
                   help="model of the sweep (default S-torch, S-numpy without torch)")
    p.add_argument("--rounds", type=int, default=3, metavar="R",
                   help="run every job R times, alternating the order, and pool the steps (default 3)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job before it is stopped (default 300)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment here")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        p.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.buckets = [parse_bytes(b) for b in args.buckets.split(",") if b.strip()]
    if args.sweep_backend == "S-torch" and torch_missing():
        args.sweep_backend = "S-numpy"
    if any(n < 1 for n in args.np) or args.steps < 1 or args.rounds < 1 or len(args.sizes) < 2:
        p.error("--np, --steps and --rounds must be >= 1, --sizes needs 2 widths or more")
    return args


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    env = environment()
    try:
        import stratagem

        pkg = os.path.dirname(stratagem.__file__)
        import hashlib

        env.setdefault("stratagem_sources_sha256", {})["strategies/mirrored/strategy.py"] = hashlib.sha256(
            open(os.path.join(pkg, "strategies", "mirrored.py"), "rb").read()).hexdigest()[:12]
    except Exception:
        pass
    jobs = [Job(b, n) for n in args.np for b in args.backends]
    jobs += [Job(args.sweep_backend, args.sweep_np, bucket) for bucket in args.buckets]
    spec = {"sizes": args.sizes, "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "lr": args.lr}
    log(f"{len(jobs)} jobs x {args.rounds} round(s): " + ", ".join(
        f"{j.backend} np={j.np}" + (f" bucket={human(j.bucket)}" if j.bucket else "") for j in jobs))
    interrupted = False
    started = time.monotonic()
    try:
        for i in range(args.rounds):
            # Alternate the order, so a burst of outside load does not always hit the same backend.
            order = jobs if i % 2 == 0 else list(reversed(jobs))
            if args.rounds > 1:
                log(f"round {i + 1}/{args.rounds}")
            for job in order:
                if job.skipped and job.skipped.startswith("skipped"):
                    continue
                run_job(job, spec, args.timeout)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: every child process has been stopped; reporting what finished")
    env["loadavg_at_end"] = os.getloadavg()
    env["total_seconds"] = round(time.monotonic() - started, 1)

    console = make_console()
    verdicts = build_tables(jobs, args, console)
    if args.json:
        doc = {
            "benchmark": "mlp_training", "sizes": args.sizes, "batch_per_worker": args.batch,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "lr": args.lr,
            "command": [os.path.basename(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)],
            "environment": env, "targets": verdicts, "interrupted": interrupted,
            "jobs": [{"backend": j.backend, "np": j.np, "bucket_bytes": j.bucket, "skipped": j.skipped,
                      "seconds": round(j.seconds, 2), "loadavg_at_start": j.loadavg, "figures": figures(j),
                      "runs": j.runs} for j in jobs],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {args.json}")
    log(f"total {env['total_seconds']}s")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
