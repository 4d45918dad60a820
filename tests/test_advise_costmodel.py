"""The cost model of ``stratagem advise`` (stratagem.advise.costmodel) on hand-computed cases.

The figures below are chosen so every step can be checked with a pencil (see each test's comment):
S = 1 MB of parameters, 1 ms to draw a batch, 10 ms of compute, 1 ms per MB for the ps's update and
for a gradient add; all-reduce link 100 us + 1 GB/s, p2p 50 us + 2 GB/s, ps exchange 200 us + 1 GB/s.
"""

from __future__ import annotations

import pytest

from stratagem.advise import costmodel as cm

MS = 1e-3
WORK = cm.Workload("hand", batch_size=100, param_bytes=1_000_000, input_bytes=100_000, data_s=1 * MS,
                   compute_s=10 * MS, update_s_per_byte=1e-9, add_s_per_byte=1e-9,
                   shards={1: (1_000_000,), 2: (600_000, 400_000)})
ZMQ = cm.TransportFigures("zmq", allreduce=cm.Link(100e-6, 1e9), p2p=cm.Link(50e-6, 2e9), ps=cm.Link(200e-6, 1e9))
IDLE = cm.Host(cores=16)   # more cores than tasks: nothing shared


def predict(strategy, mode, workers, ps=0, host=IDLE, transport=ZMQ, colocated=True):
    return cm.predict(cm.Setup(strategy, mode, transport.name, workers, ps, colocated), WORK, transport, host)


def test_ring_allreduce_is_the_alpha_beta_formula():
    # 2(n-1)/n * S / bw + 2(n-1) * alpha = 1.5 ms + 6 x 0.1 ms
    assert cm.ring_allreduce_s(1e6, 4, cm.Link(100e-6, 1e9)) == pytest.approx(2.1 * MS)
    assert cm.ring_allreduce_s(1e6, 2, cm.Link(100e-6, 1e9)) == pytest.approx(1.2 * MS)
    assert cm.ring_allreduce_s(1e6, 1, cm.Link(100e-6, 1e9)) == 0.0


def test_fan_in_shares_the_shards_link_among_the_workers():
    # 2 alpha + w * 2B / bw = 0.4 ms + 4 x 1.2 ms
    assert cm.fan_in_s(600_000, 4, cm.Link(200e-6, 1e9)) == pytest.approx(5.2 * MS)


def test_mirrored_adds_compute_update_and_all_reduce():
    p = predict("mirrored", None, 4)
    # compute 1 + 10; pack 1 + update 1; all-reduce 2.1
    assert p.parts == pytest.approx({"compute": 11 * MS, "update": 2 * MS, "all-reduce": 2.1 * MS})
    assert p.step_s == pytest.approx(15.1 * MS)
    assert p.samples_per_s == pytest.approx(400 / (15.1 * MS))
    assert p.limit == "compute"
    alone = predict("mirrored", None, 1)     # no bucket to pack, nothing to all-reduce
    assert alone.step_s == pytest.approx(12 * MS)


def test_tasks_beyond_the_cores_share_them():
    # 4 tasks on 2 cores: every phase runs twice as slow
    assert predict("mirrored", None, 4, host=cm.Host(cores=2)).step_s == pytest.approx(30.2 * MS)
    # 2 busy processes of others on 2 cores: one task alone runs 1.5x slower, 4 tasks 3x
    busy = cm.Host(cores=2, background=2)
    assert busy.slowdown(1) == 1.5 and busy.slowdown(4) == 3.0
    assert predict("mirrored", None, 4, host=busy).step_s == pytest.approx(3 * 15.1 * MS)


def test_synchronous_compute_waits_for_the_straggler():
    host = cm.Host(cores=16, stragglers=((4, 1.5),))
    # the factor was measured on loss_and_grads: drawing 1 + compute 10 x 1.5 = 16, the rest unchanged: 16 + 2 + 2.1
    assert predict("mirrored", None, 4, host=host).step_s == pytest.approx(20.1 * MS)
    assert host.straggle(2) == pytest.approx(1 + 0.5 / 3)     # interpolated from (1, 1) to (4, 1.5)


