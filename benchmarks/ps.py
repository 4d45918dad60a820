#!/usr/bin/env python3
"""Parameter-server benchmark: push + pull throughput against a bare pyzmq request/reply, and MLP
training steps/s under each consistency mode.

    python benchmarks/ps.py                               # both parts (about 2 minutes on 2 cores)
    python benchmarks/ps.py --part throughput --ps 1 2 4 --params 10M --iters 10 --rounds 2
    python benchmarks/ps.py --part mlp --modes async sync bounded --json results-ps.json

**Throughput.** A model of ``--params`` float32 parameters (default 10M: a 5M, a 4M and a 1M weight
matrix plus biases, 40 MB) lives on 1, 2 and 4 ps tasks (``between_graph``, ``mode="async"``, greedy
placement; the two big matrices are partitioned over the shards). Each of 2 workers, started
together, runs ``--iters`` timed steps of ``opt.apply_gradients`` (plain SGD): one push of every
gradient, answered by every shard with its new values (``pull_with_push``), i.e. one round trip per
shard carrying the model's bytes each way, the shards served concurrently. The servers apply the SGD
update before answering.

The reference is the raw transport measured in the same run: the same processes (ps tasks and 2
clients), bare pyzmq (a ROUTER per server, a DEALER per client and server, zero-copy sends), each
client sending every server its share of the bytes and getting as many back, to all servers before
waiting for any reply, with nothing done on the data. Figures: aggregate GB/s over both workers
(bytes pushed + pulled, over the wall time from the first worker's first timed step to the last
worker's last), round trips/s (one per shard per step), and the ratio to the raw path (target >= 0.8).

**MLP.** The MLP 784-512-512-10 of ``mlp_training.py`` (670K parameters, numpy forward/backward,
batch 128 per worker, SGD) trained by 2 workers on 2 ps tasks under ``async``, ``sync`` and
``bounded`` (staleness 2), and under ``mirrored`` (2 workers, no ps) for reference: global updates/s
(the updates the ps applied, over the wall time) and steps/s per worker.

Each job runs in its own processes (``stratagem.core.launcher.launch`` for ours; the raw path's
processes are started and reaped here), one job after another; with ``--rounds R`` the jobs run R
times in alternating order and the best round is reported (the machine is shared: the best round is
the least disturbed one; every round is in the JSON). Every process uses one math thread. Tables go
to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
WORKERS = 2
TARGET = 0.8


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def model_shapes(params: int) -> list[tuple[str, tuple]]:
    """Weight matrices of 50 %, 40 % and 10 % of ``params`` (rows of 1000..2500) and small biases."""
    shapes = []
    for name, share, cols in (("w1", 0.5, 2500), ("w2", 0.4, 1600), ("w3", 0.1, 625)):
        rows = max(1, round(params * share / cols))
        shapes += [(name, (rows, cols)), (name.replace("w", "b"), (cols,))]
    return shapes


# -- children: our PS path --------------------------------------------------------------------------------

def child_throughput(spec: dict, out_dir: str) -> None:
    import stratagem

    strategy = stratagem.strategy("between_graph", transport="zmq", mode="async", placement="greedy",
                                  partition_bytes=spec["partition_bytes"], exit_after_serving=True,
                                  transport_options={"timeout": 120})
    with strategy.scope():
        variables = [stratagem.Variable(np.zeros(shape, np.float32), name=name) for name, shape in spec["shapes"]]
        opt = stratagem.optimizers.SGD(learning_rate=1e-3)
    grads = [(np.full(v.shape, 1e-3, np.float32), v) for v in variables]
    comm = strategy._comm()
    for _ in range(spec["warmup"]):
        opt.apply_gradients(grads)
    comm.barrier()
    times, start = [], time.time()
    for _ in range(spec["iters"]):
        began = time.perf_counter()
        opt.apply_gradients(grads)
        times.append(time.perf_counter() - began)
    end = time.time()
    nbytes = sum(v.size * 4 for v in variables)
    with open(os.path.join(out_dir, f"{strategy.task.short}.json"), "w") as f:
        json.dump({"start": start, "end": end, "times": times, "bytes_each_way": nbytes,
                   "shards": len(strategy.cluster.tasks("ps")), "acks": {str(k): v for k, v in strategy.acks.items()}}, f)
    comm.barrier()
    strategy.shutdown()


def child_mlp(spec: dict, out_dir: str) -> None:
    import stratagem
    from _mlp_training_worker import NumpyMLP, initial_params, synthetic_batch

    name, options = spec["strategy"], dict(spec["options"])
    strategy = stratagem.strategy(name, transport="zmq", transport_options={"timeout": 120}, **options)
    with strategy.scope():
        variables = [stratagem.Variable(value, name=n) for n, value in initial_params(spec["sizes"])]
        opt = stratagem.optimizers.SGD(learning_rate=0.01)
    rank = strategy.cluster.replicas().index(strategy.task)
    x, y = synthetic_batch(spec["sizes"], spec["batch"], rank)
    mlp = NumpyMLP(variables, x, y)
    comm = strategy._comm()
    for _ in range(spec["warmup"]):
        opt.apply_gradients(mlp.grads())
    comm.barrier()
    first = getattr(strategy, "global_step", 0)
    start = time.time()
    for _ in range(spec["steps"]):
        opt.apply_gradients(mlp.grads())
    end = time.time()
    record = {"start": start, "end": end, "steps": spec["steps"]}
    if name != "mirrored":
        record["updates"] = strategy.refresh() - first
        record["statuses"] = strategy.acks
    with open(os.path.join(out_dir, f"{strategy.task.short}.json"), "w") as f:
        json.dump(record, f, default=str)
    comm.barrier()
    strategy.shutdown()


# -- children: the raw pyzmq path --------------------------------------------------------------------------

def child_raw_server(port: int, sizes: list[int], expected: int, client_ports: list[int]) -> None:
    """A bare ROUTER server: answers each request with as many bytes, in frames of ``sizes``. With
    ``client_ports`` (the *duplex* variant) the reply goes back over a connection of its own to the
    client's ROUTER, as stratagem's transport does; otherwise over the request's connection."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    back = {}
    for index, client_port in enumerate(client_ports):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{client_port}")
        back[f"c{index}".encode()] = dealer
    reply = [np.ones(n, np.uint8) for n in sizes]
    for _ in range(expected):
        ident, *_payload = sock.recv_multipart(copy=False)
        if back:
            back[ident.bytes].send_multipart(reply, copy=False)
        else:
            sock.send_multipart([ident, *reply], copy=False)
    time.sleep(0.5)
    ctx.destroy(linger=0)


