"""``stratagem bench``: train one model with every strategy x transport, side by side, on this machine.

::

    stratagem bench                                # all usable strategies x transports, model mlp
    stratagem bench --strategies mirrored,parameter_server:sync,parameter_server:async \\
                    --transports zmq,grpc,mpi --worker 3 --ps 2 --model mlp --steps 300 \\
                    --json results.json --plot results.png
    stratagem bench --model embedding              # a 100k-row table a step reads ~2K rows of
    stratagem bench --strategies mirrored --transports zmq --compression none,fp16,topk,powersgd
    stratagem bench --model mypkg.models:build     # your own model (see stratagem.bench.models)
    stratagem bench --hosts 2 --link 100mbit --strategies mirrored,parameter_server:sync --model wide

Every combination runs as a local cluster of its own (``stratagem launch``; ``mpiexec`` for ``mpi``),
one after another (with ``--hosts N --link RATE``: on N emulated hosts of this machine, one task per
host in turn, ps tasks and the coordinator too, each host's link shaped to RATE, as ``stratagem launch
--hosts`` runs them; :mod:`stratagem.launch.hosts`): ``--worker`` replicas train (the ``parameter_server`` coordinator is one more task),
``--ps`` tasks hold the variables of ``between_graph`` and ``parameter_server``. Every replica trains
on the same data (each its own batches of ``batch_size`` rows, drawn by replica index and step) from
the same initial values, with plain SGD, for ``--steps`` steps each; the first ``--warmup`` steps are
left out of the timings. ``--compression LIST`` runs each combination once per compressor (``none``:
uncompressed), with the compressor's default options: the table then shows bytes per step and time to
the target loss for each. See :mod:`stratagem.bench.measure` for what each figure means and
:mod:`stratagem.bench.report` for the table.

While it runs, stderr shows which combination runs, its step and its samples per second. A
combination that fails or passes ``--timeout`` is stopped and reported; the others still run.
Exit status: 0 when every combination that was not skipped ran, 1 when one failed or timed out.

From Python::

    from stratagem.bench.train import main
    main(["--model", "linear", "--steps", "20", "--strategies", "mirrored", "--json", "out.json"])
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Sequence

from stratagem.core.errors import ConfigurationError
from stratagem.bench import plan as planning
from stratagem.bench.models import BUILTIN, build_model
from stratagem.bench.runner import RunSettings, run_combination
from stratagem.bench.units import human_bytes
from stratagem.launch.hosts import add_host_arguments, hosts_spec

DEFAULT_TRANSPORTS_NOTE = "every registered transport (those not usable here are listed as skipped)"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training bench's options (``stratagem bench [options]``)."""
    parser.add_argument("--strategies", default=planning.DEFAULT_STRATEGIES, metavar="LIST",
                        help="comma-separated strategies, a mode after a colon for the parameter-server "
                             f"ones (default: {planning.DEFAULT_STRATEGIES})")
    parser.add_argument("--transports", metavar="LIST", help=f"comma-separated transports (default: {DEFAULT_TRANSPORTS_NOTE})")
    parser.add_argument("--worker", type=int, default=2, metavar="N", help="training replicas (default 2)")
    parser.add_argument("--ps", type=int, default=1, metavar="M",
                        help="ps tasks for between_graph and parameter_server (default 1)")
    parser.add_argument("--compression", default=planning.NO_COMPRESSION, metavar="LIST",
                        help="comma-separated compressors for the gradients, 'none' for none: each combination "
                             "runs once per compressor (default: none)")
    parser.add_argument("--model", default="mlp", metavar="NAME",
                        help=f"{', '.join(BUILTIN)}, or package.module:build (default mlp)")
    parser.add_argument("--steps", type=int, default=200, metavar="N", help="steps per replica (default 200)")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="first steps of each replica left out of the timings (default 3)")
    parser.add_argument("--target-loss", type=float, metavar="LOSS",
                        help="the loss time-to-target waits for (default: the model's, else half the first loss)")
    parser.add_argument("--seed", type=int, default=0, help="initial values and data (default 0)")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                        help="stop a combination after this long (default 180)")
    parser.add_argument("--json", metavar="PATH", help="write every figure and the environment here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG: throughput bars and loss-vs-time curves")
    # --hosts N --link RATE --link-of HOST=RATE --tasks-per-host K --latency D: every combination on
    # emulated hosts, as stratagem launch --hosts runs a job (round-robin placement by default)
    add_host_arguments(parser)