def test_one_task_per_host_shares_nothing():
    crowded = cm.Host(cores=2, background=5, stragglers=((4, 2.0),))
    far = predict("mirrored", None, 4, host=crowded, colocated=False)
    assert far.step_s == pytest.approx(15.1 * MS)


def test_in_graph_client_draws_every_batch_and_carries_the_exchange():
    p = predict("in_graph", None, 3)
    # draws 3 x 1 + compute 10 (replicas in parallel); adds 3 x 1 + update 1;
    # out: 50 us + 2 x (1 MB + 0.1 MB) / 2 GB/s = 1.15 ms, back: 50 us + 2 x 1 MB / 2 GB/s = 1.05 ms
    assert p.parts == pytest.approx({"compute": 13 * MS, "update": 4 * MS, "client link": 2.2 * MS})
    assert p.step_s == pytest.approx(19.2 * MS)


def test_sync_parameter_servers_are_paced_by_the_busiest_shard():
    p = predict("between_graph", "sync", 4, ps=2)
    # busiest shard 600 KB: fan-in 0.4 + 4 x 1.2 ms over the ps link (measured on a real ps: its update is in it)
    assert p.parts == pytest.approx({"compute": 11 * MS, "ps fan-in": 5.2 * MS})
    assert p.step_s == pytest.approx(16.2 * MS)
    one = predict("between_graph", "sync", 4, ps=1)
    assert one.parts["ps fan-in"] == pytest.approx(8.4 * MS)        # 0.4 + 4 x 2 ms
    # parameter_server: the coordinator's dispatch (2 p2p latencies) on top
    coordinated = predict("parameter_server", "sync", 4, ps=2)
    assert coordinated.step_s == pytest.approx(16.3 * MS)
    assert coordinated.setup.tasks == 4 + 2 + 1


def test_without_a_ps_measurement_the_p2p_link_and_the_update_are_added():
    plain = cm.TransportFigures("zmq", allreduce=ZMQ.allreduce, p2p=ZMQ.p2p)
    p = predict("between_graph", "sync", 4, ps=2, transport=plain)
    # 2 x 50 us + 4 x 2 x 600 KB / 2 GB/s; the shard adds 4 gradients and updates once: 0.6 x 5 ms
    assert p.parts["ps fan-in"] == pytest.approx(0.1 * MS + 2.4 * MS)
    assert p.parts["ps update"] == pytest.approx(3 * MS)


def test_async_workers_loop_on_their_own_until_the_shard_saturates():
    p = predict("between_graph", "async", 2, ps=1)
    # loop: compute 11 + exchange (0.4 + 2 x 1 MB / 1 GB/s) = 13.4 ms; the shard serves a push in 2 ms,
    # 2 pushes per loop: it keeps up
    assert p.step_s == pytest.approx(13.4 * MS)
    assert p.samples_per_s == pytest.approx(200 / (13.4 * MS))
    assert "stale" in p.note
    crowded = predict("between_graph", "async", 16, ps=1)
    # 16 pushes x 2 ms = 32 ms > 13.4 ms: the shard's queue sets the pace
    assert crowded.step_s == pytest.approx(32 * MS)
    assert crowded.limit == "ps queue"


def test_an_mpi_job_shares_one_scheduling_group():
    grouped = cm.TransportFigures("mpi", allreduce=ZMQ.allreduce, p2p=ZMQ.p2p, ps=ZMQ.ps, one_group=True)
    busy = cm.Host(cores=2, background=6)
    # 4 separate tasks: (4 + 6) / 2 = 5x slower; one group of 4 gets 2 / 7 of a core: 14x
    assert predict("mirrored", None, 4, host=busy).step_s == pytest.approx(5 * 15.1 * MS)
    assert predict("mirrored", None, 4, host=busy, transport=grouped).step_s == pytest.approx(14 * 15.1 * MS)
    # on an idle machine the group has every core: no difference
    assert predict("mirrored", None, 4, host=cm.Host(2), transport=grouped).step_s == pytest.approx(2 * 15.1 * MS)


