#!/usr/bin/env python3
"""What elastic training (``on_failure="shrink"``) costs per step when nothing fails.

    python benchmarks/elastic_commit.py                    # 2 workers, 5 rounds: about a minute on 2 cores
    python benchmarks/elastic_commit.py --workers 3 --rounds 3 --steps 100

An MLP 784-512-512-10 (670K float32 parameters: 2.7 MB of variables) trained by the ``mirrored``
strategy over zmq (benchmarks/_elastic_commit_worker.py), in three modes: ``raise`` (the default, no
commits), ``shrink1`` (``on_failure="shrink"``, a commit before every batch: an all-reduce of one int64
and a copy of the variables and the optimizer state) and ``shrink10`` (a commit every 10 batches). The
modes run one job each in turn, ``--rounds`` times (interleaved, so that they see the same outside
load); each job times ``--steps`` steps after a warm-up. Printed: per mode, the median over rounds of
each job's median step time, the min, the ratio to ``raise`` of the same round (median, min), and the
median time of one commit on the chief (its all-reduce and its copy, timed on their own).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("raise", "shrink1", "shrink10")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    from stratagem.launch.launcher import launch

    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    commits: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in MODES:
                out = os.path.join(tmp, f"{mode}-{round_}.json")
                log = io.StringIO()
                result = launch([sys.executable, os.path.join(HERE, "_elastic_commit_worker.py"), out, mode,
                                 str(args.steps), str(args.warmup)], workers=args.workers, timeout=300,
                                env=env, output=log, error_output=log)
                if not result.ok:
                    print(log.getvalue(), file=sys.stderr)
                    return 1
                with open(out) as f:
                    record = json.load(f)
                medians[mode].append(statistics.median(record["step_s"]))
                commits[mode] += record["commit_s"]
                print(f"round {round_ + 1} {mode}: {medians[mode][-1] * 1e3:.2f} ms/step", file=sys.stderr)
    load = os.getloadavg()
    print(f"mirrored over zmq, {args.workers} workers, MLP 784-512-512-10 (2.7 MB), {args.steps} steps x "
          f"{args.rounds} rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'mode':10} {'median ms':>10} {'min ms':>8} {'ratio median':>13} {'ratio min':>10} {'commit ms':>10}")
    for mode in MODES:
        ratios = [m / r for m, r in zip(medians[mode], medians["raise"])]
        commit = f"{statistics.median(commits[mode]) * 1e3:10.3f}" if commits[mode] else f"{'-':>10}"
        print(f"{mode:10} {statistics.median(medians[mode]) * 1e3:10.2f} {min(medians[mode]) * 1e3:8.2f} "
              f"{statistics.median(ratios):13.3f} {min(ratios):10.3f} {commit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
