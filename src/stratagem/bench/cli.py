"""``stratagem bench``: the training comparison, and ``stratagem bench collectives``.

``stratagem bench [options]`` trains a model with every strategy x transport (:mod:`.train`);
``stratagem bench collectives [options]`` measures collective bandwidth per size (:mod:`.collectives`).
"""

from __future__ import annotations

import argparse

from stratagem.bench import collectives, train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training bench's options on ``parser``, and the ``collectives`` subcommand under it."""
    parser.description = train.__doc__.splitlines()[0]
    train.add_arguments(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="[collectives]")
    coll = sub.add_parser("collectives", help=collectives.__doc__.splitlines()[0],
                          description=collectives.__doc__.splitlines()[0])
    coll.set_defaults(subcommand_parser=coll)   # its own usage for options it does not know (see cli.main)
    collectives.add_arguments(coll)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "collectives":
        return collectives.run(args)
    return train.run(args)
