"""How the plain script ends, per strategy x transport x ending: every task's exit code and seconds.

    python3 benchmarks/script_endings.py [--transports zmq,grpc] [--strategies ...]

Runs tests/test_script_endings.py's jobs (each task an independent process with its own
STRATAGEM_CONFIG, as a Kubernetes TFJob starts them) and prints one row per job: each task's exit code
and the seconds from the job's start until it exited ("-" = still running at the limit, killed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_script_endings import FAILURES, STRATEGIES, run_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="zmq,grpc")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    jobs = [(s, None, ()) for s in strategies]
    jobs += [(s, t, (t, "raise")) for s, t in FAILURES if s.split(":")[0] in strategies]
    jobs += [(s, "worker:1", ("worker:1", "exit")) for s in ("mirrored", "between_graph") if s in strategies]
    print("| transport | strategy | ending | exit code (seconds) per task |")
    print("| --- | --- | --- | --- |")
    for transport in args.transports.split(","):
        for strategy, culprit, ending in jobs:
            results = run_job(strategy, transport, *ending)
            how = "normal end" if not ending else f"{culprit} {'raises' if ending[1] == 'raise' else 'sys.exit(3)'}"
            cells = ", ".join(f"{task} {'-' if code is None else code} ({secs:.1f})"
                              for task, (code, _, secs) in results.items())
            print(f"| {transport} | {strategy} | {how} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