def test_only_the_cpu_part_of_a_transfer_slows_down_when_cores_are_shared():
    # a 2.1 ms all-reduce of which each of 4 tasks computes 0.5 ms: on 2 cores with 2 busy processes of
    # others, the tasks are busy 4 x 0.5 / 2.1 on average, so it barely slows; all CPU: 3x (4 + 2) / 2
    host = cm.Host(cores=2, background=2)
    light = cm.TransportFigures("zmq", ZMQ.allreduce, ZMQ.p2p, ZMQ.ps, cpu=cm.CpuCosts(allreduce=cm.Link(0.0, 3e9)))
    lean = predict("mirrored", None, 4, host=host, transport=light).parts["all-reduce"]
    heavy = predict("mirrored", None, 4, host=host).parts["all-reduce"]
    cpu = 1.5e6 / 3e9                                   # 2(n-1)/n x 1 MB at 3 GB/s of CPU
    assert heavy == pytest.approx(2.1 * MS * 3)
    slow = (cm.phase(2.1 * MS, cpu, 4 * cpu, host.slowdown) - 2.1 * MS) / cpu + 1
    assert lean == pytest.approx(2.1 * MS + cpu * (slow - 1))
    assert 2.1 * MS < lean < 2.1 * MS + cpu * 2


def test_recommendation_names_the_winner_and_what_it_beats():
    setups = cm.setups_for(4, ["zmq"], [1, 2], strategies=["mirrored", "between_graph:sync"])
    assert [(s.label, s.ps) for s in setups] == [("mirrored", 0), ("between_graph:sync", 1), ("between_graph:sync", 2)]
    best, why = cm.recommend(cm.predict_all(setups, WORK, {"zmq": ZMQ}, IDLE), WORK)
    assert best.setup.strategy == "mirrored"
    assert why.startswith("mirrored over zmq: all-reduce of 1 MB costs 2.1 ms vs 5.2 ms of ps fan-in of 0.6 MB "
                          "per worker (between_graph:sync over zmq with 2 ps, 24,700 samples/s)")
    assert "4 workers x 100 rows at 15 ms a step: 26,500 samples/s" in why


def test_an_async_recommendation_says_what_it_costs():
    slow_ring = cm.TransportFigures("zmq", allreduce=cm.Link(5 * MS, 1e8), p2p=ZMQ.p2p, ps=ZMQ.ps)
    setups = cm.setups_for(2, ["zmq"], [1], strategies=["mirrored", "between_graph:sync", "between_graph:async"])
    best, why = cm.recommend(cm.predict_all(setups, WORK, {"zmq": slow_ring}, IDLE), WORK)
    assert best.setup.label == "between_graph:async"
    assert "applied about 1 update after" in why
    assert "the fastest synchronous choice is" in why


def test_extrapolation_to_many_workers():
    setups = cm.setups_for(1024, ["zmq"], [1, 2], strategies=["mirrored", "between_graph:sync"], colocated=False)
    predictions = {(p.setup.label, p.setup.ps): p for p in cm.predict_all(setups, WORK, {"zmq": ZMQ}, cm.Host(2, 9))}
    ring = predictions[("mirrored", 0)]
    # 2 x 1023/1024 x 1 ms + 2046 x 0.1 ms of all-reduce
    assert ring.parts["all-reduce"] == pytest.approx(2 * 1023 / 1024 * MS + 2046 * 100e-6)
    fan_in = predictions[("between_graph:sync", 2)].parts["ps fan-in"]
    assert fan_in == pytest.approx(0.4 * MS + 1024 * 1.2 * MS)      # one shard's link serves 1024 workers
    best, _ = cm.recommend(list(predictions.values()), WORK)
    assert best.setup.strategy == "mirrored"


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="workers must be at least 1"):
        predict("mirrored", None, 0)
    with pytest.raises(ValueError, match="needs at least one ps task"):
        predict("between_graph", "sync", 2, ps=0)
    with pytest.raises(ValueError, match="knows mirrored"):
        predict("horovod", None, 2)
    with pytest.raises(ValueError, match="nothing to recommend"):
        cm.recommend([], WORK)


