"""List every plugin: its kind, name, where it came from, and whether it is usable here.

``stratagem info`` prints a table; ``stratagem info --json`` the same rows for programs::

    $ stratagem info --json
    {"stratagem": "0.1.0", "autoload": true, "plugins": [{"kind": "transport", "name": "local", ...}]}

Listing imports no plugin (required modules are looked up, not imported); ``--check`` also imports
each one and runs its own usability check.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.add_argument("--check", action="store_true",
                        help="also import each plugin and run its own usability check (slower)")


def report(manager=None, *, check: bool = False) -> dict:
    """What ``stratagem info --json`` prints, as a dict."""
    from .. import __version__
    from .manager import plugin_manager

    manager = plugin_manager() if manager is None else manager
    return {
        "stratagem": __version__,
        "autoload": manager.autoload,
        "sources": manager.sources(),
        "plugins": [row._asdict() for row in manager.describe(check=check)],
    }


def run(args: argparse.Namespace) -> int:
    from ..core.errors import PluginError

    try:
        data = report(check=getattr(args, "check", False))
    except PluginError as exc:
        print(f"stratagem info: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_table(data)
    return 0


def _print_table(data: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"stratagem {data['stratagem']} plugins", box=box.SIMPLE_HEAD)
    for column in ("kind", "name", "source", "usable"):
        table.add_column(column, no_wrap=True)
    table.add_column("notes (why not usable, how to install)", overflow="fold")
    for row in data["plugins"]:
        notes = Text(row["reason"] or row["description"] or "", style=None if row["usable"] else "red")
        if row["install_hint"]:
            notes.append(f"\ninstall: {row['install_hint']}", style="bold")
        table.add_row(row["kind"], row["name"], row["source"],
                      Text("yes", style="green") if row["usable"] else Text("no", style="red"), notes)
    console = Console()
    console.print(table)
    if not data["autoload"]:
        console.print("third-party plugins not loaded (STRATAGEM_DISABLE_PLUGIN_AUTOLOAD is set)")
