"""The cost model behind ``stratagem advise``: pure functions from measured figures to predicted steps.

Nothing here measures, launches or imports anything heavy: every figure comes in as an argument (the
probes of :mod:`stratagem.advise.probe` measure them), so each formula can be checked by hand
(``tests/test_advise_costmodel.py`` does).

**Units.** Seconds, bytes, bytes per second. Every time is an *idle-core* time: what the work takes
on a core nobody else uses; :class:`Host` says how much slower it runs when tasks share cores.

**Links** (the alpha-beta model). Moving ``b`` bytes between two tasks takes ``latency + b /
bandwidth`` (:class:`Link`). Each transport has three: ``allreduce`` (the alpha and beta of a ring
step, fitted to all-reduces), ``p2p`` (one message one way, fitted to round trips) and ``ps`` (a
real parameter server's push and the values it sends back). Beside each, what it costs in CPU
(:class:`CpuCosts`): a transfer is partly waiting (the wire, the peer) and partly copying.

- Ring all-reduce of ``S`` bytes over ``n`` tasks: ``2(n-1)/n * S / bw + 2(n-1) * alpha``
  (:func:`ring_allreduce_s`).
- Parameter-server fan-in: every worker pushes its gradient for a shard and gets the shard's values
  back, ``2B`` bytes for a shard of ``B`` bytes; one shard's link and CPU serve its ``w`` workers one
  after another: ``2 * alpha + w * 2B / bw`` (:func:`fan_in_s`). The shards serve in parallel, so the
  busiest (largest) shard sets the time: variables are placed as the strategy places them
  (round-robin by default), so 2 ps tasks do not halve the largest shard when one variable dominates.

**CPU sharing** (:class:`Host`). On one host, tasks share its cores. While ``k`` tasks are busy, each
runs ``slowdown(k) = max(1, (k + background) / cores)`` times slower than on an idle core: the kernel's
fair share, where ``background`` is the number of busy processes of others (the probe fits it: a
busy machine slows every task, but adding a task costs less than on an idle one). The ranks of an MPI
job share one scheduling group under Linux's autogroup, so they get one share between them
(``TransportFigures.one_group``). Only CPU work slows down: a phase of ``wall`` seconds of which the
task on the critical path computes or copies ``cpu`` takes ``wall + cpu * (slowdown - 1)``, at the
slowdown of the tasks busy on average in it (:func:`phase`); computing is all CPU, a transfer partly.
A synchronous step also waits for the slowest of its ``k`` replicas (``Host.straggle``, measured in
lockstep on ``loss_and_grads`` calls: the factor is charged on the compute it was measured on, not on
the drawing of the batch before it, which a model like ``wide`` spends ten times as long on; a
meeting's lag is a rank waiting for its time slice and the barrier, which a longer draw does not
lengthen). With one task per host (``colocated=False``) nothing is shared.

**Strategies** (what one step costs; ``n`` workers, ``S`` parameter bytes; ``data``, ``compute``: a
replica drawing its batch and running forward and backward; ``update``, ``add``: per byte, the
optimizer's apply and a weighted gradient add):

- ``mirrored``: every replica draws, computes, packs its gradients (``add``), all-reduces them and
  applies the update itself. No overlap: stratagem all-reduces after the backward pass. All ``n`` tasks
  are busy throughout.
- ``in_graph``: the client draws the whole global batch, sends each of the ``n - 1`` worker tasks its
  rows and the variables' new values (``S``) over its own link, every replica computes (the client's
  own share overlaps the workers'), the ``n - 1`` gradients come back over the client's link, and the
  client adds the ``n`` gradients and applies the update.
- ``between_graph`` / ``parameter_server``, ``sync``: every worker draws and computes, then the fan-in
  on the busiest shard (``2 * alpha + n * 2B / bw``, the ps link measured on a real parameter
  server, so its update of the pushed bytes is in it). ``parameter_server`` adds the coordinator's
  dispatch: a closure out and its result back per worker step (as measured on a real coordinator,
  else ``2 * alpha`` of the p2p link), and one more task sharing the cores. (Without a ps
  measurement, the p2p link moves the bytes and the shard's adds and update, ``B * (n * add +
  update)``, come on top.)
- **The strategies' own work** (``TransportFigures.steps``, :class:`StepCosts`): a real step does
  more than the links' bare exchange (every variable read and its reply copied, one request per
  shard, the optimizer's bookkeeping, a sync round's wait at the ps; waking a task or a ps that
  waited through the compute). The steps probe times each strategy's step through the strategy;
  what the links do not explain (:func:`step_residuals`) is charged: a sync round's (``ps steps``)
  as measured for one worker plus, per further worker, what the second added in a measured round;
  an async worker's on its exchange; the in_graph client's per remote replica (``client steps``).
- ``async`` (``between_graph:async``, ``parameter_server:async``): each worker loops on its own: draw,
  compute, one round trip to the shards (``2 * alpha + 2B / bw``; the ps streams its reply in parts
  as it updates, and the shards serve at once). Each shard serves one push at a time (``2B / bw``),
  so the step time is the larger of a worker's loop and ``n`` pushes of service on the busiest shard.
  Tasks overlap freely, so the CPU is shared by the average number of busy tasks. The speed is paid
  in staleness: a gradient is applied on average ``n - 1`` updates after the values it was computed
  from were read (:func:`staleness_note`).

**Throughput.** ``samples_per_s = n * batch_size / step_s``, where a step is one batch per worker
(a global step); ``step_s`` includes drawing the batch, as the bench's samples/s does.

    >>> host = Host(cores=2)
    >>> zmq = TransportFigures("zmq", allreduce=Link(100e-6, 1e9), p2p=Link(100e-6, 1e9))
    >>> work = Workload("mlp", batch_size=256, param_bytes=1_600_000, input_bytes=264_192, data_s=0.001,
    ...                 compute_s=0.006, update_s_per_byte=1e-10, add_s_per_byte=1e-10,
    ...                 shards={1: (1_600_000,), 2: (1_050_000, 550_000)})
    >>> p = predict(Setup("mirrored", None, "zmq", workers=2), work, zmq, host)
    >>> round(p.step_s * 1e3, 2), round(p.samples_per_s)       # 7 ms local + 1.8 ms all-reduce
    (9.12, 56140)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from stratagem.ps_service.turns import TURN_BYTES

#: Strategies the model knows, and the consistency modes of those on parameter servers.
STRATEGIES = ("mirrored", "in_graph", "between_graph", "parameter_server")
PS_STRATEGIES = ("between_graph", "parameter_server")
MODES = ("sync", "async")


# -- the figures ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """Moving ``b`` bytes takes ``latency_s + b / bandwidth_Bps`` seconds.

    On a shaped link (a token bucket: :mod:`stratagem.advise.hosts`), ``burst_bytes``: the bucket's
    depth in payload bytes, which pass at once (at the speed measured here, not the wire's) when the
    link idled long enough to refill it; ``credit_s``: the wire time those bytes save. A step's
    traffic is one such transfer per direction where the direction idles between steps (a sync ps
    round's pushes, then its replies; an all-reduce while the replicas compute); both 0 on links that
    are not shaped.

    ``turns``, on a ps link that crosses hosts: how many of a sync round's replies take turns on the
    ps host's way out (the requesters on other hosts than the ps: :func:`fan_in_s`); 0 where none do.

    >>> Link(50e-6, 1e9).time(1_000_000)
    0.00105
    """

    latency_s: float
    bandwidth_Bps: float
    credit_s: float = 0.0
    burst_bytes: float = 0.0
    turns: int = 0

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    def scaled(self, factor: float) -> "Link":
        """The link ``factor`` times slower (latency up, bandwidth down)."""
        return replace(self, latency_s=self.latency_s * factor, bandwidth_Bps=self.bandwidth_Bps / factor,
                       credit_s=self.credit_s * factor)

    def bytes_s(self, nbytes: float, idle_s: float | None = None) -> float:
        """Seconds ``nbytes`` take on the link after an idle gap: ``nbytes / bw``, less the credit of
        the bucket's bytes among them (all of it if ``idle_s`` is None, else what refilled at the
        link's rate in ``idle_s``), never faster than the bytes move here.

        >>> link = Link(0.0, 1e6, credit_s=0.002, burst_bytes=2_500)   # 10 ms of bytes, 2 ms saved by 2.5 KB
        >>> round(link.bytes_s(10_000), 6), round(link.bytes_s(10_000, idle_s=0.00125), 6)  # half refilled
        (0.008, 0.009)
        >>> round(link.bytes_s(1_250), 6)           # a transfer smaller than the bucket saves its share
        0.00025
        """
        if self.credit_s <= 0 or self.burst_bytes <= 0:
            return nbytes / self.bandwidth_Bps
        filled = self.burst_bytes if idle_s is None else min(self.burst_bytes, max(0.0, idle_s) * self.bandwidth_Bps)
        return nbytes / self.bandwidth_Bps - self.credit_s * min(nbytes, filled) / self.burst_bytes


@dataclass(frozen=True)
class CpuCosts:
    """The CPU a task spends moving bytes, where measured (idle-core seconds as :class:`Link` s:
    fixed + bytes / rate): ``allreduce`` per task per call (the ring formula applies to it as to the
    time), ``p2p`` per round trip on one side, ``exchange`` per ps push-and-pull on the worker, ``serve``
    per push on the ps. None: as much CPU as time (the transfer keeps the task busy throughout)."""

    allreduce: Link | None = None
    p2p: Link | None = None
    exchange: Link | None = None
    serve: Link | None = None


@dataclass(frozen=True)
class StepCost:
    """A strategy's work per step beyond what the links explain, measured through the real strategy
    (the *steps* probe: the model's variables read and updated through the strategy, its forward and
    backward pass in place but not counted): ``wall_s`` and ``cpu_s``, idle-core seconds per step of
    the measuring task, with ``workers`` stepping; for ``parameter_server``, ``dispatch_s``: a
    closure's wall time on the coordinator beyond its step on the worker (sent, decoded, run,
    answered), ``dispatch_cpu_s``: the CPU that costs, the coordinator's and the worker's;
    ``serve_cpu_s``: the ps task's CPU per step (a worker's push and pull, as the strategy makes them)."""

    workers: int
    wall_s: float
    cpu_s: float
    dispatch_s: float = 0.0
    dispatch_cpu_s: float = 0.0
    serve_cpu_s: float = 0.0


@dataclass(frozen=True)
class StepCosts:
    """The steps probe's figures (:class:`StepCost`, None where not measured): ``ps_sync``, a
    ``between_graph`` sync round; ``ps_async``, a ``between_graph`` async worker alone, and
    ``ps_async_crowded`` with more stepping at once (sharing the cores and the ps); ``coordinator``,
    a ``parameter_server`` worker's step under the coordinator and its dispatch, alone and
    ``coordinator_crowded``; ``in_graph``, the client's work per remote replica. As measured
    (:func:`step_residuals` makes them the model's)."""

    ps_sync: StepCost | None = None
    ps_async: StepCost | None = None
    coordinator: StepCost | None = None
    in_graph: StepCost | None = None
    ps_async_crowded: StepCost | None = None
    coordinator_crowded: StepCost | None = None


@dataclass(frozen=True)
class TransportFigures:
    """One transport's links (idle-core figures): ``allreduce`` for the ring formula, ``p2p`` for one
    message one way, ``ps``: a parameter server's exchange, one way (a push and its reply cost
    ``2 * ps.time(B)``, the server's update of the ``B`` bytes included, as a real ps does it);
    ``idle_burn``: CPU a task burns while it waits in a collective (0: it sleeps; about 1: it spins,
    as Open MPI's blocking calls do); ``one_group``: the tasks of a job on this transport share one
    scheduling group on a host (an MPI job's ranks, under autogroup); ``cpu``: what moving the bytes
    costs in CPU (the part of a transfer that slows down when tasks share cores); ``steps``: the
    strategies' own work per step beyond the links (:class:`StepCosts`, as :func:`step_residuals`
    makes them; empty: none charged)."""

    name: str
    allreduce: Link
    p2p: Link
    ps: Link | None = None
    idle_burn: float = 0.0
    one_group: bool = False    # its tasks share one scheduling group (see Host.slowdown)
    cpu: CpuCosts = field(default_factory=CpuCosts)
    steps: StepCosts = field(default_factory=StepCosts)

    @property
    def exchange(self) -> Link:
        """The link of a ps exchange: measured on a real parameter server if it was, else ``p2p``."""
        return self.ps if self.ps is not None else self.p2p


@dataclass(frozen=True)
class Host:
    """``cores`` shared by our busy tasks and ``background`` busy processes of others; ``stragglers``:
    ``((k, factor), ...)``, how much longer ``k`` tasks that meet after every step take than one of
    them alone (a synchronous step waits for the slowest; measured in lockstep).

    >>> Host(cores=2).slowdown(1), Host(cores=2).slowdown(4), Host(cores=2, background=2).slowdown(1)
    (1.0, 2.0, 1.5)
    >>> Host(cores=2, background=6).slowdown(2), Host(cores=2, background=6).slowdown(2, grouped=True)
    (4.0, 7.0)
    >>> h = Host(cores=2, stragglers=((2, 1.2), (4, 1.4)))
    >>> [round(h.straggle(k), 3) for k in (1, 2, 3, 8)]
    [1.0, 1.2, 1.3, 1.4]
    """

    cores: float
    background: float = 0.0
    stragglers: tuple = ()

    def slowdown(self, busy: float, grouped: bool = False) -> float:
        """How many times slower than on an idle core each of ``busy`` tasks (of ours) runs.

        Separate tasks each get a fair share: ``max(1, (busy + background) / cores)``. ``grouped``:
        the tasks form one scheduling group (the ranks of an ``mpiexec`` job are one session, and a
        Linux kernel with autogroup shares the CPU between sessions first), which gets one share:
        ``min(busy, cores, max(cores / (1 + background), cores - background))`` cores for all of them.
        """
        busy = max(busy, 0.0)
        if not grouped or busy <= 1:
            return max(1.0, (busy + self.background) / self.cores)
        ours = min(busy, self.cores, max(self.cores / (1 + self.background), self.cores - self.background))
        return max(1.0, busy / ours)

    def straggle(self, k: float) -> float:
        """The lockstep factor for ``k`` tasks: 1 for one, interpolated between the measured ``k``,
        the last one beyond them."""
        points = sorted((float(a), float(b)) for a, b in self.stragglers)
        if k <= 1 or not points:
            return 1.0
        points = [(1.0, 1.0)] + [p for p in points if p[0] > 1]
        for (k0, f0), (k1, f1) in zip(points, points[1:]):
            if k <= k1:
                return f0 + (f1 - f0) * (k - k0) / (k1 - k0)
        return points[-1][1]


@dataclass(frozen=True)
class Workload:
    """The model, as the strategies see it (idle-core seconds; ``shards``: ps count -> bytes on each
    ps task, as the strategies place the variables)."""

    name: str
    batch_size: int
    param_bytes: int
    input_bytes: int
    data_s: float
    compute_s: float
    update_s_per_byte: float
    add_s_per_byte: float
    shards: Mapping[int, tuple] = field(default_factory=dict)

    def shard_bytes(self, ps: int) -> tuple:
        """Bytes on each of ``ps`` tasks: the placement the probe computed, else an even split."""
        if ps in self.shards:
            return tuple(self.shards[ps])
        return even_shards(self.param_bytes, ps)


@dataclass(frozen=True)
class Convergence:
    """Rows of data the model takes to reach ``target_loss`` (:mod:`stratagem.advise.convergence`):
    ``sync``, ``(replicas, rows)`` with every replica's gradient in each update; ``async_``,
    ``(workers, rows)`` with each gradient applied ``workers - 1`` updates stale. ``rows`` is None
    where the run did not reach the target (or diverged).

    >>> c = Convergence(2.2, sync=((1, 6000), (2, 10000), (4, 18000)), async_=((1, 6000), (2, 11000), (4, None)))
    >>> c.rows("sync", 3), c.rows("sync", 8), c.rows("async", 4)
    ((14000.0, False), (34000.0, True), (None, False))
    """

    target_loss: float
    sync: tuple = ()
    async_: tuple = ()

    def rows(self, mode: str, n: int) -> tuple[float | None, bool]:
        """Rows to the target with ``n`` workers in ``mode`` (``async`` for async, anything else is
        sync), and whether that is extrapolated beyond the measured counts: linear between measured
        counts, and beyond the last along the last two (never below the last). None where a measured
        count on the way did not reach the target."""
        points = sorted((int(k), r) for k, r in (self.async_ if mode == "async" else self.sync))
        if not points:
            return None, False
        for (k0, r0), (k1, r1) in zip(points, points[1:]):
            if k0 <= n <= k1:
                if r0 is None or r1 is None:
                    return (float(r0), False) if n == k0 and r0 is not None else (None, False)
                return r0 + (r1 - r0) * (n - k0) / (k1 - k0), False
        if n <= points[0][0]:
            return (None, False) if points[0][1] is None else (float(points[0][1]), n != points[0][0])
        reached = [(k, r) for k, r in points if r is not None]
        if len(reached) < len(points) or not reached:   # the last measured count did not converge
            return None, False
        if len(reached) == 1:
            return float(reached[0][1]), True
        (k0, r0), (k1, r1) = reached[-2], reached[-1]
        return r1 + max(0.0, (r1 - r0) / (k1 - k0)) * (n - k1), True

    def rows_for(self, setup: "Setup") -> tuple[float | None, bool]:
        """:meth:`rows` for ``setup``: an async setup pays its staleness, any other its global batch."""
        return self.rows("async" if setup.mode == "async" else "sync", setup.workers)


def time_to_target_s(p: "Prediction", convergence: Convergence | None) -> tuple[float | None, bool]:
    """Seconds ``p``'s setup takes to reach the convergence's target loss (its rows to the target at
    the predicted samples/s), and whether that rests on an extrapolation; None where it is not known
    or the target was not reached. An async setup pays its staleness here, a sync one its global batch.

    >>> c = Convergence(1.0, sync=((1, 1000), (2, 2000)), async_=((1, 1000), (2, 1500)))
    >>> work = Workload("m", 100, 1_000_000, 0, 0.0, 0.010, 0.0, 0.0)
    >>> t = TransportFigures("zmq", Link(1e-4, 1e9), Link(1e-4, 1e9))
    >>> p = predict(Setup("between_graph", "async", "zmq", workers=2, ps=1), work, t, Host(8))
    >>> seconds, guessed = time_to_target_s(p, c)
    >>> round(seconds / (1500 / p.samples_per_s), 6), guessed
    (1.0, False)
    """
    if convergence is None or p.samples_per_s <= 0:
        return None, False
    rows, extrapolated = convergence.rows_for(p.setup)
    if rows is None:
        return None, False
    return rows / p.samples_per_s, extrapolated


@dataclass(frozen=True)
class Setup:
    """One way to run the job: strategy (and mode), transport, workers, ps tasks; ``colocated``: every
    task on one host, sharing its cores (``False``: one task per host)."""

    strategy: str
    mode: str | None
    transport: str
    workers: int
    ps: int = 0
    colocated: bool = True

    @property
    def label(self) -> str:
        name = f"{self.strategy}:{self.mode}" if self.mode else self.strategy
        return name

    @property
    def tasks(self) -> int:
        """Processes the job runs (the parameter_server coordinator is one more)."""
        return self.workers + self.ps + (self.strategy == "parameter_server")


@dataclass(frozen=True)
class Prediction:
    """``step_s``: one global step (a batch per worker, the batch's drawing included); ``parts``:
    where that time goes (seconds of the step); ``limit``: the part that bounds it."""

    setup: Setup
    step_s: float
    samples_per_s: float
    parts: dict
    limit: str
    note: str | None = None

    def as_dict(self) -> dict:
        record = {"strategy": self.setup.strategy, "mode": self.setup.mode, "label": self.setup.label,
                  "transport": self.setup.transport, "workers": self.setup.workers, "ps": self.setup.ps,
                  "tasks": self.setup.tasks, "colocated": self.setup.colocated, "step_ms": self.step_s * 1e3,
                  "samples_per_s": self.samples_per_s, "limit": self.limit,
                  "parts_ms": {k: v * 1e3 for k, v in self.parts.items()}}
        if self.note:
            record["note"] = self.note
        return record


# -- building blocks --------------------------------------------------------------------------------

def even_shards(nbytes: int, ps: int) -> tuple:
    """``nbytes`` split as evenly as whole bytes allow over ``ps`` tasks.

    >>> even_shards(10, 3)
    (4, 3, 3)
    """
    if ps < 1:
        raise ValueError(f"ps must be at least 1, got {ps}")
    base, extra = divmod(int(nbytes), ps)
    return tuple(base + (i < extra) for i in range(ps))


def ring_allreduce_s(nbytes: float, n: int, link: Link, idle_s: float | None = None) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` tasks: ``2(n-1)/n * bytes / bw + 2(n-1) * alpha``;
    on a shaped link, less one bucket's credit (every task sends and receives at once, each
    direction of each link once; the bucket refills for ``idle_s`` between all-reduces, while the
    replicas compute: :meth:`Link.bytes_s`).

    >>> ring_allreduce_s(1e6, 4, Link(10e-6, 1e9))   # 1.5 ms of bytes + 6 latencies
    0.00156
    >>> ring_allreduce_s(1e6, 1, Link(10e-6, 1e9))   # alone: nothing to reduce
    0.0
    """
    if n < 2:
        return 0.0
    return link.bytes_s(2 * (n - 1) / n * nbytes, idle_s) + 2 * (n - 1) * link.latency_s


def fan_in_s(shard_bytes: float, workers: int, link: Link, idle_s: float | None = None) -> float:
    """One synchronous exchange with a shard of ``shard_bytes``: every worker pushes its gradient and
    gets the values back over the shard's link, one after another: ``2 * alpha + w * 2B / bw``.

    **Reply turns.** Where ``link.turns`` (``m``) replies of at least
    :data:`~stratagem.ps_service.turns.TURN_BYTES` cross the link, the ps sends them one after another
    (:mod:`stratagem.ps_service.turns`): the first requester has its values after ``x / m`` of the
    replies' time ``x`` and computes and pushes while the others still receive (the link carries both
    directions at once), each next push following the one before, so a round takes ``x / m`` and
    then the pushes' ``x``, not ``2x``: ``2 * alpha + x + x / m``. (Four workers on four hosts, the ps
    beside one: ``m = 3``, ``x = 3T`` for ``T`` one reply's time on the wire: ``4T`` instead of
    ``6T``.) The workers' compute, between their reply and their push, is the step's own part.

    On a shaped link the pushes come in while the way out idles, then the replies go out while the
    way in idles: each direction starts on the token bucket once a round (two credits,
    :meth:`Link.bytes_s`), refilled while the other direction worked and for ``idle_s`` more (the
    workers' compute; None: full). Each direction's time ``x`` is then a fixed point: the bucket
    refills at the link's rate for ``idle_s + x``, so ``x = plain - k (idle_s + x)`` with ``k`` the
    credit per byte refilled, until the bucket is full: a round of messages smaller than the bucket
    takes one direction's wire time, not two.

    >>> fan_in_s(1e6, 4, Link(10e-6, 1e9))
    0.00802
    >>> link = Link(0.0, 1e5, credit_s=1.0, burst_bytes=1e5)     # a bucket deeper than the messages
    >>> round(fan_in_s(2e3, 2, link, idle_s=0.0), 6)              # 40 ms of bytes each way, at once: 20 + 20
    0.04
    >>> fan_in_s(1e6, 4, Link(10e-6, 1e9, turns=4))               # 4 replies in turn: 4 + 1 ms of bytes
    0.00502
    """
    if workers < 1:
        return 0.0
    nbytes = workers * shard_bytes                  # the pushes in, then as many bytes of replies out
    x = link.bytes_s(nbytes)                        # with the whole bucket
    if idle_s is not None and link.credit_s > 0 and link.burst_bytes > 0:
        k = link.credit_s * link.bandwidth_Bps / link.burst_bytes
        x = max(x, (nbytes / link.bandwidth_Bps - k * idle_s) / (1 + k))
    replies = x / link.turns if link.turns > 1 and shard_bytes >= TURN_BYTES else x
    return 2 * link.latency_s + x + replies


def round_trip_s(nbytes: float, link: Link) -> float:
    """``nbytes`` there and ``nbytes`` back: ``2 * (alpha + bytes / bw)``."""
    return 2 * link.time(nbytes)


def staleness_note(setup: Setup) -> str | None:
    """What an asynchronous setup costs in convergence (None for synchronous ones).

    >>> staleness_note(Setup("between_graph", "async", "zmq", workers=4, ps=1))
    'async: each gradient is applied about 3 updates after the values it was computed from were read (stale gradients: the loss may need more steps)'
    """
    if setup.mode != "async":
        return None
    if setup.workers < 2:
        return "async with one worker: no staleness"
    stale = setup.workers - 1
    return (f"async: each gradient is applied about {stale} update{'s' * (stale != 1)} after the values it was "
            f"computed from were read (stale gradients: the loss may need more steps)")


# -- the strategies ---------------------------------------------------------------------------------

def predict(setup: Setup, work: Workload, transport: TransportFigures, host: Host) -> Prediction:
    """Predicted step time and samples/s of ``setup`` (see the module doc for the formulas).

    >>> host, work = Host(cores=8), Workload("m", 100, 1_000_000, 0, 0.0, 0.010, 0.0, 0.0)
    >>> t = TransportFigures("zmq", allreduce=Link(0.0, 1e9), p2p=Link(0.0, 1e9))
    >>> p = predict(Setup("between_graph", "sync", "zmq", workers=4, ps=1), work, t, host)
    >>> round(p.step_s * 1e3, 3), p.limit    # 10 ms compute + 4 workers x 2 MB over the ps's link
    (18.0, 'compute')
    """
    if setup.workers < 1:
        raise ValueError(f"workers must be at least 1, got {setup.workers}")
    if setup.strategy not in STRATEGIES:
        raise ValueError(f"the cost model knows {', '.join(STRATEGIES)}, not {setup.strategy!r}")
    if setup.strategy in PS_STRATEGIES:
        if setup.ps < 1:
            raise ValueError(f"{setup.strategy} needs at least one ps task")
        if setup.mode not in MODES:
            raise ValueError(f"{setup.strategy} runs sync or async here, not {setup.mode!r}")
    if setup.colocated:
        def share(busy):
            return host.slowdown(busy, transport.one_group)
        straggle = host.straggle
    else:   # one task per host: nothing shared, and no straggler figure measured across hosts
        share = straggle = (lambda busy: 1.0)
    if setup.strategy == "mirrored":
        parts = _mirrored(setup, work, transport, share, straggle)
    elif setup.strategy == "in_graph":
        parts = _in_graph(setup, work, transport, share, straggle)
    elif setup.mode == "sync":
        parts = _ps_sync(setup, work, transport, share, straggle)
    else:
        parts, step = _ps_async(setup, work, transport, share)
        return _finish(setup, work, parts, step)
    return _finish(setup, work, parts, sum(parts.values()))


def _finish(setup: Setup, work: Workload, parts: dict, step: float) -> Prediction:
    parts = {k: v for k, v in parts.items() if v > 0}
    limit = max(parts, key=parts.get) if parts else "compute"
    return Prediction(setup, step, setup.workers * work.batch_size / step, parts, limit,
                      staleness_note(setup))


def phase(wall: float, critical_cpu: float, total_cpu: float, share) -> float:
    """A phase of ``wall`` seconds on idle cores, of which the task on the critical path computes or
    copies ``critical_cpu`` and all tasks together ``total_cpu``. Only the CPU part slows down when
    tasks share cores: ``wall + critical_cpu * (slowdown - 1)``, at the slowdown of the tasks busy on
    average in it (``slowdown * total_cpu / duration``: a fixed point, found by iteration).

    >>> round(phase(0.010, 0.010, 0.040, lambda busy: max(1.0, busy / 2)), 6)   # 4 tasks computing on 2 cores
    0.02
    >>> round(phase(0.010, 0.001, 0.002, lambda busy: max(1.0, busy / 2)), 6)   # mostly waiting: not slower
    0.01
    """
    critical = min(critical_cpu, wall)
    slow = 1.0
    for _ in range(100):
        duration = wall + critical * (slow - 1)
        new = share(slow * total_cpu / duration) if duration > 0 else 1.0
        if abs(new - slow) < 1e-9:
            break
        slow = (slow + new) / 2
    return wall + critical * (slow - 1)


def _cpu(link: Link | None, nbytes: float, wall: float) -> float:
    """CPU seconds of a transfer: the measured cost, else its whole wall time."""
    return link.time(nbytes) if link is not None else wall


def _mirrored(setup: Setup, work: Workload, t: TransportFigures, share, straggle) -> dict:
    n, S = setup.workers, work.param_bytes
    slow = share(n)
    pack = S * work.add_s_per_byte if n > 1 else 0.0
    parts = {"compute": slow * (work.data_s + straggle(n) * work.compute_s),
             "update": slow * (pack + S * work.update_s_per_byte)}
    if n > 1:
        wall = ring_allreduce_s(S, n, t.allreduce, idle_s=parts["compute"] + parts["update"])   # the links idle meanwhile
        cpu = ring_allreduce_s(S, n, t.cpu.allreduce) if t.cpu.allreduce is not None else wall
        parts["all-reduce"] = phase(wall, cpu, n * cpu, share)
    return parts


def _in_graph_link(n: int, work: Workload, t: TransportFigures) -> tuple[float, float]:
    """The in_graph client's link with ``n`` replicas: idle-core wall and the client's CPU seconds."""
    S, rows, remote = work.param_bytes, work.input_bytes, n - 1
    if remote < 1:
        return 0.0, 0.0
    wall = (t.p2p.latency_s + remote * (S + rows) / t.p2p.bandwidth_Bps
            + t.p2p.latency_s + remote * S / t.p2p.bandwidth_Bps)
    # the client sends each worker its rows and the values, and gets its gradients back: a round
    # trip's CPU on the client per worker (the worker spends as much on its side)
    return wall, remote * _cpu(t.cpu.p2p, S + rows / 2, wall / remote)


def _in_graph_update(n: int, work: Workload) -> float:
    """The in_graph client's merge of ``n`` gradients and its update, idle-core seconds."""
    S = work.param_bytes
    return n * S * work.add_s_per_byte + S * work.update_s_per_byte


def _in_graph(setup: Setup, work: Workload, t: TransportFigures, share, straggle) -> dict:
    n = setup.workers
    remote = n - 1
    parts = {"compute": share(1) * n * work.data_s + share(n) * straggle(n) * work.compute_s,
             "update": share(1) * _in_graph_update(n, work)}
    if remote:
        wall, client = _in_graph_link(n, work, t)
        parts["client link"] = phase(wall, client, 2 * client, share)
        own = t.steps.in_graph      # the client's work per remote replica beyond its link and update
        if own is not None and own.wall_s > 0:
            parts["client steps"] = phase(remote * own.wall_s, remote * own.cpu_s, remote * own.cpu_s, share)
    return parts


def _ps_exchange(work: Workload, t: TransportFigures, ps: int, workers: int) -> tuple[float, float]:
    """The model's exchange with the ps tasks, from the links alone (idle-core): the wall seconds of
    a sync round of ``workers`` on the busiest shard (one worker: its push and pull), and a worker's
    CPU seconds for it."""
    biggest = max(work.shard_bytes(ps))
    link = t.exchange
    wall = fan_in_s(biggest, workers, link)
    if t.ps is None:    # (the p2p link has no update in it)
        wall += biggest * work.update_s_per_byte
    return wall, _cpu(t.cpu.exchange, work.param_bytes, round_trip_s(biggest, link))


def _sync_steps(setup: Setup, t: TransportFigures) -> tuple[float, float]:
    """A sync round's own work beyond the exchange, with ``setup.workers`` workers: the measured
    worker alone (``ps_async``), plus what each further worker added to a measured round
    (``ps_sync``, linear in the workers); a worker under the coordinator adds its own step's extra
    (it pulls before its step instead of with its push)."""
    n, steps = setup.workers, t.steps
    alone, round_ = steps.ps_async, steps.ps_sync
    if alone is not None and round_ is not None and round_.workers > 1:
        per = (n - 1) / (round_.workers - 1)
        wall = alone.wall_s + per * max(0.0, round_.wall_s - alone.wall_s)
        cpu = alone.cpu_s + per * max(0.0, round_.cpu_s - alone.cpu_s)
    elif alone is not None or round_ is not None:
        wall, cpu = (alone.wall_s, alone.cpu_s) if alone is not None else (round_.wall_s, round_.cpu_s)
    else:
        wall = cpu = 0.0
    if setup.strategy == "parameter_server" and steps.coordinator is not None and alone is not None:
        wall += max(0.0, steps.coordinator.wall_s - alone.wall_s)
        cpu += max(0.0, steps.coordinator.cpu_s - alone.cpu_s)
    return wall, cpu


def _grown(alone: StepCost | None, crowded: StepCost | None, n: int, part: str = "") -> tuple[float, float]:
    """A measured figure (``part``: "" for the step's own, "dispatch" for the dispatch) with ``n``
    workers: as measured alone, plus per further worker what the crowded measurement added (linear
    in the workers, never less than alone); the one measured when the other was not."""
    def pick(m: StepCost) -> tuple[float, float]:
        return (m.dispatch_s, m.dispatch_cpu_s) if part == "dispatch" else (m.wall_s, m.cpu_s)
    if alone is None and crowded is None:
        return 0.0, 0.0
    if alone is None or crowded is None or crowded.workers <= alone.workers:
        return pick(alone if alone is not None else crowded)
    (wall1, cpu1), (wall2, cpu2) = pick(alone), pick(crowded)
    per = max(0, n - alone.workers) / (crowded.workers - alone.workers)
    return wall1 + per * max(0.0, wall2 - wall1), cpu1 + per * max(0.0, cpu2 - cpu1)


def _serve_extra(setup: Setup, t: TransportFigures) -> float:
    """The ps's CPU per step beyond a bare push (as :func:`step_residuals` leaves it), measured in
    the steps job closest to ``setup``: a sync round; async workers at once, else alone; under a
    coordinator, the crowded one, else alone."""
    steps = t.steps
    if setup.mode == "sync":
        order = (steps.ps_sync, steps.ps_async_crowded, steps.ps_async)
    elif setup.strategy == "parameter_server":
        order = (steps.coordinator_crowded, steps.coordinator, steps.ps_async_crowded, steps.ps_async)
    else:
        order = (steps.ps_async_crowded, steps.ps_async)
    return next((m.serve_cpu_s for m in order if m is not None), 0.0)


def _dispatch(t: TransportFigures, n: int) -> tuple[float, float]:
    """The coordinator's dispatch of one closure with ``n`` workers: wall and CPU seconds, measured
    if it was, else a closure out and its result back on the p2p link."""
    if t.steps.coordinator is not None or t.steps.coordinator_crowded is not None:
        return _grown(t.steps.coordinator, t.steps.coordinator_crowded, n, "dispatch")
    wall = 2 * t.p2p.latency_s
    return wall, 2 * _cpu(t.cpu.p2p, 0, wall)


def _ps_sync(setup: Setup, work: Workload, t: TransportFigures, share, straggle) -> dict:
    n, p, S = setup.workers, setup.ps, work.param_bytes
    shards = work.shard_bytes(p)
    biggest = max(shards)
    coordinator = setup.strategy == "parameter_server"
    link = t.exchange
    compute = share(n) * (work.data_s + straggle(n) * work.compute_s)
    wall = fan_in_s(biggest, n, link, idle_s=compute)
    serve = _cpu(t.cpu.serve, biggest, round_trip_s(biggest, link))          # the busiest shard, per push
    serve_all = sum(_cpu(t.cpu.serve, b, round_trip_s(b, link)) for b in shards)
    worker = _cpu(t.cpu.exchange, S, round_trip_s(biggest, link))           # a worker, all its shards
    extra = _serve_extra(setup, t)     # the ps's CPU per step beyond a bare push, on every shard
    serve, serve_all = serve + extra, serve_all + p * extra
    parts = {"compute": compute,
             "ps fan-in": phase(wall, n * serve + worker, n * (serve_all + worker), share)}
    if t.ps is None:   # the p2p link moves the bytes; the shard's adds and update come on top
        parts["ps update"] = share(p) * biggest * (n * work.add_s_per_byte + work.update_s_per_byte)
    own_wall, own_cpu = _sync_steps(setup, t)
    if own_wall > 0:
        parts["ps steps"] = phase(own_wall, own_cpu, n * own_cpu, share)
    if coordinator:
        dispatch, dispatch_cpu = _dispatch(t, n)
        parts["dispatch"] = phase(dispatch, dispatch_cpu, n * dispatch_cpu, share)
    return parts


def _ps_async(setup: Setup, work: Workload, t: TransportFigures, share) -> tuple[dict, float]:
    n, p, S = setup.workers, setup.ps, work.param_bytes
    shards = work.shard_bytes(p)
    biggest = max(shards)
    coordinator = setup.strategy == "parameter_server"
    link = t.exchange
    local = work.data_s + work.compute_s
    extra = biggest * work.update_s_per_byte if t.ps is None else 0.0   # (the p2p link has no update in it)
    exchange = 2 * link.latency_s + 2 * biggest / link.bandwidth_Bps + extra   # a push and the values back
    serve = _cpu(t.cpu.serve, biggest, exchange - 2 * link.latency_s)         # the busiest shard's CPU per push
    serve_all = sum(_cpu(t.cpu.serve, b, 2 * b / link.bandwidth_Bps + extra) for b in shards)
    own_serve = _serve_extra(setup, t)   # the ps's CPU per step beyond a bare push, on every shard
    serve, serve_all = serve + own_serve, serve_all + p * own_serve
    worker = _cpu(t.cpu.exchange, S, exchange)
    # the worker's step beyond the exchange, as measured with n workers (under the coordinator: there)
    steps = t.steps
    if coordinator and (steps.coordinator is not None or steps.coordinator_crowded is not None):
        own_wall, own_cpu = _grown(steps.coordinator, steps.coordinator_crowded, n)
    else:
        own_wall, own_cpu = _grown(steps.ps_async, steps.ps_async_crowded, n)
    exchange += own_wall
    worker += own_cpu
    dispatch, dispatch_cpu = _dispatch(t, n) if coordinator else (0.0, 0.0)   # the closure and its result
    # The tasks overlap freely: the cores are shared by the tasks busy on average, which depends on
    # the pace (a fixed point): each worker's loop, or the busiest shard's queue when it is longer.
    work_cpu = n * (local + worker + serve_all + dispatch_cpu)   # CPU seconds per global step
    slow = 1.0
    for _ in range(100):
        exchanged = exchange + min(serve + worker, exchange) * (slow - 1)
        dispatched = dispatch + min(dispatch_cpu, dispatch) * (slow - 1)
        loop = local * slow + exchanged + dispatched
        pace = max(loop, n * serve * slow)
        new = share(slow * work_cpu / pace)
        if abs(new - slow) < 1e-9:
            break
        slow = (slow + new) / 2
    if n * serve * slow > loop:
        parts = {"compute": slow * local, "ps queue": pace - slow * local}
    else:
        parts = {"compute": slow * local, "ps exchange": exchanged}
        if dispatch:
            parts["dispatch"] = dispatched
    return parts, pace


def step_residuals(measured: StepCosts, work: Workload, t: TransportFigures, ps: int = 1) -> StepCosts:
    """The steps probe's figures (``measured``: each step's time less its compute, as measured over
    ``t``'s transport with ``ps`` ps tasks) less what the model already charges for them from ``t``'s
    links (the exchange, the in_graph client's link and update): what is left is the strategies' own
    work, which the predictions add (none below zero). The in_graph figure becomes per remote replica.

    >>> t = TransportFigures("zmq", Link(1e-4, 1e9), Link(1e-4, 1e9), ps=Link(1e-4, 1e9))
    >>> work = Workload("m", 100, 1_000_000, 0, 0.0, 0.01, 0.0, 0.0)
    >>> r = step_residuals(StepCosts(ps_async=StepCost(1, 0.0030, 0.0030)), work, t)
    >>> round(r.ps_async.wall_s * 1e3, 3)     # 3 ms measured, 2.2 ms of it the exchange (2 alpha + 2 MB / bw)
    0.8
    """
    biggest = max(work.shard_bytes(ps))
    bare_serve = _cpu(t.cpu.serve, biggest, round_trip_s(biggest, t.exchange))   # a bare push on the ps

    def less(m: StepCost | None, wall: float, cpu: float, per: int = 1) -> StepCost | None:
        if m is None:
            return None
        own_wall = max(0.0, m.wall_s - wall) / per
        own_cpu = min(max(0.0, m.cpu_s - cpu) / per, own_wall)
        serve = max(0.0, m.serve_cpu_s - bare_serve) if m.serve_cpu_s > 0 else 0.0
        return replace(m, wall_s=own_wall, cpu_s=own_cpu, serve_cpu_s=serve)

    def exchange(m: StepCost | None) -> tuple[float, float]:   # a sync round's fan-in
        return _ps_exchange(work, t, ps, m.workers) if m is not None else (0.0, 0.0)

    in_graph = measured.in_graph
    if in_graph is not None and in_graph.workers > 1:
        wall, cpu = _in_graph_link(in_graph.workers, work, t)
        update = _in_graph_update(in_graph.workers, work)
        in_graph = less(in_graph, wall + update, cpu + update, in_graph.workers - 1)
    else:
        in_graph = None
    def alone(m: StepCost | None) -> tuple[float, float]:   # an async worker's exchange: its own round trip
        return _ps_exchange(work, t, ps, 1) if m is not None else (0.0, 0.0)

    return StepCosts(ps_sync=less(measured.ps_sync, *exchange(measured.ps_sync)),
                     ps_async=less(measured.ps_async, *alone(measured.ps_async)),
                     coordinator=less(measured.coordinator, *alone(measured.coordinator)),
                     in_graph=in_graph,
                     ps_async_crowded=less(measured.ps_async_crowded, *alone(measured.ps_async_crowded)),
                     coordinator_crowded=less(measured.coordinator_crowded, *alone(measured.coordinator_crowded)))


# -- the choice -------------------------------------------------------------------------------------

def predict_all(setups: Iterable[Setup], work: Workload, transports: Mapping[str, TransportFigures],
                host: Host) -> list[Prediction]:
    """Every setup whose transport was measured, fastest first."""
    predictions = [predict(s, work, transports[s.transport], host) for s in setups if s.transport in transports]
    return sorted(predictions, key=lambda p: -p.samples_per_s)


def setups_for(workers: int, transports: Sequence[str], ps_counts: Sequence[int], *,
               strategies: Sequence[str] = ("mirrored", "in_graph", "between_graph:sync",
                                            "between_graph:async", "parameter_server:sync",
                                            "parameter_server:async"),
               colocated: bool = True) -> list[Setup]:
    """Every strategy x transport x ps count (ps counts only for the strategies on ps tasks).

    >>> [s.label + f"/{s.ps}" for s in setups_for(2, ["zmq"], [1, 2], strategies=["mirrored", "between_graph:sync"])]
    ['mirrored/0', 'between_graph:sync/1', 'between_graph:sync/2']
    """
    setups = []
    for choice in strategies:
        name, _, mode = choice.partition(":")
        for transport in transports:
            if name in PS_STRATEGIES:
                for ps in ps_counts:
                    setups.append(Setup(name, mode or "sync", transport, workers, ps, colocated))
            else:
                setups.append(Setup(name, None, transport, workers, 0, colocated))
    return setups


def where(p: Prediction) -> str:
    """``between_graph:sync over zmq with 2 ps``."""
    s = p.setup
    return f"{s.label} over {s.transport}" + (f" with {s.ps} ps" if s.ps else "")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2g} us"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2g} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.2g} KB"


def rate(samples_per_s: float) -> str:
    """Three significant figures with thousands separators.

    >>> rate(15264.2), rate(987.65), rate(3.21)
    ('15,300', '988', '3.21')
    """
    if samples_per_s <= 0:
        return "0"
    exponent = int(math.floor(math.log10(samples_per_s)))
    if exponent >= 2:
        return f"{round(samples_per_s, 2 - exponent):,.0f}"
    return f"{samples_per_s:.{2 - exponent}f}"


def communication_s(p: Prediction) -> float:
    """Seconds of the step spent moving gradients and values (everything but compute and update)."""
    return sum(v for k, v in p.parts.items() if k not in ("compute", "update"))


def communication(p: Prediction, work: Workload) -> str:
    """What the setup moves each step, in words."""
    s = p.setup
    if s.strategy == "mirrored":
        return f"all-reduce of {_mb(work.param_bytes)}" if s.workers > 1 else "no communication"
    if s.strategy == "in_graph":
        return (f"the client's exchange of {_mb(work.param_bytes)} with each worker task" if s.workers > 1
                else "no communication")
    biggest = max(work.shard_bytes(s.ps))
    if s.mode == "async":
        return f"a ps round trip of {_mb(biggest)} each way"
    return f"ps fan-in of {_mb(biggest)} per worker"


def recommend(predictions: Sequence[Prediction], work: Workload,
              convergence: Convergence | None = None) -> tuple[Prediction, str]:
    """The fastest prediction and the reason, in a sentence: its communication against that of the best
    setup of the other family (all-reduce against parameter servers), and what an async choice costs.

    With ``convergence`` (rows to the target loss, measured), *fastest* means first to the target:
    throughput bought with staleness or a larger global batch is paid for in data, and a setup that
    does not reach the target at all is ranked last, whatever its samples/s.

    >>> work = Workload("m", 100, 2_000_000, 0, 0.0, 0.010, 0.0, 0.0, {1: (2_000_000,)})
    >>> t = {"zmq": TransportFigures("zmq", allreduce=Link(1e-4, 1e9), p2p=Link(1e-4, 1e9))}
    >>> setups = setups_for(4, ["zmq"], [1], strategies=["mirrored", "between_graph:sync"])
    >>> best, why = recommend(predict_all(setups, work, t, Host(8)), work)
    >>> why
    'mirrored over zmq: all-reduce of 2 MB costs 3.6 ms vs 16 ms of ps fan-in of 2 MB per worker (between_graph:sync over zmq with 1 ps, 15,300 samples/s); 4 workers x 100 rows at 14 ms a step: 29,400 samples/s'
    """
    if not predictions:
        raise ValueError("nothing to recommend: no setup could be predicted")
    ranked = sorted(predictions, key=lambda p: -p.samples_per_s)
    to_target = {id(p): time_to_target_s(p, convergence) for p in ranked}   # (seconds or None, extrapolated)
    if any(seconds is not None for seconds, _ in to_target.values()):
        # Stable: setups as fast to the target stay in samples/s order; those that never reach it last.
        ranked.sort(key=lambda p: (to_target[id(p)][0] is None, to_target[id(p)][0] or 0.0))
    best = ranked[0]
    on_ps = best.setup.strategy in PS_STRATEGIES
    rival = next((p for p in ranked[1:] if (p.setup.strategy in PS_STRATEGIES) != on_ps), None)
    if rival is None and len(ranked) > 1:
        rival = ranked[1]
    text = f"{where(best)}: {communication(best, work)}"
    if communication_s(best) > 0:
        text += f" costs {_ms(communication_s(best))}"
    if rival is not None:
        text += (f" vs {_ms(communication_s(rival))} of {communication(rival, work)} "
                 f"({where(rival)}, {rate(rival.samples_per_s)} samples/s)")
    n = best.setup.workers
    text += (f"; {n} worker{'s' * (n != 1)} x {work.batch_size} rows at {_ms(best.step_s)} a step: "
             f"{rate(best.samples_per_s)} samples/s")
    if best.note and n > 1:
        text += f"; {best.note}"
        sync = next((p for p in ranked if p.setup.mode != "async"), None)
        if sync is not None:
            text += f"; the fastest synchronous choice is {where(sync)} ({rate(sync.samples_per_s)} samples/s)"
    if convergence is not None:
        seconds, guessed = to_target[id(best)]
        if seconds is not None:
            text += (f"; loss {convergence.target_loss:.3g} in {'about ' if guessed else ''}{_seconds(seconds)} "
                     f"(rows to it measured{', then extrapolated' if guessed else ''})")
        fast = max(predictions, key=lambda p: p.samples_per_s)
        if fast is not best and to_target[id(fast)][0] is None:
            cause = "its staleness" if fast.setup.mode == "async" else "its global batch"
            text += (f"; {where(fast)} moves more samples/s ({rate(fast.samples_per_s)}) but did not reach that "
                     f"loss in the convergence probe ({cause}: the run diverged or stalled at this learning rate)")
        elif fast is not best:
            text += (f"; {where(fast)} moves more samples/s ({rate(fast.samples_per_s)}) but needs more rows: "
                     f"{_seconds(to_target[id(fast)][0])} to that loss")
    return best, text


def _seconds(seconds: float) -> str:
    return f"{seconds:.2g} s" if seconds >= 0.1 else _ms(seconds)


# -- fitting the figures to measurements (pure: the probe hands in the numbers) -----------------------

def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y = a + b x`` by least squares weighted by ``1 / y**2`` (relative
    errors: a small message's time counts as much as a large one's), both kept positive.

    >>> a, b = fit_line([(0, 1.0), (10, 2.0), (20, 3.0)])
    >>> round(a, 6), round(b, 6)
    (1.0, 0.1)
    """
    pts = [(float(x), float(y)) for x, y in points if y > 0]
    if not pts:
        raise ValueError("no points to fit")
    if len({x for x, _ in pts}) < 2:
        x, y = pts[0]
        return (y, 0.0) if x == 0 else (0.0, y / x)
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    smallest = min(y for _, y in pts)
    if b <= 0:   # flat or noisy: all latency; the largest message still bounds the bandwidth
        x_max, y_max = max(pts)
        return smallest, max(1e-15, (y_max - smallest) / x_max) if x_max > 0 else 1e-15
    if a <= 0:   # all bandwidth: keep a floor of a tenth of the smallest time
        a = smallest * 0.1
    return a, b


def fit_allreduce(points: Sequence[tuple[float, float]], n: int) -> Link:
    """The ring's alpha and bandwidth from all-reduce times ``(bytes, seconds)`` over ``n`` tasks:
    ``T = 2(n-1) alpha + 2(n-1)/n bytes / bw``.

    >>> link = fit_allreduce([(0, 2e-4), (1e6, 2.2e-3)], 2)
    >>> round(link.latency_s * 1e6), round(link.bandwidth_Bps / 1e6)
    (100, 500)
    """
    if n < 2:
        raise ValueError("an all-reduce needs at least two tasks to measure a link")
    a, b = fit_line(points)
    return Link(a / (2 * (n - 1)), 2 * (n - 1) / n / b)


def fit_round_trip(points: Sequence[tuple[float, float]]) -> Link:
    """The one-way link from round trips ``(bytes each way, seconds)``: ``T = 2 alpha + 2 bytes / bw``.

    >>> link = fit_round_trip([(0, 1e-4), (1e6, 4.1e-3)])
    >>> round(link.latency_s * 1e6), round(link.bandwidth_Bps / 1e6)
    (50, 500)
    """
    a, b = fit_line(points)
    return Link(a / 2, 2 / b)


def fair_share(k: float, cores: float, background: float) -> float:
    """Slowdown of ``k`` busy tasks against one task on an idle core (see :class:`Host`)."""
    return Host(cores, background).slowdown(k)


def fit_host(cores: float, samples: Sequence[tuple[int, float]], *, idle_s: float | None = None,
             max_background: float = 64.0) -> tuple[Host, float]:
    """The background load (and, unless ``idle_s`` is given, the idle-core time) that best explain
    ``samples`` of ``(k busy tasks, seconds per call)``: ``seconds = idle * max(1, (k + background) /
    cores)``, fitted in log space (relative errors). Returns ``(Host, idle seconds)``.

    With both unknown, a machine busy at every ``k`` measured cannot tell a slow core from a crowded
    one; the probe therefore passes ``idle_s``: the fastest of many calls on one task, which ran
    with a core to itself.

    >>> host, idle = fit_host(2, [(1, 0.010), (2, 0.010), (4, 0.020)])
    >>> host.background, round(idle, 4)
    (0.0, 0.01)
    >>> host, idle = fit_host(2, [(1, 0.020), (2, 0.025), (4, 0.035)], idle_s=0.010)  # 3 busy processes of others
    >>> host.background, round(idle, 4)
    (3.0, 0.01)
    """
    pts = [(k, t) for k, t in samples if t > 0 and k >= 1]
    if not pts:
        raise ValueError("no CPU-sharing samples to fit")
    best = None
    for i in range(int(max_background * 20) + 1):
        m = i / 20
        logs = [math.log(t) - math.log(fair_share(k, cores, m)) for k, t in pts]
        log_idle = sum(logs) / len(logs) if idle_s is None else math.log(idle_s)
        error = sum((v - log_idle) ** 2 for v in logs)
        if best is None or error < best[0] - 1e-12:
            best = (error, m, math.exp(log_idle))
    _, m, idle = best
    return Host(cores, m), idle


def fit_stragglers(free: Sequence[tuple[int, float]], lockstep: Sequence[tuple[int, float]]) -> tuple:
    """``((k, factor), ...)``: the median lockstep time of ``k`` tasks over their median free-running
    time (at least 1), for every ``k`` measured both ways.

    >>> fit_stragglers([(2, 0.010), (2, 0.012), (4, 0.020)], [(2, 0.013), (4, 0.026), (4, 0.030)])
    ((2, 1.182), (4, 1.4))
    """
    import statistics

    out = []
    for k in sorted({k for k, _ in lockstep} & {k for k, _ in free}):
        ratio = statistics.median(t for j, t in lockstep if j == k) / statistics.median(t for j, t in free if j == k)
        out.append((k, round(max(1.0, ratio), 3)))
    return tuple(out)


def with_link(transport: TransportFigures, latency_s: float | None = None,
              bandwidth_Bps: float | None = None) -> TransportFigures:
    """``transport`` with every link's latency and/or bandwidth replaced: a network you describe
    instead of the one measured here (None keeps the measured figure).

    >>> t = with_link(TransportFigures("zmq", Link(1e-4, 1e9), Link(2e-4, 2e9)), bandwidth_Bps=3e9)
    >>> t.allreduce, t.p2p
    (Link(latency_s=0.0001, bandwidth_Bps=3000000000.0, credit_s=0.0, burst_bytes=0.0, turns=0), Link(latency_s=0.0002, bandwidth_Bps=3000000000.0, credit_s=0.0, burst_bytes=0.0, turns=0))
    """
    def swap(link: Link | None) -> Link | None:
        if link is None:
            return None
        return Link(link.latency_s if latency_s is None else latency_s,
                    link.bandwidth_Bps if bandwidth_Bps is None else bandwidth_Bps)
    return replace(transport, allreduce=swap(transport.allreduce), p2p=swap(transport.p2p), ps=swap(transport.ps))


def figures_as_dict(obj) -> dict:
    """A dataclass of figures as plain JSON values."""
    return asdict(obj)