def test_shards_fall_back_to_an_even_split():
    assert WORK.shard_bytes(2) == (600_000, 400_000)
    assert WORK.shard_bytes(3) == (333_334, 333_333, 333_333)


# -- fitting ----------------------------------------------------------------------------------------

def test_links_are_fitted_to_the_formulas():
    ring = cm.fit_allreduce([(0, 0.4 * MS), (1e6, 2.4 * MS), (2e6, 4.4 * MS)], 4)
    # T = 6 alpha + 1.5 bytes / bw: intercept 0.4 ms, slope 2 ms per MB
    assert ring.latency_s == pytest.approx(0.4 * MS / 6)
    assert ring.bandwidth_Bps == pytest.approx(1.5 / 2e-9)
    trip = cm.fit_round_trip([(4096, 0.1 * MS + 2 * 4096 / 1e9), (1e6, 0.1 * MS + 2e-3)])
    assert trip.latency_s == pytest.approx(50e-6)
    assert trip.bandwidth_Bps == pytest.approx(1e9)


def test_a_flat_measurement_still_gives_a_positive_bandwidth():
    a, b = cm.fit_line([(0, 1 * MS), (1e6, 0.9 * MS)])
    assert a == pytest.approx(0.9 * MS) and b > 0


def test_the_host_fit_recovers_cores_shared_with_others():
    truth = cm.Host(cores=2, background=3)
    samples = [(k, 0.010 * truth.slowdown(k)) for k in (1, 2, 3, 4, 6)]
    host, idle = cm.fit_host(2, samples)
    assert host.background == pytest.approx(3) and idle == pytest.approx(0.010)
    host, idle = cm.fit_host(2, samples, idle_s=0.010)
    assert host.background == pytest.approx(3) and idle == pytest.approx(0.010)
    quiet, _ = cm.fit_host(2, [(1, 0.010), (2, 0.010), (4, 0.020)])
    assert quiet.background == 0


def test_stragglers_are_lockstep_over_free_running():
    factors = cm.fit_stragglers([(2, 0.010), (3, 0.015), (3, 0.015)], [(2, 0.008), (3, 0.018), (3, 0.021)])
    assert factors == ((2, 1.0), (3, 1.3))    # never below 1


def test_a_described_network_replaces_the_measured_links():
    t = cm.with_link(ZMQ, latency_s=20e-6, bandwidth_Bps=3.125e9)
    assert t.allreduce == t.p2p == t.ps == cm.Link(20e-6, 3.125e9)
    assert cm.with_link(ZMQ).ps == ZMQ.ps


# -- the strategies' own work per step (the steps probe's figures) ------------------------------------

# As measured over ZMQ with 1 ps (each step's time less its compute): a between_graph worker alone
# 3 ms (2.4 ms of it the exchange: 2 x 200 us + 2 x 1 MB / 1 GB/s), a sync round of 2 workers 6 ms
# (fan-in 4.4 ms), a parameter_server worker's step 4 ms and 1.5 ms of dispatch per closure, the
# in_graph client with 2 replicas 5.15 ms (link 0.6 + 0.55 ms, adds 2 ms and update 1 ms).
MEASURED = cm.StepCosts(ps_sync=cm.StepCost(2, 6.0 * MS, 2.0 * MS), ps_async=cm.StepCost(1, 3.0 * MS, 1.0 * MS),
                        coordinator=cm.StepCost(1, 4.0 * MS, 1.0 * MS, dispatch_s=1.5 * MS, dispatch_cpu_s=0.5 * MS),
                        in_graph=cm.StepCost(2, 5.15 * MS, 5.0 * MS))


