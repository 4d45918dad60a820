"""List every plugin: its kind, name, where it came from, and whether it is usable here.

``stratagem info`` prints a table; ``stratagem info --json`` the same rows for programs::

    $ stratagem info --json
    {"stratagem": "0.1.0", "autoload": true, "plugins": [{"kind": "transport", "name": "local", ...}]}

"Usable" is checked for real: each plugin is imported and runs its own usability check (the ``mpi``
transport loads the MPI library, in a child process; ``nccl`` looks for a GPU), a few tenths of a
second. ``--quick`` only looks the required modules up and imports nothing (what :func:`report` does
by default), so a module that is installed but cannot load its library still shows as usable.

On a terminal the table wraps to its width; written to a file or a pipe it has one line per plugin
(plus one for an install hint), every reason in full, whatever ``COLUMNS`` says.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--quick", dest="check", action="store_false",
                        help="only look up the modules each plugin requires; import nothing (faster, "
                             "but blind to a library that fails to load)")
    parser.add_argument("--check", dest="check", action="store_true",
                        help="import each plugin and run its own usability check (the default)")
    parser.set_defaults(check=True)


def report(manager=None, *, check: bool = False) -> dict:
    """What ``stratagem info --json`` prints, as a dict."""
    from stratagem._version import __version__
    from stratagem.plugins.manager import plugin_manager

    manager = plugin_manager() if manager is None else manager
    return {
        "stratagem": __version__,
        "autoload": manager.autoload,
        "sources": manager.sources(),
        "plugins": [row._asdict() for row in manager.describe(check=check)],
    }


def run(args: argparse.Namespace) -> int:
    from stratagem.core.errors import PluginError

    try:
        data = report(check=getattr(args, "check", True))
    except PluginError as exc:
        print(f"stratagem info: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_table(data)
    sys.stdout.flush()  # a reader that left early is seen here, as a cut-short listing (cli.main: 141)
    return 0


def _print_table(data: dict, stream=None) -> None:
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty and isatty():
        _print_rich_table(data, stream)
    else:
        _print_plain_table(data, stream)
    if not data["autoload"]:
        print("third-party plugins not loaded (STRATAGEM_DISABLE_PLUGIN_AUTOLOAD is set)", file=stream)


def _notes(row: dict) -> str:
    return row["reason"] or row["description"] or ""


def _print_plain_table(data: dict, stream) -> None:
    """Fixed columns, then the notes unwrapped: nothing is cut, and each plugin stays greppable."""
    header = ("kind", "name", "source", "usable")
    rows = [(r["kind"], r["name"], r["source"], "yes" if r["usable"] else "no") for r in data["plugins"]]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    indent = " " * (sum(widths) + 2 * len(widths))

    def line(cells) -> str:
        return "".join(f"{cell:<{w}}  " for cell, w in zip(cells, widths))

    print(f"stratagem {data['stratagem']} plugins", file=stream)
    print(line(header) + "notes (why not usable, how to install)", file=stream)
    for cells, row in zip(rows, data["plugins"]):
        print((line(cells) + _notes(row)).rstrip(), file=stream)
        if row["install_hint"]:
            print(f"{indent}install: {row['install_hint']}", file=stream)


def _print_rich_table(data: dict, stream) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"stratagem {data['stratagem']} plugins", box=box.SIMPLE_HEAD)
    for column in ("kind", "name", "source", "usable"):
        table.add_column(column, overflow="fold")   # wrapped, never cut with an ellipsis
    table.add_column("notes (why not usable, how to install)", overflow="fold", ratio=1)
    for row in data["plugins"]:
        notes = Text(_notes(row), style=None if row["usable"] else "red")
        if row["install_hint"]:
            notes.append(f"\ninstall: {row['install_hint']}", style="bold")
        table.add_row(row["kind"], row["name"], row["source"],
                      Text("yes", style="green") if row["usable"] else Text("no", style="red"), notes)
    Console(file=stream).print(table)
