"""The fault matrix (issue #23): one fault on one task of a launched training job, per strategy x transport
x fault x culprit; the outcome expected (written below, before anything runs) beside the one observed.

    python3 benchmarks/fault_matrix.py                                  # zmq, every strategy, fault, culprit
    python3 benchmarks/fault_matrix.py --transports zmq,grpc,shm --strategies mirrored --faults sigkill,exit
    python3 benchmarks/fault_matrix.py --culprits worker --peer-timeout 5 --json faults.json
    python3 benchmarks/fault_matrix.py --transports mpi --strategies mirrored       # stratagem launch --mpi
    sudo python3 benchmarks/fault_matrix.py --transports grpc --strategies parameter_server --culprits worker \
        --faults link_cut --repeat 5                                    # one cell, five runs
    sudo python3 benchmarks/fault_matrix.py --faults link_slow,link_cut_short,link_cut       # on emulated hosts

Each cell runs the plain training script (:mod:`stratagem.testing.fault_script`, 40 steps, ``--steps``) under
``stratagem launch`` with ``STRATAGEM_PEER_TIMEOUT`` set, and strikes the fault on the culprit when the
chief (worker:0) starts step 3 (:func:`stratagem.testing.faults.run_fault`). A cell passes when:

- the outcome is the expected one: ``finishes`` (exit 0, and the variables' final values, as the last
  task to finish training read them, equal to the same strategy's run without a fault) or ``fails``
  (exit non-zero);
- for ``fails``: the launcher names the culprit, and so does every other task that failed with an error
  (its error mentions the culprit: ``worker:0->worker:1``; else the table lists the tasks it does name);
- the job was over (every task exited, the launcher's last output drained: about 1 s) within the peer
  timeout plus 10 s of the fault, or of the end of a stall that is not a loss.

Link faults (``link_slow``: the culprit's host link slowed to a hundredth of its 100 Mbit/s for 20 s;
``link_cut_short``: cut for 10 s, then restored; ``link_cut``: cut for good) run the job on emulated
hosts (one task per host; root, or ``unshare -r``): ``--faults link_slow,link_cut_short,link_cut``.
Where emulated hosts cannot be built, and over ``shm`` (one host's tasks only) and ``mpi`` (one private
network namespace), their rows say why and are not run. Over ``mpi`` the job is one ``mpiexec``
(``stratagem launch --mpi``). Nothing here passes or fails
the suite: it prints the table (markdown) and, with ``--json``, every cell's details.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from stratagem.testing.faults import FAULTS, JOBS, LINK_FAULTS, run_fault
from stratagem.testing.hosts import why_no_hosts

STRATEGIES = tuple(JOBS)
ALL_FAULTS = FAULTS + tuple(LINK_FAULTS)
CULPRITS = {"worker": "worker:1", "chief": "worker:0", "ps": "ps:0"}


def expected(strategy: str, culprit: str, fault: str, peer_timeout: float = 3.0, transport: str = "") -> str:
    """The outcome a user should get, decided before the run: ``finishes`` or ``fails``.

    - A pause shorter than the peer timeout is not a loss: every job finishes as without it.
    - SIGKILL, an exception and ``sys.exit(3)`` fail the job naming the task, everywhere: without
      ``--restart-workers`` the launcher fails a job whose task exits non-zero, and the peers that
      depended on it name it (parameter_server would re-run a vanished worker's steps, but the launcher
      still reports the dead task).
    - A stall longer than the peer timeout is a loss, so it fails the job naming the task, unless
      nobody has to wait for that task: a ``parameter_server`` worker (its steps run again on the
      others, and it is used again when it is back) finishes as without the stall. A ``between_graph``
      non-chief worker (async) finishes too, but with other weights allowed (``finishes, other weights
      allowed``): the others push and pull without it and the chief ends training when *its* steps are
      done, as in TensorFlow's between-graph async training; the stalled worker's remaining steps come
      after the end (it wakes two peer timeouts later, the job having 37 steps of ~0.07 s left) and are
      not applied. It then exits 0 saying "the job had finished without this task", and the ps tasks
      warn that it was gone: the job's output must say so (``FaultOutcome.says_left_out``), or the
      cell fails.
    - Slow is not dead: a link slowed to a hundredth still carries the heartbeats, so every job finishes
      as without it, whatever the peer timeout.
    - A link cut for 10 s is no loss when the peer timeout is long enough for TCP to resend after the
      link is back (:func:`tcp_back_after`: its retransmissions back off, 0.2 s doubling, so a 10 s cut
      is bridged 12.6 s after it began; the job waits, then trains on); with a shorter one it is, and unlike a stall the cut-off task hears nobody either: it fails too,
      naming a peer, so the job fails naming the cut-off task, whichever task it is (nobody may go on
      without a task that fails: the launcher stops the job). A link cut for good fails it likewise.
      Except a ``between_graph`` non-chief worker (async), as for its stall: nobody waits for it, the
      chief ends the job (its 37 steps left take ~2.6 s, less than the 3 s timeout) before the cut-off
      worker notices that it lost the ps, and then it exits 0 saying the job had finished without it.
      (With a job that runs on for longer than the peer timeout after the cut, that worker fails instead,
      naming ps:0, and the job fails: not a cell of this matrix.)
    - Over ``mpi`` a job cannot end without a rank: ``MPI_Finalize`` waits for every rank, so a rank
      stalled past the peer timeout is a loss even where nobody waits for it during training. The
      ranks that are done wait for it, hearing heartbeats, and when it is lost they end without
      finalizing, naming it (``transports/mpi``): the ``between_graph`` and ``parameter_server``
      worker:1 stalls fail the job naming worker:1.
    """
    if transport == "mpi" and fault == "sigstop_long":
        return "fails"
    if fault == "sigstop_short" or fault == "link_slow":
        return "finishes"
    if fault in ("link_cut_short", "link_cut") and culprit == "worker:1" and strategy == "between_graph":
        return OTHER_WEIGHTS_ALLOWED
    if fault == "link_cut_short":
        # Last heard up to a heartbeat (a tenth of the timeout) before the cut; half a second to spare.
        return "finishes" if 0.9 * peer_timeout > tcp_back_after(LINK_FAULTS[fault]) + 0.5 else "fails"
    if fault == "link_cut":
        return "fails"
    if fault == "sigstop_long" and culprit == "worker:1" and strategy == "parameter_server":
        return "finishes"
    if fault == "sigstop_long" and culprit == "worker:1" and strategy == "between_graph":
        return OTHER_WEIGHTS_ALLOWED
    return "fails"


#: The outcome of a cell that must finish, but whose final values may differ from the fault-free run's.
OTHER_WEIGHTS_ALLOWED = "finishes, other weights allowed"


def tcp_back_after(cut: float, rto: float = 0.2) -> float:
    """Seconds after a link is cut that a TCP connection over it, sending when it was cut, is heard
    again once the link is back ``cut`` seconds later: its first unanswered segment is resent after
    ``rto`` (Linux's least, 0.2 s), then after twice as long each time, and the first resend after the
    link is back gets through. ``tcp_back_after(10)`` is 12.6, ``tcp_back_after(1)`` 1.4."""
    sent, wait = 0.0, rto
    while sent < cut:
        sent, wait = sent + wait, wait * 2
    return round(sent, 6)


def cells(strategies, faults, roles):
    for strategy in strategies:
        _, ps = JOBS[strategy]
        for role in roles:
            if role == "ps" and not ps:
                continue
            for fault in faults:
                yield strategy, CULPRITS[role], fault


def verdict(outcome, want: str, baseline: dict) -> tuple[str, str, list[str]]:
    """(observed, PASS/FAIL, why not)."""
    problems = []
    if outcome.exit_code == 0:
        # The variables' final values: the most trained a task read (under between_graph's async mode
        # each worker prints the values of its own last pull; the one furthest from zero has them all:
        # every step moves w the same way. The order the lines arrive in says nothing).
        same = bool(outcome.trained) and _final(outcome.trained) == _final(baseline)
        observed = "finishes" if same else "finishes, other weights"
    else:
        observed = "fails" if outcome.exit_code != 124 else "hangs (--timeout)"
    if want == OTHER_WEIGHTS_ALLOWED:
        if observed not in ("finishes", "finishes, other weights"):
            problems.append(f"expected {want}")
        elif observed != "finishes" and not outcome.says_left_out():
            problems.append(f"no line of the output says {outcome.culprit} was left out")
    elif observed != want:
        problems.append(f"expected {want}")
    if want == "fails" and outcome.exit_code not in (0, 124):
        if outcome.launcher_culprit != outcome.culprit:
            problems.append(f"launcher names {outcome.launcher_culprit}")
        wrong = {t: "/".join(n) or "nobody" for t, n in outcome.named.items()
                 if outcome.culprit not in n and t != outcome.culprit}
        if wrong:
            problems.append("tasks name " + ", ".join(f"{t}->{n}" for t, n in sorted(wrong.items())))
    # A stall that is not a loss ends when the task is continued, two peer timeouts after it began.
    allowed = outcome.peer_timeout + 10 + (outcome.peer_timeout * 2 if outcome.fault == "sigstop_long"
                                           and want != "fails" else 0)
    if outcome.fault in ("link_slow", "link_cut_short") and want != "fails":
        allowed += outcome.link_for    # the job waits for the link, then trains on
    if outcome.fault in ("sigstop_short", "link_slow"):
        allowed = None   # the job trains on after the pause: its end says nothing about the fault
    if allowed is not None and (outcome.ended is None or outcome.ended > allowed):
        problems.append(f"ended {outcome.ended} s after the fault (> {allowed:g})")
    return observed, "PASS" if not problems else "FAIL", problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="zmq")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"any of {', '.join(ALL_FAULTS)} (default: the process faults)")
    parser.add_argument("--culprits", default="worker,chief,ps", help="roles: worker (worker:1), chief (worker:0), ps (ps:0)")
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=40, help="training steps of each job (the fault comes at step 3)")
    parser.add_argument("--repeat", type=int, default=1, help="run each fault cell this many times (a row each)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    strategies, faults = args.strategies.split(","), args.faults.split(",")
    roles = args.culprits.split(",")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more (the runs of each fault cell)")
    for name, given, known in (("strategy", strategies, STRATEGIES), ("fault", faults, ALL_FAULTS),
                               ("culprit", roles, tuple(CULPRITS))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {name}(s) {', '.join(unknown)}; known: {', '.join(known)}")
    load = os.getloadavg()
    print(f"fault matrix: peer timeout {args.peer_timeout:g} s; load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print()
    print("| transport | strategy | culprit | fault | expected | observed | verdict | exit codes | launcher names "
          "| tasks name (noticed, s after the fault) | job over (s after the fault) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    records, passed, total = [], 0, 0
    for transport in args.transports.split(","):
        baselines: dict[str, dict] = {}
        for strategy in strategies:
            base = run_fault(strategy, transport, None, None, peer_timeout=args.peer_timeout, steps=args.steps)
            baselines[strategy] = base.trained
            print(f"| {transport} | {strategy} | - | none | finishes | "
                  f"{'finishes' if base.exit_code == 0 else 'fails'} | {'PASS' if base.exit_code == 0 else 'FAIL'} | "
                  f"{_codes(base)} | {base.launcher_culprit or '-'} | - | - |", flush=True)
            records.append(_record(base, "finishes", "finishes" if base.exit_code == 0 else "fails", []))
        no_hosts = why_no_hosts() if set(faults) & set(LINK_FAULTS) else None
        for strategy, culprit, fault in (c for c in cells(strategies, faults, roles) for _ in range(args.repeat)):
            want = expected(strategy, culprit, fault, args.peer_timeout, transport)
            if fault in LINK_FAULTS and (no_hosts or transport in ("shm", "mpi")):
                why = no_hosts or ("shm connects the tasks of one host only (it refuses others, saying so)"
                                   if transport == "shm" else "an MPI job runs in one private network namespace")
                print(f"| {transport} | {strategy} | {culprit} | {fault} | {want} | not run: {why} "
                      f"| - | - | - | - | - |", flush=True)
                continue
            outcome = run_fault(strategy, transport, culprit, fault, peer_timeout=args.peer_timeout, steps=args.steps)
            observed, mark, problems = verdict(outcome, want, baselines[strategy])
            total += 1
            passed += mark == "PASS"
            named = ", ".join(f"{t}->{culprit if culprit in n else '/'.join(n) or 'nobody'} ({outcome.noticed[t]})"
                              for t, n in sorted(outcome.named.items())) or "-"
            print(f"| {transport} | {strategy} | {culprit} | {fault} | {want} | {observed} | {mark}"
                  f"{': ' + '; '.join(problems) if problems else ''} | {_codes(outcome)} | "
                  f"{outcome.launcher_culprit or '-'} | {named} | {outcome.ended} |", flush=True)
            records.append(_record(outcome, want, observed, problems))
    load = os.getloadavg()
    print(f"\n{passed} of {total} cells as expected; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


def _final(trained: dict) -> list:
    """The values furthest from zero among the tasks' ``trained: w = [...]`` lines."""
    return max((json.loads(line.split("=", 1)[1]) for line in trained.values()), key=lambda w: sum(map(abs, w)))


def _codes(outcome) -> str:
    return " ".join(f"{task}={code}" for task, code in outcome.returncodes.items())


def _record(outcome, want, observed, problems) -> dict:
    fields = {k: v for k, v in outcome.__dict__.items() if k != "output"}
    fields.update(expected=want, observed=observed, problems=problems, output_tail=outcome.output[-4000:])
    return fields


if __name__ == "__main__":
    sys.exit(main())
