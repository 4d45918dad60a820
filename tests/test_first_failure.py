"""``stratagem launch`` names the task that failed first, the one its peers' errors name, not the first
process it sees exit (issue #23, item 4; :mod:`stratagem.launch.failures`).

The plain script ``scripts/first_failure.py`` runs as every task of a three-worker job; worker:1 fails
at its fourth step while worker:2 is slow at every step:

- worker:1 stops (SIGSTOP): it never exits, and its peers fail naming it once the peer timeout has
  passed. The launcher used to blame the first peer to exit.
- worker:1 raises, and its cleanup at exit takes a while: its peers fail at once naming it and exit
  before it does. The launcher used to blame one of them.

In each case the headline and the ``<- first failure`` marker name worker:1, and so do the errors of
the peers that failed (under ``in_graph``, the client's: a replica that loses the client names the
client, whose own error names worker:1).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher import summary_rows   # the launcher summary table, parsed once

SCRIPT = Path(__file__).parent / "scripts" / "first_failure.py"
LIMIT = 60

pytestmark = pytest.mark.timeout(LIMIT + 30)


def errors_of(stderr: str, task: str) -> list[str]:
    """The last lines of ``task``'s tracebacks (``[worker:0] stratagem.core.errors.PeerLostError: ...``), or
    the one line a serving task ends with (``[worker:2] stratagem in_graph: ... stopped serving: ...``)."""
    return [line for line in stderr.splitlines()
            if line.startswith(f"[{task}] ") and re.match(r"^\[\S+\] ([\w.]+(Error|Exception)|stratagem [\w_]+): ", line)]


@pytest.mark.parametrize("strategy, transport, ending", [
    ("mirrored", "zmq", "stop"),
    ("in_graph", "zmq", "stop"),
    ("mirrored", "zmq", "raise"),
])
def test_the_launcher_names_the_task_that_failed_first(strategy, transport, ending):
    # On a hang, subprocess.run SIGKILLs the launcher and its tasks die with it (PR_SET_PDEATHSIG).
    done = subprocess.run(
        [sys.executable, "-m", "stratagem", "launch", "--worker", "3", "--grace", "1", "--timeout", str(LIMIT), "--",
         sys.executable, str(SCRIPT), strategy, transport, ending],
        capture_output=True, text=True, timeout=LIMIT + 20)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert re.search(r"stratagem launch: FAILED: worker:1 ", done.stderr), log
    rows = summary_rows(done.stderr)
    assert rows["worker:1"].endswith("<- first failure"), log
    assert not any(status.endswith("<- first failure") for task, status in rows.items() if task != "worker:1"), log
    # The peers that failed name worker:1 too (the first of them to exit was the launcher's old pick).
    # Under in_graph the client (worker:0) tells its other replica (worker:2) which task failed before it
    # leaves, so whichever of them exits before the launcher stops the other names worker:1.
    failed_peers = [task for task in ("worker:0", "worker:2") if rows[task].startswith("exit ")]
    assert failed_peers, log
    for task in failed_peers:
        assert errors_of(done.stderr, task) and all("worker/task:1" in line for line in errors_of(done.stderr, task)), log
