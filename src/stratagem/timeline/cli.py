"""``stratagem timeline merge`` and ``stratagem timeline summary``: the tasks' timeline files, together.

    stratagem launch --timeline trace.json --worker 3 -- python train.py   # records and merges
    stratagem timeline summary trace.json                                  # who waits on whom

    STRATAGEM_TIMELINE=/shared/run1/{task}.json ...                        # any other launcher
    stratagem timeline merge trace.json /shared/run1/*.json
"""

from __future__ import annotations

import argparse
import json
import sys

from stratagem.core.errors import TimelineError

_EPILOG = """\
examples:
  stratagem launch --timeline trace.json --worker 3 -- python3 train.py
  stratagem timeline summary trace.json
  STRATAGEM_TIMELINE=/shared/run1/{task}.json mpiexec -n 4 python3 train.py
  stratagem timeline merge trace.json /shared/run1/*.json

Open a trace in https://ui.perfetto.dev (or chrome://tracing): one process track per task.
Exit status: 0 done, 1 a file could not be read, understood or written, 2 usage error.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``stratagem timeline``'s subcommands ``merge`` and ``summary``."""
    parser.description = "merge the tasks' timeline files (STRATAGEM_TIMELINE) and find the straggler"
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="timeline_command", metavar="{merge,summary}")
    merge = sub.add_parser("merge", help="merge task files into one Chrome-trace/Perfetto JSON, clocks aligned",
                           description="Merge the timeline files the tasks wrote (STRATAGEM_TIMELINE) into one "
                                       "Chrome-trace / Perfetto JSON: one process track per task, every event on "
                                       "the reference task's clock (offsets measured by each task over the "
                                       "transport; their precision is listed in the output's otherData).")
    merge.set_defaults(subcommand_parser=merge)
    merge.add_argument("out", metavar="OUT.json", help="the merged trace to write")
    merge.add_argument("inputs", nargs="+", metavar="TASK.json", help="the tasks' files (one per task)")
    summary = sub.add_parser("summary", help="per task: step time breakdown, waits on each peer; the straggler",
                             description="Print, per task, the step time breakdown (compute, pack, "
                                         "collective, ps, wait, optimizer) and the time spent waiting on each "
                                         "peer, directly and traced to the cause, then name the straggler: the "
                                         "task the others wait on most.")
    summary.set_defaults(subcommand_parser=summary)
    summary.add_argument("inputs", nargs="+", metavar="TRACE.json",
                         help="a merged trace, or the tasks' own files (merged in memory)")
    summary.add_argument("--json", action="store_true", help="print the analysis as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``stratagem timeline ...``; return the exit status."""
    command = getattr(args, "timeline_command", None)
    if command is None:
        args.subcommand_parser.print_help(sys.stderr)
        return 2
    from stratagem.timeline import merge as merging
    from stratagem.timeline.summary import format_summary, summarize

    try:
        if command == "merge":
            merged = merging.merge_files(args.out, args.inputs)
            tasks = merged["otherData"]["stratagem_timeline"]["tasks"]
            print(f"stratagem timeline: merged {len(tasks)} task(s) into {args.out} "
                  f"(open it in https://ui.perfetto.dev)", file=sys.stderr)
            return 0
        report = summarize(merging.load_any(args.inputs))
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(format_summary(report, " and ".join(args.inputs) if len(args.inputs) < 3 else ""))
        return 0
    except TimelineError as exc:
        print(f"stratagem timeline: error: {exc}", file=sys.stderr)
        return 1
