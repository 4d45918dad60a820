"""The ``stratagem`` command: ``info``, ``launch`` (and ``bench``).

Each subcommand's arguments and behaviour live beside the code they drive (``add_arguments`` and
``run`` in its module); this file only wires them together, so ``stratagem --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module that implements it, one-line help)
SUBCOMMANDS = {
    "info": ("stratagem.plugins.report", "list the plugins, where each came from, and whether it is usable here"),
    "launch": ("stratagem.core.launcher", "start a local cluster: one process per task, output prefixed by task"),
    "bench": ("stratagem.bench.cli", "compare strategies x transports training a model here (and `bench collectives`)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported, so one subcommand's import problem
    cannot break the others (and ``--help`` imports none)."""
    parser = argparse.ArgumentParser(
        prog="stratagem",
        description="Stratagem: data-parallel training across processes and machines.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"stratagem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)
