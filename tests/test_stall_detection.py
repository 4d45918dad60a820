"""A stalled task is lost after the peer timeout, and only then, on every transport (issue #23, item 6).

Each test runs the plain training script (:mod:`stratagem.testing.fault_script`) under ``stratagem
launch`` with ``STRATAGEM_PEER_TIMEOUT=3`` (:func:`stratagem.testing.faults.run_fault`), over ``zmq``,
``grpc`` and ``shm``, and stops one worker with SIGSTOP while the job trains:

- stopped for good, every other worker fails naming it, a peer timeout after the stop: not before
  (0.9 x, the time it was last heard being at most a heartbeat before the stop), and not much later
  (2 x + 3 s, a wide bound for a loaded machine). Before the fix zmq declared it lost after 0.73 to 1.0
  x the timeout and grpc after 0.8 x;
- stopped for half the timeout (a GC pause), while another worker spends twice the timeout in one step
  (a pure-Python loop holding the GIL, or numpy releasing it), the job finishes as if nothing happened:
  heartbeats come from the transport's own threads, never from the user's step.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from stratagem.testing.faults import run_fault

# 3 s: the short pause is half of it, and a resumed process's first heartbeat must still come in time
# on a loaded 2-core machine; 2 s would leave that 1 s (kept at 3 s for that margin, not for speed).
PEER_TIMEOUT = 3.0
needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                                reason="grpcio is not installed (pip install 'stratagem[grpc]')")
TRANSPORTS = ["zmq", pytest.param("grpc", marks=needs_grpc), "shm"]

pytestmark = pytest.mark.timeout(120)


def _report(outcome) -> str:
    fields = {k: v for k, v in outcome.__dict__.items() if k != "output"}
    return f"{fields}\n{outcome.output[-6000:]}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stopped_worker_is_lost_one_peer_timeout_after_it_was_last_heard(transport):
    outcome = run_fault("mirrored", transport, "worker:1", "sigstop_long", peer_timeout=PEER_TIMEOUT)
    assert outcome.exit_code == 1 and outcome.launcher_culprit == "worker:1", _report(outcome)
    # The first survivor to notice fails the job and the launcher stops the other at once: it may be
    # gone (SIGTERM) before it noticed. Every survivor that did names worker:1, one peer timeout late.
    survivors = set(outcome.named) & {"worker:0", "worker:2"}
    assert survivors, "no survivor failed with an error\n" + _report(outcome)
    assert all(outcome.returncodes[t] == -15 for t in {"worker:0", "worker:2"} - survivors), _report(outcome)
    for task in survivors:
        assert outcome.named[task][:1] == ["worker:1"], f"{task} names {outcome.named[task]}\n" + _report(outcome)
        noticed = outcome.noticed[task]
        assert 0.9 * PEER_TIMEOUT <= noticed <= 2 * PEER_TIMEOUT + 3, (
            f"{task} noticed the stop after {noticed} s, with a peer timeout of {PEER_TIMEOUT} s\n" + _report(outcome))


@pytest.mark.parametrize("transport, kind", [("zmq", "python"), pytest.param("grpc", "numpy", marks=needs_grpc),
                                             ("shm", "python")])
def test_a_short_pause_and_a_long_step_finish_the_job_as_without_them(transport, kind):
    outcome = run_fault("mirrored", transport, "worker:1", "sigstop_short", peer_timeout=PEER_TIMEOUT,
                        compute=f"worker:2:{2 * PEER_TIMEOUT}:{kind}", steps=12)
    assert outcome.exit_code == 0, _report(outcome)
    assert not outcome.named, _report(outcome)
    assert outcome.ended is not None, "the pause was never struck\n" + _report(outcome)
    assert len(outcome.trained) == 3, _report(outcome)
    for line in outcome.trained.values():   # twelve steps of SGD(0.1) from zero on a gradient of ones
        assert np.allclose(json.loads(line.split("=", 1)[1]), -0.1 * 12, atol=1e-5), _report(outcome)
