"""Link faults on emulated hosts (issue #23, the fault matrix's link rows): slow is not dead, a short cut
is no loss, a cut for good is, over zmq.

Each test runs the plain training script (:mod:`stratagem.testing.fault_script`) under ``stratagem
launch`` on emulated hosts, one task per host (:func:`stratagem.testing.faults.run_fault`, peer timeout
3 s), and strikes worker:1's host link when the chief starts step 3 (``EmulatedHosts.set_link``):

- cut for good: the others fail naming worker:1 a peer timeout after the cut (those the launcher has
  not stopped first), and the job is over within the peer timeout plus 10 s; under ``parameter_server``,
  where nobody else fails, the launcher still names the cut-off worker, not the coordinator it blames;
- cut for a third of the peer timeout, then restored: the job waits and finishes as without the cut
  (TCP resends 0.2, 0.6, 1.4 s after the cut: a cut of 1 s is bridged 1.4 s after it began; a cut of
  half the timeout, 1.5 s, only 3 s after: lost, as a peer silent for its timeout must be);
- slowed to a hundredth of its rate for the rest of the job (longer than a peer timeout): the heartbeats
  still get through, and the job finishes as without it;
- a link change for a host that is not there, or at a rate that is not one, names the problem.

Needs root (or ``unshare -r``) and iproute2; skipped, saying why, where emulated hosts cannot be built.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from stratagem.core.errors import ConfigurationError
from stratagem.testing.faults import run_fault
from stratagem.testing.hosts import emulated_hosts, why_no_hosts

PEER_TIMEOUT = 3.0

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(why_no_hosts() is not None, reason=f"no emulated hosts: {why_no_hosts()}")]


def _report(outcome) -> str:
    fields = {k: v for k, v in outcome.__dict__.items() if k != "output"}
    return f"{fields}\n{outcome.output[-6000:]}"


def _finished_as_without_the_fault(outcome, steps: int) -> None:
    assert outcome.exit_code == 0, _report(outcome)
    assert outcome.ended is not None, "the fault was never struck\n" + _report(outcome)
    assert not outcome.named, _report(outcome)
    assert len(outcome.trained) == 3, _report(outcome)
    for line in outcome.trained.values():   # `steps` steps of SGD(0.1) from zero on a gradient of ones
        assert np.allclose(json.loads(line.split("=", 1)[1]), -0.1 * steps, atol=1e-5), _report(outcome)


def test_a_worker_cut_off_for_good_is_named_by_the_launcher_and_every_task_that_reports():
    outcome = run_fault("mirrored", "zmq", "worker:1", "link_cut", peer_timeout=PEER_TIMEOUT, steps=40)
    assert outcome.exit_code == 1, _report(outcome)
    assert outcome.launcher_culprit == "worker:1", _report(outcome)
    # Every task notices within a heartbeat of the others (the cut is at both ends at once), and the
    # first to fail ends the job: the launcher stops the rest, which may be gone before they print. When
    # worker:1 itself fails first (it lost every peer), the launcher names it from the losses, and the
    # survivors are stopped, naming nobody (seen in CI-like runs: both survivors SIGTERMed 0.1 s after
    # worker:1 raised). Every survivor that did print names worker:1, and one that did not was stopped.
    survivors = set(outcome.named) & {"worker:0", "worker:2"}
    if not survivors:
        assert "cut off" in outcome.reason, _report(outcome)
    for task in {"worker:0", "worker:2"} - survivors:
        assert outcome.returncodes[task] == -15, f"{task} neither named worker:1 nor was stopped\n" + _report(outcome)
    for task in survivors:
        assert outcome.named[task][:1] == ["worker:1"], f"{task} names {outcome.named[task]}\n" + _report(outcome)
        assert 0.9 * PEER_TIMEOUT <= outcome.noticed[task] <= 2 * PEER_TIMEOUT + 3, _report(outcome)
    assert outcome.ended is not None and outcome.ended <= PEER_TIMEOUT + 10, _report(outcome)
    assert not outcome.trained, _report(outcome)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_a_parameter_server_worker_cut_off_for_good_is_named_though_only_it_fails(transport):
    """The coordinator and ps:0 lose worker:1 and go on without it (its closures run elsewhere); only
    worker:1 fails, blaming the coordinator it can no longer hear. The launcher names worker:1, from the
    peers each task noted it lost (worker:1 lost them all, they lost it); it named worker:0 before.
    Over grpc too: its transport notes the same losses (the one link cell that needs them)."""
    outcome = run_fault("parameter_server", transport, "worker:1", "link_cut", peer_timeout=PEER_TIMEOUT, steps=40)
    assert outcome.exit_code == 1, _report(outcome)
    assert outcome.launcher_culprit == "worker:1", _report(outcome)
    assert outcome.reason.startswith("worker:1 "), _report(outcome)
    assert outcome.ended is not None and outcome.ended <= PEER_TIMEOUT + 10, _report(outcome)


def test_a_link_cut_shorter_than_the_peer_timeout_is_no_loss():
    outcome = run_fault("mirrored", "zmq", "worker:1", "link_cut_short", peer_timeout=PEER_TIMEOUT,
                        link_for=PEER_TIMEOUT / 3, steps=12)
    _finished_as_without_the_fault(outcome, 12)
    # The all-reduce waited for the cut-off worker, so the job outlasted the cut.
    assert outcome.ended > PEER_TIMEOUT / 3, _report(outcome)


def test_a_link_slowed_to_a_hundredth_for_longer_than_the_peer_timeout_is_no_loss():
    outcome = run_fault("mirrored", "zmq", "worker:1", "link_slow", peer_timeout=PEER_TIMEOUT,
                        link="10mbit", link_for=60.0, steps=100)
    _finished_as_without_the_fault(outcome, 100)
    # Slow for longer than a peer timeout, or the test says nothing.
    assert outcome.ended > PEER_TIMEOUT, _report(outcome)


def test_a_bad_link_change_names_the_problem():
    with emulated_hosts(1) as hosts:
        with pytest.raises(ConfigurationError, match=r"no host 1: give 0\.\.0"):
            hosts.network.set_link(1, "down")
        with pytest.raises(ConfigurationError, match="like 100mbit"):
            hosts.network.set_link(0, "fast")
