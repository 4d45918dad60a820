"""Time a collective per message size on every stratagem transport, beside torch.distributed (gloo) and mpi4py.

``stratagem bench collectives``::

    stratagem bench collectives                                  # np 2, 4K-64M, every usable transport
    stratagem bench collectives --transports zmq,grpc,mpi --np 3 --sizes 4K-256M --json out.json
    stratagem bench collectives --transports zmq --baselines none --sizes 4K,64M --iters 50
    python -m stratagem.bench.collectives ...                    # the same, without the CLI

For every world size (``--np``) and every stratagem transport and baseline, one *job*: a fresh set of
processes, one per rank (:func:`stratagem.launch.launcher.launch`, or
:func:`stratagem.launch.mpi.launch_mpi` for transports that run as an MPI job and for mpi4py),
that runs every size (:mod:`stratagem.bench.collectives_task` says how it is timed). Jobs run one
after another, never two at once. A job that fails or passes ``--timeout`` is stopped (every process
of it) and reported with the reason; the rest still run. A transport or baseline that cannot run
here is listed as skipped, with the reason and the fix.

The table (stdout) has one row per size and contender: the median and minimum iteration time (an
iteration's time is that of the slowest rank), the algorithm bandwidth ``algbw = bytes / median`` and
the bus bandwidth ``busbw = algbw x 2(n-1)/n`` for all-reduce (``x 1`` broadcast, ``x (n-1)/n``
all-gather), as nccl-tests define them, so figures of different world sizes compare. Bandwidths
are decimal GB/s (10**9 bytes a second); sizes binary (4K = 4096 bytes). ``*`` marks the fastest
contender of each size (by median). Progress goes to stderr, so ``... > table.txt`` keeps only the
table. ``--json PATH`` writes every iteration time, the statistics and the environment.

From Python, :func:`measure` runs the jobs and returns a :class:`Report`; :func:`print_report` and
:func:`report_json` render it (``benchmarks/allreduce.py`` builds on them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from stratagem.bench.collectives_task import COLLECTIVES, elements_per_rank
from stratagem.bench.environment import describe_environment
from stratagem.bench.collectives_jobs import (
    BASELINES, DEFAULT_BASELINES, DEFAULT_TIMEOUT, MAX_ITERS, MIN_ITERS, VOLUME, Contender, JobResult,
    baseline_contender,
    default_transports, run_job, schedule, stats, transport_contender,
)
from stratagem.bench.units import human_bytes, parse_size, parse_sizes

#: Sizes when ``--sizes`` is not given: 8 sizes, about a minute on 2 cores for zmq, grpc, mpi, gloo, mpi4py.
DEFAULT_SIZES = "4K-64M"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_PROG = "stratagem bench collectives"
DESCRIPTION = ("Time a collective (all-reduce by default) per message size on every stratagem transport, "
               "beside torch.distributed (gloo) and mpi4py, with algorithm and bus bandwidth as nccl-tests "
               "report them.")


# -- the live display ------------------------------------------------------------------------------


class _Display:
    """Progress on stderr: a rich progress bar on a terminal, else one plain line per event."""

    def __init__(self, total_steps: int = 0, total_jobs: int = 0, *, verbose: bool = False, quiet: bool = False):
        self.total_jobs, self.job_index, self.quiet = total_jobs, 0, quiet
        self.sizes_in_job = self.done_in_job = 0
        self.echo = self._echo if verbose else None
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("starting", total=max(1, total_steps))

    def __enter__(self) -> "_Display":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def log(self, text: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def _echo(self, line: str) -> None:
        self.log(f"    {line}")

    def _describe(self, job: JobResult, what: str) -> None:
        if self.bar is not None:
            where = f"[{self.job_index}/{self.total_jobs}] {job.label} np={job.np}"
            self.bar.update(self.task, description=f"{where}: {what}")

    def job_started(self, job: JobResult, sizes: int) -> None:
        self.job_index += 1
        self.sizes_in_job, self.done_in_job = sizes, 0
        self.log(f"[{self.job_index}/{self.total_jobs}] {job.label} np={job.np}: starting")
        self._describe(job, f"starting ({sizes} sizes)")

    def size_done(self, job: JobResult, progress: dict) -> None:
        self.done_in_job += 1
        size = human_bytes(progress["bytes"])
        median = progress.get("median_s")
        text = f"{size} median {_fmt_time(median)}" if median else f"{size} done"
        if not progress.get("correct", True):
            text += " WRONG RESULT"
        if self.bar is not None:
            self.bar.advance(self.task)
            self._describe(job, f"{text} ({self.done_in_job} of {self.sizes_in_job} sizes)")
        else:
            self.log(f"  {job.label} np={job.np} {text}")

    def job_done(self, job: JobResult) -> None:
        if self.bar is not None:  # a job that stopped early leaves its remaining sizes to skip over
            self.bar.advance(self.task, self.sizes_in_job - self.done_in_job)
        if job.status == "ok":
            self.log(f"[{self.job_index}/{self.total_jobs}] {job.label} np={job.np}: done in {job.seconds:.1f}s")
        else:
            self.log(f"[{self.job_index}/{self.total_jobs}] {job.label} np={job.np}: {job.status.upper()} "
                     f"after {job.seconds:.1f}s: {job.reason}")
            for line in job.output_tail[-10:]:
                self.log(f"    {line}")


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Report:
    """Everything one run measured: what :func:`print_report` and :func:`report_json` render."""

    collective: str
    nps: list[int]
    sizes: list[int]
    plan: list[dict]
    rounds: int
    jobs: list[JobResult]
    environment: dict
    interrupted: bool = False
    seconds: float = 0.0

    def fastest(self, np_: int, size: int) -> JobResult | None:
        """The contender with the smallest median at this size (correct results only)."""
        best, best_time = None, None
        for job in self.jobs:
            entry = job.by_size().get(size) if job.np == np_ else None
            if entry and entry["times_s"] and entry["correct"]:
                median = statistics.median(entry["times_s"])
                if best_time is None or median < best_time:
                    best, best_time = job, median
        return best

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        bad = any(j.status not in ("ok", "skipped") or not all(s["correct"] for s in j.sizes) for j in self.jobs)
        return EXIT_FAILED if bad else EXIT_OK


def _merge_rounds(rounds: list[list[JobResult]]) -> list[JobResult]:
    """One result per (contender, np): every round's iterations pooled, each round's median kept."""
    merged: dict[tuple, JobResult] = {}
    for results in rounds:
        for r in results:
            m = merged.get((r.label, r.np))
            if m is None:
                m = merged[(r.label, r.np)] = JobResult(r.contender, r.np, r.status, r.reason, [], dict(r.info),
                                                       0.0, r.loadavg, list(r.output_tail))
            m.seconds += r.seconds
            if r.status != "ok" and m.status == "ok":
                m.status, m.reason, m.output_tail = r.status, r.reason, list(r.output_tail)
            m.info = m.info or dict(r.info)
            have = m.by_size()
            for e in r.sizes:
                median = statistics.median(e["times_s"]) if e["times_s"] else None
                if e["bytes"] in have:
                    t = have[e["bytes"]]
                    t.update(times_s=t["times_s"] + e["times_s"], iters=t["iters"] + e["iters"],
                             correct=t["correct"] and e["correct"])
                    t["round_medians_s"].append(median)
                else:
                    m.sizes.append({**e, "round_medians_s": [median]})
    return list(merged.values())


def measure(contenders: Sequence[Contender], nps: Sequence[int], sizes: Sequence[int], *,
            collective: str = "allreduce", iters: int | None = None, warmup: int | None = None,
            rounds: int = 1, timeout: float = DEFAULT_TIMEOUT, options: dict | None = None,
            verbose: bool = False, quiet: bool = False) -> Report:
    """Run every (np, contender) job, ``rounds`` times (the order reversed every other round, so
    outside load does not always hit the same contender; iterations pooled), and return the report.

    Ctrl-C or SIGTERM stops the current job (its processes are reaped) and returns what finished,
    with ``interrupted`` set.
    """
    plan = schedule(sizes, iters, warmup)
    started = time.monotonic()
    environment = describe_environment(np=list(nps), collective=collective, sizes=list(sizes),
                                       contenders=[c.label for c in contenders], rounds=rounds)
    jobs = [(n, c) for n in nps for c in contenders]
    runnable = [(n, c) for n, c in jobs if not c.skip_for(n)]
    rounds_done: list[list[JobResult]] = []
    interrupted = False
    previous = signal.getsignal(signal.SIGTERM)

    def terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if not quiet:
        print(f"{_PROG}: {collective}, np {', '.join(map(str, nps))}, "
              + ", ".join(f"{human_bytes(p['bytes'])} {p['warmup']}+{p['iters']}" for p in plan)
              + f" (warm-up + timed iterations), {len(runnable)} job(s) x {rounds} round(s)", file=sys.stderr)
    signal.signal(signal.SIGTERM, terminate)  # stop like Ctrl-C: the current job is reaped, the rest reported
    try:
        with _Display(len(runnable) * len(plan) * rounds, len(runnable) * rounds, verbose=verbose,
                      quiet=quiet) as display:
            for n, c in jobs:
                if c.skip_for(n):
                    display.log(f"skipped {c.label} np={n}: {c.skip_for(n)}")
            try:
                for i in range(rounds):
                    order = jobs if i % 2 == 0 else [j for n in nps for j in reversed([j for j in jobs if j[0] == n])]
                    rounds_done.append([])
                    for n, c in order:
                        result = run_job(c, n, plan, collective=collective, timeout=timeout, options=options,
                                         display=display)
                        rounds_done[-1].append(result)
                        if result.status == "interrupted":
                            raise KeyboardInterrupt(result.reason)
            except KeyboardInterrupt:
                interrupted = True
                display.log("interrupted: every process of the running job has been stopped; reporting what finished")
    finally:
        signal.signal(signal.SIGTERM, previous)
    results = _merge_rounds(rounds_done)
    # Jobs that never ran (interrupted before them) are reported as such, not dropped.
    seen = {(r.label, r.np) for r in results}
    results += [JobResult(c, n, "interrupted", "not run: the benchmark was interrupted")
                for n, c in jobs if (c.label, n) not in seen]
    position = {(c.label, n): k for k, (n, c) in enumerate(jobs)}
    results.sort(key=lambda r: position[(r.label, r.np)])
    environment["loadavg_at_end"] = list(os.getloadavg())
    return Report(collective, list(nps), list(sizes), plan, rounds, results, environment, interrupted,
                  time.monotonic() - started)


# -- rendering -------------------------------------------------------------------------------------


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    us = seconds * 1e6
    if us >= 1e5:
        return f"{us / 1e3:,.0f} ms"
    if us >= 1e4:
        return f"{us / 1e3:,.1f} ms"
    return f"{us:,.0f} us" if us >= 100 else f"{us:.1f} us"


def make_console(file=None):
    """A rich console for tables: the terminal's width, or wide enough not to wrap in a file or pipe."""
    from rich.console import Console

    file = file or sys.stdout
    return Console(file=file, width=None if file.isatty() else 200)


