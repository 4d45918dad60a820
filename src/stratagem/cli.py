"""The ``stratagem`` command: ``info``, ``launch``, ``k8s``, ``timeline`` (and ``bench``, ``advise``).

Each subcommand's arguments and behaviour live beside the code they drive (``add_arguments`` and
``run`` in its module); this file only wires them together, so ``stratagem --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: subcommand -> (module that implements it, one-line help)
SUBCOMMANDS = {
    "info": ("stratagem.plugins.report", "list the plugins, where each came from, and whether it is usable here"),
    "launch": ("stratagem.launch.launcher", "start a local cluster: one process per task, output prefixed by task"),
    "bench": ("stratagem.bench.cli", "compare strategies x transports training a model here (and `bench collectives`)"),
    "advise": ("stratagem.advise.cli", "measure this machine, predict every strategy x transport x ps count, recommend one"),
    "timeline": ("stratagem.timeline.cli", "merge the tasks' timelines (launch --timeline) and name the straggler"),
    "k8s": ("stratagem.launch.k8s", "write Kubernetes manifests for a job (`k8s manifest`: a Kubeflow TFJob or MPIJob)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported, so one subcommand's import problem
    cannot break the others (and ``--help`` imports none)."""
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="Stratagem: data-parallel training across processes and machines.",
    )
    from stratagem import __version__

    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            # Before its arguments: a nested parser may set its own subcommand_parser. Public names (no
            # option has them): the subcommand's module reads subcommand_parser for its usage errors.
            sub_parser.set_defaults(subcommand_module=module, subcommand_parser=sub_parser)
            module.add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``stratagem`` command; return its exit status (2: usage error).

    Output cut short by its reader (``stratagem info --json | head``) ends the command quietly, as
    it does ``cat``: exit status 141 (128 + SIGPIPE, what a shell shows for a program SIGPIPE killed),
    unless the command had finished (``launch`` keeps supervising its job when its reader goes: it
    exits with the job's status).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    # Options no parser knows are reported by the subcommand's own parser (its usage, its name),
    # not the top-level one, which knows none of the subcommand's options.
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 2
    if unknown:
        getattr(args, "subcommand_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = int(args.subcommand_module.run(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return 128 + 13  # SIGPIPE
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # The command ran to its end and only output it had left to write was lost (`stratagem launch
        # ... | head`: the launcher supervised the job regardless): its own status says how it went.
        _silence_stdout()
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not report the broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
