"""``stratagem advise``: which strategy, transport and ps count to use here, measured and predicted.

::

    stratagem advise                                  # measure (under a minute), predict 2 workers, recommend
    stratagem advise --worker 4 --ps 1,2 --transports zmq,shm
    stratagem advise --predict-workers 64,256,1024    # the same model, extrapolated: one task per host
    stratagem advise --predict-workers 256 --bandwidth 25Gbit --latency 20us   # on a network you describe
    stratagem advise --model mypkg.models:build       # your model (the interface of stratagem bench's)
    stratagem advise --quick --json > advice.json     # machine-readable; --measured advice.json reuses it
    stratagem advise --hosts 2 --link 100mbit --transports zmq --model wide   # as stratagem bench --hosts runs
    stratagem advise --hosts 8 --link 1gbit --cores-per-host 16 --worker 8    # 8 real hosts you describe

It measures this machine (:mod:`stratagem.advise.probe`): the model's compute for one step, a ps's
update of its parameters, how tasks share the cores, and per transport the latency and bandwidth of
an all-reduce and of a parameter server's push-and-pull at a few message sizes. The cost model
(:mod:`stratagem.advise.costmodel`) then predicts the step time and samples/s of every strategy x
transport x ps count for ``--worker`` workers on this machine, and recommends the fastest, with the
reason in a sentence.

``--predict-workers`` extrapolates with the same model, under stated assumptions: one task per host
(no core sharing, no straggler measured across hosts), the links as measured here between two
tasks, unloaded (or as ``--bandwidth``/``--latency`` describe them), every ps on its own link, the
variables placed as the strategies place them.

**Hosts you describe** (``--hosts N --link RATE``, :mod:`stratagem.advise.hosts`): the costs measured
here (per call and per byte, the compute) with the links modelled: the tasks placed on the hosts as
``stratagem launch --hosts`` places them, each host's link ``RATE`` each way, two tasks on one host
talking over its loopback. Without ``--cores-per-host`` the hosts are emulated on this machine (what
``stratagem bench --hosts N --link RATE`` runs: every task shares its cores); with ``--cores-per-host
C`` each host has C cores of its own.

**A cluster that spans hosts.** The links are measured between local tasks unless you measure them
on your cluster: run ``stratagem advise --probe-links links.json --transports zmq`` as every task of
a job on it (any launcher stratagem reads: ``mpiexec``, ``srun``, ``TF_CONFIG``, ``stratagem launch``;
give the job one ``ps`` task to measure a parameter server's exchange too). Each pair of tasks is
timed (every pair up to 8 tasks, else the first task with each other), and an all-reduce over all of
them; the first task writes the file. ``stratagem advise --links links.json`` then uses those links:
the slowest pair for point to point, the whole job's all-reduce for the ring::

    mpiexec -n 4 -x STRATAGEM_NUM_PS=1 stratagem advise --probe-links links-mpi.json --transports mpi
    stratagem advise --links links-mpi.json --predict-workers 64,256

Exit status: 0, 1 when a measurement failed, 2 for bad options (a message says which and why).

From Python::

    from stratagem.advise.cli import main
    main(["--quick", "--transports", "zmq", "--json"])
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Sequence

from stratagem.advise import costmodel as cm
from stratagem.core.errors import ConfigurationError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_STRATEGIES = ("mirrored,in_graph,between_graph:sync,between_graph:async,"
                      "parameter_server:sync,parameter_server:async")
#: The most tasks the machine probe starts (it needs as many as the largest setup predicted here).
MAX_PROBE_TASKS = 16

ASSUMPTIONS = (
    "one task per host: no core sharing and no straggler wait (measured only on this host)",
    "links as measured here between two tasks, at idle-core speed, unless --bandwidth/--latency say otherwise; "
    "every task has its own link, each ps's link is shared by all the workers it serves",
    "the model's compute and the ps's update as measured here, on an idle core",
    "ring all-reduce (2(n-1) latencies: no tree or hierarchical algorithm at large n)",
    "variables placed as the strategies place them (round-robin; those over 1 MiB split, one slice per ps task)",
)


def _int_list(option: str, text: str, low: int = 1) -> list[int]:
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigurationError(f"{option}: expected a comma-separated list of numbers, got {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ConfigurationError(f"{option}: {item!r} is not a whole number (e.g. {option} 64,256)") from None
        if value < low:
            raise ConfigurationError(f"{option}: every value must be at least {low}, got {value}")
        values.append(value)
    return sorted(set(values))


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit|b|gbps)?(?:/s|ps)?\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(s|ms|us|ns)?\s*$", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``25Gbit``, ``10gbit/s``, ``1.25GB/s``, ``3e9`` (bytes/s); decimal units.

    >>> parse_bandwidth("10Gbit"), parse_bandwidth("1.25GB/s"), parse_bandwidth("3e9")
    (1250000000.0, 1250000000.0, 3000000000.0)
    """
    match = _RATE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigurationError(f"--bandwidth: cannot read {text!r}: write e.g. 25Gbit, 10gbit/s or 1.25GB/s")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
    unit = (match.group(3) or "").lower()
    bits = unit == "bit"
    return float(match.group(1)) * scale / (8 if bits else 1)