def with_steps(transport=ZMQ):
    steps = cm.step_residuals(MEASURED, WORK, transport)
    return cm.TransportFigures(transport.name, transport.allreduce, transport.p2p, transport.ps, steps=steps)


def test_the_steps_probe_is_charged_beyond_what_the_links_explain():
    r = cm.step_residuals(MEASURED, WORK, ZMQ)
    assert r.ps_async.wall_s == pytest.approx(0.6 * MS)             # 3 - 2.4
    assert r.ps_sync.wall_s == pytest.approx(1.6 * MS)              # 6 - (0.4 + 2 x 2 MB / 1 GB/s)
    assert r.coordinator.wall_s == pytest.approx(1.6 * MS)          # 4 - 2.4
    assert r.coordinator.dispatch_s == pytest.approx(1.5 * MS)      # measured as it is
    assert r.in_graph.wall_s == pytest.approx(1.0 * MS)             # 5.15 - 1.15 - 3, per remote replica
    # the CPU likewise, never below zero nor above the wall time it is part of: with no CPU figure
    # for the exchange, all its 2.4 ms count as CPU, more than the 1 ms measured
    assert r.ps_async.cpu_s == 0.0
    assert r.in_graph.cpu_s == pytest.approx(0.85 * MS)             # 5 - 1.15 - 3
    capped = cm.step_residuals(cm.StepCosts(ps_sync=cm.StepCost(2, 5.0 * MS, 9.0 * MS)), WORK, ZMQ)
    assert capped.ps_sync.cpu_s == capped.ps_sync.wall_s == pytest.approx(0.6 * MS)
    assert all(0 <= s.cpu_s <= s.wall_s for s in (r.ps_sync, r.ps_async, r.coordinator, r.in_graph))
    # a step measured faster than the links predict charges nothing
    fast = cm.step_residuals(cm.StepCosts(ps_async=cm.StepCost(1, 1.0 * MS, 1.0 * MS)), WORK, ZMQ)
    assert fast.ps_async.wall_s == 0.0 and fast.ps_sync is None


def test_sync_rounds_add_the_measured_work_linear_in_the_workers():
    t = with_steps()
    # alone 0.6 ms; a round of 2 added 1 ms more: with 4 workers 0.6 + 3 x 1 ms
    p = cm.predict(cm.Setup("between_graph", "sync", "zmq", 4, 1), WORK, t, IDLE)
    assert p.parts["ps steps"] == pytest.approx(3.6 * MS)
    assert p.step_s == pytest.approx(predict("between_graph", "sync", 4, ps=1).step_s + 3.6 * MS)
    one = cm.predict(cm.Setup("between_graph", "sync", "zmq", 1, 1), WORK, t, IDLE)
    assert one.parts["ps steps"] == pytest.approx(0.6 * MS)
    # parameter_server: its worker's own extra (1.6 - 0.6 ms) and the measured dispatch, not 2 latencies
    coordinated = cm.predict(cm.Setup("parameter_server", "sync", "zmq", 4, 1), WORK, t, IDLE)
    assert coordinated.parts["ps steps"] == pytest.approx(4.6 * MS)
    assert coordinated.parts["dispatch"] == pytest.approx(1.5 * MS)


