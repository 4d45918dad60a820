#!/usr/bin/env python3
"""Check ``stratagem advise``'s predictions against ``stratagem bench`` measurements, every size this
machine can run: 1-4 workers, 1-2 ps, every default bench strategy over every usable transport.

    python benchmarks/advise_validation.py                         # 3 rounds: about 30 minutes on 2 cores
    python benchmarks/advise_validation.py --rounds 1 --workers 2 --transports zmq,shm    # a few minutes
    python benchmarks/advise_validation.py --json advise-validation.json
    python benchmarks/advise_validation.py --from advise-validation.json   # the table again, from a saved run
    python benchmarks/advise_validation.py --hosts 2 --link 100mbit,1gbit --model wide --workers 2 \
        --strategies mirrored,between_graph:sync,parameter_server:sync --transports zmq    # emulated hosts (root)

**On emulated hosts** (``--hosts N|workers --link RATES``): every cell runs on N emulated hosts (or one
per worker), once per link rate, as ``stratagem bench --hosts N --link RATE`` runs it, and is predicted
as ``stratagem advise --hosts N --link RATE`` predicts it (:mod:`stratagem.advise.hosts`: the costs of
the round's probe, the links modelled by placement). The table then says, per model and worker count,
which of parameter servers and all-reduce wins at each rate, measured and predicted.

**Interleaved.** A round is: the full advise probe (the machine and every transport's links), then
every cell (strategy x transport x workers x ps) run once by the bench's own runner
(:func:`stratagem.bench.runner.run_combination`, the code behind ``stratagem bench``), in a shuffled
order. Around every cell, this process times the model's ``loss_and_grads`` on one task for
``--sense`` seconds before and after the run, wall and CPU time: how much of a core one task gets
(the figure advise's machine probe fits the background load to), measured again at the cell's time. The machine is shared with other work whose load changes
from one second to the next, by a factor of several on this 2-core machine, so each cell gets two
predictions:

- **advise**: the round's probe alone: what ``stratagem advise`` would have said before the round;
- **model**: the same model and figures, with the background load measured around the cell.

The second is the test of the cost model; the first shows what a changing load does to any
prediction made in advance. Over the rounds, each cell's entry is the median of its measured
samples/s and the median of each prediction; the error is the median over the rounds of
predicted / measured - 1 (each round's prediction is for that round's load). The load average is
printed per round; ``--from FILE --round 3`` evaluates one round.

No constant is fitted per cell: every cell is predicted by :func:`stratagem.advise.costmodel.predict`
from the measured figures alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# one math thread, as every task of the bench and of advise's probes (the load sensor runs here)
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from stratagem.advise import costmodel as cm  # noqa: E402
from stratagem.advise import probe  # noqa: E402
from stratagem.advise import hosts as hosts_model  # noqa: E402

DEFAULT_STRATEGIES = "mirrored,in_graph,between_graph:sync,between_graph:async,parameter_server:async"


def cells(workers: list[int], ps_counts: list[int], strategies: list[str], transports: list[str],
          links: list | None = None) -> list[dict]:
    out = []
    for link in (links or [None]):
        out += _cells(workers, ps_counts, strategies, transports, link)
    return out


def _cells(workers, ps_counts, strategies, transports, link) -> list[dict]:
    out = []
    for n in workers:
        for choice in strategies:
            name, _, mode = choice.partition(":")
            for transport in transports:
                for ps in (ps_counts if name in cm.PS_STRATEGIES else [0]):
                    out.append({"strategy": name, "mode": mode or None, "transport": transport, "workers": n, "ps": ps,
                                "link": link})
    return out


def key(cell: dict) -> tuple:
    return (cell.get("link") or "", cell["strategy"], cell["mode"] or "", cell["transport"], cell["workers"], cell["ps"])


def hosts_of(cell: dict, hosts: str | None):
    """The emulated hosts a cell runs on (``--hosts N``, or ``workers``: one per worker), or None."""
    if not hosts:
        return None
    from stratagem.launch.hosts import HostsSpec

    return HostsSpec.parse(cell["workers"] if hosts == "workers" else int(hosts), link=cell.get("link"))


def run_cell(cell: dict, steps: int, warmup: int, model: str, timeout: float, hosts: str | None = None) -> dict:
    """One bench run of ``cell``, through the bench's planner and runner."""
    from stratagem.bench.plan import StrategyChoice, plan
    from stratagem.bench.models import build_model
    from stratagem.bench.runner import RunSettings, run_combination
    from stratagem.plugins.manager import plugin_manager

    built = build_model(model)
    choice = StrategyChoice(cell["strategy"], cell["mode"])
    [combination] = plan([choice], [cell["transport"]], workers=cell["workers"], ps=max(1, cell["ps"]),
                         manager=plugin_manager(), hosts=hosts_of(cell, hosts))
    param_bytes = int(sum(v.nbytes for v in built.init_params(0).values()))
    settings = RunSettings(model=model, steps=steps, warmup=warmup, seed=0, timeout=timeout,
                           target_loss=None, batch_size=built.batch_size, param_bytes=param_bytes,
                           hosts=hosts_of(cell, hosts))
    outcome = run_combination(combination, settings)
    figures = {k: v for k, v in outcome.figures.items() if k != "loss_curve"}
    return {"status": outcome.status, "reason": outcome.reason, "figures": figures,
            "loadavg": list(os.getloadavg()), "time": time.time()}


