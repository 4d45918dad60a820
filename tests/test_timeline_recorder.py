"""How the timeline recorder reaches the parts that record (stratagem.core.timeline): handed to the
transport (``recorder=``, which the factory fills in from STRATAGEM_TIMELINE), read from it by the
mailbox, the communicator and the strategy; off, ``timeline.OFF``, whose methods do nothing.

The multi-task test runs real zmq transports on loopback ports chosen at run time, one thread per
task, each with a timeout; the transports are closed however the test ends.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from stratagem.collectives.communicator import Communicator
from stratagem.core import timeline
from stratagem.core.errors import ConfigurationError
from stratagem.plugins.manager import plugin_manager
from stratagem.testing.world import local_cluster, run_ranks, transport_world

pytestmark = pytest.mark.timeout(60)


def test_each_transport_records_into_the_recorder_it_was_handed(tmp_path):
    # Two tasks in one process, each with its own recorder: each file holds its own task's
    # collectives and its waits on the other, and nothing of the other's (a process-wide recorder
    # could not tell them apart).
    recorders = [timeline.Recorder(str(tmp_path / "{task}.json")) for _ in range(2)]
    cluster = local_cluster(2)
    manager = plugin_manager()
    transports = []
    try:
        for task, recorder in zip(cluster.tasks(), recorders):
            transports.append(manager.create_transport("zmq", cluster, task, recorder=recorder, timeout=20))
        for transport in transports:
            transport.start()
        assert [t.recorder for t in transports] == recorders

        def body(rank, transport):
            comm = Communicator(transport, timeout=20)
            out = [comm.allreduce(np.full(1024, rank + 1, np.float32)) for _ in range(3)]
            comm.barrier()
            return float(out[-1][0])

        assert run_ranks(transports, body, timeout=40) == [3.0, 3.0]
    finally:
        for transport in transports:
            transport.close()
    for rank, recorder in enumerate(recorders):
        me, peer = str(cluster.tasks()[rank]), str(cluster.tasks()[1 - rank])
        doc = json.load(open(recorder.flush()))
        assert doc["otherData"]["stratagem_timeline"]["task"] == me
        events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        collectives = [e for e in events if e["cat"] == "collective"]
        assert [e["name"] for e in collectives] == ["allreduce"] * 3 + ["barrier"], collectives
        assert all(e["args"]["peers"] == [peer] for e in collectives)
        assert collectives[0]["args"]["bytes"] == 4096
        assert {e["args"]["peer"] for e in events if e["cat"] == "wait"} <= {peer}


def test_without_a_timeline_everything_holds_the_recorder_that_does_nothing(monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    with transport_world("local", 2) as world:
        assert all(t.recorder is timeline.OFF for t in world)

        def body(rank, transport):
            comm = Communicator(transport, timeout=20)
            return float(comm.allreduce(np.ones(4))[0])

        assert run_ranks(world, body, timeout=30) == [2.0, 2.0]


def test_the_no_op_recorder_takes_every_call_the_recorder_takes():
    # The hot paths call whichever they hold without checking: the signatures must match.
    for name, method in inspect.getmembers(timeline.Recorder, inspect.isfunction):
        if name.startswith("_") or name in ("document", "flush", "clock_now", "end_with_script"):
            continue   # writing the file: the library calls these on a Recorder only (at exit: the process's)
        null = getattr(timeline.NullRecorder, name, None)
        assert null is not None, f"NullRecorder lacks {name}()"
        assert inspect.signature(null) == inspect.signature(method), name
    assert timeline.OFF.span("step", "step").__enter__() is None
    called = []
    timeline.OFF.record("pack", "pack", timeline.OFF.now(), lambda: called.append(1))
    assert not called   # the description is not worked out when nothing records


def test_a_recorder_that_is_not_one_is_refused_naming_what_to_pass():
    with pytest.raises(ConfigurationError, match=r"recorder must be a stratagem\.core\.timeline\.Recorder "
                                                 r"\(or timeline\.OFF\), not str"):
        plugin_manager().create_transport("zmq", local_cluster(1), "worker:0", recorder="trace.json")