def _check(args: argparse.Namespace) -> None:
    for name, low in (("worker", 1), ("ps", 0), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            raise ConfigurationError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.warmup >= args.steps:
        raise ConfigurationError(f"--warmup ({args.warmup}) must be less than --steps ({args.steps}): "
                                 f"the warm-up steps are not timed")
    if args.timeout <= 0:
        raise ConfigurationError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigurationError("--plot needs matplotlib: pip install 'stratagem[bench]' "
                                     "(or pip install matplotlib)") from None
    for path in (args.json, args.plot):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ConfigurationError(f"cannot write {path}: the folder {folder} does not exist")


class _Display:
    """Live progress on stderr: one line redrawn on a terminal, a line per combination otherwise."""

    def __init__(self, console, total: int):
        self.console, self.total = console, total
        self.live = console.is_terminal
        self.index, self.label = 0, ""

    def start(self, index: int, label: str, announce: bool = True) -> None:
        self.index, self.label = index, label
        if announce:     # (a skipped combination gets only its "skipped: why" line)
            self._show(f"[{index}/{self.total}] {label}: starting", final=not self.live)

    def progress(self, update: dict) -> None:
        if self.live:
            self._show(f"[{self.index}/{self.total}] {self.label}: step {update['step']}/{update['of']}, "
                       f"{update['samples_per_s']:,.0f} samples/s")

    def done(self, outcome) -> None:
        if outcome.status == "ok":
            f = outcome.figures
            text = (f"{f['samples_per_s']:,.0f} samples/s, final loss {f['final_loss']:.4g} "
                    f"({outcome.seconds:.1f} s)")
        else:
            text = f"{outcome.status}: {outcome.reason}"
        self._show(f"[{self.index}/{self.total}] {self.label}: {text}", final=True)

    def _show(self, text: str, final: bool = False) -> None:
        if self.live:
            self.console.file.write("\r\x1b[K" + text + ("\n" if final else ""))
            self.console.file.flush()
        elif final:
            self.console.print(text, markup=False, highlight=False)


def run(args: argparse.Namespace) -> int:
    """``stratagem bench`` with parsed ``args``; returns the exit status."""
    from rich.console import Console

    from stratagem.plugins.manager import plugin_manager
    from stratagem.bench import report
    from stratagem.bench.environment import describe_environment

    err = Console(stderr=True, soft_wrap=True)   # messages stay whole lines (grep, logs)
    try:
        _check(args)
        model = build_model(args.model)
        strategies = planning.parse_strategies(args.strategies)
        manager = plugin_manager()
        transports = planning.parse_transports(args.transports) if args.transports else manager.names("transport")
        compressions = planning.parse_compressions(args.compression)
        hosts = hosts_spec(args)
        combinations = planning.plan(strategies, transports, workers=args.worker, ps=args.ps, manager=manager,
                                     compressions=compressions, hosts=hosts)
    except ConfigurationError as exc:
        err.print(f"stratagem bench: {exc}", markup=False, highlight=False)
        return EXIT_USAGE

    param_bytes = int(sum(v.nbytes for v in model.init_params(args.seed).values()))
    target = args.target_loss if args.target_loss is not None else model.target_loss
    settings = RunSettings(model=args.model, steps=args.steps, warmup=args.warmup, seed=args.seed,
                           timeout=args.timeout, target_loss=target, batch_size=model.batch_size,
                           param_bytes=param_bytes, hosts=hosts)
    header = (f"stratagem bench: model {model.name} ({human_bytes(param_bytes)} of parameters, "
              f"batch {model.batch_size} per replica), {args.worker} replicas, {args.ps} ps, "
              f"{args.steps} steps ({args.warmup} warm-up)"
              + (f", on {hosts.describe()}" if hosts is not None else ""))
    environment = describe_environment(workers=args.worker, ps=args.ps)   # load average before the runs
    display = _Display(err, len(combinations))
    outcomes = []
    interrupted = None
    started = time.monotonic()
    for index, combination in enumerate(combinations, start=1):
        display.start(index, combination.label, announce=not combination.skipped)
        outcome = run_combination(combination, settings, on_progress=display.progress)
        display.done(outcome)
        if outcome.status == "interrupted":   # what finished is still reported; the rest does not run
            interrupted = outcome.signal
            break
        outcomes.append(outcome)
    out = Console(file=sys.stdout, width=max(120, Console(file=sys.stdout).width))
    report.print_table(outcomes, header, out, compression=compressions != [None])
    err.print(f"stratagem bench: {len(outcomes)} combinations in {time.monotonic() - started:.0f} s"
              + (f" (stopped by {signal.Signals(interrupted).name}: {len(combinations) - len(outcomes)} not finished)"
                 if interrupted else ""), markup=False, highlight=False)

    config = {"model": model.name, "model_spec": args.model, "param_bytes": param_bytes,
              "batch_size": model.batch_size, "learning_rate": model.learning_rate, "steps": args.steps,
              "warmup": args.warmup, "seed": args.seed, "workers": args.worker, "ps": args.ps,
              "target_loss": target, "strategies": [s.label for s in strategies], "transports": transports,
              "compression": [c or planning.NO_COMPRESSION for c in compressions],
              "timeout": args.timeout, "hosts": _hosts_config(hosts)}
    if args.json:
        document = report.to_json(outcomes, config, environment)
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        err.print(f"wrote {args.json}", markup=False, highlight=False)
    if args.plot:
        report.plot(outcomes, args.plot, header)
        err.print(f"wrote {args.plot}", markup=False, highlight=False)
    if interrupted:
        return 128 + interrupted     # 130 (SIGINT) or 143 (SIGTERM), as the launcher's own exit
    failed = [o for o in outcomes if o.status in ("failed", "timeout")]
    return EXIT_FAILED if failed else EXIT_OK


def _hosts_config(hosts) -> dict | None:
    """The emulated hosts of a run, for its JSON (None: one host, unshaped loopback)."""
    if hosts is None:
        return None
    return {"count": hosts.count, "link_bps": hosts.link, "link_of_bps": {hosts.name(h): r for h, r in
                                                                          sorted(hosts.link_of.items())},
            "latency_s": hosts.latency, "tasks_per_host": hosts.tasks_per_host, "description": hosts.describe()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratagem bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