class Sensor:
    """The model's ``loss_and_grads`` on one task (this process), timed for a while: the median wall
    and CPU seconds per call (their ratio is how much of a core a task gets now)."""

    def __init__(self, model: str):
        from stratagem.bench.models import build_model

        self.model = build_model(model)
        self.params = self.model.init_params(0)
        self.batch = self.model.batch(0, 0, 0, self.model.batch_size)
        self.model.loss_and_grads(self.params, self.batch)

    def __call__(self, seconds: float) -> list[float]:
        times, cpu, end = [], [], time.perf_counter() + seconds
        while True:
            start, used = time.perf_counter(), time.thread_time()
            self.model.loss_and_grads(self.params, self.batch)
            cpu.append(time.thread_time() - used)
            times.append(time.perf_counter() - start)
            if time.perf_counter() >= end and len(times) >= 3:
                return [statistics.median(times), statistics.median(cpu)]


def collect(args) -> dict:
    from stratagem.bench.availability import check_transport

    transports = [t for t in args.transports.split(",") if check_transport(t).skip is None]
    grid = cells(args.workers, args.ps, args.strategies.split(","), transports,
                 args.link.split(",") if args.link else None)
    max_tasks = max(c["workers"] + c["ps"] + (c["strategy"] == "parameter_server") for c in grid)
    settings = probe.ProbeSettings(model=args.model, transports=tuple(transports), machine_tasks=max_tasks)
    doc = {"args": vars(args), "transports": transports, "rounds": [], "started": time.time()}
    rng = random.Random(args.seed)
    sense = Sensor(args.model)
    for r in range(args.rounds):
        log = lambda text: print(f"  [{r + 1}/{args.rounds}] {text}", file=sys.stderr, flush=True)  # noqa: E731
        print(f"round {r + 1}: full probe (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        full = probe.measure(settings, on_progress=log)
        round_doc = {"probe": full.as_dict(), "cells": []}
        order = grid[:]
        rng.shuffle(order)
        for i, cell in enumerate(order):
            before = sense(args.sense)
            result = run_cell(cell, steps_for(args.steps, cell), args.warmup, args.model, args.timeout, args.hosts)
            result.update(cell=cell, sensor_s=[before, sense(args.sense)], steps=steps_for(args.steps, cell))
            round_doc["cells"].append(result)
            f = result["figures"]
            log(f"{i + 1}/{len(order)} {cell['strategy']}{':' + cell['mode'] if cell['mode'] else ''} x "
                f"{cell['transport']} w{cell['workers']} ps{cell['ps']}"
                + (f" at {cell['link']}" if cell.get("link") else "") + ": "
                + (f"{f['samples_per_s']:,.0f} samples/s" if result["status"] == "ok" else result["status"])
                + f" (one task gets {_share(result['sensor_s'][0]):.0%}/{_share(result['sensor_s'][1]):.0%} of a core, "
                  f"load {result['loadavg'][0]:.1f})")
        doc["rounds"].append(round_doc)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(doc, fh, indent=1)
    doc["finished"] = time.time()
    return doc


def parse_steps(text: str) -> dict:
    """``--steps``: ``30`` (every cell), or ``30,1gbit=120`` (120 at the 1gbit link): ``{None: 30,
    "1gbit": 120}``.

    >>> parse_steps("30,1gbit=120")
    {None: 30, '1gbit': 120}
    """
    out: dict = {}
    for item in text.split(","):
        link, _, count = item.rpartition("=")
        try:
            out[link or None] = int(count)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--steps takes N or N,RATE=N (e.g. 30,1gbit=120), not {text!r}")
    if None not in out:
        raise argparse.ArgumentTypeError(f"--steps needs a count for every link first (e.g. 30,1gbit=120), not {text!r}")
    return out


def steps_for(steps: dict, cell: dict) -> int:
    """The steps a cell runs: its link's count, else the default."""
    return steps.get(cell.get("link"), steps[None])


def _share(sensed) -> float:
    """The share of a core one task got: CPU over wall time of the sensor's calls."""
    return sensed[1] / sensed[0] if isinstance(sensed, list) else float("nan")


def figures(probe_doc: dict, sensor_s: list | None = None) -> tuple:
    """The round's figures; with ``sensor_s``, the host's background refitted to the one-task compute
    measured around the cell: its wall time against its CPU time."""
    measured = probe.fit(probe_doc["raw"])      # refitted from the raw figures: the current fits
    host, work = measured.host, measured.work
    if sensor_s:
        if isinstance(sensor_s[0], list):
            wall = [w for w, _ in sensor_s]
            idle = statistics.median(c for _, c in sensor_s)
        else:   # (a run of an earlier version: wall times only)
            wall, idle = sensor_s, work.compute_s
        fitted, _ = cm.fit_host(host.cores, [(1, t) for t in wall], idle_s=idle)
        host = cm.Host(host.cores, fitted.background, host.stragglers)
    return host, work, measured.transports


def evaluate(doc: dict, rounds: list[int] | None = None) -> list[dict]:
    """Per cell: the median measured samples/s over the rounds, the median of each prediction, their
    errors, and the drift (the cell's compute time over the advise prediction's)."""
    by_cell: dict[tuple, dict] = {}
    for number, round_doc in enumerate(doc["rounds"], start=1):
        if rounds and number not in rounds:
            continue
        for result in round_doc["cells"]:
            cell = result["cell"]
            entry = by_cell.setdefault(key(cell), {"cell": cell, "measured": [], "advise": [], "model": [],
                                                   "drift": [], "failed": []})
            if result["status"] != "ok":
                entry["failed"].append(result["reason"])
                continue
            setup = cm.Setup(cell["strategy"], cell["mode"], cell["transport"], cell["workers"], cell["ps"])
            spec = hosts_of(cell, doc["args"].get("hosts"))

            def links(t):   # on emulated hosts: the links as stratagem advise --hosts models them
                return t if spec is None else hosts_model.shaped(t, setup, spec)
            host, work, transports = figures(round_doc["probe"])
            entry["advise"].append(cm.predict(setup, work, links(transports[cell["transport"]]), host).samples_per_s)
            host_now, work, transports = figures(round_doc["probe"], result["sensor_s"])
            entry["model"].append(cm.predict(setup, work, links(transports[cell["transport"]]), host_now).samples_per_s)
            entry["measured"].append(result["figures"]["samples_per_s"])
            entry["drift"].append(result["figures"]["compute_ms"] / 1e3
                                  / (work.compute_s * host.slowdown(cell["workers"], transports[cell["transport"]].one_group)))
    rows = []
    for entry in by_cell.values():
        row = {**entry["cell"], "runs": len(entry["measured"]), "failed": entry["failed"]}
        if entry["measured"]:
            measured = statistics.median(entry["measured"])
            row.update(measured=measured, spread=(min(entry["measured"]), max(entry["measured"])),
                       advise=statistics.median(entry["advise"]), model=statistics.median(entry["model"]),
                       drift=statistics.median(entry["drift"]))
            # each round's prediction is for that round's load: the error is the median of the rounds'
            # ratios, not a ratio of medians taken over different loads
            row["advise_error"] = statistics.median(a / m for a, m in zip(entry["advise"], entry["measured"])) - 1
            row["runs_error"] = [p / m - 1 for p, m in zip(entry["model"], entry["measured"])]
            row["runs_error_advise"] = [p / m - 1 for p, m in zip(entry["advise"], entry["measured"])]
            row["runs_measured"] = list(entry["measured"])
            row["error"] = statistics.median(row["runs_error"])
        rows.append(row)
    order = {"mirrored": 0, "in_graph": 1, "between_graph": 2, "parameter_server": 3}
    rows.sort(key=lambda r: (r.get("link") or "", order.get(r["strategy"], 9), r["mode"] or "", r["transport"],
                             r["workers"], r["ps"]))
    return rows


def print_table(rows: list[dict], doc: dict, out=sys.stdout) -> None:
    print("| strategy | transport | workers | ps | measured samples/s, each round | model's error, each round | "
          "model (median) | advise (median) |", file=out)
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", file=out)
    for r in rows:
        label = r["strategy"] + (f":{r['mode']}" if r["mode"] else "") + (f" @ {r['link']}" if r.get("link") else "")
        if "measured" not in r:
            print(f"| {label} | {r['transport']} | {r['workers']} | {r['ps'] or '-'} | failed: "
                  f"{(r['failed'] or ['?'])[0][:50]} | | | |", file=out)
            continue
        miss = "" if abs(r["error"]) <= 0.15 else " **"
        runs = " / ".join(f"{m:,.0f}" for m in r["runs_measured"])
        errors = " / ".join(f"{e * 100:+.0f}%" for e in r["runs_error"])
        print(f"| {label} | {r['transport']} | {r['workers']} | {r['ps'] or '-'} | {runs} | {errors} | "
              f"{r['error'] * 100:+.0f}%{miss} | {r['advise_error'] * 100:+.0f}% |", file=out)
    done = [r for r in rows if "measured" in r]
    if done:
        for name, column in (("model (load measured around each cell)", "error"), ("advise (the probe alone)", "advise_error")):
            errors = sorted(abs(r[column]) for r in done)
            within = sum(e <= 0.15 for e in errors)
            print(f"\n{name}: {within} of {len(done)} cells within +-15%, median |error| "
                  f"{statistics.median(errors) * 100:.0f}%, worst {errors[-1] * 100:.0f}%", file=out, end="")
        print(file=out)
    if done:
        print("\nbias by strategy and transport (median of predicted / measured over the cells; 1.00: unbiased):",
              file=out)
        groups: dict[str, list] = {}
        for r in done:
            label = r["strategy"] + (f":{r['mode']}" if r["mode"] else "")
            groups.setdefault(label, {}).setdefault(r["transport"], []).append(r["error"] + 1)
        transports = sorted({t for g in groups.values() for t in g})
        print("| strategy | " + " | ".join(transports) + " | all |", file=out)
        print("| --- |" + " ---: |" * (len(transports) + 1), file=out)
        for label, by in groups.items():
            every = [x for xs in by.values() for x in xs]
            print(f"| {label} | " + " | ".join(f"{statistics.median(by[t]):.2f}" if t in by else "-" for t in transports)
                  + f" | {statistics.median(every):.2f} |", file=out)
        inside = sum(r["spread"][0] <= r["model"] <= r["spread"][1] for r in done if r["runs"] > 1)
        multi = sum(r["runs"] > 1 for r in done)
        if multi:
            spreads = sorted(r["spread"][1] / r["spread"][0] for r in done if r["runs"] > 1)
            print(f"\nthe bench against itself: a cell's fastest run over its slowest, median {statistics.median(spreads):.2f}, "
                  f"worst {spreads[-1]:.2f}; the model falls within the measured range in {inside} of {multi} cells",
                  file=out)
        print("\nthe choice (per worker count: what advise's probe alone recommends, and how it did in the bench):",
              file=out)
        for n, link in sorted({(r["workers"], r.get("link") or "") for r in done}):
            cells_n = [r for r in done if r["workers"] == n and (r.get("link") or "") == link]
            pick = max(cells_n, key=lambda r: r["advise"])
            best = max(cells_n, key=lambda r: r["measured"])
            rank = sorted(cells_n, key=lambda r: -r["measured"]).index(pick) + 1
            print(f"- {n} worker{'s' * (n != 1)}" + (f" at {link}" if link else "")
                  + f": advise picks {_name(pick)}, measured {pick['measured']:,.0f} samples/s, "
                  f"{rank} of {len(cells_n)}; the bench's best {_name(best)} {best['measured']:,.0f} "
                  f"({pick['measured'] / best['measured']:.0%} of it)", file=out)
        ps_vs_allreduce(done, out)
    for i, round_doc in enumerate(doc["rounds"], start=1):
        loads = [c["loadavg"][0] for c in round_doc["cells"]] or [0.0]
        host = round_doc["probe"]["host"]
        print(f"round {i}: load average {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f}) "
              f"on {host['cores']} cores; the probe's background fit {host['background']:.1f} busy processes",
              file=out)


def ps_vs_allreduce(done: list[dict], out) -> None:
    """Per link and worker count: the faster of all-reduce (mirrored) and parameter servers (the best
    ps cell), measured and as advise predicts it."""
    groups: dict[tuple, dict] = {}
    for r in done:
        kind = "all-reduce" if r["strategy"] == "mirrored" else "ps" if r["strategy"] in cm.PS_STRATEGIES else None
        if kind:
            g = groups.setdefault((r.get("link") or "local", r["workers"]), {})
            if kind not in g or r["measured"] > g[kind]["measured"]:
                g[kind] = r
            g.setdefault(kind + " predicted", 0.0)
            g[kind + " predicted"] = max(g[kind + " predicted"], r["advise"])
    rows = [(k, g) for k, g in sorted(groups.items()) if "ps" in g and "all-reduce" in g]
    if not rows:
        return
    print("\nparameter servers against all-reduce (samples/s: the best ps cell, mirrored; measured | advise):", file=out)
    print("| link | workers | all-reduce measured | ps measured | wins, measured | all-reduce advise | ps advise | "
          "wins, advise |", file=out)
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |", file=out)
    for (link, n), g in rows:
        ar, ps, par, pps = g["all-reduce"]["measured"], g["ps"]["measured"], g["all-reduce predicted"], g["ps predicted"]
        won, said = ("all-reduce" if ar >= ps else "ps"), ("all-reduce" if par >= pps else "ps")
        print(f"| {link} | {n} | {ar:,.1f} | {ps:,.1f} ({_name(g['ps'])}) | {won} | {par:,.1f} | {pps:,.1f} | {said}"
              + ("" if won == said else " (disagrees)") + " |", file=out)


def _name(row: dict) -> str:
    label = row["strategy"] + (f":{row['mode']}" if row["mode"] else "")
    return f"{label} over {row['transport']}" + (f" with {row['ps']} ps" if row["ps"] else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", metavar="N|workers",
                        help="run every cell on N emulated hosts (workers: one per worker), needs root; "
                             "predicted as stratagem advise --hosts does")
    parser.add_argument("--link", metavar="RATES",
                        help="with --hosts: comma-separated link rates, each cell once per rate (100mbit,1gbit)")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--ps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    parser.add_argument("--transports", default="zmq,grpc,shm,mpi")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=parse_steps, default=parse_steps("60"), metavar="N[,RATE=N]",
                        help="steps per bench run (default 60); RATE=N: N at that link (a fast link's cell "
                             "is short: 30,1gbit=120 times it for as long as the 100mbit one)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sense", type=float, default=0.4, metavar="SECONDS",
                        help="the one-task compute timed before and after each cell (default 0.4 s)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0, help="the cells' shuffled order")
    parser.add_argument("--json", help="write every measurement here (after every round)")
    parser.add_argument("--from", dest="source", help="print the table of a saved run instead of running")
    parser.add_argument("--round", dest="only", type=lambda s: [int(x) for x in s.split(",")],
                        help="with --from: only these rounds (e.g. 3, or 1,2)")
    args = parser.parse_args(argv)
    if args.source:
        with open(args.source) as fh:
            doc = json.load(fh)
    else:
        doc = collect(args)
    print_table(evaluate(doc, args.only), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