_OPS = {"allreduce": "sum all-reduce", "broadcast": "broadcast from rank 0", "allgather": "all-gather"}
_FACTORS = {"allreduce": "2(n-1)/n", "broadcast": "1", "allgather": "(n-1)/n"}


def print_report(report: Report, console=None) -> None:
    """The table per world size (stdout by default), then the skipped and failed contenders."""
    from rich import box
    from rich.table import Table

    console = console or make_console()
    for n in report.nps:
        jobs = [j for j in report.jobs if j.np == n]
        ran = [j for j in jobs if j.status != "skipped"]
        table = Table(box=box.SIMPLE_HEAD)
        for title in ("size", "contender", "median", "min", "algbw GB/s", "busbw GB/s", ""):
            table.add_column(title, justify="left" if title == "contender" else "right", no_wrap=True)
        for size in report.sizes:
            best = report.fastest(n, size)
            for k, job in enumerate(ran):
                entry = job.by_size().get(size)
                cells = [human_bytes(size) if k == 0 else "", job.label]
                if entry is None or not entry["times_s"]:
                    cells += ["-", "-", "-", "-", job.status if job.status != "ok" else ""]
                else:
                    s = stats(entry, n, report.collective)
                    mark = "*" if job is best else ("WRONG RESULT" if not entry["correct"] else "")
                    cells += [_fmt_time(s["median_s"]), _fmt_time(s["min_s"]), f"{s['algbw_GBps']:.3f}",
                              f"{s['busbw_GBps']:.3f}", mark]
                table.add_row(*cells, end_section=k == len(ran) - 1)
        if ran:
            console.print(f"float32 {_OPS[report.collective]}, {n} processes", markup=False, highlight=False)
            console.print(table)
            console.print(f"  time: an iteration's time is the slowest rank's; algbw = bytes / median time; "
                          f"busbw = algbw x {_FACTORS[report.collective]}; GB/s = 1e9 B/s; * = the fastest median "
                          f"of the size", markup=False, highlight=False)
        for job in jobs:
            if job.status == "skipped":
                console.print(f"  skipped {job.label} (np={n}): {job.reason}", markup=False, highlight=False)
            elif job.status != "ok":
                done = f"; {len(job.sizes)} of {len(report.sizes)} sizes measured" if job.sizes else ""
                console.print(f"  {job.status} {job.label} (np={n}): {job.reason}{done}", markup=False,
                              highlight=False)
        console.print()


