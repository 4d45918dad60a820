"""One task of ``stratagem advise``'s measurements (started by :mod:`stratagem.advise.probe`; not run by hand).

    python -m stratagem.advise.probe_task SPEC

``SPEC`` is a JSON file naming the job's ``mode``, the model, and ``out`` (the JSON the first task
writes). Every task of the job runs this module; the world comes from the environment, as for any
script (``stratagem launch``, ``mpiexec``, ``TF_CONFIG``...), so the same module measures a local
cluster or one that spans hosts.

``mode: "machine"`` -- what one task costs, on one host:

- the model's parts on one task while the others wait: drawing a batch (``batch``), forward and
  backward (``loss_and_grads``), the ps's update (the optimizer's ``update_array`` over every
  parameter, as a ps applies a push) and a weighted gradient add (what a sync round and the in_graph
  client do per replica), each the fastest and the median of several calls;
- CPU sharing: for each ``k`` in ``ks``, the first ``k`` tasks run ``loss_and_grads`` over and over
  for ``duration`` seconds from the same barrier, the others wait; each reports its median and
  fastest wall time and its median CPU time per call (their ratio: how slow the sharing made it).
  ``k`` above the core count shows how the tasks share the cores (and how busy the machine already is).
  Then the same in *lockstep*: the ``k`` tasks meet at a barrier after every call, as synchronous
  replicas meet at every step, so each step waits for the slowest (the straggler's cost).

``mode: "link"`` -- what moving bytes costs on one transport:

- all-reduce of each size over the whole world: :func:`stratagem.bench.collectives_task.measure`,
  the loop ``stratagem bench collectives`` runs, on its :class:`~stratagem.bench.collectives_task.StratagemBackend`;
- round trips for each pair of worker tasks: one task sends ``size`` bytes, the other answers with
  ``size`` bytes, with the transport's ``send`` and ``recv``; the other tasks wait;
- a parameter server's exchange, when the job has a ``ps`` task: it serves a real
  :class:`~stratagem.ps_service.server.ParameterServer` holding one float32 piece per size, and the first
  task pushes a gradient of each piece and gets its new values back (``pull``, as the strategies do:
  the server applies SGD and streams the values back), through :class:`~stratagem.ps_service.client.PSClient`;
- how much CPU a task burns while it waits: the first task waits in an all-reduce (then in a
  ``recv``) while the others compute for ``idle_probe`` seconds (an MPI that spins burns a core).

Beside each time, the CPU it cost (``time.process_time``: every thread of the task): per all-reduce
call on each task, per round trip on the side that starts it, per exchange on the worker, and per
push on the ps (written by the ps task to ``ps_cpu.json`` beside ``out``). Moving bytes costs wall
time and CPU time, and only the CPU part slows down when tasks share cores.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import numpy as np

#: The tag of the ping-pong messages (no strategy uses it).
PING_TAG = "advise-pingpong"


def _call_times(fn, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (this thread's: the math runs in it, one thread) of ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(max(1, repeats)):
        start, used = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - used)
        wall.append(time.perf_counter() - start)
    return wall, cpu


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)   # the parent never reads half a file


# -- machine ----------------------------------------------------------------------------------------

def model_parts(model, seed: int, repeats: int) -> dict:
    """The median and fastest wall seconds, and the median CPU seconds, of one batch, one
    ``loss_and_grads``, one ps update and one weighted add over all parameters, on this task alone.
    The CPU time is the work's idle-core cost, whatever else the machine runs (the wall time also
    counts the time others held the core)."""
    from stratagem.training.optimizers.rules import SGD

    params = model.init_params(seed)
    batch = model.batch(seed, 0, 0, model.batch_size)
    loss, grads = model.loss_and_grads(params, batch)      # warm: first calls allocate
    draws = iter(range(1, 1 << 30))

    names = sorted(params)
    values = {n: np.array(params[n], dtype=np.float32) for n in names}
    dense = {n: np.asarray(grads[n], dtype=np.float32) if np.shape(grads[n]) == values[n].shape
             else np.zeros_like(values[n]) for n in names}
    optimizer = SGD(learning_rate=float(model.learning_rate))
    optimizer.iterations = 1

    def update():
        for n in names:
            optimizer.update_array(n, values[n], dense[n])

    sums = {n: np.zeros_like(values[n]) for n in names}
    weight = np.float32(0.5)

    def add():   # as a sync round adds a push: total += grad * weight
        for n in names:
            sums[n] += np.multiply(dense[n], weight, dtype=np.float32)

    update()
    add()
    figures = {"loss": float(loss), "param_bytes": int(sum(v.nbytes for v in values.values()))}
    for name, fn, n in (("data", lambda: model.batch(seed, 0, next(draws), model.batch_size), repeats),
                        ("compute", lambda: model.loss_and_grads(params, batch), repeats * 2),
                        ("update", update, repeats * 2), ("add", add, repeats * 2)):
        wall, cpu = _call_times(fn, n)
        figures[f"{name}_s"], figures[f"{name}_fastest_s"] = statistics.median(wall), min(wall)
        figures[f"{name}_cpu_s"] = statistics.median(cpu)
    return figures


def sharing_round(comm, model, params, batch, k: int, duration: float, group=None) -> list[list[float]]:
    """The first ``k`` tasks call ``loss_and_grads`` for ``duration`` seconds at once (with ``group``,
    a communicator of those ``k``, they meet at its barrier after every call: lockstep); every task
    returns ``[median wall, fastest wall, median CPU]`` seconds per call of each active task (the same
    list everywhere)."""
    comm.barrier()
    mine = [float("nan")] * 3
    if comm.rank < k:
        times, cpu = [], []
        end = time.perf_counter() + duration
        while True:
            start, used = time.perf_counter(), time.thread_time()
            model.loss_and_grads(params, batch)
            cpu.append(time.thread_time() - used)
            finished = time.perf_counter() >= end and len(times) >= 2
            if group is not None:
                # the group's all-reduce is the barrier, and agrees on when to stop (same call count)
                finished = group.allreduce(np.array([float(finished)]), op="min")[0] == 1.0
            times.append(time.perf_counter() - start)
            if finished:
                break
        mine = [statistics.median(times[1:]), min(times[1:]), statistics.median(cpu[1:])]
    gathered = np.asarray(comm.allgather(np.array(mine, np.float64))).reshape(-1, 3)
    return [[float(x) for x in row] for row in gathered[:k]]


def run_machine(comm, spec: dict) -> dict | None:
    from stratagem.bench.models import build_model

    model = build_model(spec["model"])
    seed = int(spec.get("seed", 0))
    parts = None
    comm.barrier()
    if comm.rank == 0:
        parts = model_parts(model, seed, int(spec.get("repeats", 7)))
    comm.barrier()
    params = model.init_params(seed)
    batch = model.batch(seed, comm.rank, 0, model.batch_size)
    model.loss_and_grads(params, batch)
    from stratagem.collectives.communicator import Communicator

    sharing, lockstep = [], []
    ks = [k for k in spec["ks"] if 1 <= k <= comm.size]
    groups = {k: Communicator(comm.transport, comm.members[:k], name=f"advise-lockstep-{k}")
              for k in ks if k >= 2 and comm.rank < k}
    duration = float(spec.get("duration", 0.3))
    for round_ in range(int(spec.get("rounds", 1))):
        # alternate the order, so a change of the machine's load does not always hit the same k
        for k in (ks if round_ % 2 == 0 else ks[::-1]):
            rows = sharing_round(comm, model, params, batch, k, duration)
            sharing.append({"k": k, "seconds": [r[0] for r in rows], "fastest": [r[1] for r in rows],
                            "cpu": [r[2] for r in rows]})
            if k >= 2:
                rows = sharing_round(comm, model, params, batch, k, duration, groups.get(k))
                lockstep.append({"k": k, "seconds": [r[0] for r in rows], "fastest": [r[1] for r in rows],
                                 "cpu": [r[2] for r in rows]})
    for group in groups.values():
        group.close()
    if comm.rank != 0:
        return None
    return {"mode": "machine", "tasks": comm.size, "cores": len(os.sched_getaffinity(0)),
            "hostname": socket.gethostname(), "parts": parts, "sharing": sharing, "lockstep": lockstep,
            "loadavg": list(os.getloadavg())}


# -- link -------------------------------------------------------------------------------------------

def pingpong(comm, peer: int, sizes: list[dict], initiator: bool) -> list[dict]:
    """Round trips with ``peer``: send ``bytes``, get ``bytes`` back (the answering side echoes)."""
    from stratagem.core.transport import Message

    transport, other = comm.transport, comm.members[peer]
    results = []
    for entry in sizes:
        count = max(1, int(entry["bytes"]) // 4)
        buffer = np.ones(count, np.float32)
        times = []
        cpu = 0.0
        for i in range(int(entry["warmup"]) + int(entry["iters"])):
            if initiator:
                start, used = time.perf_counter(), time.process_time()
                transport.send(other, PING_TAG, Message({"i": i}, [buffer]))
                transport.recv(other, PING_TAG)
                if i >= int(entry["warmup"]):
                    times.append(time.perf_counter() - start)
                    cpu += time.process_time() - used
            else:
                transport.recv(other, PING_TAG)
                transport.send(other, PING_TAG, Message({"i": i}, [buffer]))
        results.append({"bytes": count * 4, "times_s": times, "cpu_s": cpu / max(1, len(times))})
    return results


def idle_burn(comm, seconds: float) -> dict:
    """CPU seconds per wall second the first task burns while it waits for the others, who compute
    ``seconds``: in an all-reduce, then in a ``recv``."""
    from stratagem.core.transport import Message

    burn = {}
    for how in ("collective", "recv"):
        comm.barrier()
        if comm.rank == 0:
            cpu, wall = time.process_time(), time.perf_counter()
            if how == "collective":
                comm.allreduce(np.zeros(1, np.float32))
            else:
                for peer in range(1, comm.size):
                    comm.transport.recv(comm.members[peer], PING_TAG)
            burn[how] = (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall)
        else:
            end = time.perf_counter() + seconds
            x = np.ones(1 << 16, np.float32)
            while time.perf_counter() < end:
                x *= np.float32(1.0000001)        # busy, in numpy, as a computing replica is
            if how == "collective":
                comm.allreduce(np.zeros(1, np.float32))
            else:
                comm.transport.send(comm.members[0], PING_TAG, Message({}, []))
    return burn


def pairs_of(size: int, all_pairs_up_to: int = 8) -> list[tuple[int, int]]:
    """Which pairs exchange: every pair in a small world, else the first task with each other
    (a ps's view of its workers).

    >>> pairs_of(3), pairs_of(10)[:2], len(pairs_of(10))
    ([(0, 1), (0, 2), (1, 2)], [(0, 1), (0, 2)], 9)
    """
    if size <= all_pairs_up_to:
        return [(i, j) for i in range(size) for j in range(i + 1, size)]
    return [(0, j) for j in range(1, size)]


def serve_ps(spec: dict, out_dir: str) -> None:
    """A ``ps`` task of the link job: serve a real parameter server until the workers say goodbye,
    then write the CPU seconds (this process's, every thread) each push of each piece cost it to
    ``OUT_DIR/ps_cpu.json``, which the parent reads when the job ran on its host."""
    import stratagem
    from stratagem.ps_service.server import ParameterServer

    class TimedServer(ParameterServer):
        def handle(self, message):
            used = time.process_time()
            super().handle(message)
            meta = message.meta or {}
            if meta.get("op") == "push" and meta.get("names"):
                cpu.setdefault(meta["names"][0], []).append(time.process_time() - used)

    cpu: dict[str, list] = {}
    transport = stratagem.transport(spec["transport"], timeout=spec.get("timeout", 60))
    transport.start()
    try:
        TimedServer(transport, poll=0.05).serve()
    finally:
        transport.close()
    _write(os.path.join(out_dir, "ps_cpu.json"), cpu)


def ps_exchange(comm, sizes: list[dict], learning_rate: float) -> list[dict]:
    """The first task's push-and-pull round trips with the ps task, one piece of each size."""
    from stratagem.ps_service.client import PSClient
    from stratagem.ps_service.messages import PushRequest
    from stratagem.ps_service.protocol import task_key

    client = PSClient(comm.transport)
    names = [f"piece{i}" for i in range(len(sizes))]
    counts = [max(1, int(e["bytes"]) // 4) for e in sizes]
    specs = [{"name": n, "var": n, "shape": [c], "dtype": "float32", "part": 0, "parts": 1, "lo": 0, "hi": c}
             for n, c in zip(names, counts)]
    client.init({0: specs}, {0: [np.zeros(c, np.float32) for c in counts]},
                {"mode": "async", "pushers": [task_key(comm.task)]})
    client.set_optimizer({"name": "SGD", "learning_rate": float(learning_rate)})
    results = []
    for name, count, entry in zip(names, counts, sizes):
        grad = np.full(count, 1e-3, np.float32)
        others = [n for n in names if n != name]
        times = []
        cpu = 0.0
        for i in range(int(entry["warmup"]) + int(entry["iters"])):
            start, used = time.perf_counter(), time.process_time()
            request = PushRequest(pull=True, skip=others)
            request.add(name, grad)
            client.push_all({0: request})
            if i >= int(entry["warmup"]):
                times.append(time.perf_counter() - start)
                cpu += time.process_time() - used
        results.append({"bytes": count * 4, "times_s": times, "cpu_s": cpu / max(1, len(times))})
    return results


def run_link(spec: dict, out_dir: str) -> dict | None:
    from stratagem.bench import collectives_task
    from stratagem.core.cluster import ClusterResolver
    from stratagem.ps_service.client import PSClient

    if ClusterResolver.from_env().task.job == "ps":
        serve_ps(spec, out_dir)
        return None
    backend = collectives_task.StratagemBackend({"stratagem": {"transport": spec["transport"]},
                                                 "timeout": spec.get("timeout", 60)})
    comm = backend.comm
    has_ps = "ps" in comm.transport.cluster.jobs
    clean = False
    try:
        allreduce, allreduce_path = [], os.path.join(out_dir, "allreduce.json")
        for entry in spec["sizes"]:     # one size at a time: the CPU it cost this task, per call
            used = time.process_time()
            collectives_task.measure(backend, {"label": spec["transport"], "collective": "allreduce",
                                               "sizes": [entry]}, allreduce_path)
            calls = int(entry["warmup"]) + int(entry["iters"])
            allreduce.append({"cpu_s": (time.process_time() - used) / max(1, calls)})
            if comm.rank == 0:
                with open(allreduce_path) as f:
                    allreduce[-1].update(json.load(f)["sizes"][0])
        pairs = []
        width = sum(int(e["iters"]) for e in spec["sizes"])
        for i, j in pairs_of(comm.size):
            comm.barrier()
            result = None
            if comm.rank in (i, j):
                result = pingpong(comm, j if comm.rank == i else i, spec["sizes"], initiator=comm.rank == i)
            sizes = _gather_times(comm, i, result, spec["sizes"], width)
            cpus = np.asarray(comm.allgather(np.array([e["cpu_s"] for e in result] if comm.rank == i
                                                      else [np.nan] * len(spec["sizes"])))).reshape(comm.size, -1)
            for entry, cpu in zip(sizes, cpus[i]):
                entry["cpu_s"] = float(cpu)
            pairs.append({"a": str(comm.members[i]), "b": str(comm.members[j]), "sizes": sizes})
        exchange = None
        if has_ps:
            comm.barrier()
            result = ps_exchange(comm, spec["sizes"], spec.get("learning_rate", 0.01)) if comm.rank == 0 else None
            exchange = _gather_times(comm, 0, result, spec["sizes"], width)
            if comm.rank == 0:
                for entry, timed in zip(exchange, result):
                    entry["cpu_s"] = timed["cpu_s"]
        burn = idle_burn(comm, float(spec.get("idle_probe", 0.25)))
        clean = True
    finally:
        if has_ps:
            PSClient(comm.transport).bye()     # the ps task stops serving once every worker has left
        backend.close(clean)
    if comm.rank != 0:
        return None
    return {"mode": "link", "transport": spec["transport"], "np": comm.size, "allreduce": allreduce,
            "pairs": pairs, "ps_exchange": exchange, "idle_burn": burn, "hostname": socket.gethostname(),
            "loadavg": list(os.getloadavg())}


def _gather_times(comm, source: int, result: list[dict] | None, sizes: list[dict], width: int) -> list[dict]:
    """Task ``source``'s per-size times on every task (an all-gather of fixed-size rows)."""
    row = np.full(width, np.nan)
    if comm.rank == source:
        row[:] = [t for entry in result for t in entry["times_s"]]
    rows = np.asarray(comm.allgather(row)).reshape(comm.size, width)
    times, offset = [], 0
    for entry in sizes:
        n = int(entry["iters"])
        times.append({"bytes": max(1, int(entry["bytes"]) // 4) * 4,
                      "times_s": [float(t) for t in rows[source, offset:offset + n]]})
        offset += n
    return times


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m stratagem.advise.probe_task SPEC (started by `stratagem advise`)", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    out_dir = os.path.dirname(os.path.abspath(spec["out"]))
    if spec["mode"] == "machine":
        import stratagem

        comm = stratagem.communicator(transport=spec.get("transport", "zmq"), timeout=spec.get("timeout", 60))
        clean = False
        try:
            result = run_machine(comm, spec)
            comm.barrier()
            clean = True
        finally:
            if clean:
                comm.close()
    else:
        result = run_link(spec, out_dir)
    if result is not None:
        _write(spec["out"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
