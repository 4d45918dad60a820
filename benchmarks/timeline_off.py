#!/usr/bin/env python3
"""What the timeline hooks cost when no timeline is recorded (issue 25 item 5: "no cost when off").

    python benchmarks/timeline_off.py                                  # hooks, then calls on this tree
    python benchmarks/timeline_off.py --against /work/main/src         # calls: this tree vs another, alternating

``hooks``: in this process, nanoseconds per hook of a collective, less an empty loop's, for the two
ways of skipping the recording: the global that hot paths read and branched on (``RECORDER``,
``None`` when off: read once, checked before and after the work) and the recorder handed in
(``timeline.OFF``: ``started = recorder.now()`` before the work, ``recorder.record(..., describe,
*parts)`` after, both doing nothing). Best and median of ``--repeat`` alternating runs.

``calls``: microseconds per ``Communicator.allreduce`` of 4 KB (float32) on a one-task world over the
``local`` transport, the whole Python path of a collective with almost no communication, so the
hooks are as large a share of it as they can be. With ``--against SRC`` the same child script runs
with ``PYTHONPATH`` at this tree's ``src`` and at ``SRC`` in turn (``--rounds`` times each,
alternating which goes first), so that the load of a shared machine falls on both alike; each
child's figure is the best of 15 batches of ``--calls`` calls.

Both time the CPU the process used (``process_time_ns``), not the wall clock: on a loaded machine the
time a process waits for a core swings the wall-clock figures by several times, which would drown
differences of tens of nanoseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
#: Batches of calls per child; its figure is the best batch's time per call.
BATCHES = 15

CHILD = r"""
import time, numpy as np
from stratagem.collectives.communicator import Communicator
from stratagem.core.cluster import ClusterSpec
from stratagem.transports.local import LocalTransport
cluster = ClusterSpec({"worker": ["local:0"]})
transport = LocalTransport(cluster, "worker:0", **LocalTransport.world_options()); transport.start()
comm = Communicator(transport, timeout=30)
x, out = np.ones(1024, np.float32), np.empty(1024, np.float32)
for _ in range(2000):
    comm.allreduce(x, out=out)
best = None
for _ in range(BATCHES):
    start = time.process_time_ns()
    for _ in range(CALLS):
        comm.allreduce(x, out=out)
    took = (time.process_time_ns() - start) / CALLS
    best = took if best is None else min(best, took)
comm.close(); transport.close()
print(best / 1000)
"""


def hooks(n: int, repeat: int) -> dict:
    """ns per hook, off: the old global-and-branch idiom and the recorder handed in."""
    sys.path.insert(0, SRC)
    from stratagem.core import timeline

    module = types.SimpleNamespace(RECORDER=None)    # main's ``stratagem.core.timeline``, timeline off
    kwargs = {"op": "sum"}

    def old():
        for _ in range(n):
            recorder = module.RECORDER
            started = recorder.now() if recorder is not None else 0
            if recorder is not None:
                recorder.add("collective", "allreduce", started, recorder.now(), None)

    def new():
        recorder, describe = timeline.OFF, dict
        for _ in range(n):    # as Communicator._call does
            started = recorder.now()
            recorder.record("collective", "allreduce", started, describe, "allreduce", None, None, kwargs, None)

    def empty():
        for _ in range(n):
            pass

    runs: dict[str, list[float]] = {"global + branch (main)": [], "recorder handed in (OFF)": [], "empty": []}
    for _ in range(repeat):
        for name, body in zip(runs, (old, new, empty)):
            start = time.process_time_ns()
            body()
            runs[name].append((time.process_time_ns() - start) / n)
    base = min(runs.pop("empty"))
    return {name: (min(times) - base, statistics.median(times) - base) for name, times in runs.items()}


def calls(src: str, count: int) -> float:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    env.pop("STRATAGEM_TIMELINE", None)
    child = CHILD.replace("CALLS", str(count)).replace("BATCHES", str(BATCHES))
    done = subprocess.run([sys.executable, "-c", child], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"PYTHONPATH={src}: {done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="SRC", help="another tree's src/ to compare the calls with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--n", type=int, default=200_000, help="hooks per run")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the start")
    print(f"\nhooks, timeline off ({args.n} per run, {args.repeat} runs, empty loop subtracted):")
    for name, (best, median) in hooks(args.n, args.repeat).items():
        print(f"  {name:<26} best {best:6.1f} ns   median {median:6.1f} ns")
    trees = {"this tree": SRC} if not args.against else {"this tree": SRC, "against": args.against}
    figures: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
        for name, src in order:
            figures[name].append(calls(src, args.calls))
    print(f"\ncalls: Communicator.allreduce 4 KB, one-task local world, us per call (best of {BATCHES} x {args.calls} "
          f"per child; {args.rounds} children each, alternating):")
    for name, values in figures.items():
        print(f"  {name:<10} {trees[name]:<32} min {min(values):6.3f}  median {statistics.median(values):6.3f}  "
              f"all {' '.join(f'{v:.3f}' for v in values)}")
    if args.against:
        mine, theirs = statistics.median(figures["this tree"]), statistics.median(figures["against"])
        print(f"  this tree - against: {1000 * (mine - theirs):+.0f} ns per call (medians), "
              f"{1000 * (min(figures['this tree']) - min(figures['against'])):+.0f} ns (mins)")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