def report_json(report: Report, command: Sequence[str] | None = None) -> dict:
    """The JSON document of ``--json``: every iteration time, the statistics and the environment."""
    return {
        "benchmark": "collectives", "collective": report.collective, "dtype": "float32",
        "op": "sum" if report.collective == "allreduce" else None,
        "command": list(command) if command is not None else None,
        "timing": "per iteration: every rank enters the backend's barrier, then times its own call with "
                  "perf_counter; an iteration's time is the max over the ranks",
        "bandwidth": f"algbw = data_bytes / median (GB/s = 1e9 B/s); busbw = algbw x "
                     f"{_FACTORS[report.collective]} (nccl-tests)",
        "environment": report.environment, "plan": report.plan, "rounds": report.rounds,
        "interrupted": report.interrupted, "seconds": round(report.seconds, 2),
        "fastest": {str(n): {str(size): (best.label if (best := report.fastest(n, size)) else None)
                             for size in report.sizes} for n in report.nps},
        "jobs": [
            {"label": j.label, "kind": j.contender.kind, "name": j.contender.name, "np": j.np,
             "status": j.status, "reason": j.reason, "info": j.info, "seconds": round(j.seconds, 2),
             "loadavg_at_start": j.loadavg, "output_tail": j.output_tail or None,
             "sizes": [{**e, **stats(e, j.np, report.collective)} for e in j.sizes]}
            for j in report.jobs
        ],
    }