def child_raw_client(spec: dict, out: str, index: int) -> None:
    import zmq

    ctx = zmq.Context()
    socks = []
    for port in spec["server_ports"]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"c{index}".encode())
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    inbox = None
    if spec["client_ports"][index]:
        inbox = ctx.socket(zmq.ROUTER)
        inbox.bind(f"tcp://127.0.0.1:{spec['client_ports'][index]}")
    payloads = [[np.ones(n, np.uint8) for n in sizes] for sizes in spec["frames"]]

    def round_trip():
        trackers = [sock.send_multipart(payload, copy=False, track=True) for sock, payload in zip(socks, payloads)]
        for sock in socks:
            if inbox is None:
                sock.recv_multipart(copy=False)
            else:
                inbox.recv_multipart(copy=False)
        for tracker in trackers:
            tracker.wait()

    for _ in range(spec["warmup"]):
        round_trip()
    time.sleep(max(0.0, spec["start_at"] - time.time()))
    times, start = [], time.time()
    for _ in range(spec["iters"]):
        began = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - began)
    end = time.time()
    with open(out, "w") as f:
        json.dump({"start": start, "end": end, "times": times, "shards": len(socks),
                   "bytes_each_way": sum(sum(sizes) for sizes in spec["frames"])}, f)
    ctx.destroy(linger=0)


def frames_per_server(shapes: list, ps: int, partition_bytes: int) -> list[list[int]]:
    """The byte sizes of the pieces each ps task holds, as the PS path places them (greedy,
    partitioned): the raw path sends the very same frames."""
    from stratagem.core.placement import Placer

    placer = Placer(ps, "greedy", partition_bytes)
    frames: list[list[int]] = [[] for _ in range(ps)]
    for name, shape in shapes:
        for piece in placer.place(name, shape, "float32"):
            frames[piece.ps].append(piece.nbytes)
    return frames