def test_async_workers_loop_through_their_measured_step():
    t = with_steps()
    p = cm.predict(cm.Setup("between_graph", "async", "zmq", 2, 1), WORK, t, IDLE)
    # compute 11 + exchange 2.4 + the step's own 0.6 ms
    assert p.step_s == pytest.approx(14.0 * MS)
    coordinated = cm.predict(cm.Setup("parameter_server", "async", "zmq", 2, 1), WORK, t, IDLE)
    # compute 11 + exchange 2.4 + the worker's own 1.6 + dispatch 1.5 ms
    assert coordinated.parts == pytest.approx({"compute": 11 * MS, "ps exchange": 4.0 * MS, "dispatch": 1.5 * MS})


def test_the_in_graph_client_pays_its_measured_work_per_remote_replica():
    t = with_steps()
    p = cm.predict(cm.Setup("in_graph", None, "zmq", 3), WORK, t, IDLE)
    assert p.parts["client steps"] == pytest.approx(2 * 1.0 * MS)
    assert "client steps" not in cm.predict(cm.Setup("in_graph", None, "zmq", 1), WORK, t, IDLE).parts


def test_step_figures_survive_a_saved_measurement():
    from stratagem.advise.probe import transport_from_dict

    t = with_steps()
    assert transport_from_dict(cm.figures_as_dict(t)) == t
    assert transport_from_dict(cm.figures_as_dict(ZMQ)) == ZMQ       # (none measured: none charged)


def test_async_steps_grow_with_the_workers_as_measured_crowded():
    # a second async worker at once made each step 5 ms (2.4 of it the exchange): 2.6 ms, 2 ms more than alone
    crowded = cm.StepCosts(ps_async=MEASURED.ps_async, ps_async_crowded=cm.StepCost(2, 5.0 * MS, 1.0 * MS),
                           coordinator=MEASURED.coordinator,
                           coordinator_crowded=cm.StepCost(2, 4.0 * MS, 1.0 * MS, dispatch_s=2.5 * MS, dispatch_cpu_s=0.5 * MS))
    steps = cm.step_residuals(crowded, WORK, ZMQ)
    t = cm.TransportFigures("zmq", ZMQ.allreduce, ZMQ.p2p, ZMQ.ps, steps=steps)
    assert steps.ps_async_crowded.wall_s == pytest.approx(2.6 * MS)
    step = {n: cm.predict(cm.Setup("between_graph", "async", "zmq", n, 1), WORK, t, IDLE).step_s for n in (1, 2, 4)}
    assert step[1] == pytest.approx(11 * MS + 2.4 * MS + 0.6 * MS)          # alone as measured alone
    assert step[2] == pytest.approx(11 * MS + 2.4 * MS + 2.6 * MS)          # two as measured crowded
    assert step[4] == pytest.approx(11 * MS + 2.4 * MS + 0.6 * MS + 3 * 2 * MS)
    # the coordinator's dispatch likewise: 1.5 ms alone, 2.5 ms with two workers, 4.5 ms with four
    coordinated = cm.predict(cm.Setup("parameter_server", "async", "zmq", 4, 1), WORK, t, IDLE)
    assert coordinated.parts["dispatch"] == pytest.approx(4.5 * MS)


def test_the_ps_pays_its_measured_cpu_per_step_beyond_a_bare_push():
    # the ps measured 3 ms of CPU per step through the strategy, where a bare push of 1 MB costs 1 ms
    # (ps CPU link 0 + 1 GB/s): 2 ms more per push, on every shard
    served = cm.TransportFigures("zmq", ZMQ.allreduce, ZMQ.p2p, ZMQ.ps, cpu=cm.CpuCosts(serve=cm.Link(0.0, 1e9)))
    measured = cm.StepCosts(ps_async=cm.StepCost(1, 2.4 * MS, 0.0, serve_cpu_s=3.0 * MS))
    steps = cm.step_residuals(measured, WORK, served)
    assert steps.ps_async.serve_cpu_s == pytest.approx(2.0 * MS)
    t = cm.TransportFigures("zmq", ZMQ.allreduce, ZMQ.p2p, ZMQ.ps, cpu=served.cpu, steps=steps)
    # 16 async workers on 1 ps: the shard serves each push in 1 + 2 ms of CPU: 16 x 3 ms sets the pace
    crowded = cm.predict(cm.Setup("between_graph", "async", "zmq", 16, 1), WORK, t, IDLE)
    assert crowded.limit == "ps queue" and crowded.step_s == pytest.approx(16 * 3.0 * MS)
    bare = cm.predict(cm.Setup("between_graph", "async", "zmq", 16, 1), WORK, served, IDLE)
    assert bare.step_s == pytest.approx(16 * 1.0 * MS)                     # (a bare push alone: 16 x 1 ms)


