"""What a multi-node launch costs next to a local one, on this machine (both "nodes" on loopback).

    python benchmarks/multinode_launch.py [--rounds 5]

Per round, interleaved: the plain mirrored script of tests/scripts/multinode_train.py run (a) by one
``stratagem launch --worker 2`` and (b) by two launchers ``--nnodes 2 --node-rank 0|1`` with one worker
each; then the plain training script with worker:1 raising in its fourth step, (c) local and (d) on two
nodes. Each figure is the wall time from starting the launcher(s) until every launcher has exited
(median and min over the rounds), and for (b)/(d) the gap between the two launchers' exits. Also checks
that (a) and (b) give bitwise the same weights. Timings on a shared machine swing: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [sys.executable, str(ROOT / "tests" / "scripts" / "multinode_train.py")]
FAIL = [sys.executable, "-m", "stratagem.testing.plain_training", "mirrored", "zmq", "worker:1", "raise"]
LAUNCH = [sys.executable, "-m", "stratagem", "launch", "--timeout", "120"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATAGEM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["STRATAGEM_SECRET"] = secrets.token_hex(16)
    return env


def local(command: list[str]) -> tuple[float, str, int]:
    began = time.monotonic()
    done = subprocess.run([*LAUNCH, "--worker", "2", "--", *command], env=_env(), capture_output=True, text=True,
                          timeout=180, cwd=str(ROOT))
    return time.monotonic() - began, done.stdout + done.stderr, done.returncode


def two_nodes(command: list[str], port: int) -> tuple[float, float, str, list[int]]:
    env = _env()
    began = time.monotonic()
    procs = [subprocess.Popen([*LAUNCH, "--nnodes", "2", "--node-rank", str(rank), "--rdzv", f"127.0.0.1:{port}",
                               "--node-host", "127.0.0.1", "--rdzv-timeout", "60", "--", *command],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))
             for rank in range(2)]
    ends, outputs = [], []
    for proc in procs:
        outputs.append(proc.communicate(timeout=180)[0])
        ends.append(time.monotonic())
    return max(ends) - began, abs(ends[1] - ends[0]), "".join(outputs), [p.returncode for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from stratagem.testing.world import free_ports

    rows: dict[str, list[float]] = {k: [] for k in ("a", "b", "b_gap", "c", "d", "d_gap")}
    same = True
    for _ in range(args.rounds):
        port_b, port_d = free_ports(2)
        seconds, out_a, code = local(TRAIN)
        assert code == 0, out_a
        rows["a"].append(seconds)
        seconds, gap, out_b, codes = two_nodes(TRAIN, port_b)
        assert codes == [0, 0], out_b
        rows["b"].append(seconds)
        rows["b_gap"].append(gap)
        digests = set(re.findall(r"weights (\w+)", out_a)) | set(re.findall(r"weights (\w+)", out_b))
        same = same and len(digests) == 1
        seconds, out_c, code = local(FAIL)
        assert code == 1, out_c
        rows["c"].append(seconds)
        seconds, gap, out_d, codes = two_nodes(FAIL, port_d)
        assert codes == [1, 1] and "FAILED: worker:1 (node 1)" in out_d, out_d
        rows["d"].append(seconds)
        rows["d_gap"].append(gap)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.rounds} rounds; "
          f"(a) and (b) bitwise the same weights: {same}")
    print("| job | median s | min s | launchers' exits apart, median s |")
    print("| --- | --- | --- | --- |")
    for key, label, gap in (("a", "(a) train, launch --worker 2", None), ("b", "(b) train, 2 x --nnodes 2", "b_gap"),
                            ("c", "(c) worker:1 raises, launch --worker 2", None),
                            ("d", "(d) worker:1 raises, 2 x --nnodes 2", "d_gap")):
        gap_text = f"{statistics.median(rows[gap]):.3f}" if gap else "-"
        print(f"| {label} | {statistics.median(rows[key]):.2f} | {min(rows[key]):.2f} | {gap_text} |")


if __name__ == "__main__":
    main()