def parse_latency(text: str) -> float:
    """Seconds from ``20us``, ``0.5ms``, ``1e-5`` (seconds).

    >>> parse_latency("20us"), parse_latency("0.5ms"), parse_latency("1e-5")
    (2e-05, 0.0005, 1e-05)
    """
    match = _TIME.match(str(text))
    if not match:
        raise ConfigurationError(f"--latency: cannot read {text!r}: write e.g. 20us, 0.5ms or 1e-5 (seconds)")
    divisor = {"s": 1, "": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}[(match.group(2) or "").lower()]
    return float(match.group(1)) / divisor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``stratagem advise``'s options."""
    from stratagem.bench.models import BUILTIN

    parser.description = __doc__.splitlines()[0].replace("``", "")
    parser.epilog = ("The model: the one stratagem bench trains (mlp), or yours as package.module:build, a "
                     "function with no arguments returning an object with name, batch_size, learning_rate, "
                     "init_params(seed), batch(seed, replica, step, rows) and loss_and_grads(params, batch) "
                     "(see stratagem.bench.models).")
    parser.add_argument("--model", default="mlp", metavar="NAME",
                        help=f"{', '.join(BUILTIN)}, or package.module:build returning a model with the bench's "
                             f"interface (see stratagem.bench.models; default mlp)")
    parser.add_argument("--worker", type=int, default=2, metavar="N",
                        help="workers to predict on this machine (default 2)")
    parser.add_argument("--ps", default="1,2", metavar="LIST",
                        help="ps counts for the parameter-server strategies (default 1,2)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, metavar="LIST",
                        help=f"strategies to predict, with the mode after a colon (default {DEFAULT_STRATEGIES})")
    parser.add_argument("--transports", metavar="LIST",
                        help="transports to measure (default: every registered one; those not usable here are "
                             "listed)")
    parser.add_argument("--predict-workers", metavar="LIST",
                        help="also extrapolate to these worker counts, one task per host (e.g. 64,256,1024)")
    parser.add_argument("--bandwidth", metavar="RATE",
                        help="for --predict-workers: the network's bandwidth per link (e.g. 25Gbit) instead of "
                             "the measured one")
    parser.add_argument("--latency", metavar="TIME",
                        help="for --predict-workers: the network's one-way latency (e.g. 20us) instead of the "
                             "measured one; with --hosts: the links' one-way delay, added to each call")
    parser.add_argument("--hosts", type=int, metavar="N",
                        help="predict for N hosts (the tasks placed on them as stratagem launch --hosts does) "
                             "instead of this machine; the links modelled, the costs measured here")
    parser.add_argument("--link", metavar="RATE",
                        help="with --hosts: each host's link rate each way (100mbit, 1gbit, 10gbit; default: "
                             "unshaped); --latency gives its one-way delay")
    parser.add_argument("--link-of", action="append", default=[], metavar="HOST=RATE",
                        help="with --hosts: one host's link rate (host1=100mbit); repeatable")
    parser.add_argument("--tasks-per-host", type=int, metavar="K",
                        help="with --hosts: K tasks on each host in turn (default: round-robin)")
    parser.add_argument("--cores-per-host", type=float, metavar="C",
                        help="with --hosts: each host has C cores of its own (default: the hosts are emulated "
                             "on this machine, as stratagem bench --hosts runs them, and share its cores)")
    parser.add_argument("--probe-links", metavar="PATH",
                        help="run as every task of a job on your cluster: time its links (every pair, an "
                             "all-reduce, a ps exchange) over the one transport of --transports; the first task "
                             "writes PATH")
    parser.add_argument("--links", metavar="PATHS",
                        help="comma-separated files of --probe-links: use those links instead of local ones")
    parser.add_argument("--quick", action="store_true",
                        help="measure less (fewer sizes and rounds): faster, noisier")
    parser.add_argument("--measured", metavar="PATH",
                        help="reuse the measurements of an earlier --json output instead of measuring")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (measurements, predictions, advice) instead of tables")
    parser.add_argument("--seed", type=int, default=0, help="the model's initial values and data (default 0)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="stop a measurement job after this long (default 120)")


def _strategies(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigurationError(f"--strategies: expected a comma-separated list, got {text!r}")
    for item in items:
        name, _, mode = item.partition(":")
        if name not in cm.STRATEGIES:
            raise ConfigurationError(f"--strategies: the cost model knows {', '.join(cm.STRATEGIES)}, not {name!r}")
        if name in cm.PS_STRATEGIES and mode and mode not in cm.MODES:
            raise ConfigurationError(f"--strategies: {name} is predicted in mode sync or async, not {mode!r}")
        if name not in cm.PS_STRATEGIES and mode:
            raise ConfigurationError(f"--strategies: {name} takes no mode (got {item!r})")
    return items


def check(args: argparse.Namespace) -> dict:
    """The options, read and checked; raises ``ConfigurationError`` naming the bad one."""
    if args.worker < 1:
        raise ConfigurationError(f"--worker must be at least 1, got {args.worker}")
    if args.timeout <= 0:
        raise ConfigurationError(f"--timeout must be > 0 seconds, got {args.timeout}")
    checked = {"ps": _int_list("--ps", args.ps), "strategies": _strategies(args.strategies),
               "predict": _int_list("--predict-workers", args.predict_workers) if args.predict_workers else [],
               "bandwidth": parse_bandwidth(args.bandwidth) if args.bandwidth else None,
               "latency": parse_latency(args.latency) if args.latency else None}
    checked["hosts"] = _described_cluster(args)
    if checked["hosts"] is not None and checked["predict"]:
        raise ConfigurationError("--hosts describes the cluster to predict for; --predict-workers extrapolates "
                                 "one task per host: give one of them")
    if checked["hosts"] is not None and checked["bandwidth"]:
        raise ConfigurationError("with --hosts, give the link rate as --link RATE (e.g. --link 1gbit), not "
                                 "--bandwidth")
    if (checked["bandwidth"] or checked["latency"] is not None) and not (checked["predict"] or checked["hosts"]):
        raise ConfigurationError("--bandwidth and --latency describe the network of --predict-workers: "
                                 "give --predict-workers too (this machine's links are measured), or --latency "
                                 "with --hosts N")
    if args.measured and not os.path.isfile(args.measured):
        raise ConfigurationError(f"--measured: no such file {args.measured!r} (write one with --json > FILE)")
    checked["links"] = [p.strip() for p in args.links.split(",") if p.strip()] if args.links else []
    for path in checked["links"]:
        if not os.path.isfile(path):
            raise ConfigurationError(f"--links: no such file {path!r} (write one with --probe-links)")
    if args.probe_links:
        names = [t.strip() for t in (args.transports or "zmq").split(",") if t.strip()]
        if len(names) != 1:
            raise ConfigurationError(f"--probe-links measures one transport at a time: give --transports NAME "
                                     f"(got {args.transports!r})")
        checked["probe_transport"] = names[0]
    return checked


def _described_cluster(args: argparse.Namespace):
    """``--hosts`` and its options as a :class:`~stratagem.advise.hosts.DescribedCluster` (None without
    ``--hosts``)."""
    from stratagem.launch.hosts import HostsSpec

    given = [flag for flag, value in (("--link", args.link), ("--link-of", args.link_of or None),
                                      ("--tasks-per-host", args.tasks_per_host),
                                      ("--cores-per-host", args.cores_per_host)) if value is not None]
    if args.hosts is None:
        if given:
            raise ConfigurationError(f"{', '.join(given)}: only with --hosts N (the cluster to predict for)")
        return None
    if args.cores_per_host is not None and not args.cores_per_host > 0:
        raise ConfigurationError(f"--cores-per-host must be a number of cores > 0, got {args.cores_per_host:g}")
    from stratagem.advise.hosts import DescribedCluster

    latency = f"{parse_latency(args.latency) * 1e6:g}us" if args.latency and parse_latency(args.latency) > 0 else None
    spec = HostsSpec.parse(args.hosts, link=args.link, link_of=args.link_of, latency=latency,
                           tasks_per_host=args.tasks_per_host)
    return DescribedCluster(spec, args.cores_per_host)


def _transports(args: argparse.Namespace) -> tuple:
    from stratagem.plugins.manager import plugin_manager

    if args.transports:
        return tuple(dict.fromkeys(t.strip() for t in args.transports.split(",") if t.strip()))
    return tuple(plugin_manager().names("transport"))


def load_measured(path: str):
    """Measurements from an earlier ``--json`` document (or a bare measurements document)."""
    from stratagem.advise.probe import Measurements

    try:
        with open(path) as f:
            doc = json.load(f)
        return Measurements.from_dict(doc.get("measurements", doc))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"--measured {path}: not the JSON of `stratagem advise --json` ({exc})") from None


def probe_links(path: str, transport: str, model: str, seed: int, quick: bool, timeout: float) -> int:
    """``--probe-links``: this process is one task of the user's job; time the links with the others."""
    import contextlib
    import io
    import tempfile

    from stratagem.advise import probe, probe_task

    from stratagem.core.cluster import ClusterResolver

    cluster = ClusterResolver.from_env().cluster
    if len(cluster.replicas()) < 2:
        raise ConfigurationError("--probe-links runs as every task of a job of at least two worker tasks "
                                 "(mpiexec -n 3, srun, TF_CONFIG or stratagem launch --worker 2 ...); this process "
                                 "found no such job in its environment")
    described = probe.describe_model(model, seed)
    spec = {"mode": "link", "transport": transport, "timeout": timeout, "learning_rate": described["learning_rate"],
            "sizes": probe.schedule(probe.sizes_around(described["param_bytes"], quick), quick),
            "idle_probe": 0.15 if quick else 0.25}
    with tempfile.TemporaryDirectory(prefix="stratagem-advise-") as scratch, \
            contextlib.redirect_stdout(io.StringIO()):    # (the all-reduce loop's progress lines)
        result = probe_task.run_link(spec, scratch)
    if result is not None:     # the first task
        result["one_group"] = False
        with open(path, "w") as f:
            json.dump(result, f)
    return EXIT_OK


def use_links(measured, paths: Sequence[str]):
    """``measured`` with the links of ``--probe-links`` files in place of the local ones."""
    from stratagem.advise import probe

    for path in paths:
        try:
            with open(path) as f:
                raw = json.load(f)
            figures = probe.fit_transport(raw, one_group=raw.get("one_group", False))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(f"--links {path}: not a file of `stratagem advise --probe-links` ({exc})") from None
        local = measured.transports.get(figures.name)
        if local is not None:   # the strategies' own work per step, measured here, stays
            figures = dataclasses.replace(figures, steps=local.steps)
        measured.transports[figures.name] = figures
        measured.skipped.pop(figures.name, None)
        measured.raw.setdefault("links_from_files", {})[figures.name] = raw
    return measured


def advise(measured, workers: int, ps_counts: Sequence[int], strategies: Sequence[str]) -> tuple[list, tuple]:
    """Predictions for this machine, fastest first, and ``(best, reason)``."""
    setups = cm.setups_for(workers, list(measured.transports), ps_counts, strategies=strategies)
    predictions = cm.predict_all(setups, measured.work, measured.transports, measured.host)
    return predictions, cm.recommend(predictions, measured.work, measured.convergence)


def extrapolate(measured, counts: Sequence[int], ps_counts: Sequence[int], strategies: Sequence[str],
                bandwidth: float | None = None, latency: float | None = None) -> dict:
    """``{workers: (predictions, (best, reason))}`` with one task per host (see ``ASSUMPTIONS``)."""
    transports = {name: cm.with_link(t, latency, bandwidth) for name, t in measured.transports.items()}
    out = {}
    for n in counts:
        setups = cm.setups_for(n, list(transports), ps_counts, strategies=strategies, colocated=False)
        predictions = cm.predict_all(setups, measured.work, transports, measured.host)
        out[n] = (predictions, cm.recommend(predictions, measured.work, measured.convergence))
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _parts(p: cm.Prediction) -> str:
    return ", ".join(f"{k} {v * 1e3:.2g}" for k, v in sorted(p.parts.items(), key=lambda kv: -kv[1]))


def _own_work(steps: cm.StepCosts) -> str:
    """The steps probe's charges in a few words: ``async 1.6, sync round of 2 5.1, ...``."""
    words = []
    if steps.ps_async is not None:
        words.append(f"async {steps.ps_async.wall_s * 1e3:.2g}")
    if steps.ps_sync is not None:
        words.append(f"sync round of {steps.ps_sync.workers} {steps.ps_sync.wall_s * 1e3:.2g}")
    if steps.coordinator is not None:
        words.append(f"coordinated {steps.coordinator.wall_s * 1e3:.2g} + dispatch {steps.coordinator.dispatch_s * 1e3:.2g}")
    if steps.in_graph is not None:
        words.append(f"in_graph {steps.in_graph.wall_s * 1e3:.2g} per remote replica")
    return ", ".join(words) or "not measured"


def _rows(points) -> str:
    """``6,144 / 10,240 / not reached`` for measured (replicas, rows) points."""
    return " / ".join("not reached" if rows is None else f"{rows:,}" for _, rows in points) or "-"


def _to_target(p: cm.Prediction, convergence: cm.Convergence) -> str:
    seconds, guessed = cm.time_to_target_s(p, convergence)
    if seconds is None:
        return "not reached" if convergence.rows_for(p.setup)[0] is None else "-"
    return ("~" if guessed else "") + f"{seconds:.3g}"


def print_report(measured, predictions, best_reason, extrapolated: dict, settings: dict, console) -> None:
    from rich.table import Table

    from stratagem.bench.units import human_bytes, human_rate

    work, host = measured.work, measured.host
    console.print(f"stratagem advise: model {work.name} ({human_bytes(work.param_bytes)} of parameters, batch "
                  f"{work.batch_size} per replica), {settings['workers']} workers on this machine; measured in "
                  f"{measured.seconds:.0f} s", markup=False, highlight=False)
    console.print(f"host: {host.cores:g} cores, busy with about {host.background:.1f} processes of others; "
                  f"compute {work.compute_s * 1e3:.2f} ms a step on an idle core, data {work.data_s * 1e3:.2f} ms, "
                  f"ps update {work.update_s_per_byte * work.param_bytes * 1e3:.2f} ms"
                  + (f"; lockstep waits x{host.straggle(settings['workers']):.2f} for the slowest of "
                     f"{settings['workers']}" if host.stragglers else ""), markup=False, highlight=False)
    links = Table(box=None, pad_edge=False, title=None)
    for name, justify in (("transport", "left"), ("all-reduce latency", "right"), ("bandwidth", "right"),
                          ("ps exchange latency", "right"), ("bandwidth", "right"), ("a waiting task", "left")):
        links.add_column(name, justify=justify, no_wrap=True)
    for t in measured.transports.values():
        ps = t.exchange
        links.add_row(t.name, f"{t.allreduce.latency_s * 1e6:.0f} us", human_rate(t.allreduce.bandwidth_Bps),
                      f"{ps.latency_s * 1e6:.0f} us", human_rate(ps.bandwidth_Bps),
                      (f"spins ({t.idle_burn:.0%} of a core)" if t.idle_burn > 0.25 else "sleeps")
                      + ("; the job is one scheduling group" if t.one_group else ""))
    console.print("links (idle-core figures, fitted to the measurements):")
    console.print(links)
    console.print("a step's own work beyond the links (ms, measured through each strategy):")
    for t in measured.transports.values():
        console.print(f"  {t.name}: {_own_work(t.steps)}", markup=False, highlight=False, soft_wrap=True)
    conv = measured.convergence
    if conv is not None:
        console.print(f"convergence (this process, plain SGD at the model's learning rate): rows to loss "
                      f"{conv.target_loss:.3g} with 1, 2, 4... replicas: sync {_rows(conv.sync)}; async "
                      f"{_rows(conv.async_)}", markup=False, highlight=False, soft_wrap=True)
    table = Table(box=None, pad_edge=False)
    columns = [("strategy", "left"), ("transport", "left"), ("ps", "right"), ("tasks", "right"),
               ("samples/s", "right"), ("step ms", "right")]
    if conv is not None:
        columns.append((f"s to loss {conv.target_loss:.3g}", "right"))
    columns.append(("where the step goes (ms)", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "where the step goes (ms)")
    best, reason = best_reason
    for p in predictions:
        cells = [p.setup.label, p.setup.transport, str(p.setup.ps or "-"), str(p.setup.tasks),
                 f"{p.samples_per_s:,.0f}" + (" *" if p is best else "  "), _ms(p.step_s)]
        if conv is not None:
            cells.append(_to_target(p, conv))
        table.add_row(*cells, _parts(p))
    if settings.get("hosts") is not None:
        console.print(f"predicted for {settings['workers']} workers on {settings['hosts'].describe()} (the costs "
                      f"measured here, the links modelled: see stratagem.advise.hosts):", markup=False,
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"predicted for {settings['workers']} workers here (tasks share the {host.cores:g} cores):")
    console.print(table)
    console.print(f"recommended: {reason}", markup=False, highlight=False, soft_wrap=True)
    for name, why in measured.skipped.items():
        console.print(f"  not measured: {name}: {why}", markup=False, highlight=False, soft_wrap=True)
    for name, raw in measured.raw.get("links_from_files", {}).items():
        console.print(f"  {name}'s links from --links: {raw.get('np')} tasks, {len(raw.get('pairs', []))} pairs timed "
                      f"(the slowest pair's figures used)", markup=False, highlight=False, soft_wrap=True)
    if not extrapolated:
        return
    counts = sorted(extrapolated)
    console.print("")
    console.print(f"extrapolated to {', '.join(map(str, counts))} workers (samples/s; the best transport "
                  f"of each strategy and ps count)", markup=False, highlight=False)
    grid = Table(box=None, pad_edge=False)
    grid.add_column("strategy", no_wrap=True)
    grid.add_column("ps", justify="right")
    for n in counts:
        grid.add_column(f"{n} workers", justify="right", no_wrap=True)
    rows: dict[tuple, dict] = {}
    for n in counts:
        for p in extrapolated[n][0]:
            cell = rows.setdefault((p.setup.label, p.setup.ps), {})
            if n not in cell or p.samples_per_s > cell[n].samples_per_s:
                cell[n] = p
    for (label, ps), cell in rows.items():
        grid.add_row(label, str(ps or "-"), *[
            (f"{cell[n].samples_per_s:,.0f} {cell[n].setup.transport}" if n in cell else "-")
            + (" *" if n in cell and cell[n] is extrapolated[n][1][0] else "  ") for n in counts])
    console.print(grid)
    for n in counts:
        console.print(f"{n} workers: {extrapolated[n][1][1]}", markup=False, highlight=False, soft_wrap=True)
    net = []
    if settings.get("bandwidth"):
        net.append(f"bandwidth {human_rate(settings['bandwidth'])} per link")
    if settings.get("latency") is not None:
        net.append(f"latency {settings['latency'] * 1e6:g} us")
    console.print("assumptions: " + "; ".join(ASSUMPTIONS) + (f"; network: {', '.join(net)}" if net else ""),
                  markup=False, highlight=False, soft_wrap=True)


def document(measured, predictions, best_reason, extrapolated: dict, settings: dict) -> dict:
    best, reason = best_reason

    def record(p: cm.Prediction) -> dict:
        out = p.as_dict()
        if measured.convergence is not None:
            seconds, guessed = cm.time_to_target_s(p, measured.convergence)
            out.update(time_to_target_s=seconds, time_to_target_extrapolated=guessed,
                       target_loss=measured.convergence.target_loss)
        return out

    doc = {"model": measured.work.name, "workers": settings["workers"], "ps": settings["ps"],
           "recommendation": {**record(best), "reason": reason},
           "predictions": [record(p) for p in predictions],
           "measurements": measured.as_dict()}
    if settings.get("hosts") is not None:
        spec = settings["hosts"].hosts
        doc["hosts"] = {"count": spec.count, "link_bps": spec.link,
                        "link_of_bps": {spec.name(h): r for h, r in sorted(spec.link_of.items())},
                        "latency_s": spec.latency, "tasks_per_host": spec.tasks_per_host,
                        "cores_per_host": settings["hosts"].cores_per_host, "description": settings["hosts"].describe()}
    if extrapolated:
        doc["extrapolation"] = {
            "assumptions": list(ASSUMPTIONS),
            "network": {"bandwidth_Bps": settings.get("bandwidth"), "latency_s": settings.get("latency")},
            "workers": {str(n): {"recommendation": {**record(b), "reason": r},
                                 "predictions": [record(p) for p in preds]}
                        for n, (preds, (b, r)) in extrapolated.items()}}
    return doc


def run(args: argparse.Namespace) -> int:
    """``stratagem advise`` with parsed ``args``; returns the exit status."""
    from rich.console import Console

    from stratagem.advise import probe

    err = Console(stderr=True, soft_wrap=True)

    def say(text: str) -> None:
        err.print(f"stratagem advise: {text}", markup=False, highlight=False)

    try:
        settings = check(args)
        if args.probe_links:
            return probe_links(args.probe_links, settings["probe_transport"], args.model, args.seed, args.quick,
                               args.timeout)
        if args.measured:
            measured = load_measured(args.measured)
        else:
            transports = _transports(args)
            most = max([args.worker] + [args.worker + max(settings["ps"]) + 1])
            cores = probe.cores_here()
            probe_settings = probe.ProbeSettings(model=args.model, transports=transports, seed=args.seed,
                                                 quick=args.quick, timeout=args.timeout,
                                                 machine_tasks=min(MAX_PROBE_TASKS, max(most, cores + 1, 2)))
            measured = probe.measure(probe_settings, on_progress=say)
        if settings["links"]:
            measured = use_links(measured, settings["links"])
        if not measured.transports:
            raise ConfigurationError("no transport could be measured here: "
                                     + "; ".join(f"{k}: {v}" for k, v in measured.skipped.items()))
        if settings["hosts"] is not None:
            from stratagem.advise import hosts as described

            predictions, best_reason = described.predict(settings["hosts"], measured, args.worker, settings["ps"],
                                                         settings["strategies"])
        else:
            predictions, best_reason = advise(measured, args.worker, settings["ps"], settings["strategies"])
        extrapolated = extrapolate(measured, settings["predict"], settings["ps"], settings["strategies"],
                                   settings["bandwidth"], settings["latency"]) if settings["predict"] else {}
    except ConfigurationError as exc:
        say(str(exc))
        return EXIT_USAGE
    except probe.ProbeError as exc:
        say(str(exc))
        return EXIT_FAILED
    shown = {"workers": args.worker, "ps": settings["ps"], "bandwidth": settings["bandwidth"],
             "latency": settings["latency"], "hosts": settings["hosts"]}
    if args.json:
        json.dump(document(measured, predictions, best_reason, extrapolated, shown), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        out = Console(file=sys.stdout, width=max(120, Console(file=sys.stdout).width))
        print_report(measured, predictions, best_reason, extrapolated, shown, out)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratagem advise")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
