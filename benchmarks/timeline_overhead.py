#!/usr/bin/env python3
"""What recording a timeline costs: training steps with and without ``STRATAGEM_TIMELINE``.

    python benchmarks/timeline_overhead.py                          # 3 rounds, about 3 minutes on 2 cores
    python benchmarks/timeline_overhead.py --rounds 5 --steps 100 --json out.json

For each strategy (``mirrored``: 2 workers; ``between_graph``, sync: 2 workers and a ps task) and
each model of ``stratagem.bench.models`` (``mlp``, small: 1.6 MB of parameters, compute-bound;
``wide``, medium: 8 MB, communication-bound), a job of ``benchmarks/_timeline_worker.py`` under
``stratagem.launch.launcher.launch`` trains ``--steps`` timed steps after ``--warmup``, once without
a timeline and once with one (each task writing its file at exit, as under ``launch --timeline``).
The pairs run in alternating order (off/on, then on/off) and the configurations interleave, round
after round, so that load changes on a shared machine hit both sides alike (table A). Then, in each
round, one more job per configuration records every other step only (table B): odd steps with the
recorder, even steps without, the same on both replicas, so both kinds of step share the job, the
load and the network; this is the precise figure on a busy machine, and ``paired`` (the median,
over every recorded step, of its time over that of the unrecorded step beside it) the most robust
one. A job's figure is the median of
the chief's step times (``perf_counter`` around ``strategy.run``); the overhead of a configuration is
the median over rounds of (with / without) - 1, next to the ratio of the pooled medians and of the
pooled minimums. Also shown: events recorded per step by the chief. The target (issue 16): under 3%
of the step time.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_timeline_worker.py")
TARGET = 0.03


def run_job(strategy: str, model: str, steps: int, warmup: int, timeline: bool | None, timeout: float) -> dict:
    """One job; ``timeline`` True/False: with/without (STRATAGEM_TIMELINE), None: every other step."""
    from stratagem.launch.launcher import launch

    ps = 1 if strategy == "between_graph" else 0
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "STRATAGEM_TIMELINE": None}
    folder = tempfile.mkdtemp(prefix="timeline-overhead-")
    if timeline:
        env["STRATAGEM_TIMELINE"] = os.path.join(folder, "{task}.json")
    out, err = io.StringIO(), io.StringIO()
    command = [sys.executable, WORKER, strategy, model, str(steps), str(warmup), "steps" if timeline is None else "job"]
    for attempt in range(3):   # a port taken between the launcher's choice and the bind: start again
        out, err = io.StringIO(), io.StringIO()
        result = launch(command, workers=2, ps=ps, transport="zmq", env=env, timeout=timeout, output=out,
                        error_output=err)
        if result.ok or "Address already in use" not in err.getvalue():
            break
    if not result.ok:
        raise RuntimeError(f"{strategy}/{model} (timeline {timeline}) failed: {result.summary()}\n{err.getvalue()[-3000:]}")
    line = next(line for line in out.getvalue().splitlines() if "RESULT " in line)
    reported = json.loads(line.split("RESULT ", 1)[1])
    events = reported["events"] or 0
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as stream:
            doc = json.load(stream)
        if doc["otherData"]["stratagem_timeline"]["task"] == "/job:worker/task:0":
            events = sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
        os.unlink(path)
    os.rmdir(folder)
    times = reported["times"]
    if timeline is None:   # interleaved steps: the off and on halves of one job
        off = [t for t, on in zip(times, reported["on"]) if not on]
        on = [t for t, on in zip(times, reported["on"]) if on]
        flags = reported["on"]
        # Each recorded step against the unrecorded step next to it: neighbours share the moment's load.
        paired = [times[k] / times[k - 1] if flags[k] else times[k - 1] / times[k]
                  for k in range(1, len(times)) if flags[k] != flags[k - 1]]
        return {"off": statistics.median(off), "on": statistics.median(on), "off_min": min(off),
                "on_min": min(on), "paired": paired, "events_per_step": events / max(1, (steps + warmup) // 2)}
    return {"median": statistics.median(times), "min": min(times), "events_per_step": events / (steps + warmup)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="mirrored,between_graph")
    parser.add_argument("--models", default="mlp,wide", help="small and medium models (stratagem.bench.models)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    configs = [(s, m) for s in args.strategies.split(",") for m in args.models.split(",")]
    jobs: dict[tuple, dict[bool, list]] = {c: {False: [], True: []} for c in configs}
    steps: dict[tuple, list] = {c: [] for c in configs}
    loads = [os.getloadavg()]
    started = time.time()
    for round_ in range(args.rounds):
        for number, config in enumerate(configs):
            order = (False, True) if (round_ + number) % 2 == 0 else (True, False)
            for timeline in order:
                figure = run_job(*config, args.steps, args.warmup, timeline, args.timeout)
                jobs[config][timeline].append(figure)
                log(f"round {round_ + 1}/{args.rounds} {config[0]}/{config[1]} timeline "
                    f"{'on' if timeline else 'off'}: median step {1000 * figure['median']:.2f} ms")
            figure = run_job(*config, 2 * args.steps, args.warmup, None, args.timeout)
            steps[config].append(figure)
            log(f"round {round_ + 1}/{args.rounds} {config[0]}/{config[1]} every other step: median "
                f"{1000 * figure['off']:.2f} ms off, {1000 * figure['on']:.2f} ms on")
        loads.append(os.getloadavg())
    print(f"\ntimeline overhead: {args.rounds} rounds, 2 workers (between_graph: + 1 ps task, sync); load average "
          f"{', '.join(f'{l[0]:.2f}' for l in loads)} (1 min: at the start, after each round); "
          f"{time.time() - started:.0f} s")
    rows = []
    print(f"\nA. jobs with and without STRATAGEM_TIMELINE ({args.steps} steps after {args.warmup}; pairs in alternating "
          f"order):\n")
    print(f"{'strategy/model':<24} {'off median':>11} {'on median':>11} {'overhead':>9} {'pooled':>8} {'min':>8} "
          f"{'events/step':>12}")
    for config in configs:
        off, on = jobs[config][False], jobs[config][True]
        ratios = [b["median"] / a["median"] - 1 for a, b in zip(off, on)]
        row = {"strategy": config[0], "model": config[1], "kind": "jobs",
               "off_ms": 1000 * statistics.median(r["median"] for r in off),
               "on_ms": 1000 * statistics.median(r["median"] for r in on),
               "overhead": statistics.median(ratios), "overhead_rounds": ratios,
               "pooled": statistics.median(r["median"] for r in on) / statistics.median(r["median"] for r in off) - 1,
               "min": min(r["min"] for r in on) / min(r["min"] for r in off) - 1,
               "events_per_step": statistics.median(r["events_per_step"] for r in on)}
        rows.append(row)
        print(_line(row))
    print(f"\nB. every other step recorded, in one job ({2 * args.steps} steps after {args.warmup}; the replicas' "
          f"recorder only, not the ps task's):\n")
    print(f"{'strategy/model':<24} {'off median':>11} {'on median':>11} {'overhead':>9} {'pooled':>8} {'min':>8} "
          f"{'events/step':>12} {'paired':>8}")
    for config in configs:
        figures = steps[config]
        ratios = [f["on"] / f["off"] - 1 for f in figures]
        row = {"strategy": config[0], "model": config[1], "kind": "steps",
               "off_ms": 1000 * statistics.median(f["off"] for f in figures),
               "on_ms": 1000 * statistics.median(f["on"] for f in figures),
               "overhead": statistics.median(ratios), "overhead_rounds": ratios,
               "pooled": statistics.median(f["on"] for f in figures) / statistics.median(f["off"] for f in figures) - 1,
               "min": min(f["on_min"] for f in figures) / min(f["off_min"] for f in figures) - 1,
               "events_per_step": statistics.median(f["events_per_step"] for f in figures),
               "paired": statistics.median(r for f in figures for r in f["paired"]) - 1}
        rows.append(row)
        print(_line(row) + f" {100 * row['paired']:>7.1f}%")
    costs = recorder_costs()
    print(f"\nC. the recorder alone (in this process, {costs['n']} events): one event with its two clock reads "
          f"and an args dict {costs['event_ns']:.0f} ns, a wait {costs['wait_ns']:.0f} ns; with the timeline off, "
          f"a hook (now() and record() on timeline.OFF) costs {costs['off_ns']:.1f} ns. Estimated overhead, events/step x the cost of a wait "
          f"over the step time without a timeline (table A):\n")
    for row in rows:
        if row["kind"] == "jobs":
            estimate = row["events_per_step"] * costs["wait_ns"] / (row["off_ms"] * 1e6)
            row["estimate"] = estimate
            print(f"{row['strategy'] + '/' + row['model']:<24} {100 * estimate:.3f}%")
    worst = {kind: max(r["overhead"] for r in rows if r["kind"] == kind) for kind in ("jobs", "steps")}
    paired = max(r["paired"] for r in rows if r["kind"] == "steps")
    print(f"\ntarget: overhead < {100 * TARGET:.0f}% of the step time: A {'[MET]' if worst['jobs'] < TARGET else '[MISSED]'} "
          f"(worst median {100 * worst['jobs']:.1f}%), B {'[MET]' if worst['steps'] < TARGET else '[MISSED]'} "
          f"(worst median {100 * worst['steps']:.1f}%), B paired {'[MET]' if paired < TARGET else '[MISSED]'} "
          f"(worst {100 * paired:.1f}%)")
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"rows": rows, "loadavg": loads, "args": vars(args)}, stream, indent=2)
    return 0


def recorder_costs(n: int = 200_000) -> dict:
    """Nanoseconds per recorded event, per wait, and per event with the timeline off (``timeline.OFF``:
    the hot path's ``now()`` and ``record()`` calls, less an empty loop's; best of 5 runs each)."""
    from stratagem.core import timeline

    def best(body) -> float:
        times = []
        for _ in range(5):
            rec = timeline.Recorder(os.devnull, max_events=n + 1)
            start = time.perf_counter_ns()
            body(rec)
            times.append((time.perf_counter_ns() - start) / n)
        return min(times)

    def events(rec):
        now = rec.now
        for _ in range(n):
            start = now()
            rec.add("collective", "allreduce", start, now(), {"bytes": 4096})

    def waits(rec):
        now = rec.now
        for _ in range(n):
            start = now()
            rec.wait("/job:worker/task:1", "coll/world", start, now())

    def off(rec):
        rec = timeline.OFF
        describe = dict
        for _ in range(n):
            start = rec.now()
            rec.record("collective", "allreduce", start, describe, (("bytes", 4096),))

    def empty(rec):
        for _ in range(n):
            pass

    return {"n": n, "event_ns": best(events), "wait_ns": best(waits), "off_ns": max(0.0, best(off) - best(empty))}


def _line(row: dict) -> str:
    return (f"{row['strategy'] + '/' + row['model']:<24} {row['off_ms']:>9.2f}ms {row['on_ms']:>9.2f}ms "
            f"{100 * row['overhead']:>8.1f}% {100 * row['pooled']:>7.1f}% {100 * row['min']:>7.1f}% "
            f"{row['events_per_step']:>12.1f}")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