# -- the parent -----------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def launch_job(mode: str, spec: dict, ps: int, workers: int, timeout: float) -> list[dict]:
    """Run a child job under stratagem's launcher; return the workers' records."""
    from stratagem.core.launcher import launch

    with tempfile.TemporaryDirectory() as out:
        spec_path = os.path.join(out, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        errors = io.StringIO()
        result = launch([sys.executable, os.path.abspath(__file__), "--child", mode, spec_path, out],
                        workers=workers, ps=ps, timeout=timeout, output=sys.stderr, error_output=errors,
                        env=THREADS)
        if not result.ok:
            raise RuntimeError(f"{mode} job failed: {result.reason}\n{errors.getvalue()[-3000:]}")
        return [json.load(open(os.path.join(out, f"worker:{i}.json"))) for i in range(workers)]


def raw_job(frames: list[list[int]], warmup: int, iters: int, timeout: float, duplex: bool) -> list[dict]:
    """The bare pyzmq path: a server per entry of ``frames`` and 2 clients, each client sending every
    server its frames and getting the same back."""
    from stratagem.testing.world import free_ports

    ps = len(frames)
    ports = free_ports(ps + WORKERS)
    env = {**os.environ, **THREADS}
    me = os.path.abspath(__file__)
    procs = []
    with tempfile.TemporaryDirectory() as out:
        spec = {"server_ports": ports[:ps], "client_ports": ports[ps:] if duplex else [0] * WORKERS,
                "frames": frames, "warmup": warmup, "iters": iters, "start_at": time.time() + 2.0}
        spec_path = os.path.join(out, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        try:
            paths = [os.path.join(out, f"client{i}.json") for i in range(WORKERS)]
            for i, path in enumerate(paths):
                procs.append(subprocess.Popen([sys.executable, me, "--child", "raw-client", spec_path, path, str(i)],
                                              env=env, start_new_session=True, preexec_fn=_die_with_parent))
            for port, sizes in zip(spec["server_ports"], frames):
                procs.append(subprocess.Popen(
                    [sys.executable, me, "--child", "raw-server", str(port), ",".join(map(str, sizes)),
                     str(WORKERS * (warmup + iters)), ",".join(map(str, spec["client_ports"])) if duplex else ""],
                    env=env, start_new_session=True, preexec_fn=_die_with_parent))
            deadline = time.monotonic() + timeout
            for proc in procs:
                proc.wait(max(1.0, deadline - time.monotonic()))
            if any(p.returncode for p in procs):
                raise RuntimeError(f"raw job failed: exit codes {[p.returncode for p in procs]}")
            return [json.load(open(path)) for path in paths]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def aggregate(records: list[dict]) -> dict:
    """Aggregate figures over the workers: wall time from the first start to the last end."""
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    steps = sum(len(r["times"]) for r in records)
    moved = sum(2 * r["bytes_each_way"] * len(r["times"]) for r in records)
    trips = sum(r["shards"] * len(r["times"]) for r in records)
    return {"wall_s": wall, "gbps": moved / wall / 1e9, "round_trips_per_s": trips / wall,
            "steps_per_s": steps / wall, "median_step_ms": 1e3 * float(np.median([t for r in records for t in r["times"]]))}


PARTITION_BYTES = 4 << 20
KINDS = ("ps", "raw", "raw-duplex")


def run_throughput(args) -> dict:
    shapes = model_shapes(args.params)
    total = sum(int(np.prod(s)) for _, s in shapes)
    rounds: list[dict] = []
    for round_index in range(args.rounds):
        order = args.ps if round_index % 2 == 0 else list(reversed(args.ps))
        for ps in order:
            for kind in (KINDS if round_index % 2 == 0 else tuple(reversed(KINDS))):
                log(f"[round {round_index + 1}] throughput {kind} with {ps} ps task(s), {WORKERS} workers, "
                    f"{total / 1e6:.1f}M parameters")
                if kind == "ps":
                    spec = {"shapes": shapes, "partition_bytes": PARTITION_BYTES, "warmup": args.warmup,
                            "iters": args.iters}
                    records = launch_job("throughput", spec, ps, WORKERS, args.timeout)
                else:
                    records = raw_job(frames_per_server(shapes, ps, PARTITION_BYTES), args.warmup, args.iters,
                                      args.timeout, duplex=kind == "raw-duplex")
                rounds.append({"round": round_index, "kind": kind, "ps": ps, **aggregate(records), "records": records})
    best = {}
    for entry in rounds:
        key = (entry["kind"], entry["ps"])
        if key not in best or entry["gbps"] > best[key]["gbps"]:
            best[key] = entry
    rows = []
    for ps in args.ps:
        ours = best[("ps", ps)]
        raw = max((best[(k, ps)] for k in KINDS[1:]), key=lambda e: e["gbps"])
        rows.append({"ps": ps, "ours_gbps": ours["gbps"], "raw_gbps": raw["gbps"], "raw_kind": raw["kind"],
                     "reqrep_gbps": best[("raw", ps)]["gbps"], "duplex_gbps": best[("raw-duplex", ps)]["gbps"],
                     "ours_rt_s": ours["round_trips_per_s"], "raw_rt_s": raw["round_trips_per_s"],
                     "ours_step_ms": ours["median_step_ms"], "raw_step_ms": raw["median_step_ms"],
                     "ratio": ours["gbps"] / raw["gbps"]})
    print(f"\nPush + pull of a {total / 1e6:.1f}M-parameter float32 model ({total * 4 / 1e6:.0f} MB each way per "
          f"step), {WORKERS} workers, best of {args.rounds} round(s); raw = the faster of bare pyzmq request/reply "
          f"on one connection and on two (one per direction, as stratagem's transport)\n")
    print("| ps tasks | ours GB/s | raw GB/s (req/rep, duplex) | ours / raw | ours round trips/s | raw round trips/s "
          "| ours median step | raw median step |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        verdict = "" if r["ratio"] >= TARGET else " (below 0.8)"
        print(f"| {r['ps']} | {r['ours_gbps']:.2f} | {r['raw_gbps']:.2f} ({r['reqrep_gbps']:.2f}, {r['duplex_gbps']:.2f}) "
              f"| {r['ratio']:.2f}{verdict} | {r['ours_rt_s']:.1f} | {r['raw_rt_s']:.1f} | {r['ours_step_ms']:.0f} ms "
              f"| {r['raw_step_ms']:.0f} ms |")
    return {"params": total, "rows": rows, "rounds": rounds}


def run_mlp(args) -> dict:
    sizes = [784, 512, 512, 10]
    jobs = [("async", {"mode": "async"}), ("sync", {"mode": "sync"}),
            ("bounded", {"mode": "bounded", "staleness": 2})]
    jobs = [job for job in jobs if job[0] in args.modes]
    if "mirrored" in args.modes:
        jobs.append(("mirrored", {}))
    rounds = []
    for round_index in range(args.rounds):
        for label, options in (jobs if round_index % 2 == 0 else list(reversed(jobs))):
            log(f"[round {round_index + 1}] MLP under {label}")
            strategy = "mirrored" if label == "mirrored" else "between_graph"
            spec = {"strategy": strategy, "options": options, "sizes": sizes, "batch": 128,
                    "warmup": 5, "steps": args.mlp_steps}
            records = launch_job("mlp", spec, 0 if strategy == "mirrored" else 2, WORKERS, args.timeout)
            wall = max(r["end"] for r in records) - min(r["start"] for r in records)
            updates = records[0].get("updates", records[0]["steps"])
            rounds.append({"round": round_index, "label": label, "wall_s": wall, "updates_per_s": updates / wall,
                           "worker_steps_per_s": sum(r["steps"] for r in records) / wall / WORKERS,
                           "records": records})
    best = {}
    for entry in rounds:
        if entry["label"] not in best or entry["updates_per_s"] > best[entry["label"]]["updates_per_s"]:
            best[entry["label"]] = entry
    print(f"\nMLP 784-512-512-10 (670K parameters), batch 128 per worker, {WORKERS} workers, 2 ps tasks "
          f"(mirrored: none), best of {args.rounds} round(s)\n")
    print("| mode | global updates/s | steps/s per worker |")
    print("| --- | ---: | ---: |")
    for label, _ in jobs:
        entry = best[label]
        print(f"| {label} | {entry['updates_per_s']:.1f} | {entry['worker_steps_per_s']:.1f} |")
    return {"rows": [{"mode": k, "updates_per_s": v["updates_per_s"], "worker_steps_per_s": v["worker_steps_per_s"]}
                     for k, v in best.items()], "rounds": rounds}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "throughput", "mlp"), default="all")
    parser.add_argument("--ps", type=int, nargs="+", default=[1, 2, 4], help="ps task counts (default 1 2 4)")
    parser.add_argument("--params", type=parse_count, default=parse_count("10M"), help="model size (default 10M)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per worker (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["async", "sync", "bounded", "mirrored"])
    parser.add_argument("--mlp-steps", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        kind, rest = argv[1], argv[2:]
        if kind == "throughput":
            child_throughput(json.load(open(rest[0])), rest[1])
        elif kind == "mlp":
            child_mlp(json.load(open(rest[0])), rest[1])
        elif kind == "raw-server":
            child_raw_server(int(rest[0]), [int(n) for n in rest[1].split(",")], int(rest[2]),
                             [int(p) for p in rest[3].split(",") if p])
        elif kind == "raw-client":
            child_raw_client(json.load(open(rest[0])), rest[1], int(rest[2]))
        return 0
    args = parse_args(argv)
    results = {"argv": argv, "loadavg_before": os.getloadavg(), "cpus": os.cpu_count()}
    if args.part in ("all", "throughput"):
        results["throughput"] = run_throughput(args)
    if args.part in ("all", "mlp"):
        results["mlp"] = run_mlp(args)
    results["loadavg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