# -- command line ----------------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _option(text: str) -> tuple[str, object]:
    """``chunk_bytes=4M`` -> ("chunk_bytes", 4194304); ``transport.io_threads=2`` for a transport option."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--set wants KEY=VALUE (e.g. chunk_bytes=4M or "
                                         f"transport.zero_copy_bytes=1M), got {text!r}")
    value = value.strip()
    parsed: object = value
    for convert in (int, parse_size, float):
        try:
            parsed = convert(value)
            break
        except ValueError:
            continue
    else:
        parsed = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return key.strip(), parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``stratagem bench collectives`` on ``parser`` (the CLI creates it)."""
    parser.description = parser.description or DESCRIPTION
    parser.epilog = ("Sizes are binary (4K = 4096 B); bandwidths decimal GB/s. Progress goes to stderr, the table "
                     "to stdout. Exit status: 0 all ran, 1 a job failed, timed out or gave a wrong result, "
                     "2 usage error, 130 interrupted.")
    parser.add_argument("--transports", type=_names, default=None, metavar="T,T",
                        help="stratagem transports (default: every registered one that runs across processes; "
                             "those that cannot run here are listed as skipped, with the reason)")
    parser.add_argument("--baselines", default=",".join(DEFAULT_BASELINES), metavar="B,B",
                        help=f"reference implementations: {', '.join(BASELINES)} (a plain pyzmq ring, "
                             f"all-reduce only) or none (default: {','.join(DEFAULT_BASELINES)}; one that is not "
                             f"installed is listed as skipped)")
    parser.add_argument("--np", type=int, nargs="+", default=[2], metavar="N",
                        help="processes per job; several values run every job at each (default: 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES), metavar="SIZES",
                        help=f"bytes per rank's result: A-B (powers of 4 from A, B included), A-BxN (step N), "
                             f"or a list 4K,1M,64M (default: {DEFAULT_SIZES}, about a minute on 2 cores)")
    parser.add_argument("--collective", choices=sorted(COLLECTIVES), default="allreduce",
                        help="the collective to time (default: allreduce)")
    parser.add_argument("--iters", type=int, default=None, metavar="N",
                        help=f"timed iterations per size (default: {human_bytes(VOLUME)} / size, "
                             f"{MIN_ITERS} to {MAX_ITERS})")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="untimed iterations before them (default: a tenth of the timed ones, 2 to 20)")
    parser.add_argument("--rounds", type=int, default=1, metavar="R",
                        help="run every job R times, alternating the order, and pool the iterations "
                             "(default: 1; more spreads each contender over time on a busy machine)")
    parser.add_argument("--set", dest="options", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="a communicator option for stratagem's transports (chunk_bytes=4M, small_bytes=64K), "
                             "or transport.KEY=VALUE for a transport option (transport.zero_copy_bytes=1M); "
                             "repeatable")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"stop a job that runs longer, report it and go on (default: {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--json", metavar="PATH", help="write every figure and the environment to PATH")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print the ranks' own output")