# -- convergence: rows to the target loss, and what they make of the recommendation ------------------

CONVERGENCE = cm.Convergence(1.0, sync=((1, 1000), (2, 2000), (4, 4000)), async_=((1, 1000), (2, 1400), (4, None)))


def test_rows_to_the_target_are_interpolated_then_extrapolated_and_a_stall_stays_a_stall():
    assert CONVERGENCE.rows("sync", 3) == (3000.0, False)
    assert CONVERGENCE.rows("sync", 16) == (16000.0, True)            # along the last two points
    assert CONVERGENCE.rows("async", 2) == (1400.0, False)
    assert CONVERGENCE.rows("async", 3) == (None, False)              # on the way to a count that did not converge
    assert CONVERGENCE.rows("async", 64) == (None, False)             # nor beyond it
    flat = cm.Convergence(1.0, sync=((1, 1000), (2, 900)))
    assert flat.rows("sync", 8) == (900.0, True)                       # extrapolation never falls below the last


def test_time_to_target_is_rows_over_samples_per_second():
    p = predict("mirrored", None, 2)
    seconds, guessed = cm.time_to_target_s(p, CONVERGENCE)
    assert seconds == pytest.approx(2000 / p.samples_per_s) and not guessed
    assert cm.time_to_target_s(p, None) == (None, False)
    assert cm.time_to_target_s(predict("between_graph", "async", 4, ps=1), CONVERGENCE) == (None, False)


def test_a_faster_setup_that_does_not_reach_the_target_is_not_recommended():
    slow_ring = cm.TransportFigures("zmq", allreduce=cm.Link(5 * MS, 1e8), p2p=ZMQ.p2p, ps=ZMQ.ps)
    setups = cm.setups_for(4, ["zmq"], [1], strategies=["mirrored", "between_graph:async"])
    predictions = cm.predict_all(setups, WORK, {"zmq": slow_ring}, IDLE)
    fastest = max(predictions, key=lambda p: p.samples_per_s)
    assert fastest.setup.label == "between_graph:async"                # by samples/s alone it would win...
    best, why = cm.recommend(predictions, WORK, CONVERGENCE)
    assert best.setup.strategy == "mirrored"                           # ...but its staleness never gets there
    assert "loss 1 in" in why and "did not reach that loss in the convergence probe" in why
    reached = cm.Convergence(1.0, sync=((1, 1000), (4, 4000)), async_=((1, 1000), (4, 1500)))
    assert cm.recommend(predictions, WORK, reached)[0].setup.label == "between_graph:async"


