"""``stratagem advise --hosts N --link RATE``: predictions for a cluster of hosts you describe.

The costs of the work are measured here once (:mod:`stratagem.advise.probe`): the model's compute, a
ps's update, and per transport the per-call latency and per-byte cost of moving bytes between two
local tasks (what the CPU does: serializing, copying, the kernel's loopback). The hosts' links are
modelled, not measured:

- **Placement.** The tasks go on the hosts as ``stratagem launch --hosts`` puts them: round-robin in
  the launcher's order (the coordinator, the workers, the ps tasks), or ``--tasks-per-host K`` on
  each host in turn (:func:`stratagem.launch.hosts.plan_cluster`). Two tasks on one host talk over
  its loopback, at the speed measured here.
- **A link** carries ``RATE`` bits/s each way (``--link``; ``--link-of`` a slower host: the slowest
  host that holds a task of the job sets the pace), of which :data:`PAYLOAD` is payload (Ethernet,
  IP and TCP headers take the rest), plus a one-way latency (``--latency``; none by default).
- **A byte that crosses a link** moves at the slower of what it costs here (the measured per-byte
  figure: the copies on both ends) and its share of the wire: ``bw = min(bw_here, wire / flows)``,
  where ``flows`` is how many of the job's transfers share the busiest host's link at once. A
  stream is pipelined (a piece is copied while the one before is on the wire), so the two do not
  add up. A call costs the latency measured here plus the link's.
- **The token bucket** (``tc tbf``, as ``stratagem launch --hosts`` shapes a link) fills while its
  direction idles, up to its depth (:func:`stratagem.launch.hosts.bucket_bytes`: 96 KiB at 100mbit,
  250 KB at 1gbit), and that much passes at once when the traffic starts again: each direction's
  first transfer of a step saves ``depth / rate`` of wire time (``Link.credit_s``; 7.9 ms at
  100mbit, 2 ms at 1gbit), where the wire decides. Only on emulated hosts (without
  ``--cores-per-host``): a real link of that rate sends no faster after a pause. A sync ps round gets it on its pushes and on its
  replies (each direction idles while the other works); an all-reduce once (both directions at
  once), as far as the bucket refilled while the replicas computed.

  - all-reduce (a ring in rank order, so consecutive workers sit on different hosts): each host's link
    carries one ring flow per worker on it; with every worker on one host, none.
  - a ps exchange: the pushes of the workers on other hosts than the ps cross the ps host's link
    (each ps host's link is shared by the ps tasks on it); the workers on the ps's own host exchange
    over its loopback: the busiest ps host gives ``flows = remote workers / workers x ps tasks there``.
    A sync round's replies to the remote workers take turns on its way out (``Link.turns``:
    :func:`ps_turns`; what that makes of a round: :func:`~stratagem.advise.costmodel.fan_in_s`).
  - point to point (the ``in_graph`` client's link, a coordinator's dispatch): one flow.

- **Cores.** ``--cores-per-host C``: every host has ``C`` cores of its own, shared by the tasks on it
  (no other load; no straggler measured across hosts). Without it, the hosts are emulated on this
  machine (as ``stratagem bench --hosts`` runs them), so every task shares this machine's cores, as
  measured here (its other load and its stragglers included).

    >>> from stratagem.launch.hosts import HostsSpec
    >>> spec = HostsSpec.parse(2, link="100mbit")
    >>> s = cm.Setup("between_graph", "sync", "zmq", workers=2, ps=1)
    >>> placement(s, spec)     # round-robin: worker:0 host0, worker:1 host1, ps:0 host0
    {'worker': [0, 1], 'ps': [0], 'chief': []}
    >>> round(ps_flows(s, spec), 3)  # of 2 workers, 1 crosses the link to the ps
    0.5
    >>> t = cm.TransportFigures("zmq", cm.Link(1e-4, 1e9), cm.Link(1e-4, 1e9), ps=cm.Link(1e-4, 1e9))
    >>> link = shaped(t, s, spec).exchange
    >>> round(link.latency_s, 6), round(link.bandwidth_Bps / 1e6, 1)   # the wire decides: 11.96e6 / 0.5
    (0.0001, 23.9)
    >>> round(link.credit_s * 1e3, 2)      # the bucket's 96 KiB of frames pass at once: 7.9 ms of wire
    7.68
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from stratagem.advise import costmodel as cm
from stratagem.launch.hosts import HostsSpec, bucket_bytes, format_rate, plan_cluster

#: The share of a link's bits that is payload: a 1448-byte TCP segment in a 1514-byte Ethernet frame
#: (the token bucket counts the headers too).
PAYLOAD = 1448 / 1514


@dataclass(frozen=True)
class DescribedCluster:
    """The cluster advise predicts for: the hosts (count, links, latency, placement) and each host's
    cores (None: emulated on this machine, every task sharing its cores)."""

    hosts: HostsSpec
    cores_per_host: float | None = None

    def describe(self) -> str:
        """``2 emulated hosts, links 100mbit`` and how the cores are counted."""
        base = self.hosts.describe()
        if self.cores_per_host is None:
            return base.replace("emulated hosts", "hosts") + " (emulated on this machine: its cores shared by all)"
        return base.replace("emulated hosts", "hosts") + f", {self.cores_per_host:g} cores each"


def placement(setup: cm.Setup, spec: HostsSpec) -> dict:
    """Each job's tasks' hosts, as ``stratagem launch --hosts`` places them: ``{"worker": [host of
    worker:0, ...], "ps": [...], "chief": [the parameter_server coordinator's]}``."""
    counts = {"chief": int(setup.strategy == "parameter_server"), "worker": setup.workers, "ps": setup.ps}
    _, where = plan_cluster(counts, spec)
    out: dict = {"worker": [], "ps": [], "chief": []}
    for task in sorted(where, key=lambda t: (t.job, t.index)):
        out[task.job].append(where[task])
    return out


def wire_Bps(setup: cm.Setup, spec: HostsSpec) -> float | None:
    """Payload bytes per second of the slowest link among the hosts the job uses (None: unshaped)."""
    used = {h for hosts in placement(setup, spec).values() for h in hosts}
    rates = [spec.rate_of(h) for h in used]
    if any(r is None for r in rates) or not rates:
        return None
    return min(rates) / 8 * PAYLOAD


def ring_flows(setup: cm.Setup, spec: HostsSpec) -> int:
    """Ring flows on the busiest host's link: the most workers on one host (0 if all share one)."""
    hosts = placement(setup, spec)["worker"]
    if len(set(hosts)) < 2:
        return 0
    return max(hosts.count(h) for h in set(hosts))


def ps_flows(setup: cm.Setup, spec: HostsSpec) -> float:
    """How many times over a ps exchange's bytes cross the busiest ps host's link, per worker's byte:
    the share of workers on other hosts, times the ps tasks on that host."""
    where = placement(setup, spec)
    if not where["ps"]:
        return 0.0
    workers = where["worker"]
    worst = 0.0
    for host in set(where["ps"]):
        remote = sum(1 for w in workers if w != host) / max(1, len(workers))
        worst = max(worst, remote * where["ps"].count(host))
    return worst


def ps_turns(setup: cm.Setup, spec: HostsSpec) -> int:
    """How many of a sync round's replies take turns on the busiest ps host's link: the workers on
    other hosts than it (a ps task answers those on its own host at once, over loopback:
    :mod:`stratagem.ps_service.turns`).

    >>> ps_turns(cm.Setup("between_graph", "sync", "zmq", workers=4, ps=1), HostsSpec.parse(4, link="1gbit"))
    3
    """
    where = placement(setup, spec)
    if not where["ps"]:
        return 0
    workers = where["worker"]
    busiest = max(sorted(set(where["ps"])), key=lambda h: sum(1 for w in workers if w != h) * where["ps"].count(h))
    return sum(1 for w in workers if w != busiest)


def bucket_payload(setup: cm.Setup, spec: HostsSpec) -> float:
    """Payload bytes of the token bucket's depth on the slowest link the job uses (its depth is
    counted in frame bytes: :func:`stratagem.launch.hosts.bucket_bytes`); 0 where the links are not
    shaped."""
    used = {h for hosts in placement(setup, spec).values() for h in hosts}
    rates = [spec.rate_of(h) for h in used]
    if not rates or any(r is None for r in rates):
        return 0.0
    return bucket_bytes(min(rates)) * PAYLOAD


def _over(link: cm.Link | None, flows: float, wire: float | None, latency: float, burst: float) -> cm.Link | None:
    """``link`` (measured here) across the hosts: ``flows`` transfers share the wire's ``wire`` bytes/s.

    A stream is pipelined: the sender copies a piece into its socket while the one before is on the
    wire and the receiver reads the one before that, so the slower of the two sets the rate: the
    wire's share, ``wire / flows``, or the rate measured here (the copies at both ends and the
    kernel's work). Where the wire decides, the token bucket's ``burst`` bytes pass at the rate
    measured here: the credit is their time on the wire less that. (The link counts every worker's
    bytes, ``flows`` of each crossing: the bucket's bytes are ``burst / flows`` of them.)"""
    if link is None:
        return None
    if wire is None or flows <= 0:
        return cm.Link(link.latency_s + (latency if flows > 0 else 0.0), link.bandwidth_Bps)
    share = wire / flows
    if share >= link.bandwidth_Bps:
        return cm.Link(link.latency_s + latency, link.bandwidth_Bps)
    counted = burst / flows
    return cm.Link(link.latency_s + latency, share, burst / wire - counted / link.bandwidth_Bps, counted)


def shaped(t: cm.TransportFigures, setup: cm.Setup, spec: HostsSpec, emulated: bool = True) -> cm.TransportFigures:
    """``t`` (measured here) with its links across ``spec``'s hosts, for ``setup``'s placement;
    ``emulated``: the links are ``stratagem launch --hosts``'s token buckets, whose depth passes at
    once after an idle gap (a real link of that rate has no such credit: ``--cores-per-host``)."""
    wire, latency = wire_Bps(setup, spec), spec.latency or 0.0
    burst = bucket_payload(setup, spec) if emulated else 0.0
    ps = _over(t.ps, ps_flows(setup, spec), wire, latency, burst)
    if ps is not None and setup.mode == "sync":
        ps = dataclasses.replace(ps, turns=ps_turns(setup, spec))
    return dataclasses.replace(t, allreduce=_over(t.allreduce, ring_flows(setup, spec), wire, latency, burst),
                               p2p=_over(t.p2p, 1.0, wire, latency, burst), ps=ps)


def host_for(cluster: DescribedCluster, setup: cm.Setup, measured_host: cm.Host) -> cm.Host:
    """The cores the tasks share: this machine's as measured (emulated hosts), else ``C`` per host used
    (the busy tasks spread over them as placed; no other load, no straggler figure)."""
    if cluster.cores_per_host is None:
        return measured_host
    used = len({h for hosts in placement(setup, cluster.hosts).values() for h in hosts})
    return cm.Host(cores=cluster.cores_per_host * used)


def predict(cluster: DescribedCluster, measured, workers: int, ps_counts: Sequence[int],
            strategies: Sequence[str]) -> tuple[list, tuple]:
    """Predictions for ``workers`` on the described cluster, fastest first, and ``(best, reason)``."""
    setups = cm.setups_for(workers, list(measured.transports), ps_counts, strategies=strategies)
    emulated = cluster.cores_per_host is None
    predictions = sorted((cm.predict(s, measured.work, shaped(measured.transports[s.transport], s, cluster.hosts,
                                                              emulated),
                                     host_for(cluster, s, measured.host)) for s in setups),
                         key=lambda p: -p.samples_per_s)
    return predictions, cm.recommend(predictions, measured.work, measured.convergence)


def link_text(spec: HostsSpec) -> str:
    """``100mbit`` (or ``unshaped``): the link a table names."""
    return format_rate(spec.link) if spec.link else "unshaped"