def communicator_options(pairs: Sequence[tuple[str, object]]) -> dict:
    """``--set`` pairs as communicator options (``transport.X`` into ``transport_options``)."""
    options: dict = {}
    for key, value in pairs:
        if key.startswith("transport."):
            options.setdefault("transport_options", {})[key[len("transport."):]] = value
        else:
            options[key] = value
    return options


def contenders(transports: Sequence[str] | None, baselines: Sequence[str]) -> list[Contender]:
    """Every contender asked for, in order, each with the reason it is skipped if it cannot run."""
    names = default_transports() if transports is None else list(dict.fromkeys(transports))
    return [transport_contender(t) for t in names] + [baseline_contender(b) for b in dict.fromkeys(baselines)]


class UsageError(ValueError):
    """Options that parsed but cannot be run; the message names the problem."""


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (they parsed, but do not go together), or None."""
    if any(n < 2 for n in args.np):
        return "--np values must be 2 or more (a collective over one process moves no data)"
    if any(s % 4 for s in args.sizes):
        bad = ", ".join(str(s) for s in args.sizes if s % 4)
        return f"sizes must be whole float32 arrays, multiples of 4 bytes: {bad}"
    if args.collective == "allgather":
        small = [s for s in args.sizes for n in args.np if elements_per_rank("allgather", s, n) < 1]
        if small:
            return f"all-gather sizes must be at least 4 x np bytes (every rank sends one float32 or more): {small}"
    for name, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1)):
        if value is not None and value < low:
            return f"{name} must be {low} or more, got {value}"
    if args.timeout <= 0:
        return f"--timeout must be more than 0 seconds, got {args.timeout:g}"
    return None


def _baseline_names(text: str) -> list[str]:
    names = _names(text)
    return [] if names in ([], ["none"]) else names


def measure_from_args(args: argparse.Namespace) -> Report:
    """Check the parsed options of :func:`add_arguments` and :func:`measure` what they ask for.

    Raises :class:`UsageError` for options that do not go together and for unknown transport or
    baseline names (with the known ones).
    """
    from stratagem.core.errors import PluginError

    problem = _check(args)
    if problem:
        raise UsageError(problem)
    try:
        chosen = contenders(args.transports, _baseline_names(args.baselines))
    except (PluginError, ValueError) as exc:  # an unknown transport or baseline name
        raise UsageError(str(exc)) from None
    return measure(chosen, args.np, args.sizes, collective=args.collective, iters=args.iters, warmup=args.warmup,
                   rounds=args.rounds, timeout=args.timeout, options=communicator_options(args.options),
                   verbose=args.verbose)


def run(args: argparse.Namespace) -> int:
    """Run ``stratagem bench collectives`` with parsed ``args``; print the table; return the exit status."""
    try:
        report = measure_from_args(args)
    except UsageError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print_report(report)
    if args.json:
        command = [_PROG, *args.argv] if hasattr(args, "argv") else [os.path.basename(sys.argv[0]), *sys.argv[1:]]
        with open(args.json, "w") as f:
            json.dump(report_json(report, command), f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    print(f"total {report.seconds:.1f}s", file=sys.stderr)
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stratagem.bench.collectives ...``: the same as ``stratagem bench collectives ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=_PROG, description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