def test_across_a_shaped_link_the_stream_is_paced_by_the_wire_less_the_token_bucket():
    from stratagem.advise import hosts
    from stratagem.launch.hosts import HostsSpec

    spec = HostsSpec.parse(2, link="100mbit")
    wire = 100e6 / 8 * 1448 / 1514              # payload bytes/s of the link
    burst = (96 << 10) * 1448 / 1514            # the bucket's 96 KiB of frames, in payload: 7.9 ms of wire

    sync = cm.Setup("between_graph", "sync", "zmq", 2, 1)
    link = hosts.shaped(ZMQ, sync, spec).exchange
    # 1 of the 2 workers is remote: its bytes, half of the round's, cross at the wire's rate (not
    # added to the 1 GB/s measured here: pipelined); pushes in, replies out, each after an idle gap,
    # starts with the bucket's bytes at the speed measured here (the round's 2 x burst of them)
    assert link.bandwidth_Bps == pytest.approx(wire / 0.5)
    credit = burst / wire - 2 * burst / 1e9
    assert link.credit_s == pytest.approx(credit)
    assert hosts.shaped(ZMQ, sync, spec, emulated=False).exchange.credit_s == 0   # a real link: no bucket
    fan_in = 2 * 200e-6 + 2 * (2 * 1e6 / (wire / 0.5) - credit)
    assert predict("between_graph", "sync", 2, ps=1, transport=hosts.shaped(ZMQ, sync, spec)).parts["ps fan-in"] \
        == pytest.approx(fan_in)

    ring = cm.Setup("mirrored", None, "zmq", 2)
    # one flow each way on each link; the bucket refills while the replicas compute (11 + 2 ms > 7.9)
    p = predict("mirrored", None, 2, transport=hosts.shaped(ZMQ, ring, spec))
    assert p.parts["all-reduce"] == pytest.approx(1e6 / wire - (burst / wire - burst / 1e9) + 2 * 100e-6)
    # a bucket that refilled for 2 ms gives the credit of what refilled: 2 ms of wire, less its bytes here
    shaped = hosts.shaped(ZMQ, ring, spec).allreduce
    assert cm.ring_allreduce_s(1e6, 2, shaped, idle_s=0.002) == pytest.approx(
        1e6 / wire - (0.002 - 0.002 * wire / 1e9) + 2 * 100e-6)


def test_a_sync_rounds_replies_to_other_hosts_take_turns_on_the_ps_link():
    """The ps sends a sync round's replies to the workers on other hosts one after another
    (ps_service/turns.py): a round is the first reply's share of the replies' time and then the
    pushes, ``x / m + x``, not ``2x`` (4 workers on 4 hosts, the ps beside one: 4T instead of 6T)."""
    from stratagem.advise import hosts
    from stratagem.launch.hosts import HostsSpec

    spec = HostsSpec.parse(4, link="100mbit")
    wire = 100e6 / 8 * 1448 / 1514
    sync = cm.Setup("between_graph", "sync", "zmq", 4, 1)
    link = hosts.shaped(ZMQ, sync, spec, emulated=False).exchange
    assert link.turns == 3 and link.bandwidth_Bps == pytest.approx(wire / 0.75)   # 3 of the 4 cross the link
    T = 1e6 / wire                                     # one worker's 1 MB on the wire
    fan_in = predict("between_graph", "sync", 4, ps=1, transport=hosts.shaped(ZMQ, sync, spec, emulated=False))
    assert fan_in.parts["ps fan-in"] == pytest.approx(2 * 200e-6 + 3 * T + T)     # 4T (the even share: 6T)
    assert cm.fan_in_s(1e6, 4, cm.Link(0.0, wire / 0.75)) == pytest.approx(6 * T)
    # what does not take turns: async pushes, one remote worker, replies under 64 KiB, a p2p fallback
    asynchronous = cm.Setup("between_graph", "async", "zmq", 4, 1)
    assert hosts.shaped(ZMQ, asynchronous, spec).exchange.turns == 0
    assert hosts.shaped(ZMQ, cm.Setup("between_graph", "sync", "zmq", 2, 1), HostsSpec.parse(2, link="1gbit")).ps.turns == 1
    assert cm.fan_in_s(1e6, 2, cm.Link(0.0, 1e9, turns=1)) == cm.fan_in_s(1e6, 2, cm.Link(0.0, 1e9))
    small = 32 << 10
    assert cm.fan_in_s(small, 4, cm.Link(0.0, 1e9, turns=3)) == cm.fan_in_s(small, 4, cm.Link(0.0, 1e9))
    assert cm.Link(0.0, 1e9, turns=3).scaled(2).turns == 3
